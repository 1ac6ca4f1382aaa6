"""The memory/speed study of notebook 13: one measurement per technique, same seed and data.

Techniques are applied on top of a base ladder step (its cumulative settings): precision, activation
checkpointing of every block (and of the output head, computed in chunks), exact accumulation of the same batch in micro-batches, optimizer
states offloaded to the host, and their combinations. Each is measured like a ladder step
(``hwlib.ladder.run_step``) and its loss curve is compared with the base: all of them but the precision
change compute the same function, so their curves must agree within the base step's tolerance.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import precision, results
from ..device import ChoiceError, resolve_device
from ..ladder.run import run_step
from ..ladder.same_math import compare_curves
from ..ladder.session import Session
from ..memory.accumulation import ResilientStep
from ..memory.checks import positive_int
from ..memory.offload import BUCKET_PARAMS
from ..memory.tracker import MemoryTracker
from ..profiles import Plan, resolve_profile
from ..steps import Settings, get_step, settings_for
from ..workloads import get_workload
from ..workloads.checkpointing import parse_checkpointing

# name: (changes to the base settings, accumulation factor)
TECHNIQUES: dict[str, tuple[dict, int]] = {
    "fp32 (TF32)": ({"autocast": None}, 1),
    "bf16": ({}, 1),
    "bf16 + checkpointing(blocks)": ({"checkpointing": "all"}, 1),
    "bf16 + checkpointing(head)": ({"checkpointing": "head"}, 1),
    "bf16 + checkpointing(every 2nd block, head)": ({"checkpointing": "every_2,head"}, 1),
    "bf16 + checkpointing(blocks, head)": ({"checkpointing": "all,head"}, 1),
    "bf16 + accumulation x4": ({}, 4),
    "bf16 + offload": ({"offload_optimizer": True}, 1),
    "bf16 + checkpointing(blocks, head) + offload": ({"checkpointing": "all,head", "offload_optimizer": True}, 1),
    "bf16 + checkpointing(blocks, head) + accumulation x4": ({"checkpointing": "all,head"}, 4),
}


def _config(config) -> dict:
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"config must be a dict of workload config fields, got {type(config).__name__}")
    return dict(config or {})


def technique_settings(base_step: str, name: str):
    if name not in TECHNIQUES:
        raise ChoiceError("technique", name, tuple(TECHNIQUES))
    change, acc = TECHNIQUES[name]
    return dataclasses.replace(settings_for(base_step), **change), acc


def measure_techniques(workload: str, base_step: str, names: list[str], *, profile: str, device: str,
                       plan: Plan | None = None, notebook: str, seed: int = 0, run=None,
                       config: dict | None = None) -> list[dict]:
    """One row per technique (time, peaks, check losses, ratios to bf16) and its records, keyed by
    the field ``technique`` on the base step."""
    config = _config(config)
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of technique names, got {names!r}")
    for name in names:          # every name checked before the first measurement
        technique_settings(base_step, name)
    rows, base = [], None
    wl = get_workload(workload)
    parts = wl.checkpoint_parts
    cfg = wl.config(resolve_profile(profile, device), **config)
    for name in names:
        settings, acc = technique_settings(base_step, name)
        blocks, head = parse_checkpointing(settings.checkpointing, cfg.n_layer)
        need = ({"blocks"} if blocks else set()) | ({"head"} if head else set())
        if need - set(parts):
            rows.append({"technique": name, "status": "n/a", "settings": dataclasses.asdict(settings), "losses": [],
                         "reason": f"{workload} cannot checkpoint its {', '.join(sorted(need - set(parts)))}",
                         "micro_batches": acc, **{k: None for k in ("ms_per_step", "ms_p20", "ms_p80", "items_per_s",
                                                                    "peak_alloc_gib", "peak_reserved_gib")}})
            continue
        micro = None
        if acc > 1:
            micro = max(1, cfg.batch // acc)
        r = run_step(workload, base_step, profile=profile, device=device, seed=seed, plan=plan, settings=settings,
                     micro_batch=micro, config=config)
        row = {"technique": name, "status": r.status, "reason": r.reason,
               "ms_per_step": r.timing.median_ms if r.timing else None,
               "ms_p20": r.timing.p20_ms if r.timing else None, "ms_p80": r.timing.p80_ms if r.timing else None,
               "items_per_s": r.items_per_s, "peak_alloc_gib": r.peak_mem_gib, "peak_reserved_gib": r.peak_reserved_gib,
               "losses": r.check_losses, "settings": r.settings, "micro_batches": acc}
        if name == "bf16":
            base = row
        rows.append(row)
    for row in rows:
        if base and row["ms_per_step"] and base["ms_per_step"]:
            row["time_vs_bf16"] = row["ms_per_step"] / base["ms_per_step"]
            row["speed_vs_bf16"] = base["ms_per_step"] / row["ms_per_step"]
        if base and row["peak_alloc_gib"] and base["peak_alloc_gib"]:
            row["memory_vs_bf16"] = row["peak_alloc_gib"] / base["peak_alloc_gib"]
        if base and row["losses"] and base["losses"]:
            row["max_rel_loss_diff_vs_bf16"] = compare_curves(row["losses"], base["losses"], 0)
    recs = []
    for row in rows:
        common = dict(notebook=notebook, workload=workload, step=base_step, profile=profile, device=device,
                      fields={"technique": row["technique"]}, params={"base_step": base_step, "settings": row["settings"], "micro_batches": row["micro_batches"]})
        if row["status"] != "ok":
            recs.append(results.make_record(metric="ms_per_step", value=None, unit="ms", status=row["status"],
                                            reason=row["reason"], **common))
            continue
        recs.append(results.make_record(metric="ms_per_step", value=row["ms_per_step"], p20=row["ms_p20"],
                                        p80=row["ms_p80"], unit="ms", **common))
        for m, unit in (("peak_alloc_gib", "GiB"), ("peak_reserved_gib", "GiB"), ("items_per_s", "items/s")):
            if row[m] is not None:
                recs.append(results.make_record(metric=m, value=row[m], unit=unit, **common))
    results.append(recs, run)
    return rows


def same_math_tolerance(base_step: str) -> float:
    """Techniques other than precision must match the base within its ladder step's tolerance."""
    return max(get_step(base_step).tolerance, 1e-2)


