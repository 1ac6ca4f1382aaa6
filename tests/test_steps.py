import dataclasses

import pytest
import torch

from hwlib import precision, steps
from hwlib.device import ChoiceError, Unavailable
from test_device import fake


def test_ladder_is_cumulative():
    s1, s7 = steps.settings_for("01_baseline_fp32"), steps.settings_for("07_nice_shapes")
    assert s1 == steps.Settings()
    assert s7 == steps.Settings(tf32=True, autocast="bf16", attention="sdpa", fused_adamw=True, compile=True,
                                vocab_multiple=64)
    assert steps.settings_for("04") == steps.settings_for("04_sdpa_attention")
    for b in steps.LADDER[1:]:
        # each recipe step adds exactly its own change to the step it builds on; a step past the recipe none
        a = steps.previous(b.name)
        assert steps.settings_for(b.name).diff(steps.settings_for(a.name)).keys() == b.change.keys()
        assert b.apply is not None if b.beyond_recipe else b.apply is None


def test_a_retired_step_left_the_ladder_its_folder_and_notebook_for_a_toggle():
    """A step whose gain measured within the noise is off the ladder: no step, folder or notebook of its
    name; it built on a step still there, and notebook 19's toggle of its name measures the change."""
    from hwlib.paths import REPO_ROOT
    from hwlib.studies import ablation
    assert steps.RETIRED_NAMES == ("28_gemm_workspace",)
    for r in steps.RETIRED:
        assert r.name not in steps.STEP_NAMES
        with pytest.raises(ChoiceError):
            steps.get_step(r.name)
        assert not any(s.name.startswith(r.name[:3]) for s in steps.LADDER)   # its number is not reused
        assert not (REPO_ROOT / "hwlib" / "steps" / f"s{r.name}").exists()
        assert not (REPO_ROOT / "notebooks" / f"{r.name}.ipynb").exists()
        assert steps.get_step(r.after).name == r.after and r.why and r.title
        assert all(not steps.not_applicable(steps.get_step(r.after), w) for w in r.workloads)
        assert ablation.get_toggle(r.toggle).name == r.toggle


def test_a_step_built_on_an_earlier_step_leaves_the_branch_between_out():
    """21 builds on 17, not on 18 (listed before it): FP8 stays out of its settings and its chain."""
    assert steps.previous("21_fused_layernorm").name == "17_fused_lm_head"
    assert [s.name for s in steps.chain("21")][-3:] == ["12_bk_core", "17_fused_lm_head", "21_fused_layernorm"]
    assert "18_fp8" not in [s.name for s in steps.chain("21")] and not steps.uses_fp8("21")
    assert all(s.after is None or steps.STEP_NAMES.index(s.after) < steps.STEP_NAMES.index(s.name)
               for s in steps.LADDER)
    assert steps.describe("21") == [{"setting": "apply", "before": "17_fused_lm_head",
                                     "after": "hwlib.steps.s21_fused_layernorm.apply.apply"}]


def test_previous_and_describe():
    assert steps.previous("01_baseline_fp32") is None
    assert steps.previous("03_bf16_autocast").name == "02_tf32"
    assert steps.describe("06_torch_compile") == [{"setting": "compile", "before": False, "after": True}]


def test_unknown_step_names_the_choices():
    with pytest.raises(ChoiceError) as e:
        steps.get_step("08_magic")
    assert "'08_magic'" in str(e.value) and "07_nice_shapes" in str(e.value)


def test_tolerances_are_stated():
    for s in steps.LADDER[1:]:
        assert 0 < s.tolerance <= 0.05 and s.why_tolerance


def test_gpu_only_step_on_cpu_is_skipped_with_reason():
    why = steps.unavailable(steps.get_step("02_tf32"), fake(kind="cpu"))
    assert why and "GPU-only" in why and "cpu" in why
    assert steps.unavailable(steps.get_step("03_bf16_autocast"), fake(kind="cpu")) is None
    assert "sm_75" in steps.unavailable(steps.get_step("02_tf32"), fake(cap=(7, 5)))
    assert "compile" in steps.unavailable(steps.get_step("06_torch_compile"), fake(cap=(6, 1)))


