"""Run N training steps of a workload under a step's settings, and measure them.

One measurement = one seeded run: the first ``plan.check`` steps give the loss curve that the
"same math" check compares with the step before (they are also the warm-up that absorbs
compilation and allocator growth), then ``plan.warmup`` more steps, then ``plan.timed`` steps timed
by ``bench.StepClock``. Compile time is the first step's wall time minus a steady step, reported
apart. A loss that turns NaN or inf marks the result ``nonfinite``: its time is not reported.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import warnings
from dataclasses import dataclass, field

import torch

from . import bench, ceilings as ceilings_mod, results
from .device import DeviceInfo, Unavailable, info, resolve_device
from .profiles import Plan, plan as plan_for, resolve_profile
from .steps import (LADDER, STEP_NAMES, Settings, Step, applies, autocast_ctx, backend_flags, check_available, get_step, previous,
                    resolve_autocast, settings_for)
from .workloads import get_workload


@dataclass
class StepResult:
    workload: str
    step: str
    profile: str
    device: dict
    status: str                        # ok, skipped, nonfinite
    reason: str | None = None
    config: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
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
    host_wait_ms: float | None = None      # per timed step, host blocked on the loader (hwlib.loader)
    notes: list = field(default_factory=list)

    @property
    def check_losses(self) -> list:
        return self.losses[: self.check_steps]

    @property
    def items_per_s(self) -> float | None:
        return self.items_per_step / (self.timing.median_ms / 1e3) if self.timing else None

    @property
    def model_tflops(self) -> float | None:
        return self.flops_per_step / (self.timing.median_ms / 1e3) / 1e12 if self.timing else None

    def mfu(self, ceil: dict | None) -> float | None:
        peak = (ceil or {}).get("matmul_tflops", {}).get("bf16")
        return self.model_tflops / peak if (self.model_tflops and peak) else None

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


def make_optimizer(model: torch.nn.Module, cfg, settings: Settings):
    """AdamW as GPT-2 trains it: matrices decayed, biases and LayerNorm gains not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    if settings.offload_optimizer:
        from .memory.offload import OffloadedAdamW
        return OffloadedAdamW(groups, **kw)
    return torch.optim.AdamW(groups, **kw, **({"fused": True} if settings.fused_adamw else {}))


