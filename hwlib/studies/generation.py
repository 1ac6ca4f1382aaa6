"""Notebook 14's measurements: the Polychromic trainer's generation ladder, its time shares over a
5-step cycle, decode bandwidth, the semantics checks, the gradient demonstration and the diversity
score study. Each function returns rows; ``*_records`` turn rows into records (workload
"polychromic", the ladder rung as ``step``, x-values in fields).

A cycle is what the seed's trainer repeats: ``every`` trainer steps, the last with the diversity
bonus. Every phase is timed by ``hwlib.bench.wall_s`` (a sync before and after): the phases run one
after another and the bonus's phases end in host work (``.tolist()``, ``.item()``), so device time
alone would miss what the seed's loop waits for. The cycle's first ``every - 1`` trainer steps come
before any bonus, so no rung changes them: ``prefix`` runs them once from the start state, times
them and keeps the state after them; each rung's cycles start from that state (``Trainer.restore``)
with the bonus and the step it feeds, and count the prefix's time as the cycle's first steps. The
trainer losses of every rung must equal the first rung's: the ladder changes how replies are
generated, never the training (the step after the bonus is where a rung that disturbed the model
would show).

Decode bandwidth: bytes one decode step must move (``fused_decode.step_bytes``: every weight once,
the input embedding only for its rows, the KV cache of all rows at each step's length where a cache
is used, the residual stream and the logits), averaged over the generation, over the time of one
decode step (generation time / forward calls), with the floor those bytes take at the copy
ceiling. The seed's way recomputes the whole sequence per token: its bytes are counted as what a
step must move at minimum (no cache).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from .. import bench
from ..ops import diversity as dv
from ..precision import tf32_mode
from ..results import make_record
from ..workloads import polychromic as pc
from ..workloads.polychromic import fused_decode

WORKLOAD = "polychromic"
RUNGS = {  # step name -> (way, what changes)
    "14a_seed_way": ("seed", "one generate per reply, train mode, checkpointing on (no KV cache); per-prompt "
                             "encoding, pairwise matrix, .item()"),
    "14b_eval_kv_cache": ("eval_cache", "eval mode: the KV cache is on"),
    "14c_batched": ("batched", "one generate for all prompts (num_return_sequences=N), one encoder call, "
                               "the closed-form score, one sync"),
    "14d_static_hf": ("static_hf", "Hugging Face static KV cache, decode compiled with CUDA graphs"),
    "14d_static_own": ("static_own", "the lab's decode loop: static cache, one CUDA graph per step, sampling "
                                     "inside the graph"),
}
# The trainer with the decode ladder's decoder (``fused_step``): "14e_fused_top_p" and so on.
FUSED = "14e_fused"
# Then the training step compiled (``Trainer.compile_training``), with the best decoder. Its losses move
# by compiled rounding, not by the replies: they are held to the bf16 loss-curve tolerance the
# ladder's compiled steps use, not to QUALITY_TOL.
COMPILED_TRAIN = "14f_compiled_train"
COMPILED_TRAIN_TOL = 1e-2
PER_PROMPT = ("seed", "eval_cache")     # the seed's bonus: per-prompt round trip, encoding and score
QUALITY_TOL = 1e-6                      # relative; the training path is identical on every rung


def bonus(tr: pc.Trainer, way: str, loop=None) -> tuple[float, dict, torch.Tensor]:
    """One diversity bonus by ``way`` (``loop``: way "fused"'s decoder): (score as a float, seconds per
    phase, replies)."""
    dev = tr.device
    cfg = tr.cfg
    t = {p: 0.0 for p in pc.PHASES if p != "training"}
    t["generation"], replies = bench.wall_s(lambda: tr.generate(way, loop=loop), dev)
    if way in PER_PROMPT:
        scores = []
        for p in range(cfg.prompts):
            s, (ids, mask) = bench.wall_s(lambda: tr.round_trip(replies[p]), dev)
            t["round_trip"] += s
            s, e = bench.wall_s(lambda: tr.encode(ids, mask), dev)
            t["encoding"] += s
            s, v = bench.wall_s(lambda: dv.seed_scores(e[None])[0], dev)
            t["score"] += s
            scores.append(v)
        return sum(scores) / len(scores), t, replies
    t["round_trip"], (ids, mask) = bench.wall_s(lambda: tr.round_trip(replies), dev)
    t["encoding"], e = bench.wall_s(lambda: tr.encode(ids, mask).view(cfg.prompts, cfg.replies, -1), dev)
    t["score"], v = bench.wall_s(lambda: dv.closed_form_score(e).mean().item(), dev)
    return v, t, replies


def prefix(tr: pc.Trainer) -> dict:
    """The cycle's first ``every - 1`` trainer steps from the start state (``Trainer.reset``), which
    no rung changes: their seconds, their losses and the state after them (``Trainer.snapshot``)."""
    tr.reset()
    seconds, losses = 0.0, []
    for k in range(tr.cfg.every - 1):
        s, ce = bench.wall_s(lambda: tr.train_step(k), tr.device)
        seconds += s
        losses.append(float(ce))
    return {"seconds": seconds, "losses": losses, "state": tr.snapshot()}


def cycle(tr: pc.Trainer, way: str, pre: dict, loop=None) -> dict:
    """One cycle: the ``prefix`` ``pre`` (its state restored, its time counted), then the bonus by
    ``way`` and the trainer step it feeds. Returns seconds per phase, the cycle's trainer losses and
    the bonus's score."""
    tr.restore(pre["state"])
    out = {p: 0.0 for p in pc.PHASES}
    score, t, _ = bonus(tr, way, loop)
    for p, s in t.items():
        out[p] += s
    s, ce = bench.wall_s(lambda: tr.train_step(tr.cfg.every - 1, score), tr.device)
    out["training"] = pre["seconds"] + s
    return {"seconds": out, "losses": pre["losses"] + [float(ce)], "score": score}


