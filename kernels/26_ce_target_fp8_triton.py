"""The target entries of the FP8 LM head's gradient, kept out of FP8, in Triton.

Loaded from this folder by ``hwlib.ops.sources``; the Python face (the chunk loop, the FP8 GEMMs,
``26_ce_grad_fp8_triton.py``'s pass for the other entries, the autograd op) is
``hwlib/steps/s26_fp8_head/op.py``, whose ``_add_target_terms`` is this kernel's math in torch ops.

The gradient of the mean cross-entropy is (softmax - onehot(t)) / #targets. The FP8 matmuls take the
off-target probabilities (``P``, e5m2); each row's target entry, c_n = (p_t - 1) w_n / #targets (w_n:
1, 0 where ignored, NaN where the target is no class), is added here in fp32, after the matmuls:

    dh_n      += c_n * W8[t_n] / s_w          one row of W's e4m3 copy, gathered
    dW[t_n]   += c_n * h8_n / s_h             one row of h's, scattered with atomic adds

The same e4m3 operands as the matmuls, so the result is the gradient of the FP8 forward with only the
off-target entries rounded. Rows whose c_n is 0 (ignored targets) are skipped.

Bytes a row of width D: read D (W8's row) + D (h8's) + 2D (dh, bf16) + write 2D (dh) + D fp32 atomic
adds into dW (4D bytes through L2): ~11 D bytes; FLOPs 4 D. At GPT-2's 16,384 x 768: ~140 MB.
Where several rows share a target, their atomic adds to the same row of dW serialize in L2, and their
order varies: dW's sum is not bitwise reproducible from run to run (as torch's index_add_ on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _target_rows_kernel(dh_ptr, stride_dh, dw_ptr, stride_dw, w8_ptr, stride_w, h8_ptr, stride_h, t_ptr, coef_ptr,
                        inv_w_ptr, inv_h_ptr, D, V_rows, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    c = tl.load(coef_ptr + n)
    if c != 0.0:                      # NaN (a bad target) is not 0: it goes on into dh and dW
        t = tl.load(t_ptr + n)
        t = tl.minimum(tl.maximum(t, 0), V_rows - 1).to(tl.int64)
        inv_w = tl.load(inv_w_ptr)
        inv_h = tl.load(inv_h_ptr)
        n64 = n.to(tl.int64)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m = cols < D
            w_row = tl.load(w8_ptr + t * stride_w + cols, mask=m, other=0.0).to(tl.float32)
            dh = tl.load(dh_ptr + n64 * stride_dh + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(dh_ptr + n64 * stride_dh + cols, (dh + (c * inv_w) * w_row).to(dh_ptr.dtype.element_ty), mask=m)
            h_row = tl.load(h8_ptr + n64 * stride_h + cols, mask=m, other=0.0).to(tl.float32)
            tl.atomic_add(dw_ptr + t * stride_dw + cols, (c * inv_h) * h_row, mask=m, sem="relaxed")


def add_target_terms(dh: torch.Tensor, dw: torch.Tensor, t: torch.Tensor, coef: torch.Tensor, w8: torch.Tensor,
                     inv_w: torch.Tensor, h8: torch.Tensor, inv_h: torch.Tensor, block_d: int | None = None) -> None:
    """In place: ``dh`` [C, D] += coef[:, None] * w8[t] * inv_w and ``dw`` [V_rows, D] (float32) row t_n += coef_n *
    h8_n * inv_h (see the module doc). ``w8`` [V_rows, D] and ``h8`` [C, D]: FP8, rows contiguous; ``t`` [C]
    int64 (clamped into the rows: a row with coef 0 is skipped, one with NaN spreads it); ``coef`` [C]
    float32; ``inv_w``, ``inv_h``: 1-element float32 tensors on the device (no host sync)."""
    C, D = dh.shape
    if tuple(h8.shape) != (C, D) or w8.shape[1] != D or tuple(dw.shape) != tuple(w8.shape):
        raise ValueError(f"shapes: dh {tuple(dh.shape)} and h8 {tuple(h8.shape)} must match, w8 {tuple(w8.shape)} "
                         f"and dw {tuple(dw.shape)} too, with the same width")
    if dw.dtype != torch.float32:
        raise ValueError(f"dw must be float32 (atomic adds), got {dw.dtype}")
    for name, x in (("dh", dh), ("dw", dw), ("w8", w8), ("h8", h8)):
        if x.stride(1) != 1:
            raise ValueError(f"{name}: columns must be contiguous (stride 1), got strides {x.stride()}")
    if C == 0:
        return
    bd = block_d or min(1024, triton.next_power_of_2(D))
    _target_rows_kernel[(C,)](dh, dh.stride(0), dw, dw.stride(0), w8, w8.stride(0), h8, h8.stride(0), t, coef,
                              inv_w, inv_h, D, w8.shape[0], BLOCK_D=bd, num_warps=4)