class Session:
    """A workload's model, optimizer, scaler and data under one ``Settings``: everything a
    training step needs, and what a checkpoint saves. Callers wrap use in ``backend_flags``."""

    def __init__(self, workload: str, cfg, settings: Settings, device: torch.device, seed: int = 0,
                 source: str | None = None, micro_batch: int | None = None):
        self.wl = get_workload(workload)
        # Gradient accumulation: each step's batch runs as exact micro-batches of at most this size.
        self.micro_batch = micro_batch
        self.cfg, self.settings, self.device, self.seed = cfg, settings, device, seed
        self.batches = self.wl.batches(cfg, device, seed, source, settings)
        self.model = self.wl.build(cfg, settings, seed).to(device)
        if settings.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)   # 4-d weights only
        self.opt = make_optimizer(self.model, cfg, settings)
        self.scaler = torch.amp.GradScaler("cuda") if settings.autocast == "fp16" else None
        self.fwd = self.model
        if settings.compile or settings.cuda_graphs:
            # reduce-overhead records the forward and backward graphs as CUDA graphs and replays them.
            mode = "reduce-overhead" if settings.cuda_graphs and device.type == "cuda" else None
            self.fwd = torch.compile(self.model, mode=mode)

    def forward_backward(self, batch, weight: float = 1.0) -> torch.Tensor:
        """Loss of ``batch`` and its gradient, scaled by ``weight``, added to ``.grad``."""
        with autocast_ctx(self.settings, self.device):
            loss = self.wl.loss(self.fwd, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise TypeError(f"workload {self.wl.name!r}: loss must be a scalar tensor attached to the graph, "
                            f"got {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        scaled = loss * weight if weight != 1.0 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        # A CUDA-graph output lives in the graph's memory pool and is overwritten by the next replay.
        return loss.detach().clone() if self.settings.cuda_graphs else loss.detach()

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=self.settings.fused_adamw)

    def step(self, i: int) -> torch.Tensor:
        if self.settings.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()   # a new iteration: earlier outputs may be reused
        batch = self.batches(i)
        if self.micro_batch:
            from .memory.accumulation import accumulate, batch_size, plan_micro_batches
            loss = accumulate(self.forward_backward, batch, plan_micro_batches(batch_size(batch), self.micro_batch))
        else:
            loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()
        # Resident batches live on the device: drop them before the cache is emptied.
        self.batches = self.model = self.opt = self.fwd = self.scaler = None
        if self.settings.compile or self.settings.cuda_graphs:
            torch._dynamo.reset()
        _free(self.device)


def detect_sdpa_backend(fn) -> str:
    """Which attention kernel ran, read off the aten ops that ``fn()`` dispatched."""
    from torch.profiler import ProfilerActivity, profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the profiler's notes on event cycles are not ours to show
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    names = {e.name for e in prof.events()}
    for key, label in (("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU kernel)"),
                       ("_scaled_dot_product_flash_attention", "flash"),
                       ("_scaled_dot_product_cudnn_attention", "cudnn"),
                       ("_scaled_dot_product_efficient_attention", "memory-efficient"),
                       ("_scaled_dot_product_fused_attention_overrideable", "fused (overrideable)"),
                       ("_scaled_dot_product_attention_math", "math (unfused)")):
        if any(key in n for n in names):
            return label
    return "none found"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


def run_step(workload: str = "gpt", step: str = "01_baseline_fp32", *, profile: str = "auto",
             device: str | torch.device = "auto", seed: int = 0, plan: Plan | None = None,
             source: str | None = None, check_only: bool = False, progress: bool = False,
             settings: Settings | None = None, micro_batch: int | None = None, **config) -> StepResult:
    """Train ``workload`` under ``step``'s cumulative settings and measure it.

    ``check_only`` runs just the seeded steps of the semantics check, untimed. ``settings``
    replaces the step's cumulative settings for a side experiment (its curve is not saved as the
    step's reference). ``micro_batch`` accumulates each batch exactly in micro-batches of at
    most that many samples. Keyword arguments
    beyond these override fields of the workload's config (``batch=8``, ``n_layer=4``).
    A step this device cannot run comes back with ``status='skipped'`` and the reason.
    """
    dev = resolve_device(device)
    prof = resolve_profile(profile, dev)
    wl = get_workload(workload)
    st: Step = get_step(step)
    di: DeviceInfo = info(dev)
    cfg = wl.config(prof, **config)
    pl = plan or plan_for(prof)
    if check_only:
        pl = Plan(check=pl.check, warmup=0, timed=0)
    if pl.check < 1 or pl.warmup < 0 or pl.timed < 0 or (not check_only and pl.timed < 1):
        raise ValueError(f"plan needs check >= 1, warmup >= 0 and timed >= 1, got {pl}")
    res = StepResult(workload=wl.name, step=st.name, profile=prof, device=di.to_dict(), status="ok",
                     config=dataclasses.asdict(cfg), seed=seed, check_steps=pl.check,
                     items_per_step=wl.items_per_step(cfg), unit=wl.unit, flops_per_step=wl.flops_per_step(cfg))
    na = applies(st, wl.name)
    if na:
        res.status, res.reason = "n/a", na
        return res
    reason = check_available(st, di)
    if reason:
        res.status, res.reason = "skipped", reason
        return res
    variant = settings is not None or micro_batch is not None
    wanted = settings if variant else settings_for(st.name)
    settings = resolve_autocast(wanted, di)
    if settings.cuda_graphs and dev.type != "cuda":
        res.notes.append("CUDA graphs need a CUDA device: compiled without them on " + dev.type)
    if settings.autocast != wanted.autocast:
        res.notes.append(f"bf16 unsupported on {di.name}: fp16 autocast with a GradScaler instead")
    res.settings = dataclasses.asdict(settings)

    sess = Session(wl.name, cfg, settings, dev, seed, source, micro_batch=micro_batch)
    timed_from, settled = pl.check + pl.warmup, True
    if pl.timed:
        shapes = wl.batch_shapes(cfg, sess.batches, pl.check + pl.warmup + 2 * pl.timed)
        timed_from, settled = first_timed_step(shapes, pl.check + pl.warmup, pl.timed)
        if timed_from > pl.check + pl.warmup:
            res.notes.append(f"warm-up extended by {timed_from - pl.check - pl.warmup} steps: every batch shape of the "
                             "timed window ran before it (its recompile or CUDA-graph recording is not timed)")
        if not settled:
            res.notes.append("a batch shape first seen inside the timed window: its recompile or CUDA-graph "
                             "recording is in the timing")
    res.warmup_steps = timed_from - pl.check

    losses: list[torch.Tensor] = []
    total = timed_from + pl.timed
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc=f"{wl.name} {st.name}", leave=False)
    try:
        if settings.loader == "resident":
            make = getattr(sess.batches, "make_resident", None)
            if make is not None:
                make(total)
            else:  # a plain batch function: call it now for every step, keep the results
                kept = {i: sess.batches(i) for i in range(total)}
                sess.batches = kept.__getitem__
        with backend_flags(settings):
            if settings.attention == "sdpa":
                with torch.no_grad(), autocast_ctx(settings, dev):
                    x = sess.batches(0)
                    found = detect_sdpa_backend(lambda: sess.wl.loss(sess.model, x))
                    res.sdpa_backend = None if found == "none found" else found   # a model without attention
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            res.first_step_s, loss0 = bench.wall_s(lambda: sess.step(0), dev)
            losses.append(loss0)
            bar and bar.update(1)
            clock = bench.StepClock(dev)
            wait0 = None
            for i in range(1, total):
                if i == timed_from:
                    clock.mark()
                    wait0 = getattr(sess.batches, "wait_s", None)
                losses.append(sess.step(i))
                if i >= timed_from:
                    clock.mark()
                if bar is not None:
                    bar.update(1)
            vals = torch.stack(losses).float().cpu().tolist()  # one sync for the whole run
            if pl.timed:
                res.timing = clock.timing()
                wait1 = getattr(sess.batches, "wait_s", None)
                if wait1 is not None and wait0 is not None:
                    res.host_wait_ms = (wait1 - wait0) * 1e3 / pl.timed
            if dev.type == "cuda":
                res.peak_mem_gib = torch.cuda.max_memory_allocated(dev) / 2**30
                res.peak_reserved_gib = torch.cuda.max_memory_reserved(dev) / 2**30
    finally:
        if bar is not None:
            bar.close()
        sess.close()

    res.losses = vals
    bad = next((i for i, v in enumerate(vals) if not math.isfinite(v)), None)
    if bad is not None:
        res.status = "nonfinite"
        res.reason = f"loss became {vals[bad]} at step {bad}; time not reported"
        res.timing = None
        return res
    if settings.compile and res.timing:
        res.compile_s = max(0.0, res.first_step_s - res.timing.median_ms / 1e3)
    if not variant:
        save_curve(res)
    return res


