// BK-Core in plain CUDA C++: G_i = [(T - zI)^-1]_ii for a batch of tridiagonal T, and its exact
// gradient. No torch headers: CI checks it with `nvcc -arch=sm_90 -c kernels/bk_core.cu`; the torch
// binding lives in hwlib/ops/bk_cuda.py and hwlib/cuda.py loads both with load_inline.
//
// Math (derivation in hwlib/ops/bk_reference.py), d_i = a_i - z, k_j = b_j c_j:
//   sL_i = k_{i-1} gL_{i-1},  gL_i = 1 / (d_i - sL_i)        left to right
//   sR_i = k_i gR_{i+1},      gR_i = 1 / (d_i - sR_i)        right to left
//   G_i  = 1 / (d_i - sL_i - sR_i)
// Backward, forward-mode tangent with v = conj(grad):
//   gL_i' = gL_i^2 (v_i + tL_i), tL_i = k_{i-1} gL_{i-1}';  gR_i' = gR_i^2 (v_i + tR_i), tR_i = k_i gR_{i+1}'
//   G_i' = G_i^2 (v_i + tL_i + tR_i);  da_i = -Re G_i';  P_i = G_i' gR_{i+1} + G_i gR_{i+1}'
//   db_i = c_i Re P_i;  dc_i = b_i Re P_i
//
// Layout: row-major a [B, N], b, c [B, N-1], out [B, N] complex (re, im interleaved). One thread
// per sequence, T sequences per block. Coalescing comes from staging: the block copies a tile of
// C positions x T sequences into shared memory with consecutive threads on consecutive addresses,
// then each thread walks its own column of the tile ([C][T+1]: the +1 keeps both views free of
// bank conflicts). Outputs leave through the same kind of tile.
//
// Chunked recompute instead of a stored gL: pass 1 (left to right) keeps only sL at every chunk
// start (in a [chunks, B] workspace, coalesced across threads); pass 2 walks the chunks right to
// left, reloads each tile once, recomputes sL inside it from the saved boundary into shared
// memory, then sweeps it right to left for gR and G. DRAM bytes per element, float32:
//   forward:  12 (pass 1 reads a, b, c) + 12 (pass 2 reads them again) + 8 (G) + 8/C = ~32.5
//             (minimal 20; a two-pass kernel that stores gL moves 48)
//   backward: 20 + 20 (a, b, c, grad twice) + 12 (da, db, dc) + 16/C = ~53 (minimal 32)
// FLOPs per element: forward ~50 (three complex reciprocals, sL recomputed once), backward ~120.
// float64 halves the tile depth of the backward so that shared memory stays under 48 KiB static.
//
// The same block code runs on the host (HostExec: every "thread" of a phase in turn, a barrier
// being the end of a phase), exported as bk_core_*_host_*: tests check the indexing and chunking
// against the float64 reference on a machine without a GPU.

#include <cuda_runtime.h>
#include <stdint.h>

namespace bk {

template <typename R> struct cx { R re, im; };

template <typename R> __host__ __device__ __forceinline__ cx<R> mk(R re, R im) { cx<R> w; w.re = re; w.im = im; return w; }
template <typename R> __host__ __device__ __forceinline__ cx<R> operator+(cx<R> x, cx<R> y) { return mk(x.re + y.re, x.im + y.im); }
template <typename R> __host__ __device__ __forceinline__ cx<R> operator-(cx<R> x, cx<R> y) { return mk(x.re - y.re, x.im - y.im); }
template <typename R> __host__ __device__ __forceinline__ cx<R> operator*(cx<R> x, cx<R> y) {
  return mk(x.re * y.re - x.im * y.im, x.re * y.im + x.im * y.re);
}
template <typename R> __host__ __device__ __forceinline__ cx<R> operator*(R s, cx<R> x) { return mk(s * x.re, s * x.im); }

// Correctly rounded reciprocals on both sides, so host and device agree up to FMA contraction.
__host__ __device__ __forceinline__ float rcp(float x) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}
__host__ __device__ __forceinline__ double rcp(double x) {
#ifdef __CUDA_ARCH__
  return __drcp_rn(x);
#else
  return 1.0 / x;
#endif
}
// 1 / w; |w|^2 must stay in range (|a - z| < 1e19 in float32), which bounded resolvents respect.
template <typename R> __host__ __device__ __forceinline__ cx<R> inv(cx<R> w) {
  R s = rcp(w.re * w.re + w.im * w.im);
  return mk(w.re * s, -w.im * s);
}

