"""``hwlib reproduce`` under faults and bad input: interrupted runs leave no process behind and a
rerun records the same numbers; one run per folder; run folders stay under outputs/, on one
machine and profile; damaged files are skipped with a warning; bad arguments are clear errors.
docs/integrity.md lists these promises beside the tests here that hold them."""

import json
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hwlib import cli, query, runs
from hwlib.device import info
from hwlib.steps import LADDER
from test_cli import WRITE, make_nb, ran_in_process

REPO = Path(__file__).resolve().parent.parent
N = 12   # records the fake measuring notebook writes, one every 0.1 s

# A notebook that measures slowly: it names its processes (the kernel, papermill, and a helper it
# starts in a session of its own, as a data loader worker or compiler would), then writes records.
MEASURE = f'''import json, os, subprocess, sys, time
run = os.environ["HWLIB_RUN"]
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
json.dump([os.getpid(), os.getppid(), helper.pid], open(os.path.join(run, "pids.json"), "w"))
for i in range({N}):
    with open(os.path.join(run, "results.jsonl"), "a") as f:
        f.write(json.dumps({{"notebook": "00_measure", "metric": "m", "value": i * 1.5, "fields": {{"i": i}}}}) + "\\n")
    time.sleep(0.1)
helper.kill()
'''
# A notebook that waits until the test lets it finish.
HOLD = '''import json, os, time
run = os.environ["HWLIB_RUN"]
with open(os.path.join(run, "pids.tmp"), "w") as f:   # whole or absent: the test polls for the file
    json.dump([os.getpid(), os.getppid()], f)
os.replace(os.path.join(run, "pids.tmp"), os.path.join(run, "pids.json"))
t0 = time.time()
while not os.path.exists(os.path.join(run, "release")) and time.time() - t0 < 60:
    time.sleep(0.05)
'''


@pytest.fixture(autouse=True)
def outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("HWLIB_OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.delenv("HWLIB_RUN", raising=False)
    return tmp_path / "outputs"


def series(tmp_path, **bodies) -> Path:
    d = tmp_path / "nbs"
    d.mkdir(exist_ok=True)
    for name, body in bodies.items():
        make_nb(d / f"{name}.ipynb", body)
    return d


def args(nbs, run="r", *extra):
    return ["reproduce", "--notebooks", str(nbs), "--run", run, "--profile", "smoke", "--device", "cpu",
            "--timeout", "60", "--quiet", *extra]


class Cli:
    """``hwlib reproduce`` in a process of its own, in a session of its own, as a shell starts it: a fork
    of this process running ``cli.main`` as ``python -m hwlib.cli`` does (``sys.exit(main())``), in the
    checkout with the checkout first on PYTHONPATH. Forked, it starts with torch imported: a fresh
    interpreter took about 3 CPU-s importing it (the CLI reads the device through it) for each run a
    test starts. The part of ``subprocess.Popen`` the tests use; its output goes to files beside the
    notebooks."""

    def __init__(self, nbs: Path, run: str):
        self._out, self._err = nbs.parent / f"cli-{run}.out", nbs.parent / f"cli-{run}.err"
        # daemon: one a failed test leaves running is ended (SIGTERM: it ends its notebooks) as pytest exits,
        # not waited for
        self._proc = multiprocessing.get_context("fork").Process(target=self._main, args=(args(nbs, run),),
                                                                 daemon=True)
        self._proc.start()
        self.pid, self.returncode = self._proc.pid, None

    def _main(self, argv):
        os.setsid()
        os.chdir(REPO)
        # the checkout first, and whatever the environment already adds (a GPU image's own packages)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        for fd, path in ((1, self._out), (2, self._err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
        try:
            code = cli.main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        sys.exit(code)

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode        # -N for a signal N, as Popen's
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float) -> tuple[str, str]:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("hwlib reproduce", timeout)
        return self._out.read_text(), self._err.read_text()


def start_cli(nbs, run="r") -> Cli:
    return Cli(nbs, run)


def wait_for(pred, what, timeout=60.0):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def lines(run: Path) -> int:
    p = run / "results.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def measured(run: Path) -> list[float]:
    return sorted(r["value"] for r in query.load(run))


# --- 1. interrupted runs leave no process behind ------------------------------------------------------

