"""Where things live: the checkout (or working folder), the package's own files, run folders.

Run names stay under ``outputs/``: a run is named, never pointed at an arbitrary folder, so that a
typo or a ``../`` cannot write measurements (or overwrite a committed reference) elsewhere.
"""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# A checkout keeps outputs/ and data/ beside hwlib/; an installed copy (Colab) uses the working folder.
_PKG_PARENT = PACKAGE_DIR.parent
REPO_ROOT = _PKG_PARENT if (_PKG_PARENT / "pyproject.toml").exists() else Path.cwd()
# Every kernel source lives in the repository's top-level kernels/, named by the step that introduces
# it; the wheel ships that folder inside the package as hwlib/kernels/ (pyproject.toml's package-dir),
# so a clone reads kernels/ and an installed copy (Colab) its own hwlib/kernels/.
KERNELS_DIR = _PKG_PARENT / "kernels" if (_PKG_PARENT / "kernels").is_dir() and (_PKG_PARENT / "pyproject.toml").exists() \
    else PACKAGE_DIR / "kernels"
DEFAULT_RUN = "interactive"


class RunNameError(ValueError):
    """A run name that would leave ``outputs/`` or says nothing."""


# The environment a notebook run by `hwlib reproduce` reads to dump its stacks before its time runs out
# (hwlib.runs sets them, hwlib.stacks.arm_stack_dump reads them).
STACKS_FILE, STACKS_DEADLINE, STACKS_CELL_S = "HWLIB_STACKS_FILE", "HWLIB_STACKS_DEADLINE", "HWLIB_STACKS_CELL_S"

def outputs_root() -> Path:
    """``$HWLIB_OUTPUTS`` (a relative one taken from the working folder, once: ``hwlib reproduce``
    hands its notebooks the absolute folder), else the checkout's ``outputs/``. A file there is an
    error naming the variable."""
    env = os.environ.get("HWLIB_OUTPUTS")
    root = Path(env or REPO_ROOT / "outputs").resolve()
    if root.exists() and not root.is_dir():
        raise RunNameError(f"{'HWLIB_OUTPUTS=' + repr(env) if env else str(root)} is a file, not a folder: "
                           f"point HWLIB_OUTPUTS at a folder (or unset it for {REPO_ROOT / 'outputs'})")
    return root


def run_name(run: str | os.PathLike | None = None, *, source: str = "run") -> str:
    """The run's name relative to ``outputs/``: ``run``, else ``$HWLIB_RUN``, else 'interactive'.

    ``outputs/x`` and an absolute path inside ``outputs/`` are accepted as ``x``. An empty name,
    ``..`` or an absolute path elsewhere raise ``RunNameError`` naming ``source``."""
    if run is None:
        env = os.environ.get("HWLIB_RUN")
        if env is None:
            return DEFAULT_RUN
        run, source = env, "HWLIB_RUN"
    text = os.fspath(run)
    if not text.strip():
        raise RunNameError(f"{source}: an empty run name; name the run (e.g. 'latest') or leave it out "
                           f"for '{DEFAULT_RUN}'")
    root = outputs_root()
    p = Path(text)
    if p.is_absolute():
        try:
            rel = p.resolve().relative_to(root)
        except ValueError:
            raise RunNameError(f"{source}={text!r} is outside {root}: runs live under outputs/; "
                               f"give a name such as 'latest' or 'mygpu/try1'") from None
    else:
        if p.parts and p.parts[0] == "outputs":
            p = Path(*p.parts[1:]) if len(p.parts) > 1 else Path("")
        if ".." in p.parts:
            raise RunNameError(f"{source}={text!r} climbs out of outputs/ ('..'); give a name such as 'latest'")
        rel = p
    name = rel.as_posix().strip("/")
    if name in ("", "."):
        raise RunNameError(f"{source}={text!r} names outputs/ itself; name a run inside it, e.g. 'latest'")
    long = next((part for part in name.split("/") if len(part.encode()) > NAME_MAX), None)
    if long is not None:
        raise RunNameError(f"{source}: the run name's part {long[:40]!r}... is {len(long.encode())} bytes long; "
                           f"file systems take at most {NAME_MAX}: give a shorter name")
    return name


NAME_MAX = 255   # bytes in one path component on the usual file systems


