import json
import re
from pathlib import Path

import pytest

from hwlib import paths, query, results
from hwlib.ladder import record as record_mod
from hwlib.report import pages
from hwlib.report import tables as report


def put(step, ms=None, tps=None, status="ok", reason=None, check=None, check_status="ok", mfu=None):
    common = dict(notebook=step, workload="gpt", step=step, profile="full", device={"name": "Test GPU"})
    recs = [results.make_record(metric="ms_per_step", value=ms, p20=ms and ms * 0.9, p80=ms and ms * 1.1,
                                unit="ms", status=status, reason=reason, **common)]
    if tps:
        recs.append(results.make_record(metric="tokens_per_s", value=tps, unit="tokens/s", **common))
        recs.append(results.make_record(metric="model_tflops", value=tps / 1000, unit="TFLOP/s", **common))
        recs.append(results.make_record(metric="mfu", value=mfu, unit="", **common))
    if check is not None:
        recs.append(results.make_record(metric="same_math_max_rel", value=check, unit="relative, tolerance 0.01",
                                        status=check_status, **common))
    results.append(recs)


@pytest.fixture
def ladder(isolated_run):
    put("01_baseline_fp32", ms=10.0, tps=1000.0, mfu=0.1)
    put("02_tf32", status="skipped", reason="GPU-only")
    put("03_bf16_autocast", ms=5.0, tps=2000.0, check=1e-3, mfu=0.2)
    put("04_sdpa_attention", ms=4.0, tps=2500.0, check=0.5, check_status="failed", mfu=0.25)
    results.write_json(isolated_run / "ceilings.json", {"copy_gbps": 3000.0, "matmul_tflops": {"bf16": 800.0}})
    return isolated_run


def test_ladder_rows_derive_speedups(ladder):
    rows = {r["step"]: r for r in query.ladder_rows(query.load(), "gpt")}
    assert list(rows) == ["01_baseline_fp32", "02_tf32", "03_bf16_autocast", "04_sdpa_attention"]
    assert rows["01_baseline_fp32"]["speedup_vs_baseline"] == 1.0
    assert rows["03_bf16_autocast"]["speedup_vs_baseline"] == pytest.approx(2.0)
    assert rows["03_bf16_autocast"]["speedup_vs_prev"] == pytest.approx(2.0)   # skipped 02 is not "prev"
    assert rows["02_tf32"]["status"] == "skipped" and rows["02_tf32"]["speedup_vs_baseline"] is None
    assert rows["04_sdpa_attention"]["status"] == "math changed"


def test_a_step_with_only_a_studys_records_is_no_ladder_row(ladder):
    """Notebook 16 profiles a step the ladder has not run in this run: its step_ms and sol_share records
    (no fields) make no ladder row, which would read ok without a time."""
    common = dict(notebook="16_where_time_goes", workload="gpt", step="05_fused_optimizer", profile="full")
    results.append([results.make_record(metric="step_ms", value=3.9, unit="ms", **common),
                    results.make_record(metric="sol_share", value=0.5, unit="fraction", **common)])
    rows = query.ladder_rows(query.load(), "gpt")
    assert "05_fused_optimizer" not in [r["step"] for r in rows]
    assert all(r["ms_per_step"] for r in rows if r["status"] == "ok")


def test_every_ladder_row_has_the_same_columns_when_the_first_step_did_not_run(isolated_run):
    """A baseline that ran out of memory: the rows after it still write as one CSV table."""
    put("01_baseline_fp32", status="skipped", reason="out of memory")
    put("03_bf16_autocast", ms=5.0, tps=2000.0, check=1e-3)
    put("17_fused_lm_head", ms=4.0, tps=2500.0, check=1e-3)
    put("18_fp8", ms=4.5, tps=2200.0, check=1e-3)
    put("21_fused_layernorm", ms=3.8, tps=2600.0, check=1e-3)
    rows = query.ladder_rows(query.load(), "gpt")
    assert len({tuple(r) for r in rows}) == 1, [list(r) for r in rows]
    by = {r["step"]: r for r in rows}
    assert by["01_baseline_fp32"]["prev_step"] is None
    # 21 builds on 17, not on 18: its "x vs prev" is against 17
    assert by["21_fused_layernorm"]["prev_step"] == "17_fused_lm_head"
    assert by["21_fused_layernorm"]["speedup_vs_prev"] == pytest.approx(2600 / 2500)
    assert Path(report.write_all()["gpt.csv"]).read_text().count("\n") == len(rows) + 1
    # the speed-up column names the step it is taken against: 03, the first one measured here, not 01
    assert all(r["base_step"] == "03_bf16_autocast" for r in rows if r["throughput"])
    head = report.markdown_table(rows).splitlines()[0]
    assert "| x vs 03 |" in head and "x vs 01" not in head


