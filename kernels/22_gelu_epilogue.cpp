// GPT's MLP GELU inside the matmuls' epilogues, through cuBLASLt: host C++ that configures cuBLASLt's
// own kernels (no device code of ours, hence .cpp, compiled by the host compiler against the CUDA
// toolkit's cublasLt.h). No torch headers; its C ABI is declared once, in 22_gelu_epilogue.h; the torch
// binding lives in hwlib/steps/s22_gelu_epilogue/op.py and hwlib/ops/build.py loads both with load_inline.
//
// Math, bf16 operands, fp32 accumulation, g(u) = 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))):
//   forward      pre = x W^T + b,  out = g(pre)          x [M, K], W [N, K], b [N]; out, pre [M, N]
//   backward     dpre = (dy W) * g'(pre)                  dy [M, C], W [C, N] (the next linear's weight)
// The forward is one matmul with the GELU_AUX_BIAS epilogue: the bias is added and the GELU applied to
// the fp32 accumulators before they are rounded, and the pre-activation is written beside the output
// (the "aux" matrix) for the backward. The backward is the next linear's input-gradient matmul with the
// DGELU epilogue: its accumulators are multiplied by g'(pre), read from the aux matrix. cuBLASLt's GELU
// is the tanh form above, the one GPT-2 uses (F.gelu(approximate="tanh")).
//
// What was measured and left out (H100, GPT-2's MLP, M = 16384, N = 3072, C = 768):
//   * the bias gradients in cuBLASLt's epilogues: DGELU_BGRAD (fc's, in the input-gradient matmul) took
//     490 us against the plain matmul's 126; BGRADB (each bias gradient in its weight-gradient matmul)
//     took 160 us against 145 for the plain matmul and inductor's column sum (fc's), 133 against 121
//     (proj's). The column sums stay with inductor (hwlib/steps/s22_gelu_epilogue/op.py's backward formula);
//   * timing the heuristic's first 16 kernels on each shape's first call and keeping the fastest: the
//     DGELU matmul went from 168-170 us to 161 us, the others moved by less than their spread, and the
//     step within noise (notebook 20's gelu_epilogue knob at step 21: 1.022x, 1.007-1.037, against
//     1.015x, 1.000-1.030): each call takes the kernel cuBLASLt's heuristic ranks first;
//   * the DGELU matmul in the forward's TN layout, from a transposed copy of W (21 us to make): 170 us
//     against 161 us in the NN layout;
//   * the same two epilogues in Triton matmuls (Triton 3.6, bf16, fp32 accumulation; same errors against
//     float64 as cuBLASLt's, 1.66e-3 relative): the best of 6 tilings x warps x stages, one tile a program,
//     took 233 us (forward) and 251 us (backward), and persistent ones with TMA loads and stores (flattened
//     tile loop) 189 and 257 us, against 158 and 155 us for cuBLASLt's here and 122 and 127 us for torch.mm's
//     plain products. Triton's matmul did not reach cuBLASLt's at K = 768 with these epilogues; not kept.
//
// Bytes (bf16, 2 B an element; FLOPs 2 M N K forward, 2 M N C backward):
//   forward   x, W, b read (2 MK + 2 NK + 2 N), out and pre written (4 MN). Unfused, the matmul writes pre
//             (2 MN) and a pointwise kernel reads it and writes out (4 MN): 2 MN more.
//   backward  dy, W read (2 MC + 2 CN), pre read (2 MN), dpre written (2 MN). Unfused, the matmul writes
//             dy W (2 MN) and a pointwise kernel reads it and pre and writes dpre (6 MN): 4 MN more.
// At GPT-2 small's MLP each MN term is 100 MB: 6 MN bytes fewer per layer and step (302 MB, ~0.1 ms of a
// 3 TB/s HBM) at one pass per op.
//
// With the bias column (hwlib.steps.s22_gelu_epilogue.op's bias_column): x's rows are K + 16 wide, the LayerNorm's output
// beside a column of ones and zeros (ldx K + 16; the forward reads the first K); the input gradient
// dx = dpre W_fc is a plain matmul written into rows K + 16 wide (lddx), the gradient of that wider tensor, and
// the bias gradient comes out of the weight-gradient matmul dpre^T [x, 1] (in torch, outside this file).
//
// Layouts. cuBLASLt is column-major: a row-major [R, C] matrix is its column-major [C, R] transpose.
//   forward   D = pre^T [N, M] = W x^T:     A = W, stored [K, N] (lda K), transposed; B = x^T, [K, M] (ldb ldx)
//   backward  D = dpre^T [N, M] = W^T dy^T: A = W as [N, C] (lda N); B = dy^T, [C, M] (ldb C)
//   dx        D = dx^T [K, M] (ldd lddx) = W_fc^T dpre^T: A = W_fc as [K, N] (lda K); B = dpre^T, [N, M] (ldb N)
// Every leading dimension must be a multiple of 8 elements (16 bytes) and every pointer 16-byte
// aligned: the binding checks both.

