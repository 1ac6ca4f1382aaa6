import json
import sys

import pytest

from hwlib import query, results
from hwlib.device import ChoiceError, info
from hwlib.report import tables as report
from hwlib.profiles import plan as plan_for
from hwlib.studies import process_noise as pn


def lrow(step, ms, p20=None, p80=None, status="ok"):
    return {"step": step, "status": status, "ms_per_step": ms, "ms_p20": p20 or (ms and ms * 0.99),
            "ms_p80": p80 or (ms and ms * 1.01)}


LADDER = {
    "gpt": [lrow("01_baseline_fp32", 100.0), lrow("02_tf32", 50.0, 40.0, 60.0), lrow("06_torch_compile", 20.0),
            lrow("08_dataloader", None, status="n/a")],
    "resnet_bk": [lrow("03_bf16_autocast", 160.0, 150.0, 190.0), lrow("05_fused_optimizer", 200.0, 190.0, 215.0),
                  lrow("12_bk_core", 30.0)],
}


def test_choose_steps_takes_last_steps_then_the_widest():
    got = [(t.workload, t.step) for t in pn.choose_steps(LADDER, threshold=1.10)]
    # last measured steps first (08 has no time), then p80/p20 above 1.10, widest first (1.5, 1.27, 1.13)
    assert got == [("gpt", "06_torch_compile"), ("resnet_bk", "12_bk_core"), ("gpt", "02_tf32"),
                   ("resnet_bk", "03_bf16_autocast"), ("resnet_bk", "05_fused_optimizer")]
    got = [(t.workload, t.step) for t in pn.choose_steps(LADDER, last_of=["resnet_bk"], threshold=1.2, wide=1)]
    assert got == [("resnet_bk", "12_bk_core"), ("gpt", "02_tf32")]
    assert pn.choose_steps(LADDER, last_of=[], wide=0) == []
    # a workload with no rows: nothing, or with a device's facts its last recipe step
    assert pn.choose_steps({}, last_of=["vit_bdh"]) == []
    (t,) = pn.choose_steps({}, last_of=["vit_bdh"], di=info("cpu"))
    assert t.workload == "vit_bdh" and t.step == pn.last_recipe_step("vit_bdh", info("cpu"))
    assert t.step == "10_channels_last"
    # recipe: a last step past the recipe brings the recipe's last timed step with it (gpt's 25 and 09);
    # a last step inside the recipe (resnet_bk's 12) brings nothing
    past = {"gpt": [lrow("06_torch_compile", 20.0), lrow("09_cuda_graphs", 18.0), lrow("17_fused_lm_head", 17.0),
                    lrow("25_bias_column", 16.0)], "resnet_bk": LADDER["resnet_bk"]}
    got = [(t.workload, t.step) for t in pn.choose_steps(past, wide=0, recipe=True)]
    assert got == [("gpt", "25_bias_column"), ("gpt", "09_cuda_graphs"), ("resnet_bk", "12_bk_core")]
    assert [(t.workload, t.step) for t in pn.choose_steps(past, wide=0)] == [("gpt", "25_bias_column"),
                                                                             ("resnet_bk", "12_bk_core")]
    with pytest.raises(ValueError, match="threshold"):
        pn.choose_steps(LADDER, threshold=0.9)
    with pytest.raises(ValueError, match="wide"):
        pn.choose_steps(LADDER, wide=-1)
    with pytest.raises(ValueError, match="last_of"):
        pn.choose_steps(LADDER, last_of="gpt")


def test_spread_is_slowest_over_fastest_with_an_interval():
    same = [[10.0, 10.1, 9.9, 10.0, 10.05]] * 3
    s = pn.spread(same)
    assert s["spread"] == pytest.approx(1.0) and s["lo"] <= 1.0 <= s["hi"] and not s["beyond_steps"]
    apart = [[10.0, 10.1, 9.9, 10.0], [15.0, 15.2, 14.9, 15.1], [12.0, 12.1, 11.9, 12.0]]
    s = pn.spread(apart)
    assert s["spread"] == pytest.approx(15.05 / 10.0) and (s["slowest"], s["fastest"]) == (1, 0)
    assert s["lo"] > 1.4 and s["beyond_steps"]
    with pytest.raises(ValueError, match="at least 2"):
        pn.spread([[1.0, 2.0]])
    with pytest.raises(ValueError, match="samples"):
        pn.spread([[1.0], [float("nan")]])


