"""What step 27 removes: half the bytes of the stream terms in the fused residual LayerNorms."""

from __future__ import annotations

from ..s21_fused_layernorm.op import traffic_bytes


def predict(ctx):
    # The fused residual LayerNorms' bytes (kernels/21_add_layernorm_triton.py's count) with a bf16
    # stream against an fp32 one, at each of the 2 L calls (one after every branch; block 0's first
    # LayerNorm has no add before it, the final one has): forward and backward once each. The embedding
    # sum's write and block 0's plain LayerNorm read, both narrower too, are not counted.
    n, d = ctx.tokens, ctx.cfg.d_model
    f32, b16 = traffic_bytes(n, d, stream_bytes=4), traffic_bytes(n, d, stream_bytes=2)
    return ctx.bytes_prediction("the fused residual LayerNorms' stream terms at 2 bytes instead of 4, and the branch "
                                "gradient's copy that a stream of the branch's dtype no longer needs",
                                2.0 * ctx.cfg.n_layer * sum(f32[k] - b16[k] for k in f32))
