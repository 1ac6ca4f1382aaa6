// BK-Core in plain CUDA C++: G_i = [(T - zI)^-1]_ii for a batch of tridiagonal T, and its exact
// gradient. No torch headers: CI checks it with `nvcc -arch=sm_90 -c kernels/12_bk_core.cu`; its
// C ABI is declared once, in 12_bk_core.h (included below, so the compiler holds the definitions to
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
//            into shared memory), the 16-byte vectors of each row permuted (sw below) so that the
//            chunk-per-thread view is free of bank conflicts and reads 16 bytes per instruction;
//   maps     each thread composes its chunk's left map N_{L-1}...N_0 over its positions (the 2x2
//            products divided by a power of two near their largest entry every 4 steps: projectively
//            exact, never over- or underflow); the right map R_0...R_{L-1} is that product
//            transposed with its off-diagonal entries negated (R_i = D N_i^T D, D = diag(1, -1)), bit
//            for bit what composing the R_i gives. Composing both cost 0.1378 ms forward and 0.2832
//            backward; deriving the right one, 0.1324 and 0.2757 (8192 x 2048, interleaved, one H100:
//            81.2% to 84.5% of copy bandwidth forward);
//   scan     inclusive Hillis-Steele scans of those maps across the P chunks of each sequence, by
//            warp shuffles (log2 min(P, 32) steps, no barrier), then across the warps of a sequence
//            through their totals in shared memory (one barrier): prefix products on the left,
//            suffix products on the right, each applied to the value entering the tile, give sL
//            entering and gR leaving every chunk;
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
// Occupancy is what keeps the memory system busy: a block loads its tile and then computes without
// touching memory, so other resident blocks must cover that time. The launch bounds hold the float32
// forward to 72 registers (7 blocks of 128 threads per SM: 28 warps, 26 KB of shared memory each;
// bounded for 6 it took the same 72, 0.1326 ms against 0.1323 bounded for 7) and the backward to 167
// (3 blocks of 128; 45 KB each), with no spills.
// Left to itself the compiler gives the backward 198 registers (2 blocks), and the forward at 64
// threads x 32 positions 146 (6 blocks of 64): on an H100 both ran 10-17% slower than bounded.
// What held the forward at 78-81% of copy bandwidth (composing both maps, rescaling at every scan
// step) was instruction issue, not memory (ncu on an H100 at 8192 x 2048): 189 warp-lane
// instructions per position at 128 x 16 (144 at 64 x 32, whose longer chunks halve the scan work per
// position but leave 16 warps per SM to hide latency instead of 28, and end up as fast); in the
// compute phases an eligible warp waited for the issue slot in most cycles ("not selected": 2.9
// cycles per issued instruction), DRAM was 60% busy. Interleaving
// the two walks (the compiler already overlaps their independent chains) and rescaling the maps
// by a sum instead of maxima (float adds instead of integer-pipe max) both measured within noise;
// so did two cuts to the scans (0.141-0.145 ms forward before and after, interleaved on one H100):
// joining the warps of a sequence by carrying the entering value through the warps' totals (one
// map application each) instead of composing the totals into every thread's map, and rescaling
// the scanned products at every other shuffle step only. They cut the forward's executed
// instructions by 4.5% (ncu: 99.0 M to 94.6 M) but took it from 71 to 79 registers, one block per SM
// fewer; bounded back to 72 (M = 7, no spills) it ran 0.144-0.145 ms against 0.145-0.147 (four
// interleaved pairs, p20-p80 overlapping): instruction count alone does not set the forward's time.
// Nor do the loads: a one-sequence tile's loads cost about 20 instructions an element here (64-bit
// addresses and bounds per element); a per-thread base plus compile-time offsets (sw is periodic in
// 1 KB), int bounds and no predicate on a whole tile cut that to about 4, with the forward at 72
// registers (7 blocks per SM, as now). Interleaved on one H100, B = 8192, N = 2048, kernel alone:
// forward 0.1396 ms against 0.1378 (p20-p80 0.1392-0.1398 against 0.1375-0.1382), backward 0.297
// against 0.284; the same at N = 512 and 8192. The leaner loads issue their 48 cp.async in a burst,
// which may crowd the shared-memory pipe that the computing blocks' shuffles and loads also use.
// Nor is it that DRAM idles while the resident blocks compute: one thread of each block fetching the
// inputs of the block a given distance later into L2 (cp.async.bulk.prefetch.L2, no registers or
// shared memory) made the forward slower at every distance, interleaved on one H100 at 8192 x 2048:
// 0.1376 ms without, 0.1422 / 0.1613 / 0.1763 / 0.1798 ms at 1 / 2 / 4 / 7 blocks per SM ahead
// (0.0432 against 0.0438-0.0514 ms at N = 512).
// After the two cuts above (right maps derived, fewer rescales) these measured within noise or
// slower, interleaved on one H100 at 8192 x 2048 against 0.1309-0.1347 ms: keeping d - sL instead of
// sL for the second walk (0.1346 against 0.1347; fewer registers, 64), storing G two positions per
// 16-byte store (0.1359), copying a's rows in 16-byte pieces (0.1354 against 0.1347), streaming
// stores (0.1333 against 0.1326), evict-first loads (0.1379), rescaling the scans at offset 8 only
// (0.1306 against 0.1309).
// Per issued instruction a warp waits 8.5 cycles: 2.95 not selected, 1.0 fixed-latency dependencies,
// 0.9 at barriers, 0.85 on a busy math pipe, 0.5 on memory; the schedulers issue in 79% of cycles.
// The rows of b and c ([B, N-1], 4 (N - 1) bytes apart) mostly start inside a 32-byte sector, so
// their warps' requests straddle sectors: 8% more L2 sectors than the bytes need (ncu at N = 2048),
// a cost of that layout, not of the kernel.
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

