import dataclasses

import pytest
import torch

from hwlib import notebook, query, results
from hwlib.ladder import run as train
from hwlib.report import tables as report
from hwlib.device import ChoiceError
from hwlib.profiles import Plan
from hwlib.workloads.gpt import GPTWorkload

PLAN = Plan(check=4, warmup=1, timed=3)


def run(step="01_baseline_fp32", **kw):
    kw.setdefault("plan", PLAN)
    return train.run_step("gpt", step, profile="smoke", device="cpu", **kw)


def test_smoke_step_trains_and_is_timed():
    r = run()
    assert r.status == "ok" and len(r.losses) == 8 and r.timing.n == 3
    assert r.losses[-1] < r.losses[0] - 0.2          # the synthetic data is learnable
    assert r.items_per_s == pytest.approx(r.items_per_step / (r.timing.median_ms / 1e3))
    assert r.model_tflops > 0 and r.compile_s is None


def test_same_seed_same_losses_bit_for_bit():
    assert run().losses == run().losses


def test_same_math_check_passes_for_same_math_and_fails_for_other_math(isolated_run):
    base = run()
    sdpa = run("04_sdpa_attention")    # bf16 + fused attention: same math within tolerance
    chk = train.same_math(sdpa)
    assert chk.ok and chk.against == "03_bf16_autocast" and chk.max_rel_diff < chk.tolerance
    # A real change of math (twice the learning rate) must fail the tolerance of an exact-math step.
    other = run(lr=2 * base.config["lr"])
    d = train.compare_curves(other.check_losses, base.check_losses, 0)
    assert d > 0.01


def test_gpu_only_step_on_cpu_is_a_skipped_row(isolated_run, cpu_only):
    r = run("02_tf32")
    assert r.status == "skipped" and "GPU-only" in r.reason and r.timing is None
    chk = train.same_math(r)
    assert chk.ok and "skipped" in str(chk)
    train.record(r, notebook="02_tf32", check=chk)
    rows = report.ladder_rows(results.load(), "gpt")
    assert rows[0]["status"] == "skipped" and "GPU-only" in rows[0]["reason"] and rows[0]["throughput"] is None


def test_skipped_step_in_between_widens_the_tolerance(isolated_run, cpu_only):
    run()  # 01's curve is saved; 02 is skipped on CPU
    chk = train.same_math(run("03_bf16_autocast"))
    assert chk.against == "01_baseline_fp32"
    assert chk.tolerance == pytest.approx(5e-3 + 3e-2)


def test_nonfinite_loss_is_reported_not_timed(isolated_run, monkeypatch):
    calls = {"n": 0}
    real = GPTWorkload.loss

    def poisoned(self, model, batch):
        calls["n"] += 1
        loss = real(self, model, batch)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(GPTWorkload, "loss", poisoned)
    r = run()
    assert r.status == "nonfinite" and "step 2" in r.reason and r.timing is None
    chk = train.same_math(r)
    assert not chk.ok
    train.record(r, notebook="01", check=chk)
    (row,) = report.ladder_rows(results.load(), "gpt")
    assert row["status"] == "nonfinite" and row["ms_per_step"] is None and row["throughput"] is None


def test_measure_records_before_asserting(isolated_run):
    res, chk = train.measure("gpt", "01_baseline_fp32", notebook="01", profile="smoke", device="cpu",
                             plan=PLAN, progress=False)
    metrics = {r["metric"]: r for r in results.load()}
    assert {"ms_per_step", "tokens_per_s", "model_tflops", "mfu", "final_loss"} <= set(metrics)
    assert metrics["ms_per_step"]["value"] == res.timing.median_ms
    assert metrics["mfu"]["value"] == pytest.approx(res.model_tflops / results.read_json(
        isolated_run / "ceilings.json")["matmul_tflops"]["bf16"])


@pytest.mark.parametrize("kw,match", [({"workload": "bert"}, "'bert'"), ({"step": "42"}, "'42'"),
                                      ({"profile": "medium"}, "'medium'"), ({"device": "npu"}, "'npu'")])
def test_bad_names_are_clear_errors(kw, match):
    args = {"workload": "gpt", "step": "01_baseline_fp32", "profile": "smoke", "device": "cpu", **kw}
    with pytest.raises(ChoiceError, match=match):
        train.run_step(args.pop("workload"), args.pop("step"), **args)


def test_plan_must_time_something():
    with pytest.raises(ValueError, match="timed >= 1"):
        run(plan=Plan(check=2, warmup=0, timed=0))