@pytest.mark.gpu   # a GPU machine's image puts its packages on PYTHONPATH: the CLI started here must find them
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_ends_the_whole_notebook_tree_and_a_rerun_measures_the_same(sig, tmp_path, outputs, capsys):
    nbs = series(tmp_path, **{"00_measure": MEASURE})
    run = outputs / "r"
    proc = start_cli(nbs)
    wait_for(lambda: lines(run) >= 2, "the notebook's first records")
    tree = json.loads((run / "pids.json").read_text())          # kernel, papermill, the helper
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert "recorded as interrupted" in err
    assert [p for p in tree if not gone(p)] == []
    n = lines(run)
    time.sleep(0.4)
    assert lines(run) == n < N                                   # nothing measures on after the CLI
    state = json.loads((run / "state.json").read_text())
    assert state["00_measure"]["status"] == "interrupted" and signal.Signals(sig).name in state["00_measure"]["reason"]
    assert not (run / runs.PIDS_FILE).exists()
    if sig != signal.SIGINT:
        # the state the rerun reads (state.json, no .notebook.pids) is asserted the same as after SIGINT,
        # whose rerun stands for theirs (a notebook's run, seconds of CPU each)
        return
    assert cli.main(args(nbs)) == 0                              # the interrupted notebook is not "done"
    assert measured(run) == [i * 1.5 for i in range(N)]
    assert query.state(run)["00_measure"]["status"] == "ok"


def test_an_error_in_the_cli_ends_the_tree_too(tmp_path, outputs, monkeypatch):
    nbs = series(tmp_path, **{"00_measure": MEASURE})
    run = outputs / "r"
    poll = runs.TreeWatch.poll

    def failing_poll(self):
        poll(self)
        if lines(run) >= 2:
            raise RuntimeError("disk full")

    monkeypatch.setattr(runs.TreeWatch, "poll", failing_poll)
    with pytest.raises(RuntimeError, match="disk full"):
        cli.main(args(nbs))
    tree = json.loads((run / "pids.json").read_text())
    assert [p for p in tree if not gone(p)] == []
    n = lines(run)
    time.sleep(0.4)
    assert lines(run) == n < N
    assert query.state(run)["00_measure"] == {**query.state(run)["00_measure"], "status": "interrupted",
                                              "reason": "RuntimeError: disk full"}


def test_a_leftover_of_a_killed_run_is_ended_before_the_next_one_measures(tmp_path, outputs, capsys):
    nbs = series(tmp_path, **{"00_measure": MEASURE})
    run = outputs / "r"
    proc = start_cli(nbs)
    wait_for(lambda: lines(run) >= 2, "the notebook's first records")
    tree = json.loads((run / "pids.json").read_text())
    wait_for(lambda: set(tree[:2]) <= {p for p, _ in json.loads((run / runs.PIDS_FILE).read_text())["procs"]},
             "the pid file to list papermill and the kernel")
    proc.kill()                                                   # SIGKILL: no clean-up can run
    proc.communicate(timeout=10)
    assert not any(gone(p) for p in tree)                         # the leftover measures on
    assert cli.main(args(nbs)) == 0
    err = capsys.readouterr().err
    assert "ended processes" in err and "killed run of 00_measure" in err
    assert [p for p in tree if not gone(p)] == []
    assert measured(run) == [i * 1.5 for i in range(N)]


# --- 2. one run per folder -----------------------------------------------------------------------------

def test_a_second_run_on_the_same_folder_is_refused_with_the_holder(tmp_path, outputs, capsys, monkeypatch):
    nbs = series(tmp_path, **{"00_hold": HOLD, "01_after": WRITE.format(name="01")})
    run = outputs / "r"
    run_one = cli._run_one

    def hold_for_real(nb, *a, **k):   # 01_after comes out "ok" without a kernel, in both runs: that it ran is enough
        return run_one(nb, *a, **k) if nb.stem == "00_hold" else ("ok", "")
    monkeypatch.setattr(cli, "_run_one", hold_for_real)
    first = start_cli(nbs)            # forked: it runs with hold_for_real too
    wait_for(lambda: (run / "pids.json").exists(), "the first run's notebook")
    assert cli.main(args(nbs, "r", "--only", "01")) == 2
    err = capsys.readouterr().err
    assert f"pid {first.pid}" in err and "--run" in err
    assert "01_after" not in query.state(run)
    (run / "release").touch()
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    state = query.state(run)
    assert state["00_hold"]["status"] == state["01_after"]["status"] == "ok"


