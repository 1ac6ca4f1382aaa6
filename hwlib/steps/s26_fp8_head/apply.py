"""Step 26: the fused LM head's three matmuls in FP8 (``hwlib.steps.s26_fp8_head.op``: e4m3 forward; the
gradient's probabilities in e5m2, in both layouts, its target entries in fp32)."""

from __future__ import annotations

import torch.nn as nn

from .op import fused_linear_cross_entropy_fp8
from ..s17_fused_lm_head.apply import FusedLinearCEHead
from ..step import require


class FusedLinearCEHeadFP8(FusedLinearCEHead):
    @staticmethod
    def loss(h, weight, targets, vocab):
        return fused_linear_cross_entropy_fp8(h, weight, targets, vocab=vocab)


def apply(model: nn.Module) -> None:
    require(type(getattr(model, "head", None)) is FusedLinearCEHead, "26_fp8_head",
            "runs the fused LM head's GEMMs in FP8: it needs 17_fused_lm_head's head",
            type(getattr(model, "head", None)).__name__)
    model.head = FusedLinearCEHeadFP8()
