import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from hwlib import paths, query, results


def rec(metric="ms_per_step", value=1.0, step="01_baseline_fp32", **kw):
    return results.make_record(notebook="nb", workload="gpt", step=step, metric=metric, value=value, unit="ms", **kw)


def test_record_is_stamped_in_one_place():
    r = rec(profile="smoke", device="cpu")
    for k in ("notebook", "workload", "step", "metric", "value", "p20", "p80", "unit", "profile", "params",
              "fields", "device", "versions", "git_commit", "code_digest", "time", "status"):
        assert k in r
    # every record carries the device and the library versions, whoever built it
    assert r["device"]["kind"] == "cpu" and r["device"]["name"]
    assert r["versions"]["torch"] and r["versions"]["python"]
    assert rec(device={"name": "X", "kind": "cuda", "extra": 1})["device"] == {
        "kind": "cuda", "name": "X", "capability": None, "total_mem_gib": None, "sm_count": None}
    with pytest.raises(ValueError, match="status"):
        rec(status="great")
    with pytest.raises(ValueError, match="overwrite"):
        rec(extra={"device": "fake"})
    with pytest.raises(ValueError, match="metric"):
        rec(metric="")


def test_x_values_are_fields_and_part_of_the_key(isolated_run):
    results.append([rec(metric="forward_ms", value=1.0, fields={"N": 64}),
                    rec(metric="forward_ms", value=2.0, fields={"N": 128}),
                    rec(metric="forward_ms", value=3.0, fields={"N": 64})])   # N=64 measured again
    got = {r["fields"]["N"]: r["value"] for r in query.load()}
    assert got == {64: 3.0, 128: 2.0}
    assert [r["value"] for r in query.select(query.load(), N=128)] == [2.0]


def test_append_load_and_latest_wins(isolated_run):
    results.append([rec(value=1.0), rec(metric="final_loss", value=3.0)])
    results.append(rec(value=2.0))  # the same key measured again
    latest = query.load()
    assert sorted((r["metric"], r["value"]) for r in latest) == [("final_loss", 3.0), ("ms_per_step", 2.0)]
    assert len(query.load(latest_only=False)) == 3


def test_nonfinite_values_are_stored_as_strings(isolated_run):
    results.append(rec(value=float("nan"), p20=float("inf")))
    line = (isolated_run / "results.jsonl").read_text().splitlines()[-1]
    assert '"value": "nan"' in line and '"p20": "inf"' in line
    json.loads(line)  # still strict JSON


def test_the_stamp_is_written_once_per_append_and_read_back_into_every_record(isolated_run):
    mine = [rec(value=1.0), rec(metric="final_loss", value=3.0), rec(metric="peak_mem_gib", value=2.0)]
    other = rec(metric="tokens_per_s", value=9.0, device={"name": "Other GPU", "kind": "cuda"})
    results.append(mine + [other])
    lines = [json.loads(l) for l in (isolated_run / "results.jsonl").read_text().splitlines()]
    stamps = [l for l in lines if "metric" not in l]
    assert len(stamps) == 2 and len(lines) == 6             # two distinct stamps, each stored once
    assert all(set(results.STAMP_FIELDS).isdisjoint(l) for l in lines if "metric" in l)
    assert query.read_records(isolated_run / "results.jsonl") == mine + [other]   # every record whole again
    # the records read are independent dicts: changing one's device changes no other
    got = query.load(latest_only=False)
    got[0]["device"]["name"] = "changed"
    assert got[1]["device"]["name"] == mine[1]["device"]["name"]


def test_old_lines_with_the_stamp_inside_read_as_they_are(isolated_run):
    isolated_run.mkdir(parents=True, exist_ok=True)
    old = rec(value=4.0)
    (isolated_run / "results.jsonl").write_text(json.dumps(old) + "\n")
    results.append(rec(metric="final_loss", value=5.0))
    assert [r["value"] for r in query.load()] == [4.0, 5.0]
    assert all(r["versions"]["torch"] for r in query.load())


def test_a_record_whose_stamp_line_is_lost_is_kept_and_named(isolated_run):
    results.append([rec(value=1.0), rec(metric="final_loss", value=3.0)])
    path = isolated_run / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[1:]) + "\n")            # the stamp line gone
    with pytest.warns(UserWarning, match="2 record.s. kept without device and versions.*line 1, 2"):
        got = query.load()
    assert sorted(r["value"] for r in got) == [1.0, 3.0] and all("device" not in r for r in got)
    path.write_text('{"stamp": "x"}\n' + "\n".join(lines[1:]) + "\n")   # a stamp line without its fields
    with pytest.warns(UserWarning, match="line 1: a stamp line without its fields"):
        assert len(query.load()) == 2


