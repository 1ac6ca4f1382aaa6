// BK-Core in plain CUDA C++: G_i = [(T - zI)^-1]_ii for a batch of tridiagonal T, and its exact
// gradient. No torch headers: CI checks it with `nvcc -arch=sm_90 -c hwlib/kernels/bk_core.cu`; its
// C ABI is declared once, in bk_core.h (included below, so the compiler holds the definitions to
// it); the torch binding lives in hwlib/ops/bk_cuda.py and hwlib/ops/build.py loads both with
// load_inline.
//
// Math (derivation in hwlib/ops/bk_reference.py), d_i = a_i - z, k_j = b_j c_j:
//   sL_0 = 0,  sL_{i+1} = k_i / (d_i - sL_i)                 (sL_i = k_{i-1} gL_{i-1})
//   gR_N = 0,  gR_i = 1 / (d_i - k_i gR_{i+1})
//   G_i  = 1 / (d_i - sL_i - k_i gR_{i+1})
// Backward, forward-mode tangent with v = conj(grad), gL_i = 1 / (d_i - sL_i):
//   tL_0 = 0,  tL_{i+1} = k_i gL_i^2 (v_i + tL_i);   gR'_N = 0,  gR'_i = gR_i^2 (v_i + k_i gR'_{i+1})
//   G_i' = G_i^2 (v_i + tL_i + k_i gR'_{i+1});  da_i = -Re G_i'
//   P_i = G_i' gR_{i+1} + G_i gR'_{i+1};  db_i = c_i Re P_i;  dc_i = b_i Re P_i
//
// Chunk-parallel form. Each step of a sweep is a Moebius map, a 2x2 complex matrix acting on (x, 1):
//   left  (on sL):  sL_{i+1} = N_i(sL_i),  N_i = [[0, k_i], [-1, d_i]]
//   right (on gR):  gR_i     = R_i(gR_{i+1}), R_i = [[0, 1], [-k_i, d_i]]
// and the tangents are affine maps x -> A x + B given those values. One block owns a tile of
// S sequences x W positions (W = P L, S P = T threads); thread t owns L consecutive positions (a
// chunk) of one sequence. Per tile:
//   load     the tile, coalesced (consecutive threads, consecutive addresses; cp.async straight
//            into shared memory), rows padded one word every 32 so that the chunk-per-thread view
//            is free of bank conflicts;
//   maps     each thread composes its chunk's left map N_{L-1}...N_0 and right map R_0...R_{L-1}
//            (both in one pass over its positions; the 2x2 products are divided by a power of two
//            near their largest entry every 4 steps: projectively exact, never over- or underflow);
//   scan     inclusive Hillis-Steele scans of those maps across the P chunks of each sequence in
//            shared memory (log2 P steps, one barrier each): prefix products on the left, suffix
//            products on the right, each applied to the value entering the tile, give sL entering
//            and gR leaving every chunk;
//   walk     each thread runs the continued fractions above over its own chunk from those boundary
//            values (sL_i kept in registers) and writes G_i into shared memory;
//   store    the tile leaves coalesced (one 8-byte complex per thread and position).
// The backward adds the affine scans of the two tangents between a first walk (the chunk's affine
// maps) and the final walks (tL_i in registers, then da, db, dc).
// A sequence longer than one tile (N > T L) is walked by one block in two sweeps over its tiles:
// left to right for the values entering each tile (kept in a small workspace), then right to left
// with both boundary values in hand.
//
// Bytes per element, float32 (minimal: inputs read once, outputs written once):
//   forward:  a, b, c read (12) + G written (8) = 20, the minimum, for N <= T L (2048 at the
//             float32 default); longer N reads the inputs twice (32) plus 16 B per tile and sequence.
//   backward: a, b, c, grad read (20) + da, db, dc written (12) = 32, the minimum for a backward
//             that recomputes the forward's values instead of saving them (longer N: 52).
// FLOPs per element: forward about 110 (two map steps ~40, two continued fractions ~30 with three
// complex reciprocals, the scans ~30 amortized over L positions); backward about 260 (the maps,
// five complex reciprocals, the tangents and the affine scans). Memory-bound on an H100 at the
// float32 defaults when enough blocks are resident: the scans and walks overlap other blocks' loads.
// Accuracy: inside a chunk the same continued fractions as the reference; across chunks the boundary
// values come through the chunk maps (L rescaled steps) and about log2 P rescaled 2x2 products.
// float32 reciprocals on the device are rcp.approx (1 ulp). Far from the spectrum (Im z = 1) float32
// matches the float32 loop (~1e-7 relative); near it the map products lose more than the loop does
// (Im z = 0.01, N = 2048 to 16384: ~1e-5 forward, ~3e-5 backward, against ~3e-6 and ~8e-6 for the
// loop). Building with -DBK_MAP_F64 composes the maps in float64 and gets the loop's accuracy, at
// about 1.4x the forward time on an H100 (the maps then run on the half-rate float64 units).
//
// The same block code runs on the host (HostExec: every "thread" of a phase in turn, a barrier being
// the end of a phase), exported as bk_core_*_host_*: tests check indexing, scans and tiling against
// the float64 reference on a machine without a GPU.

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bk_core.h"

#define BK_HD __host__ __device__ __forceinline__

