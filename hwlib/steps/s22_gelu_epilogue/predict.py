"""What step 22 removes: the MLP's GELU passes over its [tokens, 4 d] activations."""

from __future__ import annotations

from .op import bytes_removed


def predict(ctx):
    # kernels/22_gelu_epilogue.cpp's count at one pass per op, per layer: the GELU's re-read of the
    # pre-activation (forward), the input gradient's write and re-read (backward).
    per = bytes_removed(ctx.tokens, 4 * ctx.cfg.d_model)
    return ctx.bytes_prediction("the MLP's GELU passes over its [tokens, 4 d] activations at one pass per op; an "
                                "epilogue that writes two outputs can slow its matmul, so less may be left",
                                float(ctx.cfg.n_layer * (per["forward"] + per["backward"])))
