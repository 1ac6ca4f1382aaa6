"""How a claim's figure is read off a run's records, always through ``hwlib.query``.

A lookup says which records to compare, by the records' fields, never by the text of a metric's
name:

- ``Ladder``: two steps of a workload's cumulative ladder (``query.ladder_rows``): the throughput
  ratio, or the cut in peak memory. ``"prev"`` is the nearest earlier step that was measured,
  ``"last"`` the last one;
- ``Technique``: two techniques of the memory study (notebook 13), records with the field
  ``technique`` on the same base step;
- ``Records``: records of one metric that differ in one field (``backend`` of the BK-Core grid,
  ``dtype`` of the matmul ceilings, ``vocab_multiple`` of notebook 07's eager runs);
- ``Value``: one record's value (the N where the seed's recursion breaks, OOM events survived,
  the data-wait share);
- ``NotHere``: what the lab cannot measure yet, and why.

``measure(lookup, run)`` gives the figure with the workload and device it came from, or the reason
there is none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import query
from ..paths import REPO_ROOT, read_dir

QUANTITIES = ("speed", "slowdown", "memory_cut", "first_failing_n", "survived", "share", "relative")


# --- what to look up -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Ladder:
    """``after`` against ``before`` on a workload's ladder. ``quantity``: ``speed`` (throughput
    ratio) or ``memory_cut`` (1 - peak after / peak before)."""
    before: str
    after: str
    quantity: str = "speed"
    workloads: tuple[str, ...] | None = None   # None: the seed's


@dataclass(frozen=True)
class Technique:
    """Two techniques of the memory study on the same base step (records with the field
    ``technique``). ``quantity``: ``speed`` (time before / after), ``slowdown`` (time after /
    before) or ``memory_cut`` (1 - peak allocated after / before)."""
    before: str
    after: str
    quantity: str = "speed"
    workloads: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Records:
    """Records of ``metric`` under one workload that differ in the field ``key``: the record with
    ``key`` = ``before`` against the best of those with ``key`` in ``after``. ``at``: fields both
    share (e.g. the grid point ``{"B": 8192, "N": 2048}``); ``before_metric``: the compared record's
    metric where it differs (a solver's time against a kernel's). ``lower_is_better`` for times."""
    workload: str | None
    metric: str
    key: str
    before: object
    after: tuple
    at: dict = field(default_factory=dict)
    before_metric: str | None = None
    lower_is_better: bool = True


@dataclass(frozen=True)
class Value:
    """One record's value: ``metric`` with ``fields``, on ``step`` (None: any step). ``quantity``:
    ``first_failing_n`` (premise check against the seed's N), ``survived`` (events a run came
    through), ``share`` (a fraction), ``relative`` (an error)."""
    metric: str
    quantity: str
    step: str | None = None
    fields: dict = field(default_factory=dict)
    workloads: tuple[str | None, ...] | None = None


@dataclass(frozen=True)
class NotHere:
    reason: str


def quantity_of(lk) -> str:
    return lk.quantity if isinstance(lk, (Ladder, Technique, Value)) else "speed"


# --- reading a run -------------------------------------------------------------------------------

@dataclass
class Measured:
    value: float | None = None
    workload: str | None = None
    gpu: str | None = None
    kind: str | None = None          # device kind of the records: "cuda", "cpu"
    frm: str | None = None
    to: str | None = None
    noise: float = 0.0               # the wider relative p20-p80 half-spread of the two timings
    reason: str | None = None        # why there is no value
    notes: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def spread(ms, p20, p80) -> float:
    """Half the p20-p80 spread of a timing, relative to its median (0 when unknown)."""
    ms, p20, p80 = _num(ms), _num(p20), _num(p80)
    if not ms or p20 is None or p80 is None:
        return 0.0
    return max(0.0, (p80 - p20) / ms / 2)


def _most(values: list):
    return max(set(values), key=values.count) if values else None


class RunRecords:
    """A run's records with the look-ups claims need: ladder rows (cached), the newest record
    matching fields, and the device a record was measured on."""

    def __init__(self, records: list[dict]):
        self.records = records
        self.gpu = _most([(r.get("device") or {}).get("name") for r in records if (r.get("device") or {}).get("name")])
        self.kind = _most([(r.get("device") or {}).get("kind") for r in records if (r.get("device") or {}).get("kind")])
        self._ladders: dict = {}

    def ladder(self, workload: str) -> list[dict]:
        if workload not in self._ladders:
            self._ladders[workload] = query.ladder_rows(self.records, workload)
        return self._ladders[workload]

    def newest(self, **match) -> dict | None:
        """The newest record whose keys or fields equal ``match`` (file order breaks ties)."""
        hits = query.select(self.records, **match)
        return sorted(hits, key=lambda r: r.get("time") or "")[-1] if hits else None

    def ladder_record(self, workload: str, step: str, metric: str) -> dict | None:
        """The ladder's own record of ``step`` (a record with fields belongs to a study)."""
        hits = [r for r in query.select(self.records, workload=workload, step=step, metric=metric)
                if not r.get("fields")]
        return sorted(hits, key=lambda r: r.get("time") or "")[-1] if hits else None

    def device_of(self, rec: dict | None) -> tuple[str | None, str | None]:
        d = (rec or {}).get("device") or {}
        return d.get("name") or self.gpu, d.get("kind") or self.kind


