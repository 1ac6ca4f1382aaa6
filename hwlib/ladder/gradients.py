"""The same-gradients check: ONE training step of a step and of the step it builds on, from the same
weights and batch, in fp32, compared tensor by tensor.

The loss-curve check (``same_math``) compares a few losses at 1e-2, where clean code moves them by
3e-5: a bug has to move the loss by a percent before it fires, and AdamW normalises a wrong gradient
scale away. This check compares what one step computes, at a precision where clean code agrees to
about 1e-5:

* the loss;
* every parameter's gradient;
* every parameter's update (its value after the optimizer step less its value before);
* AdamW's state after the step (``exp_avg``, ``exp_avg_sq``): the first update of AdamW is
  lr * g / (|g| + eps) whatever the betas, but its second moment is (1 - beta2) g^2, so a wrong
  beta2 shows here and nowhere else in one step.

Each figure is a relative norm difference per tensor, ||a - b|| / max(||a||, ||b||), and the check
reports the largest, with the tensor it came from. The inputs exercise what a plausible bug breaks:
biases and LayerNorm gains and biases are drawn away from their 0 and 1 initialisation (a fused
LayerNorm that forgot its bias, weight decay applied to a bias, both invisible at zero), and a
quarter of the targets are set to the ignore index (-100, ``F.cross_entropy``'s, which every
workload's loss uses).

Both models come from ``session.build_model`` (the model a step trains), and each is stepped with
its own optimizer (``session.make_optimizer`` under the step's settings) and its own batch layout
(a packed batch for step 11). What a session adds around the model and is not arithmetic is left
off: no autocast, no torch.compile, no CUDA graphs, TF32 off. Steps whose change is only one of
those are still checked: the check then proves that the model they build and the update they make
are the previous step's, and the loss-curve check bounds what their precision does
(``TOLERANCES`` says so, step by step).

``precision="own"`` runs both forwards under the step's own autocast (and TF32) instead: the kernels
that take only 16-bit operands (cuBLASLt's GELU epilogue, cuDNN's fused attention, FP8) run only
there, and fp32 falls back around them. Its tolerance for the loss and gradients is derived from the
format's unit roundoff (``tolerances``); the optimizer still runs in fp32 and keeps 1e-5.

The previous step is ``steps.previous``, skipping steps that do not apply to the workload or
cannot run on this device: they change nothing here, and add nothing to the tolerance.

The optimizer is pinned as well: ``optimizer_description`` reads back, from the optimizer a step
builds, which parameters decay and every hyperparameter; ``optimizer_changes`` compares it with
the previous step's, and a difference the step does not declare (``DECLARED_OPTIMIZER_CHANGES``)
fails the check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from dataclasses import dataclass, field

import torch

from .. import precision as math_modes
from ..device import ChoiceError, info, resolve_device
from ..ops.sources import backends_used, forget_backends
from ..steps import (LADDER, STEP_NAMES, Settings, get_step, not_applicable, previous, resolve_autocast,
                     settings_for, unavailable)
from ..workloads import get_workload
from . import session

IGNORE_INDEX = -100          # F.cross_entropy's default, which every workload's loss uses
IGNORED_SHARE = 4            # every 4th target ignored
BIAS_STD, GAIN_STD = 0.1, 0.1

# Clean code in fp32 agrees to a few 1e-7 (a sum in another order: fused attention, the chunked
# log-sum-exp of the fused head, a fused LayerNorm's reductions): on a CPU, smoke profile, the largest
# figure over every pair was 7.8e-7 (encoder_nli 11 against 08, a LayerNorm gain's gradient). 1e-5 is
# 13x that, and 9000x below the smallest figure a planted bug gave (a learning rate 10% higher: 9.1e-2;
# tests/test_same_gradients.py plants each).
FP32 = 1e-5
INERT = ("the change is {what}, which this check leaves off (fp32, autocast, compile and CUDA graphs off): the "
         "model built and its update must be the previous step's exactly; what {what} itself does to the "
         "arithmetic is bounded by the loss-curve check (steps.LADDER's tolerance)")
EXACT = "the same function in fp32: {how}; only the order of sums can differ"

# Per step: (tolerance of the same-gradients check, why). Literal, keyed by step name: loosening
# one is a visible change (tests/test_headline_numbers.py holds the table again).
TOLERANCES: dict[str, tuple[float, str]] = {
    "01_baseline_fp32": (0.0, "the reference: nothing before it to compare with"),
    "02_tf32": (FP32, INERT.format(what="TF32 matmuls")),
    "03_bf16_autocast": (FP32, INERT.format(what="bf16 autocast")),
    "04_sdpa_attention": (FP32, EXACT.format(how="fused attention (an online softmax) against matmul-softmax-matmul")),
    "05_fused_optimizer": (FP32, EXACT.format(how="AdamW's update in one kernel; set_to_none changes no value")),
    "06_torch_compile": (FP32, INERT.format(what="torch.compile")),
    "07_nice_shapes": (FP32, EXACT.format(how="padded logits sliced off before the loss; the padded rows get no "
                                             "gradient and no update (checked: the extra rows must stay zero)")),
    "08_dataloader": (FP32, EXACT.format(how="the same batch from the tuned loader")),
    "09_cuda_graphs": (FP32, INERT.format(what="CUDA graphs")),
    "10_channels_last": (FP32, EXACT.format(how="the convolution in NHWC")),
    "11_sequence_packing": (FP32, EXACT.format(how="the same pairs packed, attention kept within each pair")),
    "12_bk_core": (FP32, EXACT.format(how="the BK-Core's recursions through another backend")),
    "17_fused_lm_head": (FP32, EXACT.format(how="the head's log-sum-exp online over vocabulary tiles")),
    "18_fp8": (FP32, "FP8 rounds the MLP's operands to 3 mantissa bits whatever the autocast, so in fp32 it is not "
                     "the same arithmetic: on a GPU this check is reported, not asserted (``checked`` False); the "
                     "loss-curve check bounds it (and the step is GPU-only: skipped on CPU)"),
    "21_fused_layernorm": (FP32, EXACT.format(how="residual add + LayerNorm in one op each way")),
    "22_gelu_epilogue": (FP32, EXACT.format(how="bias + GELU and its derivative inside the MLP's matmuls")),
    "23_branch_bias": (FP32, EXACT.format(how="the branches' output biases added in the fused LayerNorm")),
    "24_qkv_grad": (FP32, EXACT.format(how="dq, dk, dv packed into the QKV projection's gradient")),
    "25_bias_column": (FP32, EXACT.format(how="mlp_fc's bias gradient through a column of ones")),
    "26_fp8_head": (FP32, "FP8 rounds the head's operands to 3 mantissa bits whatever the autocast: on a GPU this "
                          "check is reported, not asserted (``checked`` False); the loss-curve check and notebook 26's "
                          "300-step run bound it (GPU-only: skipped on CPU)"),
    "27_bf16_stream": (FP32, INERT.format(what="the residual stream in autocast's 16-bit dtype")),
    "29_shared_qk_attention": (FP32, EXACT.format(how="Q = K's scores from one bmm, the shared values summed per "
                                                       "sample, dq as (dS + dS^T) q")),
    "30_bk_fused_head": (FP32, EXACT.format(how="ResNet-BK's head's log-sum-exp online over vocabulary tiles "
                                                 "(step 17's op)")),
    "31_bucketed_graphs": (FP32, EXACT.format(how="each packed batch padded to its row-count bucket with rows that "
                                                   "attend only to themselves and reach no loss (the graph per "
                                                   "bucket itself is left off, as step 09's)")),
}
# Steps whose arithmetic in fp32 is not the previous step's by design: the check runs and is
# recorded, but its verdict does not fail the step.
NOT_EXACT = {"18_fp8": "FP8 matmuls", "26_fp8_head": "FP8 head matmuls"}

# Optimizer changes a step makes on purpose: {step: {field: value after}}. Any other difference
# between a step's optimizer and the previous step's fails the check.
DECLARED_OPTIMIZER_CHANGES: dict[str, dict] = {
    "05_fused_optimizer": {"fused": True},
}


@dataclass
class GradCheck:
    workload: str
    step: str
    against: str | None
    status: str                      # ok, failed, n/a, skipped, baseline
    device: str = "cpu"
    precision: str = "fp32"
    tolerance: float = 0.0
    why_tolerance: str = ""
    max_rel_diff: float | None = None
    worst: str | None = None         # "grad blocks.0.ln_1.bias": the quantity and tensor of max_rel_diff
    figures: dict = field(default_factory=dict)   # loss, grad, update, state: the largest of each, and its tensor
    optimizer_diff: dict = field(default_factory=dict)   # {field: (before, after)} not declared by the step
    checked: bool = True             # False: reported, not asserted (NOT_EXACT)
    op_backends: dict = field(default_factory=dict)   # hwlib's ops in the step's model and the backend each ran
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "n/a", "skipped", "baseline")

    def __str__(self) -> str:
        if self.against is None:
            return f"{self.workload} {self.step}: same gradients {self.status}: {self.detail}"
        tail = f"; optimizer changed: {self.optimizer_diff}" if self.optimizer_diff else ""
        d_ok = self.max_rel_diff is not None and self.max_rel_diff <= self.tolerance
        return (f"{self.workload} {self.step} vs {self.against}: one step in {self.precision} on {self.device}, largest "
                f"relative difference {self.max_rel_diff:.2e} ({self.worst}), tolerance {self.tolerance:.0e} -> "
                f"{'same gradients' if self.status == 'ok' and d_ok else 'FAILED' if self.status != 'ok' else 'reported'}"
                + ("" if self.checked else " (not asserted: " + NOT_EXACT[self.step] + ")") + tail
                + (f"; {self.detail}" if self.detail else ""))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def record_fields(self) -> dict:
        """The keyword arguments of one ``results.make_record`` for this check (beside the measurement's
        own: notebook, workload, step, profile, device): the largest figure as the value, its verdict as
        the status, everything else under ``extra``."""
        failed = self.status == "failed"
        return {"metric": "same_gradients_max_rel", "value": self.max_rel_diff,
                "unit": f"relative, {self.precision}, tolerance {self.tolerance:.2g}",
                # results.STATUSES has no 'baseline': the first step's record is n/a, its reason says why
                "status": "n/a" if self.status == "baseline" else self.status,
                "reason": str(self) if failed or self.against is None else None,
                "extra": {"against": self.against,    # as the same-math record names it
                          "grad_check": {"worst": self.worst, "figures": self.figures,
                                         "optimizer_diff": {k: list(v) for k, v in self.optimizer_diff.items()},
                                         "checked": self.checked, "op_backends": self.op_backends,
                                         "why_tolerance": self.why_tolerance}}}


# --- the optimizer, pinned -----------------------------------------------------------------------

PER_PARAMETER = ("lr", "betas", "eps", "weight_decay")


def _per_parameter(desc: dict) -> dict:
    """{parameter name: (lr, betas, eps, weight_decay)} of a description: what the optimizer does to each."""
    return {n: tuple(tuple(g[k]) if isinstance(g[k], list) else g[k] for k in PER_PARAMETER)
            for g in desc["groups"] for n in g["params"]}


def optimizer_changes(before: dict, after: dict, step: str) -> dict:
    """What ``after`` (``step``'s optimizer, ``session.optimizer_description``) does differently from
    ``before`` (the previous step's) that ``step`` does not declare (``DECLARED_OPTIMIZER_CHANGES``):
    {what: (before, after)}, one entry per option and per change of a per-parameter value, naming the
    parameters it moved ("weight_decay of 9 parameters (blocks.0.ln_1.bias, ...)": (0.0, 0.1)); empty
    when the optimizer is pinned."""
    declared = DECLARED_OPTIMIZER_CHANGES.get(get_step(step).name, {})
    out = {}
    for k in sorted((set(before) | set(after)) - {"groups"}):
        b, a = before.get(k), after.get(k)
        if a != b and not (k in declared and a == declared[k]):
            out[k] = (b, a)
    pb, pa = _per_parameter(before), _per_parameter(after)
    only = sorted(set(pb) ^ set(pa))
    if only:
        out[f"parameters in one optimizer only ({', '.join(only[:3])}{', ...' if len(only) > 3 else ''})"] = (
            sorted(set(pb) - set(pa)), sorted(set(pa) - set(pb)))
    for i, field_name in enumerate(PER_PARAMETER):
        moved: dict[tuple, list[str]] = {}
        for n in sorted(set(pb) & set(pa)):
            b, a = pb[n][i], pa[n][i]
            if a != b and not (field_name in declared and a == declared[field_name]):
                moved.setdefault((b, a), []).append(n)
        for (b, a), names in moved.items():
            out[f"{field_name} of {len(names)} parameters ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"] = (b, a)
    return out


def optimizer_of(workload: str, step: str, cfg, seed: int = 0) -> dict:
    """The description of the optimizer ``step`` trains ``workload`` with (``session.optimizer_description``
    of ``session.make_optimizer`` over the step's model): no training, no device."""
    model = session.build_model(workload, step, cfg, seed)
    return session.optimizer_description(model, session.make_optimizer(model, cfg, settings_for(step)))


def optimizer_check(workload: str, step: str, *, profile: str = "smoke", seed: int = 0) -> tuple[str | None, dict]:
    """(the step compared with, the undeclared changes of ``step``'s optimizer against it): the previous
    step that applies to ``workload``, on any device (what optimizer a step builds does not depend on
    where it runs). (None, {}) for the first step and for a step that does not apply."""
    wl, st = get_workload(workload), get_step(step)
    if not_applicable(st, wl.name):
        return None, {}
    prev = previous(st.name)
    while prev is not None and not_applicable(prev, wl.name):
        prev = previous(prev.name)
    if prev is None:
        return None, {}
    cfg = wl.config(profile)
    return prev.name, optimizer_changes(optimizer_of(wl.name, prev.name, cfg, seed), optimizer_of(wl.name, st.name, cfg, seed),
                                        st.name)


# --- one step ------------------------------------------------------------------------------------

def _draw_nonzero(model: torch.nn.Module, seed: int) -> None:
    """Biases and LayerNorm gains and biases (every parameter of one dimension) drawn away from 0 and
    1, the same values for a parameter of the same name in any step's model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 1:
                continue
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            gain = name.endswith("weight")           # a LayerNorm's gain (a bias is named bias)
            p.copy_((1.0 + GAIN_STD * noise) if gain else BIAS_STD * noise)


def _ignore_some(batch):
    """The batch with every IGNORED_SHARE-th target (its last tensor) set to IGNORE_INDEX, on a copy:
    the batch may be a view of a cached token stream."""
    *xs, y = batch
    y = y.clone()
    flat = y.view(-1)
    flat[::IGNORED_SHARE] = IGNORE_INDEX
    return (*xs, y)


def _place(model: torch.nn.Module, settings: Settings, dev: torch.device) -> torch.nn.Module:
    """The model on ``dev`` as a Session places it (channels_last is a Session's, not build_model's)."""
    model = model.to(dev)
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


class Stepper:
    """One training step of ``step``'s model in fp32 on batch 0, in two halves: ``backward`` (the loss
    and every gradient) and ``update`` (the optimizer step from gradients it is handed), each tensor by
    parameter name, on the CPU."""

    def __init__(self, workload: str, step: str, cfg, dev: torch.device, seed: int, autocast: str | None = None,
                 tf32: bool = False):
        self.wl = get_workload(workload)
        self.step, self.settings = step, settings_for(step)
        self.autocast, self.tf32, self.dev = autocast, tf32, dev
        torch.manual_seed(seed)                          # anything drawn from the global generator
        model = session.build_model(workload, step, cfg, seed)
        _draw_nonzero(model, seed)
        self.model = _place(model, self.settings, dev)
        self.opt = session.make_optimizer(self.model, cfg, self.settings)
        # The step's own batch layout and loader; fp32 eager (autocast, compile, CUDA graphs, TF32 left off).
        batches = self.wl.batches(cfg, dev, seed, None, self.settings)
        try:
            self.batch = _ignore_some(batches(0))
        finally:
            close = getattr(batches, "close", None)
            close and close()
        self.params = dict(self.model.named_parameters())
        self.before = {n: p.detach().float().cpu().clone() for n, p in self.params.items()}

    def backward(self) -> tuple[torch.Tensor, dict]:
        forget_backends()
        with math_modes.tf32_mode(self.tf32), math_modes.autocast(self.autocast, self.dev):
            loss = self.wl.loss(self.model, self.batch)
        with math_modes.tf32_mode(self.tf32):
            loss.backward()
        self.op_backends = dict(backends_used())
        grads = {n: (p.grad.detach().float().cpu().clone() if p.grad is not None else torch.zeros(p.shape))
                 for n, p in self.params.items()}
        return loss.detach().double().cpu(), grads

    def update(self, grads: dict) -> tuple[dict, dict]:
        """The optimizer step from ``grads`` (by name; a tensor larger than ``grads``' keeps its own gradient
        outside their common part, a padded vocabulary's rows): (updates, AdamW's state after it)."""
        for n, p in self.params.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            common = tuple(slice(0, min(x, y)) for x, y in zip(p.shape, grads[n].shape))
            g[common] = grads[n][common].to(g.device, g.dtype)
            p.grad = g
        with math_modes.tf32_mode(False):
            self.opt.step()
        names = {id(p): n for n, p in self.params.items()}
        state = {f"{k} {names[id(p)]}": v.detach().float().cpu()
                 for p, s in self.opt.state.items() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
        updates = {n: p.detach().float().cpu() - self.before[n] for n, p in self.params.items()}
        return updates, state

    def description(self) -> dict:
        return session.optimizer_description(self.model, self.opt)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||a||, ||b||) over the common part of two tensors, in float64; the part only the
    larger one has (a padded vocabulary's rows) must be zero and counts as a difference. 0 when both
    are zero; inf when shapes differ in rank or either holds a non-finite value."""
    if a.dim() != b.dim():
        return math.inf
    a, b = a.double(), b.double()
    an, bn = a.norm(), b.norm()
    if a.shape == b.shape:   # no part only one side has (a check compares thousands of tensors: 4x faster)
        num = math.sqrt(float((a - b).norm() ** 2))
    else:
        common = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
        extra = float(an ** 2 - a[common].norm() ** 2 + bn ** 2 - b[common].norm() ** 2)
        num = math.sqrt(float((a[common] - b[common]).norm() ** 2) + max(extra, 0.0))
    den = max(float(an), float(bn))
    if not (math.isfinite(num) and math.isfinite(den)):
        return math.inf
    return num / den if den > 0 else 0.0


def compare(after: dict, before: dict) -> dict:
    """The largest relative difference of each quantity between two steps' results, with its
    tensor: {quantity: (figure, tensor name)}; a tensor only one side has is an infinite difference."""
    out = {"loss": (rel_diff(after["loss"].view(1), before["loss"].view(1)), "loss")}
    for q in ("param", "grad", "update", "state"):
        a, b = after[q], before[q]
        worst = (0.0, None)
        for n in sorted(set(a) | set(b)):
            d = rel_diff(a[n], b[n]) if n in a and n in b else math.inf
            if d > worst[0] or worst[1] is None:
                worst = (d, n)
        out[q] = worst
    return out


@contextlib.contextmanager
def _cpu_threads(dev: torch.device):
    """One intra-op thread on the CPU: the smoke models are too small to split, and on a shared 2-core
    machine torch's thread pool spun long enough to make a pair 5-10x slower (0.2 s against 0.7-2 s)."""
    if dev.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def against(workload: str, step: str, dev_info) -> str | None:
    """The step ``step`` is checked against: ``steps.previous``, skipping steps that do not apply to
    ``workload`` or cannot run on this device (they change nothing here)."""
    wl = get_workload(workload).name
    prev = previous(step)
    while prev is not None and (not_applicable(prev, wl) or unavailable(prev, dev_info)):
        prev = previous(prev.name)
    return prev.name if prev is not None else None


PRECISIONS = ("fp32", "own")
# Unit roundoff of the 16-bit and TF32 formats the "own" precision runs in (same_math's U_BF16, U_TF32).
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "tf32": 2.0 ** -11}
ROUNDING_UNITS = 16
OWN_WHY = ("at the step's own precision ({mode}) the loss and gradients carry a relative error of a few of its unit "
           "roundoffs u = {u:.1e} wherever two code paths round at different points (clean CPU pairs under bf16 "
           "autocast, smoke: at most 2.7e-2 = 7 u, Vision-BDH's patch-embedding bias at step 04, a gradient summed "
           "with cancellation; every other pair at most 1.0e-2): {n} u = {tol:.2e}. The optimizer runs in fp32 from "
           "the same gradients, so the update and AdamW's state keep the fp32 tolerance")


def tolerances(step: str, mode: str | None, tf32: bool) -> tuple[dict, str]:
    """({quantity: tolerance}, why) of ``step``'s check where its forward runs under autocast ``mode``
    (None: fp32, TF32 where ``tf32``). The fp32 figure is the step's own (``TOLERANCES``); a 16-bit or
    TF32 forward widens the loss's and the gradients' to ROUNDING_UNITS of its unit roundoff."""
    tol, why = TOLERANCES[get_step(step).name]
    out = {"loss": tol, "param": 0.0, "grad": tol, "update": tol, "state": tol}
    fmt = mode or ("tf32" if tf32 else None)
    if fmt is not None:
        u = UNIT_ROUNDOFF[fmt]
        wide = max(tol, ROUNDING_UNITS * u)
        out.update(loss=wide, grad=wide)
        why = f"{why}; " + OWN_WHY.format(mode=fmt, u=u, n=ROUNDING_UNITS, tol=wide)
    return out, why


def same_gradients(workload: str, step: str, *, profile: str = "smoke", device="cpu", seed: int = 0,
                   precision: str = "fp32", config: dict | None = None) -> GradCheck:
    """One training step of ``step`` and of the step it builds on (``against``), from the same seed and
    batch, compared: loss, every gradient, every update, AdamW's state (module doc); and the optimizer
    each builds (``optimizer_changes``).

    ``precision``: "fp32" (autocast and TF32 off: clean code agrees to ~1e-7, the tolerance is 1e-5),
    or "own", both models' forward under the step's own autocast and TF32 as this device runs them
    (bf16, or fp16 where bf16 is missing): the kernels that take only 16-bit operands (cuBLASLt's GELU
    epilogue, cuDNN's fused attention, FP8) run only there, at a tolerance ``tolerances`` derives from
    the format. ``config`` overrides fields of the profile's config."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if precision not in PRECISIONS:
        raise ChoiceError("precision", precision, PRECISIONS)
    wl, st = get_workload(workload), get_step(step)
    dev = resolve_device(device)
    di = info(dev)
    cfg = wl.config(profile, **(config or {}))
    mode = tf32 = None
    if precision == "own":
        own = resolve_autocast(settings_for(st.name), di)
        mode, tf32 = own.autocast, own.tf32 and dev.type == "cuda"
    tols, why = tolerances(st.name, mode, bool(tf32))
    label = mode or ("tf32" if tf32 else "fp32")
    base = dict(workload=wl.name, step=st.name, device=dev.type, precision=label, tolerance=tols["grad"],
                why_tolerance=why)
    if (na := not_applicable(st, wl.name)):
        return GradCheck(against=None, status="n/a", detail=na, **base)
    if (skip := unavailable(st, di)):
        return GradCheck(against=None, status="skipped", detail=skip, **base)
    prev = against(wl.name, st.name, di)
    if prev is None:
        return GradCheck(against=None, status="baseline", detail="the first step: nothing to compare with", **base)
    # The global generators are the caller's (a notebook times its step after this): drawn from inside only.
    with _cpu_threads(dev), torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        a = Stepper(wl.name, st.name, cfg, dev, seed, mode, bool(tf32))
        b = Stepper(wl.name, prev, cfg, dev, seed, mode, bool(tf32))
        (loss_a, grads_a), (loss_b, grads_b) = a.backward(), b.backward()
        # Both optimizers step from the previous step's gradients: the gradients are compared on their
        # own, and AdamW's first update, lr g / (|g| + eps), would turn a gradient that is zero but for
        # rounding (a key bias's: softmax ignores a constant added to a row's scores) into updates of
        # size lr that differ from model to model.
        (up_a, state_a), (up_b, state_b) = a.update(grads_b), b.update(grads_b)
    figures = compare({"loss": loss_a, "param": a.before, "grad": grads_a, "update": up_a, "state": state_a},
                      {"loss": loss_b, "param": b.before, "grad": grads_b, "update": up_b, "state": state_b})

    def over(q):   # how far past its tolerance a quantity is (above 1: failed)
        d, t = figures[q][0], tols[q]
        return d / t if t > 0 else (math.inf if d > 0 else 0.0)
    q = max(figures, key=lambda k: (over(k), figures[k][0]))
    d, name = figures[q]
    opt_diff = optimizer_changes(b.description(), a.description(), st.name)
    # A step in NOT_EXACT is reported, not failed, on its figures; never on its optimizer.
    ok = (over(q) <= 1.0 or st.name in NOT_EXACT) and not opt_diff
    return GradCheck(against=prev, status="ok" if ok else "failed", max_rel_diff=d, worst=f"{q} {name}",
                     figures={k: {"max_rel_diff": v, "tensor": n, "tolerance": tols[k]} for k, (v, n) in figures.items()},
                     optimizer_diff=opt_diff, checked=st.name not in NOT_EXACT, op_backends=a.op_backends,
                     **{**base, "tolerance": tols[q]})


def assert_same_gradients(checks) -> None:
    """Every check passed (n/a, skipped and the baseline pass: they say why); ``checks`` a GradCheck,
    or an iterable or dict of them. Raises AssertionError naming each failure."""
    if isinstance(checks, GradCheck):
        checks = [checks]
    checks = list(checks.values()) if isinstance(checks, dict) else list(checks)
    assert checks, "no same-gradients check to judge"
    failed = [str(c) for c in checks if not c.ok]
    assert not failed, "gradients changed: " + "; ".join(failed)


def check_all(workload: str, *, profile: str = "smoke", device="cpu", seed: int = 0,
              precision: str = "fp32") -> list[GradCheck]:
    """``same_gradients`` for every step of the ladder, in order."""
    return [same_gradients(workload, s.name, profile=profile, device=device, seed=seed, precision=precision)
            for s in LADDER]


assert set(TOLERANCES) == set(STEP_NAMES), "every step states its same-gradients tolerance"
