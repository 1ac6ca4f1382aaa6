"""The library a user would pick instead of the lab's NLI encoder: Hugging Face transformers' BERT of
the same shape and batch, with that library's own best settings, timed beside the lab's last step
of the encoder_nli ladder (``11_sequence_packing``) in one process.

The anchor is ``BertForSequenceClassification`` built from a ``BertConfig`` of the workload's
profile (``bert_config``): the same layers, width, heads, GELU (erf) MLP, post-LayerNorm,
vocabulary, positions, LayerNorm epsilon and initialisation scale; no dropout, as the workload has
none (a fine-tuning default of 0.1 would add masks to every layer and make the anchor slower). It
trains as a user of transformers 5 gets it fastest off the shelf: ``attn_implementation="sdpa"``,
bf16 autocast, TF32, ``torch.compile`` (default mode), AdamW with ``fused=True`` and the lab's
learning rate, betas, weight decay and parameter groups (``ladder.session.make_optimizer``).

Same data, same loss: the workload's synthetic pairs through its own loader (``LoaderBatches``, the
step's loader mode, same seed, same order), and the mean 3-way cross-entropy of fp32 logits on the
pooled [CLS], computed here exactly as the workload computes it. Two ways to pad, two variants:

* ``anchor_hf_bert``: every pair padded to the context (512 in the full profile) with the
  attention mask: the seed's batch, and the lab's steps 01-10;
* ``anchor_hf_bert_longest``: each batch padded on the host to its longest pair, rounded up to a
  multiple of 8, what ``DataCollatorWithPadding(pad_to_multiple_of=8)`` gives: the faster of the two
  off-the-shelf batches. Its length varies, so it is marked dynamic and compiles once.

No padding-free path: transformers' one (``DataCollatorWithFlattening``: a batch's sequences in one
row, position ids restarting at each) reaches a variable-length kernel only under
``attn_implementation="flash_attention_2"`` (the flash-attn package, absent here, or a hub kernel
downloaded at load time); under SDPA, BERT's bidirectional mask ignores the position ids and the
pairs would attend to each other. And ``BertForSequenceClassification``'s pooler reads the first
token of each row: packed, it would classify one [CLS] per row, not one per pair. So a user of this
model gets padded batches; the lab's step 11 packs its pairs with a block-diagonal mask instead.

What differs from the lab's model, none of it a cost that matters: BERT's pooler is
dense + tanh where the workload's (DeBERTa's) is dense + GELU; BERT adds a token-type embedding
(``type_vocab_size`` 2, all zeros here: one more [2, d] table and one add); q, k and v are three
linears where the lab fuses them into one (the same parameters). Parameters: the anchor has
2 d more (the token-type table) and the lab's step has its vocabulary padded to a multiple of 64
(``Settings.vocab_multiple``: rows never looked up), so the counts differ by exactly
``2 d - (vocab_padded - vocab) d`` (``param_difference``): 109,484,547 against 109,487,619 at the
full profile (tests/test_nli_anchor.py counts both).

Timing is the ablation study's (``hwlib.studies.ablation``): every arm built and warmed up once
(its first call, which compiles, timed apart), then timed windows of ``bench.StepClock`` that
alternate between the arms, every second round in reverse order, so that a drift falls on all
arms alike; the ratio anchor / lab is the median step time of one over the other with a bootstrap
interval (``noise.ratio_interval``). On a CPU the arms run eager (compiling two BERTs on two cores
takes minutes) and the times say only that the code runs.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

from .. import bench, noise, precision, results
from ..data import nli as nli_data
from ..data.loader import LoaderBatches
from ..device import ChoiceError, info, resolve_device
from ..extras import require
from ..ladder.run import compile_seconds, first_timed_step
from ..ladder.session import Session, make_optimizer
from ..profiles import resolve_profile
from ..steps import Settings, resolve_autocast, settings_for
from ..workloads import encoder_nli
from ..workloads import get_workload
from .ablation import WINDOWS as _ABLATION_WINDOWS
from .ablation import Window, run_steps, time_windows, warm_up

STEP = "11_sequence_packing"   # the lab's last encoder_nli step, the anchors' reference
WORKLOAD = "encoder_nli"
NEEDED_FOR = "the transformers anchor of the NLI encoder (hwlib.studies.nli_anchor)"
PAD_MULTIPLE = 8     # DataCollatorWithPadding(pad_to_multiple_of=8): tensor-core friendly lengths
VARIANTS = {
    "anchor_hf_bert": "padded to the context with the attention mask (the seed's batch)",
    "anchor_hf_bert_longest": f"padded to each batch's longest pair, a multiple of {PAD_MULTIPLE}",
}
NO_PADDING_FREE = ("transformers' padding-free path (DataCollatorWithFlattening) needs flash_attention_2 "
                   "(flash-attn, not installed), and BertForSequenceClassification pools one [CLS] per row, "
                   "not per packed pair: padded batches with the attention mask")
COMPILE_CHOICES = ("auto", True, False)
# The ablation study's windows; smoke's shorter still (a few seconds for three arms on a CPU in CI):
# one round of 3 timed steps after one warm-up step, which there only checks that the code runs.
WINDOWS = {**_ABLATION_WINDOWS, "smoke": Window(repeats=1, steps=3, settle=0, warmup=1)}


def bert_config(cfg: encoder_nli.EncoderNLIConfig):
    """A ``transformers.BertConfig`` of the workload's shape (module doc: what differs)."""
    tf = require("transformers", NEEDED_FOR)
    return tf.BertConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        intermediate_size=cfg.d_ff, hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, max_position_embeddings=cfg.context, type_vocab_size=2, layer_norm_eps=1e-7,
        initializer_range=cfg.init_std, num_labels=cfg.n_classes, pad_token_id=nli_data.PAD,
        attn_implementation="sdpa")


