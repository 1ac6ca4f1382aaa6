import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from hwlib import results


def rec(metric="ms_per_step", value=1.0, step="01_baseline_fp32", **kw):
    return results.make_record(notebook="nb", workload="gpt", step=step, metric=metric, value=value, unit="ms", **kw)


def test_record_has_provenance():
    r = rec(profile="smoke", device={"name": "cpu"}, versions={"torch": "x"})
    for k in ("notebook", "workload", "step", "metric", "value", "p20", "p80", "unit", "profile", "params",
              "device", "versions", "git_commit", "code_digest", "time", "status"):
        assert k in r
    with pytest.raises(ValueError, match="status"):
        rec(status="great")


def test_append_load_and_latest_wins(isolated_run):
    results.append([rec(value=1.0), rec(metric="final_loss", value=3.0)])
    results.append(rec(value=2.0))  # the same key measured again
    latest = results.load()
    assert sorted((r["metric"], r["value"]) for r in latest) == [("final_loss", 3.0), ("ms_per_step", 2.0)]
    assert len(results.load(latest_only=False)) == 3


def test_nonfinite_values_are_stored_as_strings(isolated_run):
    results.append(rec(value=float("nan"), p20=float("inf")))
    line = (isolated_run / "results.jsonl").read_text()
    assert '"value": "nan"' in line and '"p20": "inf"' in line
    json.loads(line)  # still strict JSON


def test_torn_line_is_skipped_and_next_append_is_clean(isolated_run):
    results.append(rec(value=1.0))
    with open(isolated_run / "results.jsonl", "a") as f:
        f.write('{"notebook": "nb", "metric": "half')   # a writer killed mid-line
    results.append(rec(metric="final_loss", value=5.0))
    with pytest.warns(UserWarning, match="torn"):
        recs = results.load()
    assert {r["metric"] for r in recs} == {"ms_per_step", "final_loss"}


def _writer(args):
    path, i = args
    os.environ["HWLIB_RUN"] = path
    for j in range(40):
        results.append(results.make_record(notebook=f"p{i}", workload="w", step=str(j), metric="m",
                                           value=j, unit="", params={"pad": "x" * 2000}))


def test_concurrent_appends_never_interleave(tmp_path):
    run = str(tmp_path / "conc")
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(run, i) for i in range(4)])
    lines = (Path(run) / "results.jsonl").read_text().splitlines()
    assert len(lines) == 160
    assert all(json.loads(l)["params"]["pad"] == "x" * 2000 for l in lines)


def test_write_atomic_keeps_old_content_on_failure(tmp_path):
    p = tmp_path / "summary.json"
    results.write_json(p, {"a": 1})
    with pytest.raises(TypeError):
        results.write_json(p, {"a": object()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [q.name for q in tmp_path.iterdir()] == ["summary.json"]   # no temp file left behind


def test_run_dir_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HWLIB_OUTPUTS", str(tmp_path / "outs"))
    assert results.run_dir("latest") == tmp_path / "outs" / "latest"
    assert results.run_dir("reference/h100") == tmp_path / "outs" / "reference" / "h100"
    assert results.run_dir("outputs/nbval") == results.REPO_ROOT / "outputs" / "nbval"
    assert results.run_dir(tmp_path / "abs") == tmp_path / "abs"
    monkeypatch.delenv("HWLIB_RUN")
    assert results.run_dir() == tmp_path / "outs" / "interactive"


def test_code_digest_names_the_code_and_nothing_else(tmp_path):
    (tmp_path / "hwlib" / "__pycache__").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "hwlib" / "a.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "k.cu").write_text("// k\n")
    first = results.code_digest(tmp_path)
    assert len(first) == 12 and results.code_digest(tmp_path) == first
    (tmp_path / "hwlib" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"cache")
    (tmp_path / "notes.md").write_text("not code")
    results._code_digest.cache_clear()
    assert results.code_digest(tmp_path) == first            # caches and other files do not count
    (tmp_path / "kernels" / "k.cu").write_text("// k changed\n")
    results._code_digest.cache_clear()
    assert results.code_digest(tmp_path) != first
    assert results.code_digest(tmp_path / "nowhere") is None
    assert rec()["code_digest"] == results.code_digest()
