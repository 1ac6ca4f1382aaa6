
import pytest
import torch._inductor.config as inductor_config

from hwlib import query
from hwlib.device import ChoiceError, info
from hwlib.steps import get_step, settings_for
from hwlib.studies import ablation, inductor
from hwlib.studies import breakdown as bd

TINY = ablation.Window(repeats=2, steps=2, settle=1, warmup=2)


def _option(key):
    obj = inductor_config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_each_knob_is_a_rebuild_toggle_whose_arms_differ_only_by_the_options_they_patch():
    assert 4 <= len(inductor.KNOBS) <= 7 and inductor.SMOKE_KNOB in inductor.KNOBS
    assert {"max_autotune", "max_autotune_coordinate_descent", "coordinate_descent"} <= set(inductor.KNOBS)
    for name, knob in inductor.KNOBS.items():
        t = ablation.get_toggle(f"inductor_{name}")
        assert t is inductor.TOGGLES[name] and t.rebuild and t.same_math and t.fallible
        assert t.without.model is None and len(knob.why) > 80
        if knob.kind == "step":
            # hwlib's own fusion: the arm with has the step's modules swapped in, nothing else differs
            assert t.without.context is t.with_.context is None
            assert t.without.settings == t.with_.settings == {}
            assert t.with_.model is get_step(knob.step).apply and get_step(knob.step).beyond_recipe
            continue
        assert t.with_.model is None
        assert t.without.settings == t.with_.settings == {}
        off, on = t.without.context, t.with_.context
        assert isinstance(off, inductor.InductorConfig) and isinstance(on, inductor.InductorConfig)
        assert set(off.changes) == set(on.changes) and off.changes == knob.off and on.changes == knob.on
        assert all(off.changes[k] != on.changes[k] for k in on.changes) and len(knob.why) > 80
        before = {k: _option(k) for k in on.changes}
        for arm in (off, on):   # the context really sets the options, and puts them back
            with arm(None, {}):
                assert {k: _option(k) for k in on.changes} == arm.changes
            assert {k: _option(k) for k in on.changes} == before


def test_on_a_cpu_the_triton_knobs_are_skipped_with_their_reason(tmp_path):
    cpu = info("cpu")
    why = inductor.TOGGLES["max_autotune"].skips(cpu)
    assert "max-autotune" in why and "Triton GEMM templates" in why and "GPU" in why
    assert "C++" in inductor.TOGGLES["coordinate_descent"].skips(cpu)
    assert inductor.TOGGLES["aggressive_fusion"].skips(cpu) is None
    ghost = inductor.Knob("ghost", {"no_such_option": True}, {"no_such_option": False}, "t", "w", triton=False)
    assert "no inductor option no_such_option" in inductor.knob_toggle(ghost).skips(cpu)
    # an eager step compiles nothing: the knobs do not apply there
    assert "does not compile" in inductor.TOGGLES["max_autotune"].applies("gpt", settings_for("05"), cpu)
    # across processes too, a skipped knob starts no process and is recorded with its reason
    row = ablation.measure_in_processes("gpt", "17_fused_lm_head", "inductor_multi_kernel", profile="smoke",
                                        device="cpu", window=TINY, run=tmp_path / "p",
                                        command=lambda spec, out: ["false"], notebook="20_inductor")
    assert row["status"] == "skipped" and "C++" in row["reason"]
    assert query.select(query.load(tmp_path / "p"), metric="speedup")[0]["status"] == "skipped"


def test_the_fused_layernorm_knob_applies_to_gpt_compiled_steps_only():
    cpu = info("cpu")
    t = inductor.TOGGLES["fused_residual_layernorm"]
    assert t.applies("gpt", settings_for("17"), cpu, "17_fused_lm_head") is None
    assert "does not use it" in t.applies("vit_bdh", settings_for("09"), cpu, "09_cuda_graphs")
    assert "does not compile" in t.applies("gpt", settings_for("05"), cpu, "05_fused_optimizer")
    # a step that already has the change: the ladder measured it (21 and 22 made these two part of the chain)
    assert "already part of this step, since 21_fused_layernorm" in t.applies("gpt", settings_for("25"), cpu,
                                                                               "25_bias_column")
    gelu = inductor.TOGGLES["gelu_epilogue"]
    assert gelu.applies("gpt", settings_for("21"), cpu, "21_fused_layernorm") is None
    assert "since 22_gelu_epilogue" in gelu.applies("gpt", settings_for("23"), cpu, "23_branch_bias")
    assert t.with_.model is get_step("21_fused_layernorm").apply and t.without.model is None
    with pytest.raises(ValueError, match="kind must be"):
        inductor.Knob("k", {"a": True}, {"a": False}, "t", "w", triton=False, kind="other")
    with pytest.raises(ValueError, match="names its step"):
        inductor.Knob("k", {}, {}, "t", "w", triton=False, kind="step")


