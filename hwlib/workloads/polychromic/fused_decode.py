"""The decode step at the bandwidth limit: the lab's own Qwen3 decode step, each token one CUDA-graph
replay, in rungs that remove kernels and passes one change at a time (notebook 14, issue 47).

A decode step reads every weight once, the KV cache up to the current length and a few small
activations; at batch 12 its matmuls are matrix-vector products, so its floor is those bytes at the
copy bandwidth (``step_bytes``). What keeps a step above its floor is everything but the bytes: a
launch and a tail per kernel, passes that re-read what an earlier kernel wrote, a cache read past
the current length. The rungs, each cumulative (``RUNGS``):

===============  ================================================================================
``graph``        the step in plain PyTorch ops (one matmul per projection, RMSNorm, RoPE and the
                 SiLU product as eager ops, SDPA over the whole static cache with a length mask,
                 sampling), captured whole into one CUDA graph: one replay per token
``concat``       q, k, v as one matmul and gate, up as one matmul (weights concatenated once)
``compile``      the elementwise chains compiled (torch.compile, no CUDA graphs of its own: the
                 step is still captured here): residual add with the next RMSNorm, SiLU with the
                 product, q/k norm with RoPE, the sampler
``rope_cache``   q/k RMSNorm, RoPE and the cache write of k and v in one Triton kernel
                 (``decode_kernels.qk_norm_rope_cache``)
``decode_attn``  attention by a Triton decode kernel that reads the cache only up to the current
                 length, each K/V element once per GQA group (``decode_kernels.decode_attention``)
``matvec``       the four block matmuls by a Triton kernel for batches of at most 16 rows
                 (``kernels/14_decode_matvec_triton.py``): SiLU(gate) * up computed in the gate/up
                 matmul's epilogue, o and down split over K into float32 partial sums that the
                 residual add before the next RMSNorm sums (no split-K reduce kernel, no SiLU kernel)
``top_p``        top-p sampling without a sort: the threshold logit from a per-row histogram of
                 the logits' order keys, then the exponential race over the kept tokens, in five
                 Triton launches (``kernels/14_decode_top_p_triton.py``)
===============  ================================================================================

Measured and kept out of the ladder (``SLOWER``): on an H100 it made the step slower than
``decode_attn``'s compiled sampler, 6.99 against 6.84 ms at 8B and 1.73 against 1.58 ms at 0.6B
(``outputs/reference/h100-decode-sampler``, both rungs in one process):

===============  ================================================================================
``sampler``      top-p by sorting the model-dtype logits (the probabilities' order; a bf16 key is
                 half the radix passes of a float32 one) and the draw taken in sorted order
                 (``sample_top_p_sorted``, eager: torch 2.11's inductor failed to generate both a
                 cumsum fused with the gather and an argmax over the gathered noise): the same
                 token as ``decode.sample_top_p``. The bf16 sort saves less than the compiled
                 sampler's fusions that the eager form gives up.
===============  ================================================================================

The weights are the model's (a ``peft`` model's LoRA merged in: W + scaling B A, refreshed at every
call, into buffers whose addresses the captured graphs keep). The prefill is the model's own forward
(eager, LoRA unmerged); its KV cache is copied into the static cache. Prompts have no padding and
replies never stop early, as in ``decode``. On a CPU nothing is captured or compiled: the same ops run
eagerly (the Triton kernels under ``TRITON_INTERPRET=1``), which is how the tests check the math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.sources import load_python_kernel
from .config import PolyConfig
from .decode import sample_top_p, static_rows

RUNGS = ("graph", "concat", "compile", "rope_cache", "decode_attn", "matvec", "top_p")
# Timed on an H100 and slower than the rung before it (see above): asked for by name only
# (decode_bench --rungs), so that the measurement can be repeated.
SLOWER = ("sampler",)
ALL_RUNGS = RUNGS + SLOWER
# the rung each one set apart was measured on (its other pieces are that rung's)
BUILDS_ON = {"sampler": "decode_attn"}
CHANGES = {
    "graph": "the whole step (plain PyTorch ops, SDPA over the static cache, sampling) in one CUDA graph",
    "concat": "QKV as one matmul and gate/up as one matmul (concatenated weights built once)",
    "compile": "torch.compile fuses the residual add with RMSNorm, SiLU with the product, q/k norm with RoPE, "
               "and the sampler",
    "rope_cache": "q/k RMSNorm, RoPE and the cache write in one Triton kernel",
    "decode_attn": "a Triton decode-attention kernel reading the cache only up to the current length",
    "matvec": "the block matmuls by a Triton kernel for at most 16 rows: SiLU x up in the gate/up epilogue, "
              "o and down split over K, their partial sums added in the residual add",
    "top_p": "top-p from a histogram of the logits' order keys (no sort), the draw over the kept tokens: 5 launches",
    "sampler": "top-p sorts the bf16 logits (half the radix passes of float32 probabilities) and draws "
               "without scattering back to vocabulary order (eager)",
}


def speedups(rows: list[tuple[str, str, float | None]]) -> list[float | None]:
    """The speed-up of each (model size, rung name, ms per step) row, in the order measured, over the row
    it builds on: a rung over the rung measured before it on the same model size; a variant
    ``rung[backend]`` (decode_bench's SDPA variants) over its rung; a row of no rung (the earlier loop,
    14d_static_own) and a row without a time over nothing (None)."""
    out, before, at = [], {}, {}
    for size, name, ms in rows:
        base = name.split("[")[0]
        if not ms or base not in ALL_RUNGS:
            out.append(None)
        elif base != name:
            out.append(at[(size, base)] / ms if (size, base) in at else None)
        else:
            out.append(before[size] / ms if size in before else None)
            before[size] = at[(size, name)] = ms
    return out


ELEM = {"bf16": 2, "fp32": 4}
SDPA_BACKENDS = {"efficient": "EFFICIENT_ATTENTION", "math": "MATH", "cudnn": "CUDNN_ATTENTION",
                 "flash": "FLASH_ATTENTION"}


# --- bytes and floors -----------------------------------------------------------------------------

def step_bytes(cfg: PolyConfig, rows: int, length: int) -> dict:
    """Bytes one decode step must move for ``rows`` rows attending ``length`` cached positions (the
    new token's included), by part:

    * ``weights``: every block weight (q, k, v, o, gate, up, down, the four norms' gains), the final
      norm, the LM head (the whole vocabulary: a tied head reads the embedding table here) and the
      input embedding's ``rows`` rows (LoRA merged into the weights: nothing apart);
    * ``kv_read``: K and V of every layer at ``length`` positions per row;
    * ``kv_write``: the new token's K and V;
    * ``activations``: the residual stream read and written once per layer, and the logits
      written once and read once by the sampler.

    What a step cannot avoid moving, so the floor: a fused step can keep the other intermediates on
    chip. ``total`` sums the parts."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows must be a positive int, got {rows!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"length must be a positive int (cached positions attended), got {length!r}")
    e = ELEM[cfg.dtype]
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    block = (cfg.hidden * (q + 2 * kv) + q * cfg.hidden + 3 * cfg.hidden * cfg.intermediate
             + 2 * cfg.hidden + 2 * cfg.head_dim)
    weights = e * (cfg.layers * block + cfg.hidden + cfg.vocab * cfg.hidden + rows * cfg.hidden)
    per_pos = rows * cfg.layers * 2 * kv * e
    act = e * (cfg.layers * 2 * rows * cfg.hidden + 2 * rows * cfg.vocab)
    out = {"weights": weights, "kv_read": per_pos * length, "kv_write": per_pos, "activations": act}
    out["total"] = sum(out.values())
    return out


def generation_step_bytes(cfg: PolyConfig, rows: int, prompt_len: int, new_tokens: int) -> dict:
    """``step_bytes`` averaged over a generation's decode steps: the step that feeds token t
    (t = 1 .. T-1, the prefill gave token 0) attends ``prompt_len + t`` positions."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (a generation of one token has no decode step), got {new_tokens!r}")
    steps = [step_bytes(cfg, rows, prompt_len + t) for t in range(1, new_tokens)]
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def bandwidth(nbytes: float, ms: float, copy_gbps: float | None) -> dict:
    """GB/s of ``nbytes`` moved in ``ms``, its share of the copy ceiling and the floor (ms) that the
    ceiling sets for those bytes (None without a ceiling)."""
    if not ms or ms <= 0:
        raise ValueError(f"ms must be > 0, got {ms!r}")
    gbps = nbytes / (ms / 1e3) / 1e9
    return {"gbps": gbps, "share_of_copy": gbps / copy_gbps if copy_gbps else None,
            "floor_ms": nbytes / (copy_gbps * 1e9) * 1e3 if copy_gbps else None}


# --- the step's pieces (eager; the compile rung compiles these same functions) ------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm, rounding as Hugging Face's does: normalised in float32, back to the input
    dtype, then times the gain."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add (in the model dtype, as the model rounds it) and the next RMSNorm:
    (normed, new residual)."""
    r = res + x
    return rms(r, w, eps), r


def add_rms_parts(parts: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms`` of a matmul split over K: its float32 partial sums [S, B, N] summed and rounded to
    the model dtype (where the unsplit matmul rounds its output), then the residual add and RMSNorm."""
    # the slices added one by one (unrolled when traced): an elementwise chain that inductor fuses into the
    # norm's kernel, where parts.sum(0) compiles to a reduction kernel of its own (56 more launches a step)
    x = parts[0]
    for i in range(1, parts.shape[0]):
        x = x + parts[i]
    return add_rms(x.to(res.dtype), res, w, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from the fused gate/up matmul's [B, 2I] output."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (Hugging Face's apply_rotary_pos_emb)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def norm_rope(q: torch.Tensor, k: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D], k [B, HKV, D]: per-head RMSNorm, then RoPE at one position (cos, sin [D])."""
    return rope(rms(q, qn, eps), cos, sin), rope(rms(k, kn, eps), cos, sin)


def sorted_probs(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities in descending order and their token ids, sorting the model-dtype logits
    (softmax keeps their order; a bf16 key sorts in half the radix passes of a float32 one). The
    sort is stable: tied logits stay in vocabulary order."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    _, idx = logits.sort(dim=-1, descending=True, stable=True)
    return probs.gather(-1, idx), idx


def draw_sorted(sp: torch.Tensor, idx: torch.Tensor, noise: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p and the exponential race in sorted order: the noise gathered to it, no scatter back to
    vocabulary order."""
    drop = (sp.cumsum(-1) - sp) >= top_p          # the mass before a token already reached top_p
    pick = (sp.masked_fill(drop, 0.0) / noise.gather(-1, idx)).argmax(dim=-1, keepdim=True)
    return idx.gather(-1, pick)[:, 0]


def sample_top_p_sorted(logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``decode.sample_top_p`` with the sort on the logits and the draw in sorted order
    (``sorted_probs``, ``draw_sorted``): the same token. With noise of ones (greedy) the first
    maximum in vocabulary order, as argmax gives."""
    sp, idx = sorted_probs(logits, temperature)
    return draw_sorted(sp, idx, noise, top_p)


# --- weights --------------------------------------------------------------------------------------

def _merged(module: torch.nn.Module) -> torch.Tensor:
    """The weight a (peft LoRA) linear applies: W + sum over active adapters of scaling B A (float32
    sum, one rounding); a plain nn.Linear's own weight."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight.detach()
    w = base.weight.detach()
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return w
    acc = None
    for name in module.active_adapters:
        if name in module.lora_A:
            d = module.get_delta_weight(name).float()
            acc = d if acc is None else acc + d
    return w if acc is None else (w.float() + acc).to(w.dtype)


class _Weights:
    """The decode step's weights, per layer, as tensors the captured graphs keep: a weight no LoRA
    wraps is the model's own tensor; a merged or concatenated one is a copy (``copies``), refreshed
    in place by ``refresh``."""

    def __init__(self, model, concat: bool):
        self.copies: list[tuple[torch.Tensor, tuple]] = []
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.head = model.lm_head.weight.detach()
        self.layers = []
        for blk in inner.layers:
            a, m = blk.self_attn, blk.mlp
            lw = {"ln1": blk.input_layernorm.weight.detach(), "ln2": blk.post_attention_layernorm.weight.detach(),
                  "qn": a.q_norm.weight.detach(), "kn": a.k_norm.weight.detach(),
                  "o": self._slot(a.o_proj), "d": self._slot(m.down_proj)}
            if concat:
                lw["qkv"] = self._slot(a.q_proj, a.k_proj, a.v_proj)
                lw["gu"] = self._slot(m.gate_proj, m.up_proj)
            else:
                lw.update(q=self._slot(a.q_proj), k=self._slot(a.k_proj), v=self._slot(a.v_proj),
                          g=self._slot(m.gate_proj), u=self._slot(m.up_proj))
            self.layers.append(lw)

    def _slot(self, *mods) -> torch.Tensor:
        if len(mods) == 1 and getattr(mods[0], "base_layer", None) is None:
            return mods[0].weight.detach()
        buf = torch.cat([_merged(m) for m in mods])
        if any(getattr(m, "base_layer", None) is not None for m in mods):
            self.copies.append((buf, mods))      # plain weights concatenated never change: built once
        return buf

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the current LoRA-merged weights into their buffers (the trainer changes LoRA between
        bonuses; the captured graphs read these addresses)."""
        for buf, mods in self.copies:
            off = 0
            for m in mods:
                w = _merged(m)
                buf[off:off + w.shape[0]].copy_(w)
                off += w.shape[0]


# --- the decoder ----------------------------------------------------------------------------------

class FusedDecoder:
    """The rung ``rung``'s decode for ``batch`` rows of at most ``max_len`` positions on ``device``.
    ``__call__(prompts)`` returns [P, N, T] replies like ``decode.OwnDecodeLoop``; ``keep_logits``
    also keeps each step's logits (for the greedy check's tie rule)."""

    def __init__(self, pm, cfg: PolyConfig, batch: int, max_len: int, device, rung: str = "decode_attn",
                 graph: bool | None = None, sdpa_backend: str | None = None):
        if rung not in ALL_RUNGS:
            from ...device import ChoiceError
            raise ChoiceError("rung", rung, ALL_RUNGS)
        model = pm.get_base_model() if hasattr(pm, "get_base_model") else pm
        self.model, self.cfg, self.rung = model, cfg, rung
        self.level = RUNGS.index(BUILDS_ON.get(rung, rung))
        self.device = torch.device(device)
        self.batch, self.max_len = batch, max_len
        if sdpa_backend is not None and sdpa_backend not in SDPA_BACKENDS:
            from ...device import ChoiceError
            raise ChoiceError("sdpa_backend", sdpa_backend, tuple(SDPA_BACKENDS))
        self.sdpa_backend = sdpa_backend     # None: torch's own choice (rungs before decode_attn)
        self.use_graph = self.device.type == "cuda" if graph is None else graph
        qc = model.config
        self.eps = qc.rms_norm_eps
        self.H, self.HKV, self.D = qc.num_attention_heads, qc.num_key_value_heads, qc.head_dim
        self.scale = self.D ** -0.5
        dt = model.lm_head.weight.dtype
        with torch.no_grad():
            self.w = _Weights(model, concat=self.level >= 1)
            # RoPE's cos/sin for every position, from the model's own rotary module (its dtype rounding)
            pos = torch.arange(max_len, device=self.device)[None]
            cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=dt, device=self.device), pos)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        L = qc.num_hidden_layers
        self.k_cache = torch.zeros(L, batch, self.HKV, max_len, self.D, dtype=dt, device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.tok = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.noise = torch.ones(batch, cfg.vocab, dtype=torch.float32, device=self.device)
        self.positions = torch.arange(max_len, device=self.device)
        self.q_buf = torch.empty(batch, self.H, self.D, dtype=dt, device=self.device)
        self.attn_buf = torch.empty(batch, self.H, self.D, dtype=dt, device=self.device)
        self.logits = torch.empty(batch, cfg.vocab, dtype=dt, device=self.device)
        self.tokens = torch.zeros(batch, max_len, dtype=torch.long, device=self.device)
        self.fns = self._functions()
        if "matvec" in self.fns:
            self._matvec_buffers(dt)
        self.graphs: dict = {}

    # the pieces this rung runs, compiled from the compile rung on (a GPU only)
    def _functions(self) -> dict:
        matvec = self.level >= RUNGS.index("matvec")
        fns = {"add_rms": add_rms_parts if matvec else add_rms, "rms": rms, "silu_mul": silu_mul, "norm_rope": norm_rope,
               "sample": sample_top_p_sorted if self.rung == "sampler" else sample_top_p}
        if self.level >= RUNGS.index("compile") and self.use_graph:
            # emulate_precision_casts: a fused kernel rounds each intermediate the eager op would
            # store in bf16 (the residual before its norm), so fusion changes no value
            opts = {"emulate_precision_casts": True}
            fns = {k: torch.compile(f, dynamic=False, fullgraph=True, options=opts) for k, f in fns.items()}
            if self.rung == "sampler":
                fns["sample"] = sample_top_p_sorted        # eager: see SLOWER
        if self.level >= RUNGS.index("rope_cache"):
            from . import decode_kernels as dk
            fns["qk_norm_rope_cache"] = dk.qk_norm_rope_cache
        if self.level >= RUNGS.index("decode_attn"):
            from . import decode_kernels as dk
            fns["decode_attention"] = dk.decode_attention
        if self.level >= RUNGS.index("top_p"):
            fns["sample"] = self._top_p_sampler()
        if matvec:
            fns["matvec"] = load_python_kernel("14_decode_matvec_triton.py").matvec
        return fns

    def _top_p_sampler(self):
        """The sort-free sampler with its workspace (built once: a captured graph keeps its buffers),
        called as ``sample_top_p`` is."""
        from ...ops.sources import triton_interpreted
        top_p = load_python_kernel("14_decode_top_p_triton.py")
        # Interpreted (a CPU), each program costs about the same whatever its size: the threshold search
        # in two bin blocks, not 64 (a float32 call at vocab 512 took 6.8 s of CPU, 0.7 s so), as
        # tests/test_top_p_kernel.py runs it there. Compiled, the kernel's own bin block.
        kw = {"bin_block": top_p.NBINS // 2} if triton_interpreted() else {}
        sampler = top_p.TopPSampler(self.batch, self.cfg.vocab, self.device, dtype=self.logits.dtype, **kw)
        out = torch.empty(self.batch, dtype=torch.long, device=self.device)
        return lambda logits, noise, temperature, p: sampler(logits, noise, temperature, p, out)

    def _matvec_buffers(self, dt) -> None:
        """The matvec rung's outputs, allocated once (the captured graph keeps their addresses), and
        each projection's tiles and K split (``config``)."""
        mv = load_python_kernel("14_decode_matvec_triton.py")
        lw, B, dev = self.w.layers[0], self.batch, self.device
        # the SM count only sets how far o and down split over K; a CPU (the tests) takes an H100's
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        self.mv_cfg = {k: mv.config(lw[k].shape[0], lw[k].shape[1], form, sms)
                       for k, form in (("qkv", "plain"), ("o", "split"), ("gu", "gated"), ("d", "split"))}
        shape = lambda k, form: mv.out_shape(B, lw[k].shape[0], form, self.mv_cfg[k]["split"])   # noqa: E731
        self.qkv_buf = torch.empty(shape("qkv", "plain"), dtype=dt, device=dev)
        self.act_buf = torch.empty(shape("gu", "gated"), dtype=dt, device=dev)
        self.o_parts = torch.empty(shape("o", "split"), dtype=torch.float32, device=dev)
        self.d_parts = torch.empty(shape("d", "split"), dtype=torch.float32, device=dev)

    def _attention(self, i: int, h: torch.Tensor, lw: dict) -> torch.Tensor:
        B, H, HKV, D = self.batch, self.H, self.HKV, self.D
        kc, vc = self.k_cache[i], self.v_cache[i]
        if self.level >= RUNGS.index("rope_cache"):     # (the fused QKV matmul from rung concat on)
            if "matvec" in self.fns:
                qkv = self.fns["matvec"](h, lw["qkv"], self.qkv_buf, "plain", **self.mv_cfg["qkv"])
            else:
                qkv = F.linear(h, lw["qkv"])
            self.fns["qk_norm_rope_cache"](qkv, lw["qn"], lw["kn"], self.cos, self.sin, self.pos, self.q_buf,
                                           kc, vc, self.eps, H, HKV)
            q = self.q_buf
        else:
            if self.level >= 1:
                q, k, v = F.linear(h, lw["qkv"]).split([H * D, HKV * D, HKV * D], -1)
            else:
                q, k, v = F.linear(h, lw["q"]), F.linear(h, lw["k"]), F.linear(h, lw["v"])
            # the position's cos/sin gathered on the device (no host read of pos: the graph replays it)
            cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
            q, k = self.fns["norm_rope"](q.reshape(B, H, D), k.reshape(B, HKV, D), lw["qn"], lw["kn"], cos, sin,
                                         self.eps)
            kc.index_copy_(2, self.pos, k[:, :, None])
            vc.index_copy_(2, self.pos, v.reshape(B, HKV, 1, D))
        if self.level >= RUNGS.index("decode_attn"):
            self.fns["decode_attention"](q, kc, vc, self.pos, self.attn_buf, self.scale)
            o = self.attn_buf
        else:
            mask = (self.positions <= self.pos)[None, None, None, :]
            with self._sdpa():
                o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=True)
        if "matvec" in self.fns:      # float32 partial sums over K: add_rms_parts sums them
            return self.fns["matvec"](o.reshape(B, H * D), lw["o"], self.o_parts, "split", **self.mv_cfg["o"])
        return F.linear(o.reshape(B, H * D), lw["o"])

    def _sdpa(self):
        import contextlib
        if self.sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.sdpa_backend]))

    def _mlp(self, h: torch.Tensor, lw: dict) -> torch.Tensor:
        if "matvec" in self.fns:
            a = self.fns["matvec"](h, lw["gu"], self.act_buf, "gated", **self.mv_cfg["gu"])
            return self.fns["matvec"](a, lw["d"], self.d_parts, "split", **self.mv_cfg["d"])
        if self.level >= 1:
            a = self.fns["silu_mul"](F.linear(h, lw["gu"]))
        else:
            a = F.silu(F.linear(h, lw["g"])) * F.linear(h, lw["u"])
        return F.linear(a, lw["d"])

    def _step(self, sample: bool) -> None:
        """One decode step on the static buffers: token ``tok`` at position ``pos`` in, the next
        token into ``tok``, ``pos`` advanced (so that replays chain without the host)."""
        fns, eps = self.fns, self.eps
        x = F.embedding(self.tok, self.w.embed)
        res = None
        for i, lw in enumerate(self.w.layers):
            if res is None:
                h, res = fns["rms"](x, lw["ln1"], eps), x
            else:
                h, res = fns["add_rms"](x, res, lw["ln1"], eps)
            a = self._attention(i, h, lw)
            h, res = fns["add_rms"](a, res, lw["ln2"], eps)
            x = self._mlp(h, lw)
        h, _ = fns["add_rms"](x, res, self.w.norm, eps)
        torch.mm(h, self.w.head.t(), out=self.logits)
        if sample:
            self.noise.exponential_()
        nxt = fns["sample"](self.logits, self.noise, self.cfg.temperature, self.cfg.top_p)
        self.tok.copy_(nxt)
        self.pos.add_(1)
        self.tokens.index_copy_(1, self.pos, self.tok[:, None])   # the reply, by position

    def _runner(self, sample: bool):
        """The step as one callable: a CUDA graph replay on a GPU (captured on first use, after a
        warm-up run that also compiles), the eager step elsewhere."""
        if not self.use_graph:
            return lambda: self._step(sample)
        if sample not in self.graphs:
            # the warm-up and the capture write the cache at the current position, which the first
            # real step writes again: only tok and pos need putting back
            tok, pos = self.tok.clone(), self.pos.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):     # compile and allocate outside the capture
                    self._step(sample)
                    self.tok.copy_(tok)
                    self.pos.copy_(pos)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._step(sample)
            self.tok.copy_(tok)
            self.pos.copy_(pos)
            self.graphs[sample] = g
        return self.graphs[sample].replay

    @property
    def last_decode_ms(self) -> float | None:
        """Milliseconds of the last call's decode steps (the replays, prefill excluded) from CUDA
        events; None on a CPU."""
        ev = getattr(self, "_events", None)
        if not ev:
            return None
        ev[1].synchronize()
        return ev[0].elapsed_time(ev[1])

    @torch.no_grad()
    def prefill(self, rows: torch.Tensor) -> torch.Tensor:
        """The model's own forward over the prompts [B, L] (LoRA unmerged), its K and V copied into
        the static cache; returns the last position's logits [B, V]."""
        from transformers import DynamicCache
        cache = DynamicCache()
        out = self.model(input_ids=rows, past_key_values=cache, use_cache=True, logits_to_keep=1)
        L = rows.shape[1]
        for i in range(len(self.w.layers)):
            k, v = _layer_kv(out.past_key_values, i)
            self.k_cache[i, :, :, :L].copy_(k)
            self.v_cache[i, :, :, :L].copy_(v)
        return out.logits[:, -1, :]

    @torch.no_grad()
    def __call__(self, prompts: torch.Tensor, *, greedy: bool = False, new_tokens: int | None = None,
                 keep_logits: list | None = None) -> torch.Tensor:
        cfg = self.cfg
        rows, T = static_rows(prompts, cfg, new_tokens, greedy, self.batch, self.max_len, "decoder")
        P, L = prompts.shape
        was = self.model.training
        self.model.eval()
        try:
            self.w.refresh()
            self.k_cache.zero_()
            self.v_cache.zero_()
            logits = self.prefill(rows)
            noise = self.noise.fill_(1.0) if greedy else self.noise.exponential_()
            first = sample_top_p(logits, noise, cfg.temperature, cfg.top_p)
            if keep_logits is not None:
                keep_logits.append(logits.float().cpu().clone())
            step = self._runner(not greedy)
            if greedy:
                self.noise.fill_(1.0)
            self.tok.copy_(first)
            self.pos.fill_(L)
            self.tokens[:, L] = first
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else None
            if ev:
                ev[0].record()
            for _ in range(1, T):      # replays only: each writes its token into ``tokens`` itself
                step()
                if keep_logits is not None:
                    keep_logits.append(self.logits.float().cpu().clone())
            if ev:
                ev[1].record()
            out = self.tokens[:, L:L + T].clone()
            self._events = ev
        finally:
            self.model.train(was)
        return out.reshape(P, cfg.replies, T)


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's keys and values [B, HKV, L, D] from a Hugging Face cache (transformers 5 keeps
    them per layer object; older versions in lists)."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def greedy_logits_rows(kept: list[torch.Tensor], P: int, N: int) -> torch.Tensor:
    """Each prompt's first reply's logits [P, T, V] from the per-step [B, V] logits ``kept`` (rows
    of a prompt adjacent, as ``repeat_interleave`` lays them out)."""
    steps = torch.stack(kept, dim=1)          # [B, T, V]
    return steps[::N][:P]

