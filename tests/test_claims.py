import copy
import json

import pytest

from hwlib import paths, query, results
from hwlib.report import claims as claim_tables
from hwlib.seeds import data, lookup, verdicts

REF = paths.REPO_ROOT / "outputs" / "reference" / "h100"
GPU = {"kind": "cuda", "name": "Test GPU"}
BASE = "05_fused_optimizer"


@pytest.fixture(scope="module")
def _ref_verdicts():
    return verdicts.evaluate(REF)


@pytest.fixture
def ref_verdicts(_ref_verdicts):
    """The verdicts on the committed H100 reference, evaluated once for the module (a read-only run);
    each test gets its own copy."""
    return copy.deepcopy(_ref_verdicts)


def put_step(run, workload, step, ms, peak=None, spread=0.01, device=GPU):
    common = dict(notebook=step, workload=workload, step=step, profile="full", device=device)
    recs = [results.make_record(metric="ms_per_step", value=ms, p20=ms * (1 - spread), p80=ms * (1 + spread),
                                unit="ms", **common),
            results.make_record(metric="tokens_per_s", value=1e6 / ms, unit="tokens/s", **common)]
    if peak is not None:
        recs.append(results.make_record(metric="peak_mem_gib", value=peak, unit="GiB", **common))
    results.append(recs, run)


def put_technique(run, workload, name, ms, peak, step=BASE):
    common = dict(notebook="13_memory", workload=workload, step=step, profile="full", device=GPU,
                  fields={"technique": name})
    results.append([results.make_record(metric="ms_per_step", value=ms, p20=ms, p80=ms, unit="ms", **common),
                    results.make_record(metric="peak_alloc_gib", value=peak, unit="GiB", **common)], run)


def put_bk(run, backend, metric, ms, B=8192, N=2048):
    results.append(results.make_record(notebook="12_bk_core", workload="bk_core", step=None, metric=metric, value=ms,
                                       p20=ms, p80=ms, unit="ms", device=GPU,
                                       fields={"backend": backend, "B": B, "N": N}), run)


@pytest.fixture
def synthetic(tmp_path):
    """A gpt ladder (no encoder_nli): 01 100 ms, 02 50, 03 (bf16) 66.7 -> 1.5x over 01, 04 40,
    05 (fused) 33.3 -> 1.2x, 06 (compile) 37 -> 0.9x; memory 10 -> 4 GiB at 03; a memory study
    where checkpointing costs +40% time and cuts 60% memory; the seed recursion failing at N=122."""
    run = tmp_path / "synthetic"
    put_step(run, "gpt", "01_baseline_fp32", 100.0, peak=10.0)
    put_step(run, "gpt", "02_tf32", 50.0, peak=10.0)
    put_step(run, "gpt", "03_bf16_autocast", 100.0 / 1.5, peak=4.0)
    put_step(run, "gpt", "04_sdpa_attention", 40.0, peak=4.0)
    put_step(run, "gpt", "05_fused_optimizer", 40.0 / 1.2, peak=4.0)
    put_step(run, "gpt", "06_torch_compile", 40.0 / 1.2 / 0.9, peak=4.0)
    put_technique(run, "gpt", "bf16", 100.0, 10.0)
    put_technique(run, "gpt", "bf16 + checkpointing(blocks)", 140.0, 4.0)
    results.append(results.make_record(notebook="12_bk_core", workload="bk_core", step=None, device=GPU,
                                       metric="theta_phi_first_failing_N", fields={"dtype": "complex64"},
                                       value=122, unit="N"), run)
    return run


def by_claim(rows, seed, text):
    hits = [r for r in rows if r["seed"] == seed and r["claim"] == text]
    assert len(hits) == 1, (seed, text, [r["claim"] for r in rows if r["seed"] == seed])
    return hits[0]


