"""Step 21's study of the fused residual add + LayerNorm (``op``), which steps 23 and 27 use too:
the op against float64 at odd sizes, and its two kernels alone at GPT-2 small's shape against the bytes
they must move; for step 23, the same with the branch's output bias (``r_bias``) and the column sum that
its gradient no longer needs; for step 27, the same with the residual stream in bf16 (``stream``).

Kernel timing: each sample is ``LAUNCHES`` back-to-back launches (``bench.time_fn``'s group), over
input sets that rotate (together larger than L2): one launch of a ~50 us kernel per sample would time
the launch path and the sync as much as the kernel. The group is replayed from a CUDA graph (``time_fn``'s
``cuda_graph``), as the steps' graphs launch these kernels: from Python, a launch of the forward took
longer on the host than the kernel on an H100 with a bf16 stream, and the samples timed the host.
"""

from __future__ import annotations

import torch

from ... import bench
from ...ops.sources import interpreted_here
from ...studies.kernel_records import alone_words, timed_row
from ...studies.kernel_records import kernel_records as records_of
from . import STEP, op

NOTEBOOK = STEP.name   # the records' notebook unless one is given: the step's own, which bears its name
LAUNCHES = 20
INPUT_SETS = 4          # 4 x (x, r, s, y, ds, dy ...) at 16,384 x 768: ~1.4 GB, far beyond a 50 MB L2
ODD_SIZES = ((37, 71), (130, 96), (257, 200), (5, 768))
# On a CPU the Triton kernels also run interpreted (``interpreted_here``), at sizes small enough for a
# fraction of a second each (the interpreter runs the kernel's numpy per program): odd widths, a
# partial row block, one row.
INTERPRETED_SIZES = ((5, 33), (1, 50))
FP32_TOL = 1e-5     # relative, against float64: fp32 sums over at most a few hundred terms
# A bf16 stream, against float64 of the same bf16 inputs: s is rounded once into bf16 (at most 2^-9 of
# each element), and so are y, dx and dr; the normalisation carries s's rounding into y scaled by
# |s - mean| / std, a few units for these inputs. 2^-7, four times bf16's unit roundoff, in the relative
# Frobenius norm the rows report (each rounding's contribution there is about 2^-9 / sqrt(3)).
BF16_STREAM_TOL = 2.0 ** -7


def _draw(m: int, d: int, gen: torch.Generator, device, dtype, r_dtype):
    """(x, r, w, b, ds, dy, c): the stream, the branch, gain and bias, the incoming gradients, and a
    branch bias c [d] (drawn last, so that the rest are the same with or without it)."""
    x = torch.randn(m, d, generator=gen, dtype=torch.float64) * 3 + torch.randn(m, 1, generator=gen, dtype=torch.float64)
    r = torch.randn(m, d, generator=gen, dtype=torch.float64)
    w = 1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)
    b = 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)
    ds, dy = (torch.randn(m, d, generator=gen, dtype=torch.float64) for _ in range(2))
    c = 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    return [t.to(device, dt) for t, dt in ((x, dtype), (r, r_dtype), (w, dtype), (b, dtype), (ds, dtype), (dy, dtype),
                                           (c, dtype))]


