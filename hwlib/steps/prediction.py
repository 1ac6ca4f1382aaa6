"""A step's roofline prediction (``hwlib.roofline``): what its ``predict`` counts, at the run's ceilings,
with the step's floor, before the step is measured."""

from __future__ import annotations

from ..ceilings import usable
from ..roofline import Context, Prediction, flops_ms
from ..workloads import get_workload
from .ladder import get_step, not_applicable, previous, settings_for


def precision_of(step: str) -> str:
    """The matmul precision a step runs its fp32 model in: 'bf16', 'tf32' or 'fp32'."""
    s = settings_for(step)
    return "bf16" if s.autocast else "tf32" if s.tf32 else "fp32"


def floor_ms(workload: str, step: str, profile: str, ceilings: dict | None) -> float | None:
    """The step's model FLOPs at the matmul ceiling of its precision (the speed-of-light floor)."""
    wl = get_workload(workload)
    flops = wl.flops_per_step(wl.config(profile))
    if not usable(flops):   # a floor of no (or negative) FLOPs is a wrong count, never a time
        raise ValueError(f"{workload}'s flops_per_step at profile {profile!r} is {flops!r}: a floor needs a positive, "
                         "finite FLOP count")
    return flops_ms(flops, ceilings, precision_of(step))


def predict(workload: str, step: str, profile: str, ceilings: dict | None,
            prev_ms: float | None = None) -> Prediction:
    """What ``step`` should save for ``workload`` against the step before, at ``ceilings``.
    ``prev_ms``: the measured time of the step before (for the bound of overhead-only changes, and the cap
    of every saving: ``Prediction.clamp_to_step``); a positive, finite number of ms (ValueError naming it)."""
    if prev_ms is not None and not usable(prev_ms):
        raise ValueError(f"prev_ms (the step before's measured time) must be a positive, finite number of ms, "
                         f"got {prev_ms!r}")
    st = get_step(step)
    why_na = not_applicable(st, workload)
    if why_na:
        return Prediction(workload, st.name, "n/a", why_na)
    prev = previous(st.name)
    ctx = Context(workload=workload, step=st.name, profile=profile, cfg=get_workload(workload).config(profile),
                  ceilings=ceilings, elem=2 if settings_for(st.name).autocast else 4,
                  precision=precision_of(st.name), before=precision_of(prev.name) if prev else None,
                  prev_ms=prev_ms,
                  prev_floor_ms=floor_ms(workload, prev.name, profile, ceilings) if prev and ceilings else None)
    p = st.predict(ctx) if st.predict is not None else None
    if p is None:
        p = Prediction(workload, st.name, "none", f"{st.title}: nothing the roofline counts")
    p.floor_ms = floor_ms(workload, st.name, profile, ceilings) if ceilings else None
    if not ceilings:
        p.saved_ms, p.missing = None, "needs notebook 00's ceilings in this run"
    return p.clamp_to_step(prev_ms)