// One thread per sequence on the device; every thread of a phase in turn on the host.
struct DeviceExec {
  __host__ __device__ int lo() const {
#ifdef __CUDA_ARCH__
    return threadIdx.x;
#else
    return 0;
#endif
  }
  __host__ __device__ int hi() const { return lo() + 1; }
  __host__ __device__ int slot(int) const { return 0; }
  __host__ __device__ void sync() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
};
struct HostExec {
  int n;
  __host__ __device__ int lo() const { return 0; }
  __host__ __device__ int hi() const { return n; }
  __host__ __device__ int slot(int t) const { return t; }
  __host__ __device__ void sync() const {}
};

template <typename R, int T, int C> struct FwdTile {
  R a[C][T + 1], k[C][T + 1], sre[C][T + 1], sim[C][T + 1];   // sL, then G, per position
};
template <typename R, int T, int C> struct BwdTile {
  R a[C][T + 1], b[C][T + 1], c[C][T + 1], wre[C][T + 1], wim[C][T + 1];
  R slr[C][T + 1], sli[C][T + 1], tlr[C][T + 1], tli[C][T + 1];
};
template <typename R> struct FwdState { cx<R> s; };             // sL (pass 1), gR_{i+1} (pass 2)
template <typename R> struct BwdState { cx<R> s, t; };          // (sL, tL), then (gR, gR')

// Stage positions [s0, s0 + C) of sequences [b0, b0 + T): consecutive l = consecutive addresses.
template <typename R, int T, int C, class Ex>
__host__ __device__ __forceinline__ void load_fwd(const Ex& ex, FwdTile<R, T, C>& sm, const R* a, const R* b,
                                                  const R* c, long long b0, long long s0, long long B, long long N) {
  for (int tid = ex.lo(); tid < ex.hi(); ++tid)
    for (int l = tid; l < T * C; l += T) {
      const int t = l / C, j = l % C;
      const long long seq = b0 + t, pos = s0 + j;
      R av = 0, kv = 0;
      if (seq < B && pos < N) {
        av = a[seq * N + pos];
        if (pos < N - 1) kv = b[seq * (N - 1) + pos] * c[seq * (N - 1) + pos];
      }
      sm.a[j][t] = av;
      sm.k[j][t] = kv;
    }
}

template <typename R, int T, int C, class Ex>
__host__ __device__ void fwd_block(const Ex& ex, long long blk, FwdTile<R, T, C>& sm, FwdState<R>* st,
                                   const R* a, const R* b, const R* c, R* out, cx<R>* ws,
                                   long long B, long long N, R zr, R zi) {
  const long long b0 = blk * T, nch = (N + C - 1) / C;
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].s = mk<R>(0, 0);
  for (long long ch = 0; ch < nch; ++ch) {                       // pass 1: sL at chunk starts
    const long long s0 = ch * C;
    ex.sync();
    load_fwd(ex, sm, a, b, c, b0, s0, B, N);
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      const long long seq = b0 + tid;
      if (seq >= B) continue;
      cx<R> s = st[ex.slot(tid)].s;
      if (ch > 0) ws[ch * B + seq] = s;
#pragma unroll
      for (int j = 0; j < C; ++j)
        if (s0 + j < N) s = sm.k[j][tid] * inv(mk(sm.a[j][tid] - zr, -zi) - s);
      st[ex.slot(tid)].s = s;
    }
  }
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].s = mk<R>(0, 0);
  for (long long ch = nch - 1; ch >= 0; --ch) {                  // pass 2: recompute sL, sweep back
    const long long s0 = ch * C;
    ex.sync();
    load_fwd(ex, sm, a, b, c, b0, s0, B, N);
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      const long long seq = b0 + tid;
      if (seq >= B) continue;
      cx<R> s = ch > 0 ? ws[ch * B + seq] : mk<R>(0, 0);
#pragma unroll
      for (int j = 0; j < C; ++j)
        if (s0 + j < N) {
          sm.sre[j][tid] = s.re;
          sm.sim[j][tid] = s.im;
          s = sm.k[j][tid] * inv(mk(sm.a[j][tid] - zr, -zi) - s);
        }
      cx<R> gr = st[ex.slot(tid)].s;                             // gR_{s0 + C}, 0 past the end
#pragma unroll
      for (int j = C - 1; j >= 0; --j)
        if (s0 + j < N) {
          const cx<R> d = mk(sm.a[j][tid] - zr, -zi), sr = sm.k[j][tid] * gr;
          const cx<R> g = inv(d - mk(sm.sre[j][tid], sm.sim[j][tid]) - sr);
          sm.sre[j][tid] = g.re;
          sm.sim[j][tid] = g.im;
          gr = inv(d - sr);
        }
      st[ex.slot(tid)].s = gr;
    }
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid)
      for (int l = tid; l < 2 * T * C; l += T) {
        const int t = l / (2 * C), r = l % (2 * C), j = r >> 1;
        const long long seq = b0 + t, pos = s0 + j;
        if (seq < B && pos < N) out[(seq * N + pos) * 2 + (r & 1)] = (r & 1) ? sm.sim[j][t] : sm.sre[j][t];
      }
  }
}

