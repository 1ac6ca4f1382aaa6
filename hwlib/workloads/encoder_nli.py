"""DeBERTa-base-shaped NLI classifier: a bidirectional post-LayerNorm encoder over premise/hypothesis pairs.

The seed (``003``) fine-tunes DeBERTa-v3-base on NLI with every pair padded to 512 tokens. This
model has its shape: 12 layers, width 768, 12 heads, GELU (erf) MLP of 3072, post-LayerNorm
(LayerNorm after each residual sum, as BERT and DeBERTa), an embedding LayerNorm, and DeBERTa's
context pooler (dense + GELU on the [CLS] token) before a 3-way classifier trained with
cross-entropy. No dropout, so that two steps of the ladder compute the same function. Full
profile: batch 32 pairs of [CLS] premise [SEP] hypothesis [SEP] padded to 512, vocabulary 30522
(BERT's size): 85.1M encoder + 23.8M embedding + 0.6M head = 109.5M parameters (DeBERTa-v3-base
has the same 86M backbone and a 128k-token, 98M embedding).

Not reproduced: DeBERTa's disentangled attention (content-to-position and position-to-content
scores from relative-position embeddings) and its enhanced mask decoder. Plain learned absolute
positions are added to the token embeddings instead. For what the ladder measures this does not
matter: the extra terms are two more [T, T] score matrices per head, which cost FLOPs and memory
like the content scores but change none of the optimizations studied (precision, fused attention,
compile, CUDA graphs, loader, packing); a packed sequence keeps its own position ids exactly as it
would keep its own relative positions. No segment (token-type) embeddings: DeBERTa-v3 has none.

Two batch layouts (``hwlib.data.nli``), the same samples in the same order:

* padded (steps 01-10): ids [B, 512] with a key-padding mask; every query attends to the real
  keys of its own row;
* packed (step 11, ``Settings.packing``): the pairs first-fit into rows of ``pack_len`` tokens
  (512: 3-4 rows instead of 32 for the synthetic data), each token with its position inside its
  own pair and the pair's index (-1 on a row's tail); attention gets the block-diagonal mask
  seq_q == seq_k, so every pair attends only to itself, and the classifier reads each pair's
  [CLS] by a flat index. Row tails attend to each other, never to a pair, so no softmax row is
  empty and nothing leaks into the loss.

Why this mechanism: a dense [R, 1, 512, 512] boolean mask goes through
``F.scaled_dot_product_attention`` (on CUDA the memory-efficient or cuDNN kernel: flash takes no
mask) and through the manual path alike, runs on CPU, is traced by torch.compile without
data-dependent control flow, and leaves one varying dimension, the row count R, marked dynamic
so that it compiles once and CUDA graphs record one graph per count (two or three). Masked-out
tiles inside a row are still computed; FlexAttention's block mask or a varlen flash kernel could
skip them, but attention over 512-token rows is ~10% of this model's FLOPs, and both need
per-batch block metadata (FlexAttention also a compiled kernel to be fast at all), while the
dense mask already removes the >90% of the work that padding costs.

FLOPs of one training step count real tokens only (padding is work, not useful work; forward x 3
for forward + backward, attention in full as PaLM's MFU does). For a batch of pairs of n_i tokens:

    3 * [ L * ((8 d^2 + 4 d f) * sum n_i + 4 d * sum n_i^2) + B * (2 d^2 + 2 d C) ]

8 d^2: QKV (6 d^2) and output projection (2 d^2) per token; 4 d f: the MLP (16 d^2 at f = 4d);
4 d n_i per token: QK^T and AV over its own pair's n_i keys; 2 d^2 + 2 d C: pooler and classifier
on each [CLS]. ``flops_per_step`` uses sum n_i = B E[n] and sum n_i^2 = B E[n^2] over the
synthetic set of the config (seed 0, after truncation).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ..data import nli as nli_data
from ..data.loader import LoaderBatches, StepSampler
from ..shapes import padded
from ..settings import Settings
from .base import PeakMemory, Workload, check_finite_numbers, check_positive_ints
from .checkpointing import parse_checkpointing


@dataclass(frozen=True)
class EncoderNLIConfig:
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_ff: int = 3072
    context: int = 512
    pack_len: int = 512          # tokens per packed row (step 11); every pair fits one: >= context
    vocab: int = 30522
    n_classes: int = 3
    batch: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.01
    init_std: float = 0.02        # BERT's; the narrow smoke model keeps std * sqrt(d) instead (PROFILES)
    n_samples: int = 20_000       # synthetic pairs (an epoch is n_samples // batch steps)
    n_words: int = 8000           # synthetic lexicon

    def __post_init__(self):
        check_positive_ints(self, ("n_layer", "n_head", "d_model", "d_ff", "context", "pack_len", "vocab",
                                   "n_classes", "batch", "n_samples", "n_words"))
        if self.d_model % self.n_head:
            raise ValueError(f"EncoderNLIConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.context < nli_data.MIN_CONTEXT:
            raise ValueError(f"EncoderNLIConfig.context must be at least {nli_data.MIN_CONTEXT} "
                             f"([CLS] premise [SEP] hypothesis [SEP]), got {self.context}")
        if self.pack_len < self.context:
            raise ValueError(f"EncoderNLIConfig.pack_len ({self.pack_len}) must be at least the context "
                             f"({self.context}): a packed row holds whole pairs")
        if self.n_classes != len(nli_data.LABELS):
            raise ValueError(f"EncoderNLIConfig.n_classes must be {len(nli_data.LABELS)} "
                             f"({', '.join(nli_data.LABELS)}), got {self.n_classes}")
        if self.n_words > (self.vocab - nli_data.N_RESERVED - 2) // 2:
            raise ValueError(f"EncoderNLIConfig.n_words ({self.n_words}) must be at most half the hashed "
                             f"vocabulary, {(self.vocab - nli_data.N_RESERVED - 2) // 2} for vocab {self.vocab}")
        check_finite_numbers(self, positive=("lr", "init_std"))


# Its largest peak in the full series (15.87 GiB, outputs/reference/h100): the fp32 baseline, 32
# pairs padded to 512 tokens with the manual attention's [B, 12, 512, 512] scores kept per layer.
# Of it, 1.63 GiB does not grow with the batch: 109,483,011 parameters x 16 B.
PEAK = PeakMemory(step="01_baseline_fp32", batch=32, measured_gib=15.87, fixed_gib=1.63)

PROFILES = {
    "full": EncoderNLIConfig(),
    # mid: batch 16 pairs (packed: 2 rows of 512 tokens from step 11), every dimension as full.
    # PEAK.at(16) = 1.63 + 14.24 x 16 / 32 = 8.75 GiB; full's 15.87 GiB does not fit a 16 GB GPU.
    # Packing still removes 95% of the padding at this batch (98% at 32).
    "mid": EncoderNLIConfig(batch=16),
    # Smoke rows hold two contexts: rows of 64 would mostly hold one ~42-token pair each. Its
    # init_std keeps the full model's std * sqrt(d) = 0.55 (0.02 * sqrt(768 / 64)): at 0.02 a
    # width-64 model starts with uniform attention and a [CLS] output all but independent of the
    # words, so its first losses are the same whatever the pairs say.
    "smoke": EncoderNLIConfig(n_layer=2, n_head=4, d_model=64, d_ff=256, context=64, pack_len=128, vocab=1000,
                              batch=8, lr=2e-3, init_std=0.07, n_samples=2000, n_words=300),
}


class SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderNLIConfig, attention: str):
        super().__init__()
        self.n_head, self.d = cfg.n_head, cfg.d_model
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.attention = attention

    def forward(self, x, mask):
        """``mask``: bool, broadcastable to [B, H, T, T], True where the query may see the key."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(self.d, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~mask, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderNLIConfig, attention: str):
        super().__init__()
        self.attn = SelfAttention(cfg, attention)
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=1e-7)
        self.mlp_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.mlp_out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=1e-7)

    def forward(self, x, mask):
        x = self.ln_1(x + self.attn(x, mask))
        return self.ln_2(x + self.mlp_out(F.gelu(self.mlp_in(x))))


