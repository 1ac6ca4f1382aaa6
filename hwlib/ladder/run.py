"""Run N training steps of a workload under a step's settings, and measure them.

One measurement = one seeded run: the first ``plan.check`` steps give the loss curve that the
"same math" check compares with the step before (they are also the warm-up that absorbs
compilation and allocator growth), then ``plan.warmup`` more steps, then ``plan.timed`` steps timed
by ``bench.StepClock``. Compile time is the first step's wall time minus a steady step, reported
apart. A loss that turns NaN or inf marks the result ``nonfinite``: its time is not reported.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch

from .. import bench, telemetry as tel
from ..device import DeviceInfo, info, other_gpu_processes, resolve_device, usable_memory_gib
from ..ops.sources import backends_used, forget_backends
from ..profiles import Plan, plan as plan_for, resolve_profile
from ..steps import Settings, Step, get_step, not_applicable, resolve_autocast, settings_for, unavailable
from ..workloads import get_workload
from .session import CPU_COMPILE_BACKEND_ENV, Session, cpu_compile_backend, detect_sdpa_backend, free


@dataclass
class StepResult:
    workload: str
    step: str
    profile: str
    device: dict
    status: str                        # ok, skipped, n/a, nonfinite
    reason: str | None = None
    config: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    variant: bool = False                  # settings or micro-batching other than the step's own
    seed: int = 0
    losses: list = field(default_factory=list)   # every step's loss, in order
    check_steps: int = 0
    warmup_steps: int = 0                  # untimed steps after the check steps
    timing: bench.Timing | None = None
    first_step_s: float | None = None
    compile_s: float | None = None
    items_per_step: int = 0
    unit: str = "tokens"
    flops_per_step: float = 0.0
    peak_mem_gib: float | None = None      # allocated by tensors
    peak_reserved_gib: float | None = None # taken from the device by the caching allocator
    sdpa_backend: str | None = None
    op_backends: str | None = None         # hwlib's fused ops and the backend each ran ("gelu_mlp=cublaslt, ...")
    host_wait_ms: float | None = None      # per timed step, host blocked on the loader (hwlib.data.loader)
    contended: list | None = field(default_factory=list)   # other processes on the GPU around the timed window (None: unknown)
    notes: list = field(default_factory=list)
    telemetry: dict | None = None          # the timed window's clocks, power, throttling (hwlib.telemetry.summarize)

    @property
    def check_losses(self) -> list:
        return self.losses[: self.check_steps]

    @property
    def items_per_s(self) -> float | None:
        return self.items_per_step / (self.timing.median_ms / 1e3) if self.timing else None

    @property
    def model_tflops(self) -> float | None:
        return self.flops_per_step / (self.timing.median_ms / 1e3) / 1e12 if self.timing else None

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


def first_timed_step(shapes: list | None, start: int, timed: int) -> tuple[int, bool]:
    """The first timed step: ``start``, or later so that every batch shape of the timed window was run
    before it. A new shape recompiles or records a CUDA graph once; inside the window that one-off
    cost would be timed as if it were a step. ``shapes`` has a key per batch (None: all the same) and
    covers at least ``start + 2 * timed`` batches: the warm-up grows by at most ``timed`` steps.
    Returns (first step, whether every shape in the window was seen before it)."""
    if shapes is None:
        return start, True
    if len(shapes) < start + 2 * timed:
        raise ValueError(f"shapes covers {len(shapes)} batches, fewer than start + 2 * timed = {start + 2 * timed}")
    first = start
    while True:
        seen = set(shapes[:first])
        new = next((i for i in range(first, first + timed) if shapes[i] not in seen), None)
        if new is None:
            return first, True
        if new + 1 > start + timed:      # the warm-up would more than double: time it as it is
            return first, False
        first = new + 1


def check_plan(pl: Plan, check_only: bool) -> Plan:
    if not isinstance(pl, Plan):
        raise TypeError(f"plan must be a hwlib.profiles.Plan, got {type(pl).__name__}")
    if check_only:
        pl = Plan(check=pl.check, warmup=0, timed=0)
    if pl.check < 1 or pl.warmup < 0 or pl.timed < 0 or (not check_only and pl.timed < 1):
        raise ValueError(f"plan needs check >= 1, warmup >= 0 and timed >= 1, got {pl}")
    return pl


def _effective_settings(res: StepResult, st: Step, di: DeviceInfo, dev: torch.device,
                        settings: Settings | None) -> Settings:
    """The step's cumulative settings (or ``settings``), as this device runs them; notes why they differ."""
    wanted = settings if settings is not None else settings_for(st.name)
    eff = resolve_autocast(wanted, di)
    if eff.cuda_graphs and dev.type != "cuda":
        res.notes.append("CUDA graphs need a CUDA device: compiled without them on " + dev.type)
    if eff.autocast != wanted.autocast:
        res.notes.append(f"bf16 unsupported on {di.name}: fp16 autocast with a GradScaler instead")
    if (eff.compile or eff.cuda_graphs) and dev.type == "cpu" and cpu_compile_backend() != "inductor":
        res.notes.append(f"compiled with torch.compile's {cpu_compile_backend()} backend, not inductor "
                         f"({CPU_COMPILE_BACKEND_ENV})")
    return eff


