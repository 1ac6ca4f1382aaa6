"""hwlib.notebook's measure and same-math check, on the smoke profile on a CPU: the check compares a
step with the step before (a saved curve when the run has one, else one computed now), and fails
when the math differs."""

import copy
import dataclasses
import functools

import pytest

from hwlib import notebook, query, results
from hwlib.ladder import record as record_mod
from hwlib.ladder.run import run_step
from hwlib.ladder.same_math import compare_curves
from hwlib.steps import get_step

KW = dict(profile="smoke", device="cpu", progress=False)


@functools.lru_cache(maxsize=None)
def _cached(workload, step, check_only, config, seed, profile, device, plan):
    return run_step(workload, step, check_only=check_only, config=dict(config) if config else None, seed=seed,
                    profile=profile, device=device, plan=plan, progress=False)


def _run_step(workload, step, *, check_only=False, config=None, seed=0, profile="auto", device="auto",
              plan=None, progress=False, **kw):
    """run_step for the smoke runs of this file: seeded and deterministic, so each distinct run is
    made once and every later call gets a copy of it (``progress`` draws a bar and changes nothing)."""
    assert not kw, f"not cached here: {kw}"
    return copy.deepcopy(_cached(workload, step, check_only, tuple(sorted((config or {}).items())), seed,
                                 profile, str(device), plan))


@pytest.fixture(autouse=True)
def cached_runs(monkeypatch):
    """hwlib.notebook (measure, and the earlier curve it computes) runs its steps through the cache."""
    monkeypatch.setattr(notebook, "run_step", _run_step)


@pytest.fixture
def calls(monkeypatch):
    """Every run_step that hwlib.notebook makes to compute an earlier curve: (step, check_only)."""
    seen = []

    def spy(workload, step, **kw):
        seen.append((step, kw.get("check_only")))
        return _run_step(workload, step, **kw)

    monkeypatch.setattr(notebook, "run_step", spy)
    return seen


def _step(step, check_only=False):
    """A seeded smoke run of ``step`` (deterministic, so one run serves every test; a copy each call)."""
    return _run_step("gpt", step, check_only=check_only, **KW)


def test_measure_records_the_step_and_saves_its_curve(isolated_run):
    res, check = notebook.measure("gpt", "03_bf16_autocast", notebook="t", **KW)
    assert res.status == "ok" and check.ok
    saved = query.saved_curve("gpt", "03_bf16_autocast", record_mod.curve_key(res))
    assert saved == pytest.approx(res.check_losses) and len(saved) == res.check_steps
    rows = query.ladder_rows(query.load(), "gpt")
    assert [r["step"] for r in rows] == ["03_bf16_autocast"] and rows[0]["ms_per_step"] == res.timing.median_ms
    # the same-gradients check ran before the timing, against step 01 (02, TF32, is GPU-only and changes
    # nothing on a CPU), and is recorded with the step
    assert check.grads.against == "01_baseline_fp32" and check.grads.status == "ok"
    (g,) = query.select(query.load(), metric="same_gradients_max_rel")
    assert g["step"] == "03_bf16_autocast" and g["value"] == check.grads.max_rel_diff and g["status"] == "ok"


def test_assert_same_math_fails_on_a_gradient_check_that_failed(isolated_run, monkeypatch):
    real = notebook.same_gradients

    def planted(*a, **k):   # the check as it reads a step whose gradients moved
        return dataclasses.replace(real(*a, **k), status="failed", max_rel_diff=0.5, worst="grad wte.weight")
    monkeypatch.setattr(notebook, "same_gradients", planted)
    measured = notebook.measure_all(["gpt"], "03_bf16_autocast", notebook="t", profile="smoke", device="cpu")
    assert measured["gpt"][1].ok                      # the loss curves agree: only the gradients tell
    with pytest.raises(AssertionError, match="gradients changed: gpt 03_bf16_autocast vs 01_baseline_fp32"):
        notebook.assert_same_math(measured)
    (g,) = query.select(query.load(), metric="same_gradients_max_rel")
    assert g["status"] == "failed" and g["value"] == 0.5


