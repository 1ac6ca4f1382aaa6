"""Share of step time spent waiting for data: a step against the same step with every batch made
before timing and kept on the device (zero data cost)."""

from __future__ import annotations

import dataclasses

from .. import results
from ..ladder.run import run_step
from ..steps import LADDER, Settings, get_step, not_applicable, previous, settings_for


def measure_data_wait(workload: str, step: str, *, notebook: str, recorded: list[dict], also: tuple[str, ...] = (),
                      with_previous: bool = False, profile: str = "auto", device="auto", run=None, seed: int = 0,
                      progress: bool = True, settings: Settings | None = None) -> list[dict]:
    """Share of step time spent on data, for ``step`` and the steps in ``also``.

    The step runs again with every batch produced before timing and kept on the device
    (``loader="resident"``): the same model, settings and batches at zero data cost. The share is
    ``1 - t_resident / t_step``, against the step's time already recorded in this run, taken from
    ``recorded`` (the run's records, which the caller reads: ``hwlib.query.load``). Steps in
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
        while prev is not None and not_applicable(prev, workload):
            prev = previous(prev.name)
        if prev is not None and prev.name not in also:
            also = (*also, prev.name)
    inert = {k for s in LADDER if not_applicable(s, workload) for k in s.change}
    for other in also:   # by the ladder's definitions; the recorded rows are checked below
        extra = set(settings_for(other).diff(settings_for(st.name))) - {"loader"} - inert
        if extra:
            raise ValueError(f"{other} differs from {st.name} in {sorted(extra)}, not only the loader: "
                             f"one resident run cannot be the floor of both")
    steps = (st.name, *also)
    rows_of = {s: next((r for r in recorded if r.get("workload") == workload and r.get("step") == s
                        and r.get("notebook") == s and r.get("metric") == "ms_per_step"
                        and r.get("value") is not None and not r.get("fields")), None)  # the ladder's own row
               for s in steps}
    if all(ms is None for ms in rows_of.values()):   # nothing to set the resident run against: not run
        return [{"workload": workload, "step": s, "status": "not measured",
                 "reason": f"{s} has no step time in this run: measure it first"} for s in steps]
    res = run_step(workload, st.name, profile=profile, device=device, seed=seed, progress=progress,
                   settings=dataclasses.replace(base, loader="resident"))
    if res.status != "ok":
        return [{"workload": workload, "step": s, "status": res.status, "reason": res.reason} for s in steps]
    rows, out = [], []
    for s in steps:
        ms = rows_of[s]
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
            device=res.device, profile=res.profile,
            extra={"step_ms": ms["value"], "resident_ms": res.timing.median_ms, "within_noise": noise,
                   "resident_p20": res.timing.p20_ms, "resident_p80": res.timing.p80_ms}))
    if out:
        results.append(out, run)
    return rows
