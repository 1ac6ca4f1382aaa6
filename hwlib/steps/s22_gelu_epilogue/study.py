"""Step 22's study of the MLP with its GELU in cuBLASLt's epilogues (``op``): the op
against float64 at odd sizes, and each epilogue matmul alone at GPT-2 small's MLP against the unfused
kernels it replaces (the weight and bias gradients are the same kernels either way).

Kernel timing: each sample is ``LAUNCHES`` back-to-back calls (``bench.time_fn``'s group) over input
sets that rotate (together larger than L2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import bench
from ...studies.kernel_records import kernel_records as records_of, not_timed_words
from . import STEP, op

NOTEBOOK = STEP.name   # the records' notebook: the step's own, which bears its name
LAUNCHES = 20
INPUT_SETS = 2          # 2 x (pre, a, ...) at 16,384 x 3,072 bf16: ~0.5 GB, far beyond a 50 MB L2
# (M, K, N, C): rows that are multiples of nothing; widths multiples of 8, as cuBLASLt needs (the torch
# backend takes any width: tests/test_gelu_mlp.py)
ODD_SIZES = ((37, 24, 40, 16), (131, 64, 96, 32), (257, 200, 72, 8), (5, 768, 3072, 768))
FP32_TOL = 1e-5         # relative, against float64: fp32 sums of at most a few thousand terms
OUTPUTS = ("y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj")


def _draw(M, K, N, C, gen, device, dtype):
    ts = (torch.randn(M, K, generator=gen, dtype=torch.float64), torch.randn(N, K, generator=gen, dtype=torch.float64) / K ** 0.5,
          0.1 * torch.randn(N, generator=gen, dtype=torch.float64), torch.randn(C, N, generator=gen, dtype=torch.float64) / N ** 0.5,
          0.1 * torch.randn(C, generator=gen, dtype=torch.float64), torch.randn(M, C, generator=gen, dtype=torch.float64))
    return [t.to(device, dtype) for t in ts]


def _grads(fn, x, w_fc, b_fc, w_proj, b_proj, dy) -> dict:
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_fc, b_fc, w_proj, b_proj)]
    y = fn(*leaves)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return dict(zip(OUTPUTS, (y.detach(), *grads)))


def _errors(got: dict, ref: dict) -> dict:
    return {k: float((got[k].double().cpu() - ref[k]).norm() / ref[k].norm()) for k in ref}


def odd_size_rows(device, seed: int = 0, sizes=ODD_SIZES) -> list[dict]:
    """The op against float64 on fresh inputs of sizes that are multiples of nothing. On a GPU the
    cuBLASLt backend in bf16, held against the unfused bf16 path's own error on the same operands
    (``gelu_mlp.no_worse_than_unfused``); elsewhere the torch backend in fp32, within fp32's
    bound. Each row: the largest relative error over y and the five gradients."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    backend = op.select_backend("auto", device)
    dtype = torch.bfloat16 if backend == "cublaslt" else torch.float32
    rows = []
    for M, K, N, C in sizes:
        *args, dy = _draw(M, K, N, C, gen, device, dtype)
        ref = _grads(op.gelu_mlp_reference, *(t.double().cpu() for t in args), dy.double().cpu())
        err = _errors(_grads(lambda *a: op.gelu_mlp(*a, backend=backend), *args, dy), ref)
        row = {"M": M, "K": K, "N": N, "C": C, "backend": backend, "dtype": str(dtype).split(".")[-1],
               **{f"{k} rel err": v for k, v in err.items()}, "worst": max(err.values())}
        if backend == "cublaslt":
            unf = _errors(_grads(lambda *a: op.gelu_mlp(*a, backend="torch"), *args, dy), ref)
            row["unfused worst"] = max(unf.values())
            row["within tolerance"] = all(op.no_worse_than_unfused(err[k], unf[k]) for k in err)
        else:
            row["within tolerance"] = row["worst"] < FP32_TOL
        rows.append(row)
    return rows


def kernel_rows(M: int, K: int, N: int, C: int, device, iters: int = 20, seed: int = 0) -> list[dict]:
    """Each epilogue matmul alone at [M, K] -> [M, N] -> [M, C] in bf16 beside the unfused kernels it
    replaces (cuBLAS's matmul, then inductor's pointwise kernel, compiled here), median ms
    per call (p20, p80) over rotating input sets."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernel_rows times CUDA kernels; device is {device}")
    m = op.module()
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(INPUT_SETS):
        x, w_fc, b_fc, w_proj, _, dy = _draw(M, K, N, C, gen, device, torch.bfloat16)
        a, pre = m.gelu_forward(x, w_fc, b_fc, op.workspace_bytes("forward"))
        sets.append(dict(x=x, w_fc=w_fc, b_fc=b_fc, w_proj=w_proj, dy=dy, a=a, pre=pre))
    gelu = torch.compile(lambda p: F.gelu(p, approximate="tanh"))
    dgelu = torch.compile(lambda d, p: torch.ops.aten.gelu_backward(d, p, approximate="tanh"))
    S = lambda i, n: sets[i % INPUT_SETS][n]
    pairs = (
        ("forward: x W_fc^T + b, GELU", "unfused", lambda i: gelu(F.linear(S(i, "x"), S(i, "w_fc"), S(i, "b_fc")))),
        ("forward: x W_fc^T + b, GELU", "epilogue", lambda i: m.gelu_forward(S(i, "x"), S(i, "w_fc"), S(i, "b_fc"), op.workspace_bytes("forward"))),
        ("backward: dy W_proj, GELU'", "unfused", lambda i: dgelu(S(i, "dy") @ S(i, "w_proj"), S(i, "pre"))),
        ("backward: dy W_proj, GELU'", "epilogue", lambda i: m.gelu_backward(S(i, "dy"), S(i, "w_proj"), S(i, "pre"), op.workspace_bytes("backward"))),
    )
    rows = []
    for part, impl, fn in pairs:
        t = bench.time_fn(fn, device, warmup=2, iters=iters, group=LAUNCHES)
        rows.append({"part": part, "impl": impl, "M": M, "K": K, "N": N, "C": C, "ms": t.median_ms,
                     "p20": t.p20_ms, "p80": t.p80_ms})
    unfused = {r["part"]: r["ms"] for r in rows if r["impl"] == "unfused"}
    for r in rows:
        r["saved us"] = (unfused[r["part"]] - r["ms"]) * 1e3 if r["impl"] == "epilogue" else None
    return rows


def kernel_records(rows: list[dict], *, profile: str, device) -> list[dict]:
    """One ms record per part and implementation; the shape in fields."""
    return records_of(rows, notebook=NOTEBOOK, study="gelu_epilogue_kernel",
                      keys=("part", "impl", "M", "K", "N", "C"), profile=profile, device=device)


def kernel_prose(rows: list[dict]) -> str:
    """The matmuls alone, in words built from ``rows``."""
    if not rows:
        return not_timed_words("The matmuls")
    ep = [r for r in rows if r["impl"] == "epilogue"]
    parts = [f"{r['part']}: {r['ms'] * 1e3:.1f} us with the epilogue, {r['saved us']:+.1f} us against the unfused "
             f"kernels" for r in ep]
    return ("Alone, per MLP call: " + "; ".join(parts) + ". These unfused kernels stand alone; in the compiled "
            "step inductor may fuse more into them (fc's bias gradient into the GELU's backward), so their sum over "
            "the step's layers is not what the step saves: the step's own measurement below says what it did.")
