"""Load kernel sources from ``kernels/``: the clone's top-level folder, which the wheel ships inside
the package as ``hwlib/kernels/``.

``kernels/`` is deliberately not imported as a Python package: Triton files are imported by
path under a private module name, ``.cu`` and ``.h`` files are read as text for ``hwlib.ops.build``.
A clone and an installed copy (a wheel, Colab) both find them at ``hwlib.paths.KERNELS_DIR``;
``HWLIB_KERNELS`` points at another folder (kernels under development).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import warnings
from pathlib import Path

import torch

from hwlib.device import ChoiceError, Unavailable
from hwlib.paths import KERNELS_DIR

_MODULES: dict = {}
_USED: dict[str, str] = {}   # op -> the backend its last call chose in this process (see note_backend)


def kernels_dir() -> Path:
    """``$HWLIB_KERNELS`` when set, else the clone's ``kernels/`` (an installed copy: its ``hwlib/kernels``)."""
    return Path(os.environ.get("HWLIB_KERNELS") or KERNELS_DIR)


def kernel_path(filename: str) -> Path:
    p = kernels_dir() / filename
    if not p.is_file():
        where = ("HWLIB_KERNELS=" + os.environ["HWLIB_KERNELS"]) if os.environ.get("HWLIB_KERNELS") else \
            "the installed package"
        raise Unavailable(f"kernel source {p} not found (looked in {where}): unset HWLIB_KERNELS or point it "
                          f"at a folder holding {filename}, or reinstall hwlib (its wheel ships kernels/)")
    return p