#include "12_bk_core.h"

#define BK_HD __host__ __device__ __forceinline__

namespace bk {

template <typename R> struct alignas(2 * sizeof(R)) cx { R re, im; };

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
// Lanes of a warp exchange values by shuffles (put: nothing; up/down: the value of the lane off
// below/above, or the caller's own where there is none). The host runs each phase for every thread in
// turn, so a put phase writes the values to a scratch array and the next phase reads them there.
template <class V> BK_HD V shfl_words(V x, int off, bool up) {
#ifdef __CUDA_ARCH__
  constexpr int n = sizeof(V) / 4;
  static_assert(sizeof(V) % 4 == 0, "shuffled values are whole 32-bit words");
  uint32_t w[n];
  memcpy(w, &x, sizeof(V));
#pragma unroll
  for (int i = 0; i < n; ++i) w[i] = up ? __shfl_up_sync(0xffffffffu, w[i], off) : __shfl_down_sync(0xffffffffu, w[i], off);
  memcpy(&x, w, sizeof(V));
#endif
  return x;
}
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
  template <class V> BK_HD void put(int, int, const V&) const {}
  template <class V> BK_HD V up(int, int, const V& x, int off) const { return shfl_words(x, off, true); }
  template <class V> BK_HD V down(int, int, const V& x, int off) const { return shfl_words(x, off, false); }
};
struct HostExec {
  int n;
  unsigned char* xbuf;                                  // 2 n values of up to XW bytes
  static constexpr int XW = 64;
  BK_HD int lo() const { return 0; }
  BK_HD int hi() const { return n; }
  BK_HD int slot(int t) const { return t; }
  BK_HD void sync() const {}
  template <class V> BK_HD void put(int k, int tid, const V& x) const {
    static_assert(sizeof(V) <= XW, "exchange slot too small");
    memcpy(xbuf + ((size_t)k * n + tid) * XW, &x, sizeof(V));
  }
  template <class V> BK_HD V up(int k, int tid, const V& x, int off) const {
    V r = x;
    if ((tid & 31) >= off) memcpy(&r, xbuf + ((size_t)k * n + tid - off) * XW, sizeof(V));
    return r;
  }
  template <class V> BK_HD V down(int k, int tid, const V& x, int off) const {
    V r = x;
    if ((tid & 31) + off < 32) memcpy(&r, xbuf + ((size_t)k * n + tid + off) * XW, sizeof(V));
    return r;
  }
};

// Global -> shared copy of one element (4, 8 or 16 bytes), zero where !ok (cp.async: no registers,
// all in flight; the source is not read when !ok).
template <int BYTES> BK_HD void cp_bytes(void* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(BYTES), "r"(ok ? BYTES : 0)
               : "memory");
#else
  if (ok) memcpy(dst, src, BYTES);
  else memset(dst, 0, BYTES);
#endif
}
template <typename R> BK_HD void cp_elem(R* dst, const R* src, bool ok) { cp_bytes<sizeof(R)>(dst, src, ok); }
BK_HD void cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Tile layout in shared memory: element e of a tile array lives at sw(e). Each 128-byte row holds
// eight 16-byte vectors, and a row's vectors are permuted by the row's index (XOR), so that both
// views of the tile are free of bank conflicts with no padding: the coalesced view (a warp touches
// 32 consecutive 4-byte elements, one row, permuted) and the chunk view (the eight threads of a
// quarter-warp each read the same 16-byte vector of their own chunk: for chunks of 4 to 32 floats
// the XOR sends the eight to eight different vectors of banks). The permutation keeps 16-byte
// vectors whole, so the chunk view moves 16 bytes per instruction.
template <typename R> struct alignas(16) vq { R x[16 / sizeof(R)]; };
template <typename R> BK_HD constexpr int vq_n() { return (int)(16 / sizeof(R)); }
template <typename R> BK_HD int sw(int e) { return e ^ (((e / (8 * vq_n<R>())) & 7) * vq_n<R>()); }
template <typename R> BK_HD vq<R> ldv(const R* arr, int e) { return *reinterpret_cast<const vq<R>*>(arr + sw<R>(e)); }
template <typename R> BK_HD void stv(R* arr, int e, const vq<R>& v) { *reinterpret_cast<vq<R>*>(arr + sw<R>(e)) = v; }

