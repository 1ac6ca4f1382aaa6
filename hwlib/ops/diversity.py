"""The diversity score of the Polychromic trainer: mean pairwise cosine distance of N replies.

For prompt p with reply embeddings e_1..e_N (unit vectors, [P, N, D]):

    D_p = 2 / (N (N - 1)) * sum_{i<j} (1 - e_i . e_j)                   (the seed's pairwise form)

Since sum_{i != j} e_i . e_j = ||sum_i e_i||^2 - sum_i ||e_i||^2 = ||s||^2 - N for unit vectors,

    D_p = 1 - (||s_p||^2 - N) / (N (N - 1)),   s_p = sum_i e_i             (the closed form)

one pass over [P, N, D]: P N D adds and 2 P D multiply-adds, against P N^2 D for the matrix.

Implementations (same value to float32 rounding; ``reference`` in float64 is what tests compare with):

================  ==================================================================================
``pairwise``      the seed's way, batched: the [P, N, N] Gram matrix, the mean of its upper triangle
``closed``        the closed form above, in torch
``triton``        the closed form in one Triton kernel (``kernels/14_diversity_triton.py``)
``reference``     the pairwise definition in float64 loops, the spec
================  ==================================================================================

``seed_scores`` is the seed's loop itself: one prompt at a time, its N x N matrix and ``.item()``
(one host sync per prompt). The closed form assumes unit vectors: ``diversity_score`` refuses
embeddings that are not unit length unless ``normalize=True``, which normalises them first.
"""

from __future__ import annotations

import torch

from hwlib.device import ChoiceError, Unavailable

from .sources import load_python_kernel, triton_device_problem

IMPLS = ("pairwise", "closed", "triton")
UNIT_TOL = 1e-3      # | ||e|| - 1 | above this is not a unit vector at float32/bf16 rounding


def check_embeddings(emb, *, name: str = "embeddings", unit: bool = True) -> None:
    """A clear ValueError naming ``name`` unless ``emb`` is a finite floating [P, N, D] tensor with
    P >= 1, N >= 2 (pairs need two replies), D >= 1, and (``unit``) rows of unit length."""
    if not isinstance(emb, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [P, N, D], got {type(emb).__name__}")
    if emb.dim() != 3:
        raise ValueError(f"{name} must have shape [P, N, D] (prompts, replies, width), got {tuple(emb.shape)}")
    P, N, D = emb.shape
    if P < 1:
        raise ValueError(f"{name}: P = 0 prompts; give at least one prompt")
    if N < 2:
        raise ValueError(f"{name}: N = {N} replies per prompt; the score is over pairs, so N must be >= 2")
    if D < 1:
        raise ValueError(f"{name}: width D = 0")
    if not emb.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {emb.dtype}")
    if not torch.isfinite(emb).all():
        raise ValueError(f"{name} has non-finite entries")
    if unit:
        norms = torch.linalg.vector_norm(emb.float(), dim=-1)
        worst = float((norms - 1).abs().max())
        if worst > UNIT_TOL:
            raise ValueError(f"{name} are not unit length (max | ||e|| - 1 | = {worst:.3g}); the closed form "
                             f"assumes unit vectors: L2-normalise them or pass normalize=True")


def reference_score(emb: torch.Tensor) -> torch.Tensor:
    """D_p by the pairwise definition, float64 loops over pairs: [P] float64 (the spec)."""
    e = emb.detach().to("cpu", torch.float64)
    P, N, _ = e.shape
    out = torch.empty(P, dtype=torch.float64)
    for p in range(P):
        acc = 0.0
        for i in range(N):
            for j in range(i + 1, N):
                acc += 1.0 - float(e[p, i] @ e[p, j])
        out[p] = acc * 2.0 / (N * (N - 1))
    return out


def pairwise_score(emb: torch.Tensor) -> torch.Tensor:
    """The seed's form for all prompts at once: Gram matrix [P, N, N], mean of its upper triangle."""
    N = emb.shape[1]
    sim = emb @ emb.transpose(1, 2)
    iu = torch.triu_indices(N, N, offset=1, device=emb.device)
    return (1.0 - sim[:, iu[0], iu[1]]).mean(dim=1)


def closed_form_score(emb: torch.Tensor) -> torch.Tensor:
    """1 - (||sum_i e_i||^2 - N) / (N (N - 1)) per prompt: [P], in the input's dtype (fp32 accumulate
    for 16-bit inputs)."""
    N = emb.shape[1]
    s = emb.float().sum(dim=1) if emb.dtype in (torch.float16, torch.bfloat16) else emb.sum(dim=1)
    return 1.0 - ((s * s).sum(dim=-1) - N) / (N * (N - 1))


def seed_scores(emb: torch.Tensor) -> list[float]:
    """The seed's loop: one prompt at a time, its N x N cosine matrix, the upper triangle's mean
    distance, ``.item()`` (a host sync per prompt)."""
    out = []
    N = emb.shape[1]
    iu = torch.triu_indices(N, N, offset=1, device=emb.device)
    for p in range(emb.shape[0]):
        sim = emb[p] @ emb[p].T
        out.append((1.0 - sim[iu[0], iu[1]]).mean().item())
    return out


def _kernel():
    return load_python_kernel("14_diversity_triton.py")


def triton_available(device: torch.device | str) -> str | None:
    """Why the Triton kernel cannot run on tensors on ``device`` now; None when it can."""
    why = triton_device_problem(torch.device(device))
    if why:
        return why
    try:
        _kernel()
    except Unavailable as e:
        return str(e)
    return None


def triton_score(emb: torch.Tensor) -> torch.Tensor:
    """The closed form in one Triton kernel: [P] float32. No input checks (``diversity_score``
    does them): the launcher alone, as the notebook times it."""
    return _kernel().diversity_closed_form(emb)


def diversity_score(emb: torch.Tensor, impl: str = "closed", *, normalize: bool = False) -> torch.Tensor:
    """D_p for every prompt of ``emb`` [P, N, D]: a [P] tensor on ``emb``'s device (no host sync).
    ``impl``: 'pairwise', 'closed' or 'triton'. ``normalize`` L2-normalises the rows first; without
    it, rows that are not unit length are refused (the closed form would be wrong for them)."""
    if impl not in IMPLS:
        raise ChoiceError("impl", impl, IMPLS)
    check_embeddings(emb, unit=not normalize)
    if normalize:
        emb = torch.nn.functional.normalize(emb, dim=-1)
    if impl == "pairwise":
        return pairwise_score(emb)
    if impl == "closed":
        return closed_form_score(emb)
    why = triton_available(emb.device)
    if why:
        raise Unavailable(f"diversity_score impl 'triton': {why}")
    return triton_score(emb)