def test_the_best_step_is_17_on_gpt_and_09_where_17_does_not_apply():
    assert inductor.best_step("gpt", "cpu") == ("17_fused_lm_head", None)
    step, why = inductor.best_step("vit_bdh", "cpu")
    assert step == "09_cuda_graphs" and "17_fused_lm_head does not run here" in why


def test_with_the_runs_ladder_the_best_step_is_its_fastest_compiled_bf16_step():
    def row(step, ms, status="ok"):
        return {"step": step, "ms_per_step": ms, "status": status}
    rows = [row("05_fused_optimizer", 20.0), row("09_cuda_graphs", 36.3), row("17_fused_lm_head", 34.2),
            row("18_fp8", 30.0), row("24_qkv_grad", 31.8), row("25_bias_column", 31.5), row("23_branch_bias", None, "n/a")]
    # 05 is eager (nothing for inductor's options), 18 is FP8: neither counts however fast
    assert inductor.fastest_step(rows) == "25_bias_column"
    assert inductor.best_step("gpt", "cpu", rows) == ("25_bias_column", None)
    assert inductor.fastest_step([row("24_qkv_grad", 31.0), row("25_bias_column", 31.5)]) == "24_qkv_grad"
    # no row it can use: the rule without rows
    assert inductor.best_step("gpt", "cpu", [row("05_fused_optimizer", 20.0), row("18_fp8", 30.0)]) == \
        ("17_fused_lm_head", None)
    assert inductor.best_step("gpt", "cpu", []) == ("17_fused_lm_head", None)


def test_bad_knobs_fail_before_any_work(tmp_path):
    run = tmp_path / "nothing"
    with pytest.raises(ChoiceError, match="knob 'no_such_knob'") as e:
        inductor.measure(["aggressive_fusion", "no_such_knob"], device="cpu", run=run, notebook="20_inductor")
    assert e.value.argument == "knob" and "max_autotune" in str(e.value)
    with pytest.raises(ValueError, match="knobs"):
        inductor.measure("aggressive_fusion", device="cpu", run=run, notebook="20_inductor")
    with pytest.raises(ValueError, match="knobs"):
        inductor.measure([], device="cpu", run=run, notebook="20_inductor")
    with pytest.raises(ValueError, match="level"):
        inductor.measure(["aggressive_fusion"], device="cpu", level=2.0, run=run, notebook="20_inductor")
    with pytest.raises(ValueError, match="different values"):
        inductor.Knob("same", {"max_autotune": True}, {"max_autotune": True}, "t", "w", triton=True)
    with pytest.raises(ValueError, match="already registered"):
        ablation.register(inductor.knob_toggle(inductor.KNOBS["max_autotune"]))
    with pytest.raises(ValueError, match="same_math needs rebuild"):
        ablation.Toggle("x", "x", ablation.Arm(), ablation.Arm(), rebuild=False, same_math=True)
    assert not (run / "results.jsonl").exists()


