"""The softmax part of the cross-entropy gradient of one chunk of logits, written in FP8 in both
layouts the backward's FP8 matmuls need, in Triton.

Loaded from this folder by ``hwlib.ops.sources``; the Python face (the chunk loop, the FP8 GEMMs,
the one-hot part, the autograd op, the float64 reference) is ``hwlib/steps/s26_fp8_head/op.py``.

For the rows n of a chunk (logits z [C, V_pad] in bf16, each row's log-sum-exp already computed by
``17_linear_ce_triton.py``'s row pass), per column v:

    p_nv  = exp(z_nv - lse_n) * w_n                            v < V, v != t_n; 0 at v = t_n and V <= v < V_pad
    w_n   = 1; 0 where t_n = ignore_index; NaN where t_n is neither a class nor ignore_index
    q_nv  = e5m2(p_nv * QMAX)                                  written to P [C, V_pad] and P^T [V_pad, C]

The gradient is softmax - onehot(t). Its target entry, p_t - 1, stays out of FP8: the caller adds
(p_t - 1) W's row t_n to dh_n and (p_t - 1) h_n to dW's row t_n, in fp32, with p_t = exp(-loss_n) from
the row pass. In e5m2 the target entry would round on a grid 1/7 apart near -1 (every p_t below 0.07
reads as 0), the largest error of the row and the same sign wherever p_t sits on a step: trained that
way, GPT-2's loss fell far behind step 25's (``hwlib.steps.s26_fp8_head.study``'s long curves). Rounding p - 1
as p and 1 apart would trade that for another: a p_t near 1 rounds by up to 2^-3 of 1, larger than
the 1 - p_t it stands for. The other entries are probabilities alone, each rounded by at most 2^-3
of itself.

|p_nv| <= 1 always, so one static scale, QMAX = 57344 (e5m2's largest finite value), uses e5m2's whole
range with no amax pass and no host sync: the caller's matmuls multiply back 1 / QMAX times the mean's
weight 1 / #targets. Values down to about 1e-9 stay normal numbers at this scale, so the smallest
probabilities of a 50k vocabulary keep their 2 mantissa bits.

dh = p W needs p with V contiguous (the matmul's reduction dimension) and dW = p^T h needs p^T
with C contiguous: FP8 tensor cores on Hopper take only K-major operands ("TN"), so both layouts are
written here, from one DRAM read of z, instead of a second pass that transposes an FP8 copy. One
program owns a BLOCK_M x BLOCK_V tile: it computes the tile row by row and writes P, then loads the
same tile column by column (from L1/L2) and writes P^T, BLOCK_M contiguous bytes per row of P^T. A
second, small kernel then zeroes each row's target entry in both layouts.

Per element, bf16 logits, from DRAM: read 2 bytes, write 1 + 1; with the row pass's one read for the
log-sum-exp, 6 bytes (the bf16 head's CUDA row pass: 4, one read and a bf16 write over z).
FLOPs: ~5 per element and two exponentials (each layout computes its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QMAX = 57344.0                   # torch.finfo(torch.float8_e5m2).max
DEFAULT_BLOCK_M, DEFAULT_BLOCK_V, DEFAULT_WARPS = 32, 128, 4


@triton.jit
def _ce_grad_fp8_kernel(z_ptr, stride_z, lse_ptr, t_ptr, g_ptr, stride_g, gt_ptr, stride_gt, C, V, V_pad,
                        ignore_index, QMAX_: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask, cmask = rows < C, cols < V_pad
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    t = tl.load(t_ptr + rows, mask=rmask, other=ignore_index)
    ignored = t == ignore_index
    bad = ((t < 0) | (t >= V)) & (t != ignore_index)
    w = tl.where(bad, float("nan"), tl.where(ignored, 0.0, 1.0)) * QMAX_
    # P: the tile [BLOCK_M rows, BLOCK_V columns], V contiguous.
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(z_ptr + r64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.where(cols[None, :] < V, tl.exp(x - lse[:, None]), 0.0) * w[:, None]
    tl.store(g_ptr + r64[:, None] * stride_g + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)
    # P^T: the same tile loaded transposed ([BLOCK_V, BLOCK_M], served by L1/L2) and computed again, not
    # made with tl.trans: a tl.trans-ed tile stored transposed wrote wrong elements on an H100 (Triton 3.6.0)
    # whenever the sizes were multiples of 16 (kernels/26_fp8_cast_triton.py; the tests check P^T).
    mask_t = cmask[:, None] & rmask[None, :]
    xt = tl.load(z_ptr + r64[None, :] * stride_z + c64[:, None], mask=mask_t, other=0.0).to(tl.float32)
    gt = tl.where(cols[:, None] < V, tl.exp(xt - lse[None, :]), 0.0) * w[None, :]
    tl.store(gt_ptr + c64[:, None] * stride_gt + rows[None, :], gt.to(gt_ptr.dtype.element_ty), mask=mask_t)


@triton.jit
def _zero_targets_kernel(g_ptr, stride_g, gt_ptr, stride_gt, t_ptr, C, V, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < C
    t = tl.load(t_ptr + rows, mask=rmask, other=-1)
    ok = rmask & (t >= 0) & (t < V)
    t64 = t.to(tl.int64)
    zero = tl.zeros([BLOCK], dtype=tl.float32).to(g_ptr.dtype.element_ty)
    tl.store(g_ptr + rows.to(tl.int64) * stride_g + t64, zero, mask=ok)
    tl.store(gt_ptr + t64 * stride_gt + rows, zero, mask=ok)


def ce_grad_fp8(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor, gt: torch.Tensor,
                vocab: int, ignore_index: int, block_m: int | None = None, block_v: int | None = None,
                num_warps: int | None = None) -> None:
    """Write ``g`` [C, V_pad] and ``gt`` [V_pad, C] from ``z`` [C, V_pad] (columns contiguous), ``lse`` [C] (float32) and ``targets`` [C] (int64):
    see the module doc. ``g``, ``gt``: float8_e5m2, columns contiguous."""
    C, V_pad = z.shape
    for name, t in (("z", z), ("g", g), ("gt", gt)):
        if t.stride(1) != 1:
            raise ValueError(f"{name}: columns must be contiguous (stride 1), got strides {t.stride()}")
    if tuple(g.shape) != (C, V_pad) or tuple(gt.shape) != (V_pad, C):
        raise ValueError(f"g must be [{C}, {V_pad}] and gt [{V_pad}, {C}], got {tuple(g.shape)} and {tuple(gt.shape)}")
    if g.dtype != torch.float8_e5m2 or gt.dtype != torch.float8_e5m2:
        raise ValueError(f"g and gt must be torch.float8_e5m2, got {g.dtype} and {gt.dtype}")
    if not (1 <= vocab <= V_pad):
        raise ValueError(f"vocab must be in [1, {V_pad}] (the logits' width), got {vocab}")
    if C == 0:
        return
    bm, bv = block_m or DEFAULT_BLOCK_M, block_v or DEFAULT_BLOCK_V
    grid = (triton.cdiv(C, bm), triton.cdiv(V_pad, bv))
    _ce_grad_fp8_kernel[grid](z, z.stride(0), lse, targets, g, g.stride(0), gt, gt.stride(0), C, vocab, V_pad,
                              ignore_index, QMAX_=QMAX, BLOCK_M=bm, BLOCK_V=bv, num_warps=num_warps or DEFAULT_WARPS)
    # The target entries, written above with the others, are zeroed after: a compare per element in the
    # tile kernel cost it 0.31 ms of 1.53 at GPT-2's shape (H100), these 2 C scattered bytes next to nothing.
    _zero_targets_kernel[(triton.cdiv(C, 1024),)](g, g.stride(0), gt, gt.stride(0), targets, C, vocab, BLOCK=1024)
