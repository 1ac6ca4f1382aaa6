"""``pip install hwlib`` without extras, for the processes of one test suite: put this folder on
PYTHONPATH and every module that only an extra of pyproject.toml brings (generation, dashboard,
bk-core, lab, compare; not the test runner's own) is absent, its import raising ModuleNotFoundError
as when it is not installed. The ladder's notebook suite runs this way (Makefile:
test-notebooks-ladder), so that notebooks 00-11 and 99 are shown to run on the core alone, at no
cost beyond the suite's own run; tests/test_extras.py checks that the block holds."""

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:                      # Python 3.10
    import tomli as tomllib

_PROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
# The extras a reader may leave out; "test" is this suite's own runner (pytest, nbval).
READER_EXTRAS = ("generation", "dashboard", "bk-core", "lab", "compare")
# distribution name -> import name, where they differ
IMPORT_NAME = {"liger-kernel": "liger_kernel", "cut-cross-entropy": "cut_cross_entropy"}


def names(reqs) -> set[str]:
    """The distribution names of requirement strings, lower-cased."""
    return {re.split(r"[<>=!~ \[;]", r.strip(), maxsplit=1)[0].lower() for r in reqs}


BLOCKED = sorted({IMPORT_NAME.get(n, n) for extra in READER_EXTRAS
                  for n in names(_PROJECT["optional-dependencies"][extra])} - {"hwlib"})
if __name__ == "sitecustomize":          # as Python's start-up loads it; tests/test_extras.py reads the names only
    for _name in BLOCKED:
        sys.modules[_name] = None        # import raises ModuleNotFoundError: not installed