def warm_up(tr: pc.Trainer, way: str, loop=None) -> float:
    """An untimed generation at every shape the timed ones meet: one reply of one prompt at full
    length for the per-reply ways (each of their calls generates one row), the bonus's whole
    generation for the batched ways (the static ones compile there). A two-token warm-up left
    one-time host costs in the first timed cycle: on an H100 the batched way's first 100-token
    generation took 8.7 s against 3.6-4.2 s for each of the five after it, its CPU time equal to its
    wall time. Returns the warm-up's wall seconds."""
    if way in PER_PROMPT:
        one = dataclasses.replace(tr.cfg, replies=1)
        s, _ = bench.wall_s(lambda: pc.decode.generate_per_reply(tr.lm, tr.prompts[:1], one, train=way == "seed"),
                            tr.device)
        return s
    s, _ = bench.wall_s(lambda: tr.generate(way, loop=loop), tr.device)
    return s


def decode_step_bytes(cfg: pc.PolyConfig, way: str) -> float:
    """Bytes a decode step of ``way`` must move, averaged over the bonus's generation
    (``fused_decode.generation_step_bytes``): one row per forward call for the per-reply ways, all
    P N rows for the batched ones; the seed's way recomputes the whole sequence per token, and is
    counted as what a step must read at minimum: the weights and activations, no cache."""
    rows = 1 if way in PER_PROMPT else cfg.prompts * cfg.replies
    b = fused_decode.generation_step_bytes(cfg, rows, cfg.prompt_len, max(cfg.new_tokens, 2))
    return b["total"] if way != "seed" else b["weights"] + b["activations"]


def measure_rung(tr: pc.Trainer, step: str, cycles: int, *, pre: dict | None = None,
                 copy_gbps: float | None = None, base_losses: list | None = None,
                 decoder: str | None = None) -> dict:
    """``cycles`` cycles of a rung after its warm-up, each from the ``prefix`` ``pre`` (None: run it
    here); one row (``rung_row``). ``step``: a rung of ``RUNGS``, or ``fused_step(rung)`` for the trainer
    with a ``fused_decode.FusedDecoder`` at that rung, or ``COMPILED_TRAIN`` (its decoder at rung
    ``decoder``, default top_p). A rung that fails (e.g. compilation) returns status 'failed' with the
    reason."""
    row = _row(step, cycles)
    if decoder is not None:
        if row.get("train") != "compiled":
            raise ValueError(f"decoder: only {COMPILED_TRAIN} takes a decoder rung; {step} names its own")
        fused_step(decoder)      # a known rung, or a clear error
        row["fused_rung"] = decoder
    try:
        loop = None
        if row["way"] == "fused":
            cfg = tr.cfg
            loop = fused_decode.FusedDecoder(tr.lm, cfg, cfg.prompts * cfg.replies, cfg.prompt_len + cfg.new_tokens,
                                             tr.device, rung=row["fused_rung"])
        compiled = row.get("train") == "compiled"
        if compiled:      # its own prefix: the steps before the bonus train compiled too
            from ..ladder.session import cpu_compile_backend
            tr.compile_training(True, "inductor" if tr.device.type == "cuda" else cpu_compile_backend())
            pre = None
        try:
            warm = warm_up(tr, row["way"], loop)
            if compiled:
                warm += bench.wall_s(lambda: tr.train_step(0), tr.device)[0]    # the compile; prefix resets
            pre = pre or prefix(tr)
            runs = [cycle(tr, row["way"], pre, loop) for _ in range(cycles)]
        finally:
            tr.compile_training(False)
    except Exception as e:     # a rung that cannot run here is a row with its reason, not a crash
        return _failed(row, e)
    return rung_row(tr, row, runs, warm, copy_gbps=copy_gbps, base_losses=base_losses)


def fused_step(rung: str) -> str:
    """The trainer-cycle rung that generates with ``fused_decode.FusedDecoder`` at ``rung``."""
    if rung not in fused_decode.ALL_RUNGS:
        from ..device import ChoiceError
        raise ChoiceError("rung", rung, fused_decode.ALL_RUNGS)
    return f"{FUSED}_{rung}"


