// Cross-entropy of one chunk of logits rows, and its gradient written over the logits, reading each
// row from memory once: the CUDA row pass of the fused LM head (hwlib/steps/s17_fused_lm_head/op.py). The Triton
// row pass (17_linear_ce_triton.py) computes the same formulas in two passes over the row in memory.
//
// For the rows n of z [C, V_pad] (only the first V columns are classes), targets t_n, and s the
// mean's weight (1 / #{n : t_n != ignore_index}, on the device):
//   lse_n  = log sum_{v < V} exp(z_nv)                 (fp32)
//   loss_n = lse_n - z_{n, t_n}                        (0 where t_n = ignore_index; NaN where t_n is
//                                                       outside [0, V) and not ignore_index)
//   dz_nv  = (exp(z_nv - lse_n) - [v = t_n]) * s_n     for every v < V_pad (exp of a padded column is
//                                                       0), s_n = 0 on ignored rows, NaN on bad ones
// written over z in place (the caller's next GEMMs read it).
//
// One block owns one row. Its threads copy the row into shared memory with cp.async, 16 bytes at a
// time (thread k copies vectors k, k + T, ...; each thread reads back only its own vectors, so no
// barrier is needed before pass 1); pass 1 keeps a running max m and sum of exp(z - m) per thread
// (rescaled once per 8-column vector whose maximum exceeds m), and one block reduction combines the
// threads' (m, sum) pairs in a fixed order; pass 2 reads the row again from shared memory and writes
// the gradient to z with 16-byte stores. Two blocks fit an SM (2 x 100.6 kB of shared memory at
// GPT-2's V_pad = 50,304), so one block's load overlaps the other's passes.
//
// Bytes per row, 2-byte logits: read 2 V_pad + 8 (target), write 2 V_pad + 4 (loss): 4 V_pad, the
// least a pass that reads the logits and writes their gradient can move (the Triton pass moves
// ~6 V: it reads the row twice). GPT-2, 16,384 rows: 3.3 GB a step against 4.9.
// FLOPs ~6 per column (a max, a subtract and an exp in each pass, the scale); exponentials: ~2.1 per
// column (pass 1's rescales add about one per 8-column vector early in a row, rarely later).
// Measured (notebook 17, H100, one chunk of 4,096 x 50,304 bf16 logits, at 23e9da7): 0.359 ms, 2.3 TB/s on
// its 0.82 GB; the Triton pass at its best launch 0.432 ms (0.461 at its default) on 1.24 GB. In the
// training step (notebook 16, step 22) the row pass went from ~1.77 to ~1.43 ms a step.
// Tried and left out (a probe, interleaved on one H100, same chunk): persistent blocks, one an SM with
// two row buffers so that the next row's copy is in flight during this row's passes, took 0.395 ms
// at 512 threads and 0.465 at 1024, against this kernel's 0.341: two independent blocks of 16 warps
// an SM overlap one's copy with the other's passes better than one block that prefetches.
//
// Rows wider than the shared memory a block may opt into (V_pad * 2 > 227 kB on an H100, ~116k
// classes) are for the Triton pass; the Python face checks that, the dtype (bf16, fp16) and the
// 16-byte alignment of every row before choosing this kernel.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "17_ce_rows.h"

namespace ce {

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

template <typename T> struct Elem;
template <> struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&p);
  }
};
template <> struct Elem<__half> {
  static __device__ __forceinline__ float lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu))); }
  static __device__ __forceinline__ float hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __half2 p = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&p);
  }
};

template <typename T> __device__ __forceinline__ void unpack(const uint4& v, float x[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = Elem<T>::lo(w[k]);
    x[2 * k + 1] = Elem<T>::hi(w[k]);
  }
}

// (m, s) <- the pair for the union of both sets of columns: s = sum exp(z - m)
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) { m = m2; s = s2; return; }
  const float M = fmaxf(m, m2);
  s = s * __expf(m - M) + s2 * __expf(m2 - M);
  m = M;
}