template <typename R, int T, int C, class Ex>
__host__ __device__ __forceinline__ void load_bwd(const Ex& ex, BwdTile<R, T, C>& sm, const R* a, const R* b,
                                                  const R* c, const R* w, long long b0, long long s0,
                                                  long long B, long long N) {
  for (int tid = ex.lo(); tid < ex.hi(); ++tid)
    for (int l = tid; l < T * C; l += T) {
      const int t = l / C, j = l % C;
      const long long seq = b0 + t, pos = s0 + j;
      R av = 0, bv = 0, cv = 0, wr = 0, wi = 0;
      if (seq < B && pos < N) {
        av = a[seq * N + pos];
        wr = w[(seq * N + pos) * 2];
        wi = w[(seq * N + pos) * 2 + 1];
        if (pos < N - 1) {
          bv = b[seq * (N - 1) + pos];
          cv = c[seq * (N - 1) + pos];
        }
      }
      sm.a[j][t] = av; sm.b[j][t] = bv; sm.c[j][t] = cv; sm.wre[j][t] = wr; sm.wim[j][t] = wi;
    }
}

template <typename R, int T, int C, class Ex>
__host__ __device__ void bwd_block(const Ex& ex, long long blk, BwdTile<R, T, C>& sm, BwdState<R>* st,
                                   const R* a, const R* b, const R* c, const R* w, R* ga, R* gb, R* gc,
                                   cx<R>* ws, long long B, long long N, R zr, R zi) {
  const long long b0 = blk * T, nch = (N + C - 1) / C;
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].s = st[ex.slot(tid)].t = mk<R>(0, 0);
  for (long long ch = 0; ch < nch; ++ch) {                       // pass 1: (sL, tL) at chunk starts
    const long long s0 = ch * C;
    ex.sync();
    load_bwd(ex, sm, a, b, c, w, b0, s0, B, N);
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      const long long seq = b0 + tid;
      if (seq >= B) continue;
      cx<R> s = st[ex.slot(tid)].s, t = st[ex.slot(tid)].t;
      if (ch > 0) { ws[(ch * B + seq) * 2] = s; ws[(ch * B + seq) * 2 + 1] = t; }
#pragma unroll
      for (int j = 0; j < C; ++j)
        if (s0 + j < N) {
          const R k = sm.b[j][tid] * sm.c[j][tid];
          const cx<R> gl = inv(mk(sm.a[j][tid] - zr, -zi) - s);
          const cx<R> glp = (gl * gl) * (mk(sm.wre[j][tid], -sm.wim[j][tid]) + t);
          s = k * gl;
          t = k * glp;
        }
      st[ex.slot(tid)].s = s;
      st[ex.slot(tid)].t = t;
    }
  }
  for (int tid = ex.lo(); tid < ex.hi(); ++tid) st[ex.slot(tid)].s = st[ex.slot(tid)].t = mk<R>(0, 0);
  for (long long ch = nch - 1; ch >= 0; --ch) {                  // pass 2
    const long long s0 = ch * C;
    ex.sync();
    load_bwd(ex, sm, a, b, c, w, b0, s0, B, N);
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid) {
      const long long seq = b0 + tid;
      if (seq >= B) continue;
      cx<R> s = mk<R>(0, 0), t = mk<R>(0, 0);
      if (ch > 0) { s = ws[(ch * B + seq) * 2]; t = ws[(ch * B + seq) * 2 + 1]; }
#pragma unroll
      for (int j = 0; j < C; ++j)
        if (s0 + j < N) {
          sm.slr[j][tid] = s.re; sm.sli[j][tid] = s.im; sm.tlr[j][tid] = t.re; sm.tli[j][tid] = t.im;
          const R k = sm.b[j][tid] * sm.c[j][tid];
          const cx<R> gl = inv(mk(sm.a[j][tid] - zr, -zi) - s);
          const cx<R> glp = (gl * gl) * (mk(sm.wre[j][tid], -sm.wim[j][tid]) + t);
          s = k * gl;
          t = k * glp;
        }
      cx<R> gr = st[ex.slot(tid)].s, grp = st[ex.slot(tid)].t;  // gR_{i+1}, gR_{i+1}'
#pragma unroll
      for (int j = C - 1; j >= 0; --j)
        if (s0 + j < N) {
          const R bv = sm.b[j][tid], cv = sm.c[j][tid], k = bv * cv;
          const cx<R> d = mk(sm.a[j][tid] - zr, -zi), v = mk(sm.wre[j][tid], -sm.wim[j][tid]);
          const cx<R> sr = k * gr, tr = k * grp;
          const cx<R> g = inv(d - mk(sm.slr[j][tid], sm.sli[j][tid]) - sr);
          const cx<R> gp = (g * g) * (v + mk(sm.tlr[j][tid], sm.tli[j][tid]) + tr);
          const R p = (gp * gr + g * grp).re;
          sm.a[j][tid] = -gp.re;                                 // the tile becomes (da, db, dc)
          sm.b[j][tid] = cv * p;
          sm.c[j][tid] = bv * p;
          gr = inv(d - sr);
          grp = (gr * gr) * (v + tr);
        }
      st[ex.slot(tid)].s = gr;
      st[ex.slot(tid)].t = grp;
    }
    ex.sync();
    for (int tid = ex.lo(); tid < ex.hi(); ++tid)
      for (int l = tid; l < T * C; l += T) {
        const int t = l / C, j = l % C;
        const long long seq = b0 + t, pos = s0 + j;
        if (seq >= B || pos >= N) continue;
        ga[seq * N + pos] = sm.a[j][t];
        if (pos < N - 1) {
          gb[seq * (N - 1) + pos] = sm.b[j][t];
          gc[seq * (N - 1) + pos] = sm.c[j][t];
        }
      }
  }
}