def _row(step: str, cycles: int) -> dict:
    if step == COMPILED_TRAIN:
        return {"step": step, "way": "fused", "fused_rung": "top_p", "train": "compiled", "cycles": cycles,
                "status": "ok", "reason": None, "quality_tol": COMPILED_TRAIN_TOL,
                "change": "the LoRA training step through torch.compile (replies by the fused decoder's top_p rung)"}
    if step.startswith(FUSED + "_"):
        rung = step[len(FUSED) + 1:]
        fused_step(rung)     # a known rung, or a clear error
        return {"step": step, "way": "fused", "fused_rung": rung, "change": fused_decode.CHANGES[rung],
                "cycles": cycles, "status": "ok", "reason": None}
    if step not in RUNGS:
        from ..device import ChoiceError
        raise ChoiceError("step", step, (*RUNGS, f"{FUSED}_<rung>", COMPILED_TRAIN))
    way, change = RUNGS[step]
    return {"step": step, "way": way, "change": change, "cycles": cycles, "status": "ok", "reason": None}


def _failed(row: dict, e: Exception) -> dict:
    if isinstance(e, (KeyboardInterrupt, ValueError)):
        raise e
    row.update(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    return row


def rung_row(tr: pc.Trainer, row: dict, runs: list[dict], warmup_s: float, *, copy_gbps: float | None = None,
             base_losses: list | None = None) -> dict:
    """``row`` completed from its ``cycle`` runs: the median cycle time (p20-p80 across cycles), the
    phases and shares of the cycle nearest that median, the generation rate and decode bandwidth
    (median generation time), the warm-up time and the loss check against ``base_losses`` (None:
    the first cycle's)."""
    cfg, way = tr.cfg, row["way"]
    cycles = len(runs)
    tot = [sum(r["seconds"].values()) for r in runs]
    mid = statistics.median(tot)
    med = min(range(cycles), key=lambda i: abs(tot[i] - mid))
    sec = runs[med]["seconds"]
    total = tot[med]
    overhead = total - sec["training"]
    row.update({"cycles": cycles, "warmup_s": warmup_s,
                "ms_per_cycle": 1e3 * mid, "ms_p20": 1e3 * bench.quantile(tot, 0.2),
                "ms_p80": 1e3 * bench.quantile(tot, 0.8), "ms_per_trainer_step": 1e3 * mid / cfg.every,
                **{f"{p}_ms": 1e3 * sec[p] for p in pc.PHASES},
                **{f"share_{p}": sec[p] / total for p in pc.PHASES},
                "share_generation_of_overhead": sec["generation"] / overhead if overhead else None,
                "share_diversity_of_overhead": (sec["round_trip"] + sec["encoding"] + sec["score"]) / overhead
                if overhead else None,
                "score": runs[med]["score"], "losses": runs[med]["losses"]})
    gen = statistics.median(r["seconds"]["generation"] for r in runs)
    n_tok = cfg.prompts * cfg.replies * cfg.new_tokens
    row["gen_tokens_per_s"] = n_tok / gen
    calls = n_tok if way in PER_PROMPT else cfg.new_tokens   # forward calls, one row each or all rows at once
    rows_per_call = 1 if way in PER_PROMPT else cfg.prompts * cfg.replies
    step_s = gen / calls
    nbytes = decode_step_bytes(cfg, way)
    bw = fused_decode.bandwidth(nbytes, 1e3 * step_s, copy_gbps)
    row.update({"decode_ms_per_step": 1e3 * step_s, "decode_bytes_per_step": nbytes, "decode_gbps": bw["gbps"],
                "decode_share_of_copy": bw["share_of_copy"], "decode_floor_ms": bw["floor_ms"]})
    ref = base_losses if base_losses is not None else runs[0]["losses"]
    row["quality_loss_max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for r in runs
                                           for a, b in zip(r["losses"], ref))
    return row


def attention_rows(tr: pc.Trainer, step: str = "14c_batched", pairs: int = 2, pre: dict | None = None) -> list[dict]:
    """One rung's cycle with eager (matmul + softmax) attention against SDPA, Hugging Face's default
    (flash kernels on an H100): what the seed's FlashAttention tier could change in this trainer.
    Each arm is warmed up and gets its prefix (eager trains through its own attention there; SDPA
    uses ``pre`` where given), then the arms' cycles alternate, ``pairs`` of each, so that a drift of
    the machine falls on both arms alike and each arm has a spread across its cycles."""
    if not isinstance(pairs, int) or isinstance(pairs, bool) or pairs < 1:
        raise ValueError(f"pairs must be a positive int, got {pairs!r}")
    base = tr.lm.get_base_model()
    was = base.config._attn_implementation
    arms = ("eager", "sdpa")
    rows = {a: {"attn": a, **_row(step, pairs)} for a in arms}
    warm, pres, runs = {}, {}, {a: [] for a in arms}
    try:
        for a in arms:
            base.set_attn_implementation(a)
            try:
                warm[a] = warm_up(tr, rows[a]["way"])
                pres[a] = pre if (pre is not None and a == was) else prefix(tr)
            except Exception as e:
                _failed(rows[a], e)
        live = [a for a in arms if rows[a]["status"] == "ok"]
        for _ in range(pairs):
            for a in list(live):
                base.set_attn_implementation(a)
                try:
                    runs[a].append(cycle(tr, rows[a]["way"], pres[a]))
                except Exception as e:
                    _failed(rows[a], e)
                    live.remove(a)
    finally:
        base.set_attn_implementation(was)
    return [rung_row(tr, rows[a], runs[a], warm[a]) if rows[a]["status"] == "ok" else rows[a] for a in arms]


def greedy_rows(tr: pc.Trainer, steps: list[str], new_tokens: int) -> list[dict]:
    """Greedy replies by each rung's way against the first rung's: the share of positions inside
    the common prefix (1.0: the same tokens). Per-reply ways run one reply per prompt (greedy
    replies of a prompt are all the same). Run first, it also times each way's first call: for the
    static-cache ways that includes compiling and capturing the decode step (``first_call_s``)."""
    base, base_logits, rows = None, None, []
    for step in steps:
        way = RUNGS[step][0]
        lg: list | None = [] if way != "static_own" else None     # the own loop keeps no logits
        try:
            if way in PER_PROMPT:
                one = dataclasses.replace(tr.cfg, replies=1)
                secs, g = bench.wall_s(lambda: pc.decode.generate_per_reply(
                    tr.lm, tr.prompts, one, train=way == "seed", greedy=True, new_tokens=new_tokens, logits=lg),
                    tr.device)
                g = g.expand(-1, tr.cfg.replies, -1)
            elif way == "static_own":   # the compiled ways at their full shape: this first call compiles
                secs, g = bench.wall_s(lambda: tr.generate(way, greedy=True), tr.device)
                g = g[..., :new_tokens]
            else:
                full = way == "static_hf"
                secs, g = bench.wall_s(lambda: pc.decode.generate_batched(
                    tr.lm, tr.prompts, tr.cfg, static=full, greedy=True, new_tokens=None if full else new_tokens,
                    logits=lg), tr.device)
                g = g[..., :new_tokens]
        except Exception as e:
            if isinstance(e, (KeyboardInterrupt, ValueError)):
                raise
            rows.append({"step": step, "agreement": None, "status": "failed", "reason": f"{type(e).__name__}: {e}"[:300]})
            continue
        g = g.cpu()
        logits = torch.stack([x[:new_tokens] for x in lg]) if lg else None     # [P, T, V]
        if base is None:
            base, base_logits = g, logits
        same = (g == base).long().cumprod(-1)          # 1 while every earlier position agreed
        diff, ties = None, divergence_ties(same[:, 0], logits, base_logits)
        if logits is not None and base_logits is not None:
            # raw logits of each prompt's first reply against the seed's way's, inside the common prefix
            # (the positions where both decoded the same context), relative to the largest |logit|
            inside = same[:, 0].bool()
            d = (logits - base_logits).abs().amax(-1)[inside]
            diff = float(d.max() / base_logits.abs().max()) if d.numel() else None
        rows.append({"step": step, "agreement": float(same.float().mean()), "identical": bool(torch.equal(g, base)),
                     "max_rel_logit_diff": diff, **ties, "first_call_s": secs, "status": "ok", "reason": None,
                     "_same": same[:, 0]})
    # A way that keeps no logits (the own loop) is judged at the reference's logits with the largest
    # noise the other bf16 ways showed: the same model and dtype, other kernels.
    noise = max((r["logit_noise"] for r in rows if r.get("logit_noise") is not None), default=None)
    for r in rows:
        same = r.pop("_same", None)
        if r.get("divergences") and r["divergences_at_ties"] is None and noise is not None and base_logits is not None:
            r.update(divergence_ties(same, None, base_logits, noise=noise))
    return rows


def divergence_ties(same: torch.Tensor, logits: torch.Tensor | None, base_logits: torch.Tensor | None,
                    noise: float | None = None) -> dict:
    """Whether each reply that left the reference's greedy tokens did so at a rounding tie.

    ``same`` [P, T] is 1 while every earlier position agreed. At a reply's first differing position
    both ways decoded the same context, so their logits there differ by numerics alone. The
    divergence is a tie when the reference's own top-two logits at that position are closer than
    ``logit_noise``: the largest logit difference between the two ways over all positions decoded
    from a common context. In bf16 with random weights (flat logits) such ties are common, and one
    flipped argmax changes every later token; a divergence at a clear margin is a real difference.
    A way without logits of its own can be judged against a ``noise`` measured elsewhere; with
    neither, nothing can be said: ``divergences_at_ties`` is None."""
    diverged = [(p, int((same[p] == 0).nonzero()[0])) for p in range(same.shape[0]) if not bool(same[p].all())]
    out = {"divergences": len(diverged), "divergences_at_ties": None, "logit_noise": None}
    if base_logits is None or (logits is None and noise is None):
        return out
    if logits is not None:
        shared = torch.cat([torch.ones_like(same[:, :1]), same[:, :-1]], -1).bool()   # same context as the reference
        noise = float((logits - base_logits).abs().amax(-1)[shared].max())
    gaps = [float(base_logits[p, t].float().topk(2).values.diff().abs()) for p, t in diverged]
    out.update(divergences_at_ties=sum(gap <= noise for gap in gaps), logit_noise=noise)
    return out


def train_mode_context_check(tr: pc.Trainer, new_tokens: int) -> dict:
    """What Hugging Face's own ``generate`` does in train mode with checkpointing on when
    ``use_cache`` is left to it: the tokens each decode forward sees (the whole sequence, as the seed
    expected with the cache off, or one token), and greedy agreement with the true uncached way."""
    one = dataclasses.replace(tr.cfg, replies=1)
    seen: list[int] = []
    hook = tr.lm.get_base_model().model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(int(kw["input_ids"].shape[1])), with_kwargs=True)
    try:
        hf = pc.decode.generate_per_reply(tr.lm, tr.prompts, one, train=True, greedy=True, new_tokens=new_tokens,
                                          hf_default=True)
        hf_seen = list(seen)
        seen.clear()
        true = pc.decode.generate_per_reply(tr.lm, tr.prompts, one, train=True, greedy=True, new_tokens=new_tokens)
        true_seen = list(seen)
    finally:
        hook.remove()
    decode_steps = lambda xs: [x for i, x in enumerate(xs) if i % new_tokens]   # noqa: E731  (drop each prefill)
    same = (hf.cpu() == true.cpu()).long().cumprod(-1)
    return {"hf_tokens_per_decode_forward": statistics.mean(decode_steps(hf_seen)) if new_tokens > 1 else None,
            "uncached_tokens_per_decode_forward": statistics.mean(decode_steps(true_seen)) if new_tokens > 1 else None,
            "greedy_agreement_hf_vs_uncached": float(same.float().mean())}