// Shared memory of one block: NA tile arrays, the warps' scan totals, the chunk messages. In the
// backward, arrays 3 and 4 together are one array of 2E reals: w interleaved (Re, Im).
template <typename R, int T, int L, int NA> struct Smem {
  static_assert(T % 32 == 0, "threads per block (T): whole warps");
  static constexpr int E = T * L, NW = T / 32;
  typedef typename MapReal<R>::type Q;
  alignas(16) R tile[NA][E];
  mat<Q> wl[NW], wr[NW];                     // each warp's total map (left: its last lane, right: its first)
  aff<R> wal[NW], war[NW];                   // the same for the tangents' affine maps (backward)
  cx<R> msg[NA == 5 ? 4 : 2][T];
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

// The tile [seq0, seq0 + S) x [tile W, tile W + W) of a [B, N], b, c [B, N-1] (and w [B, N] complex in
// the backward) into shared memory, coalesced: thread t copies elements t, t + T, t + 2T, ... With one
// sequence per block (S = 1) the element is the position in the tile and every address is the row's
// base plus a constant; with several, the element splits into (sequence, position) by shifts.
template <typename R, int T, int L, int NA, class Ex>
BK_HD void load_tile(const Ex& ex, Smem<R, T, L, NA>& sm, const Geo& g, long long tile, const R* a,
                     const R* b, const R* c, const R* w, long long B, long long N) {
  R* wt = sm.tile[3 % NA];                              // (Re, Im) pairs of w: arrays 3 and 4 as one
  const long long col0 = tile * g.W;
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    if (g.S == 1) {
      const bool in = g.seq0 < B;
      const long long row = in ? g.seq0 : 0, lim = in ? N - col0 : 0;
      const R *ar = a + row * N + col0, *br = b + row * (N - 1) + col0, *cr = c + row * (N - 1) + col0;
      const R* wr = w ? w + 2 * (row * N + col0) : a;
#pragma unroll 8
      for (int k = 0; k < L; ++k) {
        const int e = tid + k * T, pe = sw<R>(e);
        const bool ok = e < lim, okbc = e + 1 < lim;
        cp_elem(&sm.tile[0][pe], ar + e, ok);
        cp_elem(&sm.tile[1][pe], br + e, okbc);
        cp_elem(&sm.tile[2][pe], cr + e, okbc);
        if (NA == 5) cp_bytes<2 * sizeof(R)>(&wt[sw<R>(2 * e)], wr + 2 * e, ok);
      }
    } else {
#pragma unroll 4
      for (int k = 0; k < L; ++k) {
        const int e = tid + k * T, pe = sw<R>(e);
        const long long seq = g.seq0 + (e >> g.lw), pos = col0 + (e & (g.W - 1));
        const bool ok = seq < B && pos < N, okbc = ok && pos < N - 1;
        const long long idx = ok ? seq * N + pos : 0, ibc = okbc ? idx - seq : 0;
        cp_elem(&sm.tile[0][pe], a + idx, ok);
        cp_elem(&sm.tile[1][pe], b + ibc, okbc);
        cp_elem(&sm.tile[2][pe], c + ibc, okbc);
        if (NA == 5) cp_bytes<2 * sizeof(R)>(&wt[sw<R>(2 * e)], w + 2 * idx, ok);
      }
    }
    cp_wait();
  }
  ex.sync();
}

template <int L, typename R> BK_HD void check_chunk() {
  static_assert(L >= vq_n<R>() && (L & (L - 1)) == 0, "positions per thread (L): a power of two, whole 16-byte vectors");
}

// R_i = D N_i^T D with D = diag(1, -1), so a chunk's right map R_0...R_{L-1} = D (N_{L-1}...N_0)^T D:
// its left map transposed with the off-diagonal entries negated. The same products in the same order,
// the same rescalings (they read the entries' magnitudes): bit for bit what composing R_i gives.
template <typename R> BK_HD mat<R> right_of_left(const mat<R>& m) {
  mat<R> r;
  r.a = m.a; r.b = mk(-m.c.re, -m.c.im); r.c = mk(-m.b.re, -m.b.im); r.d = m.d;
  return r;
}

