"""What a ladder measurement writes: its records in ``results.jsonl`` and its check curve.

Every record goes through ``results.make_record``, the one place that stamps device, versions,
commit, code digest and time. MFU is the model's TFLOP/s over the measured matmul ceiling of the
precision the step runs in (fp32, TF32, bf16, or fp16 where bf16 is missing): a fp32 step is judged
against what fp32 can do, not against tensor cores it does not use (the speed-of-light floor of the
ladder figure stays the 16-bit one: the device's limit). Without a measured ceiling it is n/a, and
above 100% it is flagged as a bad ceiling (measured under contention, or on another device), never
printed as a number.
"""

from __future__ import annotations

import math
import uuid

from .. import results
from ..ceilings import usable
from ..paths import run_dir
from .run import StepResult
from .same_math import MathCheck


def curve_path(workload: str, step: str, run=None):
    return run_dir(run) / "curves" / workload / f"{step}.json"


def curve_key(res: StepResult) -> dict:
    """What a saved curve must match to stand for ``res``'s step: config, seed, device and K."""
    return {"config": res.config, "seed": res.seed, "device": res.device.get("name"), "k": res.check_steps}


def save_curve(res: StepResult, run=None) -> None:
    """Save the step's check losses as this run's reference curve of the step (not for variants)."""
    if res.variant or res.status != "ok":
        return
    results.write_json(curve_path(res.workload, res.step, run),
                       {**curve_key(res), "losses": res.check_losses, "settings": res.settings})


def step_precision(settings: dict | None) -> str:
    """The matmul precision a step's settings run its GEMMs in: the autocast dtype, else TF32 when it
    is on, else fp32 (an FP8 step's other matmuls stay in its autocast dtype, whose ceiling it keeps)."""
    s = settings or {}
    if s.get("autocast") in ("bf16", "fp16"):
        return s["autocast"]
    return "tf32" if s.get("tf32") else "fp32"


def mfu_ceiling(ceilings: dict | None, precision: str = "bf16") -> tuple[str, float | None]:
    """(precision, TFLOP/s) of the ceiling MFU is taken against: the measured ceiling of the step's own
    ``precision``; a 16-bit step falls back to the other 16-bit ceiling where its own was not measured
    (bf16 autocast runs as fp16 on a GPU without bf16)."""
    mm = (ceilings or {}).get("matmul_tflops") or {}
    order = {"bf16": ("bf16", "fp16"), "fp16": ("fp16", "bf16")}.get(precision, (precision,))
    for prec in order:
        if usable(mm.get(prec)):   # a negative, NaN, infinite or textual ceiling is no ceiling
            return prec, mm[prec]
    return precision, None


def mfu(res: StepResult, ceilings: dict | None) -> tuple[float | None, str | None]:
    """(MFU, why it is n/a): model TFLOP/s over the measured matmul ceiling of the precision the step
    runs in (``step_precision``). Above 1.0 the ceiling is wrong: the value is withheld."""
    if not ceilings:
        return None, "no ceilings measured in this run (notebook 00 measures them)"
    prec, peak = mfu_ceiling(ceilings, step_precision(res.settings))
    if not peak:
        return None, f"no {prec} matmul ceiling measured on this device (or not a positive, finite one)"
    if not usable(res.model_tflops):
        return None, f"model TFLOP/s {res.model_tflops!r} is not a positive, finite number"
    value = res.model_tflops / peak
    if value > 1.0:
        return None, (f"bad ceiling: {res.model_tflops:.1f} TFLOP/s is above the measured {prec} ceiling "
                      f"{peak:.1f} (measured under contention or on another device?): measure it again")
    return value, None