def test_bf16_noise_floor_sets_the_resolution_of_later_checks(isolated_run):
    """After bf16, a step's tolerance is at least how far bf16 itself moved the curve (03 vs 02),
    capped by 03's tolerance; before bf16, or without saved curves, the step's own tolerance."""
    dev = {"name": "cpu", "kind": "cpu"}

    def res(step, losses, autocast="bf16"):
        return train.StepResult(workload="gpt", step=step, profile="smoke", device=dev, status="ok",
                                config={"batch": 2}, settings={"autocast": autocast}, losses=losses, check_steps=3)

    base = [4.0, 3.0, 2.0]
    train.save_curve(res("02_tf32", base, None))
    train.save_curve(res("03_bf16_autocast", [4.0, 3.0, 2.04]))          # bf16 moved it by 2e-2
    train.save_curve(res("05_fused_optimizer", base))
    r06 = res("06_torch_compile", [4.0, 3.0, 2.03])                    # 1.5e-2 from 05: over 06's 1e-2
    check = train.same_math(r06)
    assert check.against == "05_fused_optimizer" and check.tolerance == pytest.approx(0.02) and check.ok
    assert "03 vs 02" in check.detail
    far = train.same_math(res("06_torch_compile", [4.0, 3.0, 2.1]))     # 5e-2: beyond the floor too
    assert not far.ok
    fp32 = train.same_math(res("06_torch_compile", [4.0, 3.0, 2.03], autocast=None))
    assert fp32.tolerance == pytest.approx(0.01) and not fp32.ok
    train.save_curve(res("07_nice_shapes", base))
    loader = train.same_math(res("08_dataloader", [4.0, 3.0, 2.03]))     # same arithmetic: no floor
    assert loader.against == "07_nice_shapes" and loader.tolerance == pytest.approx(0.01) and not loader.ok


def test_data_wait_against_resident_batches(isolated_run, cpu_only):
    """The share is 1 - t_resident / t_step against the ladder's own row; the nearest earlier
    applicable step is found across n/a steps (07 does not apply to vit_bdh); a step that differs
    in more than the loader is refused."""
    common = dict(profile="smoke", device="cpu", progress=False, plan=Plan(check=2, warmup=0, timed=2))
    for step in ("06_torch_compile", "08_dataloader"):
        eager = dataclasses.replace(train.settings_for(step), compile=False)   # inductor on CPU is slow
        res = train.run_step("vit_bdh", step, settings=eager, **common)
        train.record(res, notebook=step)
    mismatched = train.measure_data_wait("vit_bdh", "08_dataloader", notebook="x", profile="smoke", device="cpu",
                                         progress=False)   # the step's own settings compile; the rows did not
    assert mismatched[0]["status"] == "not comparable" and "compile" in mismatched[0]["reason"]
    eager = dataclasses.replace(train.settings_for("08_dataloader"), compile=False)
    rows = train.measure_data_wait("vit_bdh", "08_dataloader", notebook="08_dataloader", with_previous=True,
                                   profile="smoke", device="cpu", progress=False, settings=eager)
    assert [r["step"] for r in rows] == ["08_dataloader", "06_torch_compile"]
    recs = [r for r in results.load() if r["metric"] == "data_wait_share"]
    assert len(recs) == 2
    for r, rec in zip(rows, recs):
        assert r["status"] == "ok" and r["data_wait_share"] < 1.0 and isinstance(r["within_noise"], bool)
        assert r["data_wait_share"] == pytest.approx(1 - r["resident_ms"] / r["step_ms"])
        assert rec["value"] == pytest.approx(r["data_wait_share"])
    with pytest.raises(ValueError, match="not only the loader"):
        train.measure_data_wait("vit_bdh", "08_dataloader", notebook="x", also=("05_fused_optimizer",),
                                profile="smoke", device="cpu", progress=False)
    missing = train.measure_data_wait("encoder_nli", "08_dataloader", notebook="x", profile="smoke", device="cpu",
                                      progress=False)
    assert missing[0]["status"] == "not measured"


def test_timing_starts_after_every_shape_of_its_window_was_run():
    assert train.first_timed_step(None, 15, 30) == (15, True)
    same = [3] * 80
    assert train.first_timed_step(same, 15, 30) == (15, True)
    late = [3] * 15 + [4] + [3] * 64                 # a new shape at the first timed step
    assert train.first_timed_step(late, 15, 30) == (16, True)
    two = [3] * 20 + [4] + [3] * 10 + [5] + [3] * 48  # two new shapes, one after the other
    assert train.first_timed_step(two, 15, 30) == (32, True)
    too_late = [3] * 44 + [4] + [3] * 35             # seen only after the warm-up would double
    assert train.first_timed_step(too_late, 15, 30) == (45, True)
    churn = list(range(80))                          # every batch new: give up, say so
    first, settled = train.first_timed_step(churn, 15, 30)
    assert not settled and first <= 45
    with pytest.raises(ValueError, match="start \\+ 2 \\* timed"):
        train.first_timed_step([3] * 20, 15, 30)


def test_run_step_extends_the_warm_up_past_a_new_packed_shape(monkeypatch):
    from hwlib.workloads.encoder_nli import EncoderNLIWorkload
    monkeypatch.setattr(EncoderNLIWorkload, "batch_shapes",
                        lambda self, cfg, batches, n: [3] * 5 + [4] * (n - 5))
    r = train.run_step("encoder_nli", "11_sequence_packing", profile="smoke", device="cpu",
                       plan=Plan(check=3, warmup=1, timed=4))
    assert r.status == "ok" and r.warmup_steps == 3 and len(r.losses) == 3 + 3 + 4 and r.timing.n == 4
    assert any("warm-up extended by 2 steps" in n for n in r.notes)