// Each thread's chunk maps from its own positions: left N_{L-1}...N_0, and (right) R_0...R_{L-1} from it.
// Also turns a into dr = a - Re z in place (and k = b c into array 1 when keep_bc is false).
template <typename R, int T, int L, int NA, class Thr, class Ex>
BK_HD void chunk_maps(const Ex& ex, Smem<R, T, L, NA>& sm, Thr* st, bool right, bool keep_bc, R zr, R zi) {
  constexpr int V = vq_n<R>();
  check_chunk<L, R>();
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    Thr& th = st[ex.slot(tid)];
    const int base = tid * L;
    typedef typename MapReal<R>::type Q;
    mat<Q> ml = mident<Q>();
#pragma unroll
    for (int q = 0; q < L / V; ++q) {
      vq<R> va = ldv(sm.tile[0], base + q * V), vb = ldv(sm.tile[1], base + q * V);
      const vq<R> vc = ldv(sm.tile[2], base + q * V);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int j = q * V + i;
        const R dr = va.x[i] - zr, k = vb.x[i] * vc.x[i];
        va.x[i] = dr;
        vb.x[i] = k;
        ml = lstep<Q>(ml, k, dr, -zi);
        if ((j & 3) == 3 || j == L - 1) ml = mscale(ml);   // and at the end: the scans rely on it
      }
      stv(sm.tile[0], base + q * V, va);
      if (!keep_bc) stv(sm.tile[1], base + q * V, vb);
    }
    th.ml = ml;
    th.mr = right ? right_of_left(ml) : mident<Q>();
  }
}

// Inclusive scans of values x over the chunks of each sequence, x_t <- x_t after x_{t-1} after ... (left,
// comp(x_t, x_{t-1})) or x_t <- x_t after x_{t+1} after ... (right): within each warp by shuffles
// (Hillis-Steele, log2 min(P, 32) steps), then, for sequences spread over several warps, each thread
// applies the totals of the warps before (left) or after (right) it in its sequence.
template <typename V, class Ex, class Get, class Set, class Comp>
BK_HD void warp_scan(const Ex& ex, int P, int k, bool right, V* totals, Get get, Set set, Comp comp) {
  const int PW = P < 32 ? P : 32;
  for (int off = 1; off < PW; off <<= 1) {
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) ex.put(k, tid, get(tid));
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      const V x = get(tid), y = right ? ex.down(k, tid, x, off) : ex.up(k, tid, x, off);
      const int cw = tid & (PW - 1);
      if (right ? cw + off < PW : cw >= off) set(tid, comp(x, y, off));
    }
  }
  if (P <= 32) return;
  for (int tid = ex.lo(); tid < ex.hi(); ++tid)
    if ((tid & 31) == (right ? 0 : 31)) totals[tid >> 5] = get(tid);
  ex.sync();
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    const int ws = (tid & (P - 1)) >> 5, nws = P >> 5, wi = tid >> 5;
    V x = get(tid);
    if (right)
      for (int u = 1; ws + u < nws; ++u) x = comp(x, totals[wi + u], 0);
    else
      for (int u = 1; u <= ws; ++u) x = comp(x, totals[wi - u], 0);
    set(tid, x);
  }
}

