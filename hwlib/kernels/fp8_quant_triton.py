"""A tensor's absolute maximum, and its cast to FP8 in both layouts from one read, in Triton.

Loaded from this folder by ``hwlib.ops.sources`` (imported by path, not as a package module); the
Python face (the custom op, the scales, the torch reference it must match bit for bit) is
``hwlib/ops/fp8.py``.

For x [R, C] (bfloat16, float16 or float32, row-major) and one scale s per tensor:

    amax   = max |x_rc|                                      (_amax_kernel: partial maxima, atomic max)
    s      = fmax / max(amax, eps)                           (the caller, in torch: the reference's formula)
    q_rc   = fp8(clamp(x_rc s, -fmax, fmax))                 row-major [R, C]
    qt_cr  = q_rc                                            row-major [C, R]: the transposed layout

where fp8 rounds to nearest even (e4m3 or e5m2). ``torch._scaled_mm`` needs both layouts of an
operand across the three matmuls of a training step (see ``hwlib/ops/fp8.py``).

Bytes per element, 2-byte input: amax 2 (read) + cast 2 (read) + 1 + 1 (both layouts written) = 6;
two separate casts read the input twice: 8. FLOPs: ~4 per element (abs, max; multiply, clamp) and
the conversion. Memory-bound: one [64, 64] tile per program, loaded coalesced along C, stored
coalesced in both layouts (the transposed store goes through the compiler's shared-memory layout
conversion).
"""

from __future__ import annotations

import triton
import triton.language as tl

AMAX_BLOCK = 4096
TILE = 64


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    # NaN propagates (as torch's amax does): |NaN| is a positive NaN, above +inf as an integer, so the
    # atomic maximum keeps it.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, BLOCK * tl.num_programs(0)):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    tl.atomic_max(amax_ptr, tl.max(acc, 0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _cast_both_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, R, C, fmax, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r[:, None] < R) & (c[None, :] < C)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    v = x * tl.load(scale_ptr)
    v = tl.minimum(tl.maximum(v, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax, propagate_nan=tl.PropagateNan.ALL)
    y = v.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + r[:, None].to(tl.int64) * C + c[None, :], y, mask=m)
    tl.store(qt_ptr + c[:, None].to(tl.int64) * R + r[None, :], tl.trans(y), mask=tl.trans(m))


def amax(x, out, sms: int) -> None:
    """max |x| into ``out`` (a zeroed float32 [1] tensor on x's device); x contiguous."""
    n = x.numel()
    grid = (max(1, min(triton.cdiv(n, AMAX_BLOCK), 4 * sms)),)
    _amax_kernel[grid](x, out, n, BLOCK=AMAX_BLOCK, num_warps=8)


def cast_both(x, scale, q, qt, fmax: float) -> None:
    """q = fp8(clamp(x scale)) [R, C] and qt = q^T [C, R], both row-major; x [R, C] contiguous."""
    R, C = x.shape
    grid = (triton.cdiv(R, TILE), triton.cdiv(C, TILE))
    _cast_both_kernel[grid](x, scale, q, qt, R, C, fmax, BR=TILE, BC=TILE, num_warps=4)
