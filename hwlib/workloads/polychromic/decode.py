"""Generating the bonus's P x N replies, five ways (notebook 14's ladder a-d, then the decode ladder's
fused rungs), all returning the new
tokens as a [P, N, T] tensor on the device:

==================  ===============================================================================
``seed``  (a)       one ``generate`` per reply, the model in train mode with gradient checkpointing
                    on: Hugging Face then turns the KV cache off and every new token recomputes the
                    whole sequence
``eval_cache`` (b)  the same loop in eval mode: the KV cache is on
``batched`` (c)     one ``generate`` for all prompts with ``num_return_sequences=N``
``static_hf`` (d)   (c) with Hugging Face's static KV cache, which on a GPU compiles the decode
                    forward (torch.compile, mode "reduce-overhead": CUDA graphs)
``static_own`` (d)  the lab's own decode loop: a static cache, and one compiled CUDA-graph step that
                    runs the model and samples (temperature, top-p) without leaving the graph
``fused`` (e)       ``fused_decode.FusedDecoder`` at one of its rungs: the decode step rewritten
                    (``hwlib.studies.trainer_cycle`` times the trainer's cycle with it)
==================  ===============================================================================

Prompts all have ``prompt_len`` tokens (no padding), and no reply stops early (no end-of-sequence
token): every way generates exactly P N T tokens, so their times compare the same work. ``greedy``
replaces sampling by argmax for the semantics check (the same tokens from every way).
"""

from __future__ import annotations

import contextlib

import torch

from .config import PolyConfig, check_sampling

WAYS = ("seed", "eval_cache", "batched", "static_hf", "static_own", "fused")


def check_prompts(prompts: torch.Tensor, cfg: PolyConfig, new_tokens: int) -> None:
    """[P, L] integer ids with P >= 1 and L + new_tokens within the context, or a ValueError naming
    the argument."""
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"prompts must be an integer tensor [P, L], got "
                         f"{getattr(prompts, 'dtype', type(prompts).__name__)} {tuple(getattr(prompts, 'shape', ()))}")
    if prompts.shape[0] < 1:
        raise ValueError("prompts: P = 0 prompts; give at least one")
    if prompts.shape[1] < 1:
        raise ValueError("prompts: empty prompts (L = 0)")
    if prompts.shape[1] + new_tokens > cfg.max_positions:
        raise ValueError(f"prompts: a prompt of {prompts.shape[1]} tokens plus {new_tokens} new tokens is longer than "
                         f"the context ({cfg.max_positions})")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")


