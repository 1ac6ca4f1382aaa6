"""Step 29: Vision-BDH's attention swapped for one that reads its shared query-key once and its shared
values once per sample (``hwlib.steps.s29_shared_qk_attention.op``)."""

from __future__ import annotations

import torch.nn as nn

from .op import shared_qk_attention
from ..step import require


class SharedQKAttention(nn.Module):
    """``shared_qk_attention`` in the place of ``hwlib.workloads.vit_bdh.BDHAttention``; parameterless."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, q, x):
        return shared_qk_attention(q, x, self.form)


def apply(model):
    from ...workloads.vit_bdh import BDHAttention
    attend = getattr(model, "attend", None)
    require(isinstance(attend, BDHAttention), "29_shared_qk_attention",
            "needs a Vision-BDH model whose attention is the recipe's (hwlib.workloads.vit_bdh.BDHAttention)",
            type(attend).__name__ if attend is not None else f"a {type(model).__name__} without one")
    model.attend = SharedQKAttention(attend.form)
    return model