def test_one_knob_runs_through_the_ablation_on_a_cpu_and_records_compile_time_and_math(tmp_path, monkeypatch):
    # What is checked is how a knob runs through the ablation and what it records, not a backend: the
    # sessions compile with dynamo's eager backend (the knob is then inert, as under make test's aot_eager),
    # each arm still tracing its own graph; AOT autograd's joint graph, which nothing here reads, cost 4.5 s
    # of this test's 19 s of CPU on a 2-core machine. Inductor's own compile is tests/test_fallbacks.py's.
    # One layer: each arm still compiles its own graph, a smaller one (compiles are most of this test's time).
    monkeypatch.setenv("HWLIB_CPU_COMPILE_BACKEND", "eager")
    run = tmp_path / "r"
    rows = inductor.measure([inductor.SMOKE_KNOB, "max_autotune"], profile="smoke", device="cpu", window=TINY,
                            run=run, notebook="20_inductor", config={"n_layer": 1})
    by = {r["knob"]: r for r in rows}
    r = by[inductor.SMOKE_KNOB]
    assert r["status"] == "ok", r["reason"]
    assert r["step"] == "17_fused_lm_head" and r["fallback"] is None and r["changes"] == {"aggressive_fusion": True}
    assert r["ran"] == ["A", "B", "B", "A"] and r["lo"] <= r["speedup"] <= r["hi"]
    assert r["verdict"] in ("keep", "drop (slower)", "drop (within noise)")
    assert r["settings"]["without"] == r["settings"]["with"] and r["settings"]["with"]["compile"]
    # the compile time is the first call less a steady step, for both arms (each compiles its own graph)
    for arm in ("without", "with"):
        assert r["first_step_s"][arm] > r[f"ms_{arm}"] / 1e3 * 0.5
        assert r["compile_s"][arm] == pytest.approx(max(0.0, r["first_step_s"][arm] - r[f"ms_{arm}"] / 1e3))
    m = r["same_math"]
    assert m["k"] == TINY.warmup and len(r["first_losses"]["with"]) == TINY.warmup and m["tolerance"] == 1e-2
    assert m["ok"] and m["max_rel"] <= 1e-2 and all(v > 0 for v in r["first_losses"]["without"])
    sk = by["max_autotune"]
    assert sk["status"] == "skipped" and "Triton GEMM templates" in sk["reason"] and sk["verdict"].startswith("not")
    recs = query.select(query.load(run), notebook="20_inductor")
    name = f"inductor_{inductor.SMOKE_KNOB}"
    assert query.select(recs, metric="speedup", toggle=name)[0]["value"] == pytest.approx(r["speedup"])
    comp = query.select(recs, metric="compile_s", toggle=name)
    assert sorted(c["fields"]["arm"] for c in comp) == ["with", "without"]
    assert {c["fields"]["arm"]: c["value"] for c in comp} == pytest.approx(r["compile_s"])
    check = query.select(recs, metric="same_math_max_rel", toggle=name)
    assert len(check) == 1 and check[0]["status"] == "ok" and check[0]["value"] == pytest.approx(m["max_rel"])
    skipped = query.select(recs, metric="speedup", toggle="inductor_max_autotune")
    assert skipped[0]["status"] == "skipped" and "GPU" in skipped[0]["reason"]
    assert inductor.SMOKE_KNOB in inductor.prose(rows, 0.9, on_gpu=False)


def test_a_combination_is_compiled_only_where_one_of_its_parts_was_kept():
    combo = inductor.KNOBS["max_autotune_coordinate_descent"]
    assert set(combo.parts) == {"max_autotune", "coordinate_descent"}
    order = list(inductor.KNOBS)
    assert all(order.index(p) < order.index(combo.name) for p in combo.parts)   # its parts are measured first

    def part(knob, effect, status="ok", math_ok=True):   # an ablation row of a knob measured before
        return {"toggle": f"inductor_{knob}", "status": status, "effect": effect, "same_math": {"ok": math_ok}}

    dropped = [part("max_autotune", "slower"), part("coordinate_descent", "within noise")]
    why = inductor.combination_skip(combo, dropped)
    assert "none of its parts was kept" in why and "max_autotune: drop (slower)" in why
    assert inductor.combination_skip(combo, [dropped[0], part("coordinate_descent", "faster")]) is None
    # faster but with other math is not kept either
    assert "drop (math changed)" in inductor.combination_skip(
        combo, [dropped[0], part("coordinate_descent", "faster", math_ok=False)])
    # a part not measured (skipped, or not asked for) leaves the question open: measure the combination
    assert inductor.combination_skip(combo, [dropped[0], part("coordinate_descent", None, "skipped")]) is None
    assert inductor.combination_skip(combo, dropped[:1]) is None
    assert inductor.combination_skip(inductor.KNOBS["max_autotune"], dropped) is None   # not a combination


def test_a_skipped_combination_is_a_row_with_its_reason_and_no_work(tmp_path, monkeypatch):
    built = []

    def fake_one(workload, step, t, *a):
        built.append(t.name)
        return ablation._row(workload, step, t, "in_process", status="ok", effect="within noise",
                             same_math={"ok": True})

    monkeypatch.setattr(ablation, "_one", fake_one)
    monkeypatch.setattr(ablation, "_records", lambda rows, **kw: [])   # the faked rows have no windows to record
    import dataclasses
    for k in ("max_autotune", "coordinate_descent", "max_autotune_coordinate_descent"):   # GPU knobs, faked here
        name = f"inductor_{k}"
        monkeypatch.setitem(ablation.TOGGLES, name, dataclasses.replace(ablation.TOGGLES[name], skips=None))
    rows = inductor.measure(["max_autotune", "coordinate_descent", "max_autotune_coordinate_descent"],
                            profile="smoke", device="cpu", window=TINY, run=tmp_path / "r", notebook="20_inductor")
    assert built == ["inductor_max_autotune", "inductor_coordinate_descent"]
    last = rows[-1]
    assert last["knob"] == "max_autotune_coordinate_descent" and last["status"] == "skipped"
    assert "none of its parts was kept" in last["reason"] and last["verdict"] == "not measured (skipped)"