def _check_measured(res: StepResult) -> None:
    """The numbers every rate of an ``ok`` record is made of: times positive and finite (a zero one divided
    by zero; a negative one gave negative tokens/s), items a count (none: the rate is n/a), FLOPs non-negative and finite (a
    negative count was recorded as negative TFLOP/s, status ok). ValueError naming the value."""
    t = res.timing
    for name in ("median_ms", "p20_ms", "p80_ms"):
        v = getattr(t, name)
        if not usable(v):
            raise ValueError(f"{res.workload} {res.step}: timing.{name} = {v!r} is not a positive, finite time: "
                             "no rate can be made of it")
    if isinstance(res.items_per_step, bool) or not isinstance(res.items_per_step, int) or res.items_per_step < 0:
        raise ValueError(f"{res.workload} {res.step}: items_per_step = {res.items_per_step!r} must be a count of "
                         f"{res.unit} (0: not counted, its rate n/a)")
    f = res.flops_per_step
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 0:
        raise ValueError(f"{res.workload} {res.step}: flops_per_step = {f!r} must be a non-negative, finite count")


def record(res: StepResult, *, notebook: str, check: MathCheck | None = None, ceilings: dict | None = None,
           run=None, fields: dict | None = None) -> list[dict]:
    """Write the result's metrics to the run's results.jsonl (and its check curve); returns the
    records written. ``fields`` are the measurement's x-values beyond workload and step."""
    # One id for every metric of this measurement: a re-run that records fewer metrics (a step now
    # skipped) must not be read together with the previous run's leftovers.
    mid = {"measurement": uuid.uuid4().hex[:12]}
    common = dict(notebook=notebook, workload=res.workload, step=res.step, profile=res.profile, device=res.device,
                  fields={**(fields or {}), **({"variant": True} if res.variant else {})},
                  params={"config": res.config, "settings": res.settings, "seed": res.seed,
                          "check_steps": res.check_steps, "warmup_steps": res.warmup_steps,
                          "timed_steps": res.timing.n if res.timing else 0, "notes": res.notes})

    def rec(metric, value, unit, **kw):
        return results.make_record(metric=metric, value=value, unit=unit, extra={**mid, **kw.pop("extra", {})},
                                   **kw, **common)

    if res.status == "ok" and res.timing is not None:
        _check_measured(res)
    recs = []
    if res.status != "ok" or res.timing is None:
        recs.append(rec("ms_per_step", None, "ms", status=res.status, reason=res.reason))
    else:
        t = res.timing
        contended = (f"timed beside other processes on the GPU (pids {', '.join(map(str, res.contended))}): "
                     "the time is not clean") if res.contended else None
        recs.append(rec("ms_per_step", t.median_ms, "ms", p20=t.p20_ms, p80=t.p80_ms, reason=contended,
                        extra={"contended": res.contended}, telemetry=res.telemetry))
        if res.items_per_step:
            recs.append(rec(f"{res.unit}_per_s", res.items_per_s, f"{res.unit}/s",
                            p20=res.items_per_step / (t.p80_ms / 1e3), p80=res.items_per_step / (t.p20_ms / 1e3)))
        else:   # a rate of nothing counted is no rate (it was recorded as 0 tokens/s, status ok)
            recs.append(rec(f"{res.unit}_per_s", None, f"{res.unit}/s", status="n/a",
                            reason=f"no {res.unit} counted per step"))
        recs.append(rec("model_tflops", res.model_tflops, "TFLOP/s"))
        value, why = mfu(res, ceilings)
        recs.append(rec("mfu", value, f"fraction of measured {mfu_ceiling(ceilings, step_precision(res.settings))[0]} matmul",
                        status="ok" if value is not None else "n/a", reason=why))
        optional = (("peak_mem_gib", res.peak_mem_gib, "GiB"), ("first_step_s", res.first_step_s, "s"),
                    ("compile_s", res.compile_s, "s"), ("final_loss", res.final_loss, "nats"),
                    ("host_wait_ms", res.host_wait_ms, "ms"), ("sdpa_backend", res.sdpa_backend, ""),
                    ("op_backends", res.op_backends, ""))
        recs += [rec(m, v, u) for m, v, u in optional if v is not None]
    if check is not None and check.against is not None:
        recs.append(rec("same_math_max_rel", check.max_rel_diff, f"relative, tolerance {check.tolerance:.2g}",
                        status="ok" if check.ok else "failed", reason=None if check.ok else str(check),
                        extra={"against": check.against}))
    results.append(recs, run)
    save_curve(res, run)
    return recs
