"""The models of the Polychromic workload, built from configs with random weights (nothing is
downloaded): a Qwen3-shaped causal LM with LoRA through ``peft``, and a BERT-shaped sentence encoder.

Building an 8B model the default way (Hugging Face's init of every weight on the CPU, then a copy)
takes minutes. Here the LM is created on the ``meta`` device (shapes only), materialised on the
target device with ``to_empty`` and filled there: N(0, 0.02) weights from a device generator seeded
with ``seed``, unit RMSNorm gains, RoPE frequencies recomputed (``to_empty`` leaves buffers
uninitialised too). The same seed gives the same weights on the same device type.

The sentence encoder: sentence-transformers is not a dependency (it would wrap this very BertModel):
mean pooling over the attention mask and the L2 norm are done by hand, as all-MiniLM-L6-v2's
pooling module does.
"""

from __future__ import annotations

import torch

from ...extras import require
from .config import PolyConfig

NEEDED_FOR = "the generation workload (notebook 14)"

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def qwen3_config(cfg: PolyConfig):
    Qwen3Config = require("transformers", NEEDED_FOR).Qwen3Config
    return Qwen3Config(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                       num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                       max_position_embeddings=cfg.max_positions, tie_word_embeddings=cfg.tie_embeddings,
                       attention_dropout=0.0, use_cache=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)


@torch.no_grad()
def init_random(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Cheap random init in place, on the model's device: N(0, 0.02) matrices, unit norm gains, RoPE
    frequencies recomputed from the config."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=g)
    for mod in model.modules():
        if hasattr(mod, "inv_freq") and hasattr(mod, "compute_default_rope_parameters"):
            inv, _ = mod.compute_default_rope_parameters(mod.config)
            mod.inv_freq.copy_(inv)
            if hasattr(mod, "original_inv_freq"):
                mod.original_inv_freq.copy_(inv)
    return model


def build_lm(cfg: PolyConfig, device: torch.device | str, seed: int = 0):
    """The Qwen3-shaped LM on ``device`` in ``cfg.dtype``, random weights, no LoRA yet."""
    AutoModelForCausalLM = require("transformers", NEEDED_FOR).AutoModelForCausalLM
    qc = qwen3_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qc, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn)
    model.to_empty(device=torch.device(device))
    if cfg.tie_embeddings:
        model.tie_weights()     # to_empty gives each module its own tensor: tie again
        assert model.lm_head.weight is model.model.embed_tokens.weight
    init_random(model, seed)
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = None, 0, None   # no stop: every reply has T tokens
    return model


def add_lora(model, cfg: PolyConfig, seed: int = 0):
    """LoRA adapters (peft) on ``cfg.lora_targets``; the base weights frozen; gradient checkpointing
    on (non-reentrant, so frozen embeddings need no input-grad hook), as the seed trained."""
    peft = require("peft", NEEDED_FOR)
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model
    torch.manual_seed(seed)   # peft draws lora_A from the global generator
    lc = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                    target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")
    pm = get_peft_model(model, lc)
    # transformers 5 renamed gradient_checkpointing_enable (the old name warns); older ones lack the new
    enable = getattr(pm, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.train()
    return pm


def build_encoder(cfg: PolyConfig, device: torch.device | str, seed: int = 0):
    """The BERT-shaped sentence encoder (float32, eval mode), random weights from ``seed``."""
    tf = require("transformers", NEEDED_FOR)
    BertConfig, BertModel = tf.BertConfig, tf.BertModel
    bc = BertConfig(vocab_size=cfg.tok_vocab, hidden_size=cfg.enc_hidden, num_hidden_layers=cfg.enc_layers,
                    num_attention_heads=cfg.enc_heads, intermediate_size=cfg.enc_intermediate,
                    max_position_embeddings=cfg.enc_max_len, pad_token_id=0)
    torch.manual_seed(seed)
    enc = BertModel(bc, add_pooling_layer=False).to(device).eval()
    for p in enc.parameters():
        p.requires_grad_(False)
    return enc


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token states where ``mask`` is 1, then L2-normalised: [B, D] unit rows."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


def lora_parameters(pm) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in pm.named_parameters() if p.requires_grad]


def weight_bytes(model) -> int:
    """Bytes a decode step must read of the LM's weights: every parameter once, except the input
    embedding table, of which a step reads only its B rows (a tied head reads it all, as the head)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is emb and p is not head:
            continue
        total += p.numel() * p.element_size()
    return total