def test_bf16_falls_back_to_fp16_before_ampere():
    s = steps.settings_for("03_bf16_autocast")
    assert steps.resolve_autocast(s, fake(cap=(7, 5))).autocast == "fp16"
    assert steps.resolve_autocast(s, fake(cap=(8, 0))).autocast == "bf16"
    with pytest.raises(Unavailable, match="fp16"):
        steps.resolve_autocast(dataclasses.replace(s, autocast="fp16"), fake(kind="cpu"))
    with pytest.raises(ChoiceError, match="'fp8'"):
        steps.resolve_autocast(dataclasses.replace(s, autocast="fp8"), fake())


def _tf32_state():
    if precision._new_precision_api():
        return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_tf32_mode_sets_and_restores():
    before = _tf32_state()
    with precision.tf32_mode(True):
        on = _tf32_state()
        with precision.tf32_mode(False):
            off = _tf32_state()
    assert on != off and on in (("tf32", "tf32"), (True, True)) and off in (("ieee", "ieee"), (False, False))
    assert _tf32_state() == before


def test_tf32_mode_keeps_the_legacy_precision_readable():
    """Inductor's max-autotune reads torch.get_float32_matmul_precision(), which raises while the
    legacy value and the per-backend one disagree: tf32_mode keeps them in step, CPU matmuls as they were."""
    cpu_before = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    cpu_before = getattr(cpu_before, "fp32_precision", None)
    legacy_before = torch.get_float32_matmul_precision()
    with precision.tf32_mode(True):
        assert torch.get_float32_matmul_precision() == "high"
        if cpu_before is not None:
            assert torch.backends.mkldnn.matmul.fp32_precision == cpu_before
        with precision.tf32_mode(False):
            assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == legacy_before


def test_autocast_modes():
    with precision.autocast(None, torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    with precision.autocast("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="autocast mode 'fp8'"):
        precision.autocast("fp8", torch.device("cpu"))


def _di(kind, cap=None):
    from hwlib.device import DeviceInfo
    return DeviceInfo(kind=kind, name="GPU" if kind == "cuda" else "cpu", capability=list(cap) if cap else None,
                      total_mem_gib=16.0 if kind == "cuda" else None, sm_count=40, l2_mib=4.0, cpu_count=2,
                      host="vm", colab=False, versions={"triton": "3.6.0"})


def test_runs_here_names_what_a_machine_lacks():
    """Notebook 00's table: a CPU skips the GPU-only steps, a T4 runs bf16 steps as fp16 and skips FP8,
    a P100 has no tensor cores and no compiler backend, an H100 runs everything."""
    def by_step(di):
        return {r["step"]: r for r in steps.runs_here(di)}
    h100 = by_step(_di("cuda", (9, 0)))
    assert all(r["here"] == "runs" for r in h100.values()) and set(h100) == set(steps.STEP_NAMES)
    cpu = by_step(_di("cpu"))
    assert cpu["09_cuda_graphs"]["here"] == "skipped" and "GPU-only" in cpu["09_cuda_graphs"]["why"]
    assert cpu["01_baseline_fp32"]["here"] == "runs"
    t4 = by_step(_di("cuda", (7, 5)))
    assert t4["03_bf16_autocast"]["here"] == "runs as fp16 autocast + GradScaler" and "sm_80" in t4["03_bf16_autocast"]["why"]
    assert t4["18_fp8"]["here"] == "skipped" and "sm_89" in t4["18_fp8"]["why"]
    assert t4["02_tf32"]["here"] == "skipped" and "TF32" in t4["02_tf32"]["why"]
    p100 = by_step(_di("cuda", (6, 0)))
    assert p100["03_bf16_autocast"]["here"].endswith("no speed-up expected") and "sm_70" in p100["03_bf16_autocast"]["why"]
    assert p100["06_torch_compile"]["here"] == "skipped" and "sm_70" in p100["06_torch_compile"]["why"]
