"""Step 24's study of the QKV projection + attention op (``op``): the op
against float64 at odd sizes, and its packing kernel alone at GPT-2 small's shape against the two
kernels inductor writes for the same work (the packing copy, then the bias gradient's reduction).

Kernel timing as step 21's (``hwlib.steps.s21_fused_layernorm.study``): each sample is ``LAUNCHES``
back-to-back launches over input sets that rotate (together larger than L2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import bench
from ...ops.sources import interpreted_here
from ...studies.kernel_records import alone_words, timed_row
from ...studies.kernel_records import kernel_records as records_of
from . import STEP, op

NOTEBOOK = STEP.name   # the records' notebook: the step's own, which bears its name
LAUNCHES = 20
INPUT_SETS = 4          # 4 x (dq, dk, dv, dqkv) at 16,384 x 3 x 768 bf16: ~600 MB, far beyond a 50 MB L2
# (B, T, C, heads): T a multiple of nothing; head widths 16, 32 and 64, which cuDNN's kernels take
ODD_SIZES = ((2, 9, 48, 3), (1, 70, 64, 2), (3, 33, 128, 2))
# On a CPU the packing kernel also runs interpreted (``interpreted_here``), at a size small enough for a
# fraction of a second: two blocks of BLOCK_N (64) rows, the second partial and across a sequence's end;
# heads 12 wide, in tiles of 16 lanes.
INTERPRETED_SIZES = ((2, 37, 36, 3),)
FP32_TOL = 1e-5        # relative, against float64 (CPU, fp32)
ERROR_FACTOR, ERROR_SLACK = 1.5, 4e-3   # GPU, bf16: no worse than the unfused path's error by this bound


def _draw(B, T, C, gen, device):
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    w = torch.randn(3 * C, C, generator=gen, dtype=torch.float64) / C ** 0.5
    b = 0.3 * torch.randn(3 * C, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    return [t.to(device, torch.float32) for t in (x, w, b)], dy.to(device, torch.float32)


def _grads(fn, leaves, dy, n_head, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves, n_head, **kw)
    return dict(zip(("y", "dx", "dw", "db"), [y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype))]))


def unfused(x, weight, bias, n_head):
    """The path the op replaces: the projection, [B, H, T, D] views, SDPA, the heads transposed back."""
    B, T, C = x.shape
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in F.linear(x, weight, bias).split(C, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


def odd_size_rows(device, seed: int = 0, sizes=ODD_SIZES, interpreted_sizes=INTERPRETED_SIZES) -> list[dict]:
    """The op against float64 on fresh inputs of sizes that are multiples of nothing: on a CPU in fp32
    within fp32's bound; on a GPU under bf16 autocast (cuDNN's attention takes 16-bit operands), no
    worse than the unfused path's error on the same operands (``ERROR_FACTOR`` x it + ``ERROR_SLACK``).
    On a CPU where Triton interprets, the packing kernel too at ``interpreted_sizes``."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    runs = [(op.select_backend("auto", device), s) for s in sizes]
    if device.type == "cpu" and interpreted_here(device):
        runs += [("triton", s) for s in interpreted_sizes]    # the kernel a GPU runs, checked here too
    rows = []
    for backend, (B, T, C, H) in runs:
        leaves, dy = _draw(B, T, C, gen, device)
        ref = _grads(op.qkv_attention_reference, [t.double() for t in leaves], dy.double(), H)
        err = lambda got: {k: float((got[k].double() - ref[k]).norm() / ref[k].norm()) for k in ref}
        if device.type == "cuda":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ours, theirs = err(_grads(op.qkv_attention, leaves, dy, H)), err(_grads(unfused, leaves, dy, H))
            ok = all(ours[k] <= ERROR_FACTOR * theirs[k] + ERROR_SLACK for k in ours)
            rows.append({"B": B, "T": T, "C": C, "heads": H, "backend": backend, "precision": "bf16 autocast",
                         **{f"{k} rel err": v for k, v in ours.items()},
                         **{f"{k} unfused": v for k, v in theirs.items()}, "within tolerance": ok})
        else:
            ours = err(_grads(op.qkv_attention, leaves, dy, H, backend=backend))
            rows.append({"B": B, "T": T, "C": C, "heads": H,
                         "backend": backend + (" (interpreted)" if backend == "triton" else ""), "precision": "fp32",
                         **{f"{k} rel err": v for k, v in ours.items()},
                         "within tolerance": max(ours.values()) < FP32_TOL})
    return rows


def kernel_rows(B: int, T: int, C: int, n_head: int, device, ceilings: dict | None, iters: int = 20,
                seed: int = 0) -> list[dict]:
    """The packing kernel alone at [B, T, C] (bf16 [B, H, T, D] gradients, contiguous), against the
    same work compiled by inductor from torch ops (the packing copy, then the column sum): median ms
    per call (p20, p80), GB/s on the bytes each moves (``qkv_attention.traffic_bytes``) and that over
    the measured copy ceiling."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernel_rows times CUDA kernels; device is {device}")
    k = op._kernel()
    D, N = C // n_head, B * T
    gen = torch.Generator(device).manual_seed(seed)
    sets = [[torch.randn(B, n_head, T, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3)]
            + [torch.empty(N, 3 * C, device=device, dtype=torch.bfloat16)] for _ in range(INPUT_SETS)]

    def pack_and_sum(dq, dk, dv):
        dqkv = torch.cat([t.transpose(1, 2).reshape(N, C) for t in (dq, dk, dv)], dim=1)
        return dqkv, dqkv.sum(0, dtype=torch.float32)

    compiled = torch.compile(pack_and_sum, fullgraph=True)
    ours = lambda i: k.pack_qkv_grad(*sets[i % INPUT_SETS])
    theirs = lambda i: compiled(*sets[i % INPUT_SETS][:3])
    nbytes = op.traffic_bytes(N, C)
    return [timed_row(name, bench.time_fn(fn, device, warmup=2, iters=iters, group=LAUNCHES), nb, ceilings,
                      tokens=N, C=C)
            for name, fn, nb in (("packed and summed in one pass (Triton)", ours, nbytes["fused"]),
                                 ("inductor: the packing copy, then the column sum", theirs, nbytes["unfused"]))]


def kernel_records(rows: list[dict], *, profile: str, device) -> list[dict]:
    """One ms record per kernel (its GB/s alongside); the shape in fields."""
    return records_of(rows, notebook=NOTEBOOK, study="qkv_grad_kernel", keys=("kernel", "tokens", "C"),
                      profile=profile, device=device)


def kernel_prose(rows: list[dict]) -> str:
    """The kernels alone, in words built from ``rows``, and the one pass's time over the two's."""
    words = alone_words(rows, lambda r: f"{r['tokens']:,} tokens x 3 x {r['C']}")
    if len(rows) != 2:
        return words
    return words + f" The one pass takes {rows[0]['ms'] / rows[1]['ms']:.2f}x the time of the two."