# --- the "same math" check ------------------------------------------------------------------------

@dataclass
class MathCheck:
    step: str
    against: str | None
    max_rel_diff: float | None
    tolerance: float
    k: int
    ok: bool
    detail: str = ""

    def __str__(self) -> str:
        if self.against is None:
            return f"{self.step}: {self.detail or 'baseline, nothing to compare'}"
        return (f"{self.step} vs {self.against}: max relative loss difference over {self.k} steps "
                f"{self.max_rel_diff:.2e} (tolerance {self.tolerance:.0e}) -> {'same math' if self.ok else 'FAILED'}"
                + (f"; {self.detail}" if self.detail else ""))


def compare_curves(curr: list[float], prev: list[float], tolerance: float) -> float:
    """Largest relative difference between two loss curves over their common length."""
    k = min(len(curr), len(prev))
    if k == 0:
        raise ValueError("compare_curves: both curves need at least one loss")
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curr[:k], prev[:k])]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else float("inf")


def _curve_path(workload: str, step: str, run=None):
    return results.run_dir(run) / "curves" / workload / f"{step}.json"


def _curve_key(res: StepResult) -> dict:
    return {"config": res.config, "seed": res.seed, "device": res.device.get("name"), "k": res.check_steps}


def _saved_curve(res: StepResult, step: str, run=None) -> list[float] | None:
    """This run's saved check losses of ``step``, if they were made with ``res``'s config, seed,
    device and K; else None."""
    saved = results.read_json(_curve_path(res.workload, step, run))
    if saved and {k: saved.get(k) for k in ("config", "seed", "device", "k")} == _curve_key(res):
        return saved["losses"]
    return None