def _kwargs(cfg: PolyConfig, greedy: bool, new_tokens: int) -> dict:
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=None, eos_token_id=None, pad_token_id=0)
    if greedy:
        return {**kw, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    check_sampling(cfg.temperature, cfg.top_p, do_sample=True)
    return {**kw, "do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}


@contextlib.contextmanager
def mode(model, train: bool):
    """The model in train or eval mode inside, back to what it was after."""
    was = model.training
    model.train(train)
    try:
        yield
    finally:
        model.train(was)


def _run(pm, x: torch.Tensor, kw: dict, logits: list | None, rows) -> torch.Tensor:
    """One generate call; with ``logits`` (a list) the raw logits of ``rows`` are appended to it as
    float32 [T, V] CPU tensors, one per row."""
    if logits is None:
        return pm.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
    out = pm.generate(input_ids=x, attention_mask=torch.ones_like(x), output_logits=True,
                      return_dict_in_generate=True, **kw)
    steps = torch.stack(out.logits, dim=1)          # [B, T, V]
    logits.extend(steps[r].float().cpu() for r in rows)
    return out.sequences


def generate_per_reply(pm, prompts: torch.Tensor, cfg: PolyConfig, *, train: bool, greedy: bool = False,
                       new_tokens: int | None = None, hf_default: bool = False,
                       logits: list | None = None) -> torch.Tensor:
    """(a) with ``train=True``, (b) with ``train=False``: one generate call per reply. ``hf_default``
    (train mode only) leaves ``use_cache`` to Hugging Face, for the context check. ``logits``: a list
    that receives each prompt's first reply's raw logits [T, V]."""
    T = new_tokens or cfg.new_tokens
    check_prompts(prompts, cfg, T)
    kw = _kwargs(cfg, greedy, T)
    if train and not hf_default:
        # The cache off, as the seed's trainer ran: every token recomputes the whole sequence. Left to
        # itself, transformers 5 keeps feeding one token per step while its checkpointed layers drop
        # the cache, so the replies lose their context (``train_mode_context_check`` measures it).
        kw["use_cache"] = False
    L = prompts.shape[1]
    out = torch.empty(prompts.shape[0], cfg.replies, T, dtype=torch.long, device=prompts.device)
    with mode(pm, train):
        for p in range(prompts.shape[0]):
            x = prompts[p:p + 1]
            for i in range(cfg.replies):
                out[p, i] = _run(pm, x, kw, logits if i == 0 else None, [0])[0, L:]
    return out


def generate_batched(pm, prompts: torch.Tensor, cfg: PolyConfig, *, static: bool = False, greedy: bool = False,
                     new_tokens: int | None = None, logits: list | None = None) -> torch.Tensor:
    """(c), or (d) with Hugging Face's static cache (``static``): one generate call, eval mode.
    ``logits``: a list that receives each prompt's first reply's raw logits [T, V]."""
    T = new_tokens or cfg.new_tokens
    check_prompts(prompts, cfg, T)
    kw = _kwargs(cfg, greedy, T)
    if static:
        kw["cache_implementation"] = "static"
    P, L = prompts.shape
    with mode(pm, False):
        if greedy:   # generate refuses num_return_sequences > 1 without sampling: the same rows by hand
            x = prompts.repeat_interleave(cfg.replies, dim=0)
            seq = _run(pm, x, kw, logits, range(0, x.shape[0], cfg.replies))
        else:
            seq = pm.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                              num_return_sequences=cfg.replies, **kw)
    return seq[:, L:].reshape(P, cfg.replies, T)     # each prompt's N rows in a row, as generate orders them


def sample_top_p(logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: temperature, then the smallest set of tokens whose
    probability reaches ``top_p``, then one draw by the exponential race, argmax(p_i / E_i) with
    E_i ~ Exp(1) (``noise``), which picks i with probability p_i. ``noise`` of ones is greedy decoding
    (argmax of the logits, which top-p always keeps)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sp, idx = probs.sort(dim=-1, descending=True)
    drop = (sp.cumsum(-1) - sp) >= top_p          # the mass before a token already reached top_p
    sp = sp.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, idx, sp)
    return (kept / noise).argmax(dim=-1)


def static_rows(prompts: torch.Tensor, cfg, new_tokens: int | None, greedy: bool, batch: int, max_len: int,
                what: str) -> tuple[torch.Tensor, int]:
    """The checked rows a static-cache decoder generates from (each prompt ``cfg.replies`` times) and the
    number of new tokens; a clear error when they do not fit its ``batch`` rows of ``max_len``."""
    T = new_tokens or cfg.new_tokens
    check_prompts(prompts, cfg, T)
    if not greedy:
        check_sampling(cfg.temperature, cfg.top_p)
    L = prompts.shape[1]
    rows = prompts.repeat_interleave(cfg.replies, dim=0)
    if rows.shape[0] != batch or L + T > max_len:
        raise ValueError(f"prompts: {rows.shape[0]} rows of {L} + {T} tokens do not fit this {what}'s "
                         f"{batch} rows of {max_len}")
    return rows, T


class OwnDecodeLoop:
    """The lab's decode loop for B = P N rows: an eager prefill into a Hugging Face ``StaticCache``,
    then one step per token (model forward on the last token at ``cache_position``, then sampling),
    compiled with mode "reduce-overhead" on a GPU, so each step replays one CUDA graph; the cache and
    the noise buffer keep their addresses from call to call, so later calls of the same shape replay
    without recompiling. On a CPU the same loop runs eagerly."""

    def __init__(self, pm, cfg: PolyConfig, batch: int, max_len: int, device: torch.device, compile: bool = True):
        from transformers import StaticCache
        self.model = pm.get_base_model()
        self.cfg, self.batch, self.max_len, self.device = cfg, batch, max_len, torch.device(device)
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        self.noise = torch.ones(batch, cfg.vocab, device=self.device, dtype=torch.float32)
        self.compiled = compile and self.device.type == "cuda"
        self.step_fn = (torch.compile(self._step, mode="reduce-overhead", fullgraph=False, dynamic=False)
                        if self.compiled else self._step)

    def _step(self, tok: torch.Tensor, pos: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tok, cache_position=pos, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1, :]
        return sample_top_p(logits, noise, self.cfg.temperature, self.cfg.top_p)[:, None]

    @torch.no_grad()
    def __call__(self, prompts: torch.Tensor, *, greedy: bool = False, new_tokens: int | None = None) -> torch.Tensor:
        cfg = self.cfg
        rows, T = static_rows(prompts, cfg, new_tokens, greedy, self.batch, self.max_len, "loop")
        P, L = prompts.shape
        was = self.model.training
        self.model.eval()
        try:
            self.cache.reset()
            out = torch.empty(self.batch, T, dtype=torch.long, device=rows.device)

            def draw():
                return self.noise.fill_(1.0) if greedy else self.noise.exponential_()
            logits = self.model(input_ids=rows, cache_position=torch.arange(L, device=rows.device),
                                past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
            tok = sample_top_p(logits, draw(), cfg.temperature, cfg.top_p)[:, None]
            out[:, :1] = tok
            for t in range(1, T):
                pos = torch.full((1,), L + t - 1, dtype=torch.long, device=rows.device)
                if self.compiled:
                    torch.compiler.cudagraph_mark_step_begin()
                tok = self.step_fn(tok, pos, draw())
                out[:, t:t + 1] = tok
        finally:
            self.model.train(was)
        return out.reshape(P, cfg.replies, T)


def generate(way: str, pm, prompts: torch.Tensor, cfg: PolyConfig, *, greedy: bool = False,
             new_tokens: int | None = None, loop: OwnDecodeLoop | None = None) -> torch.Tensor:
    """The replies [P, N, T] by ``way`` (one of ``WAYS``); ``static_own`` needs its ``loop``
    (``OwnDecodeLoop``), ``fused`` a ``fused_decode.FusedDecoder`` (any callable of the same signature)."""
    if way == "seed":
        return generate_per_reply(pm, prompts, cfg, train=True, greedy=greedy, new_tokens=new_tokens)
    if way == "eval_cache":
        return generate_per_reply(pm, prompts, cfg, train=False, greedy=greedy, new_tokens=new_tokens)
    if way == "batched":
        return generate_batched(pm, prompts, cfg, greedy=greedy, new_tokens=new_tokens)
    if way == "static_hf":
        return generate_batched(pm, prompts, cfg, static=True, greedy=greedy, new_tokens=new_tokens)
    if way in ("static_own", "fused"):
        if loop is None:
            raise ValueError(f"loop: way {way!r} needs its decode loop "
                             f"({'an OwnDecodeLoop' if way == 'static_own' else 'a fused_decode.FusedDecoder'})")
        return loop(prompts, greedy=greedy, new_tokens=new_tokens)
    from ...device import ChoiceError
    raise ChoiceError("way", way, WAYS)
