"""hwlib's modules import one way: base -> core -> runners -> edge, with no cycles.

Every import is read from the source (module level and inside functions alike), so a cycle cannot
hide behind a function-local import."""

import ast
import functools
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "hwlib"

# The first path component under hwlib/ decides the layer (docs/architecture.md, Layers).
LAYERS = {
    "base": {"__init__", "paths", "device", "precision", "blas", "bench", "results", "profiles", "telemetry", "trace", "noise", "source", "settings", "extras", "stacks"},
    "core": {"ops", "kernels", "workloads", "steps", "data", "ceilings", "shapes", "roofline"},
    "runners": {"ladder", "studies", "memory", "distributed"},
    "edge": {"query", "report", "seeds", "dashboard", "notebook", "cli", "runs", "release", "series"},
}
ORDER = ["base", "core", "runners", "edge"]
# A step folder's study (hwlib/steps/sNN_name/study.py) times the step's op alone, drives the runner for
# its long curves and writes records: a runner, although its folder is in the core. So the core (the
# step's op, apply and predict, the ladder's list) never imports it; a notebook or a test does.
STUDY = re.compile(r"hwlib\.steps\.s\d\d_[a-z0-9_]+\.study")
# memory/ holds primitives the ladder's session uses (accumulation, offload, checkpoint): it sits
# with the runners but imports nothing from them.


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> str:
    if STUDY.fullmatch(module):
        return "runners"
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for name, tops in LAYERS.items():
        if top in tops:
            return name
    raise AssertionError(f"{module}: no layer for hwlib.{top}; add it to LAYERS (and docs/architecture.md)")


@functools.cache
def known_modules() -> frozenset[str]:
    return frozenset(module_name(p) for p in PKG.rglob("*.py"))


def imports_of(path: Path) -> set[str]:
    """hwlib modules that ``path`` imports, resolved to module names (a ``from x import y`` of a
    submodule counts as that submodule)."""
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    known = known_modules()
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("hwlib")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("hwlib"):
                continue
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
            out |= subs or {mod}
            if subs and len(subs) < len(node.names):
                out.add(mod)
    return {m for m in out if m != me}


# Read once per session: every test below reads the same sources, and the files do not change under it.
@functools.cache
def graph() -> dict[str, frozenset[str]]:
    files = [p for p in PKG.rglob("*.py") if "kernels" not in p.relative_to(PKG).parts]
    return {module_name(p): frozenset(imports_of(p)) for p in files}


def test_every_module_has_a_layer():
    for m in graph():
        layer_of(m)


def test_no_import_points_up_a_layer():
    bad = []
    for m, deps in graph().items():
        for d in deps:
            if d == "hwlib":   # the package root holds only the version and a lazy attribute
                continue
            if ORDER.index(layer_of(d)) > ORDER.index(layer_of(m)):
                bad.append(f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)})")
    assert not bad, "imports that point up a layer:\n" + "\n".join(sorted(bad))


def test_memory_imports_no_other_runner():
    for m, deps in graph().items():
        if m.startswith("hwlib.memory"):
            up = [d for d in deps if layer_of(d) == "runners" and not d.startswith("hwlib.memory")]
            assert not up, f"{m} imports {up}: memory/ is the runners' primitives"


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle among modules (package __init__ edges to their own submodules excluded), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(g.get(n, ())):
            if n.startswith(d + "."):   # a module importing its own package's __init__ (siblings)
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if state.get(d) is None and d in g:
                c = visit(d)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if state.get(n) is None:
            c = visit(n)
            if c:
                return c
    return None


def test_no_import_cycle():
    c = find_cycle(graph())
    assert c is None, "import cycle: " + " -> ".join(c)


def test_the_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    with pytest.raises(AssertionError):
        layer_of("hwlib.nowhere")
    assert ORDER.index(layer_of("hwlib.cli")) > ORDER.index(layer_of("hwlib.results"))
    assert layer_of("hwlib.steps.s25_bias_column.study") == "runners"
    assert layer_of("hwlib.steps.s25_bias_column.apply") == layer_of("hwlib.steps.s25_bias_column") == "core"


def test_step_folders_hold_their_studies():
    """Each study.py under hwlib/steps is a step folder's, so the layer rule above sees it."""
    studies = [m for m in graph() if m.rpartition(".")[2] == "study"]
    assert studies, "no step folder holds a study"
    assert all(STUDY.fullmatch(m) for m in studies), studies


CORE_IMPORTS = ("hwlib.notebook", "hwlib.query", "hwlib.steps")


def fresh_hwlib_modules() -> list[tuple[str, str | None]]:
    """(name, file) of every hwlib module that importing CORE_IMPORTS loads into a Python that has
    loaded no hwlib module. A child forked from this process, with every hwlib module dropped, imports
    them: torch and the other libraries stay loaded, and which hwlib modules load does not depend on
    them. Where forking is not safe a fresh Python runs it."""
    import importlib
    import json
    import subprocess
    import sys
    from forked import can_fork, run_forked
    if not can_fork():
        code = (f"import sys, json, {', '.join(CORE_IMPORTS)}; "
                "print(json.dumps(sorted((m, getattr(v, '__file__', None)) for m, v in sys.modules.items() "
                "if m.startswith('hwlib'))))")
        return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                         cwd=PKG.parent, timeout=120).stdout)

    def child():
        for name in [m for m in sys.modules if m == "hwlib" or m.startswith("hwlib.")]:
            del sys.modules[name]
        for name in CORE_IMPORTS:
            importlib.import_module(name)
        print(json.dumps(sorted((m, getattr(v, "__file__", None)) for m, v in sys.modules.items()
                                if m.startswith("hwlib"))))

    rc, text = run_forked(child, 120)
    assert rc == 0, text[-3000:]
    return json.loads(text)


def test_the_core_a_ladder_notebook_imports_stays_within_its_budget():
    """The README states a line budget for what a ladder notebook imports; studies, dashboards, claims,
    release and run supervision stay outside it (they import the core, never the reverse)."""
    import re
    budget = int(re.search(r"core budget: (\d+) lines", (PKG.parent / "README.md").read_text()).group(1))
    mods = fresh_hwlib_modules()
    assert "hwlib.notebook" in dict(mods)
    lines = sum(len(Path(f).read_text().splitlines()) for _, f in mods if f)
    names = [m for m, _ in mods]
    outside = [m for m in names if m.split(".")[1:2] and m.split(".")[1] in
               {"studies", "dashboard", "seeds", "release", "cli", "distributed"}]
    assert not outside, outside
    assert lines <= budget, f"the core a ladder notebook imports is {lines} lines, over its budget of {budget}"