def save_curve(res: StepResult, run=None) -> None:
    results.write_json(_curve_path(res.workload, res.step, run),
                       {**_curve_key(res), "losses": res.check_losses, "settings": res.settings})


def reference_curve(res: StepResult, step: str, run=None) -> list[float] | None:
    """The loss curve of ``step`` with ``res``'s config, seed and device: from this run's saved
    curves when present, else computed now (check steps only, untimed). None if that step is
    unavailable here."""
    saved = _saved_curve(res, step, run)
    if saved is not None:
        return saved
    overrides = {k: v for k, v in res.config.items()}
    prev = run_step(res.workload, step, profile=res.profile, device=_device_arg(res), seed=res.seed,
                    plan=Plan(check=res.check_steps, warmup=0, timed=0), check_only=True, **overrides)
    return prev.check_losses if prev.status == "ok" else None


def _device_arg(res: StepResult) -> str:
    return "cuda" if res.device.get("kind") == "cuda" else "cpu"


def same_math(res: StepResult, run=None) -> MathCheck:
    """Compare ``res``'s first K losses with the nearest earlier step that ran on this device."""
    st = get_step(res.step)
    if res.status in ("skipped", "n/a"):  # nothing ran, nothing to compare; the row says why
        return MathCheck(res.step, None, None, st.tolerance, 0, True, f"skipped: {res.reason}")
    if res.status != "ok":
        return MathCheck(res.step, None, None, st.tolerance, 0, False, f"{res.status}: {res.reason}")
    prev = previous(res.step)
    while prev is not None:
        curve = reference_curve(res, prev.name, run)
        if curve is not None:
            d = compare_curves(res.check_losses, curve, st.tolerance)
            # Tolerances of skipped steps in between add up: their changes are part of this diff.
            tol = sum(s.tolerance for s in _between(prev.name, res.step))
            why = st.why_tolerance
            floor = _reduced_precision_floor(res, run)
            if floor is not None and floor > tol:
                tol = floor
                why += (f"; under bf16 a change of rounding alone moves this workload's curve as far as bf16 itself did "
                        f"(03 vs 02: {floor:.1e}), so that is the resolution of the check")
            return MathCheck(res.step, prev.name, d, tol, min(len(curve), res.check_steps), d <= tol, why)
        prev = previous(prev.name)
    return MathCheck(res.step, None, None, 0.0, 0, True)


def _reduced_precision_floor(res: StepResult, run=None) -> float | None:
    """How far bf16 moved this workload's loss curve (step 03 against 02, as saved in this run),
    for a step after 03 that runs under autocast: a reordering of bf16 arithmetic cannot be
    resolved more finely than that. Capped by step 03's own tolerance; None when not applicable."""
    bf16 = "03_bf16_autocast"
    if not res.settings.get("autocast") or STEP_NAMES.index(res.step) <= STEP_NAMES.index(bf16):
        return None
    if get_step(res.step).same_arithmetic:   # nothing to resolve: the step keeps its own bound
        return None
    c03, c02 = _saved_curve(res, bf16, run), _saved_curve(res, "02_tf32", run)
    if c03 is None or c02 is None:
        return None
    return min(compare_curves(c03, c02, 0), get_step(bf16).tolerance)


def _between(after: str, upto: str) -> list[Step]:
    return list(LADDER[STEP_NAMES.index(after) + 1: STEP_NAMES.index(upto) + 1])


# --- recording ------------------------------------------------------------------------------------