def test_verdicts_on_synthetic_results(synthetic):
    rows = verdicts.evaluate(synthetic)
    assert {r["verdict"] for r in rows} <= set(verdicts.VERDICTS)
    fused = by_claim(rows, "003", "Fused AdamW")                    # 1.2x against 1.05-1.10x
    assert fused["measured"] == pytest.approx(1.2) and fused["verdict"] == "holds"
    assert fused["workload"] == "gpt" and fused["gpu"] == "Test GPU"
    assert (fused["from"], fused["to"]) == ("04_sdpa_attention", "05_fused_optimizer")
    assert "nearest measured workload" in fused["note"] and "encoder_nli" in fused["note"]
    bf16 = by_claim(rows, "003", "bf16 autocast vs fp32")           # 1.5x against 2x
    assert bf16["measured"] == pytest.approx(1.5) and bf16["verdict"] == "partly"
    comp = by_claim(rows, "002", "torch.compile")                   # 0.9x against 10-30%
    assert comp["measured"] == pytest.approx(0.9) and comp["verdict"] == "fails"
    tf32 = by_claim(rows, "003", "TF32 on top of bf16")             # premise: measured 02 vs 01 instead
    assert tf32["verdict"] == "premise fails" and tf32["measured"] == pytest.approx(2.0)
    assert "bf16" in tf32["note"]
    workers = by_claim(rows, "003", "Persistent workers")            # encoder_nli's step 08 is not in the run
    assert workers["verdict"] == "not measured" and workers["measured"] is None
    assert "persistent_workers" in workers["note"]                  # read from notebook 19's ablation
    mem = by_claim(rows, "003", "bf16 autocast halves memory")      # 10 -> 4 GiB: -60% against -50%
    assert mem["measured"] == pytest.approx(0.6) and mem["verdict"] == "holds"
    slow = by_claim(rows, "002", "Gradient checkpointing costs time")  # +40% against ~30%
    assert slow["measured"] == pytest.approx(1.4) and slow["verdict"] == "fails"
    ck = by_claim(rows, "002", "Gradient checkpointing halves memory")
    assert ck["measured"] == pytest.approx(0.6) and ck["verdict"] == "holds"
    mixed = [r for r in rows if r["seed"] == "000" and r["claim"].startswith("Mixed-precision BK-Core")][0]
    assert mixed["measured"] == 122 and mixed["verdict"] == "premise fails"
    ddp = by_claim(rows, "000", "DDP training scales over 2-4 GPUs")
    assert ddp["verdict"] == "not measured" and "GPUs" in ddp["note"]
    for r in rows:
        if r["seed"] == "001":
            assert r["verdict"] == "not measured" and "generation" in r["note"]


def test_a_cpu_run_gives_no_verdict_on_gpu_claims(tmp_path):
    run = tmp_path / "cpu"
    cpu = {"kind": "cpu", "name": "cpu"}
    put_step(run, "gpt", "04_sdpa_attention", 40.0, device=cpu)
    put_step(run, "gpt", "05_fused_optimizer", 20.0, device=cpu)
    row = by_claim(verdicts.evaluate(run), "003", "Fused AdamW")
    assert row["measured"] == pytest.approx(2.0) and row["verdict"] == "not measured"
    assert "smoke" in row["note"]


def test_a_gain_inside_the_timing_spread_is_within_noise(tmp_path):
    run = tmp_path / "noisy"
    put_step(run, "gpt", "04_sdpa_attention", 50.0, spread=0.2)
    put_step(run, "gpt", "05_fused_optimizer", 50.0 / 1.08, spread=0.2)   # 1.08x: above the claim's 1.05x
    put_step(run, "gpt", "06_torch_compile", 50.0 / 1.08 / 1.15, spread=0.2)  # 1.15x: above 1.10x
    rows = verdicts.evaluate(run)
    fused = by_claim(rows, "003", "Fused AdamW")
    assert fused["measured"] == pytest.approx(1.08) and fused["verdict"] == "within noise"
    assert "spread (+/-20%)" in fused["note"]
    comp = by_claim(rows, "002", "torch.compile")
    assert comp["measured"] == pytest.approx(1.15) and comp["verdict"] == "within noise"


def test_the_same_gain_beyond_a_narrow_spread_holds(tmp_path):
    run = tmp_path / "quiet"
    put_step(run, "gpt", "04_sdpa_attention", 50.0, spread=0.01)
    put_step(run, "gpt", "05_fused_optimizer", 50.0 / 1.08, spread=0.01)
    row = by_claim(verdicts.evaluate(run), "003", "Fused AdamW")
    assert row["verdict"] == "holds" and "spread" not in row["note"]