def test_a_branch_steps_prose_compares_it_with_the_step_it_builds_on(isolated_run):
    """21 builds on 17: its words say how it did against 17, not against 18 listed just before it."""
    put("17_fused_lm_head", ms=4.0, tps=2500.0, check=1e-5)
    put("18_fp8", ms=3.0, tps=3333.0, check=1e-3)
    put("21_fused_layernorm", ms=3.96, tps=2525.0, check=1e-5)
    rows = query.ladder_rows(query.load(), "gpt")
    text = report.step_prose(rows, "gpt", "21_fused_layernorm")
    assert "Against 17_fused_lm_head (4.00 ms/step) that is 1.01x, within the p20-p80 spread" in text
    assert "18_fp8" not in text


def test_markdown_table_and_prose_use_the_numbers(ladder):
    rows = query.ladder_rows(query.load(), "gpt")
    md = report.markdown_table(rows)
    assert "| 03_bf16_autocast | ok | 5.0 (4.5-5.5) | 2,000 | 2.00 |" in md
    assert "skipped: GPU-only" in md and "math changed" in md
    text = report.what_we_saw(rows, "gpt")
    assert "1,000 tokens/s" in text and "2.00x" in text and "02_tf32 is skipped: GPU-only" in text
    assert "changed the math" in text


def test_write_all_and_summary_schema(ladder):
    written = report.write_all()
    for p in written.values():
        assert Path(p).exists() and Path(p).stat().st_size > 0
    s = json.loads((ladder / "summary.json").read_text())
    assert set(s) == {"device", "versions", "profile", "ceilings", "workloads", "kernels", "generation", "multi_gpu"}
    assert s["ceilings"]["matmul_tflops"]["bf16"] == 800.0
    steps = s["workloads"]["gpt"]["steps"]
    assert [x["step"] for x in steps][:2] == ["01_baseline_fp32", "02_tf32"]
    for k in ("status", "ms_per_step", "ms_p20", "ms_p80", "throughput", "unit", "model_tflops", "mfu",
              "peak_mem_gib", "speedup_vs_baseline", "final_loss"):
        assert k in steps[0]


def test_readme_block_between_markers(ladder, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_START}\nold table\n{report.README_END}\noutro\n")
    assert pages.update_page(readme, ladder) is True
    text = readme.read_text()
    assert "old table" not in text and "Test GPU" in text and text.startswith("intro") and text.endswith("outro\n")
    assert pages.update_page(readme, ladder) is False    # idempotent
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        pages.update_page(readme, ladder)


RESULTS_PAGE = paths.REPO_ROOT / "docs" / "results.md"


def _block(text: str, start: str, end: str) -> str:
    return text[text.index(start) + len(start):text.index(end)].strip()


@pytest.fixture(scope="module")
def built():
    """The reference's blocks as the committed-pages check below built them, by (builder, run): the
    tests after it compare with these rather than build them again (about a CPU-second each)."""
    return {}


def _kept(built: dict, name: str, build):
    def once(run):
        if (name, run) not in built:
            built[name, run] = build(run)
        return built[name, run]
    return once


def test_committed_pages_match_the_reference_runs(monkeypatch, built):
    """README.md and docs/results.md hold, between their markers, what ``hwlib readme`` makes from the
    committed reference runs; each block lives in one of the two, the long tables in docs/results.md."""
    monkeypatch.setenv("HWLIB_OUTPUTS", str(paths.REPO_ROOT / "outputs"))   # read-only use of the reference
    ref = "reference/h100"
    if not (paths.run_dir(ref, create=False) / "results.jsonl").exists():
        pytest.skip("no reference run committed")
    readme, page = (paths.REPO_ROOT / "README.md").read_text(), RESULTS_PAGE.read_text()
    # each block is built once and compared again below (and by the claims check further on)
    monkeypatch.setattr(pages, "readme_block", _kept(built, "readme", report.readme_block))
    monkeypatch.setattr(pages, "claims_block", _kept(built, "claims", report.claims_block))
    assert pages.render_page(readme, ref) == readme, "README's generated blocks are stale: run `make readme`"
    assert pages.render_page(page, ref) == page, "docs/results.md's generated blocks are stale: run `make readme`"
    for start, end, _ in pages.blocks(ref):
        assert (start in readme) + (start in page) == 1, f"{start} belongs on one page"
    for start in (report.README_START, report.CLAIMS_START, report.SMALL_START, report.FIRST_START):
        assert start in page, f"{start}: a long table belongs on docs/results.md"
    assert pages.GLANCE_START in readme and pages.COMMANDS_START in readme
    assert _block(page, report.README_START, report.README_END) == pages.readme_block(ref).strip()
    assert set(built) == {("readme", ref), ("claims", ref)}


