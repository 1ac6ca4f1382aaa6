import json
import sys
import types

import pytest
import torch

from hwlib import noise, query
from hwlib.device import ChoiceError
from hwlib.studies import ablation
from hwlib.workloads.vit_bdh import PROFILES, VisionBDH

TINY = ablation.Window(repeats=2, steps=2, settle=1, warmup=2)


def test_an_ablation_runs_its_arms_interleaved_and_records_the_interval(tmp_path):
    run = tmp_path / "abl"
    # GPT-2's smoke model: its batches are in memory, the quickest to build on a CPU.
    rows = ablation.measure("gpt", "05_fused_optimizer", ["cudnn_benchmark", "without_04_sdpa_attention", "non_blocking"],
                            profile="smoke", device="cpu", window=TINY, run=run, notebook="19_ablations")
    by = {r["toggle"]: r for r in rows}
    for name in ("cudnn_benchmark", "without_04_sdpa_attention"):
        r = by[name]
        assert r["status"] == "ok", r["reason"]
        assert r["ran"] == noise.interleaved_order(TINY.repeats) == ["A", "B", "B", "A"]
        assert [len(w) for w in r["windows"]["without"]] == [TINY.steps] * TINY.repeats
        assert r["lo"] <= r["speedup"] <= r["hi"] and r["effect"] in ("faster", "slower", "within noise")
    assert by["non_blocking"]["status"] == "n/a" and "loader" in by["non_blocking"]["reason"]
    recs = query.load(run)
    name = "without_04_sdpa_attention"
    sp = query.select(recs, metric="speedup", toggle=name)
    assert len(sp) == 1 and sp[0]["fields"] == {"toggle": name, "mode": "in_process"}
    iv = sp[0]["params"]["interval"]
    assert iv["lo"] == pytest.approx(by[name]["lo"]) and iv["level"] == noise.DEFAULT_LEVEL
    assert sp[0]["params"]["settings"]["without"]["attention"] == "manual"
    arms = query.select(recs, metric="ms_per_step", toggle=name)
    assert sorted(r["fields"]["arm"] for r in arms) == ["with", "without"]
    assert query.select(recs, metric="speedup", toggle="non_blocking")[0]["status"] == "n/a"


def _layer_pair(patch):
    cfg = PROFILES["smoke"]
    torch.manual_seed(0)
    ref = VisionBDH(cfg).init_weights(0).double()
    var = VisionBDH(cfg).init_weights(0).double()
    patch(var)
    x = torch.randn(3, 65, cfg.d_model, dtype=torch.float64)
    return ref, var, x


def test_the_broadcast_head_layout_computes_the_same_layer():
    ref, var, x = _layer_pair(ablation._broadcast_layout)
    assert type(var).__name__ == "BroadcastHeads"
    torch.testing.assert_close(var.layer(x), ref.layer(x), rtol=1e-10, atol=1e-10)


def test_rope_computed_every_call_matches_the_cached_tables():
    ref, var, x = _layer_pair(ablation._rope_live)
    assert "rope_cos" not in dict(var.named_buffers())
    torch.testing.assert_close(var.rope_cos.double(), ref.rope_cos.double(), rtol=0, atol=1e-5)
    torch.testing.assert_close(var.rope_sin.double(), ref.rope_sin.double(), rtol=0, atol=1e-5)
    assert (var.layer(x) - ref.layer(x)).abs().max() < 1e-3


def test_zero_grad_arm_zeroes_in_place_and_restores_the_method():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    sess = types.SimpleNamespace(opt=opt)
    p.grad = torch.ones(3)
    with ablation._zero_grad(False)(sess, {}):
        opt.zero_grad(set_to_none=True)          # what the session asks for at a fused step
    assert p.grad is not None and p.grad.eq(0).all()
    assert "zero_grad" not in vars(opt)
    opt.zero_grad(set_to_none=True)
    assert p.grad is None


def test_workers_by_the_rule():
    assert ablation.workers_by_rule(79.6) == 26 and ablation.workers_by_rule(8.0) == 2
    assert ablation.workers_by_rule(2.0) == 1 and ablation.workers_by_rule(None) is None


