"""What step 31 removes: the host's time between the GPU's kernels (notebook 16's idle: the step's wall
time less the union of its kernels' intervals), less the work its padding rows add."""

from __future__ import annotations

from ...roofline import Prediction, flops_ms


def padding_flops(cfg) -> float:
    """Forward + backward FLOPs a step spends on padding rows, on average over one epoch of the config's
    synthetic set: each padding row is pack_len tokens through every layer, attending within itself."""
    from ...workloads.encoder_nli import flops_formula
    from .buckets import bucket_stats, default_buckets, row_counts
    st = bucket_stats(row_counts(cfg), default_buckets(cfg), cfg.pack_len)
    rows = st["padding rows"] / st["batches"]
    return flops_formula(cfg, rows * cfg.pack_len, rows * cfg.pack_len ** 2, 0)


def predict(ctx):
    extra = padding_flops(ctx.cfg)
    p = Prediction(ctx.workload, ctx.step, "bound", "the host time between kernels that a replayed whole step "
                   "leaves out (launches, dynamo's guards, the autograd engine, AdamW's launches): at most the "
                   "step before's time above its floor, less the padding rows' FLOPs at the matmul ceiling",
                   flops_removed=-extra if extra else 0.0)   # no padding: 0, not -0
    if ctx.prev_ms is not None and ctx.prev_floor_ms is not None:
        p.saved_ms = max(0.0, ctx.prev_ms - ctx.prev_floor_ms) - (flops_ms(extra, ctx.ceilings, ctx.precision) or 0.0)
    elif ctx.ceilings:
        p.missing = "the step before has no measured time in this run"
    return p