def test_the_readme_shows_the_results_before_the_rest(monkeypatch):
    """What a reader meets first: the first look's command before the whole series', both with their time;
    then one line and one figure per workload; then the rest, in a few hundred lines."""
    monkeypatch.setenv("HWLIB_OUTPUTS", str(paths.REPO_ROOT / "outputs"))
    text = (paths.REPO_ROOT / "README.md").read_text()
    assert text.index("make first-look") < text.index("make reproduce") < text.index(pages.COMMANDS_START) \
        < text.index(pages.GLANCE_START) < text.index("## The notebooks")
    commands = _block(text, pages.COMMANDS_START, pages.COMMANDS_END)
    # Each time is the committed run's notebooks' seconds added up, read from its state.json.
    for run in ("reference/h100-first-look", "reference/h100"):
        state = json.loads((paths.REPO_ROOT / "outputs" / run / "state.json").read_text())
        total = sum(v["seconds"] for k, v in state.items() if not k.startswith("_") and isinstance(v, dict))
        assert f"{total:.0f} s ({total / 60:.0f} min) on NVIDIA H100 80GB HBM3" in commands, (run, total)
    glance = _block(text, pages.GLANCE_START, pages.GLANCE_END)
    s = json.loads((paths.REPO_ROOT / "outputs/reference/h100/summary.json").read_text())
    for w in s["workloads"]:
        assert f"- **{w}**: " in glance and f"/outputs/reference/h100/figures/{w}_ladder.png)" in glance
    # the fastest gpt step without FP8 on the ladder (retired 28's records are left out)
    assert "-> 513,663 tokens/s, 01_baseline_fp32 -> 25_bias_column" in glance
    assert len(text.splitlines()) < 400


def test_every_link_of_the_two_pages_works_outside_the_repository():
    """The README is the package's long description: no link of it, nor of the page it sends readers to,
    is relative; each link into the repository names a file that exists (an executed reference notebook
    for every notebook that has one)."""
    from hwlib import source
    base = f"{source.REPOSITORY}/blob/{source.NOTEBOOK_REF}/"
    raw = base.replace("https://github.com/", "https://raw.githubusercontent.com/").replace("/blob/", "/")
    readme = (paths.REPO_ROOT / "README.md").read_text()
    for text in (readme, RESULTS_PAGE.read_text()):
        targets = re.findall(r"\]\(([^)\s]+)\)", text)
        assert targets
        relative = [t for t in targets if not t.startswith(("https://", "#"))]
        assert not relative, relative[:5]
        for t in targets:
            for prefix in (base, raw):
                if t.startswith(prefix):
                    assert (paths.REPO_ROOT / t[len(prefix):].split("#")[0]).exists(), t
    executed = sorted(p.name for p in (paths.REPO_ROOT / "outputs/reference/h100/executed").glob("[0-9][0-9]_*.ipynb"))
    for name in executed:
        if (paths.REPO_ROOT / "notebooks" / name).exists():
            assert f"{base}outputs/reference/h100/executed/{name})" in readme, name


def test_pages_markers_are_optional_but_paired(ladder):
    base = f"intro\n{report.README_START}\nold\n{report.README_END}\n"
    assert report.CLAIMS_START not in pages.render_page(base, ladder)
    both = pages.render_page(base + f"{report.CLAIMS_START}\nstale\n{report.CLAIMS_END}\n", ladder)
    assert "stale" not in both and "| 000 |" in both and "#### 004" in both
    with pytest.raises(ValueError, match="one is missing"):
        pages.render_page(base + report.CLAIMS_START, ladder)
    with pytest.raises(ValueError, match="markers not found"):
        pages.render_page("no block here", ladder)
    assert report.source_markdown("a/b, docs/x.md (commit 1234567)") == \
        "[a/b](https://github.com/a/b), `docs/x.md` (commit 1234567)"
    assert report.source_markdown("a/b (a fork of c/d), X.md") == "[a/b](https://github.com/a/b) (a fork of c/d), `X.md`"


def test_committed_results_page_explains_the_seeds_before_their_claims_tables(monkeypatch, built):
    monkeypatch.setenv("HWLIB_OUTPUTS", str(paths.REPO_ROOT / "outputs"))   # read-only use of the reference
    ref = "reference/h100"
    if not (paths.run_dir(ref, create=False) / "results.jsonl").exists():
        pytest.skip("no reference run committed")
    text = RESULTS_PAGE.read_text()
    section, start = text.index("## The seeds' claims"), text.index(report.CLAIMS_START)
    assert section < start and "A *seed* is" in text[section:start] and "**premise fails**" in text[section:start]
    assert "###" not in _block(text, report.README_START, report.README_END).replace("####", "")
    block = _block(text, report.CLAIMS_START, report.CLAIMS_END)
    assert block == _kept(built, "claims", report.claims_block)(ref).strip(), \
        "the claims tables are stale: run `make readme`"
    assert "[neko-jpg/Project-ResNet-BK-An-O-N-Language-Model-Architecture](https://github.com/" in block