constexpr int kThreads = 64;
template <typename R> struct Chunk { static constexpr int fwd = 16, bwd = 16; };
template <> struct Chunk<double> { static constexpr int fwd = 16, bwd = 8; };   // 48 KiB static smem

template <typename R>
__global__ void __launch_bounds__(kThreads) _bk_forward_kernel(const R* a, const R* b, const R* c, R* out,
                                                               cx<R>* ws, long long B, long long N, R zr, R zi) {
  __shared__ FwdTile<R, kThreads, Chunk<R>::fwd> sm;
  FwdState<R> st[1];
  fwd_block<R, kThreads, Chunk<R>::fwd>(DeviceExec(), blockIdx.x, sm, st, a, b, c, out, ws, B, N, zr, zi);
}

template <typename R>
__global__ void __launch_bounds__(kThreads) _bk_backward_kernel(const R* a, const R* b, const R* c, const R* w,
                                                                R* ga, R* gb, R* gc, cx<R>* ws, long long B,
                                                                long long N, R zr, R zi) {
  __shared__ BwdTile<R, kThreads, Chunk<R>::bwd> sm;
  BwdState<R> st[1];
  bwd_block<R, kThreads, Chunk<R>::bwd>(DeviceExec(), blockIdx.x, sm, st, a, b, c, w, ga, gb, gc, ws, B, N, zr, zi);
}

template <typename R> long long ws_elems(long long B, long long N, bool backward) {
  const int C = backward ? Chunk<R>::bwd : Chunk<R>::fwd;
  return ((N + C - 1) / C) * B * (backward ? 4 : 2);             // complex (sL) or (sL, tL) per chunk
}

