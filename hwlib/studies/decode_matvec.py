"""The decode step's block matmuls alone (issue 47): each projection of a Qwen3 size at the decode
batch, cuBLAS (``F.linear``, what rung ``decode_attn`` runs) against the Triton kernel of
``kernels/14_decode_matvec_triton.py`` over a grid of tile sizes and K splits, each timed with its
weights cold in L2 (a rotation of copies larger than L2, replayed as one CUDA graph per sample), as
they are in a decode step that streams every layer's weights once. Writes one JSON row per
(size, projection, config) and prints the best config of each projection beside cuBLAS.

    python -m hwlib.studies.decode_matvec --sizes qwen3_0.6b qwen3_8b --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import bench
from ..ops.sources import load_python_kernel
from ..workloads.polychromic.config import config
from .decode_bench import log, measure_copy

ROTATE_BYTES = 256 * 2**20       # > every Hopper's L2 (50-60 MB): each call reads its weight from HBM
GRID = {"block_n": (16, 32, 64), "block_k": (128, 256), "num_stages": (3, 5), "split": (1, 2, 4, 8)}


def projections(model_size: str) -> dict:
    """name -> (N, K, form) of one block's four matmuls: form ``split`` where a residual add follows."""
    c = config(model_size)
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden, "plain"), "o": (c.hidden, q, "split"),
            "gate_up": (2 * c.intermediate, c.hidden, "gated"), "down": (c.hidden, c.intermediate, "split")}


def _time(fn, copies: int, dev) -> bench.Timing:
    return bench.time_fn(fn, dev, warmup=2, iters=20, group=copies, cuda_graph=True)


def sweep(model_size: str, rows: int, dev: torch.device, copy_gbps: float, log) -> list[dict]:
    mv = load_python_kernel("14_decode_matvec_triton.py")
    out_rows = []
    for name, (N, K, form) in projections(model_size).items():
        wbytes = 2 * N * K
        copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
        ref = mv.reference(x, ws[0], form)

        def row(impl, t, **cfg):
            r = {"model_size": model_size, "proj": name, "N": N, "K": K, "rows": rows, "form": form, "impl": impl,
                 **cfg, "median_us": t.median_ms * 1e3, "p20_us": t.p20_ms * 1e3, "p80_us": t.p80_ms * 1e3,
                 "weight_bytes": wbytes, "gbps": wbytes / (t.median_ms / 1e3) / 1e9}
            r["share_of_copy"] = r["gbps"] / copy_gbps
            out_rows.append(r)
            return r

        if form == "gated":
            def cublas(i):
                g, u = F.linear(x, ws[i % copies]).chunk(2, dim=-1)
                return F.silu(g) * u
        else:
            def cublas(i):
                return F.linear(x, ws[i % copies])
        base = row("cublas", _time(cublas, copies, dev))
        best = None
        splits = GRID["split"] if form == "split" else (1,)
        for bn, bk, st, sp in itertools.product(GRID["block_n"], GRID["block_k"], GRID["num_stages"], splits):
            if sp > 1 and K // sp < bk:
                continue
            out = torch.empty(mv.out_shape(rows, N, form, sp), device=dev,
                              dtype=torch.float32 if form == "split" else torch.bfloat16)
            cfg = dict(split=sp, block_n=bn, block_k=bk, num_stages=st)
            try:
                mv.matvec(x, ws[0], out, form, **cfg)
                got = out.double().sum(0) if form == "split" else out.double()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                t = _time(lambda i: mv.matvec(x, ws[i % copies], out, form, **cfg), copies, dev)
            except Exception as e:       # a config that does not compile is a row, not the end of the sweep
                out_rows.append({"model_size": model_size, "proj": name, "impl": "triton", **cfg,
                                 "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            r = row("triton", t, **cfg, max_rel_err=err)
            if best is None or r["median_us"] < best["median_us"]:
                best = r
        if best:
            log(f"{model_size} {name:8s} N={N:6d} K={K:6d}: cuBLAS {base['median_us']:7.1f} us "
                f"({base['share_of_copy']:.0%} of copy), Triton best {best['median_us']:7.1f} us "
                f"({best['share_of_copy']:.0%}) split={best['split']} BN={best['block_n']} BK={best['block_k']} "
                f"stages={best['num_stages']} err={best['max_rel_err']:.1e}")
        del ws
        torch.cuda.empty_cache()
    return out_rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["qwen3_0.6b", "qwen3_8b"])
    p.add_argument("--rows", type=int, default=12, help="decode batch (P N rows); at most 16")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    a.out.mkdir(parents=True, exist_ok=True)
    copy = measure_copy(dev)
    rows = []
    for size in a.sizes:
        rows += sweep(size, a.rows, dev, copy, log)
        (a.out / "matvec_sweep.json").write_text(json.dumps({"device": torch.cuda.get_device_name(dev),
                                                             "copy_gbps": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