def test_glance_takes_the_fastest_exact_step_and_says_the_fp8_branch_and_a_peer(isolated_run):
    """One line per workload: the first measured step to the fastest step without FP8, whose status is ok;
    the FP8 branch where it is faster still; the speed of light where notebook 16 measured that step; a peer
    measured beside it where a record names one."""
    put("01_baseline_fp32", ms=10.0, tps=1000.0, mfu=0.1)
    put("09_cuda_graphs", ms=2.0, tps=5000.0, check=1e-5, mfu=0.4)
    put("25_bias_column", ms=1.7, tps=5900.0, check=1e-5, mfu=0.5)
    put("26_fp8_head", ms=1.5, tps=6600.0, check=1e-3, mfu=0.55)
    put("24_qkv_grad", ms=1.6, tps=6000.0, check=0.5, check_status="failed", mfu=0.52)   # math changed
    common = dict(notebook="16_where_time_goes", workload="gpt", step="25_bias_column", profile="full",
                  device={"name": "Test GPU"})
    results.append([results.make_record(metric="sol_share", value=0.61, unit="ratio", **common),
                    results.make_record(metric="floor_ms", value=0.5, unit="ms", fields={"part": "step"},
                                        params={"bound": "bytes"}, **common),
                    results.make_record(metric="step_ms", value=1.75, unit="ms", fields={"window": "unprofiled"},
                                        **common),
                    *[results.make_record(metric=m, value=v, unit=u, fields={"study": "anchor"}, params=p,
                                          **{**common, "notebook": "29_anchor", "step": "llm_c"})
                      for m, v, u, p in (("tokens_per_s", 5000.0, "tokens/s", {}),
                                         ("anchor_over_lab", 1.18, "x", {"what": "llm.c train_gpt2cu",
                                                                          "against": "25_bias_column",
                                                                          "interval": {"lo": 1.1, "hi": 1.2}}))]])
    (g,) = pages.glance_rows(isolated_run)
    assert (g["base"]["step"], g["best"]["step"], g["fp8"]["step"]) == ("01_baseline_fp32", "25_bias_column",
                                                                          "26_fp8_head")
    line = pages.glance_line(g)
    assert line.startswith("**gpt**: 1,000 -> 5,900 tokens/s, 01_baseline_fp32 -> 25_bias_column "
                           "(its fastest step without FP8): **5.90x**; MFU 50.0%; 61% of the speed of light")
    assert "The FP8 branch's fastest, 26_fp8_head: 6.60x." in line
    assert "its step floor 0.5 ms (bytes-bound, notebook 16) against 1.8 ms profiled: 3.5x above it" in line
    assert ("Measured beside 25_bias_column in one process (notebook 29_anchor): llm.c train_gpt2cu, 5,000 tokens/s; "
            "25_bias_column runs "
            "1.18x (1.10-1.20) as fast.") in line
    block = pages.glance_block(isolated_run)
    assert "- **gpt**: " in block and "Not meaningful" not in block


def test_commands_block_reads_each_runs_state(ladder, tmp_path):
    results.write_json(ladder / "state.json", {
        "_profile": "full", "_device": "Test GPU", "00_environment": {"status": "ok", "seconds": 20.0, "reason": ""},
        "16_where_time_goes": {"status": "ok", "seconds": 160.0, "reason": ""}})
    block = pages.commands_block(ladder, (tmp_path / "never_ran",))
    first, whole = block.splitlines()[2:]
    assert first.endswith("| no reference run yet |") and "make first-look" in first
    assert "| 00_environment, 16_where_time_goes | 180 s (3 min) on Test GPU (full profile)" in whole
    # of several first-look runs, those that exist, one row each
    rows = pages.commands_block(ladder, (tmp_path / "never_ran", ladder)).splitlines()[2:]
    assert len(rows) == 2 and "make first-look" in rows[0] and "on Test GPU" in rows[0]


def test_a_rerun_with_fewer_metrics_does_not_mix_with_stale_ones(isolated_run):
    from hwlib.ladder import run as train
    from hwlib.profiles import Plan
    r = train.run_step("gpt", "01_baseline_fp32", profile="smoke", device="cpu", plan=Plan(2, 0, 2))
    record_mod.record(r, notebook="01")
    r.status, r.reason, r.timing = "skipped", "now skipped", None
    record_mod.record(r, notebook="01")
    (row,) = query.ladder_rows(query.load(), "gpt")
    assert row["status"] == "skipped" and row["throughput"] is None and row["final_loss"] is None


def _toggle(toggle, value, lo, hi, notebook="19_ablations", mode="in_process", status="ok", metric="speedup",
            arm=None):
    fields = {"toggle": toggle, "mode": mode, **({"arm": arm} if arm else {})}
    return results.make_record(notebook=notebook, workload="gpt", step="09_cuda_graphs", metric=metric, value=value,
                               unit="x", status=status, reason=None if status == "ok" else "the arm failed",
                               device="cpu", fields=fields,
                               params={"what": f"{toggle} on", "interval": {"lo": lo, "hi": hi, "level": 0.9}})


