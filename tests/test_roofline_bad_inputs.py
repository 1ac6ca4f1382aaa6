"""The roofline's numbers from odd inputs: a ceiling that is not a positive, finite number, a count that is
not finite, a floor of no FLOPs, a measured time that is not one, a predicted saving larger than the step it
saves from, and a ladder record of a zero time or a negative count. Each is a clear error naming the value,
or a clamp whose reason the prediction carries (docs/integrity.md, "Negative floors and predictions")."""

from __future__ import annotations

import math
import re

import pytest

from hwlib import roofline
from hwlib.bench import Timing
from hwlib.ladder import record as record_mod
from hwlib.ladder.run import StepResult
from hwlib.steps import predict
from hwlib.studies import breakdown
from hwlib.workloads import get_workload

GOOD = {"copy_gbps": 100.0, "matmul_tflops": {"fp32": 1.0, "tf32": 2.0, "bf16": 4.0, "fp16": 4.0}}


def _with(**mm):
    return {"copy_gbps": GOOD["copy_gbps"], "matmul_tflops": {**GOOD["matmul_tflops"], **mm}}


@pytest.mark.parametrize("bad", [-5.0, 0.0, float("nan"), float("inf"), "fast", True])
def test_a_ceiling_that_is_not_a_positive_finite_number_is_an_error_naming_it(bad):
    """A negative ceiling gave a negative time, NaN a NaN one, a string a TypeError deep inside."""
    with pytest.raises(ValueError, match=re.escape(f"ceilings['matmul_tflops']['bf16'] = {bad!r} is not a positive")):
        roofline.flops_ms(1e12, _with(bf16=bad), "bf16")
    with pytest.raises(ValueError, match=re.escape(f"ceilings['copy_gbps'] = {bad!r}")):
        roofline.bytes_ms(1e9, {"copy_gbps": bad})
    with pytest.raises(ValueError, match=re.escape(f"matmul_tflops['bf16'] must be a positive finite number, got {bad!r}")):
        breakdown.gpt_floors(get_workload("gpt").config("smoke"), 1000, _with(bf16=bad))
    # a ceiling the run did not measure is not an error: no time
    assert roofline.flops_ms(1e12, {"matmul_tflops": {}}, "bf16") is None
    assert roofline.bytes_ms(1e9, {}) is None


@pytest.mark.parametrize("count", [float("nan"), float("inf"), -float("inf"), "12"])
def test_a_count_that_is_not_a_finite_number_is_an_error_naming_it(count):
    with pytest.raises(ValueError, match="flops"):
        roofline.flops_ms(count, GOOD, "bf16")
    with pytest.raises(ValueError, match="nbytes"):
        roofline.bytes_ms(count, GOOD)


def test_a_negative_count_is_an_added_cost_not_an_error():
    """A step may add FLOPs or bytes (``Prediction.flops_removed`` < 0): its time is negative, a slowdown."""
    assert roofline.flops_ms(-1e12, GOOD, "bf16") == pytest.approx(-250.0)
    assert roofline.bytes_ms(-1e9, GOOD) == pytest.approx(-10.0)


def test_gpt_floors_refuse_a_parameter_count_or_a_config_that_counts_nothing():
    cfg = get_workload("gpt").config("smoke")
    for n in (-1, 0, 2.5, float("nan")):
        with pytest.raises(ValueError, match=f"n_params.*{n!r}" if n == n else "n_params.*nan"):
            breakdown.gpt_floors(cfg, n, GOOD)
    import dataclasses
    with pytest.raises(ValueError, match="batch"):
        breakdown.gpt_floors(dataclasses.replace(cfg, batch=0), 1000, GOOD)
    with pytest.raises(ValueError, match="n_layer"):
        breakdown.gpt_floors(dataclasses.replace(cfg, n_layer=-2), 1000, GOOD)
    floors = breakdown.gpt_floors(cfg, 1000, GOOD)
    assert all(f["ms"] >= 0 for f in floors.values()) and floors["gemm"]["ms"] > 0


def test_a_floor_of_no_flops_is_an_error_naming_the_workload(monkeypatch):
    from hwlib.workloads.gpt import GPTWorkload
    monkeypatch.setattr(GPTWorkload, "flops_per_step", lambda self, cfg: 0.0)
    with pytest.raises(ValueError, match="gpt.*0.0"):
        predict("gpt", "21_fused_layernorm", "smoke", GOOD)