template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) ce_rows_kernel(T* __restrict__ z, long long stride,
                                                          const long long* __restrict__ t, float* __restrict__ loss,
                                                          const float* __restrict__ scale_p, int V, int nvec,
                                                          long long ignore_index, int write_grad) {
  extern __shared__ uint4 zs[];
  __shared__ float wm[THREADS / 32], wsum[THREADS / 32];
  const long long row = blockIdx.x;
  T* zr = z + row * stride;
  const uint4* zg = reinterpret_cast<const uint4*>(zr);
  for (int i = threadIdx.x; i < nvec; i += THREADS) cp_async16(&zs[i], &zg[i]);
  cp_async_wait_all();

  float m = -INFINITY, s = 0.f;
  for (int i = threadIdx.x; i < nvec; i += THREADS) {
    float x[8];
    unpack<T>(zs[i], x);
    float vm = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (i * 8 + j >= V) x[j] = -INFINITY;                     // padding: no class
      vm = fmaxf(vm, x[j]);
    }
    if (vm == -INFINITY) {                                     // all padding or -inf, or NaN: fmaxf drops NaN
      bool nan = false;
#pragma unroll
      for (int j = 0; j < 8; ++j) nan |= x[j] != x[j];
      if (!nan) continue;
      m = s = NAN;   // a vector of NaN logits is not padding: the row's loss is NaN (combine keeps it)
      continue;
    }
    if (vm > m) {
      s = m == -INFINITY ? 0.f : s * __expf(m - vm);
      m = vm;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) s += __expf(x[j] - m);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
    combine(m, s, m2, s2);
  }
  if ((threadIdx.x & 31) == 0) {
    wm[threadIdx.x >> 5] = m;
    wsum[threadIdx.x >> 5] = s;
  }
  __syncthreads();                                             // also: every thread's copies are visible
  float M = -INFINITY, S = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) combine(M, S, wm[w], wsum[w]);   // the same order in every thread
  const float lse = M + logf(S);

  const long long tn = t[row];
  const bool ignored = tn == ignore_index, bad = (tn < 0 || tn >= V) && !ignored;
  if (threadIdx.x == 0) {
    const long long ts = (ignored || bad) ? 0 : tn;            // never read outside the row
    const uint32_t w = reinterpret_cast<const uint32_t*>(zs)[ts >> 1];
    const float zt = (ts & 1) ? Elem<T>::hi(w) : Elem<T>::lo(w);
    loss[row] = bad ? NAN : (ignored ? 0.f : lse - zt);
  }
  if (!write_grad) return;
  float sc = *scale_p;
  if (ignored) sc = 0.f;
  if (bad) sc = NAN;
  uint4* zo = reinterpret_cast<uint4*>(zr);
  for (int i = threadIdx.x; i < nvec; i += THREADS) {
    float x[8];
    unpack<T>(zs[i], x);
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float g[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = i * 8 + 2 * k + h;
        const float p = c < V ? __expf(x[2 * k + h] - lse) : 0.f;
        g[h] = (p - (c == tn ? 1.f : 0.f)) * sc;
      }
      w[k] = Elem<T>::pack(g[0], g[1]);
    }
    zo[i] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <typename T, int THREADS>
int launch(void* z, long long rows, long long stride, const long long* t, float* loss, const float* scale, int V,
           int V_pad, long long ignore_index, int write_grad, cudaStream_t stream) {
  const int nvec = V_pad / 8;
  const size_t smem = (size_t)nvec * 16;
  // Set once per instantiation (before any CUDA-graph capture: the first call runs eagerly).
  static size_t set_for = 0;
  if (smem > set_for) {
    const cudaError_t err = cudaFuncSetAttribute(ce_rows_kernel<T, THREADS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)smem);
    if (err != cudaSuccess) return (int)err;
    set_for = smem;
  }
  ce_rows_kernel<T, THREADS><<<(unsigned)rows, THREADS, smem, stream>>>(
      reinterpret_cast<T*>(z), stride, t, loss, scale, V, nvec, ignore_index, write_grad);
  return (int)cudaGetLastError();
}

}  // namespace ce

extern "C" {

int ce_rows_launch(void* z, int dtype, long long rows, long long stride, const long long* t, float* loss,
                   const float* scale, int V, int V_pad, long long ignore_index, int write_grad, int threads,
                   void* stream) {
  if (rows <= 0) return 0;
  if (rows > 0x7fffffffLL || V < 1 || V > V_pad || V_pad % 8 != 0 || stride % 8 != 0 || (dtype != 0 && dtype != 1) ||
      (threads != 512 && threads != 1024))
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  if (dtype == 0)
    return threads == 512 ? ce::launch<__nv_bfloat16, 512>(z, rows, stride, t, loss, scale, V, V_pad, ignore_index, write_grad, s)
                          : ce::launch<__nv_bfloat16, 1024>(z, rows, stride, t, loss, scale, V, V_pad, ignore_index, write_grad, s);
  return threads == 512 ? ce::launch<__half, 512>(z, rows, stride, t, loss, scale, V, V_pad, ignore_index, write_grad, s)
                        : ce::launch<__half, 1024>(z, rows, stride, t, loss, scale, V, V_pad, ignore_index, write_grad, s);
}

const char* ce_rows_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
