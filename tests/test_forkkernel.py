"""The notebook suites' forked kernel (tests/forkkernel.py): a kernel forked from the warm server behaves as
one jupyter_client started itself: it runs in the launcher's directory and environment, an interrupt
reaches it, a shutdown or a killed launcher leaves no process, and another environment gets its own server."""
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import forkkernel  # noqa: E402

pytest.importorskip("jupyter_client")
from jupyter_client.manager import start_new_kernel  # noqa: E402

TESTS = Path(__file__).resolve().parent


def _run(kc, code: str, timeout: float = 120) -> str:
    out = []
    reply = kc.execute_interactive(code, timeout=timeout,
                                   output_hook=lambda m: out.append(m["content"].get("text", "")))
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out).strip()


def _gone(pid: int, within: float = 30.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie of ours (the launcher is jupyter_client's child) counts as gone
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def _own_env(base: Path) -> dict:
    """An environment of its own (so a server of its own), the spec on JUPYTER_PATH; the run folders
    fixed, as the server's key holds them (the autouse fixture gives each test its own). Its server
    preloads triton, in the mode it chooses itself (TRITON_VAR), as the studies' suite has it do."""
    return {"JUPYTER_PATH": str(TESTS), "HWLIB_FORK_TEST": uuid.uuid4().hex, "OMP_NUM_THREADS": "1",
            "HWLIB_OUTPUTS": str(base), "HWLIB_RUN": str(base / "run"), "HWLIB_DATA": str(base / "data"),
            forkkernel.PRELOAD_VAR: "triton.language", forkkernel.TRITON_VAR: "1"}


def _enter(monkeypatch, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # conftest.py's choice: here the server's


@pytest.fixture(scope="module")
def warm_env(tmp_path_factory):
    """One environment for the tests that fork from a real server, so that one server (it imports
    torch: seconds of CPU) forks each of their kernels; it is stopped after the module."""
    env = _own_env(tmp_path_factory.mktemp("fork-warm"))
    yield env
    with pytest.MonkeyPatch.context() as mp:
        _enter(mp, env)
        forkkernel.stop()
        assert _gone_socket(forkkernel.socket_path())


@pytest.fixture
def fork_env(monkeypatch, tmp_path, warm_env):
    """The module's warm environment, run from this test's own folder (a kernel runs in its launcher's)."""
    _enter(monkeypatch, warm_env)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def lone_env(monkeypatch, tmp_path):
    """An environment no server has served; any server started in it is stopped afterwards."""
    _enter(monkeypatch, _own_env(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    forkkernel.stop()
    assert _gone_socket(forkkernel.socket_path())


def _gone_socket(path: str, within: float = 30.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end and os.path.exists(path):
        time.sleep(0.1)
    return not os.path.exists(path)


def test_a_kernel_is_forked_from_the_warm_server_in_the_launchers_place(fork_env):
    km, kc = start_new_kernel(kernel_name="hwlib-fork", cwd=str(fork_env))
    try:
        launcher = km.provisioner.process.pid
        got = _run(kc, "import os, sys; print(os.getpid(), os.getppid(), os.getcwd(), os.environ['HWLIB_FORK_TEST'], "
                       "'torch' in sys.modules, any(p.rstrip('/').endswith('tests') for p in sys.path))")
        pid, ppid, cwd, marker, warm, sees_tests = got.split()
        assert int(pid) != launcher and int(ppid) != launcher     # forked by the server, not started by us
        assert cwd == str(fork_env) and marker == os.environ["HWLIB_FORK_TEST"]
        assert warm == "True" and sees_tests == "False"
        assert os.path.exists(forkkernel.socket_path())
        # Triton was imported by the server, in the mode its kernels are told: interpreted where no GPU is
        # visible, with TRITON_INTERPRET=1 in the kernel's environment (hwlib finds no mismatch), as
        # notebook.setup(triton_on_cpu=True) would have set it; compiled where a GPU is.
        got = _run(kc, "import os, sys, torch, triton.language as tl; from hwlib.ops import sources; "
                       "print('triton' in sys.modules, os.environ.get('TRITON_INTERPRET'), type(tl.zeros).__name__, "
                       "sources.triton_interpreter_mismatch(), sources.interpreted_here('cpu'), "
                       "torch.cuda.is_available(), sep='|')")
        preloaded, var, zeros, mismatch, interpreted, gpu = got.split("|")
        assert preloaded == "True" and mismatch == "None", got
        if gpu == "False":
            assert (var, zeros, interpreted) == ("1", "InterpretedFunction", "True"), got
        else:
            assert var == "None" and zeros != "InterpretedFunction" and interpreted == "False", got
        # an interrupt sent to the launcher (jupyter_client's way) stops a running cell in the kernel
        kc.execute("import time; time.sleep(60)")
        time.sleep(1.0)
        t0 = time.monotonic()
        km.interrupt_kernel()
        msg = kc.get_shell_msg(timeout=30)
        assert msg["content"]["status"] == "error" and msg["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - t0 < 30
    finally:
        km.shutdown_kernel(now=False)
        kc.stop_channels()
    assert _gone(int(pid)) and _gone(launcher)


def test_a_killed_launcher_takes_its_kernel_with_it(fork_env):
    km, kc = start_new_kernel(kernel_name="hwlib-fork", cwd=str(fork_env))
    try:
        pid = int(_run(kc, "import os; print(os.getpid())"))
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        assert _gone(pid), "the kernel outlived its killed launcher"
    finally:
        kc.stop_channels()
        km.cleanup_resources()


def test_each_environment_has_its_own_server_and_the_shells_variables_do_not_count():
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/a", "HWLIB_RUN": "outputs/x", "SHLVL": "1", "_": "/usr/bin/env"}
    same = {**base, "SHLVL": "2", "_": "/bin/sh", "JPY_PARENT_PID": "7", "PYTEST_CURRENT_TEST": "t (call)"}
    assert forkkernel.socket_path(base) == forkkernel.socket_path(same)
    for k, v in (("PYTHONPATH", "/b"), ("HWLIB_RUN", "outputs/y"), ("TRITON_INTERPRET", "1"),
                 ("OMP_NUM_THREADS", "2"), (forkkernel.PRELOAD_VAR, "torch._dynamo"), (forkkernel.TRITON_VAR, "1")):
        assert forkkernel.socket_path({**base, k: v}) != forkkernel.socket_path(base), k


def test_the_server_asks_cuda_in_a_child_and_takes_a_failed_probe_for_a_gpu(monkeypatch):
    """Where torch was built with CUDA, whether a GPU is visible (TRITON_VAR's choice) is asked in a forked
    child, never in the server; a probe that fails counts as a GPU, where nothing is set."""
    import torch
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked in the server"))
    assert forkkernel._no_gpu()                                   # a CPU-only build: no probe at all
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    server = os.getpid()
    for visible, no_gpu in ((False, True), (True, False), (None, False)):
        def probe(visible=visible):
            assert os.getpid() != server
            if visible is None:
                raise RuntimeError("the driver failed")
            return visible
        monkeypatch.setattr(torch.cuda, "is_available", probe)
        assert forkkernel._no_gpu() is no_gpu, visible


def test_the_suites_use_it():
    """make test's notebook suites name the forked kernel, and both preload torch.compile's stack (the
    studies' with Triton's mode chosen first)."""
    text = (TESTS.parent / "Makefile").read_text()
    assert "--nbval-kernel-name hwlib-fork" in text and "tests/forkkernel.py --stop" in text
    assert text.count(f"{forkkernel.PRELOAD_VAR}=torch._dynamo") == 2
    assert f"{forkkernel.TRITON_VAR}=1" in text
    assert (TESTS / "kernels" / "hwlib-fork" / "kernel.json").is_file()


def test_a_launcher_whose_server_cannot_start_runs_its_own_kernel(lone_env, monkeypatch):
    """A server that dies at its start costs no wait, and under a temporary folder too long for a socket's
    address no server is tried: the launcher runs the ordinary kernel in its own process, which works."""
    real = forkkernel.subprocess.Popen

    def broken(cmd, **kw):
        return real([sys.executable, "-c", "raise SystemExit(3)"], **kw)
    monkeypatch.setattr(forkkernel.subprocess, "Popen", broken)
    t0 = time.monotonic()
    assert forkkernel._server(forkkernel.socket_path()) is None
    assert time.monotonic() - t0 < 20, "the launcher waited for a server that had died"
    # a long temporary folder: no socket can be made there, and the kernel is the launcher's own
    long = lone_env / ("x" * 120)
    long.mkdir()
    monkeypatch.setenv("TMPDIR", str(long))
    monkeypatch.setattr(forkkernel.tempfile, "tempdir", None)   # read again here, and restored after
    km, kc = start_new_kernel(kernel_name="hwlib-fork", cwd=str(lone_env))
    try:
        launcher = km.provisioner.process.pid
        pid = int(_run(kc, "import os; print(os.getpid())"))
        assert pid == launcher   # exec'd in place: the ordinary kernel
    finally:
        km.shutdown_kernel(now=False)
        kc.stop_channels()
