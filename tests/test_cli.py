"""The reproduction runner on tiny notebooks: failures, time limits, resume, --only, --force."""

import json
import os
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


# where the kernel was told to put its compile caches
CACHE = ('\nopen(os.path.join(os.environ["HWLIB_RUN"], "cache.txt"), "w").write('
         'os.environ["TORCHINDUCTOR_CACHE_DIR"] + "\\n" + os.environ["TRITON_CACHE_DIR"])')


@pytest.fixture
def series(tmp_path):
    d = tmp_path / "nbs"
    d.mkdir()
    make_nb(d / "00_first.ipynb", WRITE.format(name="00") + CACHE)
    make_nb(d / "01_broken.ipynb", "raise RuntimeError('boom in 01')")
    make_nb(d / "02_after.ipynb", WRITE.format(name="02"))
    make_nb(d / "99_tables.ipynb", WRITE.format(name="99"))
    return d


# A cap, far above a kernel's start on a busy 2-core machine (make test runs four suites side by side:
# these notebooks took 13-17 s there). A notebook past its time limit is test_stack_dumps.py's: the
# series goes on past it there.
TIMEOUT_S = 300


def reproduce(series, run, *extra):
    return cli.main(["reproduce", "--notebooks", str(series), "--run", str(run), "--profile", "smoke",
                     "--device", "cpu", "--timeout", str(TIMEOUT_S), "--quiet", *extra])


def ran_in_process(monkeypatch) -> list[str]:
    """The notebooks ``reproduce`` runs from now on, by name, in order: each comes out "ok" without a
    kernel (``cli._run_one`` replaced), for tests of which notebooks run, not of what a run does."""
    ran: list[str] = []

    def run_one(nb, *a, **k):
        ran.append(nb.stem)
        return "ok", ""
    monkeypatch.setattr(cli, "_run_one", run_one)
    return ran


