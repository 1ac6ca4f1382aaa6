"""Sizes of the Polychromic workload: the language model, LoRA, the sentence encoder, the trainer and
the diversity bonus, with the checks that refuse bad values before any work starts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ...device import ChoiceError


@dataclass(frozen=True)
class PolyConfig:
    # causal LM, Qwen3-shaped (Hugging Face Qwen3Config), random weights
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tie_embeddings: bool
    max_positions: int = 4096
    dtype: str = "bf16"                 # weights and compute: "bf16" (the seed's compute dtype) or "fp32"
    attn: str = "sdpa"                  # Hugging Face attn_implementation: "sdpa" or "eager"
    # LoRA through peft (the seed: r = 16 on the attention projections)
    lora_r: int = 16
    lora_alpha: int = 32
    # 0: with dropout, the seed's train-mode generation would also draw dropout masks, and the ladder
    # would change what is sampled, not only how fast
    lora_dropout: float = 0.0
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj")
    # sentence encoder: BERT-shaped like all-MiniLM-L6-v2 (6 layers, width 384), mean pooling, L2 norm
    enc_hidden: int = 384
    enc_layers: int = 6
    enc_heads: int = 12
    enc_intermediate: int = 1536
    enc_max_len: int = 256
    tok_vocab: int = 8192               # the offline BPE tokenizer (``hwlib.data.text``)
    # trainer: per-device batch 2, accumulation 8 (the seed's)
    batch: int = 2
    accum: int = 8
    seq_len: int = 256
    lr: float = 2e-4
    lam: float = 0.3                    # weight of the diversity bonus
    every: int = 5                      # the bonus runs every 5th step
    # the bonus: P prompts, N replies each, T new tokens, temperature and top-p sampling
    prompts: int = 4
    replies: int = 3
    prompt_len: int = 32
    new_tokens: int = 100
    temperature: float = 0.9
    top_p: float = 0.9

    def params(self) -> dict:
        return dataclasses.asdict(self)


_SMOKE = PolyConfig(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                    tie_embeddings=True, max_positions=256, dtype="fp32", lora_r=4, lora_alpha=8,
                    enc_hidden=32, enc_layers=2, enc_heads=2, enc_intermediate=64, enc_max_len=64, tok_vocab=256,
                    batch=2, accum=1, seq_len=16, prompts=2, replies=3, prompt_len=8, new_tokens=8)

PROFILES: dict[str, PolyConfig] = {
    "smoke": _SMOKE,
    # Qwen3-0.6B's shape: 28 layers, width 1024, 16 query / 8 KV heads of 128, tied embeddings
    "qwen3_0.6b": PolyConfig(vocab=151936, hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8,
                             head_dim=128, tie_embeddings=True),
    # Qwen3-8B's shape: 36 layers, width 4096, 32 query / 8 KV heads of 128, untied head: 8.2B parameters
    "qwen3_8b": PolyConfig(vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                           head_dim=128, tie_embeddings=False),
}
PROFILES["full"] = PROFILES["qwen3_0.6b"]   # the notebook's time budget: see notebook 14's parameters
# mid: the same model and sizes; nothing here grows with a ladder batch (the trainer's micro-batch is
# the seed's 2 rows of 256 tokens, the bonus P N = 12 replies). The reference holds no peak-memory
# record of notebook 14; by count, bf16 weights (600,637,440 parameters x 2 B = 1.1 GiB) and the
# policy-gradient term's fp32 log-softmax over [12, 100, 151936] (0.68 GiB, held with its gradient)
# dominate; on an H100 capped at 16 GiB, building the trainer, a batched cycle, the policy-gradient
# term and a static_own cycle peaked at 3.4 GiB of tensors, well under mid's 8.82 GiB.
PROFILES["mid"] = PROFILES["full"]


def config(profile: str, **overrides) -> PolyConfig:
    """The profile's config with keyword overrides (config field names), checked."""
    if profile not in PROFILES:
        raise ChoiceError("profile", profile, tuple(PROFILES))
    names = [f.name for f in dataclasses.fields(PolyConfig)]
    bad = sorted(set(overrides) - set(names))
    if bad:
        raise ChoiceError("PolyConfig field", bad[0], names)
    cfg = dataclasses.replace(PROFILES[profile], **overrides)
    check_config(cfg)
    return cfg