def gradient_demo(tr: pc.Trainer, score: float = 0.5) -> dict:
    """The seed's objective for lam = 0 and lam = 0.3 (and lam = 0 again, for the backward's own
    reproducibility), under the math SDPA backend (deterministic): are the gradients bit-identical?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        g0 = pc.seed_objective_grads(tr, 0.0, score)
        g3 = pc.seed_objective_grads(tr, 0.3, score)
        g0b = pc.seed_objective_grads(tr, 0.0, score)
    diff = lambda a, b: max(float((x - y).abs().max()) for x, y in zip(a, b))   # noqa: E731
    return {"identical": all(torch.equal(a, b) for a, b in zip(g0, g3)), "max_abs_diff": diff(g0, g3),
            "repeat_identical": all(torch.equal(a, b) for a, b in zip(g0, g0b)), "repeat_max_abs_diff": diff(g0, g0b),
            "grad_norm": math.sqrt(sum(float((g.float() ** 2).sum()) for g in g0))}


def pg_cost(tr: pc.Trainer, way: str = "batched") -> dict:
    """What the policy-gradient term adds to a bonus step: its forward and backward over the P N
    sampled replies (wall seconds), and that its gradient is nonzero."""
    replies = tr.generate(way)
    ids, mask = tr.round_trip(replies)
    emb = tr.encode(ids, mask).view(tr.cfg.prompts, tr.cfg.replies, -1)
    for p in tr.params:
        p.grad = None

    def term():
        tr.pg_loss(replies, emb).backward()
    bench.wall_s(term, tr.device)             # warm-up (allocator, kernels)
    for p in tr.params:
        p.grad = None
    s, _ = bench.wall_s(term, tr.device)
    norm = math.sqrt(sum(float((p.grad.float() ** 2).sum()) for p in tr.params if p.grad is not None))
    for p in tr.params:
        p.grad = None
    return {"pg_term_ms": 1e3 * s, "pg_grad_norm": norm}


def pg_check(device, seed: int = 0, tokenizer=None) -> dict:
    """The policy-gradient term on a tiny model (smoke sizes, float32) against the float64 per-reply
    reference: relative error and gradient norm. LoRA's B starts at zero, which would leave A without
    gradient: B is drawn small first so that every LoRA weight is exercised. ``tokenizer``: one of at
    most the tiny model's ``tok_vocab`` ids, else a tiny one is trained (cached)."""
    with tf32_mode(False):   # IEEE float32 matmuls: the comparison is with float64
        cfg = pc.config("smoke")
        if tokenizer is not None and tokenizer.get_vocab_size() > cfg.tok_vocab:
            tokenizer = None
        tr = pc.Trainer(cfg, device, seed, tokenizer=tokenizer)
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for n, p in tr.lm.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
        torch.manual_seed(seed)
        replies = tr.generate("batched")
        ids, mask = tr.round_trip(replies)
        emb = tr.encode(ids, mask).view(tr.cfg.prompts, tr.cfg.replies, -1)
        for p in tr.params:
            p.grad = None
        tr.pg_loss(replies, emb).backward()
        got = [p.grad.detach().double().cpu() for p in tr.params]
        ref = [r.cpu() for r in pc.pg_reference_grads(tr, replies, emb)]
        err = max(float((a - b).abs().max()) for a, b in zip(got, ref)) / max(float(b.abs().max()) for b in ref)
        return {"rel_err": err, "grad_norm": math.sqrt(sum(float((a ** 2).sum()) for a in got)),
                "ref_norm": math.sqrt(sum(float((b ** 2).sum()) for b in ref))}


