"""The reproduction runner on tiny notebooks: failures, time limits, resume, --only, --force."""

import json
import subprocess
import sys

import nbformat as nbf
import pytest

from hwlib import cli, results


def make_nb(path, body, params=""):
    """A notebook of a parameters cell (profile, device, then ``params``) and ``body``."""
    nb = nbf.v4.new_notebook()
    p = nbf.v4.new_code_cell('profile = "auto"\ndevice = "auto"' + params)
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbf.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, path)


WRITE = ('import os, json\nopen(os.path.join(os.environ["HWLIB_RUN"], "{name}.txt"), "a").write(profile + "\\n")')


@pytest.fixture(autouse=True)
def outputs(tmp_path, monkeypatch):
    """Runs are named under a temporary outputs/ (run names never leave it)."""
    monkeypatch.setenv("HWLIB_OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.delenv("HWLIB_RUN", raising=False)
    return tmp_path / "outputs"


@pytest.fixture
def series(tmp_path):
    d = tmp_path / "nbs"
    d.mkdir()
    make_nb(d / "00_first.ipynb", WRITE.format(name="00"))
    make_nb(d / "01_broken.ipynb", "raise RuntimeError('boom in 01')")
    make_nb(d / "02_after.ipynb", WRITE.format(name="02"))
    make_nb(d / "03_slow.ipynb", "import time\ntime.sleep(120)")
    make_nb(d / "99_tables.ipynb", WRITE.format(name="99"))
    return d


# Long enough for a kernel's start on a busy 2-core machine (make test runs four suites side by side:
# these notebooks took 13-17 s there), short of 03_slow's sleep.
TIMEOUT_S = 40


def reproduce(series, run, *extra):
    return cli.main(["reproduce", "--notebooks", str(series), "--run", str(run), "--profile", "smoke",
                     "--device", "cpu", "--timeout", str(TIMEOUT_S), "--quiet", *extra])


def test_goes_on_past_failures_reports_them_and_resumes(series, outputs, capsys):
    run = outputs / "run1"
    assert reproduce(series, "run1") == 1
    err = capsys.readouterr().err
    assert "2 notebook(s) failed: 01_broken, 03_slow" in err
    state = json.loads((run / "state.json").read_text())
    assert [state[k]["status"] for k in ("00_first", "01_broken", "02_after", "03_slow", "99_tables")] == \
        ["ok", "failed", "ok", "timeout", "ok"]
    assert "boom in 01" in state["01_broken"]["reason"]
    assert (run / "02.txt").read_text() == "smoke\n"            # ran after the failure, with the profile
    assert (run / "executed" / "00_first.ipynb").exists() and (run / "summary.json").exists()
    # Resume: done notebooks are skipped, the failed ones and the tables notebook run again.
    (series / "03_slow.ipynb").unlink()
    make_nb(series / "01_broken.ipynb", WRITE.format(name="01"))
    assert reproduce(series, "run1") == 0
    assert (run / "00.txt").read_text() == "smoke\n" and (run / "99.txt").read_text() == "smoke\nsmoke\n"
    assert "done earlier" in capsys.readouterr().out
    # --force reruns what was done; --only restricts to the named notebooks.
    assert reproduce(series, "run1", "--only", "00", "--force") == 0
    assert (run / "00.txt").read_text() == "smoke\nsmoke\n" and (run / "02.txt").read_text() == "smoke\n"


def test_a_run_compiles_into_one_cache_in_its_folder(tmp_path, outputs, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    d = tmp_path / "cache_nbs"
    d.mkdir()
    make_nb(d / "00_cache.ipynb", 'import os\nopen(os.path.join(os.environ["HWLIB_RUN"], "cache.txt"), "w").write('
                                  'os.environ["TORCHINDUCTOR_CACHE_DIR"] + "\\n" + os.environ["TRITON_CACHE_DIR"])')
    assert reproduce(d, "cached") == 0
    run = outputs / "cached"
    code = results.code_digest()
    assert code and (run / "cache.txt").read_text().split("\n") == [str(run / ".cache" / code / "inductor"),
                                                                      str(run / ".cache" / code / "triton")]


def test_bad_arguments_are_clear_errors(series, tmp_path, capsys):
    assert reproduce(series, "r", "--only", "05") == 2
    assert "unknown notebook '05'" in capsys.readouterr().err
    assert cli.main(["reproduce", "--notebooks", str(series), "--profile", "huge"]) == 2
    assert "unknown profile 'huge'" in capsys.readouterr().err
    assert cli.main(["reproduce", "--notebooks", str(series), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    assert cli.main(["reproduce", "--notebooks", str(tmp_path), "--run", "r"]) == 2
    assert "no numbered notebooks" in capsys.readouterr().err


def test_profile_of_a_run_cannot_change_silently(series, capsys):
    assert reproduce(series, "r2", "--only", "00") == 0
    for extra in ([], ["--force"]):                    # --force reruns notebooks; it never mixes profiles
        assert cli.main(["reproduce", "--notebooks", str(series), "--run", "r2", "--profile", "full",
                         "--device", "cpu", "--only", "00", *extra]) == 2
        err = capsys.readouterr().err
        assert "made with profile 'smoke'" in err and "name a new run" in err and "--force" not in err


def test_env_and_table_commands(tmp_path, capsys):
    assert cli.main(["env", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device      cpu") and "precision" in out
    assert cli.main(["table", "--run", "empty"]) == 2
    assert "no results.jsonl records" in capsys.readouterr().err
    assert not (tmp_path / "outputs" / "empty").exists()        # reading a run never creates it


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "hwlib.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "reproduce" in out.stdout


def test_workloads_option_reaches_the_notebooks_parameter(tmp_path, outputs, capsys):
    d = tmp_path / "nbs"
    d.mkdir()
    make_nb(d / "00_list.ipynb", 'import os\n'
            'open(os.path.join(os.environ["HWLIB_RUN"], "w.txt"), "w").write(",".join(workloads))',
            params='\nworkloads = ["gpt"]')        # the notebook's own default, in its parameters cell
    run = outputs / "run"
    assert reproduce(d, "run", "--workloads", "vit_bdh, encoder_nli") == 0
    assert (run / "w.txt").read_text() == "vit_bdh,encoder_nli"
    # recorded: the time table then says that this notebook's seconds are not those of its own list
    state = lambda: json.loads((run / "state.json").read_text())["00_list"]     # noqa: E731
    assert state()["parameters"] == {"workloads": ["vit_bdh", "encoder_nli"]}
    assert reproduce(d, "run", "--force") == 0                      # without the option: the notebook's own list
    assert (run / "w.txt").read_text() == "gpt"
    assert "parameters" not in state()
    assert reproduce(d, "run", "--force", "--workloads", "vit") == 2
    assert "unknown workload 'vit'" in capsys.readouterr().err
    assert reproduce(d, "run", "--force", "--workloads", " , ") == 2
    assert "names no workload" in capsys.readouterr().err


def test_set_option_passes_a_parameter_and_records_it(tmp_path, outputs, capsys):
    d = tmp_path / "nbs"
    d.mkdir()
    make_nb(d / "00_budget.ipynb", 'import os\n'
            'open(os.path.join(os.environ["HWLIB_RUN"], "b.txt"), "w").write(repr(budget_s) + " " + repr(plan))',
            params='\nbudget_s = 600.0\nplan = None')
    run = outputs / "run"
    assert reproduce(d, "run", "--set", "00.budget_s=120", "--set", "00_budget.plan=[a, b]") == 0
    assert (run / "b.txt").read_text() == "120 ['a', 'b']"
    assert json.loads((run / "state.json").read_text())["00_budget"]["parameters"] == {"budget_s": 120,
                                                                                        "plan": ["a", "b"]}
    assert reproduce(d, "run", "--force") == 0                       # without it: the notebook's own default
    assert (run / "b.txt").read_text() == "600.0 None"
    assert "parameters" not in json.loads((run / "state.json").read_text())["00_budget"]
    for bad, says in (("00.nope=1", "has no parameter 'nope'; its parameters: budget_s, device, plan, profile"),
                      ("07.budget_s=1", "notebook '07' is not among those"),
                      ("budget_s=1", "give NOTEBOOK.PARAMETER=VALUE"),
                      ("00.budget_s=[1", "the value is not YAML"),
                      ("00.profile=full", "reproduce sets 'profile' itself; use --profile")):
        assert reproduce(d, "run", "--set", bad) == 2
        assert says in capsys.readouterr().err, bad


def test_run_order_puts_ladder_studies_after_the_ladder_and_tables_last(tmp_path):
    d = tmp_path / "nbs"
    d.mkdir()
    for name in ("00_env", "05_study", "07_step", "98_live", "99_tables"):
        make_nb(d / f"{name}.ipynb", WRITE.format(name=name[:2]))
    for name, after in (("05_study", "ladder"), ("98_live", "ladder"), ("99_tables", "all")):
        nb = nbf.read(d / f"{name}.ipynb", as_version=4)
        nb.metadata["hwlib"] = {"run_after": after}
        nbf.write(nb, d / f"{name}.ipynb")
    assert [p.stem[:2] for p in cli.list_notebooks(d)] == ["00", "07", "05", "98", "99"]
    # --only keeps the run order, whatever order it names them in
    assert [p.stem[:2] for p in cli.select(cli.list_notebooks(d), "99,05,07")] == ["07", "05", "99"]
    nb = nbf.read(d / "07_step.ipynb", as_version=4)
    nb.metadata["hwlib"] = {"run_after": "later"}
    nbf.write(nb, d / "07_step.ipynb")
    with pytest.raises(cli.CliError, match=r"07_step.ipynb: metadata hwlib.run_after must be one of 'ladder', 'all'"):
        cli.list_notebooks(d)


def test_the_series_runs_every_ladder_step_before_the_studies_that_time_them():
    from hwlib.steps import STEP_NAMES
    order = [p.stem for p in cli.list_notebooks(cli.NOTEBOOKS_DIR)]
    steps = [i for i, s in enumerate(order) if s in STEP_NAMES]
    for study in ("16_where_time_goes", "19_ablations", "20_inductor", "98_dashboard"):
        assert order.index(study) > max(steps), (study, order)
    assert order[-1].startswith("99_")
