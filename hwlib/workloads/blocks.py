"""The pre-LayerNorm residual block that GPT and ResNet-BK share; only the token mixer differs.

    x = x + mixer(LN_1(x))
    x = x + W_proj GELU_tanh(W_fc LN_2(x))        (MLP of width 4 d)

The mixer is registered under the name its workload gives it (``attn``, ``mix``), so parameter
names, and with them state-dict keys, checkpoints and the initialisation by name
(``base.init_lm_weights``), stay what they were. Submodules are created in the order ln_1, mixer,
ln_2, mlp_fc, mlp_proj: the parameter order, and any default initialisation drawn from the global
generator, are those of the blocks this one replaces.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn
import torch.nn.functional as F

from ..ops.add_layernorm import add_layer_norm
from ..ops.gelu_mlp import gelu_mlp


class PreNormBlock(nn.Module):
    def __init__(self, d_model: int, make_mixer: Callable[[], nn.Module], mixer_name: str, fused_mlp: bool = False,
                 branch_bias: bool = False, fc_bias_column: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.mixer_name = mixer_name
        setattr(self, mixer_name, make_mixer())
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)
        # The MLP as one op with its GELU in the matmuls' epilogues (hwlib.ops.gelu_mlp).
        self.fused_mlp = fused_mlp
        # forward_fused only: each branch's output bias (the mixer's and the MLP's last linear) added in
        # the fused LayerNorm after it, which sums its gradient in its own backward pass.
        self.branch_bias = branch_bias
        # forward_fused only: ln_2 writes a column of ones beside its output, and the fused MLP takes mlp_fc's
        # bias gradient from its weight-gradient matmul through it (hwlib.ops.gelu_mlp's bias_column).
        if fc_bias_column and not fused_mlp:
            raise ValueError("fc_bias_column is a bias column of the fused MLP (hwlib.ops.gelu_mlp): it needs fused_mlp")
        self.fc_bias_column = fc_bias_column

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x):
        x = x + self.mixer(self.ln_1(x))
        return x + self.mlp_out(self.ln_2(x))

    def mlp(self, h):
        return F.gelu(self.mlp_fc(h), approximate="tanh")

    def mlp_out(self, h, bias_column: bool = False):
        """The MLP branch, W_proj GELU(W_fc h): one op with the GELU in the matmuls' epilogues when
        ``fused_mlp`` is set, else the two linears around ``mlp``. ``bias_column``: h carries ln_2's
        column of ones (fused MLP only)."""
        if self.fused_mlp:
            return gelu_mlp(h, self.mlp_fc.weight, self.mlp_fc.bias, self.mlp_proj.weight, self.mlp_proj.bias,
                            bias_column=bias_column)
        return self.mlp_proj(self.mlp(h))

    def mlp_out_unbiased(self, h, bias_column: bool = False):
        """(the MLP branch before mlp_proj's bias, that bias)."""
        if self.fused_mlp:
            return (gelu_mlp(h, self.mlp_fc.weight, self.mlp_fc.bias, self.mlp_proj.weight, None,
                             bias_column=bias_column), self.mlp_proj.bias)
        return F.linear(self.mlp(h), self.mlp_proj.weight), self.mlp_proj.bias

    def forward_fused(self, x, pending=None):
        """The same block with each residual add fused into the LayerNorm after it
        (``hwlib.ops.add_layernorm``): takes the stream ``x`` before the previous block's last add and
        that add's branch output ``pending`` = (r, r_bias) (None for the first block; r_bias None
        unless ``branch_bias``), and returns the stream and this block's MLP output as such a pair,
        still to be added by the next fused LayerNorm (or the final one)."""
        if pending is None:
            h = self.ln_1(x)
        else:
            x, h = add_layer_norm(x, pending[0], self.ln_1.weight, self.ln_1.bias, self.ln_1.eps, r_bias=pending[1])
        # each branch as (r, r_bias): r_bias None where the branch adds its own bias
        r, r_bias = self.mixer.forward_unbiased(h) if self.branch_bias else (self.mixer(h), None)
        col = self.fc_bias_column
        x, h = add_layer_norm(x, r, self.ln_2.weight, self.ln_2.bias, self.ln_2.eps, r_bias=r_bias, ones_column=col)
        return x, self.mlp_out_unbiased(h, col) if self.branch_bias else (self.mlp_out(h, col), None)