# --- the diversity score alone --------------------------------------------------------------------

SCORE_IMPLS = ("seed_loop", "pairwise", "closed", "triton")


def _score_fn(impl: str):
    return {"seed_loop": dv.seed_scores, "pairwise": dv.pairwise_score, "closed": dv.closed_form_score,
            "triton": dv.triton_score}[impl]


def unit_embeddings(P: int, N: int, D: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(P, N, D, generator=g), dim=-1).to(device)


def score_check_rows(device, impls: list[str], sizes=((1, 2, 384), (4, 3, 384), (5, 7, 33), (3, 8, 129)),
                     seed: int = 0) -> list[dict]:
    """Each implementation against the float64 pairwise reference on fresh unit vectors (odd sizes)."""
    rows = []
    for k, (P, N, D) in enumerate(sizes):
        e = unit_embeddings(P, N, D, device, seed + k)
        ref = dv.reference_score(e)
        for impl in impls:
            got = torch.as_tensor(_score_fn(impl)(e), dtype=torch.float64).cpu()
            rows.append({"impl": impl, "P": P, "N": N, "D": D, "max_abs_err": float((got - ref).abs().max())})
    return rows


def score_speed_rows(device, impls: list[str], points: list[tuple[int, int]], D: int = 384, iters: int = 50) -> list[dict]:
    """Time per call of each implementation at each (P, N); inputs rotate over sets larger than
    twice a 50 MB L2 where they are large. The seed's per-prompt loop only where P <= 64 (a host
    sync per prompt). Every timed implementation was checked first (``score_check_rows``)."""
    dev = torch.device(device)
    rows = []
    for P, N in points:
        nbytes = P * N * D * 4
        sets = [unit_embeddings(P, N, D, dev, s) for s in range(max(1, min(8, math.ceil(100e6 / nbytes))))]
        for impl in impls:
            if impl == "seed_loop" and P > 64:
                continue
            fn = _score_fn(impl)
            t = bench.time_fn(lambda i: fn(sets[i % len(sets)]), dev, warmup=3, iters=iters if dev.type == "cuda" else 3)
            rows.append({"impl": impl, "P": P, "N": N, "D": D, "ms": t.median_ms, "p20": t.p20_ms, "p80": t.p80_ms,
                         "GB/s": nbytes / (t.median_ms / 1e3) / 1e9})
    return rows


