"""Colab as a new user meets it, and a release's pins: the notebooks' setup cell installs hwlib from
its repository at one ref with its dependencies (never another torch); an installed copy, run outside
the clone, imports itself, finds its kernel sources and records where its code came from; the
constraints file and the README's memory table are generated from the reference runs' records.

The install test does what the Colab cell does, offline: pip installs ``hwlib @ git+<repo>@<tag>``
from a throwaway git repository made of this tree's package files, without dependencies (the test's
environment has them) and without build isolation (no index)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hwlib import cli, query, release, results, source

ROOT = Path(__file__).resolve().parent.parent
TAG = "v0.0.0-colab-test"


def _pip(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def _git(*args, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd)}
    r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# --- the setup cell -------------------------------------------------------------------------------

def _pip_args(cell: str) -> list:
    """The argument list the setup cell hands ``subprocess.run`` (the cell is plain Python: no magics)."""
    calls = [n for n in ast.walk(ast.parse(cell)) if isinstance(n, ast.Call) and ast.unparse(n.func) == "subprocess.run"]
    (call,) = calls
    return [ast.unparse(e) if not isinstance(e, ast.Constant) else e.value for e in call.args[0].elts]


def test_the_setup_cell_installs_the_ref_with_dependencies_and_keeps_colabs_torch(tmp_path):
    cell = release.setup_cell("v1.2.3")
    assert len(cell.splitlines()) <= 5 and cell.splitlines()[-1] == "import hwlib; from hwlib import notebook as nb"
    args = _pip_args(cell)
    assert args[:4] == ["sys.executable", "-m", "pip", "install"] and "--no-deps" not in args   # dependencies come along
    assert args[-1] == f"hwlib @ git+{source.REPOSITORY}@v1.2.3"
    assert args[args.index("-c") + 1] == release.COLAB_CONSTRAINTS
    # The line before it writes the constraints that keep torch and the kernel's packages as they are:
    # run it here, where the environment has them too.
    (write,) = [l for l in cell.splitlines() if ".write_text(" in l]
    target = tmp_path / "c.txt"
    exec(write.replace(release.COLAB_CONSTRAINTS, str(target)).replace('"google.colab" in sys.modules', "True"),
         {"sys": sys, "pathlib": __import__("pathlib"), "md": importlib.metadata})
    pins = {k.lower().replace("_", "-"): v for k, v in (l.split("==") for l in target.read_text().splitlines())}
    assert pins["torch"] == importlib.metadata.version("torch")
    assert pins["ipykernel"] == importlib.metadata.version("ipykernel")
    assert set(pins) <= set(release.COLAB_KEEP) and "hwlib" not in pins


@pytest.mark.parametrize("ref", ["main", "v0.2.0", "release/2026-11", "0123456789abcdef0123456789abcdef01234567"])
def test_a_ref_is_checked_before_anything_is_written(ref):
    assert release.check_ref(ref) == ref
    for bad in ("", "v1 && rm -rf ~", "../x", "a..b", 'v1"', "-v", "x.lock", "x/"):
        with pytest.raises(release.ReleaseError, match="--ref"):
            release.check_ref(bad)


def test_the_notebooks_install_the_ref_that_source_names():
    assert release.check_ref(source.NOTEBOOK_REF) == source.NOTEBOOK_REF
    assert source.REPOSITORY.startswith("https://github.com/")


# --- the tool that pins them ----------------------------------------------------------------------

@pytest.fixture
def scratch(tmp_path):
    """Copies of two notebooks (one with the Triton variant) and of hwlib/source.py."""
    for n in ("00_environment.ipynb", "12_bk_core.ipynb"):
        shutil.copy(ROOT / "notebooks" / n, tmp_path / n)
    shutil.copy(ROOT / "hwlib" / "source.py", tmp_path / "source.py")
    return tmp_path


def test_pin_notebooks_writes_the_cell_the_metadata_and_the_source(scratch):
    nb00, nb12, src = scratch / "00_environment.ipynb", scratch / "12_bk_core.ipynb", scratch / "source.py"
    # 00 as it was before: the old cell, no GPU metadata
    nb = json.loads(nb00.read_text())
    nb["cells"][1]["source"] = ["import sys\n", "if \"google.colab\" in sys.modules:\n",
                                "    %pip install -q --no-deps \"hwlib @ git+https://github.com/hwlib/hwlib\"\n",
                                "import hwlib\n"]
    nb["metadata"] = {"kernelspec": nb["metadata"]["kernelspec"]}
    nb00.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    assert release.problems(json.loads(nb00.read_text()), nb00.name)

    changed = release.pin_notebooks("v0.2.0", [nb00, nb12], source_file=src)
    assert set(changed) == {nb00, nb12, src}
    for p in (nb00, nb12):
        got = json.loads(p.read_text())
        assert "".join(got["cells"][1]["source"]) == release.setup_cell("v0.2.0")
        assert got["metadata"]["accelerator"] == "GPU" and got["metadata"]["colab"]["gpuType"] == "T4"
        assert got["metadata"]["kernelspec"]["name"] == "python3"          # the rest is kept
        assert release.problems(got, p.name, "v0.2.0") == []
        assert release.problems(got, p.name, "main") != []
    assert 'NOTEBOOK_REF = "v0.2.0"' in src.read_text()
    assert release.pin_notebooks("v0.2.0", [nb00, nb12], source_file=src) == []   # idempotent

    # Back to the committed ref: byte for byte the committed notebook (formatting kept).
    release.pin_notebooks(source.NOTEBOOK_REF, [nb12], source_file=src)
    assert nb12.read_bytes() == (ROOT / "notebooks" / "12_bk_core.ipynb").read_bytes()
    assert src.read_bytes() == (ROOT / "hwlib" / "source.py").read_bytes()


def test_pin_notebooks_refuses_bad_input_before_writing_anything(scratch, capsys):
    nb00, nb12, src = scratch / "00_environment.ipynb", scratch / "12_bk_core.ipynb", scratch / "source.py"
    before = {p: p.read_bytes() for p in (nb00, nb12, src)}
    with pytest.raises(release.ReleaseError, match="--ref"):
        release.pin_notebooks("v1; rm", [nb00], source_file=src)
    nb = json.loads(nb12.read_text())
    nb["cells"][1]["source"] = ["print('not a setup cell')\n"]
    nb12.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    before[nb12] = nb12.read_bytes()
    with pytest.raises(release.ReleaseError, match="12_bk_core.ipynb: its first code cell does not import hwlib"):
        release.pin_notebooks("v9", [nb00, nb12], source_file=src)
    with pytest.raises(release.ReleaseError, match="no such file"):
        release.pin_notebooks("v9", [nb00, scratch / "nope.ipynb"], source_file=src)
    assert {p: p.read_bytes() for p in before} == before
    assert release.main(["pin-notebooks", "--ref", "a..b", str(nb00)]) == 2
    assert "--ref 'a..b'" in capsys.readouterr().err


# --- provenance -----------------------------------------------------------------------------------

@pytest.fixture
def fresh_provenance():
    cached = (results.code_source, results.git_commit, results._checkout_root, results._versions)

    def clear():   # the functions themselves: a test may have patched the module's names
        for f in cached:
            f.cache_clear()
    clear()
    yield
    clear()


class FakeDist:
    def __init__(self, direct: str | None, version="9.9.9"):
        self.direct, self.version, self.requires = direct, version, []

    def read_text(self, name):
        assert name == "direct_url.json"
        return self.direct


@pytest.mark.parametrize("direct, kind, commit, ref", [
    ('{"url": "https://github.com/hwlib/hwlib", "vcs_info": {"vcs": "git", "commit_id": "' + "ab" * 20
     + '", "requested_revision": "v0.2.0"}}', "git", "ab" * 20, "v0.2.0"),
    ('{"url": "file:///tmp/hwlib-0.1.0-py3-none-any.whl", "archive_info": {}}', "archive", None, None),
    ('{"url": "file:///src/hwlib", "dir_info": {}}', "directory", None, None),
    ("{not json", "unknown", None, None),
    (None, "unknown", None, None),
])
def test_an_installed_copy_records_its_version_and_commit(monkeypatch, fresh_provenance, direct, kind, commit, ref):
    monkeypatch.setattr(results, "_checkout_root", lambda: None)
    monkeypatch.setattr(results, "_installed_distribution", lambda: FakeDist(direct))
    src = results.code_source()
    assert (src["kind"], src["commit"], src["ref"], src["version"]) == (kind, commit, ref, "9.9.9")
    assert results.git_commit() == (commit[:12] if commit else None)
    r = results.make_record(notebook="nb", workload=None, step=None, metric="m", value=1.0, unit="u", device="cpu")
    assert r["code_source"] == src and r["git_commit"] == results.git_commit()


def test_a_checkout_records_its_head(fresh_provenance):
    head = _git("rev-parse", "HEAD", cwd=ROOT)
    src = results.code_source()
    assert src["kind"] == "checkout" and src["commit"] == head
    assert results.git_commit().split("-")[0] == head[:12]
    assert set(results.package_versions()) >= {"torch", "numpy", "papermill"}
    assert results.package_versions()["torch"] == importlib.metadata.version("torch")


# --- installed from git, run outside the clone ----------------------------------------------------

# Notebook 00's own cells up to its set-up call (the Colab cell among them), then what the test reads:
# a record written the way notebook 00 writes its ceilings (its measurement, seconds of CPU that prove
# nothing about where the code came from, is left out: the notebook suite runs notebook 00 whole), and
# where hwlib and its kernel sources were found, from inside the notebook's kernel.
RECORD = """nb.record_ceilings({"kind": device, "copy_gbps": 1.0, "matmul_tflops": {}}, notebook=NOTEBOOK,
                   profile=profile, run=run)"""
CHECK = """import json
from hwlib.ops import sources
names = json.loads(os.environ["HWLIB_TEST_KERNELS"])
pathlib.Path(os.environ["HWLIB_TEST_FOUND"]).write_text(json.dumps(
    {"hwlib": hwlib.__file__, "kernels": {n: str(sources.kernel_path(n)) for n in names}}))"""


def _notebook_00_set_up(path: Path) -> Path:
    """Notebook 00's cells to its ``nb.setup`` call, then RECORD and CHECK, written to ``path``."""
    import nbformat
    nb = nbformat.read(ROOT / "notebooks" / "00_environment.ipynb", as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    assert "import hwlib; from hwlib import notebook as nb" in nb.cells[code[0]].source   # the Colab cell
    (last,) = [i for i in code if "nb.setup(profile, device, run)" in nb.cells[i].source]
    nb.cells = nb.cells[:last + 1] + [nbformat.v4.new_code_cell(RECORD), nbformat.v4.new_code_cell(CHECK)]
    nbformat.write(nb, path)
    return path


def _missing_tools() -> list[str]:
    missing = [] if shutil.which("git") else ["git"]
    for dist in ("pip", "setuptools", "papermill"):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


def test_installed_from_git_a_notebook_runs_outside_the_clone(tmp_path):
    """What the Colab cell does, then notebook 00's set-up (smoke) from a folder that is another git
    repository: its records say where the code came from, and hwlib and its kernel sources are the
    installed copy's."""
    if _missing_tools():
        pytest.skip(f"{', '.join(_missing_tools())} not installed here: cannot install from git offline")
    repo, site, elsewhere, out = tmp_path / "repo", tmp_path / "site", tmp_path / "elsewhere", tmp_path / "out"
    for d in ("hwlib", "kernels"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o"))
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / f, repo / f)
    _git("init", "-q", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "release", cwd=repo)
    _git("tag", TAG, cwd=repo)
    commit = _git("rev-parse", "HEAD", cwd=repo)
    # file://localhost/...: pip before 23.3 rejects a URL requirement whose host is empty (file:///...)
    url = repo.as_uri().replace("file:///", "file://localhost/", 1)
    # --no-compile: bytecode for every installed file is pip's own step (a CPU-second here), not the subject
    r = _pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "--no-compile", "--target", str(site),
             f"hwlib @ git+{url}@{TAG}", cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    elsewhere.mkdir()
    _git("init", "-q", cwd=elsewhere)                 # a user's own repository: not hwlib's commit
    _git("commit", "-q", "--allow-empty", "-m", "theirs", cwd=elsewhere)

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "HWLIB_KERNELS", "HWLIB_RUN", "TORCH_EXTENSIONS_DIR")}
    kernels = sorted(p.name for p in (repo / "kernels").iterdir() if p.is_file())
    found = tmp_path / "found.json"
    env.update(PYTHONPATH=str(site), HWLIB_OUTPUTS=str(out), HWLIB_RUN="colab", HWLIB_PROFILE="smoke",
               HWLIB_DATA=str(tmp_path / "data"), HWLIB_TEST_KERNELS=json.dumps(kernels), HWLIB_TEST_FOUND=str(found))
    # papermill as `hwlib reproduce` starts it (cli.PAPERMILL: without rfc3987_syntax's seconds-long import)
    r = subprocess.run([sys.executable, "-c", cli.PAPERMILL, "-k", "python3", "--cwd", str(elsewhere),
                        str(_notebook_00_set_up(tmp_path / "00_environment.ipynb")), str(tmp_path / "00.ipynb")],
                       capture_output=True, text=True, cwd=elsewhere, env=env, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]

    recs = query.read_records(out / "colab" / "results.jsonl")   # stamps put back into every record
    assert recs and all(x["notebook"] == "00_environment" and x["profile"] == "smoke" for x in recs)
    want = {"kind": "git", "version": importlib.metadata.version("hwlib"), "url": url, "ref": TAG,
            "commit": commit}
    for x in recs:
        assert x["code_source"] == want, x["code_source"]
        assert x["git_commit"] == commit[:12]            # the installed code's, not the working folder's
        assert x["code_digest"] == results.code_digest(repo)   # the wheel shipped every file of hwlib/
        assert x["versions"]["packages"]["torch"] == importlib.metadata.version("torch")

    got = json.loads(found.read_text())
    inside = (site / "hwlib").resolve()
    assert Path(got["hwlib"]).resolve() == inside / "__init__.py"
    assert set(got["kernels"]) == set(kernels) and kernels
    for name, path in got["kernels"].items():
        assert Path(path).resolve().parent == inside / "kernels", path
        assert Path(path).read_bytes() == (repo / "kernels" / name).read_bytes(), name


