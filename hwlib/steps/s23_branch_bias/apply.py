"""Step 23: each branch's output bias (c_proj's, mlp_proj's) added where the branch meets the residual
stream, inside the fused add + LayerNorm, whose backward sums its gradient from values already in
registers: no pass of its own over a [tokens, d] gradient."""

from __future__ import annotations

import torch.nn as nn

from ..s21_fused_layernorm.apply import fused_trunk
from ..step import require


def apply(model: nn.Module) -> None:
    trunk = fused_trunk(model, "23_branch_bias", "adds each branch's bias inside the fused residual LayerNorm")
    for b in model.blocks:
        require(hasattr(b.mixer, "attend") and type(b.mlp_proj) is nn.Linear, "23_branch_bias",
                "needs a mixer with attend() and c_proj, and mlp_proj a plain nn.Linear (not after 18_fp8)",
                f"{type(b.mixer).__name__}, {type(b.mlp_proj).__name__}")
    trunk.branch_bias = True