def test_compacting_old_lines_keeps_every_record_and_damaged_line(isolated_run):
    from hwlib import runs
    isolated_run.mkdir(parents=True, exist_ok=True)
    old = [rec(value=float(i), step=f"0{i}_x") for i in range(1, 6)]
    path = isolated_run / "results.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in old[:3]) + b"\xff damaged\n"
                     + b"".join(json.dumps(r).encode() + b"\n" for r in old[3:]))
    results.append(rec(metric="final_loss", value=7.0))     # already packed: left as it is
    with pytest.warns(UserWarning, match="not UTF-8"):
        before = query.read_records(path)
    size, after_size = runs.compact_results(isolated_run)
    assert after_size < size
    with pytest.warns(UserWarning, match="not UTF-8"):      # the damaged line is still there, still skipped
        assert query.read_records(path) == before
    stamps = [l for l in path.read_bytes().split(b"\n") if l.startswith(b'{"code_source"') and b'"metric"' not in l]
    assert len(stamps) == 2            # the old lines' stamp once, the append's own once


def test_torn_line_is_skipped_and_next_append_is_clean(isolated_run):
    results.append(rec(value=1.0))
    with open(isolated_run / "results.jsonl", "a") as f:
        f.write('{"notebook": "nb", "metric": "half')   # a writer killed mid-line
    results.append(rec(metric="final_loss", value=5.0))
    with pytest.warns(UserWarning, match="line 3: not JSON"):    # line 1 is the first append's stamp
        recs = query.load()
    assert {r["metric"] for r in recs} == {"ms_per_step", "final_loss"}


def test_damaged_lines_are_skipped_with_one_warning_naming_them(isolated_run):
    results.append(rec(value=1.0))
    with open(isolated_run / "results.jsonl", "ab") as f:
        f.write(b"\xff\xfe not utf-8\n")
        f.write(b"[1, 2]\n")
        f.write(b'{"value": 1}\n')
        f.write(b'{"metric": "m", "value": {"a": 1}}\n')
        f.write(b'{"metric": "m", "value": true}\n')
    results.append(rec(metric="final_loss", value=5.0))
    with pytest.warns(UserWarning) as w:
        recs = query.load()
    assert len(w) == 1
    msg = str(w[0].message)
    assert "results.jsonl" in msg and "skipped 5" in msg
    for n, why in ((3, "not UTF-8"), (4, "not an object"), (5, "no 'metric'"), (6, "not a number")):
        assert f"line {n}: " in msg and why in msg
    assert sorted(r["metric"] for r in recs) == ["final_loss", "ms_per_step"]


def test_a_torn_last_line_is_named_torn(isolated_run):
    results.append(rec(value=1.0))
    with open(isolated_run / "results.jsonl", "a") as f:
        f.write('{"notebook": "nb", "metric": "half')
    with pytest.warns(UserWarning, match="line 3: torn"):
        assert len(query.load()) == 1


def test_damaged_json_files_read_as_absent(isolated_run):
    (isolated_run).mkdir(parents=True, exist_ok=True)
    (isolated_run / "ceilings.json").write_text('{"copy_gbps": 1')
    with pytest.warns(UserWarning, match="ceilings.json"):
        assert query.ceilings() is None
    (isolated_run / "ceilings.json").write_text('[1, 2]')
    with pytest.warns(UserWarning, match="not a ceilings object"):
        assert query.ceilings() is None
    (isolated_run / "state.json").write_text('{"01": {"status": "ok"}, "02": {"status": "ok", "seconds": 3}}')
    with pytest.warns(UserWarning, match="'01' lacks"):
        assert list(query.state()) == ["02"]


def _start_together(barrier):
    global _barrier
    _barrier = barrier


def _writer(args):
    # The records are made by the test and come as JSON text: making one, or unpickling one (its
    # torch version is torch's own str type), imports torch, seconds of CPU in each fresh worker,
    # and the appends are what runs concurrently here. The workers start their appends together,
    # so that they contend for the file.
    path, recs = args
    os.environ["HWLIB_RUN"] = path
    recs = json.loads(recs)
    _barrier.wait(timeout=60)
    for r in recs:
        results.append(r)


