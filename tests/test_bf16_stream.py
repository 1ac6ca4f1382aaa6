"""Step 27, the residual stream in bf16: its settings and chain, the roofline's count, the breakdown's
caveat, its study (the kernel it prints, its words) and the band it reads back (report.recipe)."""

from __future__ import annotations

import pytest

from hwlib import steps
from hwlib.report import recipe
from hwlib.steps import chain, get_step, previous, uses_fp8
from hwlib.steps.s21_fused_layernorm.op import traffic_bytes
from hwlib.steps.s27_bf16_stream import study as S
from hwlib.studies import breakdown as bd
from hwlib.workloads import get_workload


def test_the_step_builds_on_the_fp8_head_and_counts_as_the_fp8_branch():
    names = [s.name for s in chain("27_bf16_stream")]
    assert {"26_fp8_head", "21_fused_layernorm"} <= set(names) and uses_fp8("27_bf16_stream")
    assert "27_bf16_stream" not in [s.name for s in chain("26_fp8_head")]
    assert previous("27_bf16_stream").name == "26_fp8_head"
    step = get_step("27_bf16_stream")
    assert step.gpu_only and step.beyond_recipe and step.tolerance == 1e-2 and "bf16" in step.why_tolerance


def test_the_roofline_counts_the_fused_layernorms_stream_bytes():
    cfg = get_workload("gpt").config("full")
    n, d = cfg.batch * cfg.context, cfg.d_model
    p = steps.predict("gpt", "27_bf16_stream", "full", {"copy_gbps": 3000.0})
    # 2 L calls, each 4 d fewer bytes a row forward and 8 d backward (the stream's terms halved, dr not written)
    assert p.bytes_removed == pytest.approx(2 * cfg.n_layer * n * 12 * d)
    f32, b16 = traffic_bytes(n, d), traffic_bytes(n, d, stream_bytes=2)
    assert p.bytes_removed == pytest.approx(2 * cfg.n_layer * (sum(f32.values()) - sum(b16.values())))
    assert p.saved_ms == pytest.approx(p.bytes_removed / 3000e9 * 1e3)
    assert steps.predict("gpt", "27_bf16_stream", "full", None).saved_ms is None


def test_the_breakdown_says_its_elementwise_floor_counts_an_fp32_stream():
    notes = bd.floor_caveats("27_bf16_stream")
    assert any("residual stream is bf16" in n for n in notes)
    assert not any("residual stream is bf16" in n for n in bd.floor_caveats("26_fp8_head"))


def test_the_printed_kernel_is_the_forward_one():
    src = S.kernel_source()
    assert src.startswith("@triton.jit") and "_add_ln_fwd_kernel" in src and "_add_ln_bwd_kernel" not in src
    assert "s = s.to(tl.float32)" in src      # normalised as rounded


def _band(value, steps, status="ok"):
    return {"metric": "long_bf16_band", "status": status, "value": value, "workload": "gpt", "fields": {"steps": steps}}


def test_the_band_is_notebook_26s_newest_for_the_same_run_length():
    """The records in file order (``query.load`` keeps the newest per key): the last ok one of that length."""
    recs = [_band(0.05, 300), _band(0.031, 300), _band(0.2, 100), _band(0.9, 300, status="interrupted"),
            {**_band(0.7, 300), "workload": "vit_bdh"}, {"metric": "long_final_loss", "value": 2.4, "workload": "gpt"}]
    assert recipe.recorded_band(recs, 300) == 0.031
    assert recipe.recorded_band(recs, 100) == 0.2
    assert recipe.recorded_band(recs, 50) is None


def _rows(prev_end, end):
    key = "final loss (mean of last tenth)"
    return [{"step": "26_fp8_head", "steps": 300, key: prev_end, "vs 26": 0.0},
            {"step": "27_bf16_stream", "steps": 300, key: end, "vs 26": end / prev_end - 1}]


def test_the_long_curves_in_words():
    text = S.long_prose(_rows(2.40, 2.41), 0.031)
    assert "After 300 steps, 26_fp8_head ended at 2.400, 27_bf16_stream ended at 2.410" in text
    assert "+0.4% from step 26 (the bound: 20%)" in text and "ended 3.1% apart" in text and "within that spread" in text
    assert "beyond that spread" in S.long_prose(_rows(2.40, 2.60), 0.031)
    assert "apart" not in S.long_prose(_rows(2.40, 2.41), None)
    assert "did not run here" in S.long_prose(_rows(2.40, 2.41)[:1], 0.031)
    assert S.long_prose([], None).startswith("The long curves run on a GPU")