def _grads(fn, x, r, w, b, ds, dy, c=None, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    cl = None if c is None else c.detach().clone().requires_grad_()
    s, y = fn(*leaves, r_bias=cl, **kw)
    torch.autograd.backward([s, y], [ds.to(s.dtype), dy.to(y.dtype)])
    out = {"s": s.detach(), "y": y.detach(), "dx": leaves[0].grad, "dr": leaves[1].grad,
           "dw": leaves[2].grad, "db": leaves[3].grad}
    return out if cl is None else {**out, "dc": cl.grad}


def _stream_tol(stream) -> float:
    """The bound a stream of dtype ``stream`` is held to against float64; a ValueError for any other dtype."""
    tols = {torch.float32: FP32_TOL, torch.bfloat16: BF16_STREAM_TOL}
    if stream not in tols:
        raise ValueError(f"stream must be torch.float32 or torch.bfloat16, got {stream!r}")
    return tols[stream]


def odd_size_rows(device, seed: int = 0, sizes=ODD_SIZES, branch_bias: bool = False,
                  stream: torch.dtype = torch.float32, interpreted_sizes=INTERPRETED_SIZES) -> list[dict]:
    """The op (the backend ``auto`` picks on ``device``) in fp32 against float64 on fresh inputs of
    sizes that are multiples of nothing: the largest relative error of s, y and the four gradients (with
    ``branch_bias``, a branch bias c passed as ``r_bias`` and its gradient dc too), and whether it is
    within fp32's bound. With ``stream=torch.bfloat16`` every tensor but the gain and the biases is bf16
    (the stream, the branch, y and the gradients), held to ``BF16_STREAM_TOL`` against float64 of the
    same bf16 inputs."""
    device = torch.device(device)
    tol = _stream_tol(stream)
    gen = torch.Generator().manual_seed(seed)
    runs = [(op.select_backend("auto", device), s, stream) for s in sizes]
    if device.type == "cpu" and interpreted_here(device):
        # the kernels a GPU runs, checked here too; the interpreter has no bf16: a bf16 stream runs as fp16
        # (finer), held to the bf16 bound
        runs += [("triton", s, torch.float16 if stream == torch.bfloat16 else stream) for s in interpreted_sizes]
    rows = []
    for backend, (m, d), dt in runs:
        x, r, w, b, ds, dy, c = _draw(m, d, gen, device, torch.float32, torch.float32)
        x, r, ds, dy = (t.to(dt) for t in (x, r, ds, dy))
        ins = [x, r, w, b, ds, dy]
        c = c if branch_bias else None
        got = _grads(op.add_layer_norm, *ins, c, backend=backend)
        ref = _grads(op.add_layer_norm_reference, *(t.double().cpu() for t in ins),
                     None if c is None else c.double().cpu())
        err = {k: float((got[k].double().cpu() - ref[k]).norm() / ref[k].norm()) for k in ref}
        worst = max(err.values())
        rows.append({"M": m, "D": d, "backend": backend + (" (interpreted)" if backend == "triton" and
                                                           device.type == "cpu" else ""),
                     "stream": str(dt).removeprefix("torch."),
                     **{f"{k} rel err": v for k, v in err.items()}, "worst": worst, "tolerance": tol,
                     "within tolerance": worst < tol})
    return rows


def kernel_rows(m: int, d: int, device, ceilings: dict | None, iters: int = 20, seed: int = 0,
                branch_bias: bool = False, stream: torch.dtype = torch.float32) -> list[dict]:
    """The forward and backward kernels alone at [m, d] with GPT's dtypes (fp32 stream, bf16 branch and
    output) at their default launch configuration: median ms per call (p20, p80), GB/s on the bytes
    each must move (``add_layernorm.traffic_bytes``) and that over the measured copy ceiling. With
    ``branch_bias``, the kernels that add a branch bias and sum its gradient (the same bytes a row); with
    ``stream=torch.bfloat16``, the stream and its gradient in bf16 (dr not written: it is dx)."""
    device = torch.device(device)
    _stream_tol(stream)
    if device.type != "cuda":
        raise ValueError(f"kernel_rows times CUDA kernels; device is {device}")
    k = op._kernel()
    gen = torch.Generator().manual_seed(seed)
    same = stream == torch.bfloat16
    sets = []
    for _ in range(INPUT_SETS):
        x, r, w, b, ds, dy, c = _draw(m, d, gen, device, torch.float32, torch.bfloat16)
        x, ds, c = x.to(stream), ds.to(stream), c if branch_bias else None
        s, y = torch.empty_like(x), torch.empty_like(r)
        mean, rstd = torch.empty(m, device=device), torch.empty(m, device=device)
        k.add_ln_fwd(x, r, w, b, 1e-5, s, y, mean, rstd, c)
        sets.append(dict(x=x, r=r, w=w, b=b, c=c, ds=ds, dy=dy.to(torch.bfloat16), s=s, y=y, mean=mean, rstd=rstd,
                         dx=torch.empty_like(x), dr=None if same else torch.empty_like(r)))
    programs = op._programs(m, d, device)
    fwd = lambda i, S=sets: k.add_ln_fwd(*(S[i % INPUT_SETS][n] for n in ("x", "r", "w", "b")), 1e-5,
                                           *(S[i % INPUT_SETS][n] for n in ("s", "y", "mean", "rstd", "c")))
    bwd = lambda i, S=sets: k.add_ln_bwd(*(S[i % INPUT_SETS][n] for n in ("dy", "ds", "s", "w", "mean", "rstd",
                                                                          "dx", "dr")), programs,
                                         r_bias=branch_bias)
    nbytes = op.traffic_bytes(m, d, stream_bytes=stream.itemsize)
    return [timed_row(name + (" with the branch bias" if branch_bias else "") + (", bf16 stream" if same else ""),
                      bench.time_fn(fn, device, warmup=1, iters=iters, group=LAUNCHES, cuda_graph=True), nbytes[name],
                      ceilings,
                      M=m, D=d)
            for name, fn in (("forward", fwd), ("backward", bwd))]


def column_sum_row(m: int, d: int, device, ceilings: dict | None, iters: int = 20, seed: int = 0) -> dict:
    """What a bias gradient outside the kernel costs: the column sums of a bf16 [m, d] gradient into fp32
    (torch's reduction, one read of the rows), timed as ``kernel_rows`` times the kernels."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"column_sum_row times CUDA kernels; device is {device}")
    gen = torch.Generator(device).manual_seed(seed)
    sets = [torch.randn(m, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(INPUT_SETS * 6)]
    t = bench.time_fn(lambda i: sets[i % len(sets)].sum(0, dtype=torch.float32), device, warmup=1, iters=iters,
                      group=LAUNCHES)
    return timed_row("a bias gradient's own column sum (bf16 rows)", t, float(m * d * 2 + d * 4), ceilings, M=m, D=d)


def kernel_records(rows: list[dict], *, profile: str, device, notebook: str = NOTEBOOK) -> list[dict]:
    """One ms record per kernel (its GB/s alongside); the shape in fields."""
    return records_of(rows, notebook=notebook, study="add_layernorm_kernel", keys=("kernel", "M", "D"),
                      profile=profile, device=device)


def kernel_prose(rows: list[dict]) -> str:
    """The kernels alone, in words built from ``rows``."""
    return alone_words(rows, lambda r: f"{r['M']:,} x {r['D']}")
