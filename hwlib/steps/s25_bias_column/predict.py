"""What step 25 removes: mlp_fc's bias gradient's own read of its [tokens, 4 d] gradient."""


def predict(ctx):
    # mlp_fc's bias gradient is a column sum of the bf16 [tokens, 4 d] dpre, one read of it a layer; through
    # the bias column it is one more column of a matmul that reads dpre anyway (its 16 extra columns of
    # output, 2% of that matmul's FLOPs, and the LayerNorm's 16 extra bf16 columns are not counted).
    return ctx.bytes_prediction("mlp_fc's bias gradient's own read of its [tokens, 4 d] gradient",
                                2.0 * ctx.cfg.n_layer * ctx.tokens * 4 * ctx.cfg.d_model)