def test_toggle_rows_take_the_newest_record_and_the_interval_decides_the_effect(isolated_run):
    results.append([_toggle("a", 1.30, 1.20, 1.40), _toggle("a", 1.01, 0.99, 1.03),     # re-measured: newest wins
                    _toggle("b", 0.90, 0.85, 0.95), _toggle("c", 1.05, 1.01, 1.09, mode="processes"),
                    _toggle("k", 0.98, 0.96, 0.99, notebook="20_inductor"),
                    _toggle("k", 205.0, None, None, notebook="20_inductor", metric="compile_s", arm="with"),
                    _toggle("f", None, None, None, status="failed")])
    rows = {r["toggle"]: r for r in report.toggle_rows(query.load())}
    assert set(rows) == {"a", "b", "c", "k", "f"}
    assert rows["a"]["speedup"] == 1.01 and rows["a"]["effect"] == "within noise"    # the newer record
    assert rows["b"]["effect"] == "slower" and rows["c"]["effect"] == "faster"
    assert rows["k"]["compile_s_with"] == 205.0 and rows["f"]["effect"] is None
    lines = "\n".join(report.toggle_lines(list(rows.values())))
    assert "| 19 | gpt | 09_cuda_graphs | a on | one process | 1.010 (0.990-1.030, 90%) | within noise | - |" in lines
    assert "a process per window" in lines and "| 205 |" in lines and "failed: the arm failed" in lines
    assert report.toggle_lines([]) == []


def test_a_toggle_the_notebooks_last_run_measured_elsewhere_keeps_only_that_runs_rows():
    """Notebook 20 measured its knobs at step 17, then (its last run) at step 25: the README shows the
    step-25 rows. Notebook 19's last run measured other things: its older rows stay."""
    from datetime import datetime, timedelta, timezone

    def at(rec, t, step):
        return {**rec, "time": t.isoformat(), "step": step}
    t0 = datetime(2026, 11, 20, tzinfo=timezone.utc)
    old = [at(_toggle("k", 0.99, 0.97, 1.00, notebook="20_inductor"), t0, "17_fused_lm_head"),
           at(_toggle("gone", 1.02, 1.01, 1.03, notebook="20_inductor"), t0, "17_fused_lm_head"),
           at(_toggle("a", 1.10, 1.05, 1.15), t0, "09_cuda_graphs")]
    new = [at(_toggle("k", 1.00, 0.98, 1.02, notebook="20_inductor"), t0 + timedelta(days=2), "25_bias_column")]
    windows = {"20_inductor": (t0 + timedelta(days=2, minutes=-5), t0 + timedelta(days=2, minutes=1)),
               "19_ablations": (t0 + timedelta(days=1), t0 + timedelta(days=1, minutes=5))}
    rows = report.toggle_rows(old + new, windows)
    assert sorted((r["notebook"], r["toggle"], r["step"]) for r in rows) == [
        ("19_ablations", "a", "09_cuda_graphs"), ("20_inductor", "gone", "17_fused_lm_head"),
        ("20_inductor", "k", "25_bias_column")]
    assert len(report.toggle_rows(old + new)) == 4          # no windows: every step's newest record


def test_small_gpu_block_names_the_profile_its_reason_and_the_parameters_set(ladder):
    assert report.small_gpu_block([ladder]) == "No reference run in a smaller profile yet."   # no profile: left out
    results.write_json(ladder / "state.json", {
        "_profile": "mid", "_profile_reason": "auto: 16.0 GiB usable",
        "01_baseline_fp32": {"status": "ok", "seconds": 30.0, "reason": ""},
        "19_ablations": {"status": "ok", "seconds": 90.0, "reason": "", "parameters": {"noise_budget_s": 90}}})
    report.write_all(ladder)
    block = report.small_gpu_block([ladder])
    assert "profile `mid`: auto: 16.0 GiB usable." in block and "[gpt](" in block and "gpt_ladder.md)" in block
    assert "120 s over 2 notebooks" in block and "| parameters set |" in block
    assert "| 19_ablations | ok | 90.0 | 75% | - | `noise_budget_s=90` |" in block
    assert "| 01_baseline_fp32 | ok | 30.0 | 25% | - | - |" in block


def test_committed_results_page_shows_the_smaller_profiles_runs(monkeypatch):
    monkeypatch.setenv("HWLIB_OUTPUTS", str(paths.REPO_ROOT / "outputs"))   # read-only use of the references
    text = RESULTS_PAGE.read_text()
    start, end = text.index(report.SMALL_START), text.index(report.SMALL_END)
    assert text[start + len(report.SMALL_START):end].strip() == report.small_gpu_block(report.reference_runs()).strip(), \
        "docs/results.md's smaller-GPU section is stale: run `make readme`"


