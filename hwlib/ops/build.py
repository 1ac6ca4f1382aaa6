"""The one ``load_inline`` loader for ``kernels/*.cu``.

``.cu`` files are plain CUDA with ``extern "C"`` launchers (CI compiles them with plain nvcc); the
torch binding of each lives as a C++ string next to its Python face in ``hwlib/ops`` and is passed
here. What this module takes care of, because each one has bitten before (notes/pitfalls.md):

* the arch list comes from the device (``TORCH_CUDA_ARCH_LIST=9.0`` on an H100) unless the user set
  one; ``-arch`` in extra flags would be added to torch's default list, not replace it;
* one build folder per checkout, ``$TORCH_EXTENSIONS_DIR`` (default ``<repo>/.torch_extensions``),
  so every notebook of a run reuses the first build (a cold build takes tens of seconds);
* a ``lock`` left by a killed build makes torch wait forever: a lock whose owner process is gone,
  or (owner unknown) older than ``STALE_LOCK_S``, is removed with a warning;
* no implicit torch headers in the CUDA translation unit (they dominate nvcc's time);
* a machine that cannot build (CPU build of torch, no GPU, no nvcc, no ninja, a compile error)
  raises ``hwlib.device.Unavailable`` with the reason, so callers can fall back visibly.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import socket
import threading
import time
import warnings
from pathlib import Path

import torch

from hwlib.device import Unavailable
from hwlib.ops.sources import read_kernel_source
from hwlib.results import REPO_ROOT

STALE_LOCK_S = 300
_OWNER = "hwlib-build.owner"       # "pid host" of the process building in this folder
_MODULES: dict = {}
_BUILD = threading.Lock()


def extensions_dir() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or REPO_ROOT / ".torch_extensions")


def check_available() -> None:
    """Raise Unavailable naming the first thing missing for building and running CUDA kernels."""
    if torch.version.cuda is None:
        raise Unavailable(f"torch {torch.__version__} is a CPU build: it cannot compile or run CUDA kernels")
    if not torch.cuda.is_available():
        raise Unavailable("no CUDA GPU is visible to torch (no device or no driver)")
    from torch.utils import cpp_extension
    home = cpp_extension.CUDA_HOME
    if not home or not any((Path(home) / "bin" / exe).exists() for exe in ("nvcc", "nvcc.exe")):
        raise Unavailable("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    if not cpp_extension.is_ninja_available():
        raise Unavailable("ninja is missing (pip install ninja): load_inline needs it")


def arch_list(device: torch.device | int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def _owner_alive(text: str) -> bool:
    try:
        pid, host = text.split()
        if host != socket.gethostname():
            return True                  # another machine on a shared disk: cannot tell, assume alive
        if int(pid) == os.getpid():
            return False                 # our builds are serialized by _BUILD: this one was interrupted
        os.kill(int(pid), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:              # exists, owned by someone else
        return True
    except (ValueError, OSError):
        return False


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` when no live build holds it. Returns whether it removed one."""
    lock, owner = build_dir / "lock", build_dir / _OWNER
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    try:
        who = owner.read_text()
    except OSError:
        who = None
    stale = (not _owner_alive(who)) if who is not None else age > max_age_s
    if not stale:
        return False
    warnings.warn(f"removing a stale build lock {lock} ({age:.0f} s old, owner {who or 'unknown'} gone): "
                  f"a build was killed midway", RuntimeWarning, stacklevel=3)
    lock.unlink(missing_ok=True)
    owner.unlink(missing_ok=True)
    return True


def load(name: str, binding: str, functions: list[str], *, verbose: bool = False):
    """Build (or reuse) ``kernels/<name>.cu`` with its torch ``binding`` and return the module.

    ``binding`` is C++ that includes its own headers (``torch/extension.h``) and declares the
    ``extern "C"`` launchers it calls; ``functions`` are the names pybind exports."""
    check_available()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch_list())
    source = read_kernel_source(f"{name}.cu")
    arch = os.environ["TORCH_CUDA_ARCH_LIST"]
    digest = hashlib.sha256("\0".join([source, binding, arch, torch.__version__]).encode()).hexdigest()[:12]
    ext = f"hwlib_{name}_{digest}"
    if ext in _MODULES:
        return _MODULES[ext]
    from torch.utils.cpp_extension import load_inline
    build_dir = extensions_dir() / ext
    build_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(name=ext, cpp_sources=[binding], cuda_sources=[source], functions=functions,
                  build_directory=str(build_dir), extra_cuda_cflags=["-O3", "-lineinfo"], verbose=verbose)
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:   # torch >= 2.6
        kwargs["no_implicit_headers"] = True
    with _BUILD:
        clear_stale_lock(build_dir)
        owner = build_dir / _OWNER
        owner.write_text(f"{os.getpid()} {socket.gethostname()}")
        try:
            mod = load_inline(**kwargs)
        except Exception as e:
            msg = str(e).strip().splitlines()
            raise Unavailable(f"building kernels/{name}.cu failed (arch {arch}, folder {build_dir}): "
                              + " | ".join(msg[-6:])) from e
        finally:
            owner.unlink(missing_ok=True)
    _MODULES[ext] = mod
    return mod