def record(res: StepResult, *, notebook: str, check: MathCheck | None = None, ceilings: dict | None = None,
           run=None) -> list[dict]:
    """Write the result's metrics to the run's results.jsonl; returns the records written."""
    import uuid

    from .device import versions
    # One id for every metric of this measurement: a re-run that records fewer metrics (a step now
    # skipped) must not be read together with the previous run's leftovers.
    mid = {"measurement": uuid.uuid4().hex[:12]}
    common = dict(notebook=notebook, workload=res.workload, step=res.step, profile=res.profile,
                  params={"config": res.config, "settings": res.settings, "seed": res.seed,
                          "check_steps": res.check_steps, "warmup_steps": res.warmup_steps,
                          "timed_steps": res.timing.n if res.timing else 0, "notes": res.notes},
                  device={k: res.device.get(k) for k in ("kind", "name", "capability", "total_mem_gib", "sm_count")},
                  versions=versions())
    recs = []
    if res.status != "ok" or res.timing is None:
        recs.append(results.make_record(metric="ms_per_step", value=None, unit="ms", status=res.status,
                                        reason=res.reason, extra=mid, **common))
    else:
        t = res.timing
        recs.append(results.make_record(metric="ms_per_step", value=t.median_ms, p20=t.p20_ms, p80=t.p80_ms,
                                        unit="ms", extra=mid, **common))
        recs.append(results.make_record(metric=f"{res.unit}_per_s", value=res.items_per_s,
                                        p20=res.items_per_step / (t.p80_ms / 1e3),
                                        p80=res.items_per_step / (t.p20_ms / 1e3), unit=f"{res.unit}/s", extra=mid, **common))
        recs.append(results.make_record(metric="model_tflops", value=res.model_tflops, unit="TFLOP/s", extra=mid, **common))
        mfu = res.mfu(ceilings)
        recs.append(results.make_record(metric="mfu", value=mfu, unit="fraction of measured bf16 matmul",
                                        status="ok" if mfu is not None else "n/a",
                                        reason=None if mfu is not None else "no bf16 ceiling measured", extra=mid, **common))
        if res.peak_mem_gib is not None:
            recs.append(results.make_record(metric="peak_mem_gib", value=res.peak_mem_gib, unit="GiB", extra=mid, **common))
        recs.append(results.make_record(metric="first_step_s", value=res.first_step_s, unit="s", extra=mid, **common))
        if res.compile_s is not None:
            recs.append(results.make_record(metric="compile_s", value=res.compile_s, unit="s", extra=mid, **common))
        recs.append(results.make_record(metric="final_loss", value=res.final_loss, unit="nats", extra=mid, **common))
        if res.host_wait_ms is not None:
            recs.append(results.make_record(metric="host_wait_ms", value=res.host_wait_ms, unit="ms",
                                            extra=mid, **common))
        if res.sdpa_backend:
            recs.append(results.make_record(metric="sdpa_backend", value=res.sdpa_backend, unit="", extra=mid, **common))
    if check is not None and check.against is not None:
        recs.append(results.make_record(metric="same_math_max_rel", value=check.max_rel_diff,
                                        unit=f"relative, tolerance {check.tolerance:.2g}",
                                        status="ok" if check.ok else "failed",
                                        reason=None if check.ok else str(check),
                                        extra={"against": check.against, **mid}, **common))
    results.append(recs, run)
    return recs


def measure(workload: str, step: str, *, notebook: str, profile: str = "auto", device="auto", run=None,
            progress: bool = True, **kw) -> tuple[StepResult, MathCheck]:
    """``run_step`` + ``same_math`` + ``record``: what every ladder notebook does per workload.
    The check's verdict is recorded before the caller asserts on it, so a failing check still
    leaves its numbers in the run."""
    res = run_step(workload, step, profile=profile, device=device, progress=progress, **kw)
    check = same_math(res, run)
    ceil = ceilings_mod.load_or_measure(resolve_device(device), run=run)
    record(res, notebook=notebook, check=check, ceilings=ceil, run=run)
    if res.status == "nonfinite":
        warnings.warn(f"{workload} {step}: {res.reason}", stacklevel=2)
    return res, check


