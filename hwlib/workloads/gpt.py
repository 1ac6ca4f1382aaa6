"""GPT-2-class language model: pre-LayerNorm decoder, learned positions, tied embeddings, GELU (tanh).

Full profile is GPT-2 small (12 layers, width 768, 12 heads, context 1024, vocabulary 50257,
batch 16: 16,384 tokens a step, 124M parameters); mid is the same model at batch 4 (``PROFILES``
says why). Smoke is a tiny model that trains on a CPU in seconds.

FLOPs of one training step (forward x 3 for forward + backward; Kaplan et al. 2020, with attention
counted in full as PaLM's MFU does):

    tokens * 3 * [ L * (24 d^2 + 4 T d) + 2 d V ]

24 d^2: QKV (6 d^2), output projection (2 d^2) and MLP (16 d^2) per token; 4 T d: Q K^T and A V;
2 d V: the tied output projection. V is the unpadded vocabulary: padding is work, not useful work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ..ops.add_layernorm import add_layer_norm
from ..ops.linear_ce import fused_linear_cross_entropy
from ..ops.linear_ce_fp8 import fused_linear_cross_entropy_fp8
from ..ops.qkv_attention import attention_problem, fit_problem, qkv_attention
from ..ops.sources import warn_fallback
from ..precision import compute_dtype
from ..shapes import padded
from ..steps import Settings
from .checkpointing import HEAD_CHUNK, parse_checkpointing
from .base import PeakMemory, TokenLMWorkload, check_finite_numbers, check_positive_ints, init_lm_weights
from .blocks import PreNormBlock


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    context: int = 1024
    vocab: int = 50257
    batch: int = 16
    lr: float = 6e-4
    weight_decay: float = 0.1
    data_tokens: int = 2_000_000

    def __post_init__(self):
        check_positive_ints(self, ("n_layer", "n_head", "d_model", "context", "vocab", "batch", "data_tokens"))
        check_finite_numbers(self)
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


# The full series' largest peak (29.25 GiB, outputs/reference/h100): the fp32 baseline, eager, whose
# manual attention keeps a [B, 12, 1024, 1024] fp32 score matrix per layer for backward. Of it,
# 1.85 GiB does not grow with the batch: 124,439,808 parameters x 16 B.
PEAK = PeakMemory(step="01_baseline_fp32", batch=16, measured_gib=29.25, fixed_gib=1.85)

PROFILES = {
    "full": GPTConfig(),
    # mid: batch 4 (4,096 tokens a step), every dimension as full. PEAK.at(4) = 1.85 + 27.40 x 4 / 16
    # = 8.70 GiB, well inside 16 GiB; batch 8 would reach 15.55 GiB, with no room left for the
    # allocator and the CUDA context.
    "mid": GPTConfig(batch=4),
    "smoke": GPTConfig(n_layer=2, n_head=4, d_model=64, context=64, vocab=500, batch=8, lr=3e-3,
                       data_tokens=100_000),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: str, fused_qkv: bool = False):
        super().__init__()
        self.n_head, self.d = cfg.n_head, cfg.d_model
        # fused_qkv: the QKV projection and the attention as one op (hwlib.ops.qkv_attention), whose
        # backward packs dq, dk, dv into the projection's gradient and sums the bias's in one pass.
        self.fused_qkv = fused_qkv
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attention = attention
        self.register_buffer("causal", torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x):
        return self.c_proj(self._attend(x))

    def forward_unbiased(self, x):
        """(output before c_proj's bias, that bias): for a block that adds the bias where the branch
        meets the residual stream (``PreNormBlock.branch_bias``)."""
        return F.linear(self._attend(x), self.c_proj.weight), self.c_proj.bias

    def _attend(self, x):
        """The heads' outputs, [B, T, C], before the output projection."""
        B, T, C = x.shape
        if self.fused_qkv and self.attention == "sdpa":
            dev = x.device.type
            why = attention_problem(dev)
            if why is None and fit_problem(dev, compute_dtype(x), C // self.n_head) is None:
                return qkv_attention(x, self.c_attn.weight, self.c_attn.bias, self.n_head)
            if why:   # the machine cannot run it: say so; a call it does not fit takes the unfused path quietly
                warn_fallback("fused_qkv", "qkv_attention", "F.scaled_dot_product_attention", dev, why)
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # The textbook form: a [B, H, T, T] score matrix goes through memory three times.
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.causal[:T, :T], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return y.transpose(1, 2).contiguous().view(B, T, C)


def gpt_block(cfg: GPTConfig, attention: str, fused_mlp: bool = False, branch_bias: bool = False,
              fused_qkv: bool = False, fc_bias_column: bool = False) -> PreNormBlock:
    """A GPT-2 block: causal self-attention as the mixer of the shared pre-LayerNorm block."""
    return PreNormBlock(cfg.d_model, lambda: CausalSelfAttention(cfg, attention, fused_qkv), "attn", fused_mlp,
                        branch_bias, fc_bias_column)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: str = "manual", vocab_multiple: int = 1,
                 checkpointing: str = "none", fused_head: bool = False, fused_ln: bool = False,
                 fused_mlp: bool = False, branch_bias: bool = False, fused_qkv: bool = False,
                 fc_bias_column: bool = False, fp8_head: bool = False, bf16_stream: bool = False):
        super().__init__()
        self.cfg = cfg
        # Each residual add fused into the LayerNorm after it (hwlib.ops.add_layernorm).
        self.fused_ln = fused_ln
        # LM head + cross-entropy as one chunked op (hwlib.ops.linear_ce): no [tokens, V] logits.
        self.fused_head = fused_head
        # The fused head's GEMMs in FP8 (hwlib.ops.linear_ce_fp8).
        self.fp8_head = fp8_head
        if fp8_head and not fused_head:
            raise ValueError("fp8_head runs the fused LM head's GEMMs in FP8: it needs fused_head")
        # The residual stream in autocast's dtype from the embeddings on (fp32 otherwise, as in the recipe).
        self.bf16_stream = bf16_stream
        # Checkpointed blocks keep only their input; their activations are recomputed in backward.
        self.checkpointed, self.checkpoint_head = parse_checkpointing(checkpointing, cfg.n_layer)
        if fused_ln and (self.checkpointed or self.checkpoint_head):
            raise ValueError(f"checkpointing={checkpointing!r} with fused_ln: a checkpointed block recomputes from "
                             f"its whole input, which the fused blocks hand on unsummed; use one or the other")
        if fused_qkv and attention != "sdpa":
            raise ValueError(f"fused_qkv runs fused attention: it needs attention='sdpa', got {attention!r}")
        if fc_bias_column and not fused_ln:
            raise ValueError("fc_bias_column has the fused residual LayerNorm write a column of ones: it needs fused_ln")
        if branch_bias and not fused_ln:
            raise ValueError("branch_bias adds each branch's output bias inside the fused residual LayerNorm: "
                             "it needs fused_ln")
        self.vocab_padded = padded(cfg.vocab, vocab_multiple)
        self.wte = nn.Embedding(self.vocab_padded, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        # fused_mlp: each MLP one op, its GELU in the matmuls' epilogues (hwlib.ops.gelu_mlp).
        # branch_bias: each branch's output bias added, and its gradient summed, in the fused LayerNorm after it.
        self.blocks = nn.ModuleList(gpt_block(cfg, attention, fused_mlp, branch_bias, fused_qkv, fc_bias_column)
                                    for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def init_weights(self, seed: int) -> "GPT":
        """GPT-2 initialisation (``base.init_lm_weights``), the same on every device."""
        return init_lm_weights(self, seed, self.cfg.vocab, self.cfg.n_layer, ("c_proj.weight", "mlp_proj.weight"))

    def set_attention(self, attention: str) -> None:
        for b in self.blocks:
            b.attn.attention = attention

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.context}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        if self.bf16_stream:
            x = x.to(compute_dtype(x))
        if self.fused_ln:
            return self._head(self._blocks_fused(x), targets)
        for i, block in enumerate(self.blocks):
            if i in self.checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if targets is not None and self.checkpoint_head and not self.fused_head and torch.is_grad_enabled():
            # The [tokens, V] logits are the largest activation: compute loss in chunks whose logits
            # are recomputed in backward, so at most one chunk's logits exist at a time.
            xs, ts = x.reshape(-1, x.size(-1)), targets.reshape(-1)
            total = sum(torch.utils.checkpoint.checkpoint(self._head_loss_sum, xs[i:i + HEAD_CHUNK],
                                                          ts[i:i + HEAD_CHUNK], use_reentrant=False)
                        for i in range(0, xs.size(0), HEAD_CHUNK))
            return total / ts.numel()
        return self._head(self.ln_f(x), targets)

    def _blocks_fused(self, x):
        """The blocks with each residual add fused into the LayerNorm after it; returns ln_f's output."""
        pending = None
        for block in self.blocks:
            x, pending = block.forward_fused(x, pending)
        r, r_bias = pending
        return add_layer_norm(x, r, self.ln_f.weight, self.ln_f.bias, self.ln_f.eps, r_bias=r_bias)[1]

    def _head(self, h, targets):
        """Logits, or the mean loss, from ``h = ln_f(x)``."""
        if targets is not None and self.fused_head:
            # The tied head weight keeps its padded rows; the op masks them out of the softmax.
            head = fused_linear_cross_entropy_fp8 if self.fp8_head else fused_linear_cross_entropy
            return head(h, self.wte.weight, targets, vocab=self.cfg.vocab)
        logits = self._logits(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab), targets.reshape(-1))

    def _logits(self, h):
        logits = F.linear(h, self.wte.weight)  # tied output projection
        if self.vocab_padded != self.cfg.vocab:
            logits = logits[..., : self.cfg.vocab]
        return logits

    def _head_loss_sum(self, x, targets):
        return F.cross_entropy(self._logits(self.ln_f(x)), targets, reduction="sum")


class GPTWorkload(TokenLMWorkload):
    name = "gpt"
    checkpoint_parts = ("blocks", "head")
    profiles = PROFILES

    def build(self, cfg: GPTConfig, settings: Settings, seed: int) -> GPT:
        if settings.fp8 and settings.fused_mlp:
            raise ValueError("fp8 and fused_mlp both replace the MLP's matmuls: use one or the other")
        if settings.fp8 and settings.branch_bias:   # the unbiased branch calls F.linear on mlp_proj's weight
            raise ValueError("fp8 and branch_bias: the branch without its bias would run mlp_proj's matmul in bf16, "
                             "around its FP8 layer; use one or the other")
        model = GPT(cfg, attention=settings.attention, vocab_multiple=settings.vocab_multiple,
                    checkpointing=settings.checkpointing, fused_head=settings.fused_head,
                    fused_ln=settings.fused_ln, fused_mlp=settings.fused_mlp,
                    branch_bias=settings.branch_bias, fused_qkv=settings.fused_qkv,
                    fc_bias_column=settings.fc_bias_column, fp8_head=settings.fp8_head,
                    bf16_stream=settings.bf16_stream).init_weights(seed)
        if settings.fp8:   # after the initialisation: the FP8 layers share the very same parameters
            from ..ops.fp8 import swap_mlp_linears
            swap_mlp_linears(model)
        return model

    def flops_per_step(self, cfg: GPTConfig) -> float:
        L, d, T, V = cfg.n_layer, cfg.d_model, cfg.context, cfg.vocab
        return 3.0 * self.items_per_step(cfg) * (L * (24 * d * d + 4 * T * d) + 2 * d * V)
