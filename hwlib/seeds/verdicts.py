"""Each seed claim's verdict beside what a run measured for the same change.

=================  ===========================================================================
``holds``          the measured gain reaches the claim's lower bound, beyond the timings' spread
                   (or the cost stays within the claimed cost)
``partly``         a real gain (beyond the p20-p80 spread of the two timings), below the claim
``within noise``   the ratio's interval contains the claim (or, without one, no gain): the
                   bootstrap interval of interleaved A/B windows where an ablation measured it
                   (``hwlib.noise``), else the p20-p80 spread of the two timings
``fails``          no gain, or a loss, or a cost above the one claimed
``premise fails``  the claimed change did not run, or does not do what the claim says; the
                   measured column then shows what the change does when it does run
``not measured``   the run lacks the step, or the lab lacks the hardware or workload; the note
                   says which
=================  ===========================================================================

A run made on a CPU (the smoke profile) yields no verdict on a GPU claim: its ratios are shown,
its verdicts are ``not measured``.
"""

from __future__ import annotations

from .data import CLAIMS, SEEDS, Claim
from .lookup import Measured, RunRecords, fmt_measured, load_records, measure_one, quantity_of

VERDICTS = ("holds", "partly", "within noise", "fails", "premise fails", "not measured")


SHARE_TOLERANCE = 0.10      # a claimed share holds within 10 percentage points


def verdict(quantity: str, measured: float | None, bound: float | None, noise: float = 0.0,
            interval: tuple[float, float] | None = None) -> str:
    """The verdict of a measured value against a claim (premise checks aside).

    ``speed``: the ratio's interval is ``measured`` -/+ ``noise`` (the wider relative p20-p80
    half-spread of the two timings). It holds when the whole interval is at or above ``bound``;
    it is within noise when the interval contains ``bound`` (or, without a bound, contains 1: a gain
    this run cannot tell from none); below it, partly for a gain the interval shows (above 1), else
    fails. ``memory_cut``: holds at or above ``bound``, partly for any cut below it, else fails.
    ``slowdown`` (a claimed cost): holds at or below ``bound``, else fails. ``survived``: holds
    from one event on. ``share`` (a claimed share of time): holds within ``SHARE_TOLERANCE`` of
    ``bound``, else fails; a share with no claimed figure has no verdict. Without a bound, any real
    gain holds.

    ``interval`` (lo, hi): a measured interval of the value (an ablation's bootstrap interval,
    ``hwlib.noise``) used instead of ``measured`` -/+ ``noise``. A ``share`` with an interval holds
    when the whole interval lies within ``SHARE_TOLERANCE`` of ``bound``, fails when it lies wholly
    outside that band, and is within noise otherwise."""
    if measured is None:
        return "not measured"
    if interval is not None:
        # A percentile interval of a few resampled windows can miss its own point estimate: widen it to it.
        lo, hi = min(interval[0], measured), max(interval[1], measured)
    if quantity == "speed":
        if interval is None:
            lo, hi = measured * (1.0 - noise), measured * (1.0 + noise)
        target = 1.0 if bound is None else bound
        if lo >= target and (bound is not None or lo > 1.0):
            return "holds"
        if lo <= target <= hi:
            return "within noise"
        return "partly" if lo > 1.0 else "fails"
    if quantity == "memory_cut":
        if bound is None:
            return "holds" if measured > 0 else "fails"
        return "holds" if measured >= bound else "partly" if measured > 0 else "fails"
    if quantity == "slowdown":
        return "holds" if bound is None or measured <= bound else "fails"
    if quantity == "survived":
        return "holds" if measured >= 1 else "fails"
    if quantity == "share" and bound is not None and interval is not None:
        band_lo, band_hi = bound - SHARE_TOLERANCE, bound + SHARE_TOLERANCE
        if band_lo <= lo and hi <= band_hi:
            return "holds"
        return "fails" if hi < band_lo or lo > band_hi else "within noise"
    if quantity == "share" and bound is not None:
        # A claimed share is an "about" figure ("~70%"): read as that share +/- SHARE_TOLERANCE;
        # more than that either way and the write-up's account of where the time goes is wrong.
        return "holds" if abs(measured - bound) <= SHARE_TOLERANCE else "fails"
    return "not measured"