def triton_interpreted() -> bool:
    """Whether @triton.jit decorates into the CPU interpreter now (Triton reads the variable when
    a kernel module is imported, so it must be set before that)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_device_problem(device) -> str | None:
    """Why a Triton kernel cannot run on tensors on ``device`` (a torch.device) in this process (the
    kernel itself aside); None when it can. The one device check of every op with a Triton backend."""
    if device.type == "cpu" and not triton_interpreted():
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1 (set before triton is imported)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "Triton got a CUDA device, but no CUDA GPU is visible to torch"
    if device.type == "cuda" and triton_interpreted():
        return "TRITON_INTERPRET=1 is set: Triton would interpret, not compile, for CUDA tensors"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton on {device.type} tensors"
    return None


def triton_interpreter_mismatch() -> str | None:
    """Why Triton kernels loaded now would break, if they would: Triton decorates its own library
    (``tl.zeros`` ...) at its first import, so TRITON_INTERPRET must match from before that import
    (an op's first ``auto`` or ``triton`` call imports triton, and so does torch.compile)."""
    if "triton" not in sys.modules:
        return None
    import triton.language as tl
    lib_interpreted = type(tl.zeros).__name__ == "InterpretedFunction"
    if lib_interpreted == triton_interpreted():
        return None
    return (f"TRITON_INTERPRET is {'set' if triton_interpreted() else 'unset'} now but was "
            f"{'set' if lib_interpreted else 'unset'} when triton was first imported; set it before "
            f"importing torch or hwlib (tests: conftest.py does)")


def interpreted_here(device) -> bool:
    """Whether Triton kernels can run interpreted on ``device`` in this process (a CPU device,
    TRITON_INTERPRET=1 from before triton's import: ``notebook.setup(triton_on_cpu=True)``): where a
    step's study checks them beside the torch backend that ``auto`` picks on a CPU."""
    device = torch.device(device)
    return (device.type == "cpu" and triton_device_problem(device) is None
            and triton_interpreter_mismatch() is None)


def load_python_kernel(filename: str):
    """Import ``kernels/<filename>`` (a Triton module) once per interpreter mode."""
    path = kernel_path(filename)
    key = (str(path), path.stat().st_mtime_ns, triton_interpreted())
    if key in _MODULES:
        return _MODULES[key]
    try:
        import triton  # noqa: F401  (a clear reason when it is missing)
    except ImportError as e:
        raise Unavailable(f"triton is not installed ({e})") from e
    why = triton_interpreter_mismatch()
    if why:
        raise Unavailable(why)
    name = f"hwlib._kernels.{path.stem}{'_interp' if key[2] else ''}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod           # Triton's jit looks kernels' globals up through their module
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        sys.modules.pop(name, None)
        raise Unavailable(f"loading {path.name} failed: {type(e).__name__}: {e}") from e
    _MODULES[key] = mod
    return mod


def read_kernel_source(filename: str) -> str:
    return kernel_path(filename).read_text()


# --- ops with one Triton kernel file and the same math in torch ---------------------------------------

TRITON_BACKENDS = ("auto", "triton", "torch")


def check_triton_backend(filename: str, device) -> None:
    """Unavailable, with the reason, unless ``filename``'s Triton kernels can run on ``device``'s tensors."""
    why = triton_device_problem(device)
    if why:
        raise Unavailable(f"backend 'triton': {why}")
    load_python_kernel(filename)


@functools.lru_cache(maxsize=None)
def _auto_backend(filename: str, device_type: str, interpreted: bool) -> str:
    if device_type != "cuda":
        return "torch"
    try:
        check_triton_backend(filename, torch.device("cuda"))
        return "triton"
    except Unavailable:
        return "torch"


def select_triton_backend(filename: str, backend: str, device) -> str:
    """The backend of an op whose kernels are ``filename`` (one of ``TRITON_BACKENDS``) that runs for
    tensors on ``device``: ``backend`` itself (Unavailable with the reason when it cannot), or for
    ``auto`` Triton on CUDA where it loads, else torch, chosen once per process and device type."""
    device = torch.device(device)
    if not isinstance(backend, str) or backend not in TRITON_BACKENDS:
        raise ChoiceError("backend", backend, TRITON_BACKENDS)
    if backend == "auto":
        return _auto_backend(filename, device.type, triton_interpreted())
    if backend == "triton":
        check_triton_backend(filename, device)
    return backend


def warn_fallback(op: str, wanted: str, chosen: str, device_type: str, why: str) -> None:
    """The warning an op's ``auto`` gives where it falls back from a backend this machine cannot run:
    which, to what, and why (pointing at the code that called the op's ``select_backend``)."""
    warnings.warn(f"{op}: backend 'auto' fell back from {wanted!r} to {chosen!r} on {device_type} tensors: {why}",
                  RuntimeWarning, stacklevel=4)


def constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)``: torch.compile calls ``fn`` once while tracing and
    keeps its answer as a constant. Torch's decorator imports torch._dynamo (about a second) to set
    one attribute on ``fn``; this sets the same attribute, so importing hwlib's ops imports no
    compiler (tests/test_kernels_package.py checks that the attribute is still the one torch sets)."""
    fn._dynamo_marked_constant = True
    return fn


def note_backend(op: str, name: str) -> str:
    """Remember that ``op`` chose backend ``name`` (returned): the ladder records what each of hwlib's
    ops ran, since ``auto`` falls back to torch where a kernel cannot run. Called where an op resolves
    its backend, which torch.compile runs while tracing, so a compiled step notes it too."""
    _USED[op] = name
    return name


def forget_backends() -> None:
    _USED.clear()


def backends_used() -> dict[str, str]:
    """{op: backend} for every hwlib op that resolved a backend since ``forget_backends``."""
    return dict(sorted(_USED.items()))


@constant_result
def resolve_triton_backend(filename: str, backend: str, device_type: str) -> str:
    """``select_triton_backend`` for an op's forward: torch.compile calls it once while tracing and
    keeps its answer as a constant (loading a kernel module is not traceable)."""
    return note_backend(op_name(filename), select_triton_backend(filename, backend, device_type))


def op_name(filename: str) -> str:
    """The op a kernel file serves, as the records name it: the file's stem without the number of the
    step that introduced it and without ``_triton`` (``21_add_layernorm_triton.py``: ``add_layernorm``)."""
    return re.sub(r"^\d+_", "", Path(filename).stem).removesuffix("_triton")