# A stand-in worker: no torch, so each "process" costs milliseconds. Process i reports 10 ms x (1 + i/10);
# with mode "fail" the second process dies as a real one would.
FAKE_WORKER = r"""
import json, sys
spec = json.load(open(sys.argv[1]))
log = open(sys.argv[3], "a"); log.write(spec["workload"] + "\n"); log.close()
n = sum(1 for _ in open(sys.argv[3]))
if sys.argv[4] == "fail" and n == 2:
    sys.exit("CUDA error: an illegal memory access was encountered")
ms = 10.0 * (1 + (n - 1) / 10)
json.dump({"status": "ok", "samples_ms": [ms * (1 + 0.001 * i) for i in range(spec["plan"][2] + 3)]},
          open(sys.argv[2], "w"))
"""


def fake(tmp_path, mode="ok"):
    log = tmp_path / "procs.log"
    return log, (lambda spec, out: [sys.executable, "-c", FAKE_WORKER, str(spec), str(out), str(log), mode])


def test_each_repeat_is_a_process_and_is_recorded(isolated_run, tmp_path):
    log, cmd = fake(tmp_path)
    rows = pn.measure([("gpt", "05_fused_optimizer"), ("gpt", "10_channels_last")], processes=3, profile="smoke",
                      device="cpu", command=cmd, notebook="19_ablations")
    assert log.read_text().split() == ["gpt"] * 3
    a, b = rows
    assert a["status"] == "ok" and a["processes"] == 3
    assert a["medians"] == pytest.approx([10.0 * 1.002, 11.0 * 1.002, 12.0 * 1.002], rel=1e-3)
    assert a["spread"] == pytest.approx(1.2, rel=1e-3) and a["beyond_steps"]
    assert b["status"] == "n/a" and "convolution" in b["reason"]
    recs = query.load()
    reps = query.select(recs, metric="ms_per_step", step="05_fused_optimizer")
    assert sorted(r["fields"]["repeat"] for r in reps) == [0, 1, 2]
    (sp,) = query.select(recs, metric="process_spread", step="05_fused_optimizer")
    assert sp["value"] == pytest.approx(a["spread"]) and sp["fields"] == {"processes": 3}
    assert sp["params"]["interval"]["lo"] == pytest.approx(a["lo"])
    (na,) = query.select(recs, metric="process_spread", step="10_channels_last")
    assert na["value"] is None and na["status"] == "n/a"
    # none of these is a ladder row: the ladder of this run stays empty
    assert query.ladder_rows(recs, "gpt") == []


def test_pairs_first_then_round_by_round(isolated_run, tmp_path):
    log, cmd = fake(tmp_path)
    rows = pn.measure([("gpt", "05_fused_optimizer"), ("resnet_bk", "03_bf16_autocast")], processes=3,
                      profile="smoke", device="cpu", command=cmd, notebook="19_ablations")
    # each step's pair back to back (a spread at the least), then the third processes side by side in time
    assert log.read_text().split() == ["gpt", "gpt", "resnet_bk", "resnet_bk", "gpt", "resnet_bk"]
    # each process runs the plan the ladder times the step with on this device; the fake's samples number
    # its timed steps + 3, rising 0.1% a sample, so their median tells that plan's timed count
    n = plan_for("smoke", "cpu").timed + 3
    f = 1 + 0.001 * (n - 1) / 2
    assert [r["medians"] for r in rows] == [pytest.approx([10.0 * f, 11.0 * f, 14.0 * f]),
                                           pytest.approx([12.0 * f, 13.0 * f, 15.0 * f])]


def test_a_budget_never_starts_a_pair_it_cannot_finish(isolated_run, tmp_path, monkeypatch):
    """Each fake process costs 10 s of a fake clock; a 35 s budget runs the first step's pair, does not
    start the second step's (two more would need 20 s of the 15 left), then gives the first its third."""
    log, cmd = fake(tmp_path)
    clock = [0.0]

    def costly(spec, out):
        clock[0] += 10.0
        return cmd(spec, out)
    monkeypatch.setattr(pn.time, "perf_counter", lambda: clock[0])
    rows = pn.measure([("gpt", "05_fused_optimizer"), ("resnet_bk", "03_bf16_autocast")], processes=3,
                      profile="smoke", device="cpu", command=costly, budget_s=35.0, notebook="19_ablations")
    assert log.read_text().split() == ["gpt", "gpt", "gpt"]
    first, second = rows
    assert first["status"] == "ok" and first["processes"] == 3
    assert second["status"] == "skipped" and "0 process(es) done" in second["reason"]
    (sp,) = query.select(query.load(), metric="process_spread")
    assert sp["step"] == "05_fused_optimizer" and sp["fields"] == {"processes": 3}