namespace bk {

template <typename R> struct alignas(2 * sizeof(R)) cx { R re, im; };
template <typename R> struct alignas(4 * sizeof(R)) v4 { R x, y, z, w; };

template <typename R> BK_HD cx<R> mk(R re, R im) { cx<R> w; w.re = re; w.im = im; return w; }
template <typename R> BK_HD cx<R> operator+(cx<R> x, cx<R> y) { return mk(x.re + y.re, x.im + y.im); }
template <typename R> BK_HD cx<R> operator-(cx<R> x, cx<R> y) { return mk(x.re - y.re, x.im - y.im); }
template <typename R> BK_HD cx<R> operator*(cx<R> x, cx<R> y) {
  return mk(x.re * y.re - x.im * y.im, x.re * y.im + x.im * y.re);
}
template <typename R> BK_HD cx<R> operator*(R s, cx<R> x) { return mk(s * x.re, s * x.im); }

BK_HD float rcp(float x) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return 1.0f / x;
#endif
}
BK_HD double rcp(double x) {
#ifdef __CUDA_ARCH__
  return __drcp_rn(x);
#else
  return 1.0 / x;
#endif
}
// 1 / w; |w|^2 must stay in range (|a - z| < 1e19 in float32), which bounded resolvents respect.
template <typename R> BK_HD cx<R> inv(cx<R> w) {
  const R s = rcp(w.re * w.re + w.im * w.im);
  return mk(w.re * s, -w.im * s);
}
BK_HD float amax(float x, float y) { return fmaxf(fabsf(x), fabsf(y)); }
BK_HD double amax(double x, double y) { return fmax(fabs(x), fabs(y)); }
BK_HD float fmx(float x, float y) { return fmaxf(x, y); }
BK_HD double fmx(double x, double y) { return fmax(x, y); }
// 2^-e for m = 1.f * 2^e (m >= 0): multiplying by it is exact and leaves the largest entry in [1, 4)
BK_HD float pow2_inv(float m) {
  uint32_t u;
  memcpy(&u, &m, 4);
  int e = (int)((u >> 23) & 0xffu);
  e = e > 253 ? 253 : e;
  const uint32_t r = (uint32_t)(254 - e) << 23;
  float f;
  memcpy(&f, &r, 4);
  return f;
}
BK_HD double pow2_inv(double m) {
  uint64_t u;
  memcpy(&u, &m, 8);
  int e = (int)((u >> 52) & 0x7ffu);
  e = e > 2045 ? 2045 : e;
  const uint64_t r = (uint64_t)(2046 - e) << 52;
  double f;
  memcpy(&f, &r, 8);
  return f;
}

// --- 2x2 complex Moebius maps [[a, b], [c, d]] acting on (x, 1), and affine maps x -> A x + B --------
template <typename R> struct mat { cx<R> a, b, c, d; };
template <typename R> struct aff { cx<R> A, B; };

template <typename R> BK_HD mat<R> mident() {
  mat<R> m;
  m.a = mk<R>(1, 0); m.b = mk<R>(0, 0); m.c = mk<R>(0, 0); m.d = mk<R>(1, 0);
  return m;
}
template <typename R> BK_HD mat<R> mscale(mat<R> m) {
  const R mx = fmx(fmx(amax(m.a.re, m.a.im), amax(m.b.re, m.b.im)), fmx(amax(m.c.re, m.c.im), amax(m.d.re, m.d.im)));
  const R s = pow2_inv(mx);
  m.a = s * m.a; m.b = s * m.b; m.c = s * m.c; m.d = s * m.d;
  return m;
}
template <typename R> BK_HD mat<R> mmul(const mat<R>& x, const mat<R>& y) {
  mat<R> m;
  m.a = x.a * y.a + x.b * y.c; m.b = x.a * y.b + x.b * y.d;
  m.c = x.c * y.a + x.d * y.c; m.d = x.c * y.b + x.d * y.d;
  return m;
}
template <typename R> BK_HD cx<R> mapply(const mat<R>& m, cx<R> x) { return (m.a * x + m.b) * inv(m.c * x + m.d); }
// d = (dr, di) with di = -Im z
template <typename R> BK_HD cx<R> dmul(R dr, R di, cx<R> x) { return mk(dr * x.re - di * x.im, dr * x.im + di * x.re); }
// m <- N m, N = [[0, k], [-1, d]]: the left map of one position applied after m
template <typename R> BK_HD mat<R> lstep(const mat<R>& m, R k, R dr, R di) {
  mat<R> n;
  n.a = k * m.c; n.b = k * m.d;
  n.c = dmul(dr, di, m.c) - m.a; n.d = dmul(dr, di, m.d) - m.b;
  return n;
}
// m <- m R, R = [[0, 1], [-k, d]]: the right map of one position applied before m
template <typename R> BK_HD mat<R> rstep(const mat<R>& m, R k, R dr, R di) {
  mat<R> n;
  n.a = (-k) * m.b; n.b = m.a + dmul(dr, di, m.b);
  n.c = (-k) * m.d; n.d = m.c + dmul(dr, di, m.d);
  return n;
}
template <typename R> BK_HD aff<R> acomp(const aff<R>& x, const aff<R>& y) {   // x after y
  aff<R> r;
  r.A = x.A * y.A; r.B = x.A * y.B + x.B;
  return r;
}

// Precision of the chunk maps and their scans (the boundary values): see the header.
template <typename R> struct MapReal { typedef R type; };
#ifdef BK_MAP_F64
template <> struct MapReal<float> { typedef double type; };
#endif
template <typename R, typename Q> BK_HD cx<R> to_cx(cx<Q> x) { return mk<R>((R)x.re, (R)x.im); }

