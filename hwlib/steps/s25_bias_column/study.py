"""Step 25's study of the bias column (``add_layer_norm(..., ones_column=True)`` feeding
``gelu_mlp(..., bias_column=True)``): the MLP with the column against float64 at odd sizes, and the
matmuls it changes alone at GPT-2 small's shape against the kernels they replace.

Kernel timing as step 21's (``hwlib.steps.s21_fused_layernorm.study``): each sample is ``LAUNCHES``
back-to-back calls over input sets that rotate (together larger than L2).
"""

from __future__ import annotations

import functools

import torch

from ... import bench
from ...ops.sources import interpreted_here
from ...studies.kernel_records import kernel_records as records_of, not_timed_words
from ..s21_fused_layernorm.op import BIAS_COLUMNS, add_layer_norm, add_layer_norm_reference, with_bias_column
from ..s22_gelu_epilogue import op as gelu_epilogue_op
from . import STEP

NOTEBOOK = STEP.name   # the records' notebook: the step's own, which bears its name
LAUNCHES = 20
INPUT_SETS = 4          # 4 x (dpre, x) at GPT-2 small's MLP: ~500 MB, far beyond a 50 MB L2
ODD_SIZES = ((67, 16, 64, 24), (129, 64, 256, 64), (5, 8, 8, 8))   # (rows, K, N, C): widths multiples of 8
# On a CPU the LayerNorm's Triton kernels, which write the column in the step, also run interpreted
# (``interpreted_here``), with step 23's branch bias as the step launches them: the MLP (torch on a CPU)
# reads the column they wrote, and the gradient of the LayerNorm's stream input comes back through their
# backward, which must pass over the column's gradient. A partial block of rows, an odd width; a
# fraction of a second.
INTERPRETED_SIZES = ((5, 33, 40, 9),)
FP32_TOL = 1e-5      # relative, against float64 (CPU, fp32)


def _draw(M, K, N, C, gen, device, dtype):
    x = torch.randn(M, K, generator=gen, dtype=torch.float64)
    ts = [x, torch.randn(N, K, generator=gen, dtype=torch.float64) / K ** 0.5,
          0.3 * torch.randn(N, generator=gen, dtype=torch.float64),
          torch.randn(C, N, generator=gen, dtype=torch.float64) / N ** 0.5,
          0.1 * torch.randn(C, generator=gen, dtype=torch.float64)]
    dy = torch.randn(M, C, generator=gen, dtype=torch.float64)
    return [t.to(device, dtype) for t in ts], dy.to(device, dtype)


def _through_layernorm(x, ws, dy, gen):
    """``x`` [M, K] as the stream into the LayerNorm's Triton kernels (with a branch r, its bias c, and the
    norm's w and b, drawn from ``gen``) that write the MLP's input with the bias column: (got, ref, the
    MLP's input gradient beyond K all zero), got and ref as ``odd_size_rows``' names, dx being the
    stream's gradient; ref in float64."""
    M, K = x.shape
    ln = [torch.randn(M, K, generator=gen, dtype=torch.float64), 0.3 * torch.randn(K, generator=gen, dtype=torch.float64),
          1 + 0.1 * torch.randn(K, generator=gen, dtype=torch.float64), 0.1 * torch.randn(K, generator=gen, dtype=torch.float64)]

    def grads(leaves, norm, mlp):
        x, r, c, w, b, *mlp_ws = leaves
        _, y = norm(x, r, w, b, r_bias=c)
        out = mlp(y, *mlp_ws)
        g = torch.autograd.grad(out, [y, x, *mlp_ws], dy.to(out.dtype))
        return [out.detach(), *g[1:]], g[0]
    got, dy_wide = grads([t.detach().to(x, copy=True).requires_grad_() for t in (x, *ln, *ws)],
                         functools.partial(add_layer_norm, ones_column=True, backend="triton"),
                         functools.partial(gelu_epilogue_op.gelu_mlp, bias_column=True))
    ref, _ = grads([t.detach().double().requires_grad_() for t in (x, *ln, *ws)], add_layer_norm_reference,
                   gelu_epilogue_op.gelu_mlp_reference)
    return got, ref, float(dy_wide[:, K:].abs().max()) == 0.0


