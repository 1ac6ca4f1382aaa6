"""BDH's attention with what its shape allows: the query is the key (Q = K = q) and the values are the
token states x, shared by every head.

    S = q q^T                 [H B, T, T]   one bmm that reads q once (both operands are the same tile)
    P = softmax(S / sqrt(N))  (softmax form; the linear form keeps S as it is)
    o = P x                   [H, B, T, D]  one bmm per sample with the heads stacked as rows:
                                            [B, H T, T] @ [B, T, D], no copy of x per head

and the backward of ``S = q q^T`` in one bmm: dq = (dS + dS^T) q, where autograd, seeing two operands,
would run two bmm's (dS q and dS^T q) and add their [H B, T, N] outputs.

Bytes at the full profile (H = 6, B = 256, T = 65, N = 1024, D = 192, bf16), per layer application:
q is H B T N = 102M elements (204 MB); the recipe's SDPA reads it as query and as key, and its
memory-efficient kernel (the only one that takes a head width of 1024) reads and writes x expanded
over the heads (H B T D each way); here q is read once forward, once for dq, and dq written once.

``reference`` is the float64 formula the tests, the notebook and the step's check import.
"""

from __future__ import annotations

import math

import torch


class _SymmetricScores(torch.autograd.Function):
    """S = q q^T over the last two dimensions of q [..., T, N]; dS -> dq = (dS + dS^T) q."""

    @staticmethod
    def forward(ctx, q):
        ctx.save_for_backward(q)
        return q @ q.transpose(-2, -1)

    @staticmethod
    def backward(ctx, dS):
        (q,) = ctx.saved_tensors
        return (dS + dS.transpose(-2, -1)).to(q.dtype) @ q


def symmetric_scores(q: torch.Tensor) -> torch.Tensor:
    """q q^T for q [..., T, N], with its gradient in one matmul."""
    if q.dim() < 2:
        raise ValueError(f"q must have at least 2 dimensions [..., T, N], got shape {tuple(q.shape)}")
    return _SymmetricScores.apply(q)


def shared_qk_attention(q: torch.Tensor, x: torch.Tensor, form: str) -> torch.Tensor:
    """BDH's attention for q [H, B, T, N] (Q = K) and values x [B, T, D] shared by the heads -> [H, B, T, D]:
    ``softmax(q q^T / sqrt(N)) x`` (form "softmax") or ``(q q^T) x`` (form "linear")."""
    if form not in ("softmax", "linear"):
        raise ValueError(f"form must be 'softmax' or 'linear', got {form!r}")
    if q.dim() != 4 or x.dim() != 3 or q.shape[1:3] != x.shape[:2]:
        raise ValueError(f"q must be [H, B, T, N] and x [B, T, D] with the same B and T, got q "
                         f"{tuple(q.shape)} and x {tuple(x.shape)}")
    H, B, T, N = q.shape
    s = symmetric_scores(q)                                               # [H, B, T, T]
    p = torch.softmax(s * (1.0 / math.sqrt(N)), dim=-1) if form == "softmax" else s
    rows = p.transpose(0, 1).reshape(B, H * T, T)                         # the heads as rows, per sample
    out = torch.bmm(rows, x)
    return out.view(B, H, T, -1).transpose(0, 1)                          # [H, B, T, D]


def reference(q: torch.Tensor, x: torch.Tensor, form: str) -> torch.Tensor:
    """The recipe's formula (``hwlib.workloads.vit_bdh.BDHAttention``, manual) in float64."""
    q, x = q.double(), x.double()
    H, B, T, N = q.shape
    v = x.unsqueeze(0).expand(H, B, T, x.size(-1))
    s = q @ q.transpose(-2, -1)
    p = torch.softmax(s / math.sqrt(N), dim=-1) if form == "softmax" else s
    return p @ v


def traffic_bytes(H: int, B: int, T: int, N: int, D: int, elem: int = 2) -> dict[str, float]:
    """The bytes one layer application's attention must move, forward and backward, at one pass per
    tensor: the recipe's SDPA (q read as query and as key, x expanded over the heads as values, dq and dk
    written apart and summed) against this op (q read once a direction, x read per sample)."""
    q, xh, x, s = H * B * T * N, H * B * T * D, B * T * D, H * B * T * T
    sdpa = elem * ((2 * q + xh + xh)                                       # forward: Q, K, V in, O out
                   + (2 * q + 3 * xh + 2 * q + xh + 2 * q + q))            # backward: Q K V O dO in; dQ dK dV out; dQ + dK
    ours = elem * ((q + s + s + x + xh)                                    # forward: q in, S out, P in, x in, o out
                   + (xh + s + x + s + q + q))                             # backward: do, P (dP), x; dS; q in, dq out
    return {"sdpa (recipe)": float(sdpa), "shared q, shared x": float(ours)}


ODD_SIZES = ((3, 2, 13, 10, 7), (2, 3, 65, 34, 19), (1, 1, 1, 2, 1))   # (H, B, T, N, D), multiples of nothing


def odd_size_rows(seed: int = 0, sizes=ODD_SIZES) -> list[dict]:
    """The op in fp32 against ``reference`` in float64 on fresh random inputs at ``sizes``, both forms: the
    output and the gradients of q and x under a random incoming gradient (relative norm differences).
    q is drawn non-negative, as BDH's ReLU leaves it."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for form in ("softmax", "linear"):
        for H, B, T, N, D in sizes:
            q = torch.randn(H, B, T, N, generator=g, dtype=torch.float64).relu() * 0.5
            x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
            w = torch.randn(H, B, T, D, generator=g, dtype=torch.float64)
            q32, x32 = q.float().requires_grad_(), x.float().requires_grad_()
            q64, x64 = q.clone().requires_grad_(), x.clone().requires_grad_()
            out, ref = shared_qk_attention(q32, x32, form), reference(q64, x64, form)
            (out * w.float()).sum().backward()
            (ref * w).sum().backward()
            errs = {name: ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()
                    for name, a, b in (("out", out.detach(), ref.detach()), ("dq", q32.grad, q64.grad),
                                       ("dx", x32.grad, x64.grad))}
            rows.append({"form": form, "H, B, T, N, D": (H, B, T, N, D), **{f"rel err {k}": v for k, v in errs.items()},
                         "within tolerance": all(v < 1e-5 for v in errs.values())})
    return rows
