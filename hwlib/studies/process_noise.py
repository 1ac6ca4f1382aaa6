"""Noise across processes: a ladder step measured again in several fresh Python processes.

The ladder times each step once, in one process, and its p20-p80 is the spread of the steps inside
that one process. What changes from one process to the next (where the allocator puts things, the
kernels autotuning picks, the code the compiler makes, the cores the host threads land on, clocks)
is not in it; on a host-bound eager step it can be larger than the difference between two adjacent
steps of the ladder. Here a step is measured ``processes`` times exactly as the ladder measures it
(``ladder.run.run_step`` with the profile's plan, or the one given), each time in a fresh process
started through ``ablation.in_fresh_process`` (``python -m hwlib.studies.process_noise SPEC OUT``),
one at a time, never side by side: each step's first two processes back to back (the least a spread
needs), step after step, then round by round over the steps for the processes past two. A time
budget never starts a step whose two processes it cannot finish (judged by the processes so far), so
a short budget leaves whole spreads of the first steps instead of one process of every step and no
spread.

Recorded (notebook 19) per step once its last process has finished, never before (an interrupted
study keeps the steps it finished):

- each process's time: ``ms_per_step`` with fields ``{"repeat": i}`` (its p20/p80: the spread
  inside that process), with the telemetry of its timed window;
- the spread: ``process_spread`` with fields ``{"processes": n}``, the slowest process's median
  ms/step over the fastest's (1.0: every process agreed). Its interval (``hwlib.noise``, the two
  processes' steps resampled) says whether the two really differ: a lower end above 1 means the
  processes differ by more than their own step-to-step spread explains.

``choose_steps`` picks what to measure from a run's ladder rows: each workload's last step, and the
steps whose within-run p80/p20 is wide. The report (``report.tables``) marks a ladder step
"within noise" when it differs from the step before by less than the measured spread.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import noise, results
from ..device import info, resolve_device
from ..paths import run_dir
from ..profiles import Plan, plan as plan_for, resolve_profile
from ..steps import LADDER, get_step, not_applicable, unavailable
from ..workloads import get_workload
from .ablation import in_fresh_process, worker_command, worker_main

WIDE = 1.10            # a within-run p80/p20 above this counts as a wide spread (10% between p20 and p80)
SPREAD_UNIT = "x (slowest / fastest process's median ms/step)"


@dataclass(frozen=True)
class Target:
    """A ladder step to measure across processes, and why it was chosen."""
    workload: str
    step: str
    why: str


# --- what to measure ------------------------------------------------------------------------------

def _timed(r: dict) -> bool:
    return all(isinstance(r.get(k), (int, float)) and r[k] > 0 for k in ("ms_per_step", "ms_p20", "ms_p80"))


def last_recipe_step(workload: str, di) -> str | None:
    """The last step of the standard recipe that applies to ``workload`` and that the device ``di``
    can run (a workload with no ladder rows in the run yet)."""
    ok = [s.name for s in LADDER if not s.beyond_recipe and not not_applicable(s, workload) and not unavailable(s, di)]
    return ok[-1] if ok else None


def choose_steps(rows_by_workload: dict[str, list[dict]], *, last_of: list[str] | None = None,
                 threshold: float = WIDE, wide: int | None = None, di=None, recipe: bool = False) -> list[Target]:
    """The steps worth timing across processes, from ladder rows (``query.ladder_rows``'s, per workload):

    - the last step with a time of each workload of ``last_of`` (None: every workload given); with
      ``di`` (a device's facts), a workload without timed rows falls back on ``last_recipe_step``;
      with ``recipe``, where that last step is past the standard recipe, the recipe's last timed
      step follows it: the two ends of the workload's "past the recipe" ratio, each with its spread;
    - then the steps whose p80/p20 exceeds ``threshold`` (their own process already saw them wander),
      widest first, at most ``wide`` of them (None: all), from every workload given.

    Pure: the rows in, the targets out, last steps first in ``last_of``'s order."""
    if not isinstance(rows_by_workload, dict):
        raise TypeError(f"rows_by_workload must map a workload to its ladder rows, got {type(rows_by_workload).__name__}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 1:
        raise ValueError(f"threshold must be a p80/p20 ratio above 1, got {threshold!r}")
    if wide is not None and (isinstance(wide, bool) or not isinstance(wide, int) or wide < 0):
        raise ValueError(f"wide must be an int >= 0 or None, got {wide!r}")
    if last_of is None:
        last_of = list(rows_by_workload)
    elif isinstance(last_of, str) or not isinstance(last_of, (list, tuple)):
        raise ValueError(f"last_of must be a list of workload names or None, got {last_of!r}")
    out: list[Target] = []
    for w in last_of:
        timed = [r for r in rows_by_workload.get(w, []) if _timed(r)]
        if timed:
            out.append(Target(w, timed[-1]["step"], "the workload's last measured step"))
            within = [r for r in timed if not get_step(r["step"]).beyond_recipe]
            if recipe and within and within[-1] is not timed[-1]:
                out.append(Target(w, within[-1]["step"], "the recipe's last step, which the steps past it are "
                                                         "compared with"))
        elif di is not None:
            get_workload(w)   # a name that is no workload fails here, naming the choices
            step = last_recipe_step(w, di)
            if step:
                out.append(Target(w, step, "the workload's last recipe step (no ladder rows in this run)"))
    chosen = {(t.workload, t.step) for t in out}
    spread = [(r["ms_p80"] / r["ms_p20"], w, r["step"]) for w, rows in rows_by_workload.items() for r in rows
              if _timed(r) and (w, r["step"]) not in chosen and r["ms_p80"] / r["ms_p20"] > threshold]
    spread.sort(key=lambda x: -x[0])
    for s, w, step in spread[:wide]:
        out.append(Target(w, step, f"p80/p20 of {s:.2f} in its own run (above {threshold:g})"))
    return out


# --- the spread -----------------------------------------------------------------------------------

def spread(samples: list[list[float]], *, level: float = noise.DEFAULT_LEVEL, seed: int = 0) -> dict:
    """The spread of per-process median times: slowest over fastest, with the bootstrap interval of
    that ratio from the two processes' own steps (``noise.ratio_interval``, one window each).
    ``samples``: each process's per-step times (ms), at least two processes."""
    samples = noise._windows("samples", samples)   # lists of finite, positive times, or a ValueError
    if len(samples) < 2:
        raise ValueError(f"samples must hold the per-step times of at least 2 processes, got {len(samples)}")
    medians = [statistics.median(w) for w in samples]
    slow = max(range(len(medians)), key=medians.__getitem__)
    fast = min(range(len(medians)), key=medians.__getitem__)
    iv = noise.ratio_interval([samples[slow]], [samples[fast]], level=level, seed=seed)
    return {"medians": medians, "spread": medians[slow] / medians[fast], "slowest": slow, "fastest": fast,
            "lo": iv.lo, "hi": iv.hi, "level": level, "interval": iv.to_dict(),
            "beyond_steps": iv.lo > 1.0}


# --- one process ----------------------------------------------------------------------------------

def _worker(spec: dict) -> dict:
    """One repeat in this process: the step measured as the ladder measures it."""
    from ..ladder.run import run_step
    res = run_step(spec["workload"], spec["step"], profile=spec["profile"], device=spec["device"], seed=spec["seed"],
                   plan=Plan(*spec["plan"]), config=spec.get("config") or None)
    if res.status != "ok" or res.timing is None:
        return {"status": res.status if res.status != "ok" else "failed", "reason": res.reason or "no time measured"}
    # The process that started this one waits for it, idle, but may hold a CUDA context of its own
    # (notebook 19's in-process ablations ran before): on the GPU beside this one, it is not contention.
    others = None if res.contended is None else [p for p in res.contended if p != os.getppid()]
    return {"status": "ok", "samples_ms": res.timing.samples_ms, "notes": res.notes, "contended": others,
            "telemetry": res.telemetry, "compile_s": res.compile_s, "first_step_s": res.first_step_s}


_worker_command = worker_command("hwlib.studies.process_noise")


# --- the study ------------------------------------------------------------------------------------

def _targets(targets) -> list[Target]:
    if (isinstance(targets, (str, Target)) or not isinstance(targets, (list, tuple)) or not targets
            or all(isinstance(t, str) for t in targets)):   # one pair given bare: ("gpt", "09_cuda_graphs")
        raise ValueError(f"targets must be a non-empty list of (workload, step) pairs, got {targets!r}")
    out = []
    for t in targets:
        if isinstance(t, Target):
            w, s, why = t.workload, t.step, t.why
        elif isinstance(t, (list, tuple)) and len(t) in (2, 3):
            w, s, why = t[0], t[1], t[2] if len(t) == 3 else "asked for"
        else:
            raise ValueError(f"each target must be (workload, step) or a Target, got {t!r}")
        out.append(Target(get_workload(w).name, get_step(s).name, why))
    seen = [(t.workload, t.step) for t in out]
    twice = sorted({x for x in seen if seen.count(x) > 1})
    if twice:
        raise ValueError(f"targets names a step more than once: {twice}")
    return out


def _row(t: Target, **kw) -> dict:
    row = {"workload": t.workload, "step": t.step, "why": t.why, "status": "ok", "reason": None, "processes": 0,
           "medians": [], "spread": None, "lo": None, "hi": None, "level": None, "beyond_steps": None,
           "ms_min": None, "ms_max": None}
    row.update(kw)
    return row


def _records(row: dict, done: list[dict], *, profile, device, notebook, params) -> list[dict]:
    common = dict(notebook=notebook, workload=row["workload"], step=row["step"], profile=profile, device=device)
    recs = []
    for i, res in enumerate(done):
        xs = res["samples_ms"]
        others = res.get("contended")
        recs.append(results.make_record(
            metric="ms_per_step", value=statistics.median(xs), p20=noise.quantile(xs, 0.2), p80=noise.quantile(xs, 0.8),
            unit="ms", fields={"repeat": i}, telemetry=res.get("telemetry"),
            reason=f"timed beside other processes on the GPU (pids {', '.join(map(str, others))})" if others else None,
            params={**params, "why": row["why"], "compile_s": res.get("compile_s"), "notes": res.get("notes")}, **common))
    n = len(done)
    if row["status"] != "ok":
        recs.append(results.make_record(metric="process_spread", value=None, unit=SPREAD_UNIT, status=row["status"],
                                        reason=row["reason"], fields={"processes": n}, params=params, **common))
    else:
        recs.append(results.make_record(
            metric="process_spread", value=row["spread"], unit=SPREAD_UNIT, fields={"processes": n},
            reason=row["reason"],
            params={**params, "why": row["why"], "medians": row["medians"], "interval": row["interval"]}, **common))
    return recs


def measure(targets, *, processes: int = 3, profile: str = "auto", device: str = "auto", seed: int = 0,
            config: dict | None = None, level: float = noise.DEFAULT_LEVEL, timeout_s: float = 600.0,
            budget_s: float | None = None, notebook: str, run=None, progress: bool = False,
            command: Callable[[Path, Path], list[str]] | None = None, plan: Plan | None = None) -> list[dict]:
    """Each target step (``(workload, step)`` or a ``Target``) measured in ``processes`` fresh
    processes, one at a time, pairs first, then round by round (module doc). Returns a row per
    target: each process's median ms/step, the spread (slowest / fastest) and its interval at
    ``level``, ``beyond_steps`` (the interval excludes 1). A step that does not apply is an ``n/a``
    row; a process that fails ends its target (``failed`` with the reason, its finished processes
    still recorded). With ``budget_s``, a target's first process starts only if its pair fits in
    what is left at the mean process time so far, its second always follows its first, and a later
    one starts only if it fits: a target with two or more processes done records its spread over
    those, a target not started records nothing (``skipped``). ``command(spec, out)``
    builds a worker's command line (tests replace the worker). ``plan``: each process's steps (None: the
    profile's, as the ladder times the step). Every argument is checked first."""
    ts = _targets(targets)
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 2:
        raise ValueError(f"processes must be an int >= 2 (a spread needs two), got {processes!r}")
    if not (isinstance(level, float) and 0 < level < 1):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s <= 0):
        raise ValueError(f"budget_s must be a positive number of seconds or None, got {budget_s!r}")
    if plan is not None and (not isinstance(plan, Plan) or plan.check < 1 or plan.warmup < 0 or plan.timed < 1):
        raise ValueError(f"plan must be None or a Plan with check >= 1, warmup >= 0 and timed >= 1, got {plan!r}")
    run_dir(run, create=False)   # a run name outside outputs/ fails now, not after the processes ran
    dev = resolve_device(device)
    prof = resolve_profile(profile, dev)
    di = info(dev)
    pl = plan or plan_for(prof, dev.type)   # as the ladder times the step on this device
    make = command or _worker_command
    cfgs = {t: get_workload(t.workload).config(prof, **(config or {})) for t in ts}
    params = {t: {"config": dataclasses.asdict(cfgs[t]), "seed": seed, "plan": dataclasses.asdict(pl), "level": level}
              for t in ts}
    why = {t: not_applicable(get_step(t.step), t.workload) or unavailable(get_step(t.step), di) for t in ts}
    live = [t for t in ts if not why[t]]
    done: dict[Target, list[dict]] = {t: [] for t in ts}
    failed: dict[Target, dict] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(live) * processes, desc="ladder steps in fresh processes", leave=False)
    t0 = time.perf_counter()
    # Pairs first (a spread needs two), then the processes past two round by round: a drift over
    # the study falls on every step's later processes alike.
    order = ([(t, i) for t in live for i in range(2)]
             + [(t, i) for i in range(2, processes) for t in live])
    last = {t: k for k, (t, _) in enumerate(order)}   # a target's last place in the order
    took: list[float] = []
    rows: dict[Target, dict] = {}

    def finish(t: Target) -> None:
        # A target's records as soon as none of its processes is left to run: an interrupted study
        # keeps the targets it finished and records nothing of the one it was measuring.
        rows[t] = _final_row(t, done[t], why[t], failed.get(t), budget_s, processes, level, seed)
        if rows[t]["status"] != "skipped":
            results.append(_records(rows[t], done[t], profile=prof, device=di.to_dict(), notebook=notebook,
                                    params=params[t]), run)

    for t in ts:
        if why[t]:
            finish(t)

    def run_one(t: Target, i: int, tmp: str) -> None:
        if t in failed or len(done[t]) < i:      # failed, or its pair was never started
            return
        if budget_s is not None and i != 1:
            left = budget_s - (time.perf_counter() - t0)
            mean = statistics.fmean(took) if took else 0.0
            if left <= 0 or (2 if i == 0 else 1) * mean > left:
                return
        if bar is not None:
            bar.set_postfix_str(f"{t.workload} {t.step} #{i + 1}")
        spec = {"workload": t.workload, "step": t.step, "profile": prof, "device": dev.type, "seed": seed,
                "config": config or {}, "plan": [pl.check, pl.warmup, pl.timed]}
        start = time.perf_counter()
        res = in_fresh_process(make, spec, Path(tmp) / f"t{ts.index(t)}p{i}", timeout_s, prof)
        took.append(time.perf_counter() - start)
        if bar is not None:
            bar.update(1)
        if res["status"] != "ok":
            failed[t] = res
        else:
            done[t].append(res)

    with tempfile.TemporaryDirectory(prefix="hwlib-noise-") as tmp:
        for k, (t, i) in enumerate(order):
            run_one(t, i, tmp)
            if k == last[t]:   # only after its last process returned: an interruption never records it
                finish(t)
    if bar is not None:
        bar.close()
    return [rows[t] for t in ts]


def _final_row(t: Target, mine: list[dict], why: str | None, failed: dict | None, budget_s, processes: int,
               level: float, seed: int) -> dict:
    """A target's row once its processes are done: n/a, failed, skipped (fewer than two processes) or its spread."""
    row = _row(t, processes=len(mine), medians=[statistics.median(r["samples_ms"]) for r in mine])
    if why:
        row.update(status="n/a", reason=why)
    elif failed is not None:
        row.update(status=failed["status"], reason=f"process {len(mine) + 1}: {failed['reason']}"[:400])
    elif len(mine) < 2:
        return _row(t, processes=len(mine), status="skipped",
                    reason=f"the time budget ({budget_s:g} s) was spent with {len(mine)} process(es) done: "
                           f"no spread to record")
    else:
        sp = spread([r["samples_ms"] for r in mine], level=level, seed=seed)
        row.update(spread=sp["spread"], lo=sp["lo"], hi=sp["hi"], level=level, interval=sp["interval"],
                   beyond_steps=sp["beyond_steps"], ms_min=min(sp["medians"]), ms_max=max(sp["medians"]))
        if len(mine) < processes:
            row["reason"] = f"the time budget ({budget_s:g} s) ran out after {len(mine)} of {processes} processes"
    return row


def _main(argv: list[str]) -> int:
    return worker_main("hwlib.studies.process_noise", _worker, argv)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