def _ladder_pair(run: RunRecords, w: str, lk: Ladder):
    """(before row, after row) of ``w``'s ladder, or why there is no such pair."""
    rows = run.ladder(w)
    if not rows:
        return f"{w} is not in this run"
    by = {r["step"]: r for r in rows}
    if lk.after == "last":
        ok = [r for r in rows if r["throughput"]]
        if not ok:
            return f"no step of {w} was measured"
        after = ok[-1]
    else:
        after = by.get(lk.after)
        if after is None:
            return f"{lk.after} of {w} is not in this run"
        if after["status"] != "ok" or not after["throughput"]:
            return f"{lk.after} is {after['status']} for {w}" + (f": {after['reason']}" if after.get("reason") else "")
    if lk.before == "prev":   # the measured step it builds on (its chain: 21 builds on 17, not on 18)
        before = by.get(after.get("prev_step") or "")
        if before is None:
            return f"no step of {w} before {after['step']} was measured"
    else:
        before = by.get(lk.before)
        if before is None or not before["throughput"]:
            return f"{lk.before} of {w} is not measured in this run"
    if before is after:
        return f"{w} has a single measured step"
    return before, after


def _ladder_ratio(m: Measured, lk: Ladder, before: dict, after: dict) -> str | None:
    """Fill ``m.value`` (and ``m.noise``) from two ladder rows; the reason when it cannot."""
    if lk.quantity == "speed":
        m.value = after["throughput"] / before["throughput"]
        m.noise = max(spread(before["ms_per_step"], before["ms_p20"], before["ms_p80"]),
                      spread(after["ms_per_step"], after["ms_p20"], after["ms_p80"]))
        return None
    if lk.quantity == "memory_cut":
        if not before["peak_mem_gib"] or after["peak_mem_gib"] is None:
            return f"no peak memory recorded for {m.workload}"
        m.value = 1.0 - after["peak_mem_gib"] / before["peak_mem_gib"]
        return None
    raise ValueError(f"Ladder quantity {lk.quantity!r}: use 'speed' or 'memory_cut'")


def _measure_ladder(run: RunRecords, lk: Ladder, prefs: tuple) -> Measured:
    first_reason = None
    for i, w in enumerate(prefs):
        pair = _ladder_pair(run, w, lk)
        if isinstance(pair, str):
            first_reason = first_reason or pair
            continue
        before, after = pair
        m = Measured(workload=w, frm=before["step"], to=after["step"])
        m.gpu = after.get("device") or run.gpu
        m.kind = run.device_of(run.ladder_record(w, after["step"], "ms_per_step"))[1]
        why = _ladder_ratio(m, lk, before, after)
        if why:
            first_reason = first_reason or why
            continue
        if "math changed" in (before["status"], after["status"]):
            m.reason = f"the math changed at {after['step']} beyond its tolerance: the ratio is not the same change"
        if after.get("sdpa_backend") and "04_sdpa" in after["step"]:
            m.notes.append(f"SDPA backend that ran: {after['sdpa_backend']}")
        if i:
            m.notes.append(f"nearest measured workload ({first_reason})")
        return m
    return Measured(reason=first_reason or "no workload to measure on")