# --- versions and memory, generated from the reference runs ---------------------------------------

def test_the_committed_constraints_are_generated_from_the_reference_run():
    path = release.constraints_path(release.REFERENCE_RUN)
    assert path == ROOT / "constraints" / "h100.txt"
    assert path.read_text() == release.constraints_text(release.REFERENCE_RUN), \
        "constraints/h100.txt is stale: run `make constraints`"
    assert "torch==2" in path.read_text() and "+cu" not in path.read_text().split("\n# torch ran as")[0]


def _records(step="01_baseline_fp32", **versions):
    r = results.make_record(notebook="nb", workload="gpt", step=step, metric="ms_per_step",
                            value=1.0, unit="ms", device={"name": "GPU X"})
    r["versions"] = {**r["versions"], **versions}
    return r


def test_constraints_pin_every_package_a_record_names(tmp_path):
    results.append([_records(), _records("02_tf32")], "mine")
    text = release.constraints_text("mine")
    pins = dict(l.split("==") for l in text.splitlines() if l and not l.startswith("#"))
    assert set(pins) == set(results.package_versions())
    assert pins["torch"] == importlib.metadata.version("torch").split("+")[0]
    assert "GPU X" in text
    assert release.main(["constraints", "--run", "mine", "--out", str(tmp_path / "c.txt")]) == 0
    assert (tmp_path / "c.txt").read_text() == text
    assert release.main(["constraints", "--run", "mine", "--out", str(tmp_path / "c.txt"), "--check"]) == 0

    r = _records()
    r["versions"]["packages"] = {**r["versions"]["packages"], "numpy": "0.0.1"}
    results.append(r, "mixed")
    results.append(_records("02_tf32"), "mixed")   # another measurement: a re-measure would supersede
    with pytest.raises(release.ReleaseError, match=r"mixes versions \(numpy differ"):
        release.constraints_text("mixed")
    # a package outside the core (one a few notebooks import) may differ: the newest record's is pinned, and named
    a, b = _records(), _records("02_tf32")
    a["versions"]["packages"] = {**a["versions"]["packages"], "peft": "0.1.0"}
    b["versions"]["packages"] = {**b["versions"]["packages"], "peft": "0.2.0"}
    a["time"], b["time"] = "2026-01-02T00:00:00+00:00", "2026-01-01T00:00:00+00:00"
    results.append([a, b], "side")
    text = release.constraints_text("side")
    assert "peft==0.1.0" in text and "# peft: its records carry 0.1.0, 0.2.0; pinned to 0.1.0" in text
    with pytest.raises(release.ReleaseError, match="--run 'empty'"):
        release.constraints_text("empty")

    # a record stamped before `packages` existed names fewer libraries: it agrees, it does not mix
    old = _records()
    old["versions"] = {k: v for k, v in old["versions"].items() if k != "packages"}
    results.append([old, _records("02_tf32")], "older")
    assert release.constraints_text("older").replace("older", "mine") == release.constraints_text("mine")