// --- one thread per chunk on the device; every thread of a phase in turn on the host --------------
struct DeviceExec {
  BK_HD int lo() const {
#ifdef __CUDA_ARCH__
    return threadIdx.x;
#else
    return 0;
#endif
  }
  BK_HD int hi() const { return lo() + 1; }
  BK_HD int slot(int) const { return 0; }
  BK_HD void sync() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
};
struct HostExec {
  int n;
  BK_HD int lo() const { return 0; }
  BK_HD int hi() const { return n; }
  BK_HD int slot(int t) const { return t; }
  BK_HD void sync() const {}
};

// Global -> shared copy of one element, zero where !ok (cp.async: no registers, all in flight).
template <typename R> BK_HD void cp_elem(R* dst, const R* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  if (sizeof(R) == 4)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 4 : 0) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 8 : 0) : "memory");
#else
  *dst = ok ? *src : R(0);
#endif
}
BK_HD void cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

BK_HD int pad(int i) { return i + (i >> 5); }     // one spare word every 32: conflict-free chunk view

// Shared memory of one block: NA tile arrays, the double-buffered scan, the chunk messages.
template <typename R, int T, int L, int NA> struct Smem {
  static constexpr int E = T * L, EP = E + E / 32;
  R tile[NA][EP];
  v4<typename MapReal<R>::type> scan[2][4][T];         // [buffer][left map (2 v4) | right map (2 v4)][thread]; affine: [0], [2]
  cx<R> msg[4][T];
};

template <typename R, int L> struct FwdThr {
  mat<typename MapReal<R>::type> ml, mr;
  cx<R> xl, xr, xr_next, s_in, g_in;
  cx<R> sl[L];
};
template <typename R, int L> struct BwdThr {
  mat<typename MapReal<R>::type> ml, mr;
  aff<R> al, ar;
  cx<R> xl, xtl, xr, xrp, xr_next, xrp_next, s_in, g_in, t_in, gp_in;
  cx<R> sl[L], tl[L];
};

// Block geometry: P = 2^lp threads per sequence (chunks of L positions), S = T / P sequences.
struct Geo {
  int lp, P, lw, W, S;
  long long seq0, ntiles;
};
template <int T, int L> BK_HD Geo geometry(long long blk, long long N, int lp) {
  Geo g;
  int ll = 0;
  while ((1 << ll) < L) ++ll;
  g.lp = lp; g.P = 1 << lp; g.lw = lp + ll; g.W = 1 << g.lw; g.S = T >> lp;
  g.seq0 = blk * g.S;
  g.ntiles = (N + g.W - 1) >> g.lw;
  return g;
}

// The tile [seq0, seq0 + S) x [tile W, tile W + W) of NA row-major arrays into shared memory.
// Arrays 0..2 are a [B, N], b, c [B, N-1]; arrays 3, 4 (backward) are Re, Im of w [B, N] complex.
template <typename R, int T, int L, int NA, class Ex>
BK_HD void load_tile(const Ex& ex, Smem<R, T, L, NA>& sm, const Geo& g, long long tile, const R* a,
                     const R* b, const R* c, const R* w, long long B, long long N) {
  constexpr int E = T * L;
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    for (int e = tid; e < E; e += T) {
      const long long seq = g.seq0 + (e >> g.lw), pos = tile * g.W + (e & (g.W - 1));
      const bool ok = seq < B && pos < N, okbc = ok && pos < N - 1;
      const long long idx = seq * N + pos, ibc = idx - seq;
      const int pe = pad(e);
      cp_elem(&sm.tile[0][pe], ok ? a + idx : a, ok);
      cp_elem(&sm.tile[1][pe], okbc ? b + ibc : a, okbc);
      cp_elem(&sm.tile[2][pe], okbc ? c + ibc : a, okbc);
      if (NA == 5) {
        cp_elem(&sm.tile[3 % NA][pe], ok ? w + 2 * idx : a, ok);
        cp_elem(&sm.tile[4 % NA][pe], ok ? w + 2 * idx + 1 : a, ok);
      }
    }
    cp_wait();
  }
  ex.sync();
}

// A chunk is addressed as pad(t L) + j: exact only while it stays inside one 32-word row of the
// padded tile, so L must be a power of two <= 32 (L = 64 read the padding words as positions).
template <int L> BK_HD int chunk_base(int t) {
  static_assert(L >= 1 && L <= 32 && (32 % L) == 0, "positions per thread (L) must be a power of two <= 32");
  return pad(t * L);
}

// Each thread's chunk maps from its own positions: left N_{L-1}...N_0, right R_0...R_{L-1}.
// Also turns a into dr = a - Re z in place (and k = b c into array 1 when keep_bc is false).
template <typename R, int T, int L, int NA, class Thr, class Ex>
BK_HD void chunk_maps(const Ex& ex, Smem<R, T, L, NA>& sm, Thr* st, bool right, bool keep_bc, R zr, R zi) {
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    Thr& th = st[ex.slot(tid)];
    const int base = chunk_base<L>(tid);
    typedef typename MapReal<R>::type Q;
    mat<Q> ml = mident<Q>(), mr = mident<Q>();
#pragma unroll
    for (int j = 0; j < L; ++j) {
      const R dr = sm.tile[0][base + j] - zr, k = sm.tile[1][base + j] * sm.tile[2][base + j];
      sm.tile[0][base + j] = dr;
      if (!keep_bc) sm.tile[1][base + j] = k;
      ml = lstep<Q>(ml, k, dr, -zi);
      if (right) mr = rstep<Q>(mr, k, dr, -zi);
      if ((j & 3) == 3) {
        ml = mscale(ml);
        if (right) mr = mscale(mr);
      }
    }
    th.ml = ml;
    th.mr = mr;
  }
}