def odd_size_rows(device, seed: int = 0, sizes=ODD_SIZES, interpreted_sizes=INTERPRETED_SIZES) -> list[dict]:
    """The MLP with the bias column (the backend ``auto`` picks: cuBLASLt in bf16 on a GPU, torch in fp32
    on a CPU) against float64 on fresh inputs: the output and the gradients of x (its first K columns;
    the rest must be exactly zero), both weights and both biases. On a GPU no worse than the same op
    without the column on the same operands (``gelu_mlp.no_worse_than_unfused``). On a CPU where Triton
    interprets, at ``interpreted_sizes`` the column written by the LayerNorm's Triton kernels
    (``_through_layernorm``; dx: the LayerNorm's stream input's)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = ("y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj")
    runs = [(False, s) for s in sizes]
    if device.type == "cpu" and interpreted_here(device):
        runs += [(True, s) for s in interpreted_sizes]    # the kernels that write the column on a GPU, here too
    rows = []
    for interpreted, (M, K, N, C) in runs:
        (x, *ws), dy = _draw(M, K, N, C, gen, device, dtype)
        if interpreted:
            got, ref, pad_zero = _through_layernorm(x, ws, dy, gen)
            backend = "triton LayerNorm (interpreted), torch MLP"
        else:
            ref64 = [t.double().requires_grad_() for t in (x, *ws)]
            y64 = gelu_epilogue_op.gelu_mlp_reference(*ref64)
            ref = [y64.detach(), *torch.autograd.grad(y64, ref64, dy.double())]

            def run(xin, column):
                leaves = [xin.detach().clone().requires_grad_()] + [t.detach().clone().requires_grad_() for t in ws]
                y = gelu_epilogue_op.gelu_mlp(*leaves, bias_column=column)
                return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

            got = run(with_bias_column(x), True)
            pad_zero = float(got[1][:, K:].abs().max()) == 0.0
            got[1] = got[1][:, :K]
            backend = gelu_epilogue_op.select_backend("auto", device, dtype, (K, N, C))
        err = [float((g.double() - r).norm() / r.norm()) for g, r in zip(got, ref)]
        row = {"rows": M, "K": K, "N": N, "C": C, "backend": backend,
               **{f"{n} rel err": e for n, e in zip(names, err)}, "dx's extra columns zero": pad_zero}
        if device.type == "cuda":
            base = [float((g.double() - r).norm() / r.norm()) for g, r in zip(run(x, False), ref)]
            ok = all(gelu_epilogue_op.no_worse_than_unfused(e, b) for e, b in zip(err, base))
        else:
            ok = max(err) < FP32_TOL
        rows.append({**row, "within tolerance": ok and pad_zero})
    return rows


def kernel_rows(M: int, K: int, N: int, device, iters: int = 20, seed: int = 0) -> list[dict]:
    """The matmuls the bias column changes, alone at [M, K] -> [M, N] (bf16): mlp_fc's weight gradient
    with and without the column, the column sum it replaces (compiled by inductor, as in the step), and
    the input gradient plain and written K + BIAS_COLUMNS wide: median ms per call (p20, p80)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernel_rows times CUDA kernels; device is {device}")
    gen = torch.Generator(device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    sets = []
    for _ in range(INPUT_SETS):
        x = torch.randn(M, K, generator=gen, **bf)
        sets.append(dict(dpre=torch.randn(M, N, generator=gen, **bf), x=x, xc=with_bias_column(x),
                         w=torch.randn(N, K, generator=gen, **bf) / K ** 0.5))
    colsum = torch.compile(lambda t: t.sum(0), fullgraph=True)
    mod = gelu_epilogue_op.module()
    S = lambda i, k: sets[i % INPUT_SETS][k]
    cases = (("weight gradient, dpre^T x", lambda i: S(i, "dpre").t() @ S(i, "x")),
             (f"weight and bias gradient, dpre^T [x, 1] ({K} + {BIAS_COLUMNS} columns)",
              lambda i: S(i, "dpre").t() @ S(i, "xc")),
             ("bias gradient's own column sum (inductor)", lambda i: colsum(S(i, "dpre"))),
             ("input gradient, dpre W_fc", lambda i: S(i, "dpre") @ S(i, "w")),
             (f"input gradient written {K} + {BIAS_COLUMNS} wide (cuBLASLt)",
              lambda i: mod.input_grad_padded(S(i, "dpre"), S(i, "w"), K + BIAS_COLUMNS,
                                              gelu_epilogue_op.workspace_bytes("input_grad"))))
    rows = []
    for name, fn in cases:
        t = bench.time_fn(fn, device, warmup=2, iters=iters, group=LAUNCHES)
        rows.append({"kernel": name, "M": M, "K": K, "N": N, "ms": t.median_ms, "p20": t.p20_ms, "p80": t.p80_ms})
    return rows


def kernel_records(rows: list[dict], *, profile: str, device) -> list[dict]:
    """One ms record per kernel; the shape in fields."""
    return records_of(rows, notebook=NOTEBOOK, study="bias_column_kernel", keys=("kernel", "M", "K", "N"),
                      profile=profile, device=device)


def kernel_prose(rows: list[dict]) -> str:
    """What the column costs against what it removes, in words built from ``rows``."""
    if not rows:
        return not_timed_words("The matmuls")
    ms = {i: r["ms"] * 1e3 for i, r in enumerate(rows)}
    return (f"Alone (median per call, {rows[0]['M']:,} rows): the weight gradient took {ms[0]:.1f} us plain and "
            f"{ms[1]:.1f} us with the bias column ({ms[1] - ms[0]:+.1f} us), against {ms[2]:.1f} us for the column "
            f"sum it replaces; the input gradient took {ms[3]:.1f} us plain and {ms[4]:.1f} us written with the "
            f"extra columns ({ms[4] - ms[3]:+.1f} us). Net per MLP: {ms[2] - (ms[1] - ms[0]) - (ms[4] - ms[3]):.1f} us "
            f"saved.")
