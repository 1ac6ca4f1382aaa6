"""The one ``load_inline`` loader for ``kernels/*.cu``.

``.cu`` files are plain CUDA with ``extern "C"`` launchers declared in a header beside them (CI
compiles them with plain nvcc); the torch binding of each lives as a C++ string next to its Python
face in ``hwlib/ops`` and is passed here. What this module takes care of, because each one has
bitten before (docs/architecture.md, Known traps):

* the arch list comes from the device (``TORCH_CUDA_ARCH_LIST=9.0`` on an H100) unless the user set
  one; ``-arch`` in extra flags would be added to torch's default list, not replace it;
* one build folder per checkout, ``$TORCH_EXTENSIONS_DIR`` (default ``<repo>/.torch_extensions``),
  so every notebook of a run reuses the first build (a cold build takes tens of seconds); the
  folder's name digests the sources, the headers they include, the binding, the arch and torch;
* one builder per folder across processes and hosts: the builder creates ``hwlib-build.owner``
  once, atomically, holding "pid host", and refreshes its time while it builds; others wait, and
  while waiting clear an owner that is gone (a dead pid on this host, or on another host no
  refresh for ``STALE_LOCK_S``) together with torch's own ``lock`` it left behind. The wait is
  bounded (``HWLIB_BUILD_WAIT_S``, default ``BUILD_WAIT_S``) and ends in ``BuildLockTimeout``
  naming the lock and how to clear it: torch's own wait on its ``lock`` would never end;
* no implicit torch headers in the CUDA translation unit (they dominate nvcc's time);
* a machine that cannot build (CPU build of torch, no GPU, no nvcc, no ninja, a compile error)
  raises ``hwlib.device.Unavailable`` with the reason, so callers can fall back visibly.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import re
import socket
import threading
import time
import warnings
from pathlib import Path

import torch

from hwlib.device import Unavailable
from hwlib.ops.sources import kernels_dir, read_kernel_source
from hwlib.paths import REPO_ROOT

STALE_LOCK_S = 300       # an owner on another host that has not refreshed its lock for this long is gone
BUILD_WAIT_S = 600.0     # how long a process waits for another's build before giving up
_OWNER = "hwlib-build.owner"       # "pid host" of the process building in this folder
_MODULES: dict = {}
_BUILD = threading.Lock()


class BuildLockTimeout(Unavailable):
    """Another process held a build folder's lock for longer than the wait allowed."""


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


def build_wait_s(wait_s: float | None = None) -> float:
    """How long to wait for another process's build: ``wait_s``, else ``$HWLIB_BUILD_WAIT_S``, else
    ``BUILD_WAIT_S``; a non-number, negative or NaN is a ValueError naming where it came from."""
    source = "wait_s"
    if wait_s is None:
        env = os.environ.get("HWLIB_BUILD_WAIT_S")
        if env is None or not env.strip():
            return BUILD_WAIT_S
        source, wait_s = "HWLIB_BUILD_WAIT_S", env
    try:
        value = float(wait_s)
    except (TypeError, ValueError):
        value = math.nan
    if not value >= 0:                   # also NaN
        raise ValueError(f"{source}={wait_s!r}: give the seconds to wait for another build, a number >= 0 "
                         f"(inf waits for ever)")
    return value


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:              # exists, owned by someone else
        return True
    except OSError:
        return False


def owner_state(build_dir: Path, stale_s: float = STALE_LOCK_S) -> tuple[str | None, str | None]:
    """(who holds ``build_dir``'s build lock, why it is stale): (None, None) when nobody holds it;
    ``why`` is None while the holder may still be building."""
    owner = Path(build_dir) / _OWNER
    try:
        who = owner.read_text().strip()
        age = time.time() - owner.stat().st_mtime
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return f"unreadable ({e})", None
    parts = who.split()
    if len(parts) == 2 and parts[0].isdigit() and parts[1] == socket.gethostname():
        pid = int(parts[0])
        if pid == os.getpid():           # our builds are serialized by _BUILD: this one was interrupted
            return who, "this process, which is not building: an interrupted build"
        return who, None if _pid_alive(pid) else f"process {pid} on this host is gone"
    if age > stale_s:                    # another host (or unknown): its builder refreshes the file
        return who or "unknown", f"not refreshed for {age:.0f} s (> {stale_s:.0f} s)"
    return who or "unknown", None