# --- records --------------------------------------------------------------------------------------

RUNG_METRICS = {"ms_per_cycle": "ms", "ms_per_trainer_step": "ms", "gen_tokens_per_s": "tokens/s",
                "share_training": "share", "share_generation": "share", "share_round_trip": "share",
                "share_encoding": "share", "share_score": "share", "share_generation_of_overhead": "share",
                "share_diversity_of_overhead": "share", "decode_ms_per_step": "ms", "decode_gbps": "GB/s",
                "decode_share_of_copy": "share", "decode_floor_ms": "ms", "quality_loss_max_rel_diff": "relative", "warmup_s": "s"}


def rung_records(rows: list[dict], *, notebook: str, profile: str, device: str, params: dict,
                 fields: dict | None = None) -> list[dict]:
    """One record per metric of each rung (step = the rung); a failed rung records its reason."""
    out = []
    for r in rows:
        f = dict(fields or {})
        if "attn" in r:
            f["attn"] = r["attn"]
        for m, unit in RUNG_METRICS.items():
            if "attn" in f and m != "ms_per_cycle":
                continue              # variant rows (attention) record their cycle time only
            v = r.get(m)
            status = r["status"] if r["status"] != "ok" else ("ok" if v is not None else "n/a")
            why = "no copy ceiling in this run (notebook 00)" if m == "decode_share_of_copy" else "not measured"
            reason = r["reason"] if r["status"] != "ok" else (None if v is not None else why)
            extra = {"p20": r.get("ms_p20"), "p80": r.get("ms_p80")} if m == "ms_per_cycle" else {}
            out.append(make_record(notebook=notebook, workload=WORKLOAD, step=r["step"], metric=m, value=v,
                                   unit=unit, status=status, reason=reason, profile=profile, device=device,
                                   fields=f, params={**params, "cycles": r.get("cycles")}, **extra))
    return out


