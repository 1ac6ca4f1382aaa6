"""The core installs and imports without any extra, and what needs an extra names it (hwlib.extras).

`pip install hwlib` without extras is simulated in a child Python where every module of an extra
is absent (None in sys.modules: its import raises ModuleNotFoundError, as when it is not installed)."""

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from hwlib import extras
from hwlib.extras import MissingExtra, require, require_extra

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = PROJECT["optional-dependencies"]


# The names of requirements and the import name of each distribution where it differs, as the ladder's
# notebook suite blocks them (tests/without_extras), read without its blocking.
_spec = importlib.util.spec_from_file_location("without_extras", ROOT / "tests" / "without_extras" / "sitecustomize.py")
WITHOUT_EXTRAS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(WITHOUT_EXTRAS)
_names, IMPORT_NAME = WITHOUT_EXTRAS.names, WITHOUT_EXTRAS.IMPORT_NAME
# Every extra's modules but triton: torch's CUDA wheels depend on it, and the modules that import it at
# their top (Triton kernels) are loaded on a GPU only.
NOT_CORE = sorted(IMPORT_NAME.get(n, n) for n in _names(r for reqs in OPTIONAL.values() for r in reqs)
                  - {"hwlib", "triton"})


def test_extras_agree_with_pyproject():
    core = _names(PROJECT["dependencies"])
    for module, extra in extras.EXTRAS.items():
        assert extra in OPTIONAL, f"hwlib.extras names the extra {extra!r}, which pyproject.toml lacks"
        assert module in _names(OPTIONAL[extra]), f"{module} is not in pyproject's {extra!r} extra"
        assert module not in core, f"{module} is a core dependency and in the {extra!r} extra"
    for extra in set(extras.EXTRAS.values()):   # each such extra holds only what hwlib.extras knows of
        assert _names(OPTIONAL[extra]) == {m for m, e in extras.EXTRAS.items() if e == extra}
    # `all` brings every extra a reader needs, through hwlib's own extras
    (whole,) = OPTIONAL["all"]
    assert whole.startswith("hwlib[") and set(whole[6:-1].split(",")) == set(extras.EXTRAS.values()) | {"lab"}
    assert not {"transformers", "peft", "tokenizers", "ipywidgets", "scipy"} & core
    assert ".[all,test]" in (ROOT / "Makefile").read_text()   # make setup installs every extra


CHILD = """
import importlib, json, pkgutil, sys
for name in {blocked!r}:
    sys.modules[name] = None   # as if not installed
import hwlib
from hwlib.extras import MissingExtra
failed = {{}}
for m in pkgutil.walk_packages(hwlib.__path__, "hwlib."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed[m.name] = f"{{type(e).__name__}}: {{e}}"
from hwlib.workloads.polychromic import build, config
try:
    build.build_lm(config("smoke"), "cpu")
    gen = "built"
except MissingExtra as e:
    gen = str(e)
print(json.dumps({{"failed": failed, "generation": gen, "leaked": sorted(n for n in {blocked!r} if sys.modules.get(n))}}))
"""