def test_time_table_counts_compile_seconds_made_while_the_notebook_ran(tmp_path):
    """A study run on its own into a run folder adds rows to its notebook's tables, not compile seconds to
    that notebook's wall time: only records stamped inside the notebook's run (state.json) count."""
    from hwlib import runs
    from hwlib.report.tables import run_window, time_table
    run = tmp_path / "t"
    runs.update_state(run, **{"20_inductor": {"status": "ok", "seconds": 100.0, "reason": "",
                                               "finished": "2026-11-23T04:07:22"}})
    for when, value in (("2026-11-23T04:06:00+00:00", 20.0), ("2026-11-23T04:05:42+00:00", 1.5),
                        ("2026-11-25T19:31:34+00:00", 36.0)):
        results.append([{"notebook": "20_inductor", "metric": "compile_s", "value": value, "unit": "s",
                         "status": "ok", "fields": {"toggle": str(value)}, "time": when}], run)
    row = next(line for line in time_table(run).splitlines() if line.startswith("| 20_inductor"))
    assert row.split("|")[5].strip() == "21.5", row
    start, end = run_window({"seconds": 100.0, "finished": "2026-11-23T04:07:22"})
    assert (end - start).total_seconds() == 110.0 and end.tzinfo is not None
    assert run_window({"seconds": 1.0}) is None and run_window({"finished": "yesterday", "seconds": 1}) is None


def test_time_table_lists_a_runs_notebooks_in_the_order_the_run_went(tmp_path):
    """The committed series' order (hwlib.series): the studies that time ladder steps after the last
    ladder notebook, 99's tables last; a name with no notebook (renamed since) among the ungrouped."""
    from hwlib import runs, series
    from hwlib.report.tables import time_table
    run = tmp_path / "t"
    names = ["99_speedup_tables", "16_where_time_goes", "25_bias_column", "00_environment", "42_gone"]
    runs.update_state(run, **{n: {"status": "ok", "seconds": 1.0, "reason": ""} for n in names})
    listed = [line.split("|")[1].strip() for line in time_table(run).splitlines()[4:]]
    assert listed == ["00_environment", "25_bias_column", "42_gone", "16_where_time_goes", "99_speedup_tables"]
    assert series.order_names(names) == listed
    assert [p.stem for p in series.run_order(series.notebook_paths())][-1] == "99_speedup_tables"


def test_first_look_block_is_the_time_table_of_its_run(ladder, tmp_path):
    assert report.first_look_block((tmp_path / "never_ran",)) == "No first-look reference run yet."
    results.write_json(ladder / "state.json", {
        "_profile": "full", "00_environment": {"status": "ok", "seconds": 20.0, "reason": ""},
        "16_where_time_goes": {"status": "ok", "seconds": 60.0, "reason": "",
                               "parameters": {"steps": ["09_cuda_graphs", "25_bias_column"]}}})
    block = report.first_look_block((ladder,))
    assert "from cold caches" in block and "80 s over 2 notebooks" in block
    assert '| 16_where_time_goes | ok | 60.0 | 75% | - | `steps=["09_cuda_graphs", "25_bias_column"]` |' in block


def test_committed_results_page_shows_the_first_looks_times(monkeypatch):
    monkeypatch.setenv("HWLIB_OUTPUTS", str(paths.REPO_ROOT / "outputs"))   # read-only use of the references
    text = RESULTS_PAGE.read_text()
    start, end = text.index(report.FIRST_START), text.index(report.FIRST_END)
    assert text[start + len(report.FIRST_START):end].strip() == report.first_look_block().strip(), \
        "docs/results.md's first-look section is stale: run `make readme`"


def _row(step, tps, status="ok", spread=None, checked=True):
    return {"step": step, "status": status, "throughput": tps, "process_spread": spread,
            "same_math_max_rel": 1e-5 if checked else None}


def test_past_the_recipe_takes_the_fastest_step_of_each_kind_against_the_recipe():
    from hwlib.report import recipe
    rows = [_row("06_torch_compile", 2000.0), _row("09_cuda_graphs", 1000.0, spread=1.002),
            _row("12_bk_core", 3000.0),                                 # after 09 in the ladder, not past the recipe
            _row("17_fused_lm_head", 1100.0), _row("18_fp8", 1300.0), _row("21_fused_layernorm", 1160.0, spread=1.001),
            _row("22_gelu_epilogue", 1900.0, status="math changed"),    # a changed curve never counts
            _row("23_branch_bias", 1800.0, checked=False)]              # nor one whose curve was not checked
    plain, fp8 = recipe.target_rows(rows)
    assert (plain["step"], round(plain["x_vs_recipe"], 3), plain["met"]) == ("21_fused_layernorm", 1.16, True)
    assert plain["within_noise_of_target"] is False        # 1.16 / 1.15 is 0.9% off, the larger spread 0.2%
    assert (fp8["step"], fp8["x_vs_recipe"], fp8["met"]) == ("18_fp8", 1.3, True)
    assert fp8["within_noise_of_target"] is False          # the recipe's spread alone is enough to judge, as in the ladder
    text = recipe.sentence(rows)
    assert "21_fused_layernorm, 1.160x (target 1.15x: met)" in text and "18_fp8, 1.300x (target 1.25x: met)" in text