FAKE_WORKER = r"""
import json, sys
spec = json.load(open(sys.argv[1]))
open(sys.argv[3], "a").write(spec["arm"] + "\n")
if spec["arm"] == "with" and sys.argv[4] == "fail":
    sys.exit("CUDA error: out of memory")
ms = 10.0 if spec["arm"] == "without" else 5.0
json.dump({"status": "ok", "samples_ms": [ms * (1 + 0.01 * i) for i in range(spec["steps"])]}, open(sys.argv[2], "w"))
"""


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_across_processes_each_window_is_a_process_in_the_interleaved_order(tmp_path, mode):
    log = tmp_path / "arms.log"
    cmd = lambda spec, out: [sys.executable, "-c", FAKE_WORKER, str(spec), str(out), str(log), mode]
    row = ablation.measure_in_processes("vit_bdh", "05_fused_optimizer", "cudnn_benchmark", profile="smoke",
                                        device="cpu", window=TINY, run=tmp_path / "r", command=cmd, notebook="19_ablations")
    ran = log.read_text().split()
    rec = query.select(query.load(tmp_path / "r"), metric="speedup", mode="processes")
    if mode == "ok":
        assert ran == ["without", "with", "with", "without"]
        assert row["status"] == "ok" and row["effect"] == "faster" and row["lo"] > 1.5
        assert rec[0]["value"] == pytest.approx(row["speedup"])
    else:   # the first failing window ends it: no ratio recorded, the reason names the window
        assert ran == ["without", "with"]
        assert row["status"] == "failed" and "window 2 (with)" in row["reason"] and "out of memory" in row["reason"]
        assert rec[0]["value"] is None and rec[0]["status"] == "failed"


def test_bad_arguments_fail_before_any_work(tmp_path):
    run = tmp_path / "nothing"
    with pytest.raises(ChoiceError):
        ablation.measure("vit_bdh", "05_fused_optimizer", ["cudnn_benchmark", "no_such_toggle"], device="cpu", run=run, notebook="19_ablations")
    with pytest.raises(ValueError, match="toggles"):
        ablation.measure("vit_bdh", "05_fused_optimizer", "cudnn_benchmark", device="cpu", run=run, notebook="19_ablations")
    with pytest.raises(ValueError, match="Window.steps"):
        ablation.Window(steps=1)
    with pytest.raises(ValueError, match="level"):
        ablation.measure("vit_bdh", "05_fused_optimizer", ["cudnn_benchmark"], device="cpu", level=90, run=run, notebook="19_ablations")
    with pytest.raises(ValueError, match="nothing to remove"):
        ablation.get_toggle("without_01_baseline_fp32")
    assert not (run / "results.jsonl").exists()


def test_a_spent_budget_skips_toggles_without_recording_them(tmp_path):
    rows = ablation.measure("gpt", "05_fused_optimizer", ["cudnn_benchmark"], profile="smoke", device="cpu",
                            window=TINY, budget_s=1e-9, run=tmp_path / "r", notebook="19_ablations")
    assert rows[0]["status"] == "skipped" and "budget" in rows[0]["reason"]
    assert query.select(query.load(tmp_path / "r"), metric="speedup") == []


def test_removals_follow_the_ladder():
    assert ablation.removals_for("10_channels_last", "vit_bdh")[-1] == "without_10_channels_last"
    assert "without_07_nice_shapes" not in ablation.removals_for("10_channels_last", "vit_bdh")
    # a branch: 21 builds on 17, so removing FP8 (18) is not one of its removals
    gpt21 = ablation.removals_for("21_fused_layernorm", "gpt")
    assert gpt21[-2:] == ["without_17_fused_lm_head", "without_21_fused_layernorm"] and "without_18_fp8" not in gpt21
    # a step past the recipe is removed by leaving it out of the chain its modules are swapped in by
    t17 = ablation.get_toggle("without_17_fused_lm_head")
    assert t17.without.skip == "17_fused_lm_head" and t17.with_.skip is None and t17.rebuild
    assert t17.applies("gpt", None, None, "21_fused_layernorm") is None
    assert "does not include" in t17.applies("gpt", None, None, "09_cuda_graphs")
    t = ablation.get_toggle("without_06_torch_compile")
    assert t.without.settings == {"compile": False, "cuda_graphs": False} and t.rebuild