def test_a_stale_lock_of_a_dead_run_is_taken_over(tmp_path, outputs, capsys, monkeypatch):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    run = outputs / "r"
    run.mkdir(parents=True)
    (run / runs.LOCK_FILE).write_text(json.dumps({"pid": 2 ** 22 + 7, "host": runs.HOST}))
    ran = ran_in_process(monkeypatch)     # the lock is the subject here, not a notebook's run
    assert cli.main(args(nbs)) == 0
    assert ran == ["00_first"] and query.state(run)["00_first"]["status"] == "ok"


# --- 3. run folders ------------------------------------------------------------------------------------

def test_run_names_stay_under_outputs(tmp_path, outputs, monkeypatch, capsys):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    for bad in ("../x", "", str(tmp_path / "elsewhere")):
        assert cli.main(args(nbs, bad)) == 2
        assert "--run" in capsys.readouterr().err
        assert cli.main(["table", "--run", bad]) == 2
        assert "--run" in capsys.readouterr().err
    for bad in ("../../x", " "):
        monkeypatch.setenv("HWLIB_RUN", bad)
        assert cli.main(args(nbs)[:3] + args(nbs)[5:]) == 2      # no --run: the variable is used
        assert "HWLIB_RUN" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nbs"]  # nothing written anywhere


def test_a_run_folder_holds_one_machine(tmp_path, outputs, capsys, monkeypatch):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    ran = ran_in_process(monkeypatch)     # which runs are refused is the subject, not a notebook's run
    (outputs / "a").mkdir(parents=True)
    (outputs / "a" / "state.json").write_text(json.dumps({"_device": "NVIDIA H100 80GB HBM3"}))
    (outputs / "b").mkdir()
    (outputs / "b" / "results.jsonl").write_text(json.dumps(
        {"metric": "m", "value": 1, "device": {"name": "NVIDIA H100 80GB HBM3"}}) + "\n")
    for run in ("a", "b"):
        assert cli.main(args(nbs, run, "--force")) == 2
        err = capsys.readouterr().err
        assert "NVIDIA H100 80GB HBM3" in err and "name a new run" in err
        assert ran == []
    assert cli.main(args(nbs, "c")) == 0 and ran == ["00_first"]
    assert query.state(outputs / "c")["_device"] == info("cpu").name


def test_overwriting_a_committed_reference_takes_a_flag(tmp_path, outputs, capsys, monkeypatch):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    ref = outputs / "reference" / "h100"
    ref.mkdir(parents=True)
    (ref / "results.jsonl").write_text(json.dumps({"metric": "m", "value": 1, "device": {"name": info("cpu").name}}) + "\n")
    ran = ran_in_process(monkeypatch)     # which runs are refused is the subject, not a notebook's run
    assert cli.main(args(nbs, "reference/h100")) == 2
    assert "--overwrite-reference" in capsys.readouterr().err and ran == []
    assert cli.main(args(nbs, "reference/h100", "--overwrite-reference")) == 0
    assert ran == ["00_first"] and query.state(ref)["00_first"]["status"] == "ok"
    assert cli.main(args(nbs, "reference/new")) == 0             # a new reference is not an overwrite
    assert ran == ["00_first"] * 2 and query.state(outputs / "reference" / "new")["00_first"]["status"] == "ok"


# --- 4. damaged files ----------------------------------------------------------------------------------

def ladder_record(value):
    return {"notebook": "01", "workload": "gpt", "step": LADDER[0].name, "metric": "ms_per_step",
            "value": value, "unit": "ms", "status": "ok", "fields": {}, "device": {"name": info("cpu").name}}


def test_table_skips_damaged_lines_with_one_warning(outputs, capsys):
    run = outputs / "r"
    run.mkdir(parents=True)
    good = json.dumps(ladder_record(12.5)).encode()
    (run / "results.jsonl").write_bytes(b"\n".join([good, b"\xff\xfe not utf-8", b"[1, 2]", b'{"value": 1}',
                                                    b"garbage", good.replace(b"12.5", b'{"a": 1}')]) + b"\n")
    assert cli.main(["table", "--run", "r"]) == 0
    out, err = capsys.readouterr()
    assert "12.5" in out
    warned = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warned) == 1 and str(run / "results.jsonl") in warned[0] and "skipped 5" in warned[0]