def test_a_failing_process_ends_its_step_without_a_spread(isolated_run, tmp_path):
    log, cmd = fake(tmp_path, "fail")
    (row,) = pn.measure([("gpt", "05_fused_optimizer")], processes=3, profile="smoke", device="cpu", command=cmd, notebook="19_ablations")
    assert len(log.read_text().split()) == 2
    assert row["status"] == "failed" and "process 2" in row["reason"] and "illegal memory access" in row["reason"]
    (sp,) = query.select(query.load(), metric="process_spread")
    assert sp["value"] is None and sp["status"] == "failed"


def test_a_spent_budget_records_no_spread_of_one_process(isolated_run, tmp_path):
    log, cmd = fake(tmp_path)
    (row,) = pn.measure([("gpt", "05_fused_optimizer")], processes=3, profile="smoke", device="cpu", command=cmd,
                        budget_s=1e-9, notebook="19_ablations")
    assert row["status"] == "skipped" and "budget" in row["reason"] and not log.exists()
    assert query.select(query.load(), metric="process_spread") == []


def test_bad_arguments_fail_before_any_process(isolated_run, tmp_path):
    log, cmd = fake(tmp_path)
    for kw, match in (({"processes": 1}, "processes"), ({"level": 90}, "level"), ({"timeout_s": 0}, "timeout_s"),
                      ({"budget_s": -1}, "budget_s")):
        with pytest.raises(ValueError, match=match):
            pn.measure([("gpt", "05_fused_optimizer")], profile="smoke", device="cpu", command=cmd, **kw, notebook="19_ablations")
    with pytest.raises(ChoiceError):
        pn.measure([("gpt", "05_fused_optimizer"), ("gpt", "99_nothing")], profile="smoke", device="cpu", command=cmd, notebook="19_ablations")
    with pytest.raises(ValueError, match="targets"):
        pn.measure(("gpt", "05_fused_optimizer"), profile="smoke", device="cpu", command=cmd, notebook="19_ablations")
    with pytest.raises(ValueError, match="more than once"):
        pn.measure([("gpt", "05_fused_optimizer"), ("gpt", "05_fused_optimizer")], profile="smoke", device="cpu",
                   command=cmd, notebook="19_ablations")
    assert not log.exists() and not (isolated_run / "results.jsonl").exists()


# --- the ladder tables mark what the measured spread cannot resolve --------------------------------

def put(step, ms, spread=None):
    common = dict(notebook=step, workload="gpt", step=step, profile="full", device={"name": "Test GPU"})
    recs = [results.make_record(metric="ms_per_step", value=ms, p20=ms * 0.99, p80=ms * 1.01, unit="ms", **common),
            results.make_record(metric="tokens_per_s", value=1e5 / ms, unit="tokens/s", **common)]
    if spread is not None:
        recs.append(results.make_record(metric="process_spread", value=spread, unit=pn.SPREAD_UNIT,
                                        fields={"processes": 3}, **{**common, "notebook": "19_ablations"}))
    results.append(recs)


def test_ladder_table_marks_steps_within_the_measured_spread(isolated_run):
    put("01_baseline_fp32", 100.0)
    put("02_tf32", 98.0)                    # 1.02x, but no spread measured for 01 or 02: nothing said
    put("05_fused_optimizer", 96.0, 1.05)   # 1.02x < 1.05 measured here: within noise
    put("06_torch_compile", 60.0)           # 1.6x > the 1.05 of the step before: not within noise
    put("09_cuda_graphs", 61.0, 1.03)       # 0.98x, slower by less than 1.03: within noise
    recs = query.load()
    rows = {r["step"]: r for r in report.ladder_rows_with_noise(recs, "gpt")}
    assert [rows[s]["within_noise"] for s in rows] == [None, None, True, False, True]
    assert rows["06_torch_compile"]["noise_spread"] == pytest.approx(1.05)
    assert rows["05_fused_optimizer"]["process_spread"] == pytest.approx(1.05)
    md = report.markdown_table(list(rows.values()))
    assert "| 1.02 (within noise) |" in md and "| 0.98 (within noise) |" in md
    assert md.count("within noise)") == 2 and "05_fused_optimizer 1.050x" in md
    assert "the difference is within that noise" in report.step_prose(list(rows.values()), "gpt", "09_cuda_graphs")
    assert "larger than that" in report.step_prose(list(rows.values()), "gpt", "06_torch_compile")
    s = report.summary()
    assert [st["within_noise"] for st in s["workloads"]["gpt"]["steps"]] == [None, None, True, False, True]