template <typename R> BK_HD void put_mat(v4<R>* s0, v4<R>* s1, const mat<R>& m) {
  v4<R> x, y;
  x.x = m.a.re; x.y = m.a.im; x.z = m.b.re; x.w = m.b.im;
  y.x = m.c.re; y.y = m.c.im; y.z = m.d.re; y.w = m.d.im;
  *s0 = x; *s1 = y;
}
template <typename R> BK_HD mat<R> get_mat(const v4<R>* s0, const v4<R>* s1) {
  const v4<R> x = *s0, y = *s1;
  mat<R> m;
  m.a = mk(x.x, x.y); m.b = mk(x.z, x.w); m.c = mk(y.x, y.y); m.d = mk(y.z, y.w);
  return m;
}

// Inclusive segmented scans of the chunk maps over the P chunks of each sequence, then the
// messages: s entering every chunk (left) and gR at the first position of the next chunk (right).
template <typename R, int T, int L, int NA, class Thr, class Ex>
BK_HD void scan_maps(const Ex& ex, Smem<R, T, L, NA>& sm, Thr* st, const Geo& g, bool right) {
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    const Thr& th = st[ex.slot(tid)];
    put_mat(&sm.scan[0][0][tid], &sm.scan[0][1][tid], th.ml);
    if (right) put_mat(&sm.scan[0][2][tid], &sm.scan[0][3][tid], th.mr);
  }
  ex.sync();
  int cur = 0;
  for (int off = 1; off < g.P; off <<= 1) {
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      Thr& th = st[ex.slot(tid)];
      const int ch = tid & (g.P - 1);
      if (ch >= off) th.ml = mscale(mmul(th.ml, get_mat(&sm.scan[cur][0][tid - off], &sm.scan[cur][1][tid - off])));
      if (right && ch + off < g.P)
        th.mr = mscale(mmul(th.mr, get_mat(&sm.scan[cur][2][tid + off], &sm.scan[cur][3][tid + off])));
      if (2 * off < g.P) {                      // every entry, changed or not, for the next round
        put_mat(&sm.scan[cur ^ 1][0][tid], &sm.scan[cur ^ 1][1][tid], th.ml);
        if (right) put_mat(&sm.scan[cur ^ 1][2][tid], &sm.scan[cur ^ 1][3][tid], th.mr);
      }
    }
    ex.sync();
    cur ^= 1;
  }
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    const Thr& th = st[ex.slot(tid)];
    typedef typename MapReal<R>::type Q;
    sm.msg[0][tid] = to_cx<R>(mapply(th.ml, to_cx<Q>(th.xl)));
    if (right) sm.msg[1][tid] = to_cx<R>(mapply(th.mr, to_cx<Q>(th.xr)));
  }
  ex.sync();
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    Thr& th = st[ex.slot(tid)];
    const int ch = tid & (g.P - 1);
    th.s_in = ch > 0 ? sm.msg[0][tid - 1] : th.xl;
    if (right) {
      th.g_in = ch < g.P - 1 ? sm.msg[1][tid + 1] : th.xr;
      th.xr_next = sm.msg[1][tid - ch];
    }
  }
}

// --- forward --------------------------------------------------------------------------------------

template <typename R, int T, int L, class Ex>
BK_HD void fwd_block(const Ex& ex, long long blk, Smem<R, T, L, 3>& sm, FwdThr<R, L>* st, const R* a, const R* b,
                     const R* c, R* out, cx<R>* ws, long long B, long long N, int lp, R zr, R zi) {
  const Geo g = geometry<T, L>(blk, N, lp);
  constexpr int E = T * L;
  // ntiles > 1 only when P = T: one sequence per block, seq0 = blk
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].xl = mk<R>(0, 0);
  for (long long tile = 0; tile + 1 < g.ntiles; ++tile) {           // sweep 1: sL entering each tile
    if (g.seq0 < B) {
      for (int tid = ex.lo(); tid < ex.hi(); ++tid)
        if (tid == 0) ws[g.seq0 * g.ntiles + tile] = st[ex.slot(tid)].xl;
    }
    ex.sync();
    load_tile(ex, sm, g, tile, a, b, c, (const R*)0, B, N);
    chunk_maps(ex, sm, st, false, false, zr, zi);
    scan_maps(ex, sm, st, g, false);
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].xl = sm.msg[0][T - 1];
  }
  if (g.ntiles > 1 && g.seq0 < B) {
    for (int tid = ex.lo(); tid < ex.hi(); ++tid)
      if (tid == 0) ws[g.seq0 * g.ntiles + g.ntiles - 1] = st[ex.slot(tid)].xl;
  }
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].xr = mk<R>(0, 0);
  for (long long tile = g.ntiles - 1; tile >= 0; --tile) {          // sweep 2: both sides, then G
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid)
      st[ex.slot(tid)].xl = (g.ntiles > 1 && g.seq0 < B) ? ws[g.seq0 * g.ntiles + tile] : mk<R>(0, 0);
    load_tile(ex, sm, g, tile, a, b, c, (const R*)0, B, N);
    chunk_maps(ex, sm, st, true, false, zr, zi);
    scan_maps(ex, sm, st, g, true);
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      FwdThr<R, L>& th = st[ex.slot(tid)];
      const int base = chunk_base<L>(tid);
      cx<R> s = th.s_in;