// The chunk maps' scans, then the messages: s entering every chunk (left) and gR at the first position
// of the next chunk (right).
template <typename R, int T, int L, int NA, class Thr, class Ex>
BK_HD void scan_maps(const Ex& ex, Smem<R, T, L, NA>& sm, Thr* st, const Geo& g, bool right) {
  typedef typename MapReal<R>::type Q;
  // Rescaling multiplies by a power of two, which is exact: skipped after the shuffles at offsets 1, 4
  // and 16 it changes no bit of the maps that come out (the next rescale, or the projective apply,
  // removes the factor) while nothing overflows or leaves float's normal range: a product of two
  // products of maps scaled into [1, 4) has entries below 2^14, whatever the inputs (each chunk's
  // map leaves chunk_maps rescaled), and the warps' totals are rescaled when they are composed.
  // Rescaling at every offset: 0.1326 ms forward; at 2 and 8 only: 0.1308 (8192 x 2048, one H100).
  const auto mcomp = [](const mat<Q>& x, const mat<Q>& y, int off) {
    return (off == 1 || off == 4 || off == 16) ? mmul(x, y) : mscale(mmul(x, y));
  };
  warp_scan<mat<Q>>(ex, g.P, 0, false, sm.wl, [&](int t) { return st[ex.slot(t)].ml; },
                       [&](int t, const mat<Q>& m) { st[ex.slot(t)].ml = m; }, mcomp);
  if (right)
    warp_scan<mat<Q>>(ex, g.P, 1, true, sm.wr, [&](int t) { return st[ex.slot(t)].mr; },
                         [&](int t, const mat<Q>& m) { st[ex.slot(t)].mr = m; }, mcomp);
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    const Thr& th = st[ex.slot(tid)];
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
  constexpr int V = vq_n<R>();
  const Geo g = geometry<T, L>(blk, N, lp);
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
      const int base = tid * L;
      cx<R> s = th.s_in;
#pragma unroll
      for (int q = 0; q < L / V; ++q) {                             // left: sL_j in registers
        const vq<R> vd = ldv(sm.tile[0], base + q * V), vk = ldv(sm.tile[1], base + q * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          th.sl[q * V + i] = s;
          const R wr = vd.x[i] - s.re, wi = -zi - s.im, qq = vk.x[i] * rcp(wr * wr + wi * wi);
          s = mk(wr * qq, -wi * qq);
        }
      }
      cx<R> gr = th.g_in;
#pragma unroll
      for (int q = L / V - 1; q >= 0; --q) {                        // right: G_j over the tile
        vq<R> vd = ldv(sm.tile[0], base + q * V), vk = ldv(sm.tile[1], base + q * V);
#pragma unroll
        for (int i = V - 1; i >= 0; --i) {
          const int j = q * V + i;
          const R dr = vd.x[i], k = vk.x[i];
          const cx<R> sr = k * gr;
          const cx<R> gg = inv(mk(dr - th.sl[j].re - sr.re, -zi - th.sl[j].im - sr.im));
          vd.x[i] = gg.re;
          vk.x[i] = gg.im;
          gr = inv(mk(dr - sr.re, -zi - sr.im));
        }
        stv(sm.tile[0], base + q * V, vd);
        stv(sm.tile[1], base + q * V, vk);
      }
    }
    ex.sync();
    const long long col0 = tile * g.W;
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      if (g.S == 1) {                                               // positions e of one row
        if (g.seq0 < B) {
          cx<R>* orow = reinterpret_cast<cx<R>*>(out) + g.seq0 * N + col0;
          const long long lim = N - col0;
#pragma unroll 8
          for (int k = 0; k < L; ++k) {
            const int e = tid + k * T, pe = sw<R>(e);
            if (e < lim) orow[e] = mk(sm.tile[0][pe], sm.tile[1][pe]);
          }
        }
      } else {
#pragma unroll 4
        for (int k = 0; k < L; ++k) {
          const int e = tid + k * T, pe = sw<R>(e);
          const long long seq = g.seq0 + (e >> g.lw), pos = col0 + (e & (g.W - 1));
          if (seq < B && pos < N) reinterpret_cast<cx<R>*>(out)[seq * N + pos] = mk(sm.tile[0][pe], sm.tile[1][pe]);
        }
      }
      st[ex.slot(tid)].xr = st[ex.slot(tid)].xr_next;
    }
  }
}

// --- backward -------------------------------------------------------------------------------------

// The tangents' affine scans, then the messages: tL entering every chunk and gR' at the first position
// of the next chunk.
template <typename R, int T, int L, class Ex>
BK_HD void scan_affine(const Ex& ex, Smem<R, T, L, 5>& sm, BwdThr<R, L>* st, const Geo& g, bool right) {
  ex.sync();
  const auto acmp = [](const aff<R>& x, const aff<R>& y, int) { return acomp(x, y); };
  warp_scan<aff<R>>(ex, g.P, 0, false, sm.wal, [&](int t) { return st[ex.slot(t)].al; },
                       [&](int t, const aff<R>& m) { st[ex.slot(t)].al = m; }, acmp);
  if (right)
    warp_scan<aff<R>>(ex, g.P, 1, true, sm.war, [&](int t) { return st[ex.slot(t)].ar; },
                         [&](int t, const aff<R>& m) { st[ex.slot(t)].ar = m; }, acmp);
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

// v_j = conj(w_j) for the chunk positions q V .. q V + V - 1, from the interleaved w array (two vectors).
template <typename R> struct wv { cx<R> v[16 / sizeof(R)]; };
template <typename R> BK_HD wv<R> ldw(const R* wt, int e) {
  constexpr int V = vq_n<R>();
  wv<R> r;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const vq<R> x = ldv(wt, 2 * e + h * V);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) r.v[h * (V / 2) + i] = mk(x.x[2 * i], -x.x[2 * i + 1]);
  }
  return r;
}