def test_an_interrupted_ablation_keeps_the_toggles_it_finished(tmp_path, monkeypatch):
    run = tmp_path / "cut"
    real, calls = ablation._one, []

    def one(workload, step, t, *a, **k):
        calls.append(t.name)
        if len(calls) == 2:
            raise KeyboardInterrupt   # stopped while measuring the second toggle
        return real(workload, step, t, *a, **k)

    monkeypatch.setattr(ablation, "_one", one)
    with pytest.raises(KeyboardInterrupt):
        ablation.measure("gpt", "05_fused_optimizer", ["non_blocking", "cudnn_benchmark", "without_04_sdpa_attention"],
                         profile="smoke", device="cpu", window=TINY, run=run, notebook="19_ablations")
    recs = query.load(run)
    # the n/a toggle and the one finished are on disk; the one interrupted left nothing
    assert {r["fields"]["toggle"] for r in query.select(recs, metric="speedup")} == {"non_blocking", "cudnn_benchmark"}
    assert query.select(recs, metric="speedup", toggle="cudnn_benchmark")[0]["status"] == "ok"
    assert not query.select(recs, toggle="without_04_sdpa_attention")


def test_sdpa_toggles_are_na_where_the_attention_does_not_go_through_sdpa():
    from hwlib.steps import settings_for
    t = ablation.get_toggle("sdpa_flash_attention")
    assert t.applies("gpt", settings_for("09_cuda_graphs"), None, "09_cuda_graphs") is None
    why = t.applies("gpt", settings_for("24_qkv_grad"), None, "24_qkv_grad")
    assert why and "QKV op" in why and "not through SDPA" in why
    assert "not SDPA" in t.applies("gpt", settings_for("03_bf16_autocast"), None)
    assert "no softmax attention" in t.applies("resnet_bk", settings_for("09_cuda_graphs"), None)


def test_the_workspace_toggle_runs_without_cublass_workspace_on_a_gpu_only(tmp_path, monkeypatch):
    """Retired step 28 as a toggle: its "with" arm's windows (its CUDA graphs' recording included) run
    inside hwlib.blas.no_workspace, its "without" arm as the step is; a session each, the same math; on a
    CPU a 'skipped' record that says why, and no session built."""
    from hwlib import blas
    t = ablation.get_toggle("no_gemm_workspace")
    assert t.rebuild and t.same_math and t.without.context is None and t.with_.skip is None
    assert not blas.workspace_free()
    with t.with_.context(None, {}):
        assert blas.workspace_free() and blas.lt_workspace_bytes() == 0
    assert not blas.workspace_free() and blas.lt_workspace_bytes() == blas.LT_WORKSPACE_BYTES
    assert t.skips(types.SimpleNamespace(kind="cuda")) is None
    assert "CUDA setting" in t.skips(types.SimpleNamespace(kind="cpu"))
    # retired: the step is no longer on the ladder, so there is no removal toggle of it
    with pytest.raises(ChoiceError):
        ablation.get_toggle("without_28_gemm_workspace")
    if torch.cuda.is_available():
        return   # what follows is a CPU's skip

    def no_session(*a, **k):
        raise AssertionError("a skipped toggle builds no session")

    monkeypatch.setattr(ablation, "_build", no_session)
    run = tmp_path / "ws"
    rows = ablation.measure("gpt", "05_fused_optimizer", ["no_gemm_workspace"], profile="smoke", device="cpu",
                            window=TINY, run=run, notebook="19_ablations")
    assert rows[0]["status"] == "skipped" and "measured on a GPU only" in rows[0]["reason"]
    rec = query.select(query.load(run), metric="speedup", toggle="no_gemm_workspace")
    assert len(rec) == 1 and rec[0]["status"] == "skipped" and rec[0]["value"] is None
