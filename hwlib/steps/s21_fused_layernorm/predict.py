"""What step 21 removes: the LayerNorms' re-read of each residual sum."""

from __future__ import annotations


def predict(ctx):
    # One pass per op (studies.breakdown.gpt_floors' count): the add reads the fp32 stream and the branch
    # and writes the sum (10 d bytes a token), the LayerNorm reads the sum again (4 d) and writes its output
    # (2 d); fused, the sum is normalised where it is made: 4 d bytes fewer per LayerNorm with an add before
    # it (2 L of them), forward, and backward counted as twice the forward.
    L, d = ctx.cfg.n_layer, ctx.cfg.d_model
    return ctx.bytes_prediction("the LayerNorms' re-read of each residual sum at one pass per op; inductor already "
                                "fuses the forward add into the LayerNorm, so less may be left",
                                3.0 * ctx.tokens * 2 * L * 4 * d)
