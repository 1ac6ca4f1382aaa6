import dataclasses

import pytest
import torch

from hwlib import notebook, query
from hwlib.device import ChoiceError
from hwlib.ladder import record as record_mod
from hwlib.ladder import run as train
from hwlib.ladder.same_math import bf16_floor, compare_curves, needs_bf16_floor, same_math
from hwlib.steps import settings_for
from hwlib.studies.data_wait import measure_data_wait
from hwlib.profiles import Plan
from hwlib.report.tables import step_prose
from hwlib.workloads.gpt import GPTWorkload

PLAN = Plan(check=4, warmup=1, timed=3)


def run(step="01_baseline_fp32", **kw):
    kw.setdefault("progress", False)
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
    one = {"n_layer": 1}   # bf16 matmuls are slow on a CPU; one block shows the check as well as two
    base = run("03_bf16_autocast", config=one)
    sdpa = run("04_sdpa_attention", config=one)    # fused attention: same math within tolerance
    chk = same_math(sdpa, "03_bf16_autocast", base.check_losses)
    assert chk.ok and chk.max_rel_diff < chk.tolerance and chk.k == PLAN.check
    # A real change of math (twice the learning rate) fails the same check.
    other = run("04_sdpa_attention", config={**one, "lr": 2 * base.config["lr"]})
    bad = same_math(other, "03_bf16_autocast", base.check_losses)
    assert not bad.ok and bad.max_rel_diff > bad.tolerance and "FAILED" in str(bad)
    with pytest.raises(ValueError, match="not a step before"):
        same_math(sdpa, "05_fused_optimizer", base.check_losses)


def test_gpu_only_step_on_cpu_is_a_skipped_row(isolated_run, cpu_only):
    r = run("02_tf32")
    assert r.status == "skipped" and "GPU-only" in r.reason and r.timing is None
    chk = same_math(r, None, None)
    assert chk.ok and "skipped" in str(chk)
    record_mod.record(r, notebook="02_tf32", check=chk)
    rows = query.ladder_rows(query.load(), "gpt")
    assert rows[0]["status"] == "skipped" and "GPU-only" in rows[0]["reason"] and rows[0]["throughput"] is None


def test_skipped_step_in_between_widens_the_tolerance(isolated_run, cpu_only):
    record_mod.record(run(), notebook="01")   # 01's curve is saved; 02 is skipped on CPU
    chk = notebook.check_math(run("03_bf16_autocast"))
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
    chk = same_math(r, None, None)
    assert not chk.ok
    record_mod.record(r, notebook="01", check=chk)
    (row,) = query.ladder_rows(query.load(), "gpt")
    assert row["status"] == "nonfinite" and row["ms_per_step"] is None and row["throughput"] is None


def test_record_writes_every_metric_and_mfu_only_against_a_ceiling(isolated_run):
    res = run()
    record_mod.record(res, notebook="01")
    metrics = {r["metric"]: r for r in query.load()}
    assert {"ms_per_step", "tokens_per_s", "model_tflops", "mfu", "final_loss"} <= set(metrics)
    assert metrics["ms_per_step"]["value"] == res.timing.median_ms
    # no ceilings in this run: MFU is n/a, and nothing measured them on the side
    assert metrics["mfu"]["value"] is None and "no ceilings" in metrics["mfu"]["reason"]
    assert not (isolated_run / "ceilings.json").exists()
    peak = 2 * res.model_tflops
    # step 01 runs fp32 matmuls: its MFU is against the fp32 ceiling, never the bf16 one
    record_mod.record(res, notebook="01", ceilings={"matmul_tflops": {"bf16": 10 * peak}})
    mfu = next(r for r in query.load() if r["metric"] == "mfu")
    assert mfu["value"] is None and "no fp32 matmul ceiling" in mfu["reason"]
    record_mod.record(res, notebook="01", ceilings={"matmul_tflops": {"bf16": 10 * peak, "fp32": peak}})
    mfu = next(r for r in query.load() if r["metric"] == "mfu")
    assert mfu["value"] == pytest.approx(0.5) and mfu["status"] == "ok" and "fp32" in mfu["unit"]
    # a ceiling below the measured rate is a bad ceiling: flagged, not printed
    record_mod.record(res, notebook="01", ceilings={"matmul_tflops": {"fp32": res.model_tflops / 3}})
    mfu = next(r for r in query.load() if r["metric"] == "mfu")
    assert mfu["value"] is None and "bad ceiling" in mfu["reason"]