@pytest.mark.parametrize("quantity,measured,bound,noise,expected", [
    ("speed", 2.0, 2.0, 0.0, "holds"), ("speed", 1.5, 2.0, 0.0, "partly"), ("speed", 1.0, 2.0, 0.0, "fails"),
    ("speed", 0.8, 1.1, 0.0, "fails"), ("speed", 1.05, 1.5, 0.1, "fails"), ("speed", 1.4, 1.5, 0.1, "within noise"),
    ("speed", 1.2, 1.1, 0.3, "within noise"), ("speed", 1.2, None, 0.3, "within noise"),
    ("speed", 1.2, None, 0.1, "holds"), ("speed", 1.2, 1.5, 0.1, "partly"), ("speed", 0.95, 1.1, 0.1, "fails"),
    ("memory_cut", 0.5, 0.5, 0.0, "holds"), ("memory_cut", 0.2, 0.5, 0.0, "partly"),
    ("memory_cut", -0.1, 0.5, 0.0, "fails"), ("slowdown", 1.1, 1.3, 0.0, "holds"),
    ("slowdown", 1.4, 1.3, 0.0, "fails"), ("survived", 1, None, 0.0, "holds"), ("survived", 0, None, 0.0, "fails"),
    ("speed", None, 2.0, 0.0, "not measured"),
    ("share", 0.65, 0.7, 0.0, "holds"), ("share", 0.79, 0.7, 0.0, "holds"), ("share", 0.35, 0.7, 0.0, "fails"),
    ("share", 0.95, 0.7, 0.0, "fails"), ("share", 0.3, None, 0.0, "not measured"),
])
def test_verdict_rules(quantity, measured, bound, noise, expected):
    assert verdicts.verdict(quantity, measured, bound, noise) == expected


@pytest.mark.filterwarnings("ignore:.*step 'memory. bf16' is not a name")
def test_techniques_are_found_by_field_on_one_base_step(tmp_path):
    run = tmp_path / "techniques"
    put_technique(run, "gpt", "bf16", 100.0, 10.0, step="09_cuda_graphs")
    put_technique(run, "gpt", "bf16 + offload", 125.0, 8.0, step="05_fused_optimizer")
    # an old-style record whose step names the technique is not a technique record (make_record now
    # refuses such a step, and the readers skip the line: it is written here as an old run has it)
    old = results.make_record(notebook="13_memory", workload="gpt", step="05_fused_optimizer", device=GPU,
                              metric="peak_alloc_gib", value=10.0, unit="GiB")
    results.append({**old, "step": "memory: bf16"}, run)
    cut = lookup.measure(lookup.Technique("bf16", "bf16 + offload", "memory_cut"), run, ("gpt",))
    assert cut["value"] is None and "'bf16' of gpt" in cut["reason"]      # different base steps
    put_technique(run, "gpt", "bf16", 100.0, 10.0, step="05_fused_optimizer")
    cut = lookup.measure(lookup.Technique("bf16", "bf16 + offload", "memory_cut"), run, ("gpt",))
    assert cut["value"] == pytest.approx(0.2) and cut["text"] == "-20% memory" and cut["gpu"] == "Test GPU"
    slow = lookup.measure(lookup.Technique("bf16", "bf16 + offload", "slowdown"), run, ("gpt",))
    assert slow["value"] == pytest.approx(1.25)


def test_bk_core_and_ceiling_claims_are_looked_up_by_fields(tmp_path):
    run = tmp_path / "bk"
    put_bk(run, "torch_loop", "forward+backward_ms", 500.0)
    put_bk(run, "torch", "forward+backward_ms", 50.0)
    put_bk(run, "triton", "forward+backward_ms", 2.0)
    put_bk(run, "cuda", "forward+backward_ms", 1.0)
    put_bk(run, "cuda", "forward+backward_ms", 0.01, B=1024)          # another grid point: not the claim's
    put_bk(run, "cuda", "forward_ms", 0.2)
    put_bk(run, "cuSPARSE gtsv2StridedBatch (1 RHS)", "solve_ms", 0.8)
    for dt, tf in (("bf16", 800.0), ("tf32", 400.0), ("fp32", 50.0)):
        results.append(results.make_record(notebook="00_environment", workload=None, step=None, device=GPU,
                                           metric="matmul_tflops", fields={"dtype": dt}, value=tf, unit="TFLOP/s"), run)
    rows = verdicts.evaluate(run)
    fused = by_claim(rows, "000", "Fused CUDA kernels for the theta/phi recursions beat the PyTorch implementation")
    assert fused["measured"] == pytest.approx(500.0) and fused["verdict"] == "holds"
    assert fused["to"] == "cuda" and "fastest of triton, cuda: cuda" in fused["note"]
    assert "vs the vectorised torch scan: 50.00x" in fused["note"]
    sparse = by_claim(rows, "000", "BK kernel compared with cuSPARSE's tridiagonal solver")
    assert sparse["measured"] == pytest.approx(4.0) and sparse["verdict"] == "premise fails"
    tf32 = by_claim(rows, "002", "TF32 speeds up fp32 matrix multiplications")
    assert tf32["measured"] == pytest.approx(8.0) and tf32["verdict"] == "holds"


