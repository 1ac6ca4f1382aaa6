"""One tensor cast to FP8 in both layouts from one read, in Triton.

Loaded from this folder by ``hwlib.ops.sources``; its Python face is ``hwlib.steps.s26_fp8_head.op``,
which quantizes the LM head's hidden states and weight with it (outside torch.compile's graph, where
inductor cannot fuse the casts).

For x [R, C] (fp32, bf16 or fp16) and a scale s (a 1-element fp32 tensor on the device, so no sync):

    q    = fp8(clamp(x * s, -FMAX, FMAX))      [R, C]
    q^T                                         [C, R], row-major

FP8 matmuls on Hopper take K-major operands only, so a tensor that is a reduction operand along
both of its dimensions (W in dh = g W and z = h W^T) is needed in both layouts. Eagerly, the
transposed cast is a cast into a transposed view and a transposing copy, several passes; here one
program owns a BLOCK_R x BLOCK_C tile and writes it in both layouts, reading it twice: row by row,
then column by column (the second read of the same tile is served by L1/L2, not DRAM).

Bytes an element from DRAM: read 4 (fp32; 2 for bf16), write 1 + 1. FLOPs: 6 (scale and clamp, twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_BLOCK_R, DEFAULT_BLOCK_C, DEFAULT_WARPS = 64, 64, 4


@triton.jit
def _cast_both_kernel(x_ptr, stride_x, q_ptr, stride_q, qt_ptr, stride_qt, scale_ptr, R, C,
                      FMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask, cmask = rows < R, cols < C
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    s = tl.load(scale_ptr)
    q = tl.minimum(tl.maximum(x * s, -FMAX), FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q, mask=rmask[:, None] & cmask[None, :])
    # The transposed tile is loaded transposed (the same bytes, from L1/L2), not made with tl.trans: a
    # tl.trans-ed tile stored to q^T wrote wrong elements and left others unwritten on an H100 (Triton
    # 3.6.0) whenever the sizes were multiples of 16, in fp32 or FP8 alike; the tests check both layouts.
    # A kernel of only a load, a cast and the two stores (tl.trans-ed) was right in all 240 cases tried on an
    # H100 (Triton 3.6.0: fp32, bf16, both FP8s and int8; 64x64, 128x256, 48x80, 50x70; three tilings; with
    # and without the row-major store): the miscompile needs more of this kernel, and is not reduced further.
    xt = tl.load(x_ptr + r64[None, :] * stride_x + c64[:, None], mask=cmask[:, None] & rmask[None, :],
                 other=0.0).to(tl.float32)
    qt = tl.minimum(tl.maximum(xt * s, -FMAX), FMAX).to(qt_ptr.dtype.element_ty)
    tl.store(qt_ptr + c64[:, None] * stride_qt + rows[None, :], qt, mask=cmask[:, None] & rmask[None, :])


def cast_both(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block_r: int | None = None,
              block_c: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, q^T) of ``x`` [R, C] (columns contiguous) in ``dtype`` (an FP8 dtype), scaled by ``scale``
    (a 1-element fp32 tensor) and saturated to the dtype's range; see the module doc."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-d with contiguous columns, got shape {tuple(x.shape)}, strides {x.stride()}")
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    R, C = x.shape
    q = torch.empty(R, C, dtype=dtype, device=x.device)
    qt = torch.empty(C, R, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return q, qt
    br, bc = block_r or DEFAULT_BLOCK_R, block_c or DEFAULT_BLOCK_C
    grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
    _cast_both_kernel[grid](x, x.stride(0), q, q.stride(0), qt, qt.stride(0), scale.reshape(1).float(), R, C,
                            FMAX=float(torch.finfo(dtype).max), BLOCK_R=br, BLOCK_C=bc,
                            num_warps=num_warps or DEFAULT_WARPS)
    return q, qt