def test_concurrent_appends_never_interleave(tmp_path):
    run = str(tmp_path / "conc")   # inside HWLIB_OUTPUTS (conftest), inherited by the workers
    recs = [[results.make_record(notebook=f"p{i}", workload="w", step=str(j), metric="m", value=j, unit="",
                                 params={"pad": "x" * 2000}) for j in range(40)] for i in range(4)]
    # Forked workers: each is its own process appending to the same file, as a run's processes are,
    # without a fresh Python importing hwlib per worker (spawn cost about 2 s of CPU for the four)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(4, initializer=_start_together, initargs=(ctx.Barrier(4),)) as pool:
        pool.map(_writer, [(run, json.dumps(r)) for r in recs], chunksize=1)
    lines = [json.loads(l) for l in (Path(run) / "results.jsonl").read_text().splitlines()]
    recs = [r for r in lines if "metric" in r]
    assert len(recs) == 160 and len(lines) == 320      # every append: its stamp line, then its record
    assert all(r["params"]["pad"] == "x" * 2000 for r in recs)
    assert len(query.read_records(Path(run) / "results.jsonl")) == 160


def test_write_atomic_keeps_old_content_on_failure(tmp_path):
    p = tmp_path / "summary.json"
    results.write_json(p, {"a": 1})
    with pytest.raises(TypeError):
        results.write_json(p, {"a": object()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [q.name for q in tmp_path.iterdir()] == ["summary.json"]   # no temp file left behind


def test_run_dir_names(tmp_path, monkeypatch):
    outs = tmp_path / "outs"
    monkeypatch.setenv("HWLIB_OUTPUTS", str(outs))
    assert paths.run_dir("latest") == outs / "latest"
    assert paths.run_dir("reference/h100") == outs / "reference" / "h100"
    assert paths.run_dir("outputs/nbval") == outs / "nbval"
    assert paths.run_dir(outs / "abs") == outs / "abs"
    assert paths.is_reference("reference/h100") and not paths.is_reference("latest")
    monkeypatch.delenv("HWLIB_RUN")
    assert paths.run_dir() == outs / "interactive"
    assert not paths.run_dir("fresh", create=False).exists()


def test_committed_references_are_read_wherever_outputs_points(tmp_path, monkeypatch):
    committed = paths.REPO_ROOT / "outputs" / "reference" / "h100"
    outs = tmp_path / "outs"
    monkeypatch.setenv("HWLIB_OUTPUTS", str(outs))
    assert paths.read_dir("reference/h100") == committed.resolve()
    assert paths.read_dir(committed) == committed.resolve()        # its absolute path, outside outs
    (outs / "reference" / "h100").mkdir(parents=True)              # a run's own reference comes first
    assert paths.read_dir("reference/h100") == outs / "reference" / "h100"
    assert paths.read_dir("latest") == outs / "latest" and not (outs / "latest").exists()
    with pytest.raises(paths.RunNameError, match="outside"):       # only the references are exempt
        paths.read_dir(paths.REPO_ROOT / "outputs" / "elsewhere")
    assert query.load("reference/h200-none") == []


@pytest.mark.parametrize("bad, why", [("../x", "climbs out"), ("a/../../x", "climbs out"), ("", "empty"),
                                      ("   ", "empty"), ("outputs", "names outputs/ itself"),
                                      ("/etc/x", "outside")])
def test_run_names_stay_under_outputs(bad, why, tmp_path, monkeypatch):
    monkeypatch.setenv("HWLIB_OUTPUTS", str(tmp_path / "outs"))
    with pytest.raises(paths.RunNameError, match=why):
        paths.run_dir(bad)
    monkeypatch.setenv("HWLIB_RUN", bad)
    if bad.strip():
        with pytest.raises(paths.RunNameError, match="HWLIB_RUN"):
            paths.run_dir()
    assert not (tmp_path / "x").exists()


def test_code_digest_names_the_code_and_nothing_else(tmp_path):
    (tmp_path / "hwlib" / "__pycache__").mkdir(parents=True)
    (tmp_path / "hwlib" / "kernels").mkdir()
    (tmp_path / "hwlib" / "a.py").write_text("x = 1\n")
    (tmp_path / "hwlib" / "kernels" / "k.cu").write_text("// k\n")
    first = results.code_digest(tmp_path)
    assert len(first) == 12 and results.code_digest(tmp_path) == first
    (tmp_path / "hwlib" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"cache")
    (tmp_path / "notes.md").write_text("not code")
    results._code_digest.cache_clear()
    assert results.code_digest(tmp_path) == first            # caches and other files do not count
    (tmp_path / "hwlib" / "kernels" / "k.cu").write_text("// k changed\n")
    results._code_digest.cache_clear()
    assert results.code_digest(tmp_path) != first
    assert results.code_digest(tmp_path / "nowhere") is None
    assert rec()["code_digest"] == results.code_digest()