def phase_profile(workload: str, settings, *, profile: str, device, steps: int = 3, seed: int = 0,
                  config: dict | None = None) -> list[dict]:
    """Allocated/reserved memory per phase (forward, backward, optimizer) over a few steps."""
    steps = positive_int("steps", steps, unit="step")
    dev = resolve_device(device)
    cfg = get_workload(workload).config(resolve_profile(profile, dev), **_config(config))
    sess = Session(workload, cfg, settings, dev, seed)
    tracker = MemoryTracker(dev)
    try:
        with precision.tf32_mode(settings.tf32):
            for i in range(steps):
                batch = sess.batches(i)
                with tracker.phase("forward"), precision.autocast(settings.autocast, dev):
                    loss = sess.wl.loss(sess.fwd, batch)
                with tracker.phase("backward"):
                    loss.backward()
                    del loss
                with tracker.phase("optimizer"):
                    sess.optimizer_step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    finally:
        sess.close()
    return tracker.table()


def _simulated_oom(forward_backward, fits: int):
    """``forward_backward`` on a device that holds ``fits`` samples: larger micro-batches raise the
    out-of-memory error a GPU would (a CPU has no device memory to run out of)."""
    def fb(mb, weight):
        if mb[0].shape[0] > fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: this device fits {fits} samples)")
        return forward_backward(mb, weight)
    return fb