def test_mfu_takes_the_ceiling_of_the_precision_the_step_runs_in():
    prec = record_mod.step_precision
    assert prec(settings_for("01_baseline_fp32").__dict__) == "fp32"
    assert prec(settings_for("02_tf32").__dict__) == "tf32"
    assert prec(settings_for("06_torch_compile").__dict__) == "bf16"
    assert prec({"autocast": "fp16", "tf32": True}) == "fp16"
    both = {"matmul_tflops": {"bf16": 800.0, "fp16": 790.0, "tf32": 400.0, "fp32": 50.0}}
    assert record_mod.mfu_ceiling(both, "fp16") == ("fp16", 790.0)
    assert record_mod.mfu_ceiling(both, "tf32") == ("tf32", 400.0)
    # a GPU without bf16 (a T4): bf16 steps run as fp16 and take its ceiling
    assert record_mod.mfu_ceiling({"matmul_tflops": {"fp16": 65.0}}, "bf16") == ("fp16", 65.0)
    assert record_mod.mfu_ceiling({"matmul_tflops": {"fp16": 65.0}}, "tf32") == ("tf32", None)


def test_a_variant_is_recorded_apart_from_the_ladder_row(isolated_run):
    base = run()
    record_mod.record(base, notebook="01")
    variant = run(settings=settings_for("01_baseline_fp32"), config={"batch": 3})
    assert variant.variant
    record_mod.record(variant, notebook="01")
    rows = query.ladder_rows(query.load(), "gpt")
    assert len(rows) == 1 and rows[0]["ms_per_step"] == base.timing.median_ms
    # its curve is not saved as the step's reference
    assert query.saved_curve("gpt", "01_baseline_fp32", record_mod.curve_key(base)) == base.check_losses
    assert query.saved_curve("gpt", "01_baseline_fp32", record_mod.curve_key(variant)) is None


@pytest.mark.parametrize("kw,match", [({"workload": "bert"}, "'bert'"), ({"step": "42"}, "'42'"),
                                      ({"profile": "medium"}, "'medium'"), ({"device": "npu"}, "'npu'")])
def test_bad_names_are_clear_errors(kw, match):
    args = {"workload": "gpt", "step": "01_baseline_fp32", "profile": "smoke", "device": "cpu", **kw}
    with pytest.raises(ChoiceError, match=match):
        train.run_step(args.pop("workload"), args.pop("step"), **args)


def test_plan_must_time_something():
    with pytest.raises(ValueError, match="timed >= 1"):
        run(plan=Plan(check=2, warmup=0, timed=0))


@pytest.mark.parametrize("kw,match", [({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"micro_batch": 0}, "micro_batch"),
                                      ({"settings": {"tf32": True}}, "settings"), ({"plan": (1, 2, 3)}, "plan")])
