"""Step 21: each residual add fused into the LayerNorm after it (``hwlib.steps.s21_fused_layernorm.op``: one
Triton kernel each way), in a trunk that hands each branch's output on unsummed.

    x_{i+1} = x_i + r_i,  h = LN(x_{i+1})   ->   (x_{i+1}, h) = add_layer_norm(x_i, r_i, LN)

The later steps of this branch set the trunk's options: ``branch_bias`` (23: each branch's output
bias added, and its gradient summed, inside the add), ``ones_column`` (25: ln_2 writes a column of
ones beside its output for the MLP's bias gradient) and ``low_precision_stream`` (27: the stream in
autocast's dtype)."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from .op import add_layer_norm
from ...precision import compute_dtype
from ..step import require


class FusedResidualTrunk(nn.Module):
    """The blocks of a pre-LayerNorm model with every residual add fused into the next LayerNorm; returns
    ln_f's output, as ``Trunk`` does."""

    def __init__(self):
        super().__init__()
        self.branch_bias = False
        self.ones_column = False
        self.low_precision_stream = False

    def forward(self, x, model):
        if self.low_precision_stream:
            x = x.to(compute_dtype(x))
        pending = None
        for b in model.blocks:
            if pending is None:
                h = b.ln_1(x)
            else:
                x, h = add_layer_norm(x, pending[0], b.ln_1.weight, b.ln_1.bias, b.ln_1.eps, r_bias=pending[1])
            r, r_bias = self.mixer_branch(b, h)
            x, h = add_layer_norm(x, r, b.ln_2.weight, b.ln_2.bias, b.ln_2.eps, r_bias=r_bias,
                                  ones_column=self.ones_column)
            pending = self.mlp_branch(b, h)
        r, r_bias = pending
        return add_layer_norm(x, r, model.ln_f.weight, model.ln_f.bias, model.ln_f.eps, r_bias=r_bias)[1]

    def mixer_branch(self, block, h):
        """(the mixer's output, None), or with ``branch_bias`` (its output before c_proj's bias, that bias)."""
        if self.branch_bias:
            mixer = block.mixer
            return F.linear(mixer.attend(h), mixer.c_proj.weight), mixer.c_proj.bias
        return block.mixer(h), None

    def mlp_branch(self, block, h):
        """(the MLP's output, None), or with ``branch_bias`` (its output before mlp_proj's bias, that bias)."""
        if self.branch_bias:
            return block.mlp(h, block.mlp_fc, block.mlp_proj, proj_bias=False), block.mlp_proj.bias
        return block.mlp(h, block.mlp_fc, block.mlp_proj), None


def apply(model: nn.Module) -> None:
    require(hasattr(model, "trunk") and hasattr(model, "blocks") and hasattr(model, "ln_f"), "21_fused_layernorm",
            "needs a pre-LayerNorm model with a trunk of blocks and ln_f", type(model).__name__)
    require(not getattr(model, "checkpointed", None) and getattr(model.trunk, "final_norm", True),
            "21_fused_layernorm", "cannot run checkpointed blocks: a checkpointed block recomputes from its whole "
            "input, which the fused blocks hand on unsummed; use one or the other", "checkpointing on")
    model.trunk = FusedResidualTrunk()


def fused_trunk(model: nn.Module, step: str, what: str) -> FusedResidualTrunk:
    """The model's fused trunk, for a later step of this branch that sets one of its options."""
    trunk = getattr(model, "trunk", None)
    require(isinstance(trunk, FusedResidualTrunk), step, f"{what}: it needs 21_fused_layernorm's trunk",
            type(trunk).__name__)
    return trunk
