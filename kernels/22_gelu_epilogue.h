// The C ABI of 22_gelu_epilogue.cpp, declared once. 22_gelu_epilogue.cpp includes it (so its definitions are
// checked against it by the compiler) and so does the torch binding in hwlib/steps/s22_gelu_epilogue/op.py. Plain
// C types only: no CUDA, cuBLAS or torch headers are needed to include it.
//
// Matrices are raw pointers to bf16, row-major. handle is a cublasLtHandle_t, stream a cudaStream_t,
// both passed as void*; ws a device workspace of ws_bytes. Return: 0, or a cublasStatus_t code
// (gelu_epilogue_error_string turns it into text; GELU_EPILOGUE_NO_ALGO: cuBLASLt offered no kernel).

#ifndef HWLIB_GELU_EPILOGUE_H
#define HWLIB_GELU_EPILOGUE_H

#ifdef __cplusplus
extern "C" {
#endif

#define GELU_EPILOGUE_NO_ALGO 1000

const char* gelu_epilogue_error_string(int code);

int gelu_epilogue_forward(void* handle, const void* x, long long ldx, const void* w, const void* bias, void* out, void* pre, long long M, long long N, long long K, void* ws, long long ws_bytes, void* stream);
int gelu_epilogue_backward(void* handle, const void* dy, const void* w, const void* pre, void* dpre, long long M, long long N, long long C, void* ws, long long ws_bytes, void* stream);
int gelu_epilogue_input_grad(void* handle, const void* dpre, const void* w, void* dx, long long lddx, long long M, long long N, long long K, void* ws, long long ws_bytes, void* stream);

#ifdef __cplusplus
}
#endif

#endif  // HWLIB_GELU_EPILOGUE_H