def test_bad_arguments_name_themselves(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        run(**kw)


def test_config_is_a_dict_that_cannot_swallow_run_arguments():
    with pytest.raises(TypeError):
        run(n_layer=1)    # no catch-all: config fields go in config={...}
    r = run(config={"n_layer": 1})
    assert r.config["n_layer"] == 1


def test_bf16_noise_floor_sets_the_resolution_of_later_checks(isolated_run):
    """After bf16, a step's tolerance is at least how far bf16 itself moved the curve (03 vs 02),
    capped by 03's tolerance; before bf16, or without saved curves, the step's own tolerance."""
    dev = {"name": "cpu", "kind": "cpu"}

    def res(step, losses, autocast="bf16", workload="gpt"):
        return train.StepResult(workload=workload, step=step, profile="smoke", device=dev, status="ok",
                                config={"batch": 2}, settings={"autocast": autocast}, losses=losses, check_steps=3)

    base = [4.0, 3.0, 2.0]
    for step, losses, ac in (("02_tf32", base, None), ("03_bf16_autocast", [4.0, 3.0, 2.04], "bf16"),
                             ("05_fused_optimizer", base, "bf16"), ("07_nice_shapes", base, "bf16")):
        record_mod.save_curve(res(step, losses, ac))                    # bf16 moved 03 by 2e-2
    r06 = res("06_torch_compile", [4.0, 3.0, 2.03])                    # 1.5e-2 from 05: over 06's 1e-2
    check = notebook.check_math(r06)
    assert check.against == "05_fused_optimizer" and check.tolerance == pytest.approx(0.02) and check.ok
    assert "03 vs 02" in check.detail
    far = notebook.check_math(res("06_torch_compile", [4.0, 3.0, 2.1]))   # 5e-2: beyond the floor too
    assert not far.ok
    fp32 = notebook.check_math(res("06_torch_compile", [4.0, 3.0, 2.03], autocast=None))
    assert fp32.tolerance == pytest.approx(0.01) and not fp32.ok
    # vit_bdh: step 07 is n/a for it (it changes nothing there), so 08 against 06 takes 08's bound alone
    record_mod.save_curve(res("06_torch_compile", base, workload="vit_bdh"))
    r08 = res("08_dataloader", [4.0, 3.0, 2.03], workload="vit_bdh")
    assert not needs_bf16_floor(r08)                                     # same arithmetic: no floor
    loader = notebook.check_math(r08)
    assert loader.against == "06_torch_compile" and loader.tolerance == pytest.approx(0.01) and not loader.ok
    assert bf16_floor([1.0, 2.0], None) is None
    assert bf16_floor([1.0, 2.0], [1.0, 2.0 * (1 + 1.0)]) == pytest.approx(3e-2)   # capped by 03's tolerance
    assert compare_curves([1.0, float("nan")], [1.0, 1.0]) == float("inf")


def test_data_wait_against_resident_batches(isolated_run, cpu_only):
    """The share is 1 - t_resident / t_step against the ladder's own row; the nearest earlier
    applicable step is found across n/a steps (07 does not apply to vit_bdh); a step that differs
    in more than the loader is refused."""
    common = dict(profile="smoke", device="cpu", progress=False, plan=Plan(check=2, warmup=0, timed=2))
    for step in ("06_torch_compile", "08_dataloader"):
        eager = dataclasses.replace(settings_for(step), compile=False)   # inductor on CPU is slow
        res = train.run_step("vit_bdh", step, settings=eager, **common)
        res.variant = False   # stands for the step's own row in this test
        record_mod.record(res, notebook=step)
    eager = dataclasses.replace(settings_for("08_dataloader"), compile=False)
    # a resident run under other settings than the recorded rows' (here without the fused AdamW)
    mismatched = measure_data_wait("vit_bdh", "08_dataloader", notebook="x", profile="smoke", device="cpu",
                                   progress=False, recorded=query.load(),
                                   settings=dataclasses.replace(eager, fused_adamw=False))
    assert mismatched[0]["status"] == "not comparable" and "fused_adamw" in mismatched[0]["reason"]
    rows = measure_data_wait("vit_bdh", "08_dataloader", notebook="08_dataloader", with_previous=True,
                             profile="smoke", device="cpu", progress=False, settings=eager, recorded=query.load())
    assert [r["step"] for r in rows] == ["08_dataloader", "06_torch_compile"]
    recs = [r for r in query.load() if r["metric"] == "data_wait_share"]
    assert len(recs) == 2
    for r, rec in zip(rows, recs):
        assert r["status"] == "ok" and r["data_wait_share"] < 1.0 and isinstance(r["within_noise"], bool)
        assert r["data_wait_share"] == pytest.approx(1 - r["resident_ms"] / r["step_ms"])
        assert rec["value"] == pytest.approx(r["data_wait_share"])
    with pytest.raises(ValueError, match="not only the loader"):
        measure_data_wait("vit_bdh", "08_dataloader", notebook="x", also=("05_fused_optimizer",),
                          profile="smoke", device="cpu", progress=False, recorded=query.load())
    missing = measure_data_wait("encoder_nli", "08_dataloader", notebook="x", profile="smoke", device="cpu",
                                progress=False, recorded=query.load())
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
    # eager: the window follows the shapes the workload reports, whether or not the model is compiled
    eager = dataclasses.replace(settings_for("11_sequence_packing"), compile=False, cuda_graphs=False)
    r = train.run_step("encoder_nli", "11_sequence_packing", profile="smoke", device="cpu", settings=eager,
                       plan=Plan(check=3, warmup=1, timed=4))
    assert r.status == "ok" and r.warmup_steps == 3 and len(r.losses) == 3 + 3 + 4 and r.timing.n == 4
    assert any("warm-up extended by 2 steps" in n for n in r.notes)


def test_a_timing_beside_another_gpu_process_is_marked_contended(isolated_run, monkeypatch):
    seen = iter([[], [4242]])   # nobody before the window, another process by its end
    monkeypatch.setattr(train, "other_gpu_processes", lambda dev: next(seen))
    r = run()
    assert r.contended == [4242]
    record_mod.record(r, notebook="01")
    (row,) = query.ladder_rows(query.load(), "gpt")
    assert row["status"] == "contended" and "4242" in row["reason"]
    monkeypatch.setattr(train, "other_gpu_processes", lambda dev: None)   # NVML cannot tell
    assert run().contended is None


def test_no_other_process_on_a_cpu():
    from hwlib.device import other_gpu_processes
    assert other_gpu_processes("cpu") == []


def test_a_step_that_runs_out_of_memory_is_a_skipped_row_with_what_it_asked_for(isolated_run, monkeypatch):
    from hwlib.ladder import session as session_mod

    def no_room(self, i):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity "
                                     "of 15.00 GiB of which 1.00 GiB is free.")
    monkeypatch.setattr(session_mod.Session, "step", no_room)
    res = run()
    assert res.status == "skipped" and res.timing is None and res.losses == []
    assert res.reason.startswith("out of memory") and "2.50 GiB" in res.reason
    record_mod.record(res, notebook="01")
    (row,) = query.ladder_rows(query.load(), "gpt")
    assert row["status"] == "skipped" and "2.50 GiB" in row["reason"] and row["ms_per_step"] is None