def _technique_pair(run: RunRecords, w: str, lk: Technique, metric: str):
    """(before, after) records of the two techniques on the same base step, newest first."""
    afters = query.select(run.records, workload=w, metric=metric, technique=lk.after)
    for b in sorted(afters, key=lambda r: r.get("time") or "", reverse=True):
        a = run.newest(workload=w, step=b.get("step"), metric=metric, technique=lk.before)
        if a is not None:
            return a, b
    return None, (afters[0] if afters else None)


def _measure_technique(run: RunRecords, lk: Technique, prefs: tuple) -> Measured:
    metric = "peak_alloc_gib" if lk.quantity == "memory_cut" else "ms_per_step"
    first_reason = None
    for i, w in enumerate(prefs):
        a, b = _technique_pair(run, w, lk, metric)
        va, vb = _num((a or {}).get("value")), _num((b or {}).get("value"))
        if not va or vb is None or (a or {}).get("status", "ok") != "ok" or (b or {}).get("status", "ok") != "ok":
            missing = lk.after if vb is None else lk.before
            first_reason = first_reason or f"memory study '{missing}' of {w} is not in this run"
            continue
        gpu, kind = run.device_of(b)
        m = Measured(workload=w, gpu=gpu, kind=kind, frm=lk.before, to=lk.after)
        if lk.quantity == "speed":
            m.value = va / vb
        elif lk.quantity == "slowdown":
            m.value = vb / va
        elif lk.quantity == "memory_cut":
            m.value = 1.0 - vb / va
        else:
            raise ValueError(f"Technique quantity {lk.quantity!r}: use 'speed', 'slowdown' or 'memory_cut'")
        if lk.quantity != "memory_cut":
            m.noise = max(spread(va, a.get("p20"), a.get("p80")), spread(vb, b.get("p20"), b.get("p80")))
        if i:
            m.notes.append(f"nearest measured workload ({first_reason})")
        return m
    return Measured(reason=first_reason or "no workload to measure on")


def _measure_records(run: RunRecords, lk: Records) -> Measured:
    before_metric = lk.before_metric or lk.metric
    a = run.newest(workload=lk.workload, metric=before_metric, **lk.at, **{lk.key: lk.before})
    va = _num((a or {}).get("value"))
    if not va:
        return Measured(reason=f"{before_metric} with {lk.key} {lk.before} is not in this run")
    cands = []
    for x in lk.after:
        b = run.newest(workload=lk.workload, metric=lk.metric, **lk.at, **{lk.key: x})
        vb = _num((b or {}).get("value"))
        if vb:
            cands.append((vb, x, b))
    if not cands:
        return Measured(reason=f"{lk.metric} with {lk.key} {', '.join(str(x) for x in lk.after)} is not in this run")
    vb, x, b = (min if lk.lower_is_better else max)(cands, key=lambda c: c[0])
    gpu, kind = run.device_of(b)
    m = Measured(workload=lk.workload, gpu=gpu, kind=kind, frm=str(lk.before), to=str(x))
    m.value = va / vb if lk.lower_is_better else vb / va
    m.noise = max(spread(va, a.get("p20"), a.get("p80")), spread(vb, b.get("p20"), b.get("p80")))
    if len(lk.after) > 1:
        m.notes.append(f"fastest of {', '.join(str(c) for c in lk.after)}: {x}")
    return m


