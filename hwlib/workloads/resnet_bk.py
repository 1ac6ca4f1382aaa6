"""ResNet-BK: a language model whose token mixing is the BK-Core.

Each block (pre-LayerNorm, residual) maps the hidden states to H learned potentials per token,
v = tanh(W_v LN(x)) in [-1, 1]; for each head the tridiagonal T has diagonal a = -2 + v and
off-diagonals b = c = 1 (the seed's discrete Schroedinger operator); the BK-Core returns
G = diag((T - zI)^-1) with z = 1j, and the features [Re G, Im G] (2H per token) are projected back
to the width d and added to the residual; a GELU MLP (4d) follows. A tied output projection ends
the model.

G_ii depends on the potential at every position, left and right: as a next-token model it sees the
future, as the seed's model did. The workload is kept as the seed built it because it measures
training speed; its loss falls faster than a causal model's would.

FLOPs of one training step (matmuls only; the BK-Core is memory-bound, O(N) per sequence, and is
measured by bytes in notebook 12):

    tokens * 3 * [ L * (2 d H + 4 H d + 16 d^2) + 2 d V ]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..shapes import padded
from ..settings import Settings
from .base import PeakMemory, TokenLMWorkload, check_finite_numbers, check_positive_ints, init_lm_weights
from .blocks import PreNormBlock
from .gpt import Head


@dataclass(frozen=True)
class BKConfig:
    n_layer: int = 8
    n_head: int = 16          # potentials (BK-Core sequences) per token and layer
    d_model: int = 512
    context: int = 2048       # N of the BK-Core
    vocab: int = 50257       # GPT-2's BPE vocabulary, as the GPT workload
    batch: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.1
    z_imag: float = 1.0
    data_tokens: int = 2_000_000

    def __post_init__(self):
        check_positive_ints(self, ("n_layer", "n_head", "d_model", "context", "vocab", "batch", "data_tokens"))
        # z_imag > 0: z on the real axis hits the spectrum of T.
        check_finite_numbers(self, positive=("lr", "z_imag"))


# Its largest peak in the full series (13.02 GiB, outputs/reference/h100): the fp32 baseline, where
# a sample's [2048, 50257] fp32 logits alone are 0.38 GiB. Of it, 0.65 GiB does not grow with the
# batch: 43,796,096 parameters x 16 B.
PEAK = PeakMemory(step="01_baseline_fp32", batch=8, measured_gib=13.02, fixed_gib=0.65)

PROFILES = {
    "full": BKConfig(),
    # mid: batch 4 (8,192 tokens and 64 BK-Core sequences of N = 2048 a layer), every dimension as
    # full. PEAK.at(4) = 0.65 + 12.37 x 4 / 8 = 6.84 GiB; batch 8 is 13.02 GiB, too near 16 GiB once
    # the allocator and the CUDA context take their share.
    "mid": BKConfig(batch=4),
    "smoke": BKConfig(n_layer=2, n_head=4, d_model=64, context=64, vocab=500, batch=8, lr=3e-3, data_tokens=100_000),
}


class BKMixer(nn.Module):
    def __init__(self, cfg: BKConfig, backend: str):
        super().__init__()
        self.to_potential = nn.Linear(cfg.d_model, cfg.n_head)
        self.from_features = nn.Linear(2 * cfg.n_head, cfg.d_model)
        self.n_head, self.z = cfg.n_head, complex(0.0, cfg.z_imag)
        self.backend = backend

    def forward(self, x):
        B, N, _ = x.shape
        v = torch.tanh(self.to_potential(x)).float()          # the op is float32/float64 only
        a = (v - 2.0).transpose(1, 2).reshape(B * self.n_head, N)
        ones = torch.ones(B * self.n_head, max(N - 1, 0), device=x.device, dtype=a.dtype)
        g = _bk(a, ones, ones, self.z, self.backend)             # [B H, N, 2]: Re G, Im G
        feats = g.view(B, self.n_head, N, 2).permute(0, 2, 3, 1).reshape(B, N, 2 * self.n_head)   # [Re | Im]
        return self.from_features(feats)


def _bk(a, b, c, z, backend):
    # One custom op (``resolvent_features``): torch.compile keeps it in the graph as one node and a
    # CUDA graph replays it with the rest of the step. Outside autocast: the recursions need fp32.
    # No tensor checks (``resolvent_diagonal``'s check_finite): they cost a GPU sync per call. Here
    # they cannot fail short of NaN: diag = tanh(.) - 2 lies in [-3, -1], upper = lower = 1 and
    # Im z > 0 (BKConfig), far inside float32's working range; a NaN would reach the loss, which
    # the ladder checks (status `nonfinite`).
    from ..ops import resolvent_features
    with torch.autocast(device_type=a.device.type, enabled=False):
        return resolvent_features(a, b, c, z, backend=backend)


def bk_block(cfg: BKConfig, backend: str) -> PreNormBlock:
    """A ResNet-BK block: the BK-Core mixer in the pre-LayerNorm block GPT also uses."""
    return PreNormBlock(cfg.d_model, lambda: BKMixer(cfg, backend), "mix")


class ResNetBK(nn.Module):
    """nanoGPT's shape, as ``GPT``: embeddings, the blocks, the final LayerNorm and the tied head. How the
    head makes its loss (``head``, GPT's ``Head``: the logits, then ``F.cross_entropy``) is a parameterless
    module that a step past the recipe swaps (``hwlib.steps.s30_bk_fused_head``); the parameters never move."""

    def __init__(self, cfg: BKConfig, backend: str = "torch", vocab_multiple: int = 1):
        super().__init__()
        self.cfg = cfg
        self.vocab_padded = padded(cfg.vocab, vocab_multiple)
        self.wte = nn.Embedding(self.vocab_padded, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(bk_block(cfg, backend) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = Head()

    def init_weights(self, seed: int) -> "ResNetBK":
        return init_lm_weights(self, seed, self.cfg.vocab, self.cfg.n_layer,
                               ("from_features.weight", "mlp_proj.weight"))

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.context}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x), targets, self)

    def logits(self, h):
        logits = F.linear(h, self.wte.weight)  # tied output projection
        if self.vocab_padded != self.cfg.vocab:
            logits = logits[..., : self.cfg.vocab]
        return logits


class ResNetBKWorkload(TokenLMWorkload):
    name = "resnet_bk"
    profiles = PROFILES

    def build(self, cfg: BKConfig, settings: Settings, seed: int) -> ResNetBK:
        if settings.checkpointing not in ("none", ""):
            raise ValueError(f"checkpointing {settings.checkpointing!r}: the resnet_bk workload has none yet")
        return ResNetBK(cfg, backend=settings.bk_backend, vocab_multiple=settings.vocab_multiple).init_weights(seed)

    def flops_per_step(self, cfg: BKConfig) -> float:
        L, d, H, V = cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab
        return 3.0 * self.items_per_step(cfg) * (L * (2 * d * H + 4 * H * d + 16 * d * d) + 2 * d * V)
