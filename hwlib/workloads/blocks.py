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


class PreNormBlock(nn.Module):
    def __init__(self, d_model: int, make_mixer: Callable[[], nn.Module], mixer_name: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.mixer_name = mixer_name
        setattr(self, mixer_name, make_mixer())
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x):
        x = x + self.mixer(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh"))