#pragma unroll
      for (int j = 0; j < L; ++j) {                                 // left: sL_j in registers
        const R dr = sm.tile[0][base + j], k = sm.tile[1][base + j];
        th.sl[j] = s;
        const R wr = dr - s.re, wi = -zi - s.im, q = k * rcp(wr * wr + wi * wi);
        s = mk(wr * q, -wi * q);
      }
      cx<R> gr = th.g_in;
#pragma unroll
      for (int j = L - 1; j >= 0; --j) {                            // right: G_j over the tile
        const R dr = sm.tile[0][base + j], k = sm.tile[1][base + j];
        const cx<R> sr = k * gr;
        const cx<R> gg = inv(mk(dr - th.sl[j].re - sr.re, -zi - th.sl[j].im - sr.im));
        sm.tile[0][base + j] = gg.re;
        sm.tile[1][base + j] = gg.im;
        gr = inv(mk(dr - sr.re, -zi - sr.im));
      }
    }
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      for (int e = tid; e < E; e += T) {
        const long long seq = g.seq0 + (e >> g.lw), pos = tile * g.W + (e & (g.W - 1));
        if (seq < B && pos < N) reinterpret_cast<cx<R>*>(out)[seq * N + pos] = mk(sm.tile[0][pad(e)], sm.tile[1][pad(e)]);
      }
      st[ex.slot(tid)].xr = st[ex.slot(tid)].xr_next;
    }
  }
}

// --- backward -------------------------------------------------------------------------------------

template <typename Q, typename R> BK_HD void put_aff(v4<Q>* s, const aff<R>& m) {
  v4<Q> x;
  x.x = m.A.re; x.y = m.A.im; x.z = m.B.re; x.w = m.B.im;
  *s = x;
}
template <typename R, typename Q> BK_HD aff<R> get_aff(const v4<Q>* s) {
  const v4<Q> x = *s;
  aff<R> m;
  m.A = mk<R>(x.x, x.y); m.B = mk<R>(x.z, x.w);
  return m;
}

// Inclusive segmented scans of the chunks' tangent maps, then the messages: tL entering every chunk
// and gR' at the first position of the next chunk.
template <typename R, int T, int L, class Ex>
BK_HD void scan_affine(const Ex& ex, Smem<R, T, L, 5>& sm, BwdThr<R, L>* st, const Geo& g, bool right) {
  ex.sync();
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    const BwdThr<R, L>& th = st[ex.slot(tid)];
    put_aff(&sm.scan[0][0][tid], th.al);
    if (right) put_aff(&sm.scan[0][2][tid], th.ar);
  }
  ex.sync();
  int cur = 0;
  for (int off = 1; off < g.P; off <<= 1) {
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      BwdThr<R, L>& th = st[ex.slot(tid)];
      const int ch = tid & (g.P - 1);
      if (ch >= off) th.al = acomp(th.al, get_aff<R>(&sm.scan[cur][0][tid - off]));
      if (right && ch + off < g.P) th.ar = acomp(th.ar, get_aff<R>(&sm.scan[cur][2][tid + off]));
      if (2 * off < g.P) {
        put_aff(&sm.scan[cur ^ 1][0][tid], th.al);
        if (right) put_aff(&sm.scan[cur ^ 1][2][tid], th.ar);
      }
    }
    ex.sync();
    cur ^= 1;
  }
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    const BwdThr<R, L>& th = st[ex.slot(tid)];
    sm.msg[2][tid] = th.al.A * th.xtl + th.al.B;
    if (right) sm.msg[3][tid] = th.ar.A * th.xrp + th.ar.B;
  }
  ex.sync();
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    BwdThr<R, L>& th = st[ex.slot(tid)];
    const int ch = tid & (g.P - 1);
    th.t_in = ch > 0 ? sm.msg[2][tid - 1] : th.xtl;
    if (right) {
      th.gp_in = ch < g.P - 1 ? sm.msg[3][tid + 1] : th.xrp;
      th.xrp_next = sm.msg[3][tid - ch];
    }
  }
}

// The chunk's tangent maps from its boundary values: left tL_in -> tL_out (sL_j kept in registers),
// right gR'(next chunk) -> gR'(first position).
template <typename R, int T, int L, class Ex>
BK_HD void chunk_tangent_maps(const Ex& ex, Smem<R, T, L, 5>& sm, BwdThr<R, L>* st, bool right, R zi) {
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    BwdThr<R, L>& th = st[ex.slot(tid)];
    const int base = chunk_base<L>(tid);
    aff<R> al, ar;
    al.A = mk<R>(1, 0); al.B = mk<R>(0, 0); ar = al;
    cx<R> s = th.s_in;
#pragma unroll
    for (int j = 0; j < L; ++j) {
      const R dr = sm.tile[0][base + j], k = sm.tile[1][base + j] * sm.tile[2][base + j];
      const cx<R> v = mk(sm.tile[3][base + j], -sm.tile[4][base + j]);
      th.sl[j] = s;
      const cx<R> gl = inv(mk(dr - s.re, -zi - s.im));
      const cx<R> alpha = k * (gl * gl);
      al.A = alpha * al.A;
      al.B = alpha * (al.B + v);
      s = k * gl;
    }
    th.al = al;
    if (right) {
      cx<R> gr = th.g_in;
#pragma unroll
      for (int j = L - 1; j >= 0; --j) {
        const R dr = sm.tile[0][base + j], k = sm.tile[1][base + j] * sm.tile[2][base + j];
        const cx<R> v = mk(sm.tile[3][base + j], -sm.tile[4][base + j]);
        const cx<R> sr = k * gr;
        gr = inv(mk(dr - sr.re, -zi - sr.im));
        const cx<R> g2 = gr * gr;
        ar.A = k * (g2 * ar.A);
        ar.B = g2 * (k * ar.B + v);
      }
      th.ar = ar;
    }
  }
}

