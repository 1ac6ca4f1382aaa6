"""Set-up files agree with each other, and the notebooks keep the series' skeleton."""

import ast
import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from hwlib import release
from hwlib.steps import LADDER, STEP_NAMES

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower()


# pyproject's name -> conda-forge's, where they differ
CONDA_NAMES = {"torch": "pytorch", "matplotlib": "matplotlib-base"}
# What environment.yml leaves to pip: not on conda-forge, or (triton) on it for Linux only while an
# environment file has no platform markers. Anything else under pip: conda-forge ships it, so it goes there.
PIP_ONLY = {"triton", "playwright", "liger-kernel", "cut-cross-entropy"}


def _requirements(project: dict) -> set[str]:
    """Every requirement of pyproject's project table, its extras included; an extra that names hwlib's
    own other extras (``all``) adds nothing of its own."""
    reqs = set(project["dependencies"]).union(*project["optional-dependencies"].values())
    return {r for r in reqs if _name(r) != "hwlib"}


def environment_problems(env: dict, project: dict) -> list[str]:
    """Why environment.yml does not install pyproject's requirements, conda-forge first; [] when it does."""
    deps = env.get("dependencies", [])
    pip = next((d["pip"] for d in deps if isinstance(d, dict) and "pip" in d), [])
    conda = [d for d in deps if isinstance(d, str) and _name(d) not in ("python", "pip")]
    out = []
    if env.get("channels") != ["conda-forge"]:
        out.append(f"channels are {env.get('channels')}, not only conda-forge")
    if "-e ." not in pip:
        out.append("pip does not install hwlib itself (-e .)")
    to_conda = {_name(c): c[len(_name(c)):] for c in conda}
    to_pip = {_name(p): p for p in pip if p != "-e ."}
    for req in sorted(_requirements(project)):
        name, spec = _name(req), req[len(_name(req)):]
        if name in PIP_ONLY:
            if to_pip.pop(name, None) != req:
                out.append(f"{req!r} is not under pip as pyproject states it")
        elif to_conda.pop(CONDA_NAMES.get(name, name), None) != spec:
            out.append(f"{req!r} is not a conda-forge dependency {CONDA_NAMES.get(name, name)}{spec}")
    out += [f"{n!r} is not in pyproject.toml" for n in {**to_conda, **to_pip}]
    return out