// The chunk's tangent maps from its boundary values: left tL_in -> tL_out (sL_j kept in registers),
// right gR'(next chunk) -> gR'(first position).
template <typename R, int T, int L, class Ex>
BK_HD void chunk_tangent_maps(const Ex& ex, Smem<R, T, L, 5>& sm, BwdThr<R, L>* st, bool right, R zi) {
  constexpr int V = vq_n<R>();
  const R* wt = sm.tile[3];
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
    BwdThr<R, L>& th = st[ex.slot(tid)];
    const int base = tid * L;
    aff<R> al, ar;
    al.A = mk<R>(1, 0); al.B = mk<R>(0, 0); ar = al;
    cx<R> s = th.s_in;
#pragma unroll
    for (int q = 0; q < L / V; ++q) {
      const vq<R> vd = ldv(sm.tile[0], base + q * V), vb = ldv(sm.tile[1], base + q * V),
                  vc = ldv(sm.tile[2], base + q * V);
      const wv<R> vv = ldw(wt, base + q * V);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const R dr = vd.x[i], k = vb.x[i] * vc.x[i];
        th.sl[q * V + i] = s;
        const cx<R> gl = inv(mk(dr - s.re, -zi - s.im));
        const cx<R> alpha = k * (gl * gl);
        al.A = alpha * al.A;
        al.B = alpha * (al.B + vv.v[i]);
        s = k * gl;
      }
    }
    th.al = al;
    if (right) {
      cx<R> gr = th.g_in;
#pragma unroll
      for (int q = L / V - 1; q >= 0; --q) {
        const vq<R> vd = ldv(sm.tile[0], base + q * V), vb = ldv(sm.tile[1], base + q * V),
                    vc = ldv(sm.tile[2], base + q * V);
        const wv<R> vv = ldw(wt, base + q * V);
#pragma unroll
        for (int i = V - 1; i >= 0; --i) {
          const R dr = vd.x[i], k = vb.x[i] * vc.x[i];
          const cx<R> sr = k * gr;
          gr = inv(mk(dr - sr.re, -zi - sr.im));
          const cx<R> g2 = gr * gr;
          ar.A = k * (g2 * ar.A);
          ar.B = g2 * (k * ar.B + vv.v[i]);
        }
      }
      th.ar = ar;
    }
  }
}

template <typename R, int T, int L, class Ex>
BK_HD void bwd_block(const Ex& ex, long long blk, Smem<R, T, L, 5>& sm, BwdThr<R, L>* st, const R* a, const R* b,
                     const R* c, const R* w, R* ga, R* gb, R* gc, cx<R>* ws, long long B, long long N, int lp,
                     R zr, R zi) {
  constexpr int V = vq_n<R>();
  const Geo g = geometry<T, L>(blk, N, lp);
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
      const int base = tid * L;
      const R* wt = sm.tile[3];
      cx<R> t = th.t_in;
#pragma unroll
      for (int q = 0; q < L / V; ++q) {                             // tL_j in registers
        const vq<R> vd = ldv(sm.tile[0], base + q * V), vb = ldv(sm.tile[1], base + q * V),
                    vc = ldv(sm.tile[2], base + q * V);
        const wv<R> vv = ldw(wt, base + q * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int j = q * V + i;
          const R k = vb.x[i] * vc.x[i];
          const cx<R> gl = inv(mk(vd.x[i] - th.sl[j].re, -zi - th.sl[j].im));
          th.tl[j] = t;
          t = k * ((gl * gl) * (vv.v[i] + t));
        }
      }
      cx<R> gr = th.g_in, grp = th.gp_in;                           // gR_{j+1}, gR'_{j+1}
#pragma unroll
      for (int q = L / V - 1; q >= 0; --q) {
        vq<R> vd = ldv(sm.tile[0], base + q * V), vb = ldv(sm.tile[1], base + q * V), vc = ldv(sm.tile[2], base + q * V);
        const wv<R> vv = ldw(wt, base + q * V);
#pragma unroll
        for (int i = V - 1; i >= 0; --i) {
          const int j = q * V + i;
          const R dr = vd.x[i], bv = vb.x[i], cv = vc.x[i], k = bv * cv;
          const cx<R> sr = k * gr, tr = k * grp;
          const cx<R> gg = inv(mk(dr - th.sl[j].re - sr.re, -zi - th.sl[j].im - sr.im));
          const cx<R> gp = (gg * gg) * (vv.v[i] + th.tl[j] + tr);
          const R p = (gp * gr).re + (gg * grp).re;
          vd.x[i] = -gp.re;                                         // the tile becomes (da, db, dc)
          vb.x[i] = cv * p;
          vc.x[i] = bv * p;
          const cx<R> gn = inv(mk(dr - sr.re, -zi - sr.im));
          grp = (gn * gn) * (vv.v[i] + tr);
          gr = gn;
        }
        stv(sm.tile[0], base + q * V, vd);
        stv(sm.tile[1], base + q * V, vb);
        stv(sm.tile[2], base + q * V, vc);
      }
    }
    ex.sync();
    const long long col0 = tile * g.W;
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      if (g.S == 1) {
        if (g.seq0 < B) {
          R *gar = ga + g.seq0 * N + col0, *gbr = gb + g.seq0 * (N - 1) + col0, *gcr = gc + g.seq0 * (N - 1) + col0;
          const long long lim = N - col0;
#pragma unroll 8
          for (int k = 0; k < L; ++k) {
            const int e = tid + k * T, pe = sw<R>(e);
            if (e < lim) gar[e] = sm.tile[0][pe];
            if (e + 1 < lim) {
              gbr[e] = sm.tile[1][pe];
              gcr[e] = sm.tile[2][pe];
            }
          }
        }
      } else {
#pragma unroll 4
        for (int k = 0; k < L; ++k) {
          const int e = tid + k * T, pe = sw<R>(e);
          const long long seq = g.seq0 + (e >> g.lw), pos = col0 + (e & (g.W - 1));
          if (seq >= B || pos >= N) continue;
          ga[seq * N + pos] = sm.tile[0][pe];
          if (pos < N - 1) {
            gb[seq * (N - 1) + pos] = sm.tile[1][pe];
            gc[seq * (N - 1) + pos] = sm.tile[2][pe];
          }
        }
      }
      BwdThr<R, L>& th = st[ex.slot(tid)];
      th.xr = th.xr_next;
      th.xrp = th.xrp_next;
    }
  }
}