template <typename R, int T, int L, class Ex>
BK_HD void bwd_block(const Ex& ex, long long blk, Smem<R, T, L, 5>& sm, BwdThr<R, L>* st, const R* a, const R* b,
                     const R* c, const R* w, R* ga, R* gb, R* gc, cx<R>* ws, long long B, long long N, int lp,
                     R zr, R zi) {
  const Geo g = geometry<T, L>(blk, N, lp);
  constexpr int E = T * L;
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].xl = st[ex.slot(tid)].xtl = mk<R>(0, 0);
  for (long long tile = 0; tile + 1 < g.ntiles; ++tile) {           // sweep 1: (sL, tL) entering tiles
    if (g.seq0 < B) {
      for (int tid = ex.lo(); tid < ex.hi(); ++tid)
        if (tid == 0) {
          ws[(g.seq0 * g.ntiles + tile) * 2] = st[ex.slot(tid)].xl;
          ws[(g.seq0 * g.ntiles + tile) * 2 + 1] = st[ex.slot(tid)].xtl;
        }
    }
    ex.sync();
    load_tile(ex, sm, g, tile, a, b, c, w, B, N);
    chunk_maps(ex, sm, st, false, true, zr, zi);
    scan_maps(ex, sm, st, g, false);
    chunk_tangent_maps(ex, sm, st, false, zi);
    scan_affine(ex, sm, st, g, false);
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      st[ex.slot(tid)].xl = sm.msg[0][T - 1];
      st[ex.slot(tid)].xtl = sm.msg[2][T - 1];
    }
  }
  if (g.ntiles > 1 && g.seq0 < B) {
    for (int tid = ex.lo(); tid < ex.hi(); ++tid)
      if (tid == 0) {
        ws[(g.seq0 * g.ntiles + g.ntiles - 1) * 2] = st[ex.slot(tid)].xl;
        ws[(g.seq0 * g.ntiles + g.ntiles - 1) * 2 + 1] = st[ex.slot(tid)].xtl;
      }
  }
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].xr = st[ex.slot(tid)].xrp = mk<R>(0, 0);
  for (long long tile = g.ntiles - 1; tile >= 0; --tile) {          // sweep 2
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      BwdThr<R, L>& th = st[ex.slot(tid)];
      const bool multi = g.ntiles > 1 && g.seq0 < B;
      th.xl = multi ? ws[(g.seq0 * g.ntiles + tile) * 2] : mk<R>(0, 0);
      th.xtl = multi ? ws[(g.seq0 * g.ntiles + tile) * 2 + 1] : mk<R>(0, 0);
    }
    load_tile(ex, sm, g, tile, a, b, c, w, B, N);
    chunk_maps(ex, sm, st, true, true, zr, zi);
    scan_maps(ex, sm, st, g, true);
    chunk_tangent_maps(ex, sm, st, true, zi);
    scan_affine(ex, sm, st, g, true);
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      BwdThr<R, L>& th = st[ex.slot(tid)];
      const int base = chunk_base<L>(tid);
      cx<R> t = th.t_in;
#pragma unroll
      for (int j = 0; j < L; ++j) {                                 // tL_j in registers
        const R dr = sm.tile[0][base + j], k = sm.tile[1][base + j] * sm.tile[2][base + j];
        const cx<R> v = mk(sm.tile[3][base + j], -sm.tile[4][base + j]);
        const cx<R> gl = inv(mk(dr - th.sl[j].re, -zi - th.sl[j].im));
        th.tl[j] = t;
        t = k * ((gl * gl) * (v + t));
      }
      cx<R> gr = th.g_in, grp = th.gp_in;                           // gR_{j+1}, gR'_{j+1}
#pragma unroll
      for (int j = L - 1; j >= 0; --j) {
        const R dr = sm.tile[0][base + j], bv = sm.tile[1][base + j], cv = sm.tile[2][base + j], k = bv * cv;
        const cx<R> v = mk(sm.tile[3][base + j], -sm.tile[4][base + j]);
        const cx<R> sr = k * gr, tr = k * grp;
        const cx<R> gg = inv(mk(dr - th.sl[j].re - sr.re, -zi - th.sl[j].im - sr.im));
        const cx<R> gp = (gg * gg) * (v + th.tl[j] + tr);
        const R p = (gp * gr).re + (gg * grp).re;
        sm.tile[0][base + j] = -gp.re;                               // the tile becomes (da, db, dc)
        sm.tile[1][base + j] = cv * p;
        sm.tile[2][base + j] = bv * p;
        const cx<R> gn = inv(mk(dr - sr.re, -zi - sr.im));
        grp = (gn * gn) * (v + tr);
        gr = gn;
      }
    }
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      for (int e = tid; e < E; e += T) {
        const long long seq = g.seq0 + (e >> g.lw), pos = tile * g.W + (e & (g.W - 1));
        if (seq >= B || pos >= N) continue;
        const int pe = pad(e);
        ga[seq * N + pos] = sm.tile[0][pe];
        if (pos < N - 1) {
          gb[seq * (N - 1) + pos] = sm.tile[1][pe];
          gc[seq * (N - 1) + pos] = sm.tile[2][pe];
        }
      }
      BwdThr<R, L>& th = st[ex.slot(tid)];
      th.xr = th.xr_next;
      th.xrp = th.xrp_next;
    }
  }
}

