// The C ABI of 17_ce_rows.cu, declared once: 17_ce_rows.cu includes it (the compiler checks its definitions
// against it) and so does the torch binding in hwlib/steps/s17_fused_lm_head/ce_rows_cuda.py. Plain C types only.
//
// z: [rows, V_pad] logits (row stride `stride` elements, 16-byte aligned rows), bf16 (dtype 0) or fp16
// (dtype 1); t: [rows] int64 targets; loss: [rows] float32; scale: one float32 on the device. The
// stream is a cudaStream_t passed as void*. Return: 0 or a cudaError_t code (ce_rows_error_string).

#ifndef HWLIB_CE_ROWS_H
#define HWLIB_CE_ROWS_H

#ifdef __cplusplus
extern "C" {
#endif

int ce_rows_launch(void* z, int dtype, long long rows, long long stride, const long long* t, float* loss, const float* scale, int V, int V_pad, long long ignore_index, int write_grad, int threads, void* stream);
const char* ce_rows_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif  // HWLIB_CE_ROWS_H