// --- configurations, kernels, launchers -----------------------------------------------------------
// (T threads, L positions per thread, M blocks per SM the registers are bounded for). float32
// forward: 128 x 16 x 7 (a 2048-position tile, one sequence of the N = 2048 benchmark per block);
// float32 backward: 128 x 16 x 3; float64: 64 x 16 forward, 64 x 8 backward (register pressure).

template <int T, int L> int plan_lp(long long N) {
  const long long chunks = (N + L - 1) / L;
  int lp = 0;
  while ((1LL << lp) < chunks && (1 << lp) < T) ++lp;
  return lp;
}

extern __shared__ __align__(32) unsigned char bk_smem[];

// The dynamic shared memory a block needs, and the largest carveout, so that the blocks the
// registers allow (M) are not held back by a smaller default split of L1 and shared memory.
template <class K> cudaError_t smem_attributes(K kernel, size_t smem) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, (int)cudaSharedmemCarveoutMaxShared);
}

template <typename R, int T, int L, int M>
__global__ void __launch_bounds__(T, M) _bk_forward_kernel(const R* a, const R* b, const R* c, R* out, cx<R>* ws,
                                                        long long B, long long N, int lp, R zr, R zi) {
  Smem<R, T, L, 3>& sm = *reinterpret_cast<Smem<R, T, L, 3>*>(bk_smem);
  FwdThr<R, L> st[1];
  fwd_block<R, T, L>(DeviceExec(), blockIdx.x, sm, st, a, b, c, out, ws, B, N, lp, zr, zi);
}

template <typename R, int T, int L, int M>
__global__ void __launch_bounds__(T, M) _bk_backward_kernel(const R* a, const R* b, const R* c, const R* w, R* ga,
                                                         R* gb, R* gc, cx<R>* ws, long long B, long long N, int lp,
                                                         R zr, R zi) {
  Smem<R, T, L, 5>& sm = *reinterpret_cast<Smem<R, T, L, 5>*>(bk_smem);
  BwdThr<R, L> st[1];
  bwd_block<R, T, L>(DeviceExec(), blockIdx.x, sm, st, a, b, c, w, ga, gb, gc, ws, B, N, lp, zr, zi);
}

template <int T, int L, int M> long long ws_elems_cfg(long long B, long long N, bool backward) {
  if (N <= (long long)T * L) return 0;
  const long long nt = (N + T * L - 1) / (T * L);
  return B * nt * (backward ? 4 : 2);                             // complex xl (and xtl) per tile
}

template <typename R, int T, int L, int M>
int launch_forward_cfg(const R* a, const R* b, const R* c, R* out, R* ws, long long B, long long N, double zr,
                       double zi, void* stream) {
  if (B <= 0 || N <= 0) return 0;
  const int lp = plan_lp<T, L>(N);
  const long long S = T >> lp, blocks = (B + S - 1) / S;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
  const size_t smem = sizeof(Smem<R, T, L, 3>);
  const cudaError_t err = smem_attributes(_bk_forward_kernel<R, T, L, M>, smem);
  if (err != cudaSuccess) return (int)err;
  if (N == 1) b = c = a;                                          // b, c are empty: never read
  _bk_forward_kernel<R, T, L, M><<<(unsigned)blocks, T, smem, (cudaStream_t)stream>>>(
      a, b, c, out, reinterpret_cast<cx<R>*>(ws), B, N, lp, (R)zr, (R)zi);
  return (int)cudaGetLastError();
}

