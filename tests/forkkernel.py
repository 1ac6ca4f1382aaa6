"""A Jupyter kernel forked from a process that has already imported torch and hwlib: the notebook suites'
kernels (nbval starts one per notebook) start in a fraction of a second instead of re-importing torch.

``make test`` names it with ``--nbval-kernel-name hwlib-fork`` (its spec is ``tests/kernels/hwlib-fork``,
found through ``JUPYTER_PATH``). Each kernel jupyter_client starts runs this file as a small launcher
(``-f <connection file>``): it asks a server, one per environment, to fork a kernel from its warm process,
hands it its standard streams and working directory, forwards every signal it gets to the kernel's process
group (an interrupt, a terminate) and exits with its status; a launcher killed outright (SIGKILL) has its
kernel's group killed by the server. The first launcher starts the server; it ends once no kernel has
run for a minute, or at ``--stop``. The server only serves launchers of the environment it was started
in (the variables decide what an import found: the profile, the run folder, ``PYTHONPATH``); a launcher
of any other environment, or one that cannot reach a server, runs the ordinary kernel in its own process.

Why a fork is safe here: the server imports and never computes (no thread pool is started: the suites run
with ``OMP_NUM_THREADS=1``, and one thread is asserted before each fork), so the child starts as a fresh
kernel would, with its own random state (Python's ``random`` reseeds after a fork; the notebooks seed
torch and numpy themselves).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# What every notebook imports: about 5 s of CPU, once per server instead of once per notebook.
PRELOAD = ("numpy", "torch", "matplotlib", "matplotlib.pyplot", "IPython", "ipykernel.kernelapp", "ipywidgets",
           "hwlib.notebook")
# More modules, comma-separated (torch.compile's stack: torch._dynamo,torch._inductor.compile_fx, 5 s more).
# Dynamo imports triton, and Triton fixes its mode (TRITON_INTERPRET) at its first import, which
# notebook.setup(triton_on_cpu=True) must come before: so either no notebook of the suite runs Triton
# interpreted on a CPU, or TRITON_VAR has the server choose the mode before its imports.
PRELOAD_VAR = "HWLIB_FORK_KERNEL_PRELOAD"
# "1": where torch sees no GPU, the server sets TRITON_INTERPRET=1 before its imports and every kernel it
# forks has it, as notebook.setup(triton_on_cpu=True) would set it (and tests/conftest.py does for the unit
# suites); where a GPU is visible, or TRITON_INTERPRET is set already, it changes nothing.
TRITON_VAR = "HWLIB_FORK_KERNEL_TRITON_ON_CPU"
IDLE_S = 60.0                 # the server ends once no kernel has run for this long
START_TIMEOUT_S = 120.0       # a loaded 2-core machine imports torch slowly (the suites give nbval 240 s)
# What decides what the server's imports found and set up: the interpreter's search path and flags, the
# lab's own variables, and the libraries' thread, compile and backend settings. A launcher whose values
# differ gets a server of its own (or none); the rest of its environment (the shell's, jupyter_client's
# per-kernel variables, pytest's per-test ones) only reaches its kernel, which takes it whole.
KEYED = ("PYTHON", "HWLIB_", "TORCH", "TRITON", "OMP_", "MKL_", "OPENBLAS_", "CUDA", "MPL", "LD_", "JUPYTER_PATH")


def _env_key(env: dict) -> str:
    items = sorted((k, v) for k, v in env.items() if k.startswith(KEYED))
    return hashlib.sha256(json.dumps([sys.executable, items]).encode()).hexdigest()[:16]


def socket_path(env: dict | None = None) -> str:
    """The server's address for this environment (a short path: a Unix socket's is at most 107 bytes)."""
    return os.path.join(tempfile.gettempdir(), f"hwlib-kernel-{_env_key(dict(os.environ if env is None else env))}.sock")


# --- the server -------------------------------------------------------------------------------------

def _child(req: dict, fds: list[int], conns: list[socket.socket], extra_env: dict) -> None:
    """In the forked process: become the kernel the launcher asked for (``extra_env``: what the server
    set before its imports, which they depend on)."""
    for c in conns:   # the server's socket and its connections to other launchers
        c.close()
    for i, fd in enumerate(fds[:3]):
        os.dup2(fd, i)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update(extra_env)
    os.setpgid(0, 0)   # a group of its own, as jupyter_client gives a kernel: signals reach its whole tree
    sys.argv = ["ipykernel_launcher", *req["argv"]]
    code = 0
    try:
        from ipykernel import kernelapp
        kernelapp.launch_new_instance()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:   # no /proc: Python's own threads
        return threading.active_count()


def _no_gpu() -> bool:
    """Whether torch sees no GPU, asked in a forked child where torch was built with one: asking here would
    start CUDA's driver in the server, whose forks could then not use it. A probe that fails: a GPU, maybe."""
    import torch
    if torch.version.cuda is None and torch.version.hip is None:
        return True
    pid = os.fork()
    if pid == 0:
        code = 1
        with contextlib.suppress(BaseException):
            code = 1 if torch.cuda.is_available() else 0
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def serve(path: str) -> None:
    key = _env_key(dict(os.environ))
    # what ipykernel sets before any user code, here before matplotlib reads it at its import
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    extra_env = {}
    if os.environ.get(TRITON_VAR) == "1" and "TRITON_INTERPRET" not in os.environ and _no_gpu():
        extra_env["TRITON_INTERPRET"] = "1"      # before anything below can import triton
        os.environ.update(extra_env)
    extra = [m.strip() for m in os.environ.get(PRELOAD_VAR, "").split(",") if m.strip()]
    for name in (*PRELOAD, *extra):
        with contextlib.suppress(Exception):
            __import__(name)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]   # a kernel does not see tests/
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv.bind(path)
    srv.listen(16)
    kernels: dict[int, socket.socket] = {}
    last = time.monotonic()
    try:
        while True:
            while kernels:                         # reap: each launcher learns its kernel's status
                pid, status = os.waitpid(-1, os.WNOHANG)
                if not pid:
                    break
                conn = kernels.pop(pid, None)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                    conn.close()
                last = time.monotonic()
            if not kernels and time.monotonic() - last > IDLE_S:
                return
            ready, _, _ = select.select([srv, *kernels.values()], [], [], 0.2)
            for pid, c in list(kernels.items()):
                if c in ready and not c.recv(1, socket.MSG_PEEK):   # its launcher is gone (killed outright):
                    with contextlib.suppress(ProcessLookupError):    # its kernel goes with it
                        os.killpg(pid, signal.SIGKILL)
            if srv not in ready:
                continue
            conn, _ = srv.accept()
            conn.settimeout(30)
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                req = json.loads(msg)
            except (OSError, ValueError):
                conn.close()
                continue
            if req.get("stop"):
                conn.close()
                return
            if _env_key(req.get("env", {})) != key or _threads() != 1:
                conn.sendall(b'{"refused": "environment"}\n')
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                _child(req, fds, [srv, conn, *kernels.values()], extra_env)
            with contextlib.suppress(OSError):   # here too, before the launcher can signal the group
                os.setpgid(pid, pid)
            for fd in fds:
                os.close(fd)
            conn.settimeout(None)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            kernels[pid] = conn
            last = time.monotonic()
    finally:
        srv.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# --- the launcher -----------------------------------------------------------------------------------

