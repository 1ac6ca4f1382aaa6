"""Set-up files agree with each other, and the notebooks keep the series' skeleton."""

import json
import re
import tomllib
from pathlib import Path

import pytest

from hwlib.steps import STEP_NAMES

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_the_pyproject_dependencies():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = set(py["dependencies"]) | set(py["optional-dependencies"]["test"])
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    indent = len(lines[start + 1]) - len(lines[start + 1].lstrip())
    have = set()
    for l in lines[start + 1:]:
        if not l.strip() or len(l) - len(l.lstrip()) < indent:
            break
        item = l.strip()[2:].strip()
        if item != "-e .":
            have.add(item)
    assert have == want, f"only in environment.yml: {have - want}; only in pyproject.toml: {want - have}"


def test_ci_installs_the_cpu_torch_through_make_test():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "TORCH_SPEC=torch==2.13.0" in ci
    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^reproduce:", mk, re.M) and re.search(r"^test:", mk, re.M)
    assert '"$(TORCH_SPEC)"' in mk   # the torch build is chosen before the package's requirements


def test_readme_shows_the_two_commands_and_a_colab_badge_per_notebook():
    readme = (ROOT / "README.md").read_text()
    assert "make reproduce" in readme and "make test" in readme
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.name}" in readme and "colab-badge.svg" in readme, nb.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_skeleton(path):
    nb = json.loads(path.read_text())
    cells = nb["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert not any(c.get("outputs") or c.get("execution_count") for c in code), "commit notebooks without outputs"
    params = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    src = "".join(params[0]["source"])
    assert 'profile = "auto"' in src and 'device = "auto"' in src
    assert cells[0]["cell_type"] == "markdown" and "".join(cells[0]["source"]).startswith("# " + path.stem[:2])
    assert "google.colab" in "".join(code[0]["source"])          # setup cell works in Colab too
    text = "".join("".join(c["source"]) for c in cells)
    assert "what we saw" in text.lower()
    ladder = {s.split("_", 1)[0] for s in STEP_NAMES}
    if path.stem[:2] in ladder:
        for part in ("## The change", "## Measure", "## Same math?", "assert check.ok", "## The ladder so far"):
            assert part in text, f"{path.name} lacks {part!r}"
    elif path.stem[:2] not in ("00", "99"):
        for part in ("## The change", "## Measure", "assert "):
            assert part in text, f"{path.name} lacks {part!r}"


def test_kernel_sources_stay_free_of_torch_headers():
    for cu in (ROOT / "kernels").glob("*.cu"):
        assert "torch/" not in cu.read_text() and "ATen" not in cu.read_text(), cu.name
