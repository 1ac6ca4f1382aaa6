"""What step 23 removes: the output projections' bias gradients' own passes."""


def predict(ctx):
    # The output projections' bias gradients (two a layer) are each a column sum of a bf16 [tokens, d]
    # gradient, one read of it; in the LayerNorm's backward kernel they are sums of values already in
    # registers. The forward's bias add moves from the matmul's epilogue to the LayerNorm: no bytes.
    return ctx.bytes_prediction("the output projections' bias gradients' own passes over their [tokens, d] gradients",
                                2.0 * ctx.cfg.n_layer * ctx.tokens * ctx.cfg.d_model * 2)
