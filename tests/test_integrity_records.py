"""Records, stamps, state and ceilings are checked where they are read (``hwlib.query``, the one
reader): what fails the schema is skipped with the one warning, never trusted; a record's names never
become paths outside the run; a record is wholly on disk or the writer gets an error; ceilings that
cannot be ceilings give no MFU; tables survive what their cells hold. docs/integrity.md lists these
promises beside these tests."""

import errno
import json
import os
import types

import pytest

from hwlib import cli, query, results
from hwlib.device import info
from hwlib.ladder import record as ladder_record
from hwlib.report import tables
from hwlib.steps import LADDER

CPU = info("cpu").name


def rec(**kw):
    r = {"notebook": "01_baseline_fp32", "workload": "gpt", "step": LADDER[0].name, "metric": "ms_per_step",
         "value": 12.5, "unit": "ms", "status": "ok", "fields": {}, "device": {"name": CPU}}
    r.update(kw)
    return r


def write_lines(path, *objs, raw=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(o) + "\n" for o in objs) + "".join(line + "\n" for line in raw)
    path.write_text(text)
    return path


DAMAGED = [
    ("fields-not-object", rec(fields="abc"), "fields 'abc' is not an object"),
    ("device-a-string", rec(device="gpu0"), "device 'gpu0' is not an object"),
    ("notebook-a-list", rec(notebook=["01"]), "notebook ['01'] is not a name"),
    ("huge-int", rec(value=10 ** 400), "not finite, or too large"),
    ("workload-a-path", rec(workload="../../../../x/PWNED"), "workload '../../../../x/PWNED' is not a name"),
    ("step-a-path", rec(step="a/b"), "step 'a/b' is not a name"),
    ("p20-a-list", rec(p20=[1]), "p20 [1] is not a finite number"),
    ("field-an-object", rec(fields={"batch": {"a": 1}}), "field 'batch'"),
    ("unit-a-number", rec(unit=5), "unit 5 is not a string"),
    ("device-name-a-list", rec(device={"name": ["x"]}), "device name ['x'] is not a string"),
]


@pytest.mark.parametrize("bad,why", [(b, w) for _, b, w in DAMAGED], ids=[i for i, _, _ in DAMAGED])
def test_a_record_that_fails_the_schema_is_skipped_with_the_one_warning(bad, why, isolated_run, capsys):
    path = write_lines(isolated_run / "results.jsonl", rec(value=10.0), bad, rec(value=11.0, step=LADDER[1].name))
    with pytest.warns(UserWarning) as w:
        recs = query.load(isolated_run)
    assert [r["value"] for r in recs] == [10.0, 11.0]
    msg = str(w[0].message)
    assert len(w) == 1 and "skipped 1 damaged line" in msg and "line 2: " in msg and why in msg
    # every command that reads the run goes on: table, the rebuild of reproduce, the README block
    assert cli.main(["table", "--run", str(isolated_run)]) == 0
    out, err = capsys.readouterr()
    assert "12.5" not in out and "Traceback" not in err and str(path) in err
    with pytest.warns(UserWarning):
        written = tables.write_all(isolated_run)
    assert all(isolated_run in p.parents for p in written.values())


def test_a_workload_name_never_writes_outside_the_run(isolated_run, tmp_path):
    bad = rec(workload="../../../../" + str(tmp_path / "x" / "PWNED").lstrip("/"))
    write_lines(isolated_run / "results.jsonl", bad, rec(workload="gpt"))
    with pytest.warns(UserWarning, match="is not a name"):
        written = tables.write_all(isolated_run)
    assert not (tmp_path / "x").exists() and not list(tmp_path.rglob("PWNED*"))
    assert sorted(p.name for p in (isolated_run / "tables").iterdir()) == ["claims.md", "gpt_ladder.csv", "gpt_ladder.md"]
    assert all(isolated_run in p.parents for p in written.values())


@pytest.mark.parametrize("key, name", [("step", "14e_fused[top_p]"), ("workload", "../x"), ("notebook", ""),
                                       ("step", 14), ("workload", "a" * 101)])