def test_every_seed_has_a_table_with_all_its_claims(synthetic):
    rows = verdicts.evaluate(synthetic)
    tabs = claim_tables.tables(rows)
    assert list(tabs) == ["000", "001", "002", "003", "004"]
    for sid, table in tabs.items():
        n = sum(1 for c in data.CLAIMS if c.seed == sid)
        assert n >= 4
        assert table.count("\n") == n + 2               # header, rule, one line per claim
        assert table.startswith("| claim | claimed | measured here |")
    md = claim_tables.markdown(rows)
    for s in data.SEEDS.values():
        # Cited by its public source (repository and file), never by a local seeds/ path.
        assert f"{s.id} · {s.title}" in md and s.source and s.source in md and s.file not in md
    assert "seeds/" not in md
    assert "| Fused AdamW | 1.05-1.10x | 1.20x |" in tabs["003"]
    assert claim_tables.run_markdown(synthetic) == md


def test_the_claim_table_is_well_formed():
    kinds = (lookup.Ladder, lookup.Technique, lookup.Records, lookup.Value, lookup.NotHere)
    for c in data.CLAIMS:
        assert c.seed in data.SEEDS and c.claim and c.claimed and c.compares
        assert isinstance(c.measure, kinds)
        if isinstance(c.measure, lookup.NotHere):
            assert c.measure.reason
        assert lookup.quantity_of(c.measure) in lookup.QUANTITIES
        for label, lk in c.also:
            assert label and isinstance(lk, kinds) and not isinstance(lk, lookup.NotHere)


def test_reference_records_follow_the_conventions():
    if not (REF / "results.jsonl").exists():
        pytest.skip("no H100 reference run in this checkout")
    recs = query.read_records(REF / "results.jsonl")
    assert all(isinstance(r.get("fields"), dict) for r in recs)
    assert not [r for r in recs if str(r.get("step")).startswith("memory:") or r.get("step") == "targets"]
    assert not [r for r in recs if "_B8192" in r["metric"] or r["metric"].startswith("matmul_tflops_")]
    assert {r["fields"]["dtype"] for r in query.select(recs, metric="matmul_tflops")} >= {"bf16", "tf32", "fp32"}   # fp16 too from the runs that measure it


def test_reference_h100_gives_the_ladder_ratios_of_the_nearest_workload(ref_verdicts):
    if not (REF / "results.jsonl").exists():
        pytest.skip("no H100 reference run in this checkout")
    summ = json.loads((REF / "summary.json").read_text())
    rows = ref_verdicts
    checks = {("003", "bf16 autocast vs fp32"): ("01_baseline_fp32", "03_bf16_autocast"),
              ("003", "Fused AdamW"): ("04_sdpa_attention", "05_fused_optimizer"),
              ("002", "torch.compile"): ("05_fused_optimizer", "06_torch_compile"),
              ("002", "bf16 mixed precision trains faster"): ("02_tf32", "03_bf16_autocast"),
              ("003", "TF32 on top of bf16"): ("01_baseline_fp32", "02_tf32")}
    for (seed, text), (a, b) in checks.items():
        row = by_claim(rows, seed, text)
        # the seed's nearest workload that this run measured: encoder_nli for the NLI and guide seeds
        assert row["workload"] == "encoder_nli" and row["gpu"] == summ["device"]["name"]
        steps = {s["step"]: s for s in summ["workloads"][row["workload"]]["steps"]}
        assert row["measured"] == pytest.approx(steps[b]["throughput"] / steps[a]["throughput"], rel=1e-9)
    assert by_claim(rows, "003", "TF32 on top of bf16")["verdict"] == "premise fails"
    assert by_claim(rows, "002", "torch.compile")["verdict"] == "holds"      # ~2x against 10-30%
    mm = summ["ceilings"]["matmul_tflops"]
    tf32 = by_claim(rows, "002", "TF32 speeds up fp32 matrix multiplications")
    assert tf32["measured"] == pytest.approx(mm["tf32"] / mm["fp32"], rel=1e-9)
    assert all(r["measured"] is None for r in rows if r["seed"] == "004" and r["verdict"] == "not measured")