class EncoderNLI(nn.Module):
    def __init__(self, cfg: EncoderNLIConfig, attention: str = "manual", vocab_multiple: int = 1,
                 checkpointing: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.checkpointed, _ = parse_checkpointing(checkpointing, cfg.n_layer)   # "head": no vocabulary head here
        self.vocab_padded = padded(cfg.vocab, vocab_multiple)
        self.wte = nn.Embedding(self.vocab_padded, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.ln_emb = nn.LayerNorm(cfg.d_model, eps=1e-7)
        self.blocks = nn.ModuleList(EncoderLayer(cfg, attention) for _ in range(cfg.n_layer))
        self.pool = nn.Linear(cfg.d_model, cfg.d_model)
        self.classifier = nn.Linear(cfg.d_model, cfg.n_classes)

    def init_weights(self, seed: int) -> "EncoderNLI":
        """BERT initialisation from a CPU generator, parameter by parameter in a fixed order:
        N(0, init_std) weights and embeddings, zero biases, unit LayerNorm gains; padded
        vocabulary rows zero (never looked up, so they get no gradient)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln_" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                elif name.startswith("wte"):
                    p.zero_()
                    p[: self.cfg.vocab].normal_(0.0, self.cfg.init_std, generator=g)
                else:
                    p.normal_(0.0, self.cfg.init_std, generator=g)
        return self

    def set_attention(self, attention: str) -> None:
        for b in self.blocks:
            b.attn.attention = attention

    def forward(self, ids, labels=None, keep=None, pos=None, seq=None, cls=None):
        """Padded: ``ids``, ``keep`` [B, T]. Packed: ``ids``, ``pos``, ``seq`` [R, T] and ``cls`` [B]
        (``nli_data.PackCollate``). Returns the mean cross-entropy, or the logits without labels."""
        R, T = ids.shape
        if seq is None:
            if T > self.cfg.context:
                raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.context}")
            x = self.wte(ids) + self.wpe(torch.arange(T, device=ids.device))
            mask = keep[:, None, None, :]                          # key padding, [B, 1, 1, T]
        else:
            x = self.wte(ids) + self.wpe(pos)
            mask = (seq[:, :, None] == seq[:, None, :])[:, None]   # block-diagonal, [R, 1, T, T]
        x = self.ln_emb(x)
        for i, block in enumerate(self.blocks):
            if i in self.checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        h = x[:, 0] if seq is None else x.reshape(R * T, -1).index_select(0, cls)
        logits = self.classifier(F.gelu(self.pool(h)))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels)


def length_moments(cfg: EncoderNLIConfig) -> tuple[float, float]:
    """E[n] and E[n^2] of the pair lengths n (tokens, after truncation) of the synthetic set, seed 0."""
    lengths = _synthetic(cfg, 0).lengths.astype("float64")
    return float(lengths.mean()), float((lengths ** 2).mean())


def flops_formula(cfg: EncoderNLIConfig, tokens: float, sum_sq: float, pairs: int) -> float:
    """Forward + backward FLOPs for ``pairs`` pairs with ``tokens`` real tokens in all and
    ``sum_sq`` = sum of squared pair lengths (see the module docstring)."""
    L, d, f, C = cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.n_classes
    return 3.0 * (L * ((8 * d * d + 4 * d * f) * tokens + 4 * d * sum_sq) + pairs * (2 * d * d + 2 * d * C))


def _synthetic(cfg: EncoderNLIConfig, seed: int) -> nli_data.SyntheticNLI:
    return _synthetic_set(cfg.n_samples, cfg.vocab, cfg.context, seed, cfg.n_words)


@functools.lru_cache(maxsize=8)
def _synthetic_set(n: int, vocab: int, context: int, seed: int, n_words: int) -> nli_data.SyntheticNLI:
    # Keyed by what shapes the data alone: every step and learning rate shares one set.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # reported by dataset(), once per call site
        return nli_data.SyntheticNLI(n, vocab, context, seed, n_words)


def dataset(cfg: EncoderNLIConfig, seed: int = 0, source: str | None = None):
    """The synthetic pairs for ``seed``, or the pairs of a local JSONL file."""
    if source:
        return nli_data.JsonlNLI(source, cfg.vocab, cfg.context)
    ds = _synthetic(cfg, seed)
    nli_data.warn_truncated(ds.truncated, len(ds), cfg.context, "synthetic NLI set")
    return ds


def _packed_rows(ds, cfg: EncoderNLIConfig, seed: int, n: int):
    """(pair lengths, packed row count) of batches 0..n-1, in the loader's order."""
    order = StepSampler(len(ds), cfg.batch, seed)
    for i in range(n):
        lengths = ds.lengths[order.indices(i)]
        yield lengths, 1 + max(r for r, _ in nli_data.pack_rows(lengths, cfg.pack_len))


def padding_stats(cfg: EncoderNLIConfig, seed: int = 0, n_batches: int = 50, source: str | None = None) -> dict:
    """What padding costs and what packing removes, over batches 0..n_batches-1 of the loader.

    real: tokens of the pairs; padded: batch x context (steps 01-10); packed: rows x pack_len after
    first-fit packing (step 11). ``removed`` is the share of padding tokens that packing removes."""
    ds = dataset(cfg, seed, source)
    real = packed = 0
    rows_seen: set[int] = set()
    for lengths, rows in _packed_rows(ds, cfg, seed, n_batches):
        rows_seen.add(rows)
        real += int(lengths.sum())
        packed += rows * cfg.pack_len
    pad = n_batches * cfg.batch * cfg.context
    return {"batches": n_batches, "real_tokens": real, "padded_tokens": pad, "packed_tokens": packed,
            "padding_share_padded": 1 - real / pad, "padding_share_packed": 1 - real / packed,
            "removed": (pad - packed) / (pad - real) if pad > real else 0.0,
            "packed_rows": sorted(rows_seen), "truncated_pairs": ds.truncated, "pairs": len(ds)}


def _to_device(batch, device: torch.device, non_blocking: bool):
    out = tuple(t.to(device, non_blocking=non_blocking) for t in batch)
    if len(out) == 5:
        # The packed row count changes from batch to batch: compile it as a dynamic dimension once
        # instead of specialising on the first count and recompiling on the second.
        from torch._dynamo import maybe_mark_dynamic
        for t in out[:3]:
            maybe_mark_dynamic(t, 0)
    return out


class EncoderNLIWorkload(Workload):
    name = "encoder_nli"
    checkpoint_parts = ("blocks",)
    unit = "samples"
    profiles = PROFILES

    def build(self, cfg: EncoderNLIConfig, settings: Settings, seed: int) -> EncoderNLI:
        return EncoderNLI(cfg, attention=settings.attention, vocab_multiple=settings.vocab_multiple,
                          checkpointing=settings.checkpointing).init_weights(seed)

    def batches(self, cfg: EncoderNLIConfig, device: torch.device, seed: int, source: str | None = None,
                settings: Settings | None = None):
        settings = settings or Settings()
        ds = dataset(cfg, seed, source)
        if len(ds) < cfg.batch:
            where = f"NLI data file {source!r}" if source else "the synthetic NLI set"
            raise ValueError(f"{where} has {len(ds)} pairs, fewer than one batch of {cfg.batch}")
        collate = nli_data.PackCollate(cfg.pack_len) if settings.packing else nli_data.PadCollate(cfg.context)
        return LoaderBatches(ds, cfg.batch, device, seed, mode=settings.loader, collate=collate, to_device=_to_device)

    def batch_shapes(self, cfg: EncoderNLIConfig, batches, n: int) -> list | None:
        """Packed batches have as many rows as first-fit packing needs (3 or 4 at full size)."""
        if not isinstance(batches.collate, nli_data.PackCollate):
            return None
        return [rows for _, rows in _packed_rows(batches.dataset, cfg, batches.seed, n)]

    def loss(self, model, batch):
        if len(batch) == 3:
            ids, keep, labels = batch
            return model(ids, labels, keep=keep)
        ids, pos, seq, cls, labels = batch
        return model(ids, labels, pos=pos, seq=seq, cls=cls)

    def flops_per_step(self, cfg: EncoderNLIConfig) -> float:
        mean, mean_sq = length_moments(cfg)
        return flops_formula(cfg, cfg.batch * mean, cfg.batch * mean_sq, cfg.batch)

    def items_per_step(self, cfg: EncoderNLIConfig) -> int:
        return cfg.batch
