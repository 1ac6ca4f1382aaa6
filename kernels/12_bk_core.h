// The C ABI of 12_bk_core.cu, declared once. 12_bk_core.cu includes it (so its definitions are checked
// against it by the compiler), the torch binding in hwlib/ops/bk_cuda.py includes it, and the
// ctypes binding of the host launchers is read from it (hwlib.ops.bk_cuda.prototypes), so the
// three cannot drift apart. Plain C types only: no CUDA or torch headers are needed to include it.
//
// Arrays are raw pointers, row-major: a [B, N], b, c [B, N-1] (real); out / w complex [B, N] as
// interleaved reals; ws a workspace of bk_core_workspace_elems(...) reals, any content. z = zr + i zi.
// The stream is a cudaStream_t passed as void*. Return: 0 or a cudaError_t code
// (bk_core_error_string turns it into text). One prototype per line: the Python reader parses them.

#ifndef HWLIB_BK_CORE_H
#define HWLIB_BK_CORE_H

#ifdef __cplusplus
extern "C" {
#endif

long long bk_core_workspace_elems(long long B, long long N, int is_double, int backward);
int bk_core_tile_positions(int is_double, int backward);
const char* bk_core_error_string(int code);

int bk_core_forward_f32(const float* a, const float* b, const float* c, float* out, float* ws, long long B, long long N, double zr, double zi, void* stream);
int bk_core_forward_f64(const double* a, const double* b, const double* c, double* out, double* ws, long long B, long long N, double zr, double zi, void* stream);
int bk_core_backward_f32(const float* a, const float* b, const float* c, const float* w, float* ga, float* gb, float* gc, float* ws, long long B, long long N, double zr, double zi, void* stream);
int bk_core_backward_f64(const double* a, const double* b, const double* c, const double* w, double* ga, double* gb, double* gc, double* ws, long long B, long long N, double zr, double zi, void* stream);

// The same block code run on the CPU (every thread of a phase in turn): for tests without a GPU.
int bk_core_forward_host_f32(const float* a, const float* b, const float* c, float* out, float* ws, long long B, long long N, double zr, double zi);
int bk_core_forward_host_f64(const double* a, const double* b, const double* c, double* out, double* ws, long long B, long long N, double zr, double zi);
int bk_core_backward_host_f32(const float* a, const float* b, const float* c, const float* w, float* ga, float* gb, float* gc, float* ws, long long B, long long N, double zr, double zi);
int bk_core_backward_host_f64(const double* a, const double* b, const double* c, const double* w, double* ga, double* gb, double* gc, double* ws, long long B, long long N, double zr, double zi);

#ifdef __cplusplus
}
#endif

#endif  // HWLIB_BK_CORE_H