def test_a_name_the_readers_would_skip_is_refused_where_the_record_is_made(key, name):
    """A record whose names the readers reject (it becomes a file name) would be lost on reading: the
    run that makes it hears so at once, naming the key and the rule."""
    kw = {"notebook": "decode_bench", "workload": "polychromic", "step": "14e_fused_top_p", key: name}
    with pytest.raises(ValueError, match=f"{key} .* is not a name: letters, digits and _ . \\+ - only"):
        results.make_record(metric="ms_per_cycle", value=1.0, unit="ms", device="cpu", **kw)
    kw[key] = "14e_fused_top_p" if key == "step" else None if key == "workload" else "decode_bench"
    assert query._valid(results.make_record(metric="ms_per_cycle", value=1.0, unit="ms", device="cpu", **kw)) is None


def test_a_stamp_line_whose_id_is_not_its_hash_relabels_nothing(isolated_run):
    results.append([results.make_record(notebook="01", workload="gpt", step=LADDER[0].name, metric="m",
                                        value=1.0, unit="ms", device="cpu")])
    path = isolated_run / "results.jsonl"
    stamp, first = [json.loads(line) for line in path.read_text().splitlines()]
    forged = {**stamp, "device": {**stamp["device"], "name": "NVIDIA H100 80GB HBM3"}}   # same id, other device
    later = {**first, "value": 2.0, "metric": "m2"}
    with open(path, "a") as f:
        f.write(json.dumps(forged) + "\n" + json.dumps(later) + "\n")
    with pytest.warns(UserWarning, match="line 3: a stamp line whose id .* is not the hash of its content"):
        recs = query.load(isolated_run)
    assert [(r["metric"], r["device"]["name"]) for r in recs] == [("m", CPU), ("m2", CPU)]


@pytest.mark.parametrize("state,left_out", [
    ({"_device": ["x"], "00_a": {"status": "ok", "seconds": 1.0}}, "'_device'"),
    ({"_profile": 3, "00_a": {"status": "ok", "seconds": 1.0}}, "'_profile'"),
    ({"../x": {"status": "ok", "seconds": 1.0}, "00_a": {"status": "ok", "seconds": 1.0}}, "is not a notebook name"),
    ({"00_a": {"status": "ok", "seconds": 1.0}, "01_b": {"status": "ok", "seconds": 1e999}}, "'01_b'"),
    ({"00_a": {"status": "ok", "seconds": 1.0}, "01_b": {"status": "ok", "seconds": 2, "parameters": "x=1"}},
     "parameters 'x=1'"),
])
def test_a_state_entry_that_fails_the_schema_is_left_out(state, left_out, isolated_run, capsys):
    isolated_run.mkdir(parents=True, exist_ok=True)
    (isolated_run / "state.json").write_text(json.dumps(state).replace("Infinity", "1e999"))
    with pytest.warns(UserWarning, match=left_out):
        s = query.state(isolated_run)
    assert s == {"00_a": {"status": "ok", "seconds": 1.0}}
    write_lines(isolated_run / "results.jsonl", rec())
    assert cli.main(["table", "--run", str(isolated_run)]) == 0   # reads the state: no traceback
    assert "Traceback" not in capsys.readouterr().err
    with pytest.warns(UserWarning):
        assert "| 00_a |" in tables.time_table(isolated_run)


@pytest.mark.parametrize("bad", [-52.7, float("nan"), float("inf"), "400", 0, True, None])
def test_a_ceiling_that_cannot_be_one_is_left_out_and_gives_no_mfu(bad, isolated_run):
    isolated_run.mkdir(parents=True, exist_ok=True)
    c = {"copy_gbps": bad, "matmul_tflops": {"bf16": bad, "fp32": 50.0}}
    (isolated_run / "ceilings.json").write_text(json.dumps(c))
    if bad is None:
        got = query.ceilings(isolated_run)
    else:
        with pytest.warns(UserWarning, match="matmul_tflops\\['bf16'\\]=.* is not a positive, finite number"):
            got = query.ceilings(isolated_run)
    assert got["matmul_tflops"] == {"fp32": 50.0} and got["copy_gbps"] is None
    res = types.SimpleNamespace(model_tflops=10.0, settings={"autocast": "bf16"})
    value, why = ladder_record.mfu(res, c)                          # even handed the raw file
    assert value is None and "no bf16 matmul ceiling" in why
    assert ladder_record.mfu(types.SimpleNamespace(model_tflops=10.0, settings={}), c) == (0.2, None)
    bad_flops = types.SimpleNamespace(model_tflops=float("nan"), settings={})
    assert ladder_record.mfu(bad_flops, c)[0] is None