def _environment():
    import yaml   # papermill's own dependency
    return (yaml.safe_load((ROOT / "environment.yml").read_text()),
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def test_environment_yml_lists_the_pyproject_dependencies():
    env, project = _environment()
    assert not environment_problems(env, project), environment_problems(env, project)


@pytest.mark.parametrize("how, says", [
    ("scipy>=1.10", "'scipy>=1.10' is not a conda-forge dependency scipy>=1.10"),   # dropped
    ("pytorch>=2.6", "'torch>=2.6' is not a conda-forge dependency pytorch>=2.6"),
    ("pip numpy", "'numpy>=1.24' is not a conda-forge dependency"),                  # moved to pip
    ("old torch", "'torch>=2.6' is not a conda-forge dependency"),
    ("extra", "'pandas' is not in pyproject.toml"),
])
def test_environment_check_fails_on_a_broken_environment(how, says):
    env, project = _environment()
    deps = env["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    if how == "pip numpy":
        deps.remove("numpy>=1.24")
        pip.insert(0, "numpy>=1.24")
    elif how == "old torch":
        deps[deps.index("pytorch>=2.6")] = "pytorch>=2.4"
    elif how == "extra":
        deps.append("pandas")
    else:
        deps.remove(how)
    assert any(says in p for p in environment_problems(env, project)), environment_problems(env, project)


def test_ci_installs_the_cpu_torch_through_make_test():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test -j\d+ TORCH_SPEC=torch==2.13.0$", ci, re.M)
    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^reproduce:", mk, re.M) and re.search(r"^test:", mk, re.M)
    assert '"$(TORCH_SPEC)"' in mk   # the torch build is chosen before the package's requirements


# The cumulative ladder's own notebooks: one step each, measured by the same library calls.
LADDER_NOTEBOOKS = {s.split("_", 1)[0] for s in STEP_NAMES if s < "12"}
# the steps past the recipe: each notebook prints its step's folder and kernels (nb.show_step)
STEP_NOTEBOOKS = {s.name.split("_", 1)[0] for s in LADDER if s.beyond_recipe}
COLAB = "https://colab.research.google.com/github/hwlib/hwlib/blob/main/notebooks/"
# A number with a unit typed into prose: it would not follow the measurement.
TYPED_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(\.\d+)?\s*(x|×|ms|%|TFLOP|GFLOP|GB/s|GiB|MiB|s/step|samples/s|tokens/s)(?![a-zA-Z])")


def _code(cell) -> str:
    """A code cell's source as Python: IPython magics and shell lines become ``pass``."""
    lines = "".join(cell["source"]).splitlines()
    return "\n".join(l[: len(l) - len(l.lstrip())] + "pass" if l.lstrip().startswith(("%", "!")) else l
                     for l in lines)


def _asserts_on_measurements(tree) -> bool:
    """An ``assert`` statement, or a call to ``nb.assert_same_math``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "assert_same_math"):
            return True
    return False


def _is_setup(src: str) -> bool:
    """At most five lines; imports hwlib; every install is gated on ``"google.colab" in sys.modules``
    and none names torch (Colab's own torch build is kept)."""
    lines = [l for l in src.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    if len(src.splitlines()) > 5 or not any(re.match(r"(import hwlib|from hwlib import)", l) for l in lines):
        return False
    installs = [l for l in lines if '"pip", "install"' in l or "pip install" in l]
    return bool(installs) and all(l.startswith('if "google.colab" in sys.modules:') and not re.search(r"\btorch\b", l)
                                  for l in installs)


def skeleton_problems(nb: dict, name: str, readme: str) -> list[str]:
    """Why a notebook breaks the series' skeleton (docs/architecture.md), one line per problem; [] when it keeps it."""
    cells, stem = nb["cells"], Path(name).stem
    out = []
    code = [c for c in cells if c["cell_type"] == "code"]
    prose = [c for c in cells if c["cell_type"] == "markdown"]
    row = next((l for l in readme.splitlines() if f"/notebooks/{name})" in l), "")   # absolute links
    if f"]({COLAB}{name})" not in row or "colab-badge.svg" not in row:
        out.append(f"its README row has no Colab badge pointing at notebooks/{name}")
    if any(c.get("outputs") or c.get("execution_count") for c in code):
        out.append("outputs committed: commit notebooks without outputs")
    ids = [c.get("id") for c in cells]
    if None in ids or len(set(ids)) != len(ids):
        # nbformat 4.5 requires a unique id per cell (a missing one warns now, and will be an error)
        out.append("a cell without an id, or two with the same one")
    if not (cells and cells[0]["cell_type"] == "markdown" and "".join(cells[0]["source"]).startswith(f"# {stem[:2]} ")):
        out.append(f"the first cell is not a Markdown title '# {stem[:2]} ...'")
    params = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(params) != 1:
        out.append(f"{len(params)} cells tagged 'parameters', not exactly one")
    else:
        names = {t.id for n in ast.walk(ast.parse(_code(params[0]))) if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
        if not {"profile", "device", "run"} <= names:
            out.append(f"the parameters cell sets {sorted(names)}, not profile, device and run")
        src = "".join(params[0]["source"])
        if "HWLIB_PROFILE" not in src or "HWLIB_RUN" not in src:
            out.append("the parameters cell does not read HWLIB_PROFILE and HWLIB_RUN (nbval cannot inject)")
    if not code or not _is_setup("".join(code[0]["source"])):
        out.append("no setup cell first (at most 5 lines; imports hwlib; installs only under google.colab; never torch)")
    else:   # the one template (hwlib.release.setup_cell at hwlib.source's ref) and Colab's GPU metadata
        out += release.problems(nb, name)
    trees = []
    for c in code:
        try:
            trees.append(ast.parse(_code(c)))
        except SyntaxError as e:
            out.append(f"a code cell does not parse: {e}")
    if not any(_asserts_on_measurements(t) for t in trees[1:]):
        out.append("no cell asserts on what it measured (an assert, or nb.assert_same_math)")
    for c in prose:
        text = re.sub(r"```.*?```|`[^`]*`", "", "".join(c["source"]), flags=re.S)
        m = TYPED_NUMBER.search(text)
        if m:
            out.append(f"a number typed into prose: {m.group(0)!r} (build it from the results)")
    if "what we saw" not in " ".join("".join(c["source"]).lower() for c in prose):
        out.append("no 'What we saw' section")
    if stem[:2] in STEP_NOTEBOOKS and "nb.show_step(STEP" not in " ".join("".join(c["source"]) for c in code):
        out.append("the step's notebook does not print its step (nb.show_step(STEP, ...))")
    if stem[:2] in LADDER_NOTEBOOKS:
        calls = " ".join("".join(c["source"]) for c in code)
        for call in ("nb.setup(", "nb.show_change(STEP", "nb.predict(", "nb.measure_all(", "nb.assert_same_math(",
                     "nb.show_ladder(", "nb.outcome(", "nb.what_we_saw(w, STEP"):
            if call not in calls:
                out.append(f"the ladder notebook does not call {call}...)")
    return out


def test_readme_shows_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make reproduce" in readme and "make test" in readme


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_skeleton(path):
    problems = skeleton_problems(json.loads(path.read_text()), path.name, (ROOT / "README.md").read_text())
    assert not problems, f"{path.name}: " + "; ".join(problems)


def _broken(how: str) -> tuple[dict, str]:
    """Notebook 02 and the README, broken in one way."""
    nb = json.loads((ROOT / "notebooks" / "02_tf32.ipynb").read_text())
    readme = (ROOT / "README.md").read_text()
    cells = nb["cells"]
    if how == "badge":
        readme = readme.replace(f"{COLAB}02_tf32.ipynb", f"{COLAB}01_baseline_fp32.ipynb")
    elif how == "outputs":
        cells[1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["hi\n"]}]
    elif how == "two parameters":
        cells[3].setdefault("metadata", {})["tags"] = ["parameters"]
    elif how == "no setup":
        cells[1]["source"] = ["import hwlib\n"]
    elif how == "no assert":
        for c in cells:   # the substring stays, the assertion goes
            if c["cell_type"] == "code":
                c["source"] = ["".join(c["source"]).replace("nb.assert_same_math(measured)",
                                                           "print('assert nothing')")]
    elif how == "cpu runtime":
        del nb["metadata"]["accelerator"]
    elif how == "old install":
        cells[1]["source"] = ["".join(cells[1]["source"]).replace('"-q", "-c"', '"-q", "--no-deps", "-c"')]
        assert "--no-deps" in cells[1]["source"][0]
    elif how == "typed number":
        cells[0]["source"].append("\nTF32 made this step 1.8x faster.")
    elif how == "long setup":
        cells[1]["source"] = ["".join(cells[1]["source"]) + "\nimport os\n"]
    elif how == "no step printed":
        nb = json.loads((ROOT / "notebooks" / "25_bias_column.ipynb").read_text())
        for c in nb["cells"]:
            c["source"] = ["".join(c["source"]).replace("nb.show_step(STEP", "nb.show_change(STEP")]
    elif how == "no cell id":
        del cells[2]["id"]
    return nb, readme


@pytest.mark.parametrize("how, says", [
    ("badge", "Colab badge"), ("outputs", "outputs committed"), ("two parameters", "cells tagged 'parameters'"),
    ("no setup", "no setup cell"), ("no assert", "asserts on what it measured"), ("typed number", "typed into prose"),
    ("cpu runtime", "no GPU metadata for Colab"), ("old install", "differs from hwlib.release.setup_cell"),
    ("long setup", "at most 5 lines"), ("no step printed", "does not print its step"),
    ("no cell id", "a cell without an id"),
])
def test_each_skeleton_check_fails_on_a_notebook_broken_that_way(how, says):
    nb, readme = _broken(how)
    problems = skeleton_problems(nb, "25_bias_column.ipynb" if how == "no step printed" else "02_tf32.ipynb", readme)
    assert any(says in p for p in problems), problems
    clean_nb, clean_readme = _broken("none")
    assert skeleton_problems(clean_nb, "02_tf32.ipynb", clean_readme) == []


def test_kernel_sources_stay_free_of_torch_headers():
    cus = list((ROOT / "kernels").glob("*.cu"))
    assert cus, "no kernel sources under kernels/"
    for cu in cus:
        assert "torch/" not in cu.read_text() and "ATen" not in cu.read_text(), cu.name


def test_no_code_cell_of_six_lines_is_copied_into_more_than_three_notebooks():
    """What several notebooks need is a call into hwlib, not a copied cell (the parameters cell is the
    longest the ladder notebooks share, at five lines)."""
    seen: dict[str, set] = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for c in json.loads(path.read_text())["cells"]:
            src = "".join(c["source"]).strip()
            if c["cell_type"] == "code" and len(src.splitlines()) >= 6:
                seen.setdefault(src, set()).add(path.name)
    copied = {src.splitlines()[0]: sorted(names) for src, names in seen.items() if len(names) > 3}
    assert not copied, copied


def test_every_document_the_code_cites_is_in_the_repository():
    """A comment or docstring that sends the reader to a page sends them to one the clone has. (The seeds'
    data names the write-ups' own files in their projects, and tests make pages of their own: not cited.)"""
    cited = {}
    code = [p for p in ROOT.joinpath("hwlib").rglob("*.py") if "seeds" not in p.parts]
    for path in [*code, ROOT / "tests" / "conftest.py", ROOT / "tests" / "test_layers.py",
                 ROOT / "tests" / "test_packaging.py", ROOT / "Makefile"]:
        for m in re.finditer(r"(?<![\w/.{}*>'-])((?:[\w-]+/)*[\w-]+\.md)\b", path.read_text()):
            cited.setdefault(m.group(1), set()).add(path.relative_to(ROOT).as_posix())
    # one walk of the repository for every document cited by a path that is not its own (a glob
    # "**/doc" per document walked it again each time)
    elsewhere = [d for d in cited if not (ROOT / d).is_file()]
    found = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md")] if elsewhere else []
    missing = {doc: sorted(cited[doc]) for doc in elsewhere
               if not any(f == doc or f.endswith("/" + doc) for f in found)}
    assert not missing, missing


def test_the_ladder_notebooks_read_their_workloads_from_the_environment(monkeypatch):
    """Notebooks 01-11 measure every workload unless HWLIB_WORKLOADS names fewer (nbval cannot inject a
    parameter; make test's ladder suite names some); papermill's --workloads still overrides it."""
    from hwlib.workloads import WORKLOADS
    ladder = [p for p in NOTEBOOKS if 1 <= int(p.name[:2]) <= 11]
    assert len(ladder) == 11
    for path in ladder:
        cell = next(c for c in json.loads(path.read_text())["cells"]
                    if "parameters" in c.get("metadata", {}).get("tags", []))
        for env, want in ((None, list(WORKLOADS)), ("gpt,encoder_nli", ["gpt", "encoder_nli"])):
            if env is None:
                monkeypatch.delenv("HWLIB_WORKLOADS", raising=False)
            else:
                monkeypatch.setenv("HWLIB_WORKLOADS", env)
            ns = {"os": os}
            exec("".join(cell["source"]), ns)
            assert ns["workloads"] == want, (path.name, env, ns["workloads"])
    make = (ROOT / "Makefile").read_text()
    names = re.search(r"^NB_LADDER_WORKLOADS \?= (\S+)$", make, re.M).group(1).split(",")
    assert "gpt" in names and set(names) < set(WORKLOADS)
    assert "HWLIB_WORKLOADS=$(NB_LADDER_WORKLOADS)" in make