def test_past_the_recipe_says_not_met_within_noise_and_unmeasured():
    from hwlib.report import recipe
    rows = [_row("09_cuda_graphs", 1000.0, spread=1.01), _row("25_bias_column", 1148.0, spread=1.002)]
    plain, fp8 = recipe.target_rows(rows)
    assert plain["met"] is False and plain["within_noise_of_target"] is True     # 0.2% short, spread 1%
    assert fp8["step"] is None and fp8["met"] is None
    text = recipe.sentence(rows)
    assert "not met, closer to it than the steps' spread" in text and "FP8 step: none measured" in text
    assert recipe.sentence([_row("25_bias_column", 1148.0)]) == ""                 # no recipe step: nothing to say
    # A recipe step that is there but not clean: no ratio, and the sentence says why.
    bad = [_row("09_cuda_graphs", 1000.0, status="contended"), _row("25_bias_column", 1148.0)]
    assert [t["met"] for t in recipe.target_rows(bad)] == [None, None]
    assert "09_cuda_graphs is contended" in recipe.sentence(bad)


def test_past_the_recipe_adds_the_fp8_steps_long_run_where_its_final_loss_left_the_band():
    """Step 26's final loss after its measurement left the bf16 steps' band: the sentence then adds
    notebook 26's long run (the newest records of the longest run of that step), and says nothing of
    it without such records or where the step before it has no long run."""
    from hwlib.report import recipe

    def row(step, tps, loss):
        return dict(_row(step, tps), final_loss=loss)

    def long(step, value, steps=300, metric="long_final_loss"):
        return {"metric": metric, "status": "ok", "workload": "gpt", "step": step, "value": value,
                "fields": {"steps": steps}}
    rows = [row("09_cuda_graphs", 1000.0, 5.72), row("25_bias_column", 1149.0, 5.74), row("26_fp8_head", 1227.0, 5.67)]
    recs = [long("09_cuda_graphs", 2.438), long("25_bias_column", 2.513), long("26_fp8_head", 2.431),
            long("26_fp8_head", 9.0, steps=50),              # a shorter run of the step does not count
            long(None, 0.031, metric="long_bf16_band"), long(None, 0.5, steps=50, metric="long_bf16_band")]
    m = recipe.long_move(recs, "26_fp8_head")
    assert (m["steps"], m["prev"]) == (300, "25_bias_column")
    assert m["vs_prev"] == pytest.approx(2.431 / 2.513 - 1) and m["band"] == pytest.approx(0.031)
    text = recipe.sentence(rows, recs)
    assert "outside the bf16 steps' band" in text and "trained 300 steps from the same seed, it ended -3.3%" in text
    assert "3.1% apart" in text
    assert "apart" not in recipe.sentence(rows, recs[:4]).split("trained")[1]   # no band recorded: none said
    assert "trained 300" not in recipe.sentence(rows)                       # no records: no long run
    assert recipe.long_move(recs[:1] + recs[2:], "26_fp8_head") is None     # the step before it has none


def test_readme_block_says_how_gpt_stands_past_the_recipe(ladder):
    assert "Past the recipe" not in report.readme_block(ladder)          # no step 09 in the run: nothing said
    put("09_cuda_graphs", ms=2.0, tps=5000.0, check=1e-5, mfu=0.4)
    put("25_bias_column", ms=1.7, tps=5900.0, check=1e-5, mfu=0.5)
    block = report.readme_block(ladder)
    assert ("the fastest step past the recipe without FP8, 25_bias_column, 1.180x (target 1.15x: met); "
            "the fastest FP8 step: none measured (target 1.25x)") in block


def test_the_glance_reads_peers_from_the_machines_sibling_runs_only(monkeypatch):
    monkeypatch.setattr(pages, "reference_runs", lambda: ["reference/h100", "reference/h100-anchor",
                                                          "reference/h100x4", "reference/h200x2-rungs"])
    assert pages.sibling_runs("reference/h100") == ["reference/h100-anchor"]
    assert pages.sibling_runs(paths.REPO_ROOT / "outputs" / "reference" / "h100") == ["reference/h100-anchor"]
    assert pages.sibling_runs("reference/h200x2") == ["reference/h200x2-rungs"]


def _spread(step, value, lo, hi):
    return results.make_record(notebook="19_ablations", workload="gpt", step=step, metric="process_spread", value=value,
                               unit="x", fields={"processes": 2}, params={"interval": {"lo": lo, "hi": hi}},
                               profile="full", device={"name": "Test GPU"})


