"""Step 28's study: the matmuls of one GPT-2 block, each captured in a CUDA graph with and without
cuBLAS's workspace (``hwlib.blas``): the memset nodes a call brings into the graph, the kernel cuBLAS
picked, and the time per call.

Each case is ``CALLS`` back-to-back calls over input sets that rotate (together larger than L2),
captured once into a CUDA graph after a warm-up; a sample replays the graph, and the time per call is
the replay's over ``CALLS``. Timed in a graph, as the step runs them: a memset node's cost is the wait
it puts between kernels on the device, which a host-launched timing would hide behind launches.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ... import bench, blas, results, trace
from ...studies.kernel_records import kernel_records, not_timed_words
from ..s21_fused_layernorm.op import BIAS_COLUMNS, with_bias_column
from ..s22_gelu_epilogue import op as gelu_epilogue_op
from . import STEP

NOTEBOOK = STEP.name   # the records' notebook: the step's own, which bears its name
CALLS = 8
INPUT_SETS = 3      # 3 x a block's operands at GPT-2 small's full profile: ~1 GB, far beyond a 50 MB L2
WORKSPACES = ("32 MiB", "none")


def _sets(M: int, d: int, device, seed: int) -> list[dict]:
    gen = torch.Generator(device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    r = lambda *s: torch.randn(*s, generator=gen, **bf)
    out = []
    for _ in range(INPUT_SETS):
        x = r(M, d)
        out.append(dict(x=x, xc=with_bias_column(x), a=r(M, d), h=r(M, 4 * d), pre=r(M, 4 * d), dpre=r(M, 4 * d),
                        dy=r(M, d), dqkv=r(M, 3 * d), w_qkv=r(3 * d, d) / d ** 0.5, b_qkv=r(3 * d),
                        w_o=r(d, d) / d ** 0.5, w_fc=r(4 * d, d) / d ** 0.5, b_fc=r(4 * d),
                        w_proj=r(d, 4 * d) / (4 * d) ** 0.5))
    return out


def block_matmuls(M: int, d: int, device, seed: int = 0) -> list[tuple[str, str, str | None, object]]:
    """(name, library, hwlib's call or None for torch's, fn(i)) for the matmuls of one block of step 25 at M
    tokens and width d, each as the step calls it; ``fn(i)`` uses input set ``i`` mod ``INPUT_SETS``."""
    sets, mod = _sets(M, d, device, seed), gelu_epilogue_op.module()
    S = lambda i: sets[i % INPUT_SETS]
    # read at each call, as the op does: the setting in force while the graph is captured
    ws = gelu_epilogue_op.workspace_bytes
    return [
        ("QKV forward, x W^T + b", "torch (cuBLASLt, bias epilogue)", None,
         lambda i: F.linear(S(i)["x"], S(i)["w_qkv"], S(i)["b_qkv"])),
        ("attention output forward, a W^T", "torch (cuBLAS)", None, lambda i: S(i)["a"] @ S(i)["w_o"].t()),
        ("mlp_fc forward, GELU epilogue", "hwlib (cuBLASLt)", "forward",
         lambda i: mod.gelu_forward(S(i)["xc"][:, :d], S(i)["w_fc"], S(i)["b_fc"], ws("forward"))),
        ("mlp_proj forward, h W^T", "torch (cuBLAS)", None, lambda i: S(i)["h"] @ S(i)["w_proj"].t()),
        ("mlp_proj input gradient, DGELU epilogue", "hwlib (cuBLASLt)", "backward",
         lambda i: mod.gelu_backward(S(i)["dy"], S(i)["w_proj"], S(i)["pre"], ws("backward"))),
        (f"mlp_fc input gradient, {d} + {BIAS_COLUMNS} wide", "hwlib (cuBLASLt)", "input_grad",
         lambda i: mod.input_grad_padded(S(i)["dpre"], S(i)["w_fc"], d + BIAS_COLUMNS, ws("input_grad"))),
        ("QKV input gradient, dqkv W", "torch (cuBLAS)", None, lambda i: S(i)["dqkv"] @ S(i)["w_qkv"]),
        ("QKV weight gradient, dqkv^T x", "torch (cuBLAS)", None, lambda i: S(i)["dqkv"].t() @ S(i)["x"]),
    ]


def _captured(fn, device, calls: int):
    # bench.time_fn(cuda_graph=True) captures its own graph; this one is kept to be profiled as well as timed
    for i in range(2):   # cuBLAS's handles and heuristics, outside the capture
        fn(i)
    bench.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    bench.synchronize(device)
    return graph


def _device_work(graph, device) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        events, why = trace.record(graph.replay, device, Path(tmp) / "replay.json")
    if events is None:
        raise RuntimeError(f"the replay could not be profiled: {why}")
    return sorted(trace.device_events(events), key=lambda e: e["ts"])


def matmul_rows(M: int, d: int, device, iters: int = 20, seed: int = 0, calls: int = CALLS) -> list[dict]:
    """Per matmul of ``block_matmuls`` (its name under "kernel", as other studies' rows) and per workspace
    (``WORKSPACES``): the memsets a call brings into the graph, the longest CUDA kernel that ran, and the
    median ms per call (p20, p80)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"matmul_rows captures CUDA graphs; device is {device}")
    if calls < 1 or iters < 1:
        raise ValueError(f"calls and iters must be >= 1, got {calls} and {iters}")
    if blas.workspace_free():
        raise RuntimeError("matmul_rows was called inside hwlib.blas.no_workspace: its rows with the workspace "
                           "would run without it")
    rows = []
    for name, lib, call, fn in block_matmuls(M, d, device, seed):
        follows = call is None or call in gelu_epilogue_op.FOLLOW_BLAS   # torch's matmuls all follow hwlib.blas
        for ws in WORKSPACES:
            with blas.no_workspace(ws == "none"):
                graph = _captured(fn, device, calls)
            t = bench.time_fn(lambda i: graph.replay(), device, warmup=2, iters=iters)
            work = _device_work(graph, device)
            memsets = [e for e in work if e.get("cat") == "gpu_memset"]
            kernels = [e for e in work if e.get("cat") == "kernel"]
            longest = max(kernels, key=lambda e: float(e.get("dur", 0.0)), default=None)
            rows.append({"kernel": name, "library": lib, "follows the setting": follows, "workspace": ws, "M": M,
                         "d": d, "memsets per call": len(memsets) / calls,
                         "cuda kernel": str(longest["name"])[:72] if longest else None, "ms": t.median_ms / calls,
                         "p20": t.p20_ms / calls, "p80": t.p80_ms / calls})
            del graph
    return rows


