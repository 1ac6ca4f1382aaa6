"""Step 32's study: its three fused matmuls alone at Vision-BDH's shape, each against the same work as the
recipe runs it compiled (cuBLAS's bmm, then inductor's elementwise kernel over the result it wrote).

Kernel timing as step 21's (``hwlib.steps.s21_fused_layernorm.study``): each sample is ``LAUNCHES``
back-to-back launches over input sets that rotate (together larger than L2).
"""

from __future__ import annotations

import torch

from ... import bench
from ...studies.kernel_records import alone_words, timed_row
from ...studies.kernel_records import kernel_records as records_of
from ...workloads.vit_bdh import TOKENS, rope_tables
from . import STEP, op
from .predict import passes_removed

NOTEBOOK = STEP.name
LAUNCHES = 10
INPUT_SETS = 3     # 3 x (s, u and the two results) at [6, 16,640, 1024] bf16: 2.4 GB, far beyond a 50 MB L2
MATMULS = ("encode (forward)", "gate (forward)", "decoder's input gradient (backward)")


def _operands(H, M, D, N, device, gen):
    bf = dict(device=device, dtype=torch.bfloat16)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)
    cos, sin = (t.to(**bf) for t in rope_tables(N, TOKENS))
    return {"x": r(M, D), "E": r(H, D, N, scale=D ** -0.5), "a": r(H, M, D), "E_v": r(H, D, N, scale=D ** -0.5),
            "W": r(H, N, D, scale=N ** -0.5), "s": r(H, M, N).relu(), "u": r(H, M, N).relu(), "cos": cos, "sin": sin}


def kernel_rows(cfg, device, ceilings: dict | None, iters: int = 20, seed: int = 0) -> list[dict]:
    """Each of the three matmuls with its epilogue at ``cfg``'s shape (M = batch x 65 tokens), bf16: the
    Triton kernel against the recipe's torch formula compiled by inductor (``op._torch_gates``), median
    ms per call (p20, p80), GB/s on the bytes each moves at one pass per tensor
    (``predict.passes_removed``) and that over the measured copy ceiling."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernel_rows times CUDA kernels; device is {device}")
    H, D, N, M = cfg.n_head, cfg.d_model, cfg.n_neuron, cfg.batch * TOKENS
    gen = torch.Generator(device).manual_seed(seed)
    sets = [_operands(H, M, D, N, device, gen) for _ in range(INPUT_SETS)]
    k = op._kernel()
    calls = {
        "encode (forward)": (lambda o, f: f(op.ENCODE, o["x"], o["E"], cos=o["cos"], sin=o["sin"], tokens=TOKENS)),
        "gate (forward)": (lambda o, f: f(op.GATE, o["a"], o["E_v"], s=o["s"])),
        "decoder's input gradient (backward)": (lambda o, f: f(op.GATE_GRAD, o["x"], o["W"].transpose(1, 2),
                                                               s=o["s"], u=o["u"])),
    }
    compiled = torch.compile(op._torch_gates, fullgraph=True, dynamic=False)
    q = H * M * N * 2
    rows = []
    for name in MATMULS:
        unfused, fused = passes_removed()[name]
        call = calls[name]
        for label, fn, passes in ((f"{name}: fused epilogue (Triton)", k.gates, fused),
                                  (f"{name}: bmm, then inductor's elementwise kernel", compiled, unfused)):
            t = bench.time_fn(lambda i, fn=fn, call=call: call(sets[i % INPUT_SETS], fn), device, warmup=2,
                              iters=iters, group=LAUNCHES)
            rows.append(timed_row(label, t, passes * q, ceilings, matmul=name, H=H, M=M, N=N))
    return rows


def kernel_records(rows: list[dict], *, profile: str, device) -> list[dict]:
    """One ms record per kernel (its GB/s alongside); the shape in fields."""
    return records_of(rows, notebook=NOTEBOOK, study="bdh_gates_kernel", keys=("kernel", "H", "M", "N"),
                      profile=profile, device=device, workload="vit_bdh")


def kernel_prose(rows: list[dict]) -> str:
    """The kernels alone, in words built from ``rows``, and each fused matmul's time over the recipe's."""
    words = alone_words(rows, lambda r: f"[{r['H']}, {r['M']:,}, {r['N']}]")
    pairs = [(rows[i], rows[i + 1]) for i in range(0, len(rows) - 1, 2)]
    if pairs:
        words += " Fused over the recipe's: " + "; ".join(
            f"{a['matmul']} {a['ms'] / b['ms']:.2f}x the time" for a, b in pairs) + "."
    return words