template <typename R>
int launch_forward(const R* a, const R* b, const R* c, R* out, R* ws, long long B, long long N, double zr,
                   double zi, void* stream) {
  if (B <= 0 || N <= 0) return 0;
  const long long blocks = (B + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
  _bk_forward_kernel<R><<<(unsigned)blocks, kThreads, 0, (cudaStream_t)stream>>>(
      a, b, c, out, reinterpret_cast<cx<R>*>(ws), B, N, (R)zr, (R)zi);
  return (int)cudaGetLastError();
}

template <typename R>
int launch_backward(const R* a, const R* b, const R* c, const R* w, R* ga, R* gb, R* gc, R* ws, long long B,
                    long long N, double zr, double zi, void* stream) {
  if (B <= 0 || N <= 0) return 0;
  const long long blocks = (B + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffLL) return (int)cudaErrorInvalidValue;
  _bk_backward_kernel<R><<<(unsigned)blocks, kThreads, 0, (cudaStream_t)stream>>>(
      a, b, c, w, ga, gb, gc, reinterpret_cast<cx<R>*>(ws), B, N, (R)zr, (R)zi);
  return (int)cudaGetLastError();
}

template <typename R>
int host_forward(const R* a, const R* b, const R* c, R* out, R* ws, long long B, long long N, double zr, double zi) {
  constexpr int C = Chunk<R>::fwd;
  FwdTile<R, kThreads, C>* sm = new FwdTile<R, kThreads, C>;
  FwdState<R>* st = new FwdState<R>[kThreads];
  for (long long blk = 0; blk * kThreads < B; ++blk)
    fwd_block<R, kThreads, C>(HostExec{kThreads}, blk, *sm, st, a, b, c, out, reinterpret_cast<cx<R>*>(ws), B, N,
                              (R)zr, (R)zi);
  delete sm;
  delete[] st;
  return 0;
}

template <typename R>
int host_backward(const R* a, const R* b, const R* c, const R* w, R* ga, R* gb, R* gc, R* ws, long long B,
                  long long N, double zr, double zi) {
  constexpr int C = Chunk<R>::bwd;
  BwdTile<R, kThreads, C>* sm = new BwdTile<R, kThreads, C>;
  BwdState<R>* st = new BwdState<R>[kThreads];
  for (long long blk = 0; blk * kThreads < B; ++blk)
    bwd_block<R, kThreads, C>(HostExec{kThreads}, blk, *sm, st, a, b, c, w, ga, gb, gc,
                              reinterpret_cast<cx<R>*>(ws), B, N, (R)zr, (R)zi);
  delete sm;
  delete[] st;
  return 0;
}

}  // namespace bk

// --- C ABI: raw pointers, row-major, the stream as void* so callers need no CUDA headers ----------
// out / w: complex [B, N] as interleaved reals. ws: bk_core_workspace_elems(...) reals, any content.
// Return: 0 or a cudaError_t code (bk_core_error_string turns it into text).

extern "C" {

long long bk_core_workspace_elems(long long B, long long N, int is_double, int backward) {
  return is_double ? bk::ws_elems<double>(B, N, backward != 0) : bk::ws_elems<float>(B, N, backward != 0);
}

const char* bk_core_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

int bk_core_forward_f32(const float* a, const float* b, const float* c, float* out, float* ws, long long B,
                        long long N, double zr, double zi, void* stream) {
  return bk::launch_forward<float>(a, b, c, out, ws, B, N, zr, zi, stream);
}
int bk_core_forward_f64(const double* a, const double* b, const double* c, double* out, double* ws, long long B,
                        long long N, double zr, double zi, void* stream) {
  return bk::launch_forward<double>(a, b, c, out, ws, B, N, zr, zi, stream);
}
int bk_core_backward_f32(const float* a, const float* b, const float* c, const float* w, float* ga, float* gb,
                         float* gc, float* ws, long long B, long long N, double zr, double zi, void* stream) {
  return bk::launch_backward<float>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi, stream);
}
int bk_core_backward_f64(const double* a, const double* b, const double* c, const double* w, double* ga,
                         double* gb, double* gc, double* ws, long long B, long long N, double zr, double zi,
                         void* stream) {
  return bk::launch_backward<double>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi, stream);
}

// The same block code, run on the CPU: for tests on machines without a GPU. Not fast.
int bk_core_forward_host_f32(const float* a, const float* b, const float* c, float* out, float* ws, long long B,
                             long long N, double zr, double zi) {
  return bk::host_forward<float>(a, b, c, out, ws, B, N, zr, zi);
}
int bk_core_forward_host_f64(const double* a, const double* b, const double* c, double* out, double* ws,
                             long long B, long long N, double zr, double zi) {
  return bk::host_forward<double>(a, b, c, out, ws, B, N, zr, zi);
}
int bk_core_backward_host_f32(const float* a, const float* b, const float* c, const float* w, float* ga,
                              float* gb, float* gc, float* ws, long long B, long long N, double zr, double zi) {
  return bk::host_backward<float>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi);
}
int bk_core_backward_host_f64(const double* a, const double* b, const double* c, const double* w, double* ga,
                              double* gb, double* gc, double* ws, long long B, long long N, double zr, double zi) {
  return bk::host_backward<double>(a, b, c, w, ga, gb, gc, ws, B, N, zr, zi);
}

}  // extern "C"
