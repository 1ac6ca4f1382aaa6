"""Step 22: each block's MLP as one op (``hwlib.steps.s22_gelu_epilogue.op``) whose bias + GELU and GELU
derivative run in its matmuls' cuBLASLt epilogues, on the block's own parameters."""

from __future__ import annotations

import torch.nn as nn

from .op import gelu_mlp
from ...workloads.blocks import MLP
from ..step import require


class GeluEpilogueMLP(nn.Module):
    """W_proj GELU_tanh(W_fc h) (+ b_proj), the GELU in the first matmul's epilogue and its derivative in
    the backward's. ``bias_column``: h carries ln_2's column of ones (step 25), from which the weight
    gradient's matmul also makes mlp_fc's bias gradient."""

    def __init__(self):
        super().__init__()
        self.bias_column = False

    def forward(self, h, fc: nn.Module, proj: nn.Module, proj_bias: bool = True):
        return gelu_mlp(h, fc.weight, fc.bias, proj.weight, proj.bias if proj_bias else None,
                        bias_column=self.bias_column)


def apply(model: nn.Module) -> None:
    blocks = getattr(model, "blocks", None)
    require(blocks is not None and len(blocks) > 0, "22_gelu_epilogue", "needs pre-LayerNorm blocks", "none")
    for b in blocks:
        require(type(b.mlp) is MLP and type(b.mlp_fc) is nn.Linear and type(b.mlp_proj) is nn.Linear,
                "22_gelu_epilogue", "replaces the MLP's matmuls: it needs the plain MLP on nn.Linear layers "
                "(not after 18_fp8)", f"{type(b.mlp).__name__} on {type(b.mlp_fc).__name__}")
    for b in blocks:
        b.mlp = GeluEpilogueMLP()