def test_a_spread_of_other_code_older_than_the_step_is_not_its_spread(isolated_run):
    """A step timed again after a code change is a new measurement: the spread measured before, on the
    old code, no longer describes it (it stays in the file); one measured on the same code, or after
    the step, does."""
    put("05_fused_optimizer", 96.0)
    put("06_torch_compile", 95.0)            # 1.01x over 05
    rows = query.load()
    row_time = next(r["time"] for r in rows if r["step"] == "06_torch_compile" and r["metric"] == "ms_per_step")
    common = dict(notebook="19_ablations", workload="gpt", step="06_torch_compile", profile="full",
                  device={"name": "Test GPU"}, metric="process_spread", value=1.05, unit=pn.SPREAD_UNIT,
                  fields={"processes": 2})
    for digest, time, used in (("0ther0code000", "2000-01-01T00:00:00+00:00", False),   # older, other code
                               (None, "2000-01-01T00:00:00+00:00", True),                # older, the same code
                               ("0ther0code000", "2999-01-01T00:00:00+00:00", True)):    # after the step
        r = results.make_record(**common)
        r.update(time=time, **({"code_digest": digest} if digest else {}))
        results.append(r)
        marked = {x["step"]: x for x in report.ladder_rows_with_noise(query.load(), "gpt")}["06_torch_compile"]
        assert (marked["process_spread"] is not None) == used, (digest, time, row_time)
        assert marked["within_noise"] is (True if used else None)


def test_a_run_without_spreads_shows_the_table_as_before(isolated_run):
    put("01_baseline_fp32", 100.0)
    put("02_tf32", 99.0)
    recs = query.load()
    md = report.markdown_table(report.ladder_rows_with_noise(recs, "gpt"))
    assert md == report.markdown_table(query.ladder_rows(recs, "gpt"))
    assert "noise" not in md and "processes" not in md


def test_the_worker_entry_point_says_how_to_call_it(capsys):
    assert pn._main([]) == 2 and "usage" in capsys.readouterr().err


def test_the_worker_measures_the_step_as_the_ladder_does(isolated_run):
    # a one-layer model: the worker's path is what is checked, not the model's size
    spec = {"workload": "gpt", "step": "05_fused_optimizer", "profile": "smoke", "device": "cpu", "seed": 0,
            "config": {"n_layer": 1, "batch": 2, "context": 16}, "plan": [2, 0, 3]}
    out = pn._worker(spec)
    assert out["status"] == "ok" and len(out["samples_ms"]) == 3 and all(x > 0 for x in out["samples_ms"])
    json.dumps(out)   # it travels back through a file
    assert pn._worker({**spec, "step": "10_channels_last"})["status"] == "n/a"


def test_an_interrupted_study_keeps_the_steps_it_finished(isolated_run, tmp_path):
    log, cmd = fake(tmp_path)
    calls = []

    def stop_at_the_third(spec, out):
        calls.append(spec)
        if len(calls) == 3:   # the second step's first process: stopped as by a signal
            raise KeyboardInterrupt
        return cmd(spec, out)

    with pytest.raises(KeyboardInterrupt):
        pn.measure([("gpt", "05_fused_optimizer"), ("gpt", "06_torch_compile")], processes=2, profile="smoke",
                   device="cpu", command=stop_at_the_third, notebook="19_ablations")
    recs = query.load()
    # the first step's pair and spread are on disk; nothing of the step that was running
    assert len(query.select(recs, metric="ms_per_step", step="05_fused_optimizer")) == 2
    assert query.select(recs, metric="process_spread", step="05_fused_optimizer")[0]["status"] == "ok"
    assert not query.select(recs, step="06_torch_compile")


def test_a_step_interrupted_in_its_last_process_records_nothing(isolated_run, tmp_path):
    log, cmd = fake(tmp_path)
    calls = []

    def stop_at_the_fifth(spec, out):
        calls.append(spec)
        if len(calls) == 5:   # the first step's third and last process (pairs first, then round by round)
            raise KeyboardInterrupt
        return cmd(spec, out)

    with pytest.raises(KeyboardInterrupt):
        pn.measure([("gpt", "05_fused_optimizer"), ("gpt", "06_torch_compile")], processes=3, profile="smoke",
                   device="cpu", command=stop_at_the_fifth, notebook="19_ablations")
    # neither step finished: no spread over two of three processes with a budget's reason it never had
    assert query.load() == []
