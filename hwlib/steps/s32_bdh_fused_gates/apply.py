"""Step 32: Vision-BDH's sparse encoder and Hebbian gate swapped for ops whose matmuls do their elementwise
work in their epilogues (``hwlib.steps.s32_bdh_fused_gates.op``)."""

from __future__ import annotations

import torch.nn as nn

from .op import encode, gate_decode
from ..step import require


class FusedSparseEncoder(nn.Module):
    """``encode`` in the place of ``hwlib.workloads.vit_bdh.SparseEncoder``; parameterless."""

    def forward(self, x, encoder, cos, sin, tokens):
        return encode(x, encoder, cos, sin, tokens)


class FusedHebbianGate(nn.Module):
    """``gate_decode`` in the place of ``hwlib.workloads.vit_bdh.HebbianGate``; parameterless."""

    def forward(self, a, encoder_v, s, decoder):
        return gate_decode(a, encoder_v, s, decoder)


def apply(model):
    from ...workloads.vit_bdh import HebbianGate, SparseEncoder
    for attr, recipe in (("encode", SparseEncoder), ("gate", HebbianGate)):
        have = getattr(model, attr, None)
        require(isinstance(have, recipe), "32_bdh_fused_gates",
                f"needs a Vision-BDH model whose {attr} is the recipe's (hwlib.workloads.vit_bdh.{recipe.__name__})",
                type(have).__name__ if have is not None else f"a {type(model).__name__} without one")
    model.encode, model.gate = FusedSparseEncoder(), FusedHebbianGate()
    return model