def matmul_records(rows: list[dict], *, profile: str, device) -> list[dict]:
    """``kernel_records``' ``kernel_ms`` record per row (the CUDA kernel in its params), and a
    ``memsets_per_call`` record beside it; the matmul, its workspace and the shape in the fields."""
    keys = ("kernel", "workspace", "M", "d")
    recs = kernel_records(rows, notebook=NOTEBOOK, study="gemm_workspace", keys=keys, profile=profile,
                          device=device, params=("cuda kernel",))
    for r in rows:
        recs.append(results.make_record(notebook=NOTEBOOK, workload="gpt", step=None, metric="memsets_per_call",
                                        value=r["memsets per call"], unit="count", profile=profile, device=device,
                                        fields={"study": "gemm_workspace", **{k: r[k] for k in keys}}))
    return recs


def pairs(rows: list[dict]) -> list[dict]:
    """One row per matmul: its time per call with and without the workspace, the difference, and whether
    the difference is beyond the two timings' p20-p80 spreads."""
    by = {(r["kernel"], r["workspace"]): r for r in rows}
    out = []
    for name in dict.fromkeys(r["kernel"] for r in rows):
        a, b = by.get((name, WORKSPACES[0])), by.get((name, WORKSPACES[1]))
        if a is None or b is None:
            continue
        beyond = b["p80"] < a["p20"] or b["p20"] > a["p80"]
        out.append({"matmul": name, "library": a["library"], "follows the setting": a["follows the setting"],
                    "memsets with": a["memsets per call"],
                    "memsets without": b["memsets per call"], "us with": a["ms"] * 1e3, "us without": b["ms"] * 1e3,
                    "saved us": (a["ms"] - b["ms"]) * 1e3, "beyond spread": beyond})
    return out


def prose(rows: list[dict], n_layer: int) -> str:
    """The matmuls alone in words, built from ``rows`` (``matmul_rows``) and the model's ``n_layer``; the
    total counts the matmuls the setting changes (the GELU epilogue matmuls keep their workspace)."""
    if not rows:
        return not_timed_words("The matmuls")
    ps = pairs(rows)
    changed = [p for p in ps if p["follows the setting"]]
    gone = [p for p in changed if p["memsets with"] > 0 and p["memsets without"] == 0]
    kept = [p for p in ps if not p["follows the setting"]]
    saved = sum(p["saved us"] for p in changed)
    text = (f"Captured in CUDA graphs of back-to-back calls at {rows[0]['M']:,} tokens, {len(ps)} matmuls of a block: "
            f"{sum(p['memsets with'] > 0 for p in ps)} brought a memset per call with cuBLAS's workspace; of the "
            f"{len(changed)} the step runs without it, {len(gone)} lost theirs. ")
    if kept:
        text += "Kept with their workspace, as in the step: " + ", ".join(p["matmul"] for p in kept) + ". "
    text += ("Per call, without the workspace against with it: " + "; ".join(
        f"{p['matmul']} {p['us with']:.1f} -> {p['us without']:.1f} us"
        f"{'' if p['beyond spread'] else ' (within the spread)'}" for p in changed) +
        f". Together {abs(saved):.1f} us a block {'saved' if saved >= 0 else 'lost'}, "
        f"{abs(saved) * n_layer / 1e3:.3f} ms over {n_layer} blocks (a block's matmuls alone, not the step: in "
        f"the step a memset also waits on the kernel before it).")
    return text
