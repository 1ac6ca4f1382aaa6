"""What a release pins: the notebooks' setup cell and Colab metadata, the reference run's versions
as a pip constraints file, and the GPU memory each profile needs.

* ``setup_cell(ref)`` is the one template of every notebook's first code cell. In a clone it makes
  the checkout importable; under Colab it installs ``hwlib @ git+<REPOSITORY>@<ref>`` with its
  dependencies, while a constraints file pins torch to the build Colab already has (Colab's torch
  matches its CUDA driver; a dependency that asks for another torch then fails loudly instead of
  swapping it). The cell runs before hwlib can be imported, so it carries the ref itself.
* ``pin_notebooks(ref)`` writes that cell and the GPU metadata Colab reads (``accelerator``,
  ``colab.gpuType``) into every notebook, and the ref into ``hwlib/source.py``.
* ``constraints_text(run)`` turns the versions stamped into a reference run's records into a pip
  constraints file (``make setup PIN=1`` installs with it).
* ``memory_block()`` is the README's table of the largest peak GPU memory per profile, read from
  the committed reference runs.

Command line: ``python -m hwlib.release pin-notebooks --ref REF``, ``... constraints [--check]``,
``... readme-memory [--check]`` (``make pin-notebooks``, ``make constraints``, ``make readme``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from . import query, source
from .paths import REPO_ROOT
from .results import write_atomic
from .series import NOTEBOOKS_DIR, notebook_paths

SOURCE_FILE = Path(source.__file__)
CONSTRAINTS_DIR = REPO_ROOT / "constraints"
# The machine whose reference run the default constraints file reproduces.
REFERENCE_RUN = "reference/h100"
# What Colab reads to open a notebook on a GPU runtime; the T4 is the GPU its free tier gives.
COLAB_METADATA = {"accelerator": "GPU", "colab": {"gpuType": "T4"}}
# Written by the setup cell under Colab only (a Linux machine); pip reads it as constraints.
COLAB_CONSTRAINTS = "/tmp/hwlib-colab-constraints.txt"
# What the Colab cell keeps at the versions the runtime has: torch (Colab's build matches its CUDA
# driver) and the packages Colab's own warning says must not change under a running runtime
# ("Upgrading ipython, ipykernel, tornado, prompt-toolkit or pyzmq can cause your runtime to
# repeatedly crash"), with jupyter-client, through which its kernel talks. A dependency that needs
# another version of one of them makes pip fail with a message instead of breaking the runtime.
COLAB_KEEP = ("torch", "ipython", "ipykernel", "jupyter-client", "tornado", "pyzmq", "prompt-toolkit")
MEMORY_START, MEMORY_END = "<!-- gpu-memory:start -->", "<!-- gpu-memory:end -->"

# A branch, tag or commit: git's own rules, less the characters a shell or a quoted pip argument
# would read differently.
_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")


class ReleaseError(ValueError):
    """Bad input to a release command; the message names the argument."""


def check_ref(ref: str) -> str:
    if not isinstance(ref, str) or not _REF.fullmatch(ref) or ".." in ref or ref.endswith((".lock", "/", ".")):
        raise ReleaseError(f"--ref {ref!r} is not a git branch, tag or commit (letters, digits, '.', '_', '-', "
                           f"'/'; no '..'), e.g. 'main' or 'v0.2.0'")
    return ref


def install_target(ref: str) -> str:
    """What the Colab cell gives pip: hwlib from the repository at ``ref`` (PEP 508 direct reference)."""
    return f"hwlib @ git+{source.REPOSITORY}@{check_ref(ref)}"


def setup_cell(ref: str = source.NOTEBOOK_REF) -> str:
    """Every notebook's first code cell, five lines: a clone imports its checkout; Colab pip-installs hwlib
    at ``ref`` with its dependencies, the packages in COLAB_KEEP (its torch, its kernel's) pinned as they
    are. Notebooks that run Triton on CPU tensors say so to ``notebook.setup`` (``triton_on_cpu``)."""
    keep = ", ".join(repr(k) for k in COLAB_KEEP)
    return "\n".join([
        "import os, sys, subprocess, pathlib, importlib.metadata as md   # set-up: Colab installs hwlib, a clone imports its own",
        f'if "google.colab" in sys.modules: pathlib.Path("{COLAB_CONSTRAINTS}").write_text("".join(f"{{d.name}}=={{d.version}}\\n" for d in md.distributions() if (d.name or "").lower().replace("_", "-") in ({keep})))',
        f'if "google.colab" in sys.modules: subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", "{COLAB_CONSTRAINTS}", "{install_target(ref)}"], check=True); sys.modules["importlib"].invalidate_caches()',
        'else: sys.path.insert(0, str(next((p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "hwlib" / "__init__.py").exists()), pathlib.Path.cwd())))',
        "import hwlib; from hwlib import notebook as nb",
    ])


def _source_lines(text: str) -> list[str]:
    """A cell's source as nbformat stores it: lines that keep their newline, the last without."""
    return text.splitlines(keepends=True)


def setup_cell_of(nb: dict, name: str) -> dict:
    """The notebook's setup cell (its first code cell); an error naming the notebook when the first
    code cell is not a setup cell, so that no other cell is ever overwritten."""
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    if not code or "import hwlib" not in "".join(code[0].get("source", [])):
        raise ReleaseError(f"{name}: its first code cell does not import hwlib: not a setup cell to rewrite")
    return code[0]


def problems(nb: dict, name: str, ref: str = source.NOTEBOOK_REF) -> list[str]:
    """Why a notebook's setup cell or metadata is not what ``pin_notebooks`` writes, one line per
    problem; [] when it is."""
    out = []
    try:
        cell = setup_cell_of(nb, name)
        have = "".join(cell.get("source", []))
        want = setup_cell(ref)
        if have != want:
            out.append(f"its setup cell differs from hwlib.release.setup_cell({ref!r}): "
                       f"run `make pin-notebooks REF={ref}`")
    except ReleaseError as e:
        out.append(str(e))
    meta = nb.get("metadata", {})
    if meta.get("accelerator") != "GPU" or (meta.get("colab") or {}).get("gpuType") != COLAB_METADATA["colab"]["gpuType"]:
        out.append(f"no GPU metadata for Colab (accelerator, colab.gpuType): run `make pin-notebooks`")
    return out


def pin_notebook(path: Path, ref: str) -> bool:
    """Write the setup cell for ``ref`` and the Colab GPU metadata into one notebook; True if it changed.
    The file keeps its formatting (nbformat's one-space indent, its choice of escaping)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    cell = setup_cell_of(nb, path.name)
    cell["source"] = _source_lines(setup_cell(ref))
    meta = nb.setdefault("metadata", {})
    meta["accelerator"] = COLAB_METADATA["accelerator"]
    meta["colab"] = {**(meta.get("colab") or {}), **COLAB_METADATA["colab"]}
    new = json.dumps(nb, indent=1, ensure_ascii=text.isascii()) + "\n"
    if new == text:
        return False
    write_atomic(path, new)
    return True


def pin_source(ref: str, path: Path = SOURCE_FILE) -> bool:
    """Write ``NOTEBOOK_REF = ref`` into hwlib/source.py; True if it changed."""
    text = Path(path).read_text(encoding="utf-8")
    new, n = re.subn(r'^NOTEBOOK_REF = "[^"\n]*"$', f'NOTEBOOK_REF = "{check_ref(ref)}"', text, flags=re.M)
    if n != 1:
        raise ReleaseError(f"{path}: no single 'NOTEBOOK_REF = \"...\"' line to rewrite")
    if new == text:
        return False
    write_atomic(path, new)
    return True


def pin_notebooks(ref: str, notebooks: list[Path] | None = None, source_file: Path = SOURCE_FILE) -> list[Path]:
    """Pin every notebook (or those named) and hwlib/source.py to ``ref``; returns the files changed.
    Every notebook is checked before any file is written: a bad one leaves all untouched."""
    check_ref(ref)
    paths = [Path(p) for p in (notebooks if notebooks is not None else notebook_paths())]
    if not paths:
        raise ReleaseError("no notebooks to pin (notebooks/NN_*.ipynb)")
    for p in paths:
        if not p.is_file():
            raise ReleaseError(f"notebook {p}: no such file")
        setup_cell_of(json.loads(p.read_text(encoding="utf-8")), p.name)
    changed = [p for p in paths if pin_notebook(p, ref)]
    if pin_source(ref, source_file):
        changed.append(Path(source_file))
    return changed


# --- the reference run's versions as constraints -------------------------------------------------

# What the measurements themselves ran on (with the stamp's own keys: python, torch, triton, CUDA,
# cuDNN, driver): two versions of one of these in a run mean no single environment produced it, and
# no constraints file can say which. Other packages (those only some notebooks import: peft,
# transformers, ...) may differ between the run's records: the newest record's version is pinned and
# the file names the others.
CORE_PACKAGES = ("torch", "triton", "numpy")


def run_versions(records: list[dict], run: str = "") -> dict:
    """The one ``versions`` stamp of a run's records (records without one are left out), merged over
    its records: a record stamped before ``packages`` existed names fewer libraries and agrees with
    the rest on those it names. An error when two records name different versions of a core library
    (the stamp's own keys, ``CORE_PACKAGES``), since no single environment then produced the run; another
    package that differs takes the newest record's version, and ``mixed`` lists its versions."""
    stamped = [r for r in records if isinstance(r.get("versions"), dict) and r["versions"]]
    if not stamped:
        raise ReleaseError(f"run {run!r}: no record carries library versions")
    stamped.sort(key=lambda r: str(r.get("time") or ""))     # oldest first: the newest is set last
    merged: dict = {}
    differ: set = set()
    seen: dict = {}
    for r in stamped:
        s = r["versions"]
        for k, v in s.items():
            if k == "packages":
                continue
            if v is not None and merged.setdefault(k, v) != v:
                differ.add(k)
        pk = merged.setdefault("packages", {})
        for k, v in (s.get("packages") or {}).items():
            if v is None:
                continue
            seen.setdefault(k, set()).add(v)
            if pk.setdefault(k, v) != v:
                if k in CORE_PACKAGES:
                    differ.add(k)
                pk[k] = v
    if differ:
        raise ReleaseError(f"run {run!r} mixes versions ({', '.join(sorted(differ))} differ between its records): "
                           f"measure it again in one environment before pinning it")
    if not merged.get("packages"):
        merged.pop("packages", None)
    mixed = {k: sorted(v) for k, v in seen.items() if len(v) > 1}
    if mixed:
        merged["mixed"] = mixed
    return merged


def _public(version: str) -> tuple[str, str | None]:
    """'2.11.0+cu130' -> ('2.11.0', 'cu130'): PyPI's wheels carry no local label, so a pin keeps the
    public part and the build goes into a comment."""
    public, _, local = str(version).partition("+")
    return public, local or None


def constraints_text(run: str = REFERENCE_RUN) -> str:
    """A pip constraints file with the exact versions the run's records carry."""
    recs = query.load(run)
    if not recs:
        raise ReleaseError(f"--run {run!r}: no records (outputs/{run}/results.jsonl)")
    v = run_versions(recs, run)
    pkgs = dict(v.get("packages") or {})
    for name in ("torch", "triton"):   # runs stamped before `packages` existed carry these two
        if v.get(name) and name not in pkgs:
            pkgs[name] = v[name]
    dev = Counter((r.get("device") or {}).get("name") for r in recs if (r.get("device") or {}).get("name"))
    head = [f"# Generated by `python -m hwlib.release constraints --run {run}` (make constraints) from the",
            "# versions stamped into that run's records; regenerate it, never edit it.",
            f"# Run on {dev.most_common(1)[0][0] if dev else 'an unknown device'}: python {v.get('python')}, "
            f"CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, driver {v.get('driver')}."]
    if "packages" not in v:
        head.append("# Its records name torch and triton only (stamped before records named every dependency).")
    for name, versions in sorted((v.get("mixed") or {}).items()):
        head.append(f"# {name}: its records carry {', '.join(versions)}; pinned to {pkgs[name]}, the newest records'.")
    pins = []
    for name in sorted(pkgs):
        public, local = _public(pkgs[name])
        if local:
            index = (f"; that build: pip's --extra-index-url https://download.pytorch.org/whl/{local}"
                     if re.fullmatch(r"cu\d+|rocm[\d.]+|cpu", local) else "")
            head.append(f"# {name} ran as {pkgs[name]}{index}")
        pins.append(f"{name}=={public}")
    return "\n".join(head + pins) + "\n"


def constraints_path(run: str = REFERENCE_RUN) -> Path:
    return CONSTRAINTS_DIR / f"{run.rstrip('/').split('/')[-1]}.txt"


# --- the GPU memory each profile needs -----------------------------------------------------------

def memory_rows(runs: list[str] | None = None) -> list[dict]:
    """Per profile, the largest ``peak_mem_gib`` (tensor memory at its peak, per GPU) of any
    measured step in the committed reference runs, and where it was reached."""
    best: dict[str, dict] = {}
    for run in query.reference_runs() if runs is None else runs:
        for r in query.load(run):
            v = r.get("value")
            if (r.get("metric") != "peak_mem_gib" or r.get("status") != "ok" or not isinstance(v, (int, float))
                    or isinstance(v, bool)):
                continue
            prof = r.get("profile") or "?"
            if prof not in best or v > best[prof]["peak_gib"]:
                best[prof] = {"profile": prof, "peak_gib": float(v), "run": run, "notebook": r.get("notebook"),
                              "workload": r.get("workload"), "step": r.get("step"),
                              "device": (r.get("device") or {}).get("name")}
    return [best[p] for p in sorted(best)]


def memory_block(runs: list[str] | None = None) -> str:
    """The README's memory table: per profile, the largest measured peak and where, and the usable
    GPU memory from which ``auto`` picks it (``profiles.NEED_GIB``: the peak the profile was sized
    for plus ``HEADROOM_GIB``); a GPU-sized profile no reference run measured says so."""
    from .profiles import GPU_PROFILES, HEADROOM_GIB, NEED_GIB, PEAK_GIB
    rows = {r["profile"]: r for r in memory_rows(runs)}
    out = ["| profile | largest peak per GPU (GiB) | reached at | reference run | its GPU | auto picks it with |",
           "|---|---|---|---|---|---|"]
    for p in [*GPU_PROFILES, *sorted(set(rows) - set(GPU_PROFILES))]:
        need = (f"{NEED_GIB[p]:g} GiB usable or more ({PEAK_GIB[p]:g} + {HEADROOM_GIB:g} headroom)"
                if p in NEED_GIB else "-")
        r = rows.get(p)
        if r is None:   # a GPU profile no reference run measured: its estimate
            out.append(f"| {p} | {PEAK_GIB[p]:g} estimated | - | none yet | - | {need} |")
            continue
        out.append(f"| {p} | {r['peak_gib']:.2f} | {r['workload']} {r['step']} (notebook {r['notebook']}) | "
                   f"`outputs/{r['run']}` | {r['device']} | {need} |")
    return "\n".join(out)


def update_marked(text: str, block: str, start: str = MEMORY_START, end: str = MEMORY_END, name: str = "README.md") -> str:
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pat.search(text):
        raise ReleaseError(f"{name}: markers {start} ... {end} not found")
    return pat.sub(lambda _: f"{start}\n{block}\n{end}", text)


# --- command line --------------------------------------------------------------------------------

def _write_or_check(path: Path, new: str, check: bool, what: str, fix: str) -> int:
    old = path.read_text(encoding="utf-8") if path.is_file() else None
    if check:
        if old != new:
            print(f"{path}: {what} is out of date: run `{fix}`", file=sys.stderr)
            return 1
        print(f"{path}: {what} matches")
        return 0
    if old != new:
        write_atomic(path, new)
    print(f"{path} {'written' if old != new else 'already up to date'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hwlib.release", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pin-notebooks", help="write the setup cell for --ref and Colab's GPU metadata into the notebooks")
    p.add_argument("--ref", default=source.NOTEBOOK_REF, help="git branch, tag or commit to install under Colab "
                                                              f"(default: hwlib/source.py's, now {source.NOTEBOOK_REF!r})")
    p.add_argument("notebooks", nargs="*", type=Path, help="notebooks to pin (default: every notebooks/NN_*.ipynb)")
    c = sub.add_parser("constraints", help="write constraints/<machine>.txt from a reference run's versions")
    c.add_argument("--run", default=REFERENCE_RUN)
    c.add_argument("--out", type=Path, help="default: constraints/<machine>.txt")
    c.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    m = sub.add_parser("readme-memory", help="regenerate README.md's table of GPU memory per profile")
    m.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    m.add_argument("--check", action="store_true", help="exit 1 if the table is out of date")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pin-notebooks":
            changed = pin_notebooks(args.ref, args.notebooks or None)
            print(f"pinned to {args.ref!r}: {len(changed)} file(s) changed" +
                  "".join(f"\n  {p}" for p in changed))
            return 0
        if args.cmd == "constraints":
            out = args.out or constraints_path(args.run)
            return _write_or_check(out, constraints_text(args.run), args.check, "constraints",
                                   f"python -m hwlib.release constraints --run {args.run}")
        text = args.readme.read_text(encoding="utf-8")
        return _write_or_check(args.readme, update_marked(text, memory_block(), name=args.readme.name), args.check,
                               "the GPU memory table", "make readme")
    except (ReleaseError, OSError) as e:
        print(f"hwlib.release {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
