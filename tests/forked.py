"""A function run in a child forked from the test process, its output captured, with a time limit.

Several checks need a process without some of this one's state (Triton imported with its interpreter on,
hwlib's modules already loaded). A fresh Python importing torch again cost about 4-5 s of CPU per call on
a 2-core machine; a fork keeps torch and drops only what the check must not see. ``can_fork`` says where
that is safe; elsewhere the callers start a fresh Python.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback


def can_fork() -> bool:
    """Whether forking this process is safe: Linux, and CUDA not initialised here."""
    import torch
    return hasattr(os, "fork") and sys.platform == "linux" and not torch.cuda.is_initialized()


def run_forked(child, timeout_s: float) -> tuple[int, str]:
    """(exit code, stdout and stderr) of ``child()`` run in a forked child: 0 when it returns, 1 with the
    traceback when it raises, 124 when it runs past ``timeout_s`` (then it is killed)."""
    out = tempfile.TemporaryFile(mode="w+")
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        code = 1
        try:
            os.dup2(out.fileno(), 1)   # what the child's own processes write too
            os.dup2(out.fileno(), 2)
            sys.stdout = sys.stderr = out   # not pytest's capture, which the parent reads
            child()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline, status = time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            time.sleep(0.02)
    finally:
        if status is None:   # past its time, or this process interrupted: the child goes too
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    out.seek(0)
    text = out.read()
    out.close()
    if status is None:
        return 124, text + f"\n(killed after {timeout_s:g} s)"
    return os.waitstatus_to_exitcode(status), text