// --- configurations, kernels, launchers -----------------------------------------------------------
// (T threads, L positions per thread). float32 forward: 64 x 32 (a 2048-position tile, one
// sequence of the N = 2048 benchmark per block); float32 backward: 128 x 16; float64: 64 x 16
// forward, 64 x 8 backward (register pressure).

template <int T, int L> int plan_lp(long long N) {
  const long long chunks = (N + L - 1) / L;
  int lp = 0;
  while ((1LL << lp) < chunks && (1 << lp) < T) ++lp;
  return lp;
}

extern __shared__ __align__(32) unsigned char bk_smem[];

template <typename R, int T, int L>
__global__ void __launch_bounds__(T) _bk_forward_kernel(const R* a, const R* b, const R* c, R* out, cx<R>* ws,
                                                        long long B, long long N, int lp, R zr, R zi) {
  Smem<R, T, L, 3>& sm = *reinterpret_cast<Smem<R, T, L, 3>*>(bk_smem);
  FwdThr<R, L> st[1];
  fwd_block<R, T, L>(DeviceExec(), blockIdx.x, sm, st, a, b, c, out, ws, B, N, lp, zr, zi);
}

template <typename R, int T, int L>
__global__ void __launch_bounds__(T) _bk_backward_kernel(const R* a, const R* b, const R* c, const R* w, R* ga,
                                                         R* gb, R* gc, cx<R>* ws, long long B, long long N, int lp,
                                                         R zr, R zi) {
  Smem<R, T, L, 5>& sm = *reinterpret_cast<Smem<R, T, L, 5>*>(bk_smem);
  BwdThr<R, L> st[1];
  bwd_block<R, T, L>(DeviceExec(), blockIdx.x, sm, st, a, b, c, w, ga, gb, gc, ws, B, N, lp, zr, zi);
}

template <int T, int L> long long ws_elems_cfg(long long B, long long N, bool backward) {
  if (N <= (long long)T * L) return 0;
  const long long nt = (N + T * L - 1) / (T * L);
  return B * nt * (backward ? 4 : 2);                             // complex xl (and xtl) per tile
}