def _measure_value(run: RunRecords, lk: Value, prefs: tuple) -> Measured:
    where = {"step": lk.step} if lk.step is not None else {}
    for w in prefs:
        r = run.newest(workload=w, metric=lk.metric, **where, **lk.fields)
        v = _num((r or {}).get("value"))
        if v is None:
            continue
        gpu, kind = run.device_of(r)
        m = Measured(value=v, workload=w, gpu=gpu, kind=kind, to=lk.step or lk.metric)
        m.extra = dict(r.get("params") or {})
        return m
    at = f"{lk.step}: " if lk.step else ""
    fields = f" ({', '.join(f'{k} {v}' for k, v in lk.fields.items())})" if lk.fields else ""
    return Measured(reason=f"{at}{lk.metric}{fields} is not in this run")


def measure_one(run: RunRecords, lk, workloads: tuple) -> Measured:
    """One lookup against a run; ``workloads`` are tried in order where the lookup names none."""
    if isinstance(lk, NotHere):
        return Measured(reason=lk.reason)
    if isinstance(lk, Ladder):
        return _measure_ladder(run, lk, lk.workloads or workloads)
    if isinstance(lk, Technique):
        return _measure_technique(run, lk, lk.workloads or workloads)
    if isinstance(lk, Records):
        return _measure_records(run, lk)
    if isinstance(lk, Value):
        return _measure_value(run, lk, lk.workloads or workloads)
    raise TypeError(f"unknown lookup {type(lk).__name__}: use Ladder, Technique, Records, Value or NotHere")


# How each quantity reads in the claims tables; a quantity not listed prints as a plain number.
QUANTITY_FORMATS = {
    "speed": lambda v: f"{v:.2f}x",
    "memory_cut": lambda v: f"{-v:+.0%} memory",
    "slowdown": lambda v: f"{v - 1:+.0%} time",
    "first_failing_n": lambda v: f"misses 1e-4 from N = {v:.0f}",
    "survived": lambda v: f"{v:.0f} OOM event(s) survived",
    "share": lambda v: f"{v:.1%}",            # of what: the claim's "compares" column says
    "relative": lambda v: f"{v:.1%} off",
}


def fmt_measured(quantity: str, v: float | None) -> str:
    """A measured figure as the claims tables show it."""
    if v is None:
        return "-"
    return QUANTITY_FORMATS.get(quantity, lambda x: f"{x:g}")(v)


def measure(lookup, run=None, workloads: tuple[str, ...] = ()) -> dict:
    """One lookup (``Ladder``, ``Technique``, ``Records``, ``Value``) against a run (name, folder,
    list of records, or a ``RunRecords`` that several lookups share), trying ``workloads`` in order
    where the lookup names none. Returns value, text, workload, gpu, kind, from, to, reason (why there
    is no value) and notes."""
    run = run if isinstance(run, RunRecords) else RunRecords(load_records(run))
    m = measure_one(run, lookup, tuple(workloads))
    return {"value": m.value, "text": fmt_measured(quantity_of(lookup), m.value), "workload": m.workload,
            "gpu": m.gpu, "kind": m.kind, "from": m.frm, "to": m.to, "reason": m.reason, "notes": list(m.notes)}


def gpu_of(records: list[dict]) -> str | None:
    """The device most of a run's records were measured on."""
    return RunRecords(records).gpu


def load_records(run) -> list[dict]:
    """Records of a run given by name, folder or as a list; a run that does not exist has none
    (and its folder is not created). Committed references are found wherever outputs/ points
    (``paths.read_dir``)."""
    if isinstance(run, list):
        return run
    if run is not None and not (read_dir(run) / query.RESULTS_FILE).exists():
        return []
    return query.load(run)


def default_run() -> Path:
    """The reference run of this machine's GPU if there is one, else the H100 reference."""
    ref = REPO_ROOT / "outputs" / "reference"
    try:
        import torch
        if torch.cuda.is_available():
            from ..device import short_name
            mine = ref / short_name(torch.cuda.get_device_name())
            if (mine / query.RESULTS_FILE).exists():
                return mine
    except Exception:   # no usable CUDA: the H100 reference stands in
        pass
    return ref / "h100"