@pytest.mark.parametrize("prev_ms", [-3.0, 0.0, float("nan"), float("inf"), "12"])
def test_a_measured_time_of_the_step_before_that_is_not_one_is_an_error(prev_ms):
    """A NaN time made a bound of max(0, nan) = 0 ms, silently; a negative one a bound of 0; inf an infinite one."""
    with pytest.raises(ValueError, match="prev_ms"):
        predict("gpt", "09_cuda_graphs", "smoke", GOOD, prev_ms=prev_ms)


def test_a_saving_larger_than_the_step_is_clamped_with_the_reason():
    """Step 21 removes bytes; at a copy bandwidth far below the real one its saving exceeds the step before's
    measured time, which would predict a step below its floor (or below zero). Clamped to the step before's
    time above this step's floor, and the row says so; a plausible saving is left as it is."""
    slow = {**GOOD, "copy_gbps": 1e-6}
    free = predict("gpt", "21_fused_layernorm", "smoke", slow)
    assert free.saved_ms > 1e3 and free.clamped is None        # no measured time: nothing to compare with
    p = predict("gpt", "21_fused_layernorm", "smoke", slow, prev_ms=50.0)
    assert p.saved_ms == pytest.approx(50.0 - p.floor_ms)
    assert p.clamped and "50" in p.clamped and "clamped" in p.to_row()["basis"]
    ok = predict("gpt", "21_fused_layernorm", "smoke", GOOD, prev_ms=1e6)
    assert ok.clamped is None and 0 < ok.saved_ms < 1e6


def test_a_step_before_measured_under_this_steps_floor_predicts_no_saving_and_says_why():
    p = predict("gpt", "21_fused_layernorm", "smoke", GOOD, prev_ms=1e-9)
    assert p.floor_ms > 1e-9
    assert p.saved_ms == 0.0 and "floor" in p.clamped


def _result(**kw):
    base = dict(workload="gpt", step="01_baseline_fp32", profile="smoke", device={"name": "test"}, status="ok",
                items_per_step=512, flops_per_step=1e12, timing=Timing(median_ms=100.0, p20_ms=99.0, p80_ms=101.0, n=10))
    return StepResult(**{**base, **kw})


@pytest.mark.parametrize("kw, named", [
    ({"timing": Timing(median_ms=0.0, p20_ms=0.0, p80_ms=0.0, n=3)}, "median_ms = 0.0"),
    ({"timing": Timing(median_ms=5.0, p20_ms=-1.0, p80_ms=6.0, n=3)}, "p20_ms = -1.0"),
    ({"timing": Timing(median_ms=float("nan"), p20_ms=1.0, p80_ms=6.0, n=3)}, "median_ms"),
    ({"items_per_step": -512}, "items_per_step"),
    ({"flops_per_step": -1e12}, "flops_per_step"),
    ({"flops_per_step": float("inf")}, "flops_per_step")])
def test_a_ladder_record_of_a_zero_time_or_a_bad_count_is_an_error_naming_it(kw, named, isolated_run):
    """A zero time divided by zero; a negative count gave negative tokens/s and TFLOP/s recorded ok."""
    with pytest.raises(ValueError, match=named):
        record_mod.record(_result(**kw), notebook="01", ceilings=GOOD, run=isolated_run)
    recs = record_mod.record(_result(), notebook="01", ceilings=GOOD, run=isolated_run)
    assert all(r["value"] is None or not isinstance(r["value"], float) or math.isfinite(r["value"]) for r in recs)


def test_a_ladder_record_of_no_items_counted_has_no_rate(isolated_run):
    """0 items a step was recorded as 0 tokens/s, status ok: now the rate is n/a, with the reason."""
    recs = record_mod.record(_result(items_per_step=0), notebook="01", ceilings=GOOD, run=isolated_run)
    (rate,) = [r for r in recs if r["metric"] == "tokens_per_s"]
    assert rate["value"] is None and rate["status"] == "n/a" and "no tokens counted" in rate["reason"]
    assert next(r for r in recs if r["metric"] == "model_tflops")["value"] == pytest.approx(10.0)
