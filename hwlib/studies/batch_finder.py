"""The batch-size finder on a real workload: each trial runs full training steps of a ``Session``
(``hwlib.memory.finder.search_batch`` is the search itself, tested without a GPU). A peak measured
earlier at the profile's batch picks where the doubling starts (``informed_start``), and a trial
already over the budget after its first step stops there: trials saved, the batch found the same."""

from __future__ import annotations

import gc

import torch

from .. import precision, results
from ..device import resolve_device, usable_memory_gib
from ..ladder.run import run_step
from ..ladder.session import Session, free
from ..memory import allocator
from ..memory.accumulation import OOM_ERRORS
from ..memory.checks import finite_number, positive_int
from ..memory.finder import GiB, FinderResult, budget_of, informed_start, search_batch
from ..profiles import Plan
from ..steps import Settings
from ..workloads import get_workload
from .memory import technique_settings


def run_steps(step, steps: int, peak_gib, budget_gib: float) -> int:
    """``step(i)`` for i = 0 .. steps - 1, stopping after a step whose peak (``peak_gib()``) is already
    over ``budget_gib``; returns the number of steps run. Such a trial fails whatever its later steps
    do (a peak only grows), so they would only cost time; its peak is then a lower bound."""
    for i in range(steps):
        step(i)
        if i + 1 < steps and peak_gib() > budget_gib:
            return i + 1
    return steps


def _check_hint(hint, start: int) -> tuple[int, float] | None:
    """``hint`` checked: None, or (batch, reserved peak GiB) measured earlier; it picks the start."""
    if hint is None:
        return None
    if not isinstance(hint, (tuple, list)) or len(hint) != 2:
        raise TypeError(f"hint must be a (batch, reserved peak GiB) pair measured earlier, got {hint!r}")
    if start != 1:
        raise ValueError(f"pass start ({start!r}) or hint, not both: the hint picks the start")
    return (positive_int("hint batch", hint[0]),
            finite_number("hint peak GiB", hint[1], low=0.0, low_open=True))


def _hint_start(hint: tuple[int, float], budget: float, max_batch: int) -> int:
    """The doubling's start from ``hint``, a power of two within ``max_batch``."""
    return min(informed_start(budget, *hint), 1 << (max_batch.bit_length() - 1))


def find_batch_size(workload: str, settings: Settings, device: torch.device | str, *, profile: str = "full",
                    margin: float = 0.1, start: int = 1, max_batch: int = 1024, steps: int = 2,
                    config: dict | None = None, hint: tuple[int, float] | None = None) -> FinderResult:
    """Largest batch of ``workload`` under ``settings`` that fits this GPU with ``margin`` to spare.
    ``config`` overrides fields of the workload's config other than the batch, which is searched.
    ``start`` (a power of two) is where the doubling begins; ``hint``, a (batch, reserved peak GiB)
    measured earlier under the same settings, picks it instead (``informed_start``). Either way the
    batch found is that of start=1: the smaller batches only locate the range."""
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be a hwlib.steps.Settings, got {type(settings).__name__}")
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device or 'cuda', got {type(device).__name__}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("find_batch_size measures GPU memory: device must be a CUDA device "
                         "(search_batch takes any measuring function)")
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config must be a dict of config fields, got {type(config).__name__}")
    config = dict(config or {})
    if "batch" in config:
        raise ValueError("config: 'batch' is what find_batch_size searches; pass start and max_batch instead")
    steps = positive_int("steps", steps, unit="step")
    max_batch = positive_int("max_batch", max_batch)
    hint = _check_hint(hint, start)
    wl = get_workload(workload)
    wl.config(profile, **config)     # a bad profile or field is named now, not as a failed trial
    gc.collect()
    torch.cuda.empty_cache()
    free_bytes, _total = torch.cuda.mem_get_info(device)
    # The device's free memory knows nothing of a per-process cap ($HWLIB_MEMORY_CAP_GIB): without
    # the min, a capped process would search for batches the allocator then refuses.
    capacity = min((free_bytes + torch.cuda.memory_reserved(device)) / GiB, usable_memory_gib(device))
    budget = budget_of(capacity, margin)
    if hint is not None:
        start = _hint_start(hint, budget, max_batch)
    allocated: dict[int, float] = {}     # batch -> peak allocated, reported beside the reserved peak
    ran: dict[int, int] = {}             # batch -> steps run (fewer than steps: stopped over the budget)
    reserved = lambda: torch.cuda.max_memory_reserved(device) / GiB

    def try_batch(b: int) -> float | None:
        sess, peak = None, None
        try:
            cfg = wl.config(profile, **{**config, "batch": b})
            torch.cuda.reset_peak_memory_stats(device)
            with precision.tf32_mode(settings.tf32):
                sess = Session(workload, cfg, settings, device)
                # The first step allocates the optimizer states; one over the budget then fails anyway.
                ran[b] = run_steps(sess.step, steps, reserved, budget)
                torch.cuda.synchronize(device)
            peak = reserved()
            allocated[b] = torch.cuda.max_memory_allocated(device) / GiB
        except OOM_ERRORS:
            peak = None
        finally:
            # Session.close already collects and empties the cache (``free``), after the error and its
            # frames are gone; a session that never built leaves only those frames to free here.
            if sess is not None:
                sess.close()
            else:
                free(device)
        return peak

    r = search_batch(try_batch, capacity, margin=margin, start=start, max_batch=max_batch)
    for t in r.trials:
        t["peak_alloc_gib"] = allocated.get(t["batch"])     # None for a batch that ran out of memory
        t["steps"] = ran.get(t["batch"])                    # None likewise
        t["peak_is_lower_bound"] = t["steps"] is not None and t["steps"] < steps
    r.allocator = allocator.settings()
    return r