def test_check_passes_against_the_saved_curve_of_the_step_before(isolated_run, calls):
    before = _step("03_bf16_autocast")
    record_mod.record(before, notebook="t")          # saves its curve, as measure does
    calls.clear()
    res = _step("04_sdpa_attention")
    check = notebook.check_math(res)
    assert calls == []                               # the saved curve stood in: nothing re-ran
    assert check.against == "03_bf16_autocast" and check.k == res.check_steps
    assert check.max_rel_diff == pytest.approx(compare_curves(res.check_losses, before.check_losses))
    assert check.ok and check.max_rel_diff <= check.tolerance == get_step("04_sdpa_attention").tolerance


def test_check_fails_when_the_math_differs(isolated_run, calls):
    before = _step("03_bf16_autocast")
    record_mod.record(before, notebook="t")          # saves its curve, as measure does
    calls.clear()
    res = _step("04_sdpa_attention")
    # The same step with its losses moved 5%: what a real change of math looks like to the check.
    moved = dataclasses.replace(res, losses=[v * 1.05 for v in res.losses])
    check = notebook.check_math(moved)
    assert calls == [] and check.against == "03_bf16_autocast"
    assert check.max_rel_diff == pytest.approx(compare_curves(moved.check_losses, before.check_losses))
    assert not check.ok and check.max_rel_diff > 0.04 > check.tolerance and "FAILED" in str(check)
    with pytest.raises(AssertionError, match="math changed"):
        notebook.assert_same_math({"gpt": (moved, check)})
    notebook.assert_same_math({"gpt": (res, notebook.check_math(res))})   # the unmoved step passes


def test_check_computes_the_curve_of_the_step_before_when_none_is_saved(isolated_run, calls):
    res = _step("04_sdpa_attention")
    check = notebook.check_math(res)
    assert calls == [("03_bf16_autocast", True)]     # only the check steps of 03, untimed
    ref = _step("03_bf16_autocast", check_only=True)
    assert check.against == "03_bf16_autocast" and check.ok
    assert check.max_rel_diff == pytest.approx(compare_curves(res.check_losses, ref.check_losses))
    assert notebook.earlier_curve(res, compute=False) == (None, None)


def test_a_saved_curve_of_another_config_is_not_used(isolated_run, calls):
    other = _run_step("gpt", "03_bf16_autocast", check_only=True, config={"lr": 1e-3}, **KW)
    record_mod.save_curve(other)                     # what measure saves, under another learning rate
    assert query.saved_curve("gpt", "03_bf16_autocast", record_mod.curve_key(other)) == other.check_losses
    calls.clear()
    res = _step("04_sdpa_attention")                 # the profile's own learning rate
    name, curve = notebook.earlier_curve(res)
    assert name == "03_bf16_autocast" and calls == [("03_bf16_autocast", True)]
    assert curve == pytest.approx(_step("03_bf16_autocast", check_only=True).check_losses)


def test_a_step_with_nothing_to_compare_with_fails_the_assertion(isolated_run):
    res = _step("04_sdpa_attention")
    lonely = notebook.same_math(res, None, None)     # what the check says without an earlier curve
    with pytest.raises(AssertionError, match="no earlier step's curve"):
        notebook.assert_same_math({"gpt": (res, lonely)})


CEIL = {"copy_gbps": 1000.0, "matmul_tflops": {"bf16": 400.0, "tf32": 200.0, "fp32": 50.0}}