def test_goes_on_past_failures_reports_them_and_resumes(series, outputs, capsys, monkeypatch):
    """One series (its kernels are most of this file's CPU) for: a failure recorded and passed over,
    resume, --force and --only, the run's one compile cache, and its one profile."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)    # as a person's shell has them: unset
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    run = outputs / "run1"
    assert reproduce(series, "run1") == 1
    err = capsys.readouterr().err
    assert "1 notebook(s) failed: 01_broken" in err
    state = json.loads((run / "state.json").read_text())
    assert [state[k]["status"] for k in ("00_first", "01_broken", "02_after", "99_tables")] == \
        ["ok", "failed", "ok", "ok"]
    assert "boom in 01" in state["01_broken"]["reason"]
    assert (run / "02.txt").read_text() == "smoke\n"            # ran after the failure, with the profile
    assert (run / "99.txt").read_text() == "smoke\n"
    assert (run / "executed" / "00_first.ipynb").exists() and (run / "summary.json").exists()
    # Resume: done notebooks are skipped, the failed ones and the tables notebook run again. Which ones
    # run is reproduce's own choice, made in this process: each run of one is the same as above.
    ran = ran_in_process(monkeypatch)
    assert reproduce(series, "run1") == 0
    assert ran == ["01_broken", "99_tables"]
    assert "done earlier" in capsys.readouterr().out
    state = json.loads((run / "state.json").read_text())
    assert {state[k]["status"] for k in ("00_first", "01_broken", "02_after", "99_tables")} == {"ok"}
    # --force reruns what was done; --only restricts to the named notebooks.
    ran.clear()
    assert reproduce(series, "run1", "--only", "00", "--force") == 0
    assert ran == ["00_first"]
    # A run compiles into one cache in its folder, per version of the code.
    code = results.code_digest()
    assert code and (run / "cache.txt").read_text().split("\n") == [str(run / ".cache" / code / "inductor"),
                                                                      str(run / ".cache" / code / "triton")]
    # The profile of a run cannot change silently: --force reruns notebooks; it never mixes profiles.
    for extra in ([], ["--force"]):
        assert cli.main(["reproduce", "--notebooks", str(series), "--run", "run1", "--profile", "full",
                         "--device", "cpu", "--only", "00", *extra]) == 2
        err = capsys.readouterr().err
        assert "made with profile 'smoke'" in err and "name a new run" in err and "--force" not in err


def test_bad_arguments_are_clear_errors(series, tmp_path, capsys):
    assert reproduce(series, "r", "--only", "05") == 2
    assert "unknown notebook '05'" in capsys.readouterr().err
    assert cli.main(["reproduce", "--notebooks", str(series), "--profile", "huge"]) == 2
    assert "unknown profile 'huge'" in capsys.readouterr().err
    assert cli.main(["reproduce", "--notebooks", str(series), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    assert cli.main(["reproduce", "--notebooks", str(tmp_path), "--run", "r"]) == 2
    assert "no numbered notebooks" in capsys.readouterr().err


def test_env_and_table_commands(tmp_path, capsys):
    assert cli.main(["env", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device      cpu") and "precision" in out
    assert cli.main(["table", "--run", "empty"]) == 2
    assert "no results.jsonl records" in capsys.readouterr().err
    assert not (tmp_path / "outputs" / "empty").exists()        # reading a run never creates it


def test_importing_the_cli_leaves_torch_out():
    """``hwlib.cli`` imports torch only in the commands that need it (seconds of CPU in each process)."""
    out = subprocess.run([sys.executable, "-c", "import sys, hwlib.cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "hwlib.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "reproduce" in out.stdout


def test_notebooks_papermill_reads_notebooks_without_building_the_iri_grammar(tmp_path):
    """Each notebook's papermill process (``cli.PAPERMILL``) starts without rfc3987_syntax, whose import
    builds a parser for seconds of CPU, and still reads, validates and refuses notebooks as nbformat does."""
    make_nb(tmp_path / "00_ok.ipynb", "pass")
    bad = json.loads((tmp_path / "00_ok.ipynb").read_text())
    bad["cells"][0]["cell_type"] = "spreadsheet"
    (tmp_path / "01_bad.ipynb").write_text(json.dumps(bad))
    # one process (papermill's imports are its CPU seconds): the probe, then cli.PAPERMILL itself with --help
    probe = (cli.PAPERMILL_PRELUDE + "; import json, os, nbformat, papermill\n"
             "def valid(p):\n    try:\n        nbformat.validate(nbformat.read(p, as_version=4))\n        return True\n"
             "    except nbformat.ValidationError:\n        return False\n"
             "print(json.dumps([valid(p) for p in json.loads(os.environ['PROBE_NOTEBOOKS'])]\n"
             "                 + [sys.modules.get(m) is not None for m in ('rfc3987_syntax', 'lark')]), flush=True)\n"
             + cli.PAPERMILL)
    r = subprocess.run([sys.executable, "-c", probe, "--help"], capture_output=True, text=True,
                       env=dict(os.environ, PROBE_NOTEBOOKS=json.dumps([str(tmp_path / "00_ok.ipynb"),
                                                                         str(tmp_path / "01_bad.ipynb")])))
    first, _, rest = r.stdout.partition("\n")
    assert r.returncode == 0 and json.loads(first) == [True, False, False, False], r.stdout + r.stderr[-2000:]
    assert rest.startswith("Usage: papermill"), r.stdout + r.stderr[-2000:]


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


def test_set_option_passes_a_parameter_and_records_it(tmp_path, outputs, capsys, monkeypatch):
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
    # without it: the notebook's own default. That a run without parameters after one with them reaches
    # the notebook's defaults (its parameters file of before left behind) is the workloads test's real run;
    # here, in process, that nothing is passed and nothing recorded
    given = []
    monkeypatch.setattr(cli, "_run_one", lambda nb, *a: given.append((nb.stem, *a[-2:])) or ("ok", ""))
    assert reproduce(d, "run", "--force") == 0
    assert given == [("00_budget", None, None)]
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


# --- the first look: its summary on fabricated runs (no notebook is run) -------------------------------------

def first_look_run(folder, kind="cuda", profile="full", name="Test GPU", ms=(40.0, 32.0), outputs_written=True):
    """A run folder as the first look leaves it: GPT-2's rows at 09 and 25 (ms_per_step, tokens_per_s), the
    gpt figure and tables."""
    for step, t in zip(("09_cuda_graphs", "25_bias_column"), ms):
        common = dict(notebook=step, workload="gpt", step=step, profile=profile, device={"name": name, "kind": kind})
        results.append([results.make_record(metric="ms_per_step", value=t, p20=t, p80=t, unit="ms", **common),
                        results.make_record(metric="tokens_per_s", value=16384 / t * 1e3, unit="tokens/s", **common)],
                       folder)
    if outputs_written:
        for f in ("figures/gpt_ladder.png", "tables/gpt_ladder.md", "tables/claims.md"):
            (folder / f).parent.mkdir(parents=True, exist_ok=True)
            (folder / f).write_text("x")
    return folder


def test_first_look_summary_says_the_headline_where_its_outputs_are_and_the_ratio_to_its_reference(outputs):
    from hwlib.report import first_look
    run = first_look_run(outputs / "first-look")
    ref = first_look_run(outputs / "reference" / "gpu-first-look", ms=(44.0, 30.0), outputs_written=False)
    other = first_look_run(outputs / "reference" / "gpu-mid", profile="mid", ms=(80.0, 70.0), outputs_written=False)
    text = first_look.summary_text(run, references=[other, ref])
    assert "First look: Test GPU, full profile" in text and "Not meaningful" not in text
    assert "gpt at 09_cuda_graphs (the standard recipe): 40.0 ms/step, 409,600 tokens/s" in text
    assert "gpt at 25_bias_column (past the recipe): 32.0 ms/step, 512,000 tokens/s" in text
    assert "25_bias_column over 09_cuda_graphs: 1.25x the tokens/s" in text
    assert "figures/gpt_ladder.png" in text and "tables/gpt_ladder.md" in text and "tables/claims.md" in text
    assert "gpu-first-look (Test GPU, full): 09_cuda_graphs 1.10x, 25_bias_column 0.94x its tokens/s" in text
    # another GPU, or the same GPU in another profile: no reference, and it says for what
    assert "no reference for Test GPU/full" in first_look.summary_text(run, references=[other])


def test_first_look_summary_on_a_cpu_says_its_numbers_mean_nothing(outputs):
    from hwlib.report import first_look
    run = first_look_run(outputs / "cpu", kind="cpu", profile="smoke", name="cpu", outputs_written=False)
    text = first_look.summary_text(run, references=[])
    assert "Not meaningful as performance: measured on a CPU" in text and "smoke profile" in text
    assert "no reference for cpu/smoke" in text and "figure: none drawn" in text
    # a step that did not run says so instead of a number
    results.append([results.make_record(metric="ms_per_step", value=None, unit="ms", status="failed", reason="boom",
                                        notebook="25", workload="gpt", step="25_bias_column", profile="smoke",
                                        device={"name": "cpu", "kind": "cpu"})], run)
    text = first_look.summary_text(run, references=[])
    assert "gpt at 25_bias_column (past the recipe): failed: boom" in text and "over 09_cuda_graphs" not in text


def test_first_look_command_runs_the_first_looks_notebooks_then_prints_its_summary(outputs, monkeypatch, capsys):
    """The command hands reproduce the first look's notebooks, parameters and GPT-2 alone, into outputs/first-look
    unless --run names another run; then prints the summary."""
    seen = {}

    def fake_reproduce(args):
        seen.update(vars(args))
        first_look_run(cli.run_dir(args.run))
        return 0
    monkeypatch.setattr(cli, "reproduce", fake_reproduce)
    assert cli.main(["first-look", "--profile", "smoke", "--device", "cpu", "--quiet"]) == 0
    assert (seen["run"], seen["only"], seen["workloads"]) == ("first-look", "00,09,25,16,99", "gpt")
    assert seen["set"] == ["16.steps=[09_cuda_graphs, 25_bias_column]"] and seen["profile"] == "smoke"
    out = capsys.readouterr().out
    assert "First look: Test GPU" in out and "1.25x the tokens/s" in out
    assert cli.main(["first-look", "--run", "mine"]) == 0 and seen["run"] == "mine"
    with pytest.raises(SystemExit):
        cli.main(["first-look", "--only", "00"])   # the first look's notebooks are its own


def test_workloads_reach_only_the_notebooks_that_take_them(tmp_path):
    make_nb(tmp_path / "09_takes.ipynb", "pass", params='\nworkloads = ["gpt"]')
    make_nb(tmp_path / "16_does_not.ipynb", "pass", params='\nworkload = "gpt"')
    assert cli._takes_workloads(tmp_path / "09_takes.ipynb") is True
    assert cli._takes_workloads(tmp_path / "16_does_not.ipynb") is False


def test_a_kernel_that_found_its_port_taken_is_started_once_more(series, outputs, monkeypatch, capsys):
    """jupyter_client picks a free port and the kernel binds it later: another process can take it in
    between. No cell ran, so the notebook is started once more; any other failure stands."""
    calls = []

    def fake(nb, run, *a, **k):
        calls.append(nb.stem)
        log = run / "executed" / f"{nb.stem}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        first = calls.count(nb.stem) == 1
        if nb.stem == "00_first" and first:
            log.write_text("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5')\n"
                           "RuntimeError: Kernel died before replying to kernel_info\n")
            return "failed", "Kernel died before replying to kernel_info"
        if nb.stem == "01_broken":
            log.write_text("RuntimeError: boom in 01\n")
            return "failed", "boom in 01"
        log.write_text("")
        return "ok", ""
    monkeypatch.setattr(cli, "_run_one", fake)
    assert reproduce(series, "ports") == 1
    assert calls.count("00_first") == 2 and calls.count("01_broken") == 1
    state = json.loads((outputs / "ports" / "state.json").read_text())
    assert state["00_first"]["status"] == "ok" and state["01_broken"]["status"] == "failed"
    assert "port taken" in capsys.readouterr().out
    assert not cli.kernel_port_taken(outputs / "ports" / "nowhere.log")
