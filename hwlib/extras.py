"""The optional parts of hwlib: which extra of the package brings each module it imports only where
one notebook or one function needs it, and the error that names the extra.

``pip install hwlib`` installs the core: the ladder, the studies, the report. Notebook 14's
generation workload (transformers, peft, tokenizers), the widget dashboards (ipywidgets) and the
BK-Core notebook's SciPy reference come with ``hwlib[generation]``, ``hwlib[dashboard]`` and
``hwlib[bk-core]``; ``hwlib[all]`` brings every one (pyproject.toml, checked against ``EXTRAS`` by
tests/test_packaging.py).
"""

import importlib
from types import ModuleType

# top-level module -> the extra (pyproject.toml's optional-dependencies) whose distribution brings it
EXTRAS = {
    "transformers": "generation",
    "peft": "generation",
    "tokenizers": "generation",
    "ipywidgets": "dashboard",
    "scipy": "bk-core",
}


class MissingExtra(ImportError):
    """An optional module is not installed; the message says which extra installs it."""


def install_hint(extra: str) -> str:
    return f'pip install "hwlib[{extra}]"'


def require(module: str, needed_for: str) -> ModuleType:
    """``module`` imported (``"scipy.linalg"``, ``"transformers"``), or ``MissingExtra`` naming the extra
    that installs it and what needed it. An ImportError raised inside an installed module (a broken
    install, a missing dependency of its own) is left as it is: the extra would not fix it."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        raise ValueError(f"module {module!r}: not an optional dependency of hwlib (EXTRAS: {sorted(EXTRAS)})")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing is not None and not (module == missing or module.startswith(missing + ".")):
            raise
        extra = EXTRAS[top]
        raise MissingExtra(f"{needed_for} needs {top}, which is not installed; it comes with the "
                           f"'{extra}' extra: {install_hint(extra)} (or {install_hint('all')})",
                           name=module) from e


def require_extra(extra: str, needed_for: str) -> None:
    """Every module of ``extra`` imported, or ``MissingExtra`` naming it: a notebook's first cells say
    at once what it needs, rather than a later cell failing halfway through a measurement."""
    modules = [m for m, e in EXTRAS.items() if e == extra]
    if not modules:
        raise ValueError(f"extra {extra!r}: hwlib has no such extra (extras: {sorted(set(EXTRAS.values()))})")
    for m in modules:
        require(m, needed_for)