def judge(c: Claim, m: Measured) -> tuple[str, list[str]]:
    """A claim's verdict on what was measured, with the notes that explain it."""
    q = quantity_of(c.measure)
    notes = [c.premise] if c.premise else []
    if c.premise:
        return "premise fails", notes
    if q == "first_failing_n":
        if m.value is not None and m.value <= c.bound:
            return "premise fails", notes
        if m.value is not None:
            notes.append(f"the recursion holds to N = {m.value:.0f}; its speed is not measured")
        return "not measured", notes
    if m.value is None or m.reason:
        return "not measured", notes
    if m.kind and m.kind != "cuda":
        return "not measured", notes + [f"measured on {m.kind} (smoke check): no verdict on a GPU claim"]
    if q == "survived" and m.extra.get("real_oom") is False:
        return "not measured", notes + ["the OOM was simulated, not a real CUDA out-of-memory error"]
    iv = measured_interval(m)
    v = verdict(q, m.value, c.bound, m.noise, interval=iv if (iv and "interval" in m.extra) else None)
    if v == "within noise" and "interval" in m.extra:
        notes.append(f"the {m.extra['interval'].get('level', 0):.0%} interval of the interleaved A/B windows contains "
                     f"{'the claim' if c.bound is not None else 'no gain'}")
    elif v == "within noise":
        notes.append(f"within the timings' p20-p80 spread (+/-{m.noise:.0%})")
    return v, notes


def measured_interval(m: Measured) -> tuple[float, float] | None:
    """The interval a verdict is judged on: an ablation's bootstrap interval where the record has
    one (``hwlib.noise``), else a speed's value -/+ the p20-p80 half-spread; None for a single value."""
    iv = m.extra.get("interval") if isinstance(m.extra, dict) else None
    if isinstance(iv, dict) and isinstance(iv.get("lo"), (int, float)) and isinstance(iv.get("hi"), (int, float)):
        return float(iv["lo"]), float(iv["hi"])
    if m.value is not None and m.noise:
        return m.value * (1.0 - m.noise), m.value * (1.0 + m.noise)
    return None


# Why a measured figure has no interval, by quantity: said in the interval's place, never left blank.
NO_INTERVAL = {
    "memory_cut": "none: peak memory, one reading (the allocations repeat; no timing noise)",
    "first_failing_n": "none: an exact count against a float64 reference",
    "survived": "none: a count of events",
    "relative": "none: one measurement against a reference",
}


def interval_text(quantity: str, iv: tuple[float, float] | None, level: float | None = None,
                  measured: bool = True) -> str:
    """An interval as the claims tables show it ('1.02-1.09x (90%)'); without one, why not
    (``NO_INTERVAL``; a timing without a recorded spread: 'none: one measurement, no spread recorded');
    '-' only where nothing was measured."""
    if iv is None:
        if not measured:
            return "-"
        return NO_INTERVAL.get(quantity, "none: one measurement, no spread recorded")
    lo, hi = (fmt_measured(quantity, v) for v in iv)
    return f"{lo.rstrip('x')}-{hi}" + (f" ({level:.0%})" if level else " (p20-p80)")


def _also(run: RunRecords, c: Claim, m: Measured) -> list[str]:
    """The numbers of a claim's side lookups, as notes."""
    out = []
    for label, lk in c.also:
        am = measure_one(run, lk, SEEDS[c.seed].workloads)
        if am.value is not None:
            where = f" on {am.workload}" if am.workload and am.workload != m.workload else ""
            out.append(f"{label}{where}: {fmt_measured(quantity_of(lk), am.value)}")
    return out


def evaluate(run=None, *, elsewhere: tuple = ()) -> list[dict]:
    """One row per claim: seed, claim, claimed, measured, workload, gpu, verdict, note (and
    compares, from/to, measured_text, quantity). ``run``: a run name or folder as
    ``query.load`` takes it, or a list of records. ``elsewhere``: runs (names) to read a claim
    from when ``run`` cannot measure it (a claim about several GPUs, for a one-GPU run); the
    note then names the run it came from."""
    r = RunRecords(load_records(run))
    others = [(name, RunRecords(load_records(name))) for name in elsewhere]
    rows = []
    for c in CLAIMS:
        q = quantity_of(c.measure)
        m = measure_one(r, c.measure, SEEDS[c.seed].workloads)
        came_from = None
        for name, other in others if m.value is None else ():
            mo = measure_one(other, c.measure, SEEDS[c.seed].workloads)
            if mo.value is not None:
                m, came_from = mo, name
                break
        v, notes = judge(c, m)
        if came_from:
            notes.insert(0, f"measured in {came_from} ({m.gpu}): this run cannot measure it")
        if m.reason:
            notes.append(m.reason)
        notes += m.notes
        if c.note:
            notes.append(c.note)
        notes += _also(r, c, m)
        iv = measured_interval(m) if m.value is not None else None
        level = (m.extra.get("interval") or {}).get("level") if isinstance(m.extra, dict) else None
        rows.append({"seed": c.seed, "claim": c.claim, "claimed": c.claimed, "compares": c.compares,
                     "measured": m.value, "measured_text": fmt_measured(q, m.value), "quantity": q,
                     "lo": iv[0] if iv else None, "hi": iv[1] if iv else None,
                     "interval_text": interval_text(q, iv, level, measured=m.value is not None),
                     "workload": m.workload, "gpu": m.gpu if m.value is not None else None,
                     "from": m.frm, "to": m.to, "verdict": v, "note": "; ".join(n for n in notes if n)})
    return rows