@pytest.mark.parametrize("raw", ["0", "-4", "lots", "inf"])
def test_a_bad_memory_cap_is_named(monkeypatch, raw):
    from hwlib import device
    monkeypatch.setenv("HWLIB_MEMORY_CAP_GIB", raw)
    with pytest.raises(ValueError, match="HWLIB_MEMORY_CAP_GIB"):
        device.memory_cap_gib()
    monkeypatch.setenv("HWLIB_MEMORY_CAP_GIB", "16")
    assert device.memory_cap_gib() == 16.0
    assert device.apply_memory_cap(torch.device("cpu")) == torch.device("cpu")   # nothing to cap on a CPU


def test_the_backends_of_hwlibs_ops_are_recorded(isolated_run):
    """``auto`` falls back to torch where a kernel cannot run (here: a CPU without the Triton
    interpreter, and no cuBLASLt): the record says what ran, and a step without the ops says nothing."""
    res = run("22_gelu_epilogue", config={"n_layer": 1})   # one block uses every op; compiles faster
    assert res.status == "ok"
    assert res.op_backends == "add_layernorm=torch, gelu_mlp=torch, linear_ce=torch"
    record_mod.record(res, notebook="22")
    rows = query.ladder_rows(query.load(), "gpt")
    assert next(r for r in rows if r["step"] == "22_gelu_epilogue")["op_backends"] == res.op_backends
    assert f"hwlib's ops ran these backends: {res.op_backends}." in step_prose(rows, "gpt", "22_gelu_epilogue")
    assert run().op_backends is None   # step 01: no fused op, and nothing left from the step before


def test_a_cpu_compile_backend_other_than_inductor_is_noted_and_a_bad_one_named(monkeypatch):
    from hwlib.ladder import session as session_mod
    monkeypatch.setenv("HWLIB_CPU_COMPILE_BACKEND", "aot_eager")
    one = {"n_layer": 1}   # compiles faster than the smoke config's two blocks
    r = train.run_step("gpt", "06_torch_compile", profile="smoke", device="cpu", progress=False, config=one,
                       plan=Plan(check=2, warmup=0, timed=1))
    assert r.status == "ok" and any("aot_eager backend, not inductor" in n for n in r.notes)
    monkeypatch.setenv("HWLIB_CPU_COMPILE_BACKEND", "eager")   # the notebook suites' (Makefile)
    e = train.run_step("gpt", "06_torch_compile", profile="smoke", device="cpu", progress=False, config=one,
                       plan=Plan(check=2, warmup=0, timed=1))
    assert e.status == "ok" and any("eager backend, not inductor" in n for n in e.notes)
    assert e.check_losses == pytest.approx(r.check_losses, rel=1e-5)   # the same math as under aot_eager
    monkeypatch.setenv("HWLIB_CPU_COMPILE_BACKEND", "tvm")
    with pytest.raises(ValueError, match="HWLIB_CPU_COMPILE_BACKEND='tvm'"):
        session_mod.compile_model(torch.nn.Linear(2, 2), device=torch.device("cpu"))
    monkeypatch.delenv("HWLIB_CPU_COMPILE_BACKEND")
    assert session_mod.cpu_compile_backend() == "inductor"