def test_the_core_imports_without_any_extra_and_generation_names_its_extra():
    out = subprocess.run([sys.executable, "-c", CHILD.format(blocked=NOT_CORE)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["failed"] == {}, got["failed"]   # every module of the package imports with the core alone
    assert got["leaked"] == []
    assert 'pip install "hwlib[generation]"' in got["generation"] and "transformers" in got["generation"]
    assert "transformers" in NOT_CORE and "ipywidgets" in NOT_CORE and "scipy" in NOT_CORE


@pytest.fixture
def without(monkeypatch):
    def block(*names):
        for n in names:
            monkeypatch.setitem(sys.modules, n, None)
    return block


def test_the_tokenizer_names_the_generation_extra(without):
    from hwlib.data import text
    without("tokenizers")
    with pytest.raises(MissingExtra, match=r'tokenizers.*pip install "hwlib\[generation\]"'):
        text.train_tokenizer(64, n_lines=10, cache=False)


def test_lora_names_the_generation_extra(without):
    from hwlib.workloads.polychromic import build
    without("peft")
    with pytest.raises(MissingExtra, match=r'generation workload.*peft.*hwlib\[generation\]'):
        build.add_lora(object(), None)


def test_the_explorer_panel_names_the_dashboard_extra(without):
    from hwlib.dashboard.explorer import Explorer
    without("ipywidgets")
    ex = Explorer.__new__(Explorer)   # the panel is built before anything is read
    ex.widgets = None
    with pytest.raises(MissingExtra, match=r'ipywidgets.*pip install "hwlib\[dashboard\]"'):
        ex.widget()


def test_the_scipy_reference_names_the_bk_core_extra(without):
    import torch
    from hwlib.studies.bk_core import scipy_diag_inverse
    without("scipy", "scipy.linalg")
    a = torch.zeros(1, 3)
    with pytest.raises(MissingExtra, match=r'scipy.*pip install "hwlib\[bk-core\]"'):
        scipy_diag_inverse(a, a[:, :2], a[:, :2], 0.5j)


def test_require_extra_names_the_first_missing_module(without, monkeypatch):
    # transformers, before peft in the extra, is there: a stand-in (the real import costs seconds of CPU)
    monkeypatch.setitem(sys.modules, "transformers", ModuleType("transformers"))
    without("peft")
    with pytest.raises(MissingExtra, match=r"notebook 14 needs peft.*hwlib\[generation\]"):
        require_extra("generation", "notebook 14")
    with pytest.raises(ValueError, match="no such extra"):
        require_extra("generations", "notebook 14")


def test_an_import_error_inside_an_installed_module_is_not_blamed_on_the_extra(monkeypatch):
    def broken(name):   # transformers is there, a dependency of its own is not
        raise ModuleNotFoundError("No module named 'huggingface_hub'", name="huggingface_hub")
    monkeypatch.setattr(extras, "importlib", SimpleNamespace(import_module=broken))
    with pytest.raises(ModuleNotFoundError) as e:
        require("transformers", "x")
    assert not isinstance(e.value, MissingExtra) and e.value.name == "huggingface_hub"
    with pytest.raises(ValueError, match="not an optional dependency"):
        require("numpy", "x")


def test_notebook_14_says_its_extra_before_it_measures():
    nb = json.loads((ROOT / "notebooks" / "14_generation_diversity.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    said = code.find('require_extra("generation"')
    builds = [i for i in (code.find(s) for s in ("build_lm", "Trainer(", "G.run", "pc.")) if i >= 0]
    assert 0 <= said < min(builds)


def test_hwlib_version(capsys):
    from hwlib import __version__
    from hwlib.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hwlib {__version__}"
    # one place for the version: pyproject reads hwlib.__version__
    assert "version" in PROJECT["dynamic"] and "version" not in PROJECT
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]["version"] == \
        {"attr": "hwlib.__version__"}


def test_the_ladder_notebooks_are_tested_without_any_extra():
    """The ladder's notebook suite (00-11 and 99) runs with tests/without_extras on PYTHONPATH: there,
    every module of a reader's extra is absent, as after `pip install hwlib`, and the test runner's own
    modules are not."""
    make = (ROOT / "Makefile").read_text()
    target = make[make.index("\ntest-notebooks-ladder:"):]
    target = target[:target.index("\n\n")]
    assert "PYTHONPATH=$(CURDIR)/tests/without_extras" in target and "$(NB_KERNEL_ARG)" in target
    # the kernel is this Python: forked from a server it started (tests/forkkernel.py), or its own
    assert "NB_KERNEL_ARG = $(if $(FORK_KERNEL),--nbval-kernel-name hwlib-fork" in make
    assert ",--nbval-current-env)" in make
    child = ("import importlib, json, sitecustomize\nout = {}\nfor m in ['transformers', 'peft', 'tokenizers', "
             "'ipywidgets', 'scipy', 'jupyterlab', 'nbval', 'pytest']:\n    try:\n        importlib.import_module(m)\n"
             "        out[m] = 'imported'\n    except ModuleNotFoundError:\n        out[m] = 'absent'\n"
             "print(json.dumps([out, sitecustomize.BLOCKED]))")
    res = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests" / "without_extras")})
    assert res.returncode == 0, res.stderr[-2000:]
    got, blocked = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {**{m: "absent" for m in ("transformers", "peft", "tokenizers", "ipywidgets", "scipy", "jupyterlab")},
                   "nbval": "imported", "pytest": "imported"}
    assert set(blocked) == set(NOT_CORE) - {"nbval", "pytest", "playwright"}   # every reader's extra, no more