def score_records(rows: list[dict], *, notebook: str, profile: str, device: str) -> list[dict]:
    return [make_record(notebook=notebook, workload=WORKLOAD, step=None, metric="score_ms", value=r["ms"],
                        p20=r["p20"], p80=r["p80"], unit="ms", profile=profile, device=device,
                        fields={"impl": r["impl"], "N": r["N"], "P": r["P"]}, params={"D": r["D"], "gbps": r["GB/s"]})
            for r in rows]


def check_records(values: dict, *, notebook: str, profile: str, device: str) -> list[dict]:
    """Scalar checks (greedy agreement per rung, gradient demonstration, policy-gradient cost)."""
    return [make_record(notebook=notebook, workload=WORKLOAD, step=step, metric=m, value=v, unit=unit,
                        profile=profile, device=device, status="ok" if v is not None else "n/a")
            for (step, m, unit), v in values.items()]


DECODE_TARGETS = {"qwen3_0.6b": 0.5, "qwen3_8b": 0.75}   # share of copy, batch 12, reference H100


def targets(rows: list[dict], decode_rows: list[dict] | None = None, model_size: str | None = None) -> list[dict]:
    """The issues' H100 targets, from the rung rows: step d's generated tokens/s >= 50x the seed's
    way, and step d's decode at >= 50% of the copy ceiling (the better d of the two); with
    ``decode_rows`` (the fused ladder's), its best rung against ``DECODE_TARGETS[model_size]``."""
    by = {r["step"]: r for r in rows if r["status"] == "ok"}
    a = by.get("14a_seed_way")
    ds = [by[s] for s in ("14d_static_hf", "14d_static_own") if s in by]
    out = []
    if a and ds:
        d = max(ds, key=lambda r: r["gen_tokens_per_s"])
        x = d["gen_tokens_per_s"] / a["gen_tokens_per_s"]
        out.append({"target": "step d generated tokens/s >= 50x the seed's way", "value": x, "unit": "x",
                    "measured": f"{d['step']}: {x:.1f}x", "met": x >= 50})
    if ds:
        d = max(ds, key=lambda r: r["decode_gbps"])
        s = d["decode_share_of_copy"]
        out.append({"target": "step d decode >= 50% of the copy bandwidth", "value": s, "unit": "share of copy",
                    "measured": f"{d['step']}: " + (f"{s:.1%}" if s is not None else "n/a (no copy ceiling)"),
                    "met": None if s is None else s >= 0.5})
    fused = [r for r in decode_rows or [] if r.get("status") == "ok" and r.get("decode_gbps")]
    if fused and model_size in DECODE_TARGETS:
        want = DECODE_TARGETS[model_size]
        d = max(fused, key=lambda r: r["decode_gbps"])
        s = d.get("decode_share_of_copy")
        out.append({"target": f"fused decode ({model_size}, batch {d['batch']}) >= {want:.0%} of the copy bandwidth",
                    "value": s, "unit": "share of copy",
                    "measured": f"{d['rung']}: " + (f"{s:.1%}" if s is not None else "n/a (no copy ceiling)"),
                    "met": None if s is None else s >= want})
    return out


def target_records(tgts: list[dict], *, notebook: str, profile: str, device: str) -> list[dict]:
    return [make_record(notebook=notebook, workload=WORKLOAD, step=None, metric="target", value=t["value"],
                        unit=t["unit"], profile=profile, device=device, fields={"target": t["target"]},
                        params={"measured": t["measured"]},
                        status="n/a" if t["met"] is None else "ok" if t["met"] else "failed",
                        reason="not measured in this run" if t["met"] is None else None) for t in tgts]


def summary_rows(records: list[dict]) -> list[dict]:
    """summary.json's ``generation`` steps from a run's records (newest per key already chosen)."""
    by: dict = {}
    for r in records:
        if r.get("workload") == WORKLOAD and r.get("step") in RUNGS and not r.get("fields"):
            by.setdefault(r["step"], {})[r["metric"]] = r
    out = []
    for step in RUNGS:
        m = by.get(step)
        if not m:
            continue
        v = lambda k: (m.get(k) or {}).get("value")   # noqa: E731
        ms = m.get("ms_per_cycle", {})
        cyc = v("ms_per_cycle")
        out.append({"step": step, "status": ms.get("status"), "reason": ms.get("reason"),
                    "gen_tokens_per_s": v("gen_tokens_per_s"), "ms_per_cycle": cyc,
                    "ms_per_trainer_step": v("ms_per_trainer_step"), "share_generation": v("share_generation"),
                    "share_diversity": (sum(v(f"share_{p}") for p in ("round_trip", "encoding", "score"))
                                        if all(isinstance(v(f"share_{p}"), (int, float)) for p in
                                               ("round_trip", "encoding", "score")) else None),
                    "share_generation_of_overhead": v("share_generation_of_overhead"),
                    "share_diversity_of_overhead": v("share_diversity_of_overhead"),
                    "decode_gbps": v("decode_gbps"), "decode_share_of_copy": v("decode_share_of_copy")})
    return out


# --- the decode ladder past rung d (issue 47): the lab's fused decode step, rung by rung ------------