template <typename R, int T, int L>
int launch_forward_cfg(const R* a, const R* b, const R* c, R* out, R* ws, long long B, long long N, double zr,
                       double zi, void* stream) {
  if (B <= 0 || N <= 0) return 0;
  const int lp = plan_lp<T, L>(N);
  const long long S = T >> lp, blocks = (B + S - 1) / S;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
  const size_t smem = sizeof(Smem<R, T, L, 3>);
  cudaError_t err = cudaFuncSetAttribute(_bk_forward_kernel<R, T, L>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
  if (err != cudaSuccess) return (int)err;
  if (N == 1) b = c = a;                                          // b, c are empty: never read
  _bk_forward_kernel<R, T, L><<<(unsigned)blocks, T, smem, (cudaStream_t)stream>>>(
      a, b, c, out, reinterpret_cast<cx<R>*>(ws), B, N, lp, (R)zr, (R)zi);
  return (int)cudaGetLastError();
}

template <typename R, int T, int L>
int launch_backward_cfg(const R* a, const R* b, const R* c, const R* w, R* ga, R* gb, R* gc, R* ws, long long B,
                        long long N, double zr, double zi, void* stream) {
  if (B <= 0 || N <= 0) return 0;
  const int lp = plan_lp<T, L>(N);
  const long long S = T >> lp, blocks = (B + S - 1) / S;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
  const size_t smem = sizeof(Smem<R, T, L, 5>);
  cudaError_t err = cudaFuncSetAttribute(_bk_backward_kernel<R, T, L>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
  if (err != cudaSuccess) return (int)err;
  if (N == 1) { b = c = a; gb = gc = ga; }
  _bk_backward_kernel<R, T, L><<<(unsigned)blocks, T, smem, (cudaStream_t)stream>>>(
      a, b, c, w, ga, gb, gc, reinterpret_cast<cx<R>*>(ws), B, N, lp, (R)zr, (R)zi);
  return (int)cudaGetLastError();
}

template <typename R, int T, int L>
int host_forward_cfg(const R* a, const R* b, const R* c, R* out, R* ws, long long B, long long N, double zr,
                     double zi) {
  const int lp = plan_lp<T, L>(N);
  Smem<R, T, L, 3>* sm = new Smem<R, T, L, 3>;
  FwdThr<R, L>* st = new FwdThr<R, L>[T];
  if (N == 1) b = c = a;
  for (long long blk = 0; blk * (T >> lp) < B; ++blk)
    fwd_block<R, T, L>(HostExec{T}, blk, *sm, st, a, b, c, out, reinterpret_cast<cx<R>*>(ws), B, N, lp, (R)zr,
                       (R)zi);
  delete sm;
  delete[] st;
  return 0;
}

template <typename R, int T, int L>
int host_backward_cfg(const R* a, const R* b, const R* c, const R* w, R* ga, R* gb, R* gc, R* ws, long long B,
                      long long N, double zr, double zi) {
  const int lp = plan_lp<T, L>(N);
  Smem<R, T, L, 5>* sm = new Smem<R, T, L, 5>;
  BwdThr<R, L>* st = new BwdThr<R, L>[T];
  if (N == 1) { b = c = a; gb = gc = ga; }
  for (long long blk = 0; blk * (T >> lp) < B; ++blk)
    bwd_block<R, T, L>(HostExec{T}, blk, *sm, st, a, b, c, w, ga, gb, gc, reinterpret_cast<cx<R>*>(ws), B, N, lp,
                       (R)zr, (R)zi);
  delete sm;
  delete[] st;
  return 0;
}

template <int T, int L> constexpr int tile_positions() { return T * L; }

}  // namespace bk

// Default configurations: threads per block _T, positions per thread _L (-D overrides both; L a power
// of two <= 32, see chunk_base).
#ifndef BK_FWD_F32_T
#define BK_FWD_F32_T 64
#define BK_FWD_F32_L 32
#endif
#define BK_FWD_F32 BK_FWD_F32_T, BK_FWD_F32_L
#ifndef BK_BWD_F32_T
#define BK_BWD_F32_T 128
#define BK_BWD_F32_L 16
#endif
#define BK_BWD_F32 BK_BWD_F32_T, BK_BWD_F32_L
#ifndef BK_FWD_F64_T
#define BK_FWD_F64_T 64
#define BK_FWD_F64_L 16
#endif
#define BK_FWD_F64 BK_FWD_F64_T, BK_FWD_F64_L
#ifndef BK_BWD_F64_T
#define BK_BWD_F64_T 64
#define BK_BWD_F64_L 8
#endif
#define BK_BWD_F64 BK_BWD_F64_T, BK_BWD_F64_L

// --- C ABI (declared in bk_core.h): raw pointers, row-major, the stream as void* -------------------

extern "C" {

long long bk_core_workspace_elems(long long B, long long N, int is_double, int backward) {
  if (is_double) return backward ? bk::ws_elems_cfg<BK_BWD_F64>(B, N, true) : bk::ws_elems_cfg<BK_FWD_F64>(B, N, false);
  return backward ? bk::ws_elems_cfg<BK_BWD_F32>(B, N, true) : bk::ws_elems_cfg<BK_FWD_F32>(B, N, false);
}

// Positions of one sequence in one tile: longer sequences take the two-sweep path.
int bk_core_tile_positions(int is_double, int backward) {
  if (is_double) return backward ? bk::tile_positions<BK_BWD_F64>() : bk::tile_positions<BK_FWD_F64>();
  return backward ? bk::tile_positions<BK_BWD_F32>() : bk::tile_positions<BK_FWD_F32>();
}

const char* bk_core_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

int bk_core_forward_f32(const float* a, const float* b, const float* c, float* out, float* ws, long long B,
                        long long N, double zr, double zi, void* stream) {
  return bk::launch_forward_cfg<float, BK_FWD_F32>(a, b, c, out, ws, B, N, zr, zi, stream);
}
int bk_core_forward_f64(const double* a, const double* b, const double* c, double* out, double* ws, long long B,
                        long long N, double zr, double zi, void* stream) {
  return bk::launch_forward_cfg<double, BK_FWD_F64>(a, b, c, out, ws, B, N, zr, zi, stream);
}
int bk_core_backward_f32(const float* a, const float* b, const float* c, const float* w, float* ga, float* gb,
                         float* gc, float* ws, long long B, long long N, double zr, double zi, void* stream) {
  return bk::launch_backward_cfg<float, BK_BWD_F32>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi, stream);
}
int bk_core_backward_f64(const double* a, const double* b, const double* c, const double* w, double* ga,
                         double* gb, double* gc, double* ws, long long B, long long N, double zr, double zi,
                         void* stream) {
  return bk::launch_backward_cfg<double, BK_BWD_F64>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi, stream);
}

// The same block code, run on the CPU: for tests on machines without a GPU. Not fast.
int bk_core_forward_host_f32(const float* a, const float* b, const float* c, float* out, float* ws, long long B,
                             long long N, double zr, double zi) {
  return bk::host_forward_cfg<float, BK_FWD_F32>(a, b, c, out, ws, B, N, zr, zi);
}
int bk_core_forward_host_f64(const double* a, const double* b, const double* c, double* out, double* ws,
                             long long B, long long N, double zr, double zi) {
  return bk::host_forward_cfg<double, BK_FWD_F64>(a, b, c, out, ws, B, N, zr, zi);
}
int bk_core_backward_host_f32(const float* a, const float* b, const float* c, const float* w, float* ga,
                              float* gb, float* gc, float* ws, long long B, long long N, double zr, double zi) {
  return bk::host_backward_cfg<float, BK_BWD_F32>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi);
}
int bk_core_backward_host_f64(const double* a, const double* b, const double* c, const double* w, double* ga,
                              double* gb, double* gc, double* ws, long long B, long long N, double zr, double zi) {
  return bk::host_backward_cfg<double, BK_BWD_F64>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi);
}

}  // extern "C"
