"""The decode step's block matmuls at batch <= 16 in Triton: out = x W^T for x [M, K], W [N, K].

At M = 12 rows a projection is a matrix-vector product in all but name: 2 M N K FLOPs against
2 N K bytes of bf16 weight, 12 FLOP/byte, far under any GPU's ridge point, so the time is the
weight's bytes at the copy bandwidth plus what keeps the memory system from streaming them (too few
programs in flight, a second pass over partial sums, a separate launch for what follows).

    bytes:  2 N K (weight) + 2 M K (x) + M N s (out; s = 2 bf16, 4 float32 partials, x SPLIT)
    FLOPs:  2 M N K (the tensor cores run M padded to 16: 16/M more issued)

Three forms, one kernel (``_matvec_kernel``):

``plain``    out [M, N] in x's dtype; grid (N / BN): one program streams BN weight rows once.
``split``    out [SPLIT, M, N] float32 partial sums over SPLIT slices of K; grid (N / BN, SPLIT).
             A projection with few output columns and a long K (o: N = 1024, K = 2048 at Qwen3-0.6B)
             would otherwise run N / BN programs on 132 SMs; the consumer sums the slices in the
             kernel it runs anyway (the residual add before RMSNorm), so the split costs no launch.
``gated``    W = [gate; up] ([2 I, K]), out [M, I] = SiLU(gate) * up, each value rounded where eager
             bf16 code stores it (gate and up, SiLU(gate), the product): each program takes BN gate
             rows and the matching BN up rows, so the [M, 2 I] gate/up tensor is never written.

The float64 reference is ``reference``; the tests compare each form with it on odd sizes (M = 3,
N = 100, K = 200, ...). Runs on CPU tensors under TRITON_INTERPRET=1 (set before triton's import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FORMS = ("plain", "split", "gated")


@triton.jit
def _round(x, dtype: tl.constexpr):
    # to the storage dtype and back: the value an eager op that writes a tensor leaves
    return x.to(dtype).to(tl.float32)


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, out_ptr, M, N, K, K_PER, HALF, stride_xm, stride_wn, stride_os, stride_om,
                   FORM: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    m = tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    m_ok = m < M
    n_ok = n < N
    x_rows = x_ptr + m[:, None] * stride_xm
    # 64-bit row offsets: N K passes 2^31 elements for an 8B model's LM-sized weights
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    k0 = pid_s * K_PER
    for start in range(k0, tl.minimum(k0 + K_PER, K), BK):
        k = start + kk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        if FORM == 2:       # the up rows HALF rows below their gate rows
            wu = tl.load(w_rows + HALF * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=PREC)
    mask = m_ok[:, None] & n_ok[None, :]
    dst = out_ptr + pid_s * stride_os + m[:, None] * stride_om + n[None, :]
    if FORM == 1:
        tl.store(dst, acc, mask=mask)
    else:
        dt = out_ptr.dtype.element_ty
        if FORM == 2:
            g = _round(acc, dt)
            u = _round(acc_up, dt)
            acc = _round(g / (1.0 + tl.exp(-g)), dt) * u
        tl.store(dst, acc.to(dt), mask=mask)


def reference(x: torch.Tensor, w: torch.Tensor, form: str = "plain") -> torch.Tensor:
    """The float64 result each form approximates: x W^T ([M, N]); for ``gated`` SiLU(x G^T) * x U^T
    with W = [G; U]. ``split`` forms are compared after summing their slices."""
    y = x.double() @ w.double().t()
    if form == "gated":
        g, u = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u
    return y


def out_shape(M: int, N: int, form: str, split: int) -> tuple:
    """The shape ``matvec`` writes for a weight of N rows."""
    if form == "split":
        return (split, M, N)
    return (M, N // 2) if form == "gated" else (M, N)


def config(N: int, K: int, form: str, sms: int) -> dict:
    """Tiles and K split for a weight [N, K], from the sweep over both Qwen3 sizes' projections at 12
    rows on an H200 (``hwlib.studies.decode_matvec``; its rows in outputs/reference/h200-decode): 32
    weight rows by 128 columns a tile was within 4% of each projection's best; a split form splits K
    until the grid holds about two programs per SM (the best split of all four split projections);
    the gated form pipelines 5 tiles deep at K <= 2048 and 3 beyond (6.1 against 6.9 us at K = 1024,
    50.2 against 53.6 us at K = 4096)."""
    split = 1
    if form == "split":
        cols = triton.cdiv(N, 32)
        while split < 8 and cols * split < 2 * sms and K // (2 * split) >= 128:
            split *= 2
    stages = 3 if form == "split" or (form == "gated" and K > 2048) else 5
    return {"split": split, "block_n": 32, "block_k": 128, "num_stages": stages}


def matvec(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, form: str = "plain", split: int = 1,
           block_n: int = 32, block_k: int = 256, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x`` [M, K] (M <= 16, rows contiguous), ``w`` [N, K] (rows contiguous), ``out`` preallocated as
    ``out_shape`` says (float32 for ``split``, x's dtype otherwise). Writes and returns ``out``."""
    if form not in FORMS:
        raise ValueError(f"form: {form!r} is not one of {FORMS}")
    M, K = x.shape
    N = w.shape[0]
    if M > 16:
        raise ValueError(f"x: {M} rows; this kernel is for decode batches of at most 16 rows")
    if w.shape[1] != K:
        raise ValueError(f"w: shape {tuple(w.shape)} does not match x's K = {K}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x, w: rows must be contiguous")
    if form == "gated" and N % 2:
        raise ValueError(f"w: a gated weight stacks gate and up rows; {N} rows is odd")
    if form != "split" and split != 1:
        raise ValueError(f"split: {split} slices of K need form='split'")
    want = out_shape(M, N, form, split)
    if tuple(out.shape) != want:
        raise ValueError(f"out: shape {tuple(out.shape)}, expected {want}")
    if out.stride(-1) != 1:
        raise ValueError("out: rows must be contiguous")
    n_cols = N // 2 if form == "gated" else N
    k_per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    grid = (triton.cdiv(n_cols, block_n), split)
    _matvec_kernel[grid](
        x, w, out, M, n_cols, K, k_per, N // 2, x.stride(0), w.stride(0),
        out.stride(0) if form == "split" else 0, out.stride(-2),
        FORM=FORMS.index(form), PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BM=16, BN=block_n, BK=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
