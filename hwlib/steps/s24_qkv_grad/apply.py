"""Step 24: the QKV projection and the attention as one op (``hwlib.steps.s24_qkv_grad.op``), whose
backward packs dq, dk, dv into the projection's gradient and sums the QKV bias's in the same pass."""

from __future__ import annotations

import torch.nn as nn

from .op import attention_problem, fit_problem, qkv_attention
from ...ops.sources import warn_fallback
from ...precision import compute_dtype
from ...workloads.gpt import CausalHeads
from ..step import require


class QKVHeads(nn.Module):
    """The heads' outputs from the projection's weight and bias in one op; where the machine cannot run
    it, it says so and takes SDPA's path; a call it does not fit takes that path quietly."""

    def __init__(self, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.unfused = CausalHeads(n_head, "sdpa")

    def forward(self, x, c_attn: nn.Module, causal):
        dev = x.device.type
        why = attention_problem(dev)
        if why is None and fit_problem(dev, compute_dtype(x), x.size(-1) // self.n_head) is None:
            return qkv_attention(x, c_attn.weight, c_attn.bias, self.n_head)
        if why:
            warn_fallback("fused_qkv", "qkv_attention", "F.scaled_dot_product_attention", dev, why)
        return self.unfused(x, c_attn, causal)


def apply(model: nn.Module) -> None:
    for b in getattr(model, "blocks", ()):
        heads = getattr(getattr(b, "attn", None), "heads", None)
        require(isinstance(heads, CausalHeads) and heads.attention == "sdpa", "24_qkv_grad",
                "runs fused attention: it needs GPT's causal heads with attention='sdpa'",
                f"{type(heads).__name__} with attention={getattr(heads, 'attention', None)!r}")
    for b in model.blocks:
        b.attn.heads = QKVHeads(b.attn.heads.n_head)
