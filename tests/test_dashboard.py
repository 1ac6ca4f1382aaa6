"""The dashboards without a browser: the monitor's plots, hook and failure states; the explorer's
rows, ratios and noise bands; and every piece of bad input said in place, never raised."""

import math
import time
import types

import matplotlib

matplotlib.use("Agg")

import pytest

from hwlib import bench, results
from hwlib.dashboard import explorer, monitor
from hwlib.ladder.run import run_step
from hwlib.profiles import Plan
from hwlib.steps import STEP_NAMES

GPU = {"kind": "cuda", "name": "Test GPU"}


class FlakySource:
    """Telemetry that reads ``good`` times, then fails like a GPU that fell off the bus."""
    kind, name = "nvml", "Flaky GPU"

    def __init__(self, good=3):
        self.n, self.good = 0, good

    def read(self):
        self.n += 1
        if self.n > self.good:
            raise RuntimeError("NVMLError_GpuIsLost")
        return {"gpu_util": 50.0 + self.n, "sm_clock_mhz": 1900.0, "cpu_util": 10.0}

    def close(self):
        pass


def wait_for(cond, seconds=5.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


# --- monitor ----------------------------------------------------------------------------------------

def test_sparkline_draws_the_points_and_breaks_at_gaps():
    svg = monitor.sparkline([0, 1, 2, 3, 4], [1.0, 2.0, None, 4.0, 5.0], title="power", unit="W")
    assert svg.count("<polyline") == 2 and "5 W" in svg and "1-5 W" in svg
    xs = [p.split(",")[0] for p in svg.split("points='")[1].split("'")[0].split()]
    assert len(xs) == 2 and float(xs[0]) < float(xs[1])
    assert "no readings" in monitor.sparkline([0, 1], [None, float("nan")], title="t", unit="C")
    assert "<circle" in monitor.sparkline([0], [3.0], title="one", unit="")


def test_the_monitor_sees_each_step_with_the_runs_own_time_and_loss():
    mon = monitor.Monitor("cpu", interval_s=0.02, figure=False)
    # a one-layer model: the hook's path is what is checked; the monitor's and the ladder's samplers
    # each read at the start and at the end of however short a window
    with mon:
        res = run_step("gpt", "05_fused_optimizer", profile="smoke", device="cpu", plan=Plan(2, 0, 3),
                       config={"n_layer": 1, "batch": 2, "context": 16}, on_step=mon.on_step)
    assert [s["i"] for s in mon.steps] == list(range(len(res.losses)))
    assert all(math.isclose(s["loss"], l, rel_tol=1e-6) for s, l in zip(mon.steps, res.losses))
    timed = [s["ms"] for s in mon.steps if s["ms"] is not None]
    assert timed == pytest.approx(res.timing.samples_ms, rel=1e-9)      # the clock's marks, not its own
    assert [s["ms"] is None for s in mon.steps] == [True, True, False, False, False]
    assert mon.refreshes >= 1 and not mon.problems
    assert "step 4:" in mon.html.value and "loss" in mon.html.value and "host CPU" in mon.html.value
    assert res.telemetry["samples"] >= 2                                 # the ladder's own sampler ran too


def test_a_telemetry_failure_mid_run_is_said_in_place_and_the_panel_goes_on():
    mon = monitor.Monitor(source=FlakySource(good=2), interval_s=0.01, figure=True)
    clock = bench.StepClock(types.SimpleNamespace(type="cpu"))
    import torch
    with mon:
        clock.mark()
        for i in range(4):
            clock.mark()
            mon.on_step(i, torch.tensor(2.0 - i / 10), clock)
        assert wait_for(lambda: mon.sampler.lost is not None and mon.refreshes >= 2)
    assert "GPU telemetry lost at" in mon.status.value and "NVMLError_GpuIsLost" in mon.status.value
    assert "Traceback" not in mon.status.value + mon.html.value
    assert [s["loss"] for s in mon.steps] == pytest.approx([2.0, 1.9, 1.8, 1.7])
    assert len([s for s in mon.steps if s["ms"] is not None]) == 4
    fig = mon.figure()                                                     # the static copy still draws
    assert "lost" in fig._suptitle.get_text() and len(fig.axes) >= 5


def test_a_broken_refresh_is_said_never_raised(monkeypatch):
    mon = monitor.Monitor("cpu", interval_s=0.01, figure=False)
    monkeypatch.setattr(mon, "render", lambda: 1 / 0)
    mon.refresh()
    assert mon.problems and "could not refresh (ZeroDivisionError" in mon.status.value
    with pytest.raises(ValueError, match="window_s"):
        monitor.Monitor("cpu", window_s=0)


# --- explorer -----------------------------------------------------------------------------------------

def put(run, step, ms, *, spread=0.01, profile="full", device=GPU, workload="gpt", fields=None, telemetry=None):
    common = dict(notebook=step, workload=workload, step=step, profile=profile, device=device, fields=fields)
    results.append([results.make_record(metric="ms_per_step", value=ms, p20=ms * (1 - spread), p80=ms * (1 + spread),
                                        unit="ms", telemetry=telemetry, **common),
                    results.make_record(metric="tokens_per_s", value=1e6 / ms, unit="tokens/s", **common)], run)


@pytest.fixture
def two_runs(tmp_path):
    """'mine' and 'ref' (full profile): mine is 2x slower at 01, equal at 02 within the spread,
    and has a monitor variant of 02 that the reference lacks."""
    put("mine", STEP_NAMES[0], 200.0, telemetry={"gpu_telemetry": True, "sm_clock_mhz": {"min": 1400, "max": 1980},
                                                 "throttle_reasons": ["sw_power_cap"]})
    put("mine", STEP_NAMES[1], 101.0, spread=0.02)
    put("mine", STEP_NAMES[1], 103.0, fields={"monitor": "live"})
    put("ref", STEP_NAMES[0], 100.0, device={"kind": "cuda", "name": "Ref GPU"})
    put("ref", STEP_NAMES[1], 100.0, spread=0.02, device={"kind": "cuda", "name": "Ref GPU"})
    return tmp_path


def test_rows_and_ratios_with_their_noise_bands(two_runs):
    mine, ref = explorer.load_run("mine"), explorer.load_run("ref")
    r = explorer.rows(mine, "gpt", "ms_per_step")
    assert [(x["step"], x["variant"]) for x in r] == [(STEP_NAMES[0], ""), (STEP_NAMES[1], ""),
                                                       (STEP_NAMES[1], "monitor=live")]
    assert "SM 1400-1980 MHz" in r[0]["telemetry"] and "throttled: sw_power_cap" in r[0]["telemetry"]
    # every metric of a timed window shows that window's telemetry, which sits on its ms_per_step record
    assert explorer.rows(mine, "gpt", "tokens_per_s")[0]["telemetry"] == r[0]["telemetry"]
    assert r[1]["telemetry"] is None
    c = {(x["step"], x["variant"]): x for x in explorer.compare(r, explorer.rows(ref, "gpt", "ms_per_step"))}
    first = c[(STEP_NAMES[0], "")]
    assert first["ratio"] == pytest.approx(2.0) and first["verdict"] == "higher"
    assert (first["band_lo"], first["band_hi"]) == pytest.approx((198 / 101, 202 / 99))
    assert c[(STEP_NAMES[1], "")]["verdict"] == "within noise"
    live = c[(STEP_NAMES[1], "monitor=live")]
    assert live["against"] == "the reference's ladder row" and live["ratio"] == pytest.approx(1.03)
    msgs, ok = explorer.problems(mine, ref, "gpt", "ms_per_step")
    assert ok and msgs == ["comparing Test GPU (mine) with Ref GPU (ref)"]


def test_bad_input_is_said_in_place(two_runs):
    put("smoke", STEP_NAMES[0], 5.0, profile="smoke", device={"kind": "cpu", "name": "x86_64"})
    put("mixed", STEP_NAMES[0], 5.0, profile="smoke", device={"kind": "cpu", "name": "x86_64"})
    put("mixed", STEP_NAMES[1], 5.0, profile="full", device=GPU)
    (two_runs / "empty").mkdir()
    ex = explorer.Explorer("empty", reference="ref")
    ex.update()
    assert any("empty: no records" in m for m in ex.messages) and not ex.table
    ex = explorer.Explorer("smoke", reference="ref")
    ex.update()
    assert any(m.startswith("not compared: smoke is the smoke profile") for m in ex.messages) and not ex.comparison
    assert ex.table and ex.table[0]["value"] == 5.0                       # its own rows are still shown
    ex = explorer.Explorer("mixed", reference=None)
    ex.update()
    assert any("mixes profiles (full, smoke)" in m for m in ex.messages)
    assert any("mixes machines (Test GPU, x86_64)" in m for m in ex.messages)
    ex = explorer.Explorer("mine", reference="ref", metric="joules_per_token")
    ex.update()
    assert "mine has no record of 'joules_per_token' for gpt" in ex.messages and not ex.table
    assert "joules_per_token" in ex.options()["metrics"]                  # still selectable, said missing
    with pytest.raises(TypeError, match="reference"):
        explorer.Explorer("mine", reference=5)
    with pytest.raises(ValueError, match="metric"):
        explorer.Explorer("mine", metric="")


def test_damaged_records_and_a_failing_read_never_reach_the_panel(two_runs, monkeypatch):
    with open(two_runs / "mine" / "results.jsonl", "ab") as f:
        f.write(b"{not json\n")
    with pytest.warns(UserWarning, match="damaged"):
        ex = explorer.Explorer("mine", reference="ref")
    ex.widget()
    assert len(ex.table) == 3
    monkeypatch.setattr(explorer, "rows", lambda *a, **k: 1 / 0)
    ex._on_change("metric", "tokens_per_s")
    assert "could not read this selection (ZeroDivisionError" in ex.widgets["table"].value
    assert "Traceback" not in ex.widgets["table"].value


def test_a_changed_selection_changes_the_table_and_the_plot(two_runs):
    ex = explorer.Explorer("mine", reference="ref")
    assert {"mine", "ref", "reference/h100"} <= set(explorer.find_runs())
    panel = ex.widget()
    assert "hwlib-explorer" in panel._dom_classes
    before, plot_before = ex.widgets["table"].value, bytes(ex.widgets["plot"].value)
    assert "<td style='padding:2px 6px'>200</td>" in before and "could not" not in before
    assert plot_before.startswith(b"\x89PNG")
    # the metric's choices name their units; choosing one selects the metric's name
    assert ex.widgets["metric"].options == (("ms_per_step (ms)", "ms_per_step"), ("tokens_per_s (tokens/s)", "tokens_per_s"))
    assert ex.widgets["metric"].label == "ms_per_step (ms)"
    ex.widgets["metric"].value = "tokens_per_s"
    after = ex.widgets["table"].value
    assert after != before and "5,000" in after and ex.metric == "tokens_per_s"
    plot_after = bytes(ex.widgets["plot"].value)
    assert plot_after.startswith(b"\x89PNG") and plot_after != plot_before
    ex.widgets["steps"].value = (STEP_NAMES[1],)
    assert {r["step"] for r in ex.table} == {STEP_NAMES[1]}
    ex.widgets["reference"].value = explorer.NONE
    assert ex.comparison == [] and "mine / " not in ex.widgets["table"].value
    ex.widgets["run"].value = "ref"
    assert ex.run_label == "ref" and ex.widgets["steps"].value == tuple(ex.options()["steps"])
    assert ex.table and ex.table[0]["device"] == "Ref GPU"


@pytest.mark.parametrize("live_ms, spread, verdict", [(100.5, 0.01, "within noise"), (110.0, 0.01, "fails")])
def test_the_dashboard_claim_reads_the_monitors_cost(tmp_path, live_ms, spread, verdict):
    from hwlib.seeds import verdicts
    step = "05_fused_optimizer"
    put("claim", step, 100.0, spread=spread, fields={"monitor": "off"})
    put("claim", step, live_ms, spread=spread, fields={"monitor": "live"})
    row = next(r for r in verdicts.evaluate(tmp_path / "claim") if r["claim"] == "Hardware utilization dashboard")
    assert row["measured"] == pytest.approx(100.0 / live_ms) and row["workload"] == "gpt"
    assert row["verdict"] == verdict and row["measured_text"] == f"{100.0 / live_ms:.2f}x"
