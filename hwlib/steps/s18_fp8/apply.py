"""Step 18: the MLP's two linears as FP8 matmuls (``hwlib.steps.s18_fp8.op``: e4m3 forward, e5m2 gradients,
per-tensor scales), sharing the very same parameters."""

from __future__ import annotations

import torch.nn as nn

from .op import swap_mlp_linears
from ...workloads.blocks import MLP
from ..step import require


def apply(model: nn.Module) -> None:
    blocks = getattr(model, "blocks", ())
    for b in blocks:
        require(type(b.mlp) is MLP, "18_fp8", "runs the MLP's linears in FP8: it needs the plain MLP",
                type(b.mlp).__name__)
    trunk = getattr(model, "trunk", None)
    require(not getattr(trunk, "branch_bias", False), "18_fp8",
            "cannot follow 23_branch_bias: the branch without its bias would run mlp_proj's matmul in bf16, "
            "around its FP8 layer", "a trunk with branch_bias")
    n = swap_mlp_linears(model)
    require(n > 0, "18_fp8", "needs pre-LayerNorm blocks with mlp_fc and mlp_proj linears", "none")
