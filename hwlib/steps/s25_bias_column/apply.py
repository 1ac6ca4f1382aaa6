"""Step 25: mlp_fc's bias gradient out of its weight-gradient matmul. ln_2 writes its output with a
column of ones (and zeros to a 16-column boundary); the fused MLP reads the first d columns in its
forward, and dW_fc's matmul over [x | 1] gives db_fc as its last column."""

from __future__ import annotations

import torch.nn as nn

from ..s21_fused_layernorm.apply import fused_trunk
from ..s22_gelu_epilogue.apply import GeluEpilogueMLP
from ..step import require


def apply(model: nn.Module) -> None:
    trunk = fused_trunk(model, "25_bias_column", "has the fused ln_2 write a column of ones")
    for b in model.blocks:
        require(isinstance(b.mlp, GeluEpilogueMLP), "25_bias_column",
                "is a bias column of the fused MLP: it needs 22_gelu_epilogue's MLP", type(b.mlp).__name__)
    trunk.ones_column = True
    for b in model.blocks:
        b.mlp.bias_column = True
