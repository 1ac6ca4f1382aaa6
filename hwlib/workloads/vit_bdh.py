"""Vision-BDH: a BDH ("Baby Dragon Hatchling") core classifying 32 x 32 images.

As the seed builds it (``vision_bdh_v2_cls``): a 4 x 4 patch convolution turns the image into 64
tokens of width D, a CLS token is prepended (T = 65) and learned positions are added. Then ONE set
of weights (encoder E, value encoder E_v, decoder W, per head h of H) is applied L times, the BDH
recurrent depth; each application, with LN a LayerNorm without affine parameters:

    x    = LN(x)                                       [B, T, D]
    s_h  = ReLU(x E_h)                                 [B, T, N]  sparse positive activations
    q_h  = RoPE(s_h)                                   Q = K = q_h
    a_h  = softmax(q_h q_h^T / sqrt(N)) x              softmax form   (vit_bdh)
    a_h  = (q_h q_h^T) x                               linear form    (vit_bdh_linear)
    u_h  = ReLU(LN(a_h) E_v,h)                         [B, T, N]
    y    = LN(sum_h (s_h * u_h) W_h)                   Hebbian-style gate: s_h * u_h
    x    = LN(x + y)

and the logits are a linear map of LN(x[CLS]) to 10 classes. Attention is bidirectional (no mask)
and its values are the token states x themselves, shared by every head. The linear form keeps the
seed's normalisation: none inside the attention (no 1/T, no 1/sqrt(N)); its output goes straight
into the LayerNorm of ``a_h``, which removes the scale. RoPE is BDH's: interleaved pairs, frequency
1 / (2 pi 65536^(2 floor(i/2) / N)), its cos/sin computed once at build time. The seed's dropout
(0.1) is left out: the lab compares loss curves step against step, and dropout masks would differ.

Full profile: D = 192, H = 6, N = 1024 per head, L = 6, batch 256; 3,562,954 parameters (three
D x H N matrices of 1,179,648 each, the rest is the patch convolution, CLS, positions and head).
Mid: the same model at batch 192 (``PROFILES`` says why).

FLOPs of one training step (matmuls and the convolution, as ``FlopCounterMode`` counts them; RoPE,
softmax, LayerNorm and the gate are elementwise and not counted). Per sample, forward:

    conv = 2 P (3 p^2) D                       P = 64 patches of p = 4
    core = L [ 6 T D H N + 2 H T^2 (N + D) ]   E, E_v, W (2 T D H N each); q q^T and A x
    head = 2 D C                               C = 10 classes

    step = batch * [ 2 conv + 3 (core + head) ]

Backward costs twice the forward for every matmul; the convolution's input is the image, which
needs no gradient, so its backward is only the weight gradient (1x). Recomputation under
activation checkpointing is not useful work and is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ..settings import Settings
from .base import PeakMemory, Workload, check_finite_numbers, check_positive_ints
from .checkpointing import parse_checkpointing

IMAGE, PATCH, IN_CHANNELS, CLASSES = 32, 4, 3, 10
PATCHES = (IMAGE // PATCH) ** 2   # 64
TOKENS = PATCHES + 1              # 65 with the CLS token
ROPE_THETA = 2.0 ** 16            # BDH's


@dataclass(frozen=True)
class VitBDHConfig:
    n_layer: int = 6           # applications of the one shared layer
    n_head: int = 6
    d_model: int = 192
    n_neuron: int = 1024       # N: width of the sparse activations, per head
    batch: int = 256
    lr: float = 5e-4
    weight_decay: float = 0.05
    data_images: int = 10_000  # size of the synthetic set (ignored with a CIFAR-10 source)

    def __post_init__(self):
        check_positive_ints(self, ("n_layer", "n_head", "d_model", "n_neuron", "batch", "data_images"))
        if self.n_neuron % 2:
            raise ValueError(f"VitBDHConfig.n_neuron ({self.n_neuron}) must be even: RoPE rotates pairs of neurons")
        check_finite_numbers(self)
        if self.data_images < self.batch:
            raise ValueError(f"VitBDHConfig.data_images ({self.data_images}) must hold at least one batch "
                             f"({self.batch})")


# The largest peak of both forms in the full series (11.74 GiB each, outputs/reference/h100): the
# fp32 baseline, where each of the L applications keeps [B, H, 65, N] activations for backward.
# The weights barely count: 3,562,954 parameters x 16 B = 0.05 GiB do not grow with the batch.
PEAK = PeakMemory(step="01_baseline_fp32", batch=256, measured_gib=11.74, fixed_gib=0.05)

PROFILES = {
    "full": VitBDHConfig(),
    # mid: batch 192 (3/4 of full, a multiple of 64), every dimension as full. PEAK.at(192) =
    # 0.05 + 11.69 x 192 / 256 = 8.82 GiB, the largest of mid's estimates (hwlib.profiles.PEAK_GIB);
    # full's 11.74 GiB would raise mid's need to 14.24 GiB, within 0.5 GiB of a 16 GB T4's 14.7 GiB.
    "mid": VitBDHConfig(batch=192),
    "smoke": VitBDHConfig(n_layer=2, n_head=2, d_model=32, n_neuron=64, batch=16, lr=1e-3, data_images=512),
}


def rope_tables(n: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, n] of BDH's RoPE (pairs of neurons share a frequency), in float64
    before rounding to float32, once, instead of every forward pass."""
    pair = torch.div(torch.arange(n, dtype=torch.float64), 2, rounding_mode="floor") * 2
    freqs = 1.0 / ROPE_THETA ** (pair / n) / (2 * math.pi)               # turns per position
    phases = (torch.arange(tokens, dtype=torch.float64)[:, None] * freqs) % 1.0 * (2 * math.pi)
    return phases.cos().float(), phases.sin().float()


def rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate neuron pairs (2i, 2i+1) of ``v`` [..., T, N] by their position's phase."""
    rot = torch.stack((-v[..., 1::2], v[..., ::2]), dim=-1).flatten(-2)
    return v * cos.to(v.dtype) + rot * sin.to(v.dtype)


class BDHAttention(nn.Module):
    """BDH's attention as the recipe runs it: q [H, B, T, N] is both query and key, and the values are the
    token states x [B, T, D], shared by every head (expanded over H). ``attention``: "manual"
    (matmul-softmax-matmul) or "sdpa" (``F.scaled_dot_product_attention``, step 04)."""

    def __init__(self, form: str, attention: str):
        super().__init__()
        self.form, self.attention = form, attention

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        H, B, T, N = q.shape
        v = x.unsqueeze(0).expand(H, B, T, x.size(-1))
        if self.form == "linear":
            # T^2 (N + D) per head: cheaper than the associative q (q^T x) order, 2 T N D, at T = 65.
            return (q @ q.transpose(-2, -1)) @ v
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, q, v, scale=1.0 / math.sqrt(N))
        att = (q @ q.transpose(-2, -1)) * (1.0 / math.sqrt(N))
        return torch.softmax(att, dim=-1) @ v


class VisionBDH(nn.Module):
    def __init__(self, cfg: VitBDHConfig, form: str = "softmax", attention: str = "manual",
                 checkpointing: str = "none"):
        super().__init__()
        if form not in ("softmax", "linear"):
            raise ValueError(f"attention form must be 'softmax' or 'linear', got {form!r}")
        if attention not in ("manual", "sdpa"):
            raise ValueError(f"attention must be 'manual' or 'sdpa', got {attention!r}")
        self.cfg = cfg
        # Parameterless: what a step past the recipe swaps (hwlib.steps.s29_shared_qk_attention).
        self.attend = BDHAttention(form, attention)
        # Each checkpointed application of the shared layer keeps only its input; the rest is
        # recomputed in backward. "head" (a GPT option) has no meaning here and is ignored.
        self.checkpointed, _ = parse_checkpointing(checkpointing, cfg.n_layer)
        D, H, N = cfg.d_model, cfg.n_head, cfg.n_neuron
        self.patch = nn.Conv2d(IN_CHANNELS, D, kernel_size=PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.pos = nn.Parameter(torch.zeros(1, TOKENS, D))
        # Per-head matrices stacked on a leading head axis: one batched matmul serves all heads.
        self.encoder = nn.Parameter(torch.empty(H, D, N))
        self.encoder_v = nn.Parameter(torch.empty(H, D, N))
        self.decoder = nn.Parameter(torch.empty(H, N, D))
        self.head = nn.Linear(D, CLASSES)
        cos, sin = rope_tables(N, TOKENS)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int) -> "VisionBDH":
        """The seed's initialisation from a CPU generator, in a fixed order: Xavier-uniform
        matrices (per head for E and E_v, as its per-head ``nn.Linear(D, N)``; over all H N inputs
        for the decoder), zero biases and CLS, N(0, 0.02) positions."""
        g = torch.Generator().manual_seed(seed)
        D, H, N = self.cfg.d_model, self.cfg.n_head, self.cfg.n_neuron

        def xavier(p, fan_in, fan_out):
            a = math.sqrt(6.0 / (fan_in + fan_out))
            p.uniform_(-a, a, generator=g)

        with torch.no_grad():
            xavier(self.patch.weight, IN_CHANNELS * PATCH * PATCH, D * PATCH * PATCH)
            self.patch.bias.zero_()
            self.cls.zero_()
            self.pos.normal_(0.0, 0.02, generator=g)
            xavier(self.encoder, D, N)
            xavier(self.encoder_v, D, N)
            xavier(self.decoder, H * N, D)
            xavier(self.head.weight, D, CLASSES)
            self.head.bias.zero_()
        return self

    def set_attention(self, attention: str) -> None:
        if attention not in ("manual", "sdpa"):
            raise ValueError(f"attention must be 'manual' or 'sdpa', got {attention!r}")
        if not isinstance(self.attend, BDHAttention):
            raise ValueError(f"set_attention chooses the recipe's attention kernel; this model's attention is "
                             f"{type(self.attend).__name__}, which has no such choice")
        self.attend.attention = attention

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        """One application of the shared BDH layer to x [B, T, D]."""
        B, T, D = x.shape
        H, N = self.cfg.n_head, self.cfg.n_neuron
        x = F.layer_norm(x, (D,))
        # Heads lead ([H, B*T, ...]) so that E, E_v and W are one bmm each, with no copy of the
        # [H, D, N] weights per sample (broadcasting matmul would expand them over B).
        s = F.relu(torch.bmm(x.reshape(1, B * T, D).expand(H, B * T, D), self.encoder))        # [H, B*T, N]
        q = rope(s.view(H, B, T, N), self.rope_cos[:T], self.rope_sin[:T])
        a = F.layer_norm(self.attend(q, x), (D,))                                              # [H, B, T, D]
        u = F.relu(torch.bmm(a.reshape(H, B * T, D), self.encoder_v))                          # [H, B*T, N]
        y = torch.bmm(s * u, self.decoder).sum(0)                                               # [B*T, D]
        return F.layer_norm(x + F.layer_norm(y.view(B, T, D), (D,)), (D,))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B = images.shape[0]
        if tuple(images.shape[1:]) != (IN_CHANNELS, IMAGE, IMAGE):
            raise ValueError(f"images must be [B, {IN_CHANNELS}, {IMAGE}, {IMAGE}], got {tuple(images.shape)}")
        x = self.patch(images).flatten(2).transpose(1, 2)                   # [B, 64, D]
        x = torch.cat([self.cls.expand(B, 1, -1), x], dim=1) + self.pos     # [B, 65, D]
        for i in range(self.cfg.n_layer):
            if i in self.checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)
            else:
                x = self.layer(x)
        return self.head(F.layer_norm(x[:, 0], (x.size(-1),)))


