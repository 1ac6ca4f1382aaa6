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

from ..shapes import padded
from ..settings import Settings
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


class CausalHeads(nn.Module):
    """softmax(Q K^T / sqrt(d_h), causal) V over the heads of the QKV projection's output, [B, T, C] in and
    out: the textbook form ("manual": the [B, H, T, T] score matrix goes through memory three times) or
    ``F.scaled_dot_product_attention`` ("sdpa"), the recipe's knob. Holds no parameters: the attention
    hands it ``c_attn``, so that a step can swap in another way to compute the same function."""

    def __init__(self, n_head: int, attention: str):
        super().__init__()
        self.n_head, self.attention = n_head, attention

    def forward(self, x, c_attn: nn.Module, causal: torch.Tensor):
        B, T, C = x.shape
        q, k, v = c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~causal[:T, :T], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return y.transpose(1, 2).contiguous().view(B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: str):
        super().__init__()
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.heads = CausalHeads(cfg.n_head, attention)
        self.register_buffer("causal", torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x):
        return self.c_proj(self.attend(x))

    def attend(self, x):
        """The heads' outputs, [B, T, C], before the output projection."""
        return self.heads(x, self.c_attn, self.causal)


def gpt_block(cfg: GPTConfig, attention: str) -> PreNormBlock:
    """A GPT-2 block: causal self-attention as the mixer of the shared pre-LayerNorm block."""
    return PreNormBlock(cfg.d_model, lambda: CausalSelfAttention(cfg, attention), "attn")


class Trunk(nn.Module):
    """The blocks in order, then the final LayerNorm: the stream ``x`` in, ``ln_f(x_L)`` out. Blocks in
    ``checkpointed`` keep only their input and recompute in backward; ``final_norm=False`` leaves ln_f to
    a head that applies it per chunk (``CheckpointedHead``)."""

    def __init__(self, checkpointed: frozenset = frozenset(), final_norm: bool = True):
        super().__init__()
        self.checkpointed, self.final_norm = checkpointed, final_norm

    def forward(self, x, model: "GPT"):
        for i, block in enumerate(model.blocks):
            if i in self.checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return model.ln_f(x) if self.final_norm else x


class Head(nn.Module):
    """The tied output projection: logits of ``h``, or their mean cross-entropy against ``targets``
    (padded vocabulary rows sliced off first)."""

    def forward(self, h, targets, model: "GPT"):
        logits = model.logits(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, model.cfg.vocab), targets.reshape(-1))


class CheckpointedHead(Head):
    """The head with its loss computed in chunks of ``HEAD_CHUNK`` tokens whose logits are recomputed in
    backward: the [tokens, V] logits are the largest activation, and at most one chunk's exists at a
    time. Takes the stream before ln_f (``Trunk(final_norm=False)``): ln_f runs inside each chunk."""

    def forward(self, x, targets, model: "GPT"):
        if targets is None or not torch.is_grad_enabled():
            return super().forward(model.ln_f(x), targets, model)
        xs, ts = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        total = sum(torch.utils.checkpoint.checkpoint(self._loss_sum, xs[i:i + HEAD_CHUNK], ts[i:i + HEAD_CHUNK],
                                                      model, use_reentrant=False)
                    for i in range(0, xs.size(0), HEAD_CHUNK))
        return total / ts.numel()

    @staticmethod
    def _loss_sum(x, targets, model):
        return F.cross_entropy(model.logits(model.ln_f(x)), targets, reduction="sum")


class GPT(nn.Module):
    """nanoGPT's shape: embeddings, the trunk of blocks with the final LayerNorm, the tied head. How the
    trunk runs its blocks (``trunk``), how each block computes its MLP (``blocks[i].mlp``) and attention
    (``blocks[i].attn.heads``), and how the head makes its loss (``head``) are parameterless modules that
    the steps past the recipe swap (``hwlib.steps``); the parameters never move."""

    def __init__(self, cfg: GPTConfig, attention: str = "manual", vocab_multiple: int = 1,
                 checkpointing: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.checkpointed, self.checkpoint_head = parse_checkpointing(checkpointing, cfg.n_layer)
        self.vocab_padded = padded(cfg.vocab, vocab_multiple)
        self.wte = nn.Embedding(self.vocab_padded, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(gpt_block(cfg, attention) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.trunk = Trunk(self.checkpointed, final_norm=not self.checkpoint_head)
        self.head = CheckpointedHead() if self.checkpoint_head else Head()

    def init_weights(self, seed: int) -> "GPT":
        """GPT-2 initialisation (``base.init_lm_weights``), the same on every device."""
        return init_lm_weights(self, seed, self.cfg.vocab, self.cfg.n_layer, ("c_proj.weight", "mlp_proj.weight"))

    def set_attention(self, attention: str) -> None:
        for b in self.blocks:
            b.attn.heads.attention = attention

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.context}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        return self.head(self.trunk(x, self), targets, self)

    def logits(self, h):
        logits = F.linear(h, self.wte.weight)  # tied output projection
        if self.vocab_padded != self.cfg.vocab:
            logits = logits[..., : self.cfg.vocab]
        return logits


class GPTWorkload(TokenLMWorkload):
    name = "gpt"
    checkpoint_parts = ("blocks", "head")
    profiles = PROFILES

    def build(self, cfg: GPTConfig, settings: Settings, seed: int) -> GPT:
        return GPT(cfg, attention=settings.attention, vocab_multiple=settings.vocab_multiple,
                   checkpointing=settings.checkpointing).init_weights(seed)

    def flops_per_step(self, cfg: GPTConfig) -> float:
        L, d, T, V = cfg.n_layer, cfg.d_model, cfg.context, cfg.vocab
        return 3.0 * self.items_per_step(cfg) * (L * (24 * d * d + 4 * T * d) + 2 * d * V)