def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except OSError:
        s.close()
        return None


def _server(path: str) -> socket.socket | None:
    """A connection to this environment's server, started first where none runs (one starter at a time)."""
    conn = _connect(path)
    if conn is not None:
        return conn
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)
        if conn is not None:
            return conn
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path],
                                  start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and server.poll() is None:   # a server that failed: no waiting
            time.sleep(0.1)
            conn = _connect(path)
            if conn is not None:
                return conn
    return None


def _own_kernel(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *argv])


def launch(argv: list[str]) -> None:
    path = socket_path()
    # a Unix socket's address holds at most 107 bytes: under a long TMPDIR, the kernel of this process
    conn = _server(path) if len(os.fsencode(path)) <= 100 else None
    if conn is None:
        _own_kernel(argv)
    req = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "launcher": os.getpid()}
    with conn:
        socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
        f = conn.makefile("rb")
        reply = json.loads(f.readline() or b"{}")
        if "pid" not in reply:
            conn.close()
            _own_kernel(argv)
        pid = reply["pid"]
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda s, _f: _signal(pid, s))
        line = f.readline()
    sys.exit(json.loads(line).get("exit", 1) if line else 1)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def stop(env: dict | None = None) -> None:
    conn = _connect(socket_path(env))
    if conn is not None:
        with conn:
            socket.send_fds(conn, [b'{"stop": true}'], [])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["--stop"]:
        stop()
    else:
        launch(sys.argv[1:])
