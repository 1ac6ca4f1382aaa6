"""What step 24 removes: the QKV bias gradient's own read of dq, dk and dv."""

from __future__ import annotations

from .op import traffic_bytes


def predict(ctx):
    # kernels/24_qkv_grad_triton.py's count: the QKV bias gradient's reduction re-reads dq, dk, dv
    # (3 d bf16 values a token) after the packing copy; packed and summed in one pass, once per layer.
    per = traffic_bytes(ctx.tokens, ctx.cfg.d_model)
    return ctx.bytes_prediction("the QKV bias gradient's own read of dq, dk and dv",
                                float(ctx.cfg.n_layer * (per["unfused"] - per["fused"])))
