"""The pre-LayerNorm residual block that GPT and ResNet-BK share; only the token mixer differs.

    x = x + mixer(LN_1(x))
    x = x + W_proj GELU_tanh(W_fc LN_2(x))        (MLP of width 4 d)

The mixer is registered under the name its workload gives it (``attn``, ``mix``), so parameter
names, and with them state-dict keys, checkpoints and the initialisation by name
(``base.init_lm_weights``), stay what they were. Submodules are created in the order ln_1, mixer,
ln_2, mlp_fc, mlp_proj: the parameter order, and any default initialisation drawn from the global
generator, are those of the blocks this one replaces.

How the MLP computes is a module of its own, ``mlp``, that holds no parameters: the block hands it
``mlp_fc`` and ``mlp_proj``. A step past the recipe swaps in another way to compute the same function
(``hwlib.steps``) without moving a parameter.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """W_proj GELU_tanh(W_fc h) + b_proj, from the block's two linears (``proj_bias=False``: without b_proj,
    for a caller that adds it where the branch meets the residual stream)."""

    def forward(self, h, fc: nn.Module, proj: nn.Module, proj_bias: bool = True):
        a = F.gelu(fc(h), approximate="tanh")
        return proj(a) if proj_bias else F.linear(a, proj.weight)


class PreNormBlock(nn.Module):
    def __init__(self, d_model: int, make_mixer: Callable[[], nn.Module], mixer_name: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.mixer_name = mixer_name
        setattr(self, mixer_name, make_mixer())
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)
        self.mlp = MLP()

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x):
        x = x + self.mixer(self.ln_1(x))
        return x + self.mlp(self.ln_2(x), self.mlp_fc, self.mlp_proj)