def test_same_math_check_and_verdicts():
    ok = ablation.same_math_check({"without": [10.0, 9.0], "with": [10.0, 9.05]}, "17_fused_lm_head")
    assert ok["ok"] and ok["max_rel"] == pytest.approx(0.05 / 9.0) and ok["k"] == 2
    assert not ablation.same_math_check({"without": [10.0], "with": [10.2]}, "17_fused_lm_head")["ok"]
    row = {"status": "ok", "effect": "faster", "same_math": {"ok": True}}
    assert inductor.verdict(row) == "keep"
    assert inductor.verdict({**row, "effect": "within noise"}) == "drop (within noise)"
    assert inductor.verdict({**row, "same_math": {"ok": False}}) == "drop (math changed)"
    assert inductor.verdict({"status": "skipped"}) == "not measured (skipped)"


def _bd(step, metric, value, category=None, notes=()):
    return {"notebook": "16_where_time_goes", "step": step, "metric": metric, "value": value, "status": "ok",
            "fields": {"category": category} if category else {"window": "unprofiled"}, "params": {"notes": list(notes)}}


def test_what_the_breakdown_leaves_is_read_from_notebook_16s_records():
    rows, text = inductor.breakdown_left([], "17_fused_lm_head")
    assert rows == [] and "has not run" in text
    recs = [_bd("09_cuda_graphs", "step_ms", 40.0),
            _bd("09_cuda_graphs", "category_ms", 12.0, "elementwise"), _bd("09_cuda_graphs", "category_floor_ms", 2.0, "elementwise"),
            _bd("09_cuda_graphs", "category_ms", 16.0, "gemm"), _bd("09_cuda_graphs", "category_floor_ms", 14.0, "gemm")]
    rows, text = inductor.breakdown_left(recs, "17_fused_lm_head")
    el = next(r for r in rows if r["category"] == "LayerNorm / elementwise")
    assert el["above floor (ms)"] == pytest.approx(10.0) and el["speed-up at its floor"] == pytest.approx(40 / 30)
    assert el["measured / floor"] == pytest.approx(6.0)
    head = next(r for r in rows if r["category"] == "LM head + cross-entropy")
    assert head["ms/step"] is None and head["speed-up at its floor"] is None
    assert "09_cuda_graphs (not 17_fused_lm_head" in text and "LayerNorm / elementwise" in text
    measured = {"knob": "max_autotune", "step": "17_fused_lm_head", "status": "ok", "ms_without": 40.0, "ms_with": 39.0,
                "speedup": 40 / 39, "lo": 1.01, "hi": 1.04, "effect": "faster", "verdict": "keep",
                "compile_s": {"without": 2.0, "with": 90.0}, "same_math": {"k": 5, "max_rel": 1e-5, "ok": True,
                                                                          "tolerance": 1e-2}}
    said = inductor.prose([measured], 0.9, on_gpu=True, left=rows)
    assert "Kept, a gain beyond noise with the same math: max_autotune." in said and "1.026x" in said
    assert "1.33x" in said and "compiling took 90 s with it against 2 s without" in said
    said = inductor.prose([{**measured, "effect": "within noise", "verdict": "drop (within noise)"}], 0.9, True, rows)
    assert "inductor's defaults stay" in said and "no option reached any of it" in said
    # the fused head: its GEMMs counted as GEMMs (the breakdown's note) leave the head below its floor; the two
    # become one row
    among = "the head's matmuls are not the longest GEMMs by 3x (...): " + bd.HEAD_AMONG_GEMMS
    fused = [_bd("17_fused_lm_head", "step_ms", 34.7, notes=[among]),
             _bd("17_fused_lm_head", "category_ms", 17.2, "gemm"), _bd("17_fused_lm_head", "category_floor_ms", 11.0, "gemm"),
             _bd("17_fused_lm_head", "category_ms", 1.8, "lm_head_ce"), _bd("17_fused_lm_head", "category_floor_ms", 5.0, "lm_head_ce")]
    rows, text = inductor.breakdown_left(fused, "17_fused_lm_head")
    assert [r["category"] for r in rows] == ["GEMMs + LM head + cross-entropy", "LayerNorm / elementwise"]
    assert rows[0]["ms/step"] == pytest.approx(19.0) and rows[0]["floor (ms)"] == pytest.approx(16.0)
    assert rows[0]["above floor (ms)"] == pytest.approx(3.0) and "taken together" in text
