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
from ..memory.tracker import MemoryTracker
from ..profiles import Plan, resolve_profile
from ..steps import get_step, settings_for
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


def technique_settings(base_step: str, name: str):
    if name not in TECHNIQUES:
        raise ChoiceError("technique", name, tuple(TECHNIQUES))
    change, acc = TECHNIQUES[name]
    return dataclasses.replace(settings_for(base_step), **change), acc


def measure_techniques(workload: str, base_step: str, names: list[str], *, profile: str, device: str,
                       plan: Plan | None = None, notebook: str = "13_memory", seed: int = 0, run=None,
                       config: dict | None = None) -> list[dict]:
    """One row per technique (time, peaks, check losses, ratios to bf16) and its records, keyed by
    the field ``technique`` on the base step."""
    config = dict(config or {})
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
    dev = resolve_device(device)
    cfg = get_workload(workload).config(resolve_profile(profile, dev), **(config or {}))
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