@pytest.mark.parametrize("state", ['{"00_first": {"sta', "[1, 2]", '{"00_first": {"status": "ok"}}'])
def test_reproduce_goes_on_past_damaged_state_ceilings_and_curves(state, tmp_path, outputs, capsys, monkeypatch):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    ran = ran_in_process(monkeypatch)     # reproduce reads the damaged files itself; the notebook reads none
    run = outputs / "r"
    (run / "curves" / "gpt").mkdir(parents=True)
    (run / "state.json").write_text(state)
    (run / "ceilings.json").write_text('{"matmul_tfl')
    (run / "curves" / "gpt" / f"{LADDER[0].name}.json").write_bytes(b"\x00\xff")
    (run / "results.jsonl").write_text(json.dumps(ladder_record(3.0)) + "\n{torn")
    assert cli.main(args(nbs)) == 0
    err = capsys.readouterr().err
    assert str(run / "state.json") in err and "Traceback" not in err
    assert ran == ["00_first"]                                    # an entry without seconds is not "done"
    assert query.state(run)["00_first"]["status"] == "ok"
    assert json.loads((run / "summary.json").read_text())["ceilings"]["copy_gbps"] is None


# --- 5. bad arguments ----------------------------------------------------------------------------------

@pytest.mark.parametrize("only", ["", ",", " , "])
def test_only_that_names_nothing_is_an_error(only, tmp_path, outputs, capsys):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    assert cli.main(args(nbs, "r", "--only", only)) == 2
    assert "--only" in capsys.readouterr().err and not (outputs / "r" / "00.txt").exists()


@pytest.mark.parametrize("flag", ["--timeout", "--cell-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "1e400", "1e300", "ten", ""])
def test_time_limits_are_positive_finite_seconds(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["reproduce", "--notebooks", str(tmp_path), flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--workloads", ""], ["--device", ""], ["--device", "cuda:x"], ["--profile", ""]])
def test_other_bad_values_are_errors_naming_the_argument(extra, tmp_path, outputs, capsys):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    assert cli.main(args(nbs, "r")[:-1] + extra) == 2
    err = capsys.readouterr().err
    assert extra[0].lstrip("-") in err and not (outputs / "r" / "00.txt").exists()


def test_profile_variable_is_named_and_an_explicit_profile_wins(tmp_path, outputs, monkeypatch, capsys):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    no_profile = [a for a in args(nbs) if a not in ("--profile", "smoke")]
    monkeypatch.setenv("HWLIB_PROFILE", "bogus")
    assert cli.main(no_profile) == 2
    assert "HWLIB_PROFILE" in capsys.readouterr().err
    monkeypatch.setenv("HWLIB_PROFILE", "full")
    given = []   # what the notebook's run is handed (papermill's -p profile, and its environment), in process
    monkeypatch.setattr(cli, "_run_one", lambda nb, run, env, a, profile, *_: given.append((profile, env["HWLIB_PROFILE"]))
                        or ("ok", ""))
    assert cli.main(args(nbs)) == 0                               # --profile smoke beats HWLIB_PROFILE=full
    assert "profile=smoke (--profile; HWLIB_PROFILE='full' ignored)" in capsys.readouterr().out
    assert given == [("smoke", "smoke")]                          # and the notebook gets it too, both ways


@pytest.fixture
def multi_gpu_once(monkeypatch):
    """The README block's several-GPU table, read from the committed references once for a test that
    renders the block again and again (each read loads every reference run: about 0.9 CPU-s)."""
    from hwlib.report import tables
    real, memo = tables.multi_gpu_lines, {}

    def once(runs):
        key = tuple(runs)
        if key not in memo:
            memo[key] = real(runs)
        return list(memo[key])
    monkeypatch.setattr(tables, "multi_gpu_lines", once)
    return memo


def test_readme_keeps_its_mode_and_check_never_writes(tmp_path, outputs, capsys, multi_gpu_once):
    from hwlib.report.tables import README_END, README_START
    run = outputs / "r"
    run.mkdir(parents=True)
    (run / "results.jsonl").write_text(json.dumps(ladder_record(12.5)) + "\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# lab\n{README_START}\nSTALE-BLOCK\n{README_END}\n")
    readme.chmod(0o644)
    before = readme.stat()
    assert cli.main(["readme", "--run", "r", "--readme", str(readme), "--check"]) == 1
    assert readme.read_text().count("STALE-BLOCK") == 1
    assert (readme.stat().st_ino, readme.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert cli.main(["readme", "--run", "r", "--readme", str(readme)]) == 0
    assert "STALE-BLOCK" not in readme.read_text() and stat.S_IMODE(readme.stat().st_mode) == 0o644
    assert cli.main(["readme", "--run", "r", "--readme", str(readme), "--check"]) == 0
    assert cli.main(["readme", "--run", "../r", "--readme", str(readme)]) == 2
    assert len(multi_gpu_once) == 1   # the block was rendered, with the references' own table