def test_reference_h100_study_claims_come_from_their_records(ref_verdicts):
    if not (REF / "results.jsonl").exists():
        pytest.skip("no H100 reference run in this checkout")
    recs = lookup.load_records(REF)
    rows = ref_verdicts

    def one(**match):
        (r,) = query.select(recs, **match)
        return r["value"]
    fb = {b: one(workload="bk_core", metric="forward+backward_ms", backend=b, B=8192, N=2048)
          for b in ("torch_loop", "triton", "cuda")}
    kern = by_claim(rows, "000", "Fused CUDA kernels for the theta/phi recursions beat the PyTorch implementation")
    assert kern["measured"] == pytest.approx(fb["torch_loop"] / min(fb["triton"], fb["cuda"]), rel=1e-9)
    assert kern["verdict"] == "holds"
    peak = {t: one(workload="encoder_nli", metric="peak_alloc_gib", technique=t)
            for t in ("bf16", "bf16 + checkpointing(blocks)")}
    ck = by_claim(rows, "002", "Gradient checkpointing halves memory")
    assert ck["workload"] == "encoder_nli"
    assert ck["measured"] == pytest.approx(1 - peak["bf16 + checkpointing(blocks)"] / peak["bf16"], rel=1e-9)
    oom = by_claim(rows, "003", "OOM-resilient training")
    assert oom["measured"] == one(workload="gpt", metric="oom_events", technique="resilient") >= 1
    assert oom["verdict"] == "holds"
    mixed = [r for r in rows if r["seed"] == "000" and r["claim"].startswith("Mixed-precision BK-Core")][0]
    assert mixed["measured"] == one(workload="bk_core", metric="theta_phi_first_failing_N", dtype="complex64")
    assert "complex128: misses 1e-4 from N = " in mixed["note"]


def test_a_missing_run_has_nothing_measured_and_is_not_created(tmp_path):
    missing = tmp_path / "nope"
    rows = verdicts.evaluate(missing)
    assert not missing.exists()
    assert {r["verdict"] for r in rows} == {"not measured", "premise fails"}
    assert all(r["measured"] is None for r in rows)


def put_ablation(run, workload, toggle, ratio, lo, hi, device=GPU):
    results.append(results.make_record(
        notebook="19_ablations", workload=workload, step="10_channels_last", metric="speedup", value=ratio,
        p20=lo, p80=hi, unit="x", device=device, fields={"toggle": toggle, "mode": "in_process"},
        params={"interval": {"lo": lo, "hi": hi, "level": 0.9}}), run)


@pytest.mark.parametrize("lo, ratio, hi, expected", [
    (1.12, 1.15, 1.18, "holds"),          # the whole interval above the claimed 1.10x
    (0.99, 1.04, 1.12, "within noise"),   # contains 1.10x
    (1.01, 1.03, 1.05, "partly"),         # a real gain, below the claim
    (0.97, 1.00, 1.03, "fails"),          # contains 1 but lies below the claim
])
def test_an_ablation_verdict_is_judged_on_its_interval(tmp_path, lo, ratio, hi, expected):
    put_ablation(tmp_path / "r", "vit_bdh", "rope_cached", ratio, lo, hi)
    row = by_claim(verdicts.evaluate(tmp_path / "r"), "004", "Cached RoPE tables")
    assert row["measured"] == pytest.approx(ratio) and row["verdict"] == expected
    assert (row["lo"], row["hi"]) == (pytest.approx(lo), pytest.approx(hi))
    assert "(90%)" in row["interval_text"]


def test_every_measured_speed_row_carries_an_interval(synthetic):
    for r in verdicts.evaluate(synthetic):
        if r["measured"] is not None and r["quantity"] == "speed":
            assert r["lo"] <= r["measured"] <= r["hi"] and r["interval_text"] != "-", r["claim"]


def test_every_verdict_states_its_interval_or_why_it_has_none(ref_verdicts):
    for r in ref_verdicts:
        if r["measured"] is None:
            assert r["interval_text"] == "-", r["claim"]
        elif r["lo"] is None:
            assert r["interval_text"].startswith("none: "), (r["claim"], r["interval_text"])
        else:
            assert r["lo"] <= r["hi"] and r["interval_text"] not in ("-", "") and not r["interval_text"].startswith(
                "none"), (r["claim"], r["interval_text"])
    assert verdicts.interval_text("memory_cut", None).startswith("none: peak memory")
    assert verdicts.interval_text("speed", None) == "none: one measurement, no spread recorded"
    assert verdicts.interval_text("speed", None, measured=False) == "-"


@pytest.mark.parametrize("interval, expected", [
    ((0.65, 0.75), "holds"), ((0.35, 0.45), "fails"), ((0.55, 0.65), "within noise"), ((0.62, 0.90), "within noise"),
])
def test_a_share_with_an_interval_holds_only_inside_the_tolerance_band(interval, expected):
    mid = sum(interval) / 2
    assert verdicts.verdict("share", mid, 0.7, interval=interval) == expected
