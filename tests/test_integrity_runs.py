"""``hwlib reproduce`` cannot be turned against its user: processes are known by a token in their
environment, never by a file; a leftover of a killed run anywhere on the machine stops a measurement;
run folders are resolved before any check; one notebook's fault is that notebook's row; ``--set``
values reach the notebook exactly as state.json records them. docs/integrity.md lists these promises
beside these tests."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hwlib import cli, query, runs
from test_cli import WRITE, make_nb, ran_in_process
from test_integrity_cli import HOLD, args, gone, outputs, series, start_cli, wait_for  # noqa: F401 (a fixture)


def _alive(p: subprocess.Popen) -> bool:
    return p.poll() is None and not gone(p.pid)


# --- processes: a token in the environment, never a file ---------------------------------------------

def test_a_hand_written_pid_file_gets_nothing_killed(tmp_path, monkeypatch, capsys):
    """Also: a relative HWLIB_OUTPUTS reaches the notebooks (their kernel starts in the notebooks'
    folder), and the executed copy keeps no absolute path of the measuring machine."""
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HWLIB_OUTPUTS", "rel-out")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        run = tmp_path / "rel-out" / "r"
        run.mkdir(parents=True)
        start = runs._stat(victim.pid)[3]
        (run / runs.PIDS_FILE).write_text(json.dumps({"host": runs.HOST, "notebook": "00_first",
                                                      "procs": [[victim.pid, start]]}))
        assert cli.main(args(nbs)) == 0
        assert _alive(victim), "a process named only by .notebook.pids was killed"
        assert "ended processes" not in capsys.readouterr().err
        assert not (run / runs.PIDS_FILE).exists() and (run / "00.txt").read_text() == "smoke\n"
        meta = json.loads((run / "executed" / "00_first.ipynb").read_text())["metadata"]["papermill"]
        assert not any(os.path.isabs(meta[k]) for k in ("input_path", "output_path")), meta
    finally:
        victim.kill()
        victim.wait()


def test_reproducing_a_copy_of_a_folder_in_use_leaves_the_original_running(tmp_path, outputs, capsys, monkeypatch):
    nbs = series(tmp_path, **{"00_hold": HOLD})
    first = start_cli(nbs, "cA")
    try:
        wait_for(lambda: (outputs / "cA" / "pids.json").exists(), "the first run's notebook")
        wait_for(lambda: (outputs / "cA" / runs.PIDS_FILE).exists(), "its process list")
        kernel = json.loads((outputs / "cA" / "pids.json").read_text())[0]
        shutil.copytree(outputs / "cA", outputs / "cB")            # .notebook.pids and .lock come along
        # what reproducing the copy does before its notebook is the subject: its notebook runs in process
        # (cA's CLI, forked before this, runs its own for real)
        ran = ran_in_process(monkeypatch)
        assert cli.main(args(nbs, "cB")) == 0 and ran == ["00_hold"]
        assert not gone(kernel), "reproducing the copy killed the original run's kernel"
        (outputs / "cA" / "release").touch()
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()


def test_a_leftover_of_a_killed_run_anywhere_stops_another_run_from_measuring(tmp_path, outputs, capsys, monkeypatch):
    nbs = series(tmp_path, **{"00_hold": HOLD})
    other = tmp_path / "other"
    other.mkdir()
    make_nb(other / "00_first.ipynb", WRITE.format(name="00"))
    proc = start_cli(nbs, "kA")
    try:
        wait_for(lambda: (outputs / "kA" / "pids.json").exists(), "kA's notebook")
        tree = json.loads((outputs / "kA" / "pids.json").read_text())
        proc.kill()                                                # SIGKILL: kA's kernel lives on
        proc.communicate(timeout=10)
        assert not any(gone(p) for p in tree)
        assert cli.main(args(other, "kB")) == 2
        err = capsys.readouterr().err
        assert f"{tree[0]}" in err and str(outputs / "kA") in err and "kill -9" in err
        assert not (outputs / "kB" / "00.txt").exists()
        # which runs measure is the subject: from here on the notebooks run in process
        ran = ran_in_process(monkeypatch)
        assert cli.main(args(nbs, "kA")) == 0                     # the way out it names: kA ends its leftover
        assert "ended processes" in capsys.readouterr().err and all(gone(p) for p in tree)
        assert cli.main(args(other, "kB")) == 0 and ran == ["00_hold", "00_first"]
    finally:
        for p in tree if "tree" in locals() else []:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


# --- paths: resolved before any check, nothing made outside outputs/ -----------------------------------

def test_run_folders_are_resolved_before_they_are_checked_or_made(tmp_path, outputs, monkeypatch, capsys):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    ref = outputs / "reference" / "h100"
    ref.mkdir(parents=True)
    (ref / "results.jsonl").write_text(json.dumps({"metric": "m", "value": 1}) + "\n")
    (outputs / "alias").symlink_to(ref)                           # a link into a committed reference
    assert cli.main(args(nbs, "alias")) == 2
    assert "--overwrite-reference" in capsys.readouterr().err and not (ref / "00.txt").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (outputs / "out").symlink_to(elsewhere)                       # a run folder that leads out of outputs/
    assert cli.main(args(nbs, "out")) == 2
    assert "outside" in capsys.readouterr().err and list(elsewhere.iterdir()) == []   # not even .lock
    (outputs / "afile").write_text("x")
    assert cli.main(args(nbs, "afile")) == 2
    assert "is a file" in capsys.readouterr().err
    assert cli.main(args(nbs, "n" * 300)) == 2
    assert "at most 255" in capsys.readouterr().err
    monkeypatch.setenv("HWLIB_OUTPUTS", str(outputs / "afile"))
    assert cli.main(args(nbs)) == 2
    assert "HWLIB_OUTPUTS" in capsys.readouterr().err
    assert sorted(p.name for p in outputs.iterdir()) == ["afile", "alias", "out", "reference"]


def test_readme_through_a_link_keeps_the_link(tmp_path, outputs, monkeypatch):
    from hwlib.report import tables
    from hwlib.report.tables import README_END, README_START
    from test_integrity_cli import ladder_record
    # the link is the subject: the block's several-GPU table (read from every committed reference run, about
    # 0.9 CPU-s) is test_integrity_cli's readme test's
    monkeypatch.setattr(tables, "multi_gpu_lines", lambda runs: ["| several-GPU table |"])
    run = outputs / "r"
    run.mkdir(parents=True)
    (run / "results.jsonl").write_text(json.dumps(ladder_record(12.5)) + "\n")
    real = tmp_path / "real.md"
    real.write_text(f"# lab\n{README_START}\nSTALE\n{README_END}\n")
    link = tmp_path / "README.md"
    link.symlink_to(real)
    assert cli.main(["readme", "--run", "r", "--readme", str(link)]) == 0
    assert link.is_symlink() and "STALE" not in real.read_text() and "| several-GPU table |" in real.read_text()


# --- faults: one notebook's fault is its own row --------------------------------------------------------

def test_one_notebooks_fault_is_its_failed_row_and_the_series_goes_on(tmp_path, outputs, monkeypatch, capsys):
    rm = 'import os, shutil\nshutil.rmtree(os.path.join(os.environ["HWLIB_RUN"], "executed"))'
    nbs = series(tmp_path, **{"00_rm": rm, "01_full": WRITE.format(name="01"), "02_unrecorded": WRITE.format(name="02"),
                              "03_after": WRITE.format(name="03")})
    run_one, update = cli._run_one, runs.update_state

    def disk_full(nb, *a, **k):
        if nb.stem == "01_full":
            raise OSError(errno.ENOSPC, "No space left on device", str(outputs / "r" / "executed" / "01_full.log"))
        if nb.stem == "03_after":   # that it runs is the subject: in process (02 runs for real after 00's rmtree)
            ran.append(nb.stem)
            return "ok", ""
        return run_one(nb, *a, **k)

    def state_unwritable(folder, **entries):
        if "02_unrecorded" in entries:
            raise OSError(errno.EROFS, "Read-only file system")
        return update(folder, **entries)
    ran = []
    monkeypatch.setattr(cli, "_run_one", disk_full)
    monkeypatch.setattr(runs, "update_state", state_unwritable)
    assert cli.main(args(nbs)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "cannot record 02_unrecorded" in err and "01_full" in err
    state = query.state(outputs / "r")
    assert state["00_rm"]["status"] in ("ok", "failed")           # its own copy went with the folder it removed
    assert state["01_full"]["status"] == "failed" and "No space left" in state["01_full"]["reason"]
    assert "02_unrecorded" not in state and (outputs / "r" / "02.txt").exists()
    assert state["03_after"]["status"] == "ok" and ran == ["03_after"]


# --- parameters: what the notebook gets is what state.json records ------------------------------------

SHOW = ('import json, os\nopen(os.path.join(os.environ["HWLIB_RUN"], "got.json"), "a").write('
        'json.dumps([[type(v).__name__, v] for v in (tol, plan, n)]) + "\\n")')


def test_set_values_reach_the_notebook_as_state_json_records_them(tmp_path, outputs, capsys):
    d = tmp_path / "nbs"
    d.mkdir()
    make_nb(d / "00_show.ipynb", SHOW, params="\ntol = 0.5\nplan = []\nn = 1")
    run = outputs / "r"
    sets = ["--set", "00.tol=1e-08", "--set", '00.plan=[a, 2.5, "010", 1.0e+3, null]', "--set", "00.n=12"]
    assert cli.main(args(d, "r", *sets)) == 0
    got = json.loads((run / "got.json").read_text().splitlines()[-1])
    recorded = query.state(run)["00_show"]["parameters"]
    assert got == [["float", 1e-08], ["list", ["a", 2.5, "010", 1000.0, None]], ["int", 12]]
    assert [recorded[k] for k in ("tol", "plan", "n")] == [v for _, v in got]
    # --set on a notebook already done with other values runs it again; the same values again do not
    assert cli.main(args(d, "r", "--set", "00.tol=2e-3")) == 0
    assert json.loads((run / "got.json").read_text().splitlines()[-1])[0] == ["float", 0.002]
    assert cli.main(args(d, "r", "--set", "00.tol=2e-3")) == 0
    assert len((run / "got.json").read_text().splitlines()) == 2 and "done earlier" in capsys.readouterr().out


@pytest.mark.parametrize("value,says", [("010", "ambiguous"), ("12:30:00", "ambiguous"), ("yes", "ambiguous"),
                                        ("2024-01-01", "ambiguous"), (".nan", "not a finite number"),
                                        ("-.inf", "not a finite number"), ("1e400", "not a finite number"),
                                        ("x" * 80_000, "a parameter is a setting"), ("{1: 2}", "not a string")])
def test_set_values_that_would_arrive_otherwise_are_refused(value, says, tmp_path, outputs, capsys):
    d = tmp_path / "nbs"
    d.mkdir()
    make_nb(d / "00_show.ipynb", SHOW, params="\ntol = 0.5\nplan = []\nn = 1")
    assert cli.main(args(d, "r", "--set", f"00.tol={value}")) == 2
    err = capsys.readouterr().err
    assert says in err and "--set" in err and "Traceback" not in err
    assert not (outputs / "r").exists()


@pytest.mark.parametrize("device,env,says", [("cpu:7", None, "--device"), ("auto:1", None, "device"),
                                             ("cpu", "lots", "HWLIB_MEMORY_CAP_GIB"),
                                             ("auto", "-2", "HWLIB_MEMORY_CAP_GIB"),
                                             ("cpu", "inf", "HWLIB_MEMORY_CAP_GIB")])
def test_devices_and_the_memory_cap_are_checked_on_every_device(device, env, says, tmp_path, outputs,
                                                                monkeypatch, capsys):
    nbs = series(tmp_path, **{"00_first": WRITE.format(name="00")})
    if env is not None:
        monkeypatch.setenv("HWLIB_MEMORY_CAP_GIB", env)
    argv = args(nbs)
    argv[argv.index("--device") + 1] = device
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says.lstrip("-") in err and "Traceback" not in err and not (outputs / "r" / "00.txt").exists()


def test_leftovers_under_another_outputs_folder_are_said_not_refused(tmp_path, outputs, monkeypatch, capsys):
    """A leftover of a run under this outputs folder stops the measurement; one under another (another
    checkout, a test's scratch folder: perhaps another person's) is said once on stderr."""
    found = {str(tmp_path / "elsewhere" / "r"): [101], str(outputs / "x"): [202]}
    monkeypatch.setattr(runs, "orphans", lambda exclude=None: found)
    why = cli._orphans_note(outputs / "r")
    assert "202" in why and str(outputs / "x") in why and "101" not in why
    del found[str(outputs / "x")]
    assert cli._orphans_note(outputs / "r") is None
    err = capsys.readouterr().err
    assert err.count("101") == 1 and "another outputs folder" in err   # said once, not before every notebook