def _inside(p: Path, root: Path, source: str, text: str) -> Path:
    """``p`` with every link resolved, refused unless it stays inside ``root`` and is a folder (or
    nothing yet): checked before anything is created there."""
    real = p.resolve()
    if real != root and root not in real.parents:
        raise RunNameError(f"{source}={text!r}: {p} leads to {real} (a symbolic link), outside {root}: runs live "
                           f"under outputs/; remove the link or name another run")
    if real.exists() and not real.is_dir():
        raise RunNameError(f"{source}={text!r}: {real} is a file, not a run folder; name another run "
                           f"(e.g. --run latest) or move the file")
    return real


def run_dir(run: str | os.PathLike | None = None, *, create: bool = True) -> Path:
    """The folder of a run under ``outputs/`` (``latest`` -> ``outputs/latest``, ``reference/h100``
    -> ``outputs/reference/h100``); created unless ``create`` is False. See ``run_name``."""
    root = outputs_root()
    name = run_name(run)
    source, text = ("HWLIB_RUN", os.environ.get("HWLIB_RUN", "")) if run is None else ("run", os.fspath(run))
    p = _inside(root / name, root, source, text)   # resolved and checked before anything is made
    if create:
        p.mkdir(parents=True, exist_ok=True)
        _inside(p, root, source, text)   # a link put in place meanwhile is still refused
    return p


def compile_cache_env(run: Path, code: str | None) -> dict[str, str]:
    """The environment that puts a run's compile caches in its folder: inductor's FX-graph and
    AOT-autograd caches and Triton's kernels are made once per run and reused by every later
    notebook of it (and by a resumed run); a new run starts cold, so its compile times are a cold
    start's. ``hwlib reproduce`` passes it to each notebook; a notebook run on its own sets it for
    itself (``hwlib.notebook.setup``), where nothing set it before.

    ``code`` (``results.code_digest()``) names the folder: inductor keys a cached graph on the graph,
    not on the Python behind a custom op it calls (hwlib's ops: their fake implementations give the
    output shapes the compiled code asserts), so a run resumed after hwlib's code changed must not
    reuse graphs compiled against the old code."""
    base = run / ".cache" / (code or "unknown-code")
    return {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"), "TRITON_CACHE_DIR": str(base / "triton")}


def _inductor_default_cache_dir() -> str:
    """Inductor's default cache folder (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``).
    Importing that module imports all of ``torch._inductor`` and ``torch._dynamo`` (4 s on a small CPU,
    in every notebook's set-up, most of which never compile): where it is not imported yet, its rule is
    followed here instead (the temporary folder, ``torchinductor_`` and the user's name)."""
    mod = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if mod is not None and hasattr(mod, "default_cache_dir"):
        return mod.default_cache_dir()
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def apply_compile_cache_env(env: dict[str, str]) -> None:
    """Put ``compile_cache_env``'s folders in ``os.environ`` unless the user chose others. Importing ``torch._dynamo`` (torch.compile's first call does) writes inductor's
    default folder into ``TORCHINDUCTOR_CACHE_DIR``: a value equal to that default is inductor's
    own, not a choice, and is replaced (else a notebook run outside ``hwlib reproduce`` would reuse
    graphs compiled against older hwlib code, whose custom ops gave other output shapes)."""
    defaults = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(_inductor_default_cache_dir())}
    for k, v in env.items():
        have = os.environ.get(k)
        if have is None or (k in defaults and os.path.abspath(have) == defaults[k]):
            os.environ[k] = v


def read_dir(run: str | os.PathLike | None = None) -> Path:
    """The folder to read a run from: ``run_dir(run, create=False)``, except that a committed
    reference (``reference/<machine>``) that this process's outputs root does not hold is read from
    the checkout's ``outputs/reference/``, where it is committed. Tests and notebook checks point
    ``HWLIB_OUTPUTS`` at a scratch folder and still compare with the references; nothing is ever
    written through this path."""
    committed = (REPO_ROOT / "outputs" / "reference").resolve()
    if run is not None and Path(os.fspath(run)).is_absolute():
        p = Path(os.fspath(run)).resolve()
        if p == committed or committed in p.parents:
            return p
    p = run_dir(run, create=False)
    name = run_name(run)
    if not p.exists() and name.split("/")[0] == "reference":
        return committed.parent / name
    return p


def is_reference(run: str | os.PathLike | None) -> bool:
    """Whether ``run`` is a committed reference run (``outputs/reference/...``): by its name, or by the
    folder it resolves to (a link in outputs/ that points into ``reference/`` is one too)."""
    if run_name(run).split("/")[0] == "reference":
        return True
    root = outputs_root()
    real = (root / run_name(run)).resolve()
    return real == root / "reference" or (root / "reference") in real.parents