class VitBDHWorkload(Workload):
    """Vision-BDH with softmax attention (manual or SDPA, per ``Settings.attention``)."""

    name = "vit_bdh"
    checkpoint_parts = ("blocks",)
    unit = "samples"
    profiles = PROFILES
    form = "softmax"

    def build(self, cfg: VitBDHConfig, settings: Settings, seed: int) -> VisionBDH:
        return VisionBDH(cfg, form=self.form, attention=settings.attention,
                         checkpointing=settings.checkpointing).init_weights(seed)

    def batches(self, cfg: VitBDHConfig, device: torch.device, seed: int, source: str | None = None,
                settings: Settings | None = None):
        import functools

        from ..data.images import cached_synthetic_images, cifar10, collate
        from ..data.loader import LoaderBatches
        settings = settings or Settings()
        ds = cifar10(source, split="train", seed=seed) if source else cached_synthetic_images(cfg.data_images, seed)
        return LoaderBatches(ds, cfg.batch, torch.device(device), seed, mode=settings.loader,
                             collate=functools.partial(collate, channels_last=settings.channels_last))

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def flops_per_step(self, cfg: VitBDHConfig) -> float:
        L, D, H, N, T = cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_neuron, TOKENS
        conv = 2 * PATCHES * (IN_CHANNELS * PATCH * PATCH) * D
        core = L * (6 * T * D * H * N + 2 * H * T * T * (N + D))
        head = 2 * D * CLASSES
        return float(cfg.batch * (2 * conv + 3 * (core + head)))

    def items_per_step(self, cfg: VitBDHConfig) -> int:
        return cfg.batch


class VitBDHLinearWorkload(VitBDHWorkload):
    """Vision-BDH with the linear attention form (no softmax; ``Settings.attention`` is moot)."""

    name = "vit_bdh_linear"
    form = "linear"