def build_anchor(cfg: encoder_nli.EncoderNLIConfig, seed: int = 0) -> torch.nn.Module:
    """``BertForSequenceClassification`` of ``bert_config(cfg)``, initialised by transformers (N(0,
    init_std) weights, zero biases, unit LayerNorms) from ``seed``, on the CPU; the global RNG is left
    as it was."""
    tf = require("transformers", NEEDED_FOR)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.BertForSequenceClassification(bert_config(cfg)).train()


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def param_difference(cfg: encoder_nli.EncoderNLIConfig, vocab_multiple: int | None = None) -> int:
    """Anchor's parameters less the lab step's: the token-type table (2 d) less the padded vocabulary
    rows ((vocab_padded - vocab) d; ``vocab_multiple``: the step's, by default)."""
    from ..shapes import padded
    multiple = settings_for(STEP).vocab_multiple if vocab_multiple is None else vocab_multiple
    return 2 * cfg.d_model - (padded(cfg.vocab, multiple) - cfg.vocab) * cfg.d_model


class LongestCollate:
    """Pairs padded to the batch's longest, rounded up to ``multiple`` (at most ``context``):
    (ids [B, T], keep [B, T] bool, labels [B]), as ``DataCollatorWithPadding`` pads on the host."""

    def __init__(self, context: int, multiple: int = PAD_MULTIPLE):
        self.context, self.multiple = context, multiple

    def __call__(self, samples):
        longest = max(len(x) for x, _ in samples)
        return nli_data.PadCollate(min(self.context, -(-longest // self.multiple) * self.multiple))(samples)


def _to_device_dynamic_length(batch, device: torch.device, non_blocking: bool):
    out = tuple(t.to(device, non_blocking=non_blocking) for t in batch)
    # the padded length changes from batch to batch: one compiled graph for every length
    from torch._dynamo import maybe_mark_dynamic
    for t in out[:2]:
        maybe_mark_dynamic(t, 1)
    return out


# --- the arms -------------------------------------------------------------------------------------

class _Lab:
    """The lab's step: its ladder session (model, optimizer, loader, compile, CUDA graphs)."""

    def __init__(self, cfg, settings: Settings, dev: torch.device, seed: int):
        self.name = STEP
        self.sess = Session(WORKLOAD, cfg, settings, dev, seed, step=STEP)
        self.model, self.batches, self.i = self.sess.model, self.sess.batches, 0

    def shapes(self, n: int) -> list | None:
        return self.sess.wl.batch_shapes(self.sess.cfg, self.batches, n)   # packed rows per batch

    def step(self) -> torch.Tensor:
        self.i += 1
        return self.sess.step(self.i - 1)

    def run(self, n: int, clock: bench.StepClock | None = None) -> list[torch.Tensor]:
        with self.sess.precision():
            return run_steps(self.step, n, clock)

    def close(self) -> None:
        self.sess.close()


class _Anchor:
    """transformers' BERT, trained with the step's precision, optimizer and loader, on padded batches."""

    def __init__(self, variant: str, cfg, settings: Settings, dev: torch.device, seed: int):
        self.name, self.settings, self.dev, self.i = variant, settings, dev, 0
        self.model = build_anchor(cfg, seed).to(dev)
        # a class per variant: compiled code is guarded on the module's type, so the padded variant never
        # runs the graph compiled with a dynamic length for the other (both run the same code)
        cls = type(self.model)
        self.model.__class__ = type(f"{cls.__name__}_{variant}", (cls,), {})
        self.opt = make_optimizer(self.model, cfg, settings)
        self.fwd = torch.compile(self.model) if settings.compile else self.model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # truncated pairs: the lab's session has said so once
            ds = encoder_nli.dataset(cfg, seed)
        longest = variant == "anchor_hf_bert_longest"
        self.batches = LoaderBatches(
            ds, cfg.batch, dev, seed, mode=settings.loader,
            collate=LongestCollate(cfg.context) if longest else nli_data.PadCollate(cfg.context),
            to_device=_to_device_dynamic_length if longest and settings.compile else None)

    def shapes(self, n: int) -> None:
        return None   # one shape, or a length marked dynamic: one graph

    def loss(self, batch) -> torch.Tensor:
        ids, keep, labels = batch
        logits = self.fwd(input_ids=ids, attention_mask=keep).logits
        return F.cross_entropy(logits.float(), labels)   # the workload's loss, not transformers' own

    def step(self) -> torch.Tensor:
        batch = self.batches(self.i)
        self.i += 1
        with precision.autocast(self.settings.autocast, self.dev):
            loss = self.loss(batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def run(self, n: int, clock: bench.StepClock | None = None) -> list[torch.Tensor]:
        with precision.tf32_mode(self.settings.tf32):
            return run_steps(self.step, n, clock)

    def close(self) -> None:
        self.batches.close()
        self.model = self.opt = self.fwd = None


# --- the study ------------------------------------------------------------------------------------

def _check(variants, batch, compile, level, window):
    if isinstance(variants, str) or not variants:
        raise ValueError(f"variants must be a non-empty list of variant names, got {variants!r}")
    for v in variants:
        if v not in VARIANTS:
            raise ChoiceError("variant", v, tuple(VARIANTS))
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
        raise ValueError(f"batch must be a positive int (pairs per step) or None, got {batch!r}")
    if compile not in COMPILE_CHOICES or not isinstance(compile, (str, bool)):
        raise ChoiceError("compile", compile, COMPILE_CHOICES)
    if not (isinstance(level, float) and 0 < level < 1):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    if window is not None and not isinstance(window, Window):
        raise TypeError(f"window must be a hwlib.studies.ablation.Window, got {type(window).__name__}")


def measure(*, profile: str = "auto", device: str = "auto", variants=tuple(VARIANTS), batch: int | None = None,
            compile="auto", window: Window | None = None, level: float = noise.DEFAULT_LEVEL, seed: int = 0,
            notebook: str, run=None) -> list[dict]:
    """The lab's step 11 and each anchor variant, interleaved in this process (module doc).

    ``batch``: pairs per step (default: the profile's); ``compile``: "auto" compiles on a GPU only.
    Returns one row per arm, the lab's first: ms/step median with p20/p80, samples/s, parameters,
    first-call seconds, first loss, and for an anchor its time over the lab's (``vs_lab``, above 1:
    the lab is faster) with the interval and the per-window p20/p80. Records them all (metrics
    ``ms_per_step``, ``parameters``, ``first_loss``, ``compile_s`` where compiled, and
    ``anchor_over_lab``), workload encoder_nli, step the arm's name, fields ``{"study": "nli_anchor"}``
    (records with fields are not ladder rows). Every argument is checked before anything is built;
    without transformers it raises ``MissingExtra`` naming the 'generation' extra."""
    _check(variants, batch, compile, level, window)
    wl = get_workload(WORKLOAD)
    dev = resolve_device(device)
    prof = resolve_profile(profile, dev)
    cfg = wl.config(prof, **({"batch": batch} if batch is not None else {}))
    win = window or WINDOWS[prof]
    require("transformers", NEEDED_FOR)
    di = info(dev)
    settings = resolve_autocast(settings_for(STEP), di)
    compiled = dev.type == "cuda" if compile == "auto" else compile
    if not compiled:
        settings = dataclasses.replace(settings, compile=False, cuda_graphs=False)

    arms: list = []
    try:
        arms.append(_Lab(cfg, settings, dev, seed))
        arms.extend(_Anchor(v, cfg, settings, dev, seed) for v in variants)
        rows = {a.name: {"arm": a.name, "status": "ok", "params": param_count(a.model)} for a in arms}
        timed_steps = win.repeats * (win.settle + win.steps)
        for a in arms:   # warm-up: compilation, CUDA graphs, autotuning, loader workers
            # longer where needed: every packed row count of the lab's timed batches runs once before
            # (its recompile or CUDA-graph recording is not timed), as the ladder's own run does
            warmup = (first_timed_step(a.shapes(win.warmup + 2 * timed_steps), win.warmup, timed_steps)[0]
                      if compiled else win.warmup)
            first_s, losses = warm_up(a, warmup, dev)
            rows[a.name].update(first_step_s=first_s, first_loss=float(losses[0]), warmup_steps=warmup)
        order = noise.interleaved_order(win.repeats, [a.name for a in arms])
        timed = time_windows({a.name: a for a in arms}, order, win, dev)
    finally:
        for a in arms:
            a.close()
    return _finish(rows, timed, order, cfg, prof, di, settings, compiled, win, level, seed, notebook, run)


def _finish(rows: dict, timed: dict, order: list, cfg, prof: str, di, settings: Settings, compiled: bool, win: Window,
            level: float, seed: int, notebook: str, run) -> list[dict]:
    lab = rows[STEP]
    params = {"config": dataclasses.asdict(cfg), "settings": dataclasses.asdict(settings), "compiled": compiled,
              "seed": seed, "window": dataclasses.asdict(win), "order": order, "level": level,
              "padding_free": NO_PADDING_FREE}
    recs = []
    for name, row in rows.items():
        t = bench.Timing.from_samples([x for w in timed[name] for x in w])
        row.update(ms_per_step=t.median_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, samples_per_s=cfg.batch / t.median_ms * 1e3,
                   model="hwlib EncoderNLI" if name == STEP else "transformers BertForSequenceClassification",
                   batch_layout="packed rows, block-diagonal mask" if name == STEP else VARIANTS[name],
                   param_difference=None if name == STEP else row["params"] - lab["params"])
        if compiled:
            row["compile_s"] = compile_seconds(row["first_step_s"], t.median_ms)
        common = dict(notebook=notebook, workload=WORKLOAD, step=name, profile=prof, device=di.to_dict(),
                      fields={"study": "nli_anchor"})
        p = {**params, "what": row["model"] + ": " + row["batch_layout"], "warmup_steps": row["warmup_steps"]}
        recs.append(results.make_record(metric="ms_per_step", value=t.median_ms, p20=t.p20_ms, p80=t.p80_ms, unit="ms",
                                        params=p, **common))
        recs.append(results.make_record(metric="samples_per_s", value=row["samples_per_s"], unit="samples/s",
                                        params=p, **common))
        recs.append(results.make_record(metric="parameters", value=row["params"], unit="parameters", params=p, **common))
        recs.append(results.make_record(metric="first_loss", value=row["first_loss"], unit="nats", params=p, **common))
        if "compile_s" in row:
            recs.append(results.make_record(metric="compile_s", value=row["compile_s"], unit="s",
                                            params={**p, "first_step_s": row["first_step_s"]}, **common))
        if name != STEP:
            iv = noise.ratio_interval(timed[name], timed[STEP], level=level, seed=seed)
            per = noise.window_ratios(timed[name], timed[STEP])
            row.update(vs_lab=iv.ratio, vs_lab_lo=iv.lo, vs_lab_hi=iv.hi, vs_lab_p20=noise.quantile(per, 0.2),
                       vs_lab_p80=noise.quantile(per, 0.8))
            recs.append(results.make_record(
                metric="anchor_over_lab", value=iv.ratio, p20=row["vs_lab_p20"], p80=row["vs_lab_p80"],
                unit=f"x (time of this anchor / time of {STEP}, same process)",
                params={**p, "interval": iv.to_dict(), "against": STEP}, **common))
    results.append(recs, run)
    return list(rows.values())


COLUMNS = ["arm", "model", "batch_layout", "params", "ms_per_step", "ms_p20", "ms_p80", "samples_per_s", "vs_lab",
           "vs_lab_lo", "vs_lab_hi", "first_loss"]