def measure_data_wait(workload: str, step: str, *, notebook: str, also: tuple[str, ...] = (),
                      with_previous: bool = False, profile: str = "auto", device="auto", run=None, seed: int = 0,
                      progress: bool = True, settings: Settings | None = None) -> list[dict]:
    """Share of step time spent on data, for ``step`` and the steps in ``also``.

    The step runs again with every batch produced before timing and kept on the device
    (``loader="resident"``): the same model, settings and batches at zero data cost. The share is
    ``1 - t_resident / t_step``, against the step's time already recorded in this run. Steps in
    ``also`` must differ from ``step`` only in the loader, so the one resident run is their floor too.
    ``with_previous`` adds the nearest earlier step that applies to the workload. Changes of steps
    that do not apply to the workload are inert for it and are not counted as differences.
    A recorded step time is used only when its settings (but the loader), config and profile are
    the resident run's: otherwise the row says "not comparable" and why. The share is not clipped:
    a slightly negative share is noise, and ``within_noise`` says when the two p20-p80 ranges overlap.
    ``settings`` replaces the step's cumulative settings (both runs must then have used them).
    Records ``data_wait_share`` for each; returns the rows."""
    st = get_step(step)
    base = settings if settings is not None else settings_for(st.name)
    if with_previous:
        prev = previous(st.name)
        while prev is not None and applies(prev, workload):
            prev = previous(prev.name)
        if prev is not None and prev.name not in also:
            also = (*also, prev.name)
    inert = {k for s in LADDER if applies(s, workload) for k in s.change}
    for other in also:   # by the ladder's definitions; the recorded rows are checked below
        extra = set(settings_for(other).diff(settings_for(st.name))) - {"loader"} - inert
        if extra:
            raise ValueError(f"{other} differs from {st.name} in {sorted(extra)}, not only the loader: "
                             f"one resident run cannot be the floor of both")
    res = run_step(workload, st.name, profile=profile, device=device, seed=seed, progress=progress,
                   settings=dataclasses.replace(base, loader="resident"))
    if res.status != "ok":
        return [{"workload": workload, "step": s, "status": res.status, "reason": res.reason} for s in (st.name, *also)]
    recs = results.load(run)
    rows, out = [], []
    for s in (st.name, *also):
        ms = next((r for r in recs if r.get("workload") == workload and r.get("step") == s and r.get("notebook") == s
                   and r.get("metric") == "ms_per_step" and r.get("value") is not None), None)  # the ladder's own row
        if ms is None:
            rows.append({"workload": workload, "step": s, "status": "not measured",
                         "reason": f"{s} has no step time in this run: measure it first"})
            continue
        params = ms.get("params") or {}
        ignore = {"loader"} | inert
        theirs = {k: v for k, v in (params.get("settings") or {}).items() if k not in ignore}
        ours = {k: v for k, v in res.settings.items() if k not in ignore}
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if params.get("config") != res.config:
            differ.append("config")
        if ms.get("profile") != res.profile:
            differ.append("profile")
        if differ:
            rows.append({"workload": workload, "step": s, "status": "not comparable",
                         "reason": f"the recorded {s} differs from the resident run in {differ}"})
            continue
        share = 1.0 - res.timing.median_ms / ms["value"]
        noise = not (res.timing.p80_ms < (ms.get("p20") or ms["value"]) or res.timing.p20_ms > (ms.get("p80") or ms["value"]))
        loader_mode = params.get("settings", {}).get("loader")
        rows.append({"workload": workload, "step": s, "status": "ok", "loader": loader_mode, "step_ms": ms["value"],
                     "resident_ms": res.timing.median_ms, "data_wait_share": share, "within_noise": noise})
        out.append(results.make_record(
            notebook=notebook, workload=workload, step=s, metric="data_wait_share", value=share,
            unit="fraction of step time", params={"loader": loader_mode, "settings": res.settings, "seed": seed},
            device={k: res.device.get(k) for k in ("kind", "name", "capability")}, profile=res.profile,
            extra={"step_ms": ms["value"], "resident_ms": res.timing.median_ms, "within_noise": noise,
                   "resident_p20": res.timing.p20_ms, "resident_p80": res.timing.p80_ms}))
    if out:
        results.append(out, run)
    return rows