#include "22_gelu_epilogue.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

namespace {

struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Desc() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

#define LT_CHECK(expr)                                   \
  do {                                                   \
    cublasStatus_t s_ = (expr);                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) return (int)s_;     \
  } while (0)

// D [m, n] (column-major, ldd >= m) = op(A) op(B), bf16 in and out, fp32 accumulate; A is stored [k, m]
// (lda) when transposed, else [m, k]; B [n, k] (ldb) when transposed, else [k, n]. `epilogue` reads or
// writes `bias` ([m]) and `aux` ([m, n], ld m) where it uses them.
int matmul(cublasLtHandle_t handle, cublasOperation_t transa, const void* A, long long lda, cublasOperation_t transb,
           const void* B, long long ldb, void* D, long long ldd, long long m, long long n, long long k,
           cublasLtEpilogue_t epilogue, const void* bias, const void* aux, void* ws, long long ws_bytes,
           cudaStream_t stream) {
  Desc g;
  LT_CHECK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
  LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (bias) LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux) {
    const int64_t aux_ld = m;
    LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }
  const bool ta = transa == CUBLAS_OP_T, tb = transb == CUBLAS_OP_T;
  LT_CHECK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, ta ? k : m, ta ? m : k, lda));
  LT_CHECK(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, tb ? n : k, tb ? k : n, ldb));
  LT_CHECK(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_16BF, m, n, ldd));
  LT_CHECK(cublasLtMatmulPreferenceCreate(&g.pref));
  const size_t ws_size = (size_t)ws_bytes;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                sizeof(ws_size)));
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, g.op, g.a, g.b, g.d, g.d, g.pref, 1, &heur, &found));
  if (found == 0) return GELU_EPILOGUE_NO_ALGO;
  const float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasLtMatmul(handle, g.op, &alpha, A, g.a, B, g.b, &beta, D, g.d, D, g.d, &heur.algo, ws,
                          ws_size, stream));
  return 0;
}

}  // namespace

extern "C" const char* gelu_epilogue_error_string(int code) {
  switch (code) {
    case 0: return "success";
    case GELU_EPILOGUE_NO_ALGO: return "cuBLASLt has no kernel for this matmul with this epilogue";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

extern "C" int gelu_epilogue_forward(void* handle, const void* x, long long ldx, const void* w, const void* bias,
                                     void* out, void* pre, long long M, long long N, long long K, void* ws,
                                     long long ws_bytes, void* stream) {
  return matmul((cublasLtHandle_t)handle, CUBLAS_OP_T, w, K, CUBLAS_OP_N, x, ldx, out, N, N, M, K,
                CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, pre, ws, ws_bytes, (cudaStream_t)stream);
}

extern "C" int gelu_epilogue_backward(void* handle, const void* dy, const void* w, const void* pre, void* dpre,
                                      long long M, long long N, long long C, void* ws, long long ws_bytes, void* stream) {
  return matmul((cublasLtHandle_t)handle, CUBLAS_OP_N, w, N, CUBLAS_OP_N, dy, C, dpre, N, N, M, C,
                CUBLASLT_EPILOGUE_DGELU, nullptr, pre, ws, ws_bytes, (cudaStream_t)stream);
}

extern "C" int gelu_epilogue_input_grad(void* handle, const void* dpre, const void* w, void* dx, long long lddx,
                                        long long M, long long N, long long K, void* ws, long long ws_bytes,
                                        void* stream) {
  return matmul((cublasLtHandle_t)handle, CUBLAS_OP_N, w, K, CUBLAS_OP_N, dpre, N, dx, lddx, K, M, N,
                CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, ws, ws_bytes, (cudaStream_t)stream);
}