def measured_hint(rows: list[dict] | None, name: str, batch: int) -> tuple[int, float] | None:
    """(batch, reserved peak GiB) of technique ``name`` in ``measure_techniques``' rows, run at the
    profile's ``batch``; None where there is no such peak (no row, not ok, accumulated in micro-batches,
    or no allocator counters): the search then starts at 1."""
    row = next((r for r in rows or [] if r.get("technique") == name), None)
    if row is None or row.get("status") != "ok" or row.get("micro_batches", 1) != 1 or not row.get("peak_reserved_gib"):
        return None
    return batch, row["peak_reserved_gib"]


def max_batches(workload: str, base_step: str, names: list[str], device: torch.device | str, *, profile: str,
                margin: float = 0.1, notebook: str, run=None, config: dict | None = None,
                measured: list[dict] | None = None) -> dict[str, FinderResult]:
    """``find_batch_size`` for each technique of the memory study on ``base_step``; each result is
    recorded as ``max_batch`` on the base step with the field ``technique``. ``measured``: the study's
    rows for this workload (``measure_techniques``, same profile and config): each technique's peak
    there picks its search's start, saving the trials at small batches."""
    found = {}
    batch = get_workload(workload).config(profile, **(config or {})).batch
    for name in names:
        settings, _ = technique_settings(base_step, name)
        f = find_batch_size(workload, settings, device, profile=profile, margin=margin, config=config,
                            hint=measured_hint(measured, name, batch))
        found[name] = f
        results.append(results.make_record(
            notebook=notebook, workload=workload, step=base_step, metric="max_batch", value=f.batch, unit="samples",
            profile=profile, device=str(torch.device(device).type), fields={"technique": name},
            params={"margin": margin, "start": f.start, "trials": f.trials, "fit": list(f.fit),
                    "predicted_peak_gib": f.predicted_peak_gib, "measured_peak_gib": f.measured_peak_gib,
                    "allocator": f.allocator}), run)
    return found


def finder_long_run(workload: str, base_step: str, result: FinderResult, *, profile: str, device: str = "cuda",
                    technique: str = "bf16", steps: int = 50, check: int = 5, notebook: str,
                    run=None, config: dict | None = None) -> dict:
    """The finder's batch trained for ``steps`` full steps in a fresh session under ``technique``: its
    measured reserved peak against the prediction, recorded as ``finder_peak_error`` (relative)."""
    steps, check = positive_int("steps", steps, unit="step"), positive_int("check", check, unit="step")
    if check >= steps:
        raise ValueError(f"check ({check}) must be fewer than steps ({steps}): the rest are timed")
    settings, _ = technique_settings(base_step, technique)
    free(resolve_device(device))     # the finder's last trial leaves nothing cached to count against this run
    r = run_step(workload, base_step, profile=profile, device=device, settings=settings,
                 plan=Plan(check=check, warmup=0, timed=steps - check),
                 config={**(config or {}), "batch": result.batch})
    ok = r.status == "ok" and r.peak_reserved_gib is not None
    err = r.peak_reserved_gib / result.predicted_peak_gib - 1 if ok else None
    row = {"batch": result.batch, "steps": len(r.losses), "status": r.status, "reason": r.reason,
           "predicted_gib": result.predicted_peak_gib, "measured_gib": r.peak_reserved_gib,
           "allocated_gib": r.peak_mem_gib, "error": err, "allocator": result.allocator}
    results.append(results.make_record(
        notebook=notebook, workload=workload, step=base_step, metric="finder_peak_error", value=err, unit="relative",
        status="failed" if r.status == "ok" and not ok else r.status,
        reason=r.reason or (None if ok else "no reserved peak measured (a CUDA device has one)"),
        profile=profile, device=r.device, fields={"technique": technique}, params=row), run)
    return row