def timed_window(res: StepResult, sess: Session, pl: Plan) -> int:
    """The first timed step (``first_timed_step`` over the workload's batch shapes); notes an extension."""
    start = pl.check + pl.warmup
    if not pl.timed:
        return start
    shapes = sess.wl.batch_shapes(sess.cfg, sess.batches, start + 2 * pl.timed)
    first, settled = first_timed_step(shapes, start, pl.timed)
    if first > start:
        res.notes.append(f"warm-up extended by {first - start} steps: every batch shape of the "
                         "timed window ran before it (its recompile or CUDA-graph recording is not timed)")
    if not settled:
        res.notes.append("a batch shape first seen inside the timed window: its recompile or CUDA-graph "
                         "recording is in the timing")
    return first


def _note_contention(res: StepResult, dev: torch.device) -> None:
    """Other processes on the GPU at the edges of the timed window: a timing made beside them is
    marked contended (NVML; on a machine where it cannot tell, the result says unknown)."""
    others = other_gpu_processes(dev)
    if others is None:
        res.contended = None
    elif others and res.contended is not None:
        res.contended = sorted(set(res.contended) | set(others))


def train_steps(res: StepResult, sess: Session, timed_from: int, timed: int, progress: bool, sample: bool = True,
           on_step=None) -> list[float]:
    """Every step's loss; fills the timing, first-step time, peaks, SDPA backend, loader wait and the
    timed window's telemetry (``sample``). ``on_step(i, loss, clock)`` is called after each step with
    the loss tensor as it is (no sync) and the step clock inside the timed window (a live monitor)."""
    dev, total = sess.device, timed_from + timed
    bar = sampler = None
    if progress:
        from tqdm.auto import tqdm   # only when a bar is asked for
        bar = tqdm(total=total, desc=f"{res.workload} {res.step}", leave=False)
    losses: list[torch.Tensor] = []
    try:
        if sess.settings.loader == "resident":
            sess.make_resident(total)
        with sess.precision():
            if sess.settings.attention == "sdpa":
                with torch.no_grad(), sess.autocast():
                    x = sess.batches(0)
                    res.sdpa_backend = detect_sdpa_backend(lambda: sess.wl.loss(sess.model, x))
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            res.first_step_s, loss0 = bench.wall_s(lambda: sess.step(0), dev)
            losses.append(loss0)
            on_step and on_step(0, loss0, None)
            bar and bar.update(1)
            clock, wait0 = bench.StepClock(dev), None
            for i in range(1, total):
                if i == timed_from:
                    _note_contention(res, dev)
                    sampler = tel.Sampler(dev).start() if sample else None   # NVML opened before the first mark
                    clock.mark()
                    wait0 = getattr(sess.batches, "wait_s", None)
                losses.append(sess.step(i))
                if i >= timed_from:
                    clock.mark()
                on_step and on_step(i, losses[-1], clock if i >= timed_from else None)
                bar and bar.update(1)
            vals = torch.stack(losses).float().cpu().tolist()  # one sync for the whole run
            if timed:
                _note_contention(res, dev)
                res.timing = clock.timing()
                wait1 = getattr(sess.batches, "wait_s", None)
                if wait1 is not None and wait0 is not None:
                    res.host_wait_ms = (wait1 - wait0) * 1e3 / timed
            if dev.type == "cuda":
                res.peak_mem_gib = torch.cuda.max_memory_allocated(dev) / 2**30
                res.peak_reserved_gib = torch.cuda.max_memory_reserved(dev) / 2**30
    finally:
        if sampler is not None:   # stopped after the window's final sync: it covers the whole window
            res.telemetry = sampler.stop().summary()
        if bar is not None:
            bar.close()
        sess.close()
    return vals


