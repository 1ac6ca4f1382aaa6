"""The Polychromic diversity score in Triton: D_p = 1 - (||sum_i e_i||^2 - N) / (N (N - 1)).

Loaded from this folder by ``hwlib.ops.sources`` (imported by path, not as a package module); the
Python face, the float64 reference and the derivation are in ``hwlib/ops/diversity.py``.

For unit vectors e_1..e_N of prompt p, sum_{i != j} e_i . e_j = ||s||^2 - N with s = sum_i e_i, so
the mean pairwise cosine distance needs one pass over the N x D block, not the N x N Gram matrix.

Layout: embeddings [P, N, D] (any strides; float32, bfloat16 or float16, accumulated in float32);
one program per BLOCK_P prompts, each loading its [BLOCK_P, BLOCK_N, BLOCK_D] tile once (BLOCK_N,
BLOCK_D the next powers of two of N and D; masked), summing over N, squaring and summing over D.

    bytes:  P N D s read + 4 P written (s = 4 for float32): 4.6 kB per prompt at N = 3, D = 384
    FLOPs:  P (N D adds + 2 D multiply-adds + 3): ~1.9 kFLOP per prompt at N = 3, D = 384
    arithmetic intensity ~0.4 FLOP/byte: memory-bound at any P; at the seed's P = 4 the whole
    input is 18 kB and the launch costs more than the work.

Runs on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _diversity_closed_form_kernel(e_ptr, out_ptr, P, N, D, s_p, s_n, s_d, inv_pairs,
                                  BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    live = rows < P
    # 64-bit offsets: P * s_p overflows int32 beyond ~5.6M prompts of N = 3, D = 384
    ptrs = (e_ptr + rows.to(tl.int64)[:, None, None] * s_p + n[None, :, None] * s_n + d[None, None, :] * s_d)
    mask = live[:, None, None] & (n < N)[None, :, None] & (d < D)[None, None, :]
    e = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(e, axis=1)                    # [BLOCK_P, BLOCK_D]: sum of the N replies
    ss = tl.sum(s * s, axis=1)               # ||s||^2
    score = 1.0 - (ss - N) * inv_pairs
    tl.store(out_ptr + rows, score, mask=live)


def block_sizes(n: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, BLOCK_D): a tile of about 4096 elements per program (registers), at least
    one prompt."""
    bn, bd = triton.next_power_of_2(n), triton.next_power_of_2(d)
    bp = max(1, min(64, 4096 // (bn * bd)))
    return bp, bn, bd


def diversity_closed_form(emb: torch.Tensor) -> torch.Tensor:
    """D_p for emb [P, N, D]: [P] float32 on emb's device. Unit rows assumed (the caller checks)."""
    P, N, D = emb.shape
    out = torch.empty(P, dtype=torch.float32, device=emb.device)
    bp, bn, bd = block_sizes(N, D)
    grid = (triton.cdiv(P, bp),)
    _diversity_closed_form_kernel[grid](emb, out, P, N, D, emb.stride(0), emb.stride(1), emb.stride(2),
                                        1.0 / (N * (N - 1)), BLOCK_P=bp, BLOCK_N=bn, BLOCK_D=bd)
    return out
