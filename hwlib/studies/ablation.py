"""Ablations: one setting toggled at a time on a workload's ladder step, with a noise bound.

Each toggle has two arms, *without* the change and *with* it; the ratio reported is the time per
step without over the time with (above 1: the change helps), with a bootstrap interval
(``hwlib.noise``). Two ways to measure it:

- ``measure``, in one process: both arms are built and warmed up once, then their timed windows
  alternate (``noise.interleaved_order``: A B B A A B ...), each window a few untimed settling
  steps and then ``steps`` steps timed by ``bench.StepClock``. A *switch* toggle (cudnn.benchmark,
  zero_grad, the optimizer, the loader's options) flips the change on one live session between
  windows; a *rebuild* toggle (a ladder step removed, the SDPA backend, a model variant, cuBLAS's
  workspace, which must hold while the CUDA graphs are recorded) keeps two
  sessions alive, each model of its own class so that the compiler never hands one arm the graph
  it compiled for the other (its cache is keyed by code, and both arms run the same code).
- ``measure_in_processes``: every window in a fresh Python process (``python -m
  hwlib.studies.ablation SPEC OUT``), in the same interleaved order, results through files; the
  interval then includes what changes from process to process (allocator layout, autotuning, clocks).

The ladder's ``run.train_steps`` owns a session's whole life (it closes it at the end), so the
windows here drive ``Session.step`` themselves, timed by the same ``bench.StepClock``; the plan is
checked by ``run.check_plan``. Records are written after a toggle's last window, never before: an
interrupted ablation records nothing for the toggle it was measuring.

Each arm's first call is timed apart (``bench.wall_s``): where the arm compiles, that call less a
steady step is its compile time, as the ladder counts it. Where a toggle's arms compute the same
function (``same_math``: a compiler option, a kernel choice), their warm-up losses, the first K steps
from the same seed and batches, must agree within the step's tolerance (``same_math_check``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import bench, blas, noise, results
from ..data.loader import LoaderBatches, default_workers
from ..device import ChoiceError, info, other_gpu_processes, resolve_device
from ..ladder.run import check_plan, compile_seconds
from ..ladder.same_math import compare_curves
from ..ladder.session import Session, detect_sdpa_backend, make_optimizer
from ..profiles import Plan, resolve_profile
from ..steps import LADDER, STEP_NAMES, Settings, chain, get_step, not_applicable, resolve_autocast, settings_for, unavailable
from ..workloads import get_workload

ARMS = ("without", "with")
GB_PER_WORKER = 3.0          # the seed guide's sizing rule: one loader worker per 3 GB of GPU memory


# --- what a toggle changes ------------------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    """One side of a toggle: ``settings`` changed from the step's, a step past the recipe left out of
    the chain (``skip``), a ``model`` patch applied to the built model before its first call, and a
    ``context(session, store)`` entered around every step of this arm (``store``: a dict kept for the
    arm's lifetime, for objects made once)."""
    settings: dict = field(default_factory=dict)
    model: Callable | None = None
    context: Callable | None = None
    skip: str | None = None


@dataclass(frozen=True)
class Toggle:
    name: str
    title: str                       # the change, as the "with" arm has it
    without: Arm
    with_: Arm
    rebuild: bool                    # a session per arm (else one session, the change flipped per window)
    applies: Callable | None = None  # (workload, settings, device info) -> why it does not apply, or None
    stat: str = "median"             # per-step statistic the ratio is taken of
    epoch_windows: bool = False      # each window spans a whole epoch of the loader (its per-epoch costs)
    skips: Callable | None = None    # (device info) -> why this device cannot measure it (a 'skipped' row), or None
    fallible: bool = False           # an arm may fail to run here (a forced kernel, a compiler option): 'skipped', the error
    same_math: bool = False          # the arms compute the same function: their warm-up losses agree within the step's tolerance

    def __post_init__(self):
        if self.same_math and not self.rebuild:
            # one shared session runs the arms one after the other: their warm-ups are different steps
            raise ValueError(f"toggle {self.name}: same_math needs rebuild=True (a session per arm, both from step 0)")


# --- switches on one live session -----------------------------------------------------------------

@contextlib.contextmanager
def _cudnn_benchmark(sess, store):
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


def _zero_grad(mode: bool):
    @contextlib.contextmanager
    def ctx(sess, store):
        opt = sess.opt
        # The session calls opt.zero_grad(set_to_none=...): this arm's mode wins over the step's.
        opt.zero_grad = lambda set_to_none=None, _o=opt, _mode=mode: type(_o).zero_grad(_o, set_to_none=_mode)
        try:
            yield
        finally:
            del opt.zero_grad   # back to the class's method
    return ctx


@contextlib.contextmanager
def _foreach_adamw(sess, store):
    """A second AdamW over the same parameters with the multi-tensor (foreach) kernels, swapped in
    for this arm's windows; its moments are its own, built at its first step."""
    if "opt" not in store:
        store["opt"] = make_optimizer(sess.model, sess.cfg, dataclasses.replace(sess.settings, fused_adamw=False))
        for g in store["opt"].param_groups:
            g["foreach"] = True
    kept, sess.opt = sess.opt, store["opt"]
    try:
        yield
    finally:
        sess.opt = kept


class _LoaderVariant(LoaderBatches):
    """The session's tuned loader with one option changed: pinned memory, non_blocking copies,
    persistent workers (off: the workers are started again every epoch, as a DataLoader without
    them does for each new iterator) or the worker count."""

    def __init__(self, like: LoaderBatches, *, pin: bool = True, non_blocking: bool = True,
                 persistent: bool = True, workers: int | None = None):
        super().__init__(like.dataset, like.batch, like.device, like.seed, "tuned",
                         workers=like.workers if workers is None else workers, prefetch=like.prefetch,
                         collate=like.collate)
        self.pin, self.persistent = pin, persistent
        self.per_epoch = len(like.dataset) // like.batch
        self.to_device = lambda b, d, nb: like.to_device(b, d, non_blocking and nb)

    def _stream(self, start: int):
        from ..data.loader import StepSampler, _Indexed, _quiet_worker
        sampler = StepSampler(len(self.dataset), self.batch, self.seed, start)
        self._loader = torch.utils.data.DataLoader(
            _Indexed(self.dataset), batch_sampler=sampler, num_workers=self.workers, collate_fn=self.collate,
            pin_memory=self.pin and self.device.type == "cuda", persistent_workers=self.workers > 0,
            prefetch_factor=self.prefetch if self.workers > 0 else None, worker_init_fn=_quiet_worker)
        return iter(self._loader)

    def _host_batch(self, i: int):
        if not self.persistent and self._it is not None and i == self._next and i % self.per_epoch == 0:
            self.close()   # a new epoch: a non-persistent loader starts its workers again
        return super()._host_batch(i)


def _loader(**options):
    @contextlib.contextmanager
    def ctx(sess, store):
        if "batches" not in store:
            store["batches"] = _LoaderVariant(sess.batches, **options)
            store.setdefault("close", []).append(store["batches"].close)
        kept, sess.batches = sess.batches, store["batches"]
        try:
            yield
        finally:
            sess.batches = kept
    return ctx


def workers_by_rule(total_mem_gib: float | None) -> int | None:
    """Loader workers by the "one per 3 GB of GPU memory" rule (None without a GPU)."""
    if not total_mem_gib:
        return None
    return max(1, int(total_mem_gib // GB_PER_WORKER))


def _rule_workers(sess, store):
    n = workers_by_rule(info(sess.device).total_mem_gib)
    return _loader(workers=n)(sess, store)


def _sdpa(backend: str):
    def ctx(sess, store):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([getattr(SDPBackend, backend)])
    return ctx


# --- model variants (Vision-BDH) ------------------------------------------------------------------

def _rope_live(model):
    """RoPE's cos/sin computed on the device in every application of the layer (the seed's
    uncached form) instead of read from the tables made at build time."""
    from ..workloads.vit_bdh import ROPE_THETA, TOKENS

    class RopeEveryCall(type(model)):
        def _phases(self):
            n = self.cfg.n_neuron
            dev = self.encoder.device
            pair = torch.div(torch.arange(n, device=dev), 2, rounding_mode="floor").float() * 2
            freqs = 1.0 / ROPE_THETA ** (pair / n) / (2 * math.pi)
            return (torch.arange(TOKENS, device=dev, dtype=torch.float32)[:, None] * freqs) % 1.0 * (2 * math.pi)

        rope_cos = property(lambda self: self._phases().cos())
        rope_sin = property(lambda self: self._phases().sin())

    for name in ("rope_cos", "rope_sin"):
        model._buffers.pop(name, None)
    model.__class__ = RopeEveryCall


def _broadcast_layout(model):
    """The per-head weights applied by broadcasting matmuls over [B, H, T, ...] (the seed's layout
    before its change) instead of one batched matmul over the head axis: same parameters, same math."""
    import torch.nn.functional as F

    from ..workloads.vit_bdh import rope

    class BroadcastHeads(type(model)):
        def layer(self, x):
            B, T, D = x.shape
            x = F.layer_norm(x, (D,))
            s = F.relu(x.unsqueeze(1) @ self.encoder)                                   # [B, H, T, N]
            q = rope(s, self.rope_cos[:T], self.rope_sin[:T])
            a = F.layer_norm(self.attend(q.transpose(0, 1), x), (D,)).transpose(0, 1)  # [B, H, T, D]
            u = F.relu(a @ self.encoder_v)                                              # [B, H, T, N]
            y = ((s * u) @ self.decoder).sum(1)                                         # [B, T, D]
            return F.layer_norm(x + F.layer_norm(y, (D,)), (D,))

    model.__class__ = BroadcastHeads


def _own_class(model, tag: str) -> None:
    """Give ``model`` a class of its own: compiled code is cached per code object and guarded on
    the module's type, so two arms that run the same code still get a graph each."""
    cls = type(model)
    model.__class__ = type(f"{cls.__name__}_{tag}", (cls,), {})


# --- when a toggle applies ------------------------------------------------------------------------

def _needs_loader(workload, st: Settings, di, step=None):
    why = not_applicable(get_step("08_dataloader"), workload)
    if why:
        return f"no loader to tune: {why}"
    if st.loader != "tuned":
        return "the step's loader is not the tuned one (step 08 comes later)"
    return None


def _needs_gpu_memory(workload, st, di, step=None):
    return _needs_loader(workload, st, di, step) or (None if di.total_mem_gib else "the rule sizes by GPU memory; this device has none")


def _eager_grads(workload, st, di, step=None):
    if st.cuda_graphs and di.kind == "cuda":
        return ("under CUDA graphs the gradients live in the graphs' memory pool: they must be set to None, not "
                "zeroed in place; measured at a step without CUDA graphs")
    return None


def _needs_fused(workload, st, di, step=None):
    return None if st.fused_adamw else "the step's optimizer is not fused yet (step 05 comes later)"


def _needs_sdpa(workload, st, di, step=None):
    if st.attention != "sdpa":
        return "the step's attention is not SDPA (step 04 comes later)"
    if workload not in ("gpt", "encoder_nli", "vit_bdh"):
        return f"{workload} has no softmax attention for SDPA to run"
    if workload == "gpt" and step is not None and "24_qkv_grad" in {s.name for s in chain(step)}:
        # hwlib.steps.s24_qkv_grad.op calls the device's fused kernel itself: sdpa_kernel never reaches it,
        # and both arms would time the same kernel
        return "the step's attention is hwlib's QKV op (step 24), which calls its kernel directly, not through SDPA"
    return None


def _vit_only(workload, st, di, step=None):
    return None if workload == "vit_bdh" else "a change inside the Vision-BDH model"


def _no_workspace(sess, store):
    # Entered around every window of the arm, warm-up included: the CUDA graphs are recorded inside it, and
    # a graph keeps the kernels (and the memsets before them) it recorded.
    return blas.no_workspace(True)


def _needs_cublas(di) -> str | None:
    if di.kind != "cuda":
        return (f"cuBLAS's workspace is a CUDA setting: on {di.kind} both arms would run the same matmuls "
                "(measured on a GPU only)")
    return None


def _sdpa_toggle(backend: str, label: str) -> Toggle:
    return Toggle(f"sdpa_{backend.lower()}", f"SDPA forced to its {label} kernel (vs its math kernel)",
                  without=Arm(context=_sdpa("MATH")), with_=Arm(context=_sdpa(backend)), rebuild=True,
                  applies=_needs_sdpa, fallible=True)


TOGGLES: dict[str, Toggle] = {t.name: t for t in (
    Toggle("cudnn_benchmark", "torch.backends.cudnn.benchmark on", Arm(), Arm(context=_cudnn_benchmark), rebuild=False),
    Toggle("zero_grad_set_to_none", "zero_grad(set_to_none=True) instead of zeroing the gradients",
           Arm(context=_zero_grad(False)), Arm(context=_zero_grad(True)), rebuild=False, applies=_eager_grads),
    Toggle("fused_adamw", "AdamW(fused=True) instead of the multi-tensor (foreach) kernels",
           Arm(context=_foreach_adamw), Arm(), rebuild=False, applies=_needs_fused),
    Toggle("pinned_memory", "pinned host memory for batches", Arm(context=_loader(pin=False)), Arm(), rebuild=False,
           applies=_needs_loader),
    Toggle("non_blocking", "non_blocking host-to-device copies", Arm(context=_loader(non_blocking=False)), Arm(),
           rebuild=False, applies=_needs_loader),
    Toggle("persistent_workers", "persistent loader workers (not started again every epoch)",
           Arm(context=_loader(persistent=False)), Arm(), rebuild=False, applies=_needs_loader, stat="mean",
           epoch_windows=True),
    Toggle("workers_per_3gb", "loader workers by the one-per-3-GB-of-VRAM rule (vs one per spare core, at most 8)",
           Arm(), Arm(context=_rule_workers), rebuild=False, applies=_needs_gpu_memory),
    Toggle("rope_cached", "RoPE tables made once at build time (vs computed in every layer application)",
           Arm(model=_rope_live), Arm(), rebuild=True, applies=_vit_only),
    Toggle("head_layout", "per-head weights as one batched matmul over the head axis (vs broadcasting matmuls)",
           Arm(model=_broadcast_layout), Arm(), rebuild=True, applies=_vit_only),
    # Step 28 of GPT-2's ladder until its gain over step 25 measured within the noise (hwlib.steps.retired):
    # the same matmuls, another tile scheduler, so the arms' curves must agree within the step's tolerance.
    Toggle("no_gemm_workspace", "torch's matmuls and hwlib's plain cuBLASLt matmul without cuBLAS's workspace "
           "(hwlib.blas.no_workspace): no memset before them in the CUDA graph (retired step 28)",
           Arm(), Arm(context=_no_workspace), rebuild=True, skips=_needs_cublas, same_math=True),
    _sdpa_toggle("FLASH_ATTENTION", "flash"),
    _sdpa_toggle("EFFICIENT_ATTENTION", "memory-efficient"),
    _sdpa_toggle("CUDNN_ATTENTION", "cuDNN"),
)}

# Fields a ladder step's removal resets; torch.compile takes CUDA graphs with it (they come through it here).
_REMOVAL_ALSO = {"06_torch_compile": {"cuda_graphs": False}}


def removal(step: str) -> Toggle:
    """The toggle that removes ladder step ``step`` (its change reset to the default) from a later step."""
    st = get_step(step)
    if st.beyond_recipe:
        def applies_past(workload, s: Settings, di, step=None, _st=st):
            if not_applicable(_st, workload):
                return not_applicable(_st, workload)
            if step is None or _st.name not in {c.name for c in chain(step)}:
                return f"the step does not include {_st.name}"
            return None
        return Toggle(f"without_{st.name}", f"{st.title} (step {st.name[:2]}), removed from the step",
                      Arm(skip=st.name), Arm(), rebuild=True, applies=applies_past, fallible=True)
    if not st.change:
        raise ValueError(f"{st.name} changes nothing: there is nothing to remove")
    defaults = Settings()
    reset = {k: getattr(defaults, k) for k in st.change}
    reset.update(_REMOVAL_ALSO.get(st.name, {}))

    def applies(workload, s: Settings, di, step=None, _st=st):
        if not_applicable(_st, workload):
            return not_applicable(_st, workload)
        if all(getattr(s, k) == v for k, v in reset.items()):
            return f"the step does not include {_st.name}"
        return None

    return Toggle(f"without_{st.name}", f"{st.title} (step {st.name[:2]}), removed from the step",
                  Arm(settings=reset), Arm(), rebuild=True, applies=applies)


def get_toggle(name: str) -> Toggle:
    if name in TOGGLES:
        return TOGGLES[name]
    if isinstance(name, str) and name.startswith("without_"):
        try:
            return removal(name[len("without_"):])
        except ChoiceError:
            pass
    raise ChoiceError("toggle", name, tuple(TOGGLES) + tuple(f"without_{s}" for s in STEP_NAMES))


def register(*toggles: Toggle) -> None:
    """Add toggles that another study defines (``hwlib.studies.inductor``) to the ones ``get_toggle``
    finds; a name already taken by another toggle is an error."""
    for t in toggles:
        if not isinstance(t, Toggle):
            raise TypeError(f"register takes Toggle objects, got {type(t).__name__}")
        if TOGGLES.get(t.name, t) is not t:
            raise ValueError(f"a toggle named {t.name!r} is already registered")
        TOGGLES[t.name] = t


def removals_for(step: str, workload: str) -> list[str]:
    """The removal toggles of every step of ``step``'s chain (the steps it builds on, and itself) that
    applies to ``workload`` (02 onwards)."""
    names = {s.name for s in chain(step)}
    return [f"without_{s.name}" for s in LADDER
            if s.name in names and (s.change or s.beyond_recipe) and not not_applicable(s, workload)]


# --- interleaved windows over arms ----------------------------------------------------------------
# An arm is anything with a ``name`` and ``run(n, clock=None)`` (n training steps, their losses): this
# module's ``_Arm`` and the anchors beside a ladder step (``hwlib.studies.nli_anchor``).

def run_steps(step: Callable[[], torch.Tensor], n: int, clock: bench.StepClock | None = None) -> list[torch.Tensor]:
    """``n`` calls of ``step``, their losses; marks ``clock`` around each and synchronises it at the end,
    so that a window's work ends inside the caller's context (an arm's settings)."""
    out = []
    if clock is not None:
        clock.mark()
    for _ in range(n):
        out.append(step())
        if clock is not None:
            clock.mark()
    if clock is not None:
        clock.samples_ms()
    return out


def warm_up(arm, n: int, dev: torch.device) -> tuple[float, list[torch.Tensor]]:
    """``n`` untimed steps of ``arm`` (compilation, CUDA graphs, autotuning, loader workers): the wall
    seconds of its first call, which holds its compilation (the ladder's compile_s), and the losses.
    FloatingPointError, naming the arm, where a loss is not finite."""
    first_s, first = bench.wall_s(lambda: arm.run(1), dev)
    losses = first + arm.run(n - 1)
    if not _finite(losses):
        raise FloatingPointError(f"arm {arm.name}: the loss is not finite in warm-up")
    return first_s, losses


def time_windows(arms: dict, order: list[str], win: "Window", dev: torch.device,
                 steps: int | None = None) -> dict[str, list[list[float]]]:
    """One timed window per entry of ``order`` (keys of ``arms``): ``win.settle`` untimed steps, then
    ``steps`` (default ``win.steps``) timed by ``bench.StepClock``; each arm's windows' step times.
    FloatingPointError, naming the arm, where a loss is not finite: its time is not reported."""
    timed: dict[str, list] = {k: [] for k in arms}
    for key in order:
        a = arms[key]
        a.run(win.settle)
        clock = bench.StepClock(dev)
        if not _finite(a.run(win.steps if steps is None else steps, clock)):
            raise FloatingPointError(f"arm {a.name}: the loss is not finite; time not reported")
        timed[key].append(clock.samples_ms())
    return timed


# --- one arm, alive for a toggle's windows --------------------------------------------------------

class _Arm:
    """An arm's session (shared with the other arm for a switch toggle), its context and its own
    batch counter per loader, so that each loader reads a contiguous stream."""

    def __init__(self, name: str, arm: Arm, sess: Session, counters: dict):
        self.name, self.arm, self.sess, self.store, self.counters = name, arm, sess, {}, counters

    @contextlib.contextmanager
    def active(self):
        with self.sess.precision(), (self.arm.context(self.sess, self.store) if self.arm.context
                                     else contextlib.nullcontext()):
            yield

    def step(self) -> torch.Tensor:
        key = id(self.sess.batches)
        i = self.counters.get(key, 0)
        self.counters[key] = i + 1
        return self.sess.step(i)

    def run(self, n: int, clock: bench.StepClock | None = None) -> list[torch.Tensor]:
        """``n`` steps under this arm's context; marks ``clock`` around each one."""
        with self.active():
            return run_steps(self.step, n, clock)

    def sdpa_backend(self) -> str | None:
        if self.sess.settings.attention != "sdpa":
            return None
        with self.active(), torch.no_grad(), self.sess.autocast():
            batch = self.sess.batches(self.counters.get(id(self.sess.batches), 0))
            return detect_sdpa_backend(lambda: self.sess.wl.loss(self.sess.model, batch))

    def close(self):
        for fn in self.store.get("close", []):
            fn()


def _settings(base: Settings, changes: dict, di) -> Settings:
    return resolve_autocast(dataclasses.replace(base, **changes), di)


def _build(workload: str, step: str, cfg, toggle: Toggle, base: Settings, dev, di, seed: int) -> dict[str, _Arm]:
    counters: dict = {}
    if not toggle.rebuild:
        sess = Session(workload, cfg, _settings(base, {}, di), dev, seed, step=step)
        return {"without": _Arm("without", toggle.without, sess, counters),
                "with": _Arm("with", toggle.with_, sess, counters)}
    arms = {}
    for name, arm in (("without", toggle.without), ("with", toggle.with_)):
        sess = Session(workload, cfg, _settings(base, arm.settings, di), dev, seed, step=step,
                       skip=(arm.skip,) if arm.skip else ())
        _own_class(sess.model, name)
        if arm.model is not None:
            arm.model(sess.model)
        arms[name] = _Arm(name, arm, sess, {})
    return arms


def _close(arms: dict[str, _Arm]) -> None:
    sessions = []
    for a in arms.values():
        a.close()
        if all(a.sess is not s for s in sessions):
            sessions.append(a.sess)
    for s in sessions:
        s.close()


def _finite(losses: list[torch.Tensor]) -> bool:
    return bool(losses) and all(math.isfinite(v) for v in torch.stack(losses).float().cpu().tolist())


def same_math_check(first_losses: dict[str, list[float]], step: str) -> dict:
    """The arms' first K losses (same seed, same batches, a session each) against each other: the
    largest relative difference of the "with" arm's curve from the "without" arm's
    (``ladder.same_math.compare_curves``), within ``step``'s own tolerance (a change of rounding only,
    as a compiler option makes, moves the curve no further than the step's own change may)."""
    tol = get_step(step).tolerance
    d = compare_curves(first_losses["with"], first_losses["without"])
    k = min(len(first_losses["with"]), len(first_losses["without"]))
    return {"max_rel": d, "tolerance": tol, "k": k, "ok": d <= tol, "against": "without"}


# --- the study ------------------------------------------------------------------------------------

def _positive_int(name: str, v, minimum: int = 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


@dataclass(frozen=True)
class Window:
    """How each arm is measured: ``warmup`` untimed steps once (compilation, CUDA-graph recording,
    autotuning), then ``repeats`` timed windows per arm, each ``settle`` untimed steps (the other
    arm just ran) and ``steps`` timed ones."""
    repeats: int = 4
    steps: int = 10
    settle: int = 3
    warmup: int = 5

    def __post_init__(self):
        for name, minimum in (("repeats", 1), ("steps", 2), ("settle", 0), ("warmup", 1)):
            _positive_int(f"Window.{name}", getattr(self, name), minimum)
        check_plan(Plan(check=self.warmup, warmup=self.settle, timed=self.steps), False)


# smoke: no settle steps, since its CPU times mean nothing (tests/test_ablation.py keeps a settle step);
# two warm-up steps still, as the same-math check compares the arms' warm-up losses.
WINDOWS = {"full": Window(repeats=4, steps=10, settle=3, warmup=5), "smoke": Window(repeats=2, steps=2, settle=0, warmup=2)}
WINDOWS["mid"] = WINDOWS["full"]   # mid's steps are shorter, its windows as long in steps


def _check(workload: str, step: str, toggles, window, level, budget_s):
    wl, st = get_workload(workload), get_step(step)
    if isinstance(toggles, str) or not toggles:
        raise ValueError(f"toggles must be a non-empty list of toggle names, got {toggles!r}")
    ts = [get_toggle(t) for t in toggles]
    if window is not None and not isinstance(window, Window):
        raise TypeError(f"window must be a hwlib.studies.ablation.Window, got {type(window).__name__}")
    if not (isinstance(level, float) and 0 < level < 1):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s <= 0):
        raise ValueError(f"budget_s must be a positive number of seconds or None, got {budget_s!r}")
    return wl, st, ts


def _row(workload, step, t: Toggle, mode, **kw) -> dict:
    base = {"workload": workload, "step": step, "toggle": t.name, "title": t.title, "mode": mode, "status": "ok",
            "reason": None, "ms_without": None, "ms_with": None, "speedup": None, "lo": None, "hi": None,
            "level": None, "effect": None, "p20": None, "p80": None, "order": None}
    base.update(kw)
    return base


def _summarise(row: dict, t: Toggle, a_windows, b_windows, level: float, seed: int) -> dict:
    iv = noise.ratio_interval(a_windows, b_windows, level=level, seed=seed, stat=t.stat)
    per = noise.window_ratios(a_windows, b_windows, stat=t.stat)
    f = noise._stat(t.stat)
    row.update(ms_without=f([x for w in a_windows for x in w]), ms_with=f([x for w in b_windows for x in w]),
               speedup=iv.ratio, lo=iv.lo, hi=iv.hi, level=level, effect=noise.effect(iv.lo, iv.hi),
               p20=noise.quantile(per, 0.2), p80=noise.quantile(per, 0.8), interval=iv.to_dict(),
               windows={"without": a_windows, "with": b_windows})
    return row


def _records(rows: list[dict], *, profile, device, notebook, params: dict) -> list[dict]:
    recs = []
    for r in rows:
        fields = {"toggle": r["toggle"], "mode": r["mode"]}
        common = dict(notebook=notebook, workload=r["workload"], step=r["step"], profile=profile, device=device)
        p = {**params, "what": r["title"], "order": r["order"], "settings": r.get("settings"),
             "sdpa_backend": r.get("sdpa_backend")}
        if r["status"] != "ok":
            recs.append(results.make_record(metric="speedup", value=None, unit="x", status=r["status"],
                                            reason=r["reason"], fields=fields, params=p, **common))
            continue
        p["interval"] = r["interval"]
        recs.append(results.make_record(metric="speedup", value=r["speedup"], p20=r["p20"], p80=r["p80"],
                                        unit="x (time without / time with)", fields=fields, params=p,
                                        reason=r.get("contended"), **common))
        for arm in ARMS:
            xs = [x for w in r["windows"][arm] for x in w]
            recs.append(results.make_record(metric="ms_per_step", value=r[f"ms_{arm}"], p20=noise.quantile(xs, 0.2),
                                            p80=noise.quantile(xs, 0.8), unit="ms", fields={**fields, "arm": arm},
                                            params={k: p[k] for k in ("what", "order")}, **common))
        for arm, s in (r.get("compile_s") or {}).items():
            recs.append(results.make_record(metric="compile_s", value=s, unit="s", fields={**fields, "arm": arm},
                                            params={"what": p["what"], "first_step_s": r["first_step_s"][arm]}, **common))
        m = r.get("same_math")
        if m is not None:
            recs.append(results.make_record(
                metric="same_math_max_rel", value=m["max_rel"], unit=f"relative, tolerance {m['tolerance']:.2g}",
                status="ok" if m["ok"] else "failed", fields=fields, params={"what": p["what"], "k": m["k"]},
                reason=None if m["ok"] else (f"the arms' first {m['k']} losses differ by {m['max_rel']:.2e}, more "
                                             f"than the step's tolerance {m['tolerance']:.0e}"), **common))
    return recs


def measure(workload: str, step: str, toggles: list[str], *, profile: str = "auto", device: str = "auto",
            window: Window | None = None, level: float = noise.DEFAULT_LEVEL, seed: int = 0, config: dict | None = None,
            budget_s: float | None = None, notebook: str, run=None, progress: bool = False,
            skip_if: Callable[[Toggle, list], str | None] | None = None) -> list[dict]:
    """Each toggle on ``workload``'s ``step``, its arms interleaved in this process (module doc).

    Returns one row per toggle: the median ms/step of each arm, the speed-up (without / with), its
    interval at ``level``, its ``effect`` (faster, slower, within noise), the p20/p80 of the
    per-window ratios, and the order the windows ran in. A toggle that does not apply is an ``n/a``
    row; one whose arm cannot run here (a forced SDPA kernel the shapes do not allow) is ``skipped``
    with the error; past ``budget_s`` seconds the remaining toggles are ``skipped`` and not recorded,
    as is one for which ``skip_if(toggle, rows so far)`` gives a reason (a rule of the caller's that
    reads the toggles measured before it). Every argument is checked before the first session is built."""
    wl, st, ts = _check(workload, step, toggles, window, level, budget_s)
    dev = resolve_device(device)
    prof = resolve_profile(profile, dev)
    win = window or WINDOWS[prof]
    di = info(dev)
    cfg = wl.config(prof, **(config or {}))
    base = settings_for(st.name)
    t0 = time.perf_counter()
    rows = []
    params = {"config": dataclasses.asdict(cfg), "seed": seed, "window": dataclasses.asdict(win), "level": level}

    def record(row: dict) -> None:
        # each toggle's records as soon as its last window is done: an interrupted study keeps the toggles
        # it finished and records nothing of the one it was measuring
        results.append(_records([row], profile=prof, device=di.to_dict(), notebook=notebook, params=params), run)

    why_step = not_applicable(st, wl.name) or unavailable(st, di)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(ts), desc=f"{wl.name} {st.name} ablations", leave=False)
    for t in ts:
        if bar is not None:
            bar.set_postfix_str(t.name)
        why = why_step or (t.applies(wl.name, base, di, st.name) if t.applies else None)
        skip = None if why else (t.skips(di) if t.skips else None)
        if why or skip:
            rows.append(_row(wl.name, st.name, t, "in_process", status="n/a" if why else "skipped", reason=why or skip))
            record(rows[-1])
        elif budget_s is not None and time.perf_counter() - t0 > budget_s:
            rows.append(_row(wl.name, st.name, t, "in_process", status="skipped",
                             reason=f"the time budget ({budget_s:g} s) was spent before this toggle"))
        elif skip_if is not None and (rule := skip_if(t, rows)):
            rows.append(_row(wl.name, st.name, t, "in_process", status="skipped", reason=rule))
        else:
            rows.append(_one(wl.name, st.name, t, cfg, base, dev, di, win, level, seed))
            if rows[-1]["status"] != "skipped" or rows[-1].get("arm_failed"):
                record(rows[-1])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def _one(workload, step, t: Toggle, cfg, base, dev, di, win: Window, level, seed) -> dict:
    row = _row(workload, step, t, "in_process")
    steps = win.steps
    arms = {}
    try:
        arms = _build(workload, step, cfg, t, base, dev, di, seed)
        ds = getattr(arms["with"].sess.batches, "dataset", None)
        if t.epoch_windows and ds is not None:   # every window holds one epoch boundary
            steps = max(steps, len(ds) // cfg.batch)
        row["settings"] = {k: dataclasses.asdict(a.sess.settings) for k, a in arms.items()}
        row["sdpa_backend"], row["first_step_s"], row["first_losses"] = {}, {}, {}
        for a in arms.values():   # warm both arms up: compilation, graphs, autotuning, workers
            try:
                first_s, losses = warm_up(a, win.warmup, dev)
            except FloatingPointError as e:
                return {**row, "status": "nonfinite", "reason": str(e)}
            row["first_step_s"][a.name] = first_s
            row["first_losses"][a.name] = torch.stack(losses).float().cpu().tolist()
            row["sdpa_backend"][a.name] = a.sdpa_backend()
        if t.same_math:
            row["same_math"] = same_math_check(row["first_losses"], step)
        order = noise.interleaved_order(win.repeats)
        row["order"] = "".join(order)
        others_before = other_gpu_processes(dev) if dev.type == "cuda" else []
        try:
            timed = time_windows({"A": arms["without"], "B": arms["with"]}, order, win, dev, steps)
        except FloatingPointError as e:
            return {**row, "status": "nonfinite", "reason": str(e)}
        others = sorted(set(others_before or []) | set((other_gpu_processes(dev) if dev.type == "cuda" else []) or []))
        if others:
            row["contended"] = f"timed beside other processes on the GPU (pids {', '.join(map(str, others))})"
        row["ran"] = order
        row = _summarise(row, t, timed["A"], timed["B"], level, seed)
        # compile time as the ladder counts it: the first call less a steady step, for an arm that compiles
        # a model of its own (a switch toggle's arms share one session: it compiles once)
        row["compile_s"] = {n: compile_seconds(s, row[f"ms_{n}"]) for n, s in row["first_step_s"].items()
                            if t.rebuild and (arms[n].sess.settings.compile or arms[n].sess.settings.cuda_graphs)}
        return row
    except RuntimeError as e:
        # Only a fallible toggle's arm may fail (a forced SDPA kernel refusing the shapes, "No available
        # kernel"; a compiler option the compiler cannot honour); anything else is a bug.
        if not t.fallible or isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {**row, "status": "skipped", "reason": f"an arm cannot run here: {first[:300]}", "arm_failed": True}
    finally:
        _close(arms)


# --- across processes -----------------------------------------------------------------------------

def _worker(spec: dict) -> dict:
    """One arm's window in this process: build, warm up, settle, time (``measure_in_processes``)."""
    t = get_toggle(spec["toggle"])
    dev = resolve_device(spec["device"])
    di = info(dev)
    wl = get_workload(spec["workload"])
    cfg = wl.config(spec["profile"], **(spec.get("config") or {}))
    base = settings_for(spec["step"])
    arm = t.without if spec["arm"] == "without" else t.with_
    sess = Session(wl.name, cfg, _settings(base, arm.settings, di), dev, spec["seed"], step=spec["step"],
                   skip=(arm.skip,) if arm.skip else ())
    if arm.model is not None:
        arm.model(sess.model)
    a = _Arm(spec["arm"], arm, sess, {})
    try:
        if not _finite(a.run(spec["warmup"] + spec["settle"])):
            return {"status": "nonfinite", "reason": "the loss is not finite in warm-up"}
        clock = bench.StepClock(dev)
        if not _finite(a.run(spec["steps"], clock)):
            return {"status": "nonfinite", "reason": "the loss is not finite; time not reported"}
        return {"status": "ok", "samples_ms": clock.samples_ms()}
    finally:
        a.close()
        sess.close()


def worker_command(module: str) -> Callable[[Path, Path], list[str]]:
    """The command line of a worker: ``python -m MODULE SPEC OUT`` with this interpreter."""
    return lambda spec_path, out_path: [sys.executable, "-m", module, str(spec_path), str(out_path)]


_worker_command = worker_command("hwlib.studies.ablation")


def in_fresh_process(command: Callable[[Path, Path], list[str]], spec: dict, stem: Path, timeout_s: float,
                     profile: str) -> dict:
    """Run one worker in a fresh process: ``spec`` goes in as ``STEM.spec.json``, the worker writes
    its result to ``STEM.out.json``. Returns the worker's result when its status is 'ok'; else a
    dict with the status ('failed' when it wrote nothing: a crash, a timeout) and the reason (the
    worker's own, else the last line of its stderr, else the timeout). Nothing is read from a
    worker that exited non-zero, so a half-written result is never taken for a measurement."""
    spec_path, out_path = Path(f"{stem}.spec.json"), Path(f"{stem}.out.json")
    spec_path.write_text(json.dumps(spec))
    # The worker imports the hwlib this process runs, also where it is a clone put on sys.path by a
    # notebook's setup cell (sys.path is not inherited; PYTHONPATH is).
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "HWLIB_PROFILE": profile,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command(spec_path, out_path), capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        done = None
    res = json.loads(out_path.read_text()) if done is not None and done.returncode == 0 and out_path.exists() else None
    if res is not None and res.get("status") == "ok":
        return res
    tail = done.stderr.strip().splitlines()[-1:] if done is not None and done.stderr else []
    why = (res or {}).get("reason") or (tail[0] if tail else f"no result within {timeout_s:g} s")
    return {"status": (res or {}).get("status") or "failed", "reason": why}


def measure_in_processes(workload: str, step: str, toggle: str, *, profile: str = "auto", device: str = "auto",
                         window: Window | None = None, level: float = noise.DEFAULT_LEVEL, seed: int = 0,
                         config: dict | None = None, timeout_s: float = 300.0, notebook: str, run=None,
                         command: Callable[[Path, Path], list[str]] | None = None, progress: bool = False) -> dict:
    """One toggle with every window in a fresh process, in the interleaved order; each process
    warms its arm up and times one window, and writes its per-step times to a file. Returns the row
    (as ``measure``'s, ``mode`` 'processes') and records it. ``command(spec, out)`` builds a
    worker's command line (tests replace the worker)."""
    wl, st, (t,) = _check(workload, step, [toggle], window, level, None)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    dev = resolve_device(device)
    prof = resolve_profile(profile, dev)
    win = window or WINDOWS[prof]
    di = info(dev)
    base = settings_for(st.name)
    cfg = wl.config(prof, **(config or {}))
    why = not_applicable(st, wl.name) or unavailable(st, di) or (t.applies(wl.name, base, di, st.name) if t.applies else None)
    params = {"config": dataclasses.asdict(cfg), "seed": seed, "window": dataclasses.asdict(win), "level": level}
    skip = None if why else (t.skips(di) if t.skips else None)
    if why or skip:
        row = _row(wl.name, st.name, t, "processes", status="n/a" if why else "skipped", reason=why or skip)
        results.append(_records([row], profile=prof, device=di.to_dict(), notebook=notebook, params=params), run)
        return row
    order = noise.interleaved_order(win.repeats)
    row = _row(wl.name, st.name, t, "processes", order="".join(order))
    timed: dict[str, list] = {"A": [], "B": []}
    make = command or _worker_command
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(order), desc=f"{wl.name} {t.name} in processes", leave=False)
    with tempfile.TemporaryDirectory(prefix="hwlib-ablation-") as tmp:
        for k, letter in enumerate(order):
            spec = {"workload": wl.name, "step": st.name, "toggle": t.name, "arm": "without" if letter == "A" else "with",
                    "profile": prof, "device": dev.type, "seed": seed, "config": config or {},
                    "warmup": win.warmup, "settle": win.settle, "steps": win.steps}
            res = in_fresh_process(make, spec, Path(tmp) / f"w{k}", timeout_s, prof)
            if res["status"] != "ok":
                if bar is not None:
                    bar.close()
                row.update(status=res["status"], reason=f"window {k + 1} ({spec['arm']}): {res['reason']}"[:400])
                results.append(_records([row], profile=prof, device=di.to_dict(), notebook=notebook, params=params), run)
                return row
            timed[letter].append(res["samples_ms"])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    row["ran"] = order
    _summarise(row, t, timed["A"], timed["B"], level, seed)
    results.append(_records([row], profile=prof, device=di.to_dict(), notebook=notebook, params=params), run)
    return row


def worker_main(module: str, worker: Callable[[dict], dict], argv: list[str]) -> int:
    """The entry point of a fresh-process worker (``worker_command``): read SPEC.json, run
    ``worker`` on it, write its result to OUT.json."""
    if len(argv) != 2:
        print(f"usage: python -m {module} SPEC.json OUT.json", file=sys.stderr)
        return 2
    results.write_json(argv[1], worker(json.loads(Path(argv[0]).read_text())))
    return 0


def _main(argv: list[str]) -> int:
    return worker_main("hwlib.studies.ablation", _worker, argv)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
