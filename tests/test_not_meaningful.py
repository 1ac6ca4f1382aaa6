"""CPU and smoke runs say what they are: their tables, figures and prose are labelled as not
meaningful as performance, and no floor is drawn against a CPU's or a too-low ceiling."""

import pytest

from hwlib import notebook as nb
from hwlib import query, results
from hwlib.report import tables as report

GPU = {"name": "Test GPU", "kind": "cuda"}
CPU = {"name": "x86_64", "kind": "cpu"}


def put(step, ms, tps, *, device, profile):
    common = dict(notebook=step, workload="gpt", step=step, profile=profile, device=device)
    results.append([
        results.make_record(metric="ms_per_step", value=ms, p20=ms * 0.95, p80=ms * 1.05, unit="ms", **common),
        results.make_record(metric="tokens_per_s", value=tps, unit="tokens/s", **common),
        results.make_record(metric="model_tflops", value=tps / 1e4, unit="TFLOP/s", **common),
    ])


def ladder(device, profile, ceiling=800.0):
    put("01_baseline_fp32", 10.0, 1000.0, device=device, profile=profile)
    put("03_bf16_autocast", 4.0, 2500.0, device=device, profile=profile)
    put("04_sdpa_attention", 3.0, 3300.0, device=device, profile=profile)
    results.write_json(report.run_dir(None) / "ceilings.json", {"copy_gbps": 3000.0, "matmul_tflops": {"bf16": ceiling}})
    return report.ladder_rows_with_noise(query.load(), "gpt")


@pytest.mark.parametrize("device, profile, says", [
    (CPU, "smoke", ("measured on a CPU", "smoke profile")),
    (CPU, "full", ("measured on a CPU",)),
    (GPU, "smoke", ("smoke profile",)),
])
def test_cpu_and_smoke_tables_and_prose_are_labelled(isolated_run, device, profile, says):
    rows = ladder(device, profile)
    assert {r["device_kind"] for r in rows} == {device["kind"]}
    for text in (report.what_we_saw(rows, "gpt"), report.step_prose(rows, "gpt", "04_sdpa_attention")):
        assert text.startswith("Not meaningful as performance ("), text
        assert all(s in text for s in says), text
    table = report.write_all()["gpt.md"].read_text()
    assert "**Not meaningful as performance**" in table and all(s in table for s in says)
    assert ("measured on a CPU" in table) == (device is CPU)


def test_a_full_gpu_run_carries_no_label(isolated_run):
    rows = ladder(GPU, "full")
    assert report.rows_caveat(rows) is None
    assert not report.what_we_saw(rows, "gpt").startswith("Not meaningful")
    assert "Not meaningful" not in report.write_all()["gpt.md"].read_text()
    assert "went from 1,000 tokens/s" in report.what_we_saw(rows, "gpt")


def _figure_text(fig):
    ax2 = fig.axes[1]
    legend = ax2.get_legend()
    return (ax2.get_title(), [t.get_text() for t in legend.get_texts()] if legend else [],
            fig._suptitle.get_text() if fig._suptitle else "")


def test_a_cpu_figure_draws_no_floor_and_says_why(isolated_run):
    rows = ladder(CPU, "smoke", ceiling=0.4)   # a CPU's ceiling rounds to "0 TFLOP/s" at :.0f
    title, legend, sup = _figure_text(report.ladder_figure(rows, "gpt", query.ceilings()))
    assert legend == [] and "no floor drawn: a CPU run" in title
    assert sup.startswith("Not meaningful as performance") and "CPU" in sup


def test_a_floor_above_the_measured_time_is_not_drawn(isolated_run):
    rows = ladder(GPU, "full", ceiling=0.05)   # 0.33 TFLOP/s measured at 3 ms: above a 0.05 TFLOP/s "floor"
    title, legend, sup = _figure_text(report.ladder_figure(rows, "gpt", query.ceilings()))
    assert legend == [] and "measured below its floor" in title and sup == ""


def test_a_gpu_floor_names_its_ceiling_with_its_digits(isolated_run):
    rows = ladder(GPU, "full", ceiling=0.45)   # every step above its floor: 0.1-0.33 TFLOP/s model FLOPs
    title, legend, _ = _figure_text(report.ladder_figure(rows, "gpt", query.ceilings()))
    assert legend[0] == "floor: model FLOPs at 0.45 TFLOP/s" and "against the speed-of-light floor" in title
    _, legend, _ = _figure_text(report.ladder_figure(rows, "gpt", {"matmul_tflops": {"bf16": 0.0}}))
    assert legend == []   # no floor against a 0 TFLOP/s ceiling


def test_predictions_and_outcomes_are_labelled_on_a_cpu_run(isolated_run, monkeypatch):
    said = []
    monkeypatch.setattr(nb, "markdown", lambda text: said.append(text))
    ladder(CPU, "full")
    assert "measured on a CPU" in nb._say_caveat(query.load(), "full") and "Not meaningful" in said[-1]
    said.clear()
    assert nb._say_caveat([], "smoke").startswith("smoke profile") and said
    said.clear()
    assert nb._say_caveat([{"device": GPU, "profile": "full"}], "full") is None and said == []