def _pos_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")


def check_config(cfg: PolyConfig) -> None:
    """A ValueError naming the field for a value that cannot run."""
    for f in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "max_positions",
              "lora_r", "enc_hidden", "enc_layers", "enc_heads", "enc_intermediate", "enc_max_len", "batch",
              "accum", "seq_len", "every", "prompt_len", "new_tokens"):
        _pos_int(f, getattr(cfg, f))
    if not isinstance(cfg.prompts, int) or isinstance(cfg.prompts, bool) or cfg.prompts < 1:
        raise ValueError(f"prompts: P = {cfg.prompts!r}; the bonus needs at least one prompt")
    if not isinstance(cfg.replies, int) or isinstance(cfg.replies, bool) or cfg.replies < 2:
        raise ValueError(f"replies: N = {cfg.replies!r}; the diversity score is over pairs, so N must be >= 2")
    check_sampling(cfg.temperature, cfg.top_p, do_sample=True)
    if cfg.prompt_len + cfg.new_tokens > cfg.max_positions:
        raise ValueError(f"prompt_len: a prompt of {cfg.prompt_len} tokens plus {cfg.new_tokens} new tokens is longer "
                         f"than the context (max_positions = {cfg.max_positions})")
    if cfg.seq_len > cfg.max_positions:
        raise ValueError(f"seq_len {cfg.seq_len} is longer than the context (max_positions = {cfg.max_positions})")
    if cfg.dtype not in ("bf16", "fp32"):
        raise ChoiceError("dtype", cfg.dtype, ("bf16", "fp32"))
    if cfg.attn not in ("sdpa", "eager"):
        raise ChoiceError("attn", cfg.attn, ("sdpa", "eager"))
    if cfg.heads % cfg.kv_heads:
        raise ValueError(f"heads ({cfg.heads}) must be a multiple of kv_heads ({cfg.kv_heads})")
    if cfg.enc_hidden % cfg.enc_heads:
        raise ValueError(f"enc_hidden ({cfg.enc_hidden}) must be a multiple of enc_heads ({cfg.enc_heads})")
    if cfg.tok_vocab > cfg.vocab:
        raise ValueError(f"tok_vocab ({cfg.tok_vocab}) must not exceed the LM's vocab ({cfg.vocab}): prompts are "
                         f"tokenizer ids fed to the LM")
    for f in ("lr", "lam"):
        v = getattr(cfg, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{f} must be a finite number >= 0, got {v!r}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout!r}")


def check_sampling(temperature, top_p, do_sample: bool = True) -> None:
    """Sampling needs temperature > 0 (0 would divide the logits by zero: ask for greedy decoding
    instead) and 0 < top_p <= 1."""
    if not do_sample:
        return
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature!r}; for greedy decoding pass "
                         f"do_sample=False")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def param_count(cfg: PolyConfig) -> dict:
    """Parameters of the LM by part (counts, not bytes): embedding, blocks, head, LoRA."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attn = cfg.hidden * q * 2 + cfg.hidden * kv * 2 + 2 * cfg.head_dim     # q, o, k, v; q/k norms
    mlp = 3 * cfg.hidden * cfg.intermediate
    block = attn + mlp + 2 * cfg.hidden
    dims = {"q_proj": (cfg.hidden, q), "k_proj": (cfg.hidden, kv), "v_proj": (cfg.hidden, kv), "o_proj": (q, cfg.hidden),
            "gate_proj": (cfg.hidden, cfg.intermediate), "up_proj": (cfg.hidden, cfg.intermediate),
            "down_proj": (cfg.intermediate, cfg.hidden)}
    lora = cfg.layers * sum(cfg.lora_r * (dims[t][0] + dims[t][1]) for t in cfg.lora_targets)
    return {"embedding": cfg.vocab * cfg.hidden, "blocks": cfg.layers * block + cfg.hidden,
            "head": 0 if cfg.tie_embeddings else cfg.vocab * cfg.hidden, "lora": lora}
