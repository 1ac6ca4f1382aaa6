"""The QKV projection's output gradient, packed from the attention's dq, dk, dv, with the QKV bias's
gradient summed in the same pass. One Triton kernel.

Loaded from this folder by ``hwlib.ops.sources`` (imported by path, not as a package module); the
Python face (the autograd op, the torch backend, the float64 reference) is
``hwlib/steps/s24_qkv_grad/op.py``.

GPT's attention projects its input x [N, C] (N = B T tokens) to qkv = x W^T + b [N, 3C] and reads q,
k and v out of it as [B, H, T, D] views (C = H D). The attention's backward returns dq, dk, dv as
tensors of their own, [B, H, T, D] each; the projection's backward needs them back in qkv's layout,
and the bias's gradient is their sum over the tokens:

    dqkv[b T + t, j C + h D + d] = dX_j[b, h, t, d]        X_0 = q, X_1 = k, X_2 = v
    db[j C + h D + d]             = sum_{b, t} dX_j[b, h, t, d]

Compiled, inductor writes the first as one kernel (a copy through a transpose) and computes the second
as a reduction of its own that reads dq, dk, dv again: one more read of 3 N C elements. Here one pass
does both: each program copies a [BLOCK_N, D] tile of one head of each of dq, dk, dv into its place
in dqkv and writes the tile's column sums (fp32) as one row of partial sums; the caller sums the
partials over the row blocks (cdiv(N, BLOCK_N) x 3C floats: 2.4 MB, under 2% of the bytes at GPT-2's shape).

Bytes (2-byte gradients): read 6 N C, write 6 N C, + 4 * 3C per row block of partials. Unfused, the
bias gradient's reduction reads 6 N C more. GPT-2 small (N = 16,384, C = 768): 151 MB a call against
227 MB, twelve calls a step. FLOPs: 3 N C additions; nowhere near a compute limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows per program: 64 rows x 64 lanes of a head, three times (q, k, v): 24 kB in and out a program,
# 256 x 12 programs at GPT-2 small's shape. Untimed against other tiles.
BLOCK_N = 64


@triton.jit
def _qkv_grad_pack_kernel(dq_ptr, dk_ptr, dv_ptr, out_ptr, part_ptr, N, T, C,
                          sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                          D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    rmask = rows < N
    mask = rmask[:, None] & (d < D)[None, :]
    b = (rows // T).to(tl.int64)
    t = (rows % T).to(tl.int64)
    dst = rows.to(tl.int64)[:, None] * (3 * C) + h * D + d[None, :]
    part = pid_n * (3 * C) + h * D + d
    # q, k, v in turn: the same tile of rows and lanes, each tensor with strides of its own
    x = tl.load(dq_ptr + (b * sqb + h * sqh + t * sqt)[:, None] + d[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + dst, x, mask=mask)
    tl.store(part_ptr + part, tl.sum(x.to(tl.float32), axis=0), mask=d < D)
    x = tl.load(dk_ptr + (b * skb + h * skh + t * skt)[:, None] + d[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + dst + C, x, mask=mask)
    tl.store(part_ptr + part + C, tl.sum(x.to(tl.float32), axis=0), mask=d < D)
    x = tl.load(dv_ptr + (b * svb + h * svh + t * svt)[:, None] + d[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + dst + 2 * C, x, mask=mask)
    tl.store(part_ptr + part + 2 * C, tl.sum(x.to(tl.float32), axis=0), mask=d < D)


def row_blocks(N: int) -> int:
    """Rows of partial sums ``pack_qkv_grad`` returns for N tokens."""
    return max(1, triton.cdiv(N, BLOCK_N))


def pack_qkv_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dq, dk, dv [B, H, T, D] (any strides with a unit last one) into ``out`` [B T, 3 H D] (contiguous);
    returns the float32 partial column sums [row_blocks(B T), 3 H D] (their sum over rows is db)."""
    B, H, T, D = dq.shape
    N, C = B * T, H * D
    if not (dq.stride(-1) == dk.stride(-1) == dv.stride(-1) == 1 and out.is_contiguous()
            and dk.shape == dv.shape == dq.shape and tuple(out.shape) == (N, 3 * C)):
        raise ValueError(f"pack_qkv_grad: dq, dk, dv [B, H, T, D] of one shape with unit last strides and out "
                         f"[B T, 3 H D] contiguous, got {tuple(dq.shape)}, {tuple(dk.shape)}, {tuple(dv.shape)} and "
                         f"{tuple(out.shape)}")
    part = torch.empty(row_blocks(N), 3 * C, dtype=torch.float32, device=dq.device)
    if N == 0:
        return part.zero_()
    _qkv_grad_pack_kernel[(triton.cdiv(N, BLOCK_N), H)](
        dq, dk, dv, out, part, N, T, C, dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1),
        dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), D=D, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)
    return part
