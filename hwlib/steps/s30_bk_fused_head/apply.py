"""Step 30: ResNet-BK's LM head and its cross-entropy as step 17's fused op (``FusedLinearCEHead``, imported
from ``hwlib.steps.s17_fused_lm_head``: one implementation for both workloads): the [tokens, V] logits are
never written to memory."""

from __future__ import annotations

import torch.nn as nn

from ..s17_fused_lm_head.apply import FusedLinearCEHead
from ..step import require


def apply(model: nn.Module) -> nn.Module:
    """Swap ResNet-BK's tied head (``hwlib.workloads.gpt.Head``, which its forward hands ``ln_f``'s output)
    for the fused one; the head has no parameters, so the state_dict is unchanged."""
    from ...workloads.gpt import Head
    from ...workloads.resnet_bk import ResNetBK
    head = getattr(model, "head", None)
    require(isinstance(model, ResNetBK) and type(head) is Head, "30_bk_fused_head",
            "needs a ResNet-BK model whose head is the recipe's tied head (hwlib.workloads.gpt.Head)",
            f"a {type(model).__name__} with head {type(head).__name__}" if head is not None
            else f"a {type(model).__name__} without one")
    model.head = FusedLinearCEHead()
    return model