def test_a_retired_steps_records_leave_the_ladder_for_a_block_of_their_own(isolated_run):
    """The committed runs hold records of step 28, since retired (hwlib.steps.retired). The ladder tables
    leave them out, on purpose: the ladder is hwlib.steps.LADDER. The "Retired steps" block shows the step
    against the step it built on, with both spreads across processes; the time table marks its notebook."""
    from hwlib import runs
    assert "| 28_gemm_workspace | gpt | not measured in this run |" in report.retired_block(isolated_run)
    put("25_bias_column", ms=4.0, tps=2500.0, check=1e-5)
    put("28_gemm_workspace", ms=3.99, tps=2505.0, check=1e-5)
    results.append([_spread("25_bias_column", 1.003, 0.996, 1.008), _spread("28_gemm_workspace", 1.005, 0.992, 1.011)])
    recs = query.load()
    assert [r["step"] for r in query.ladder_rows(recs, "gpt")] == ["25_bias_column"]
    assert "28_gemm_workspace" not in report.markdown_table(query.ladder_rows(recs, "gpt"))
    (r,) = report.retired_rows(recs)
    assert r["speedup_vs_after"] == pytest.approx(2505 / 2500) and r["within_noise"] is True
    assert ("| 28_gemm_workspace | gpt | 4.0 (3.6-4.4) on Test GPU (full) | 25_bias_column: 4.0 (3.6-4.4) | "
            "1.002 (within noise) | 28: 1.005x (0.992-1.011); 25: 1.003x (0.996-1.008) | "
            "notebook 19, toggle `no_gemm_workspace` on 25_bias_column |") in report.retired_block(isolated_run)
    put("28_gemm_workspace", ms=3.0, tps=3300.0, check=1e-5)   # measured again: a gain beyond both spreads
    assert "| 1.320 (outside the noise) |" in report.retired_block(isolated_run)
    runs.update_state(isolated_run, **{n: {"status": "ok", "seconds": 1.0, "reason": ""}
                                       for n in ("25_bias_column", "28_gemm_workspace")})
    listed = [line.split("|")[1].strip() for line in report.time_table(isolated_run).splitlines()[4:]]
    assert listed == ["25_bias_column", "28_gemm_workspace (retired step)"]


def test_the_readme_says_which_steps_were_retired_from_the_reference_records(monkeypatch):
    monkeypatch.setenv("HWLIB_OUTPUTS", str(paths.REPO_ROOT / "outputs"))   # read-only use of the reference
    text = (paths.REPO_ROOT / "README.md").read_text()
    block = _block(text, report.RETIRED_START, report.RETIRED_END)
    assert block == report.retired_block("reference/h100").strip(), "the retired steps are stale: run `make readme`"
    assert "| 28_gemm_workspace | gpt | 31.8 (31.6-32.7) on NVIDIA H100 80GB HBM3 (full) |" in block
    assert "1.002 (within noise)" in block and "notebooks/28_gemm_workspace.ipynb" not in text


def test_decode_ladder_rows_compare_each_rung_with_the_one_before(tmp_path, monkeypatch):
    """decode_bench's records as the README's decode table reads them: each rung against the rung
    measured before it, an SDPA variant against its own rung, the earlier loop against nothing."""
    from hwlib.report import tables
    monkeypatch.setenv("HWLIB_OUTPUTS", str(tmp_path))
    run = tmp_path / "dec"
    run.mkdir()
    lines = []
    for size, rung, ms in (("m", "graph", 4.0), ("m", "rope_cache", 2.0), ("m", "rope_cache[math]", 4.0),
                           ("m", "decode_attn", 1.6), ("m", "14d_static_own", 3.0), ("n", "graph", 10.0),
                           ("n", "matvec", 8.0), ("m", "matvec", 1.0)):
        f = {"batch": 12, "decode_rung": rung, "model_size": size}
        lines.append({"metric": "decode_ms_per_step", "value": ms, "p20": ms, "p80": ms * 1.01, "unit": "ms",
                      "step": tables.DECODE_STEP, "notebook": "decode_bench", "fields": f})
        lines.append({"metric": "decode_share_of_copy", "value": 0.5 / ms, "step": tables.DECODE_STEP,
                      "notebook": "decode_bench", "fields": f})
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = {(r["model_size"], r["rung"]): r for r in tables.decode_rows("dec")}
    x = {k: r["x"] for k, r in rows.items()}
    assert x[("m", "graph")] is None and x[("m", "rope_cache")] == 2.0 and x[("m", "rope_cache[math]")] == 0.5
    assert x[("m", "decode_attn")] == 2.0 / 1.6 and x[("m", "14d_static_own")] is None
    assert x[("m", "matvec")] == 1.6 and x[("n", "matvec")] == 10.0 / 8.0       # per model size
    assert rows[("m", "matvec")]["share"] == 0.5
    text = "\n".join(tables.decode_ladder_lines(["dec", "missing"]))
    assert "| m | decode_attn | 1.600 (1.600-1.616) | 1.25 | 31.2% |" in text and "missing" not in text
    assert tables.decode_ladder_lines(["missing"]) == []


def test_the_glance_names_each_machines_fastest_decode_rung(tmp_path, monkeypatch):
    from hwlib.report import pages
    monkeypatch.setenv("HWLIB_OUTPUTS", str(tmp_path))
    (tmp_path / "dec").mkdir()
    recs = [{"metric": "decode_ms_per_step", "value": ms, "step": "14e_fused_decode", "notebook": "decode_bench",
             "device": {"name": "GPU X"}, "fields": {"decode_rung": rung, "model_size": "m"}}
            for rung, ms in (("graph", 4.0), ("top_p", 1.0), ("matvec", 2.0))]
    (tmp_path / "dec" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    line = pages.decode_glance_line(["dec"])
    assert "on GPU X, m 1.00 ms per decode step of 12 rows (top_p)" in line
    assert pages.decode_glance_line(["nothing"]) is None