def resilient_steps(workload: str, base_step: str, batch: int, *, profile: str, device, steps: int = 3,
                    simulate_fits: int | None = None, seed: int = 0, notebook: str, run=None,
                    config: dict | None = None) -> tuple[ResilientStep, list[float]]:
    """``steps`` training steps of ``batch`` samples through ``ResilientStep.for_session``, starting with
    the whole batch as one micro-batch: on out-of-memory it halves the micro-batch and retries, the
    batch unchanged. ``simulate_fits`` simulates a device that fits that many samples (CPU). Recorded as
    ``oom_events`` on the base step with the field ``technique: resilient``."""
    batch, steps = positive_int("batch", batch), positive_int("steps", steps, unit="step")
    dev = resolve_device(device)
    settings = settings_for(base_step)
    cfg = get_workload(workload).config(resolve_profile(profile, dev), **{**_config(config), "batch": batch})
    sess = Session(workload, cfg, settings, dev, seed)
    try:
        with sess.precision():
            rs = ResilientStep.for_session(sess, micro_batch=batch)
            if simulate_fits is not None:
                rs.forward_backward = _simulated_oom(rs.forward_backward, positive_int("simulate_fits", simulate_fits))
            losses = [rs(sess.batches(i), step=i).item() for i in range(steps)]
    finally:
        sess.close()
    results.append(results.make_record(
        notebook=notebook, workload=workload, step=base_step, metric="oom_events", value=len(rs.events), unit="events",
        profile=profile, device=dev.type, fields={"technique": "resilient"},
        params={"batch": batch, "final_micro_batch": rs.micro, "real_oom": simulate_fits is None,
                "losses": losses}), run)
    return rs, losses


def _target(workload: str, text: str, value: float, shown: str, met: bool) -> dict:
    return {"workload": workload, "target": text, "value": value, "measured": shown, "met": met}


def memory_targets(workload: str, rows: list[dict], *, profile: str, long_run: dict | None = None,
                   bucket_params: int = BUCKET_PARAMS) -> list[dict]:
    """The study's rows (``measure_techniques``) against the targets for a model on a GPU: each
    checkpointing setting cuts peak memory by >= 40% at <= 35% extra step time; offload keeps >= 60%
    of the speed and frees the AdamW moments (8 bytes a parameter, less two buckets of staging); the
    finder's batch runs its long run within 10% of the predicted peak."""
    r = {x["technique"]: x for x in rows}
    bf, off = r["bf16"], r.get("bf16 + offload")
    if not bf.get("peak_alloc_gib"):
        raise ValueError("memory_targets needs the peaks a GPU measures: the bf16 row has none")
    out = []
    for name in [k for k in r if "checkpointing" in k and "offload" not in k and "accumulation" not in k]:
        ck = r[name]
        if ck["status"] != "ok":
            continue
        cut, extra = 1 - ck["peak_alloc_gib"] / bf["peak_alloc_gib"], ck["time_vs_bf16"] - 1
        out += [_target(workload, f"{name}: peak memory cut >= 40%", cut, f"{cut:.1%}", cut >= 0.40),
                _target(workload, f"{name}: <= 35% extra step time", extra, f"{extra:+.1%}", extra <= 0.35)]
    if off is not None and off["status"] == "ok":
        wl = get_workload(workload)
        n_params = sum(p.numel() for p in wl.build(wl.config(profile), Settings(), 0).parameters())
        states, staging = 8 * n_params / 2**30, 2 * 2 * 4 * bucket_params / 2**30
        freed = bf["peak_alloc_gib"] - off["peak_alloc_gib"]
        out += [_target(workload, "offload keeps >= 60% of the step speed", off["speed_vs_bf16"],
                        f"{off['speed_vs_bf16']:.1%}", off["speed_vs_bf16"] >= 0.60),
                _target(workload, f"offload frees the AdamW moments: 8 B/param = {states:.2f} GiB", freed,
                        f"{freed:.2f} GiB of peak freed (two buckets' staging stays: {staging:.3f} GiB)",
                        freed >= 0.95 * (states - staging))]
    if long_run and long_run.get("error") is not None:
        e = long_run["error"]
        out.append(_target(workload, "finder's batch: 50 steps, peak within 10% of prediction", e,
                           f"{long_run['steps']} steps, {e:+.1%}", abs(e) <= 0.10))
    return out


def record_targets(targets: list[dict], *, base_step: str, profile: str, device, notebook: str,
                   run=None) -> list[dict]:
    """Each target as metric ``target`` on the base step, fields {"target": text}, value the measured
    number, status ok or failed."""
    recs = [results.make_record(notebook=notebook, workload=t["workload"], step=base_step, metric="target",
                                value=t["value"], unit="", status="ok" if t["met"] else "failed", profile=profile,
                                device=resolve_device(device).type, fields={"target": t["target"]},
                                params={"measured": t["measured"]}) for t in targets]
    if recs:
        results.append(recs, run)
    return recs