def test_a_ceilings_file_that_is_a_folder_reads_as_not_measured(isolated_run):
    (isolated_run / "ceilings.json").mkdir(parents=True)
    with pytest.warns(UserWarning, match="cannot be read"):
        assert query.ceilings(isolated_run) is None
    (isolated_run / "results.jsonl").mkdir()
    with pytest.warns(UserWarning, match="cannot be read"):
        assert query.load(isolated_run) == []


def test_a_short_write_is_retried_and_a_failed_one_leaves_the_file_as_it_was(isolated_run, monkeypatch):
    def r(v):
        return results.make_record(notebook="01", workload="gpt", step=None, metric=f"m{v}", value=float(v),
                                   unit="ms", device="cpu")
    results.append([r(0)])
    path = isolated_run / "results.jsonl"
    before = path.read_bytes()
    real = os.write
    calls = []

    def short(fd, data):               # the kernel may write part of a buffer and say so
        calls.append(len(data))
        return real(fd, data[:max(1, len(data) // 3)])
    monkeypatch.setattr(os, "write", short)
    results.append([r(i) for i in range(1, 21)])
    monkeypatch.setattr(os, "write", real)
    assert len(calls) > 1 and [x["value"] for x in query.load(isolated_run)] == [float(i) for i in range(21)]
    before = path.read_bytes()

    def full(fd, data):                # a disk that fills after 11 records' worth of bytes
        if len(data) > 200:
            return real(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="none of this call's .* is kept: free space"):
        results.append([r(i) for i in range(30, 50)])
    monkeypatch.setattr(os, "write", real)
    assert path.read_bytes() == before                               # no torn line, no half of the records
    results.append([r(99)])
    assert query.load(isolated_run)[-1]["value"] == 99.0


def test_table_cells_hold_pipes_and_line_breaks_and_name_the_mfu_ceiling():
    rows = [{"step": LADDER[0].name, "change": "x", "status": "failed", "reason": "a | b\nc", "ms_per_step": None,
             "ms_p20": None, "ms_p80": None, "throughput": None, "unit": "tokens/s", "same_math_max_rel": None,
             "same_math_tol": None},
            {"step": LADDER[1].name, "change": "y", "status": "ok", "reason": None, "ms_per_step": 2.0, "ms_p20": 1.9,
             "ms_p80": 2.1, "throughput": 100.0, "unit": "tokens/s", "speedup_vs_baseline": 1.0,
             "speedup_vs_prev": None, "model_tflops": 5.0, "mfu": 0.1, "mfu_ceiling": "fp32",
             "same_math_max_rel": None, "same_math_tol": None, "device": CPU, "profile": "smoke"}]
    md = tables.markdown_table(rows)
    body = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(body) == 3 and all(line.count(" | ") == body[0].count(" | ") for line in body)
    assert "failed: a \\| b c" in md
    words = tables.what_we_saw(rows, "gpt")
    assert "of the measured fp32 matmul ceiling" in words and "bf16" not in words


def test_a_time_table_of_notebooks_that_all_took_0_s(isolated_run):
    isolated_run.mkdir(parents=True, exist_ok=True)
    (isolated_run / "state.json").write_text(json.dumps({
        "00_environment": {"status": "ok", "seconds": 0.0},
        "01_baseline_fp32": {"status": "failed", "seconds": 0.0, "reason": "x | y", "parameters": {"a": "|"}}}))
    text = tables.time_table(isolated_run)
    assert "| 00_environment | ok | 0.0 | - |" in text
    cells = [line.replace("\\|", "").count("|") for line in text.splitlines()[2:] if line]
    assert len(cells) == 4 and len(set(cells)) == 1 and '`a="\\|"`' in text