def resolve(workload: str, step: str, profile: str, device, config: dict | None, plan: Plan | None,
            check_only: bool = False) -> tuple:
    """A measurement's arguments resolved, each checked (a clear error naming it): (device, profile,
    workload, step, device info, config, plan)."""
    dev = resolve_device(device)
    prof = resolve_profile(profile, dev)
    wl, st, di = get_workload(workload), get_step(step), info(dev)
    cfg = wl.config(prof, **(config or {}))
    return dev, prof, wl, st, di, cfg, check_plan(plan or plan_for(prof, dev.type), check_only)


_TRIED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]iB)")


def oom_reason(e: BaseException, dev: torch.device) -> str:
    """What a step that ran out of memory asked for, against what this process may use."""
    tried = _TRIED.search(str(e))
    usable = usable_memory_gib(dev)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    parts = []
    if peak is not None:
        parts.append(f"{peak:.1f} GiB held when it failed")
    if tried:
        parts.append(f"asking for {tried.group(1)} more")
    if usable is not None:
        parts.append(f"this process may use {usable:.1f} GiB")
    return "out of memory" + (": " + ", ".join(parts) if parts else "")


def run_step(workload: str = "gpt", step: str = "01_baseline_fp32", *, profile: str = "auto",
             device: str | torch.device = "auto", seed: int = 0, plan: Plan | None = None,
             source: str | None = None, check_only: bool = False, progress: bool = False,
             settings: Settings | None = None, micro_batch: int | None = None,
             config: dict | None = None, telemetry: bool = True, on_step=None) -> StepResult:
    """Train ``workload`` under ``step``'s cumulative settings and measure it.

    ``check_only`` runs just the seeded steps of the semantics check, untimed. ``settings``
    replaces the step's cumulative settings for a side experiment (the result is marked a variant:
    its curve is not the step's reference). ``micro_batch`` accumulates each batch exactly in
    micro-batches of at most that many samples. ``config`` overrides fields of the workload's
    config (``{"batch": 8, "n_layer": 4}``). ``telemetry`` samples the timed window in a background
    thread (``hwlib.telemetry``; its summary goes into the records); ``on_step`` is ``train_steps``'s
    per-step hook (a live monitor). A step this device cannot run comes back with
    ``status='skipped'`` and the reason; one that does not apply to the workload, ``'n/a'``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if micro_batch is not None and (not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1):
        raise ValueError(f"micro_batch must be a positive int or None, got {micro_batch!r}")
    if settings is not None and not isinstance(settings, Settings):
        raise TypeError(f"settings must be a hwlib.steps.Settings, got {type(settings).__name__}")
    dev, prof, wl, st, di, cfg, pl = resolve(workload, step, profile, device, config, plan, check_only)
    res = StepResult(workload=wl.name, step=st.name, profile=prof, device=di.to_dict(), status="ok",
                     config=dataclasses.asdict(cfg), seed=seed, check_steps=pl.check,
                     variant=settings is not None or micro_batch is not None,
                     items_per_step=wl.items_per_step(cfg), unit=wl.unit, flops_per_step=wl.flops_per_step(cfg))
    for status, why in (("n/a", not_applicable(st, wl.name)), ("skipped", unavailable(st, di))):
        if why:
            res.status, res.reason = status, why
            return res
    eff = _effective_settings(res, st, di, dev, settings)
    res.settings = dataclasses.asdict(eff)
    try:
        forget_backends()   # what this step's ops choose, not an earlier step's in this process
        sess = Session(wl.name, cfg, eff, dev, seed, source, micro_batch=micro_batch, step=st.name)
        timed_from = timed_window(res, sess, pl)
        res.warmup_steps = timed_from - pl.check
        res.losses = train_steps(res, sess, timed_from, pl.timed, progress, telemetry, on_step)
        res.op_backends = ", ".join(f"{op}={b}" for op, b in backends_used().items()) or None
    except torch.OutOfMemoryError as e:
        oom = oom_reason(e, dev)
    else:
        oom = None
    if oom is not None:
        # A GPU too small for this step: a row that says what it asked for, and the series goes on
        # (freed once the exception, and the frames it holds, are gone).
        sess = None
        free(dev)
        res.status, res.reason, res.timing, res.losses = "skipped", oom, None, []
        return res
    bad = next((i for i, v in enumerate(res.losses) if not math.isfinite(v)), None)
    if bad is not None:
        res.status = "nonfinite"
        res.reason = f"loss became {res.losses[bad]} at step {bad}; time not reported"
        res.timing = None
    elif eff.compile and res.timing:
        res.compile_s = compile_seconds(res.first_step_s, res.timing.median_ms)
    return res


def compile_seconds(first_step_s: float, step_ms: float) -> float:
    """Compile time as the ladder counts it: the first call's wall time less one steady step."""
    return max(0.0, first_step_s - step_ms / 1e3)