def test_the_readme_states_the_memory_each_profile_needs(tmp_path):
    text = (ROOT / "README.md").read_text()
    assert release.update_marked(text, release.memory_block()) == text, "README's GPU memory table is stale: make readme"

    def peak(run, profile, value, status="ok", step="01_baseline_fp32"):
        r = results.make_record(notebook="nb", workload="gpt", step=step, metric="peak_mem_gib", value=value,
                                unit="GiB", status=status, profile=profile, device={"name": "GPU X"})
        results.append(r, run)
    peak("a", "full", 20.0)
    peak("b", "full", 30.0, step="02_tf32")
    peak("b", "full", 99.0, status="failed", step="03_bf16_autocast")   # not a measured peak
    peak("a", "mid", 12.0, step="05_fused_optimizer")
    rows = release.memory_rows(["a", "b"])
    assert [(r["profile"], r["peak_gib"], r["run"], r["step"]) for r in rows] == \
        [("full", 30.0, "b", "02_tf32"), ("mid", 12.0, "a", "05_fused_optimizer")]
    with pytest.raises(release.ReleaseError, match="markers"):
        release.update_marked("no markers", "x")


def test_make_setup_pin_installs_with_the_constraints():
    def dry(*extra):
        r = subprocess.run(["make", "-n", "setup", "PYTHON=false", "VENV=/nonexistent-venv", *extra], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = [l for l in r.stdout.splitlines() if "pip install" in l]
        # the installs of torch and of the package (by uv, else by pip), not of the installer uv itself
        return [l for l in lines if '"torch' in l or '".[all,test]"' in l]   # TORCH_SPEC may name a version
    pinned, plain = dry("PIN=1"), dry()
    assert len(pinned) == 3 and all("-c constraints/h100.txt" in l for l in pinned), pinned
    assert len(plain) == 3 and not any("-c " in l for l in plain), plain
    assert sum("uv pip install" in l for l in pinned) == 1 and sum("-m pip install" in l for l in pinned) == 2