DECODE_NOTE = ("ms per decode step from CUDA events around the replays of a whole generation (prefill "
               "apart); bytes: fused_decode.generation_step_bytes (weights, KV cache at each step's length, "
               "activations), averaged over the generation's decode steps")


def decode_check(dec, prompts: torch.Tensor, ref: torch.Tensor, ref_logits: torch.Tensor, new_tokens: int,
                 prev: torch.Tensor | None = None) -> dict:
    """Greedy tokens of a decoder (``FusedDecoder``) for ``new_tokens`` tokens against the reference
    ``ref`` [P, N, T] and its logits ``ref_logits`` [P, T, V] (each prompt's first reply): the share
    of positions inside the common prefix, the divergences and how many fall on rounding ties
    (``divergence_ties``, with the decoder's own logits), and the same share against ``prev`` (the
    rung before), when given. Returns the row and the tokens."""
    from ..workloads.polychromic import fused_decode as fd
    kept: list = []
    g = dec(prompts, greedy=True, new_tokens=new_tokens, keep_logits=kept).cpu()
    logits = fd.greedy_logits_rows(kept, prompts.shape[0], dec.cfg.replies)
    same = (g == ref).long().cumprod(-1)
    row = {"agreement": float(same.float().mean()), "identical": bool(torch.equal(g, ref)),
           **divergence_ties(same[:, 0], logits, ref_logits)}
    if prev is not None:
        row["agreement_vs_prev"] = float((g == prev).long().cumprod(-1).float().mean())
    return row, g


def time_decoder(gen, T: int, reps: int, device) -> dict:
    """``reps`` sampled generations of ``T`` tokens by ``gen`` (a callable returning replies) after one
    untimed: their wall seconds (median, p20, p80)."""
    gen()
    secs = [bench.wall_s(gen, device)[0] for _ in range(reps)]
    return {"gen_s": statistics.median(secs), "gen_s_p20": bench.quantile(secs, 0.2),
            "gen_s_p80": bench.quantile(secs, 0.8)}


def fused_rung_row(dec, prompts: torch.Tensor, T: int, reps: int, copy_gbps: float | None) -> dict:
    """One fused rung timed: ``reps`` sampled generations of ``T`` tokens after a warm-up (the first
    call captures the step's graph), ms per decode step from the CUDA events around the replays
    (median over generations, p20-p80), GB/s of the counted bytes, share of the copy ceiling, floor."""
    from ..workloads.polychromic import fused_decode as fd
    cfg = dec.cfg
    dev = dec.device
    first, _ = bench.wall_s(lambda: dec(prompts, new_tokens=T), dev)
    ms, walls = [], []
    for _ in range(reps):
        s, _ = bench.wall_s(lambda: dec(prompts, new_tokens=T), dev)
        walls.append(s)
        ev = dec.last_decode_ms       # None on a CPU: the whole call's time, prefill included
        ms.append((ev if ev is not None else 1e3 * s) / (T - 1))
    nbytes = fd.generation_step_bytes(cfg, dec.batch, prompts.shape[1], T)
    med = statistics.median(ms)
    return {"first_call_s": first, "decode_ms_per_step": med, "ms_p20": bench.quantile(ms, 0.2),
            "ms_p80": bench.quantile(ms, 0.8), "gen_s": statistics.median(walls),
            "gen_tokens_per_s": dec.batch * T / statistics.median(walls), "bytes_per_step": nbytes["total"],
            "bytes_parts": nbytes, **{f"decode_{k}": v for k, v in fd.bandwidth(nbytes["total"], med, copy_gbps).items()}}


def decode_records(rows: list[dict], *, notebook: str, model_size: str, device: str, params: dict) -> list[dict]:
    """Records of the decode ladder: per rung, ms per step (p20/p80), GB/s, share of copy, floor ms,
    greedy agreement; ``model_size`` and the batch are fields."""
    units = {"decode_ms_per_step": "ms", "decode_gbps": "GB/s", "decode_share_of_copy": "share",
             "decode_floor_ms": "ms", "gen_tokens_per_s": "tokens/s", "greedy_agreement": "share",
             "greedy_agreement_vs_prev": "share", "greedy_divergences": "count",
             "greedy_divergences_at_ties": "count", "first_call_s": "s"}
    out = []
    for r in rows:
        f = {"model_size": model_size, "batch": r.get("batch"), "decode_rung": r["rung"]}
        for m, unit in units.items():
            v = r.get(m)
            extra = {"p20": r.get("ms_p20"), "p80": r.get("ms_p80")} if m == "decode_ms_per_step" else {}
            st = r.get("status", "ok")
            out.append(make_record(notebook=notebook, workload=WORKLOAD, step="14e_fused_decode", metric=m, value=v,
                                   unit=unit, status=st if st != "ok" else ("ok" if v is not None else "n/a"),
                                   reason=r.get("reason") if st != "ok" else (None if v is not None else "not measured"),
                                   device=device, fields=f, params={**params, "change": r.get("change"),
                                                                    "note": DECODE_NOTE}, **extra))
    return out
