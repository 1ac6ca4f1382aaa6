"""What padding a GEMM dimension buys: the output projection timed at several vocabulary sizes."""

from __future__ import annotations

import torch

from .. import bench


def output_projection_sweep(tokens: int, d_model: int, vocabs: list[int], device: torch.device,
                            dtype: torch.dtype = torch.bfloat16, iters: int = 20) -> list[dict]:
    """Time logits = x @ W^T (x: tokens x d, W: V x d) for each V, forward only.

    FLOPs 2 * tokens * d * V; "useful" TFLOP/s counts only the first ``vocabs[0]`` columns, so a
    padded shape shows what it delivers of the unpadded work.
    """
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d_model, device=device, dtype=dtype, generator=g)
    useful_v = vocabs[0]
    rows = []
    for v in vocabs:
        w = torch.randn(v, d_model, device=device, dtype=dtype, generator=g)
        t = bench.time_fn(lambda i: x @ w.t(), device, warmup=3, iters=iters)
        s = t.median_ms / 1e3
        rows.append({"vocab": v, "multiple_of_64": v % 64 == 0, "ms": t.median_ms, "p20_ms": t.p20_ms,
                     "p80_ms": t.p80_ms, "tflops": 2 * tokens * d_model * v / s / 1e12,
                     "useful_tflops": 2 * tokens * d_model * useful_v / s / 1e12})
        del w
    return rows