def clear_stale_lock(build_dir: Path, stale_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir``'s owner file when its holder is gone (see ``owner_state``); returns whether
    it removed one. Only the file it judged is removed, never one a new builder just created."""
    owner = Path(build_dir) / _OWNER
    who, why = owner_state(build_dir, stale_s)
    if why is None:
        return False
    try:
        judged = owner.stat()
        grabbed = owner.with_name(f".{_OWNER}.stale.{os.getpid()}.{threading.get_ident()}")
        os.rename(owner, grabbed)
    except FileNotFoundError:
        return False                     # someone else cleared it first
    now = grabbed.stat()
    if (now.st_ino, now.st_dev) != (judged.st_ino, judged.st_dev):   # replaced between the two looks
        try:
            os.link(grabbed, owner)
        except FileExistsError:
            pass
        grabbed.unlink(missing_ok=True)
        return False
    grabbed.unlink(missing_ok=True)
    warnings.warn(f"removed a stale build lock {owner} (owner {who}: {why}): a build was killed midway",
                  RuntimeWarning, stacklevel=3)
    return True


def _create_owner(owner: Path) -> bool:
    """Create ``owner`` holding "pid host", complete or not at all; False when it exists already."""
    tmp = owner.with_name(f".{_OWNER}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(f"{os.getpid()} {socket.gethostname()}")
    try:
        os.link(tmp, owner)              # atomic, and fails when another process holds the lock
        return True
    except FileExistsError:
        return False
    except OSError:                      # a file system without hard links: exclusive create, one write
        try:
            fd = os.open(owner, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(tmp.read_text())
        return True
    finally:
        tmp.unlink(missing_ok=True)


def acquire_build_lock(build_dir: Path, *, wait_s: float | None = None, stale_s: float = STALE_LOCK_S,
                       poll_s: float = 0.5) -> Path:
    """Become the one builder in ``build_dir``: returns the owner file, which the caller removes.

    Waits while a live process holds it, re-checking on every poll whether the holder is gone; raises
    BuildLockTimeout after ``build_wait_s(wait_s)`` seconds. Torch's own ``lock`` found by a new
    owner was left by a killed build (every builder here holds the owner file first) and is removed."""
    build_dir = Path(build_dir)
    owner, limit = build_dir / _OWNER, build_wait_s(wait_s)
    t0 = time.monotonic()
    while not _create_owner(owner):
        if clear_stale_lock(build_dir, stale_s):
            continue
        waited = time.monotonic() - t0
        if waited >= limit:
            who, _ = owner_state(build_dir, stale_s)
            raise BuildLockTimeout(
                f"waited {waited:.0f} s for the build lock {owner} (held by {who or 'nobody now'}): another "
                f"process is building {build_dir.name}, or hangs doing so. If no build is running, delete "
                f"{owner} and {build_dir / 'lock'}; to wait longer, set HWLIB_BUILD_WAIT_S (seconds)")
        time.sleep(min(poll_s, max(limit - waited, 0.01)))
    torch_lock = build_dir / "lock"
    if torch_lock.exists():
        warnings.warn(f"removed torch's build lock {torch_lock}, left by a build killed midway",
                      RuntimeWarning, stacklevel=2)
        torch_lock.unlink(missing_ok=True)
    return owner


class _Heartbeat:
    """Refreshes the owner file's time while a build runs, so waiters on other hosts can tell a
    long build from a dead one."""

    def __init__(self, owner: Path, every_s: float):
        self.owner, self.every_s, self.stop = owner, every_s, threading.Event()
        self.thread = threading.Thread(target=self._run, name="hwlib-build-heartbeat", daemon=True)

    def _run(self):
        while not self.stop.wait(self.every_s):
            try:
                os.utime(self.owner)
            except OSError:
                return

    def __enter__(self):
        self.ident = self.owner.stat().st_ino
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        try:
            if self.owner.stat().st_ino == self.ident:     # still ours: release it
                self.owner.unlink()
        except FileNotFoundError:
            pass


def _includes(text: str) -> dict[str, str]:
    """The kernel-folder headers ``text`` includes with quotes, by name, with their text."""
    return {h: read_kernel_source(h) for h in sorted(set(re.findall(r'#include\s+"([^"]+)"', text)))}


def load(name: str, binding: str, functions: list[str], *, verbose: bool = False, wait_s: float | None = None,
         host: bool = False, libraries: tuple[str, ...] = ()):
    """Build (or reuse) ``kernels/<name>.cu`` with its torch ``binding`` and return the module.

    ``binding`` is C++ that includes its own headers (``torch/extension.h``, and the kernel's header
    with quotes: it is found in the kernel folder); ``functions`` are the names pybind exports.
    ``wait_s`` bounds the wait for another process's build of the same sources (``build_wait_s``).
    ``host``: the source is ``<name>.cpp``, host C++ against the CUDA toolkit (calls into a CUDA
    library, no device code), compiled with the binding by the host compiler. ``libraries``: CUDA
    libraries to link (``cublasLt``), from the toolkit's library folder."""
    check_available()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch_list())
    source = read_kernel_source(f"{name}.cpp" if host else f"{name}.cu")
    headers = _includes(source + binding)
    arch = os.environ["TORCH_CUDA_ARCH_LIST"]
    parts = [source, binding, *(f"{h}\0{t}" for h, t in headers.items()), arch, torch.__version__, *libraries]
    ext = f"hwlib_{name}_{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:12]}"
    if ext in _MODULES:
        return _MODULES[ext]
    from torch.utils.cpp_extension import load_inline
    build_dir = extensions_dir() / ext
    build_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(name=ext, cpp_sources=[binding, source] if host else [binding],
                  cuda_sources=[] if host else [source], functions=functions, with_cuda=True,
                  build_directory=str(build_dir), extra_include_paths=[str(kernels_dir())],
                  extra_cuda_cflags=["-O3", "-lineinfo"],
                  extra_ldflags=[f"-l{lib}" for lib in libraries], verbose=verbose)
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:   # torch >= 2.6
        kwargs["no_implicit_headers"] = True
    with _BUILD, _Heartbeat(acquire_build_lock(build_dir, wait_s=wait_s), STALE_LOCK_S / 10):
        try:
            mod = load_inline(**kwargs)
        except Exception as e:
            msg = str(e).strip().splitlines()
            raise Unavailable(f"building kernels/{name}.{'cpp' if host else 'cu'} failed (arch {arch}, folder {build_dir}): "
                              + " | ".join(msg[-6:])) from e
    _MODULES[ext] = mod
    return mod