template <typename R, int T, int L, int M>
int launch_backward_cfg(const R* a, const R* b, const R* c, const R* w, R* ga, R* gb, R* gc, R* ws, long long B,
                        long long N, double zr, double zi, void* stream) {
  if (B <= 0 || N <= 0) return 0;
  const int lp = plan_lp<T, L>(N);
  const long long S = T >> lp, blocks = (B + S - 1) / S;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
  const size_t smem = sizeof(Smem<R, T, L, 5>);
  const cudaError_t err = smem_attributes(_bk_backward_kernel<R, T, L, M>, smem);
  if (err != cudaSuccess) return (int)err;
  if (N == 1) { b = c = a; gb = gc = ga; }
  _bk_backward_kernel<R, T, L, M><<<(unsigned)blocks, T, smem, (cudaStream_t)stream>>>(
      a, b, c, w, ga, gb, gc, reinterpret_cast<cx<R>*>(ws), B, N, lp, (R)zr, (R)zi);
  return (int)cudaGetLastError();
}

template <typename R, int T, int L, int M>
int host_forward_cfg(const R* a, const R* b, const R* c, R* out, R* ws, long long B, long long N, double zr,
                     double zi) {
  const int lp = plan_lp<T, L>(N);
  Smem<R, T, L, 3>* sm = new Smem<R, T, L, 3>;
  FwdThr<R, L>* st = new FwdThr<R, L>[T];
  unsigned char* xbuf = new unsigned char[2 * T * HostExec::XW];
  if (N == 1) b = c = a;
  for (long long blk = 0; blk * (T >> lp) < B; ++blk)
    fwd_block<R, T, L>(HostExec{T, xbuf}, blk, *sm, st, a, b, c, out, reinterpret_cast<cx<R>*>(ws), B, N, lp, (R)zr,
                       (R)zi);
  delete sm;
  delete[] st;
  delete[] xbuf;
  return 0;
}

template <typename R, int T, int L, int M>
int host_backward_cfg(const R* a, const R* b, const R* c, const R* w, R* ga, R* gb, R* gc, R* ws, long long B,
                      long long N, double zr, double zi) {
  const int lp = plan_lp<T, L>(N);
  Smem<R, T, L, 5>* sm = new Smem<R, T, L, 5>;
  BwdThr<R, L>* st = new BwdThr<R, L>[T];
  unsigned char* xbuf = new unsigned char[2 * T * HostExec::XW];
  if (N == 1) { b = c = a; gb = gc = ga; }
  for (long long blk = 0; blk * (T >> lp) < B; ++blk)
    bwd_block<R, T, L>(HostExec{T, xbuf}, blk, *sm, st, a, b, c, w, ga, gb, gc, reinterpret_cast<cx<R>*>(ws), B, N, lp,
                       (R)zr, (R)zi);
  delete sm;
  delete[] st;
  delete[] xbuf;
  return 0;
}

template <int T, int L, int M> constexpr int tile_positions() { return T * L; }

}  // namespace bk

// Default configurations: threads per block _T, positions per thread _L (-D overrides both; L a power
// of two <= 32, see chunk_base).
#ifndef BK_FWD_F32_T
#define BK_FWD_F32_T 128
#define BK_FWD_F32_L 16
#endif
#ifndef BK_FWD_F32_M
#define BK_FWD_F32_M 7
#endif
#define BK_FWD_F32 BK_FWD_F32_T, BK_FWD_F32_L, BK_FWD_F32_M
#ifndef BK_BWD_F32_T
#define BK_BWD_F32_T 128
#define BK_BWD_F32_L 16
#endif
#ifndef BK_BWD_F32_M
#define BK_BWD_F32_M 3
#endif
#define BK_BWD_F32 BK_BWD_F32_T, BK_BWD_F32_L, BK_BWD_F32_M
#ifndef BK_FWD_F64_T
#define BK_FWD_F64_T 64
#define BK_FWD_F64_L 16
#endif
#define BK_FWD_F64 BK_FWD_F64_T, BK_FWD_F64_L, 1
#ifndef BK_BWD_F64_T
#define BK_BWD_F64_T 64
#define BK_BWD_F64_L 8
#endif
#define BK_BWD_F64 BK_BWD_F64_T, BK_BWD_F64_L, 1

// --- C ABI (declared in 12_bk_core.h): raw pointers, row-major, the stream as void* -------------------

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
