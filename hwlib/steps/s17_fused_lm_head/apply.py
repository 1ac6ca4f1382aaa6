"""Step 17: the LM head and its cross-entropy as one chunked op (``hwlib.steps.s17_fused_lm_head.op``): the
[tokens, V] logits are never written to memory."""

from __future__ import annotations

import torch.nn as nn

from .op import fused_linear_cross_entropy
from ..step import require


class FusedLinearCEHead(nn.Module):
    """Mean cross-entropy of the tied head's logits, computed vocabulary tile by tile without the logits
    (the padded rows of the tied weight are masked out of the softmax); logits as usual without targets."""

    def forward(self, h, targets, model):
        if targets is None:
            return model.logits(h)
        return self.loss(h, model.wte.weight, targets, model.cfg.vocab)

    @staticmethod
    def loss(h, weight, targets, vocab):
        return fused_linear_cross_entropy(h, weight, targets, vocab=vocab)


def apply(model: nn.Module) -> None:
    """Swap the head of a GPT-shaped model (``head``, ``wte``, ``ln_f``) for the fused one. A head
    checkpointed in chunks is replaced too: the fused op never holds more than a tile of logits, so the
    trunk hands it ln_f's output again."""
    require(hasattr(model, "head") and hasattr(model, "wte") and hasattr(model, "trunk"), "17_fused_lm_head",
            "needs a GPT-shaped model with a tied head (head, wte, trunk)", type(model).__name__)
    model.trunk.final_norm = True
    model.checkpoint_head = False
    model.head = FusedLinearCEHead()