def test_roofline_prediction_counts_what_the_change_removes():
    from hwlib import steps
    from hwlib.workloads import get_workload
    wl = get_workload("gpt")
    flops = wl.flops_per_step(wl.config("smoke"))
    tf32 = steps.predict("gpt", "02_tf32", "smoke", CEIL)
    assert tf32.kind == "estimate" and tf32.saved_ms == pytest.approx(flops / 50e12 * 1e3 - flops / 200e12 * 1e3)
    assert tf32.floor_ms == pytest.approx(flops / 200e12 * 1e3)
    sdpa = steps.predict("gpt", "04_sdpa_attention", "smoke", CEIL)
    assert sdpa.saved_ms == pytest.approx(sdpa.bytes_removed / 1e12 * 1e3) and sdpa.bytes_removed > 0
    assert steps.predict("resnet_bk", "04_sdpa_attention", "smoke", CEIL).kind == "n/a"
    assert steps.predict("encoder_nli", "11_sequence_packing", "smoke", CEIL).flops_removed > 0
    bound = steps.predict("gpt", "06_torch_compile", "smoke", CEIL, prev_ms=10.0)
    assert bound.kind == "bound" and bound.saved_ms == pytest.approx(
        10.0 - steps.floor_ms("gpt", "05_fused_optimizer", "smoke", CEIL))
    none = steps.predict("gpt", "02_tf32", "smoke", None)
    assert none.saved_ms is None and "notebook 00" in none.missing


@pytest.mark.parametrize("tf32_move, ok", [(4e-3, True), (1e-3, False)])
def test_bf16_check_allows_what_tf32_shows_the_training_amplifies(monkeypatch, tf32_move, ok):
    """bf16 moved the curve 5%: within the bound when TF32 (8x finer rounding) had moved it 4e-3
    (x8 x2 = 6.4e-2), a failure when TF32 had moved it 1e-3 (the step's own 3e-2 stands)."""
    res = _step("03_bf16_autocast")
    c02 = [v / 1.05 for v in res.check_losses]
    c01 = [v / (1 + tf32_move) for v in c02]
    monkeypatch.setattr(notebook.query, "saved_curve",
                        lambda w, step, key, run=None: {"02_tf32": c02, "01_baseline_fp32": c01}.get(step))
    check = notebook.check_math(res)
    assert check.against == "02_tf32" and check.max_rel_diff == pytest.approx(0.05)
    assert check.ok is ok
    assert check.tolerance == pytest.approx(16 * tf32_move if ok else get_step("03_bf16_autocast").tolerance)
    assert ("amplifies rounding" in str(check)) is ok
    # only step 03 gets the bound: a later step under bf16 keeps its own tolerance and the bf16 floor
    later = dataclasses.replace(_step("04_sdpa_attention"), losses=list(res.losses))
    monkeypatch.setattr(notebook.query, "saved_curve", lambda w, step, key, run=None: {
        "03_bf16_autocast": c02, "02_tf32": c02, "01_baseline_fp32": c01}.get(step))
    assert "amplifies rounding" not in str(notebook.check_math(later))


def test_setup_puts_the_compile_caches_in_the_run_folder_unless_they_are_set(isolated_run, monkeypatch, tmp_path):
    from hwlib.paths import run_dir
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))   # a user's own setting stays
    notebook.setup("smoke", "cpu", "caches")
    import os
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(run_dir("caches") / ".cache" / results.code_digest() / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_setup_replaces_the_cache_folder_that_importing_torch_dynamo_wrote(isolated_run, monkeypatch, tmp_path):
    """``from hwlib import notebook`` imports torch._dynamo, which writes inductor's default folder into
    TORCHINDUCTOR_CACHE_DIR: that is not a user's choice, and the run's own folder must replace it (else
    a notebook run outside ``hwlib reproduce`` reuses graphs compiled against older hwlib code)."""
    import os
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from hwlib.paths import run_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    notebook.setup("smoke", "cpu", "caches2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(run_dir("caches2") / ".cache" / results.code_digest() / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))        # a user's own folder stays
    notebook.setup("smoke", "cpu", "caches2")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
