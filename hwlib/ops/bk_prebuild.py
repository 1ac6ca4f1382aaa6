"""Compile the BK-Core's Triton kernels ahead of use, in background processes.

Triton compiles a kernel on its first launch with each specialization (argument dtypes, each int
argument's class: equal to 1, divisible by 16, other; the constexprs: the chunked forward's plan
from N), and keeps the result in its on-disk cache (``TRITON_CACHE_DIR``, else ``~/.triton/cache``).
A process that launches the same kernels on inputs of the same specialization fills that cache, so
the caller's own first launch loads instead of compiling. Notebook 12 launches about a dozen
specializations, each compiled on first use in its own process, one after another (the chunked
forward's first call, compile included, takes 4-5 s at L = 16 and 7-11 s at L = 32 on an H100 host);
``prebuild`` starts a few worker processes that compile them all at once, longest first, while the
notebook's other cells run.

A background failure never fails the caller: a build that failed, or that no worker has started
when it is needed, is compiled by the caller's own launch, as without a prebuild (``wait`` takes a
build nobody started off the queue, so nothing is compiled twice). Workers exit when the queue is
empty; ``close`` (also run at exit) ends any left.

Worker protocol: one JSON ``Build`` a line on stdin; one ``PREFIX`` + JSON reply a line on stdout;
EOF on stdin ends the worker. ``python -m hwlib.ops.bk_prebuild <device>`` runs one.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..device import Unavailable

from .sources import triton_device_problem, triton_interpreted

PREFIX = "bk_prebuild "      # marks the worker's replies: anything else on its stdout is ignored
KINDS = ("forward", "backward")
MAX_WORKERS = 6              # the longest build, 5 shorter ones beside it: enough on an H100
WAIT_LIMIT_S = 900.0         # a wait gives up after this long (a hung worker must not hang the caller)


def int_class(x: int) -> str:
    """What Triton specializes an int argument on: equal to 1 (a constexpr), else its width and
    whether 16 divides it."""
    if x == 1:
        return "1"
    return ("i32" if -2**31 <= x < 2**31 else "i64") + ("D" if x % 16 == 0 else "")


def stand_in_batch(batch: int) -> int:
    """A batch of the same ``int_class`` as ``batch`` (the kernels' only int argument from B is B
    itself): large batches build on 16 or 17 rows, small ones on themselves."""
    if batch <= 32:
        return batch
    return 16 if batch % 16 == 0 else 17


@dataclass(frozen=True)
class Build:
    """One launch to compile: the triton backend's ``kernel`` ("forward": ``bk_forward`` or, from
    CHUNKED_MIN_CHUNKS chunks on, ``bk_forward_chunked``; "backward": ``bk_backward``) on contiguous
    [batch, n] inputs of ``dtype``. Make them with ``Build.of``: builds are equal when Triton
    compiles them once (``spec``), whatever ``batch`` and ``n`` stand for them."""
    kernel: str
    dtype: str
    batch: int = field(compare=False)
    n: int = field(compare=False)
    spec: tuple = ()

    @classmethod
    def of(cls, kernel: str, dtype, batch: int, n: int) -> "Build":
        """The build of a launch on contiguous [batch, n] inputs. Its ``spec``: the classes of the
        int arguments, B and, from the contiguous strides, N, max(N - 1, 1) (b, c; 1 when empty)
        and 2N (the complex G or grad as floats); for the forward N itself, whose chunk plan
        (constexprs) it decides."""
        if kernel not in KINDS:
            raise ValueError(f"kernel must be one of {KINDS}, got {kernel!r}")
        batch, n = int(batch), int(n)
        ints = tuple(int_class(x) for x in (batch, n, max(n - 1, 1), 2 * n))
        return cls(kernel, str(dtype).removeprefix("torch."), stand_in_batch(batch), n,
                   ints + ((n,) if kernel == "forward" else ()))

    def launch(self) -> dict:
        """What a worker needs to make the launch (JSON)."""
        return {"kernel": self.kernel, "dtype": self.dtype, "batch": self.batch, "n": self.n}

    def chunk_plan(self) -> tuple | None:
        """(L, PP, BS, num_warps) of the chunked forward this build launches; None for the others."""
        from .bk_core import CHUNKED_MIN_CHUNKS, _triton
        tk = _triton()
        if self.kernel != "forward" or self.n < CHUNKED_MIN_CHUNKS * tk.CHUNK:
            return None
        return tk.chunk_plan(self.n)

    def estimate_s(self) -> float:
        """Compile seconds, roughly (H100, notebook 12): the chunked forward unrolls its chunk of L
        positions, ~3-5 s at L = 16 and ~8-10 s at L = 32; the sweeping kernels ~1-2 s. Only
        orders the queue."""
        plan = self.chunk_plan()
        if plan:
            return 5.0 * plan[0] / 16
        return 2.0 if self.kernel == "backward" else 1.0

    def __str__(self) -> str:
        plan = self.chunk_plan()
        how = f" (chunked L={plan[0]} PP={plan[1]} BS={plan[2]})" if plan else ""
        return f"{self.kernel} {self.dtype} B~{self.batch} N={self.n}{how}"


def run_build(build: Build, device) -> None:
    """Launch ``build`` once on ``device`` exactly as the op does (``_forward`` / ``_backward`` on
    fresh contiguous tensors): Triton compiles it, or loads it from its cache."""
    from .bk_core import _backward, _forward
    dev = torch.device(device)
    dt = getattr(torch, build.dtype)
    B, N = build.batch, build.n
    # well-conditioned values (a - z far from 0); the values do not enter the specialization
    a = torch.full((B, N), -2.0, dtype=dt, device=dev)
    b, c = (torch.ones(B, N - 1, dtype=dt, device=dev) for _ in range(2))
    if build.kernel == "forward":
        _forward("triton", a, b, c, 1j)
    else:
        cd = torch.complex64 if dt == torch.float32 else torch.complex128
        _backward("triton", a, b, c, 1j, torch.ones(B, N, dtype=cd, device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)    # a failing launch fails here, in the worker


class Prebuild:
    """The handle of a prebuild: ``wait`` for builds before launching them, ``summary`` of what it
    did, ``wall_s`` (start to last build finished), ``waited_s`` (what the caller's waits cost).
    With no builds (``reason`` says why) every method returns at once."""

    def __init__(self, builds=(), reason: str | None = None):
        # longest first (stable: equal estimates keep the caller's order, which is its order of use)
        self.builds = tuple(sorted(dict.fromkeys(builds), key=lambda b: -b.estimate_s()))
        self.reason = reason
        self.workers = 0
        self.waited_s = 0.0
        self.started = time.perf_counter()
        self._state = {b: "queued" for b in self.builds}   # queued, running, done, failed, claimed
        self._seconds: dict[Build, float] = {}
        self._last_end = self.started              # when a worker last finished a build
        self._error: dict[Build, str] = {}
        self._reported: set[Build] = set()
        self._queue = list(self.builds)
        self._procs: list[subprocess.Popen] = []
        self._alive = 0
        self._cond = threading.Condition()

    # --- the caller's side ---------------------------------------------------------------------

    def wait(self, builds=None, timeout: float = WAIT_LIMIT_S) -> "Prebuild":
        """Return once each of ``builds`` (default: all) is ready to load from the cache, failed, or
        is the caller's to compile: a build no worker has started is taken off the queue (compiling
        it here is no slower than waiting for it), one being compiled is waited for. A failure is
        printed once; after ``timeout`` s it prints what is still running and returns."""
        want = self.builds if builds is None else [b for b in builds if b in self._state]
        t0 = time.perf_counter()
        with self._cond:
            if builds is not None:
                for b in want:
                    if self._state[b] == "queued":
                        self._queue.remove(b)
                        self._state[b] = "claimed"
                self._cond.notify_all()     # builds changed state: wake the other waiters
            busy = lambda: [b for b in want if self._state[b] in ("queued", "running")]  # noqa: E731
            left = self._cond.wait_for(lambda: not busy(), timeout=timeout)
            late = [] if left else busy()
        self.waited_s += time.perf_counter() - t0
        for b in want:
            if self._state[b] == "failed" and b not in self._reported:
                self._reported.add(b)
                print(f"prebuild: {b} failed in the background ({self._error[b]}); it compiles here instead")
        if late:
            print(f"prebuild: still compiling after {timeout:.0f} s: {', '.join(map(str, late))}; "
                  f"going on (a launch of it compiles here)")
        return self

    @property
    def wall_s(self) -> float | None:
        """Seconds from the start to the last build a worker finished (0 where workers finished
        none); None while any is still queued or running."""
        with self._cond:
            if any(s in ("queued", "running") for s in self._state.values()):
                return None
            return self._last_end - self.started

    def counts(self) -> dict[str, int]:
        """How many builds are in each state."""
        out: dict[str, int] = {}
        for s in self._state.values():
            out[s] = out.get(s, 0) + 1
        return out

    def seconds(self) -> dict[str, float]:
        """Each finished build's seconds in its worker (a compile, or a load where the cache had it)."""
        return {str(b): round(s, 2) for b, s in self._seconds.items()}

    def failures(self) -> dict[str, str]:
        return {str(b): e for b, e in self._error.items()}

    def summary(self) -> str:
        """One line: what was built, in how many processes, in what wall time, what the waits cost."""
        if not self.builds:
            return f"prebuild: nothing built in the background ({self.reason})"
        c = self.counts()
        wall = f"{self.wall_s:.1f} s wall" if self.wall_s is not None else "still running"
        parts = [f"{c.get('done', 0)} of {len(self.builds)} Triton kernels built in {self.workers} background "
                 f"processes, {wall}", f"cells waited {self.waited_s:.1f} s for them"]
        if c.get("claimed"):
            parts.append(f"{c['claimed']} compiled in the notebook (needed before a worker was free)")
        if c.get("failed"):
            parts.append(f"{c['failed']} failed (compiled in the notebook): {self.failures()}")
        return "prebuild: " + "; ".join(parts)

    def close(self) -> None:
        """End the workers still running (their builds are left to the caller) and reap them."""
        with self._cond:
            for b in self._queue:
                self._state[b] = "claimed"
            self._queue.clear()
            self._cond.notify_all()
            procs = list(self._procs)
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # --- the workers' side ---------------------------------------------------------------------

    def _start(self, device: str, workers: int, env: dict | None = None) -> "Prebuild":
        """Start ``workers`` processes on ``device`` (``env``: variables set for them on top of this
        process's, which they inherit: Triton's cache directory and mode among them)."""
        root = str(Path(__file__).resolve().parents[2])     # the folder holding hwlib/
        penv = {**os.environ, **(env or {})}
        penv["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [penv.get("PYTHONPATH")] if p])
        self.workers = self._alive = max(1, min(workers, len(self.builds)))
        for _ in range(self.workers):
            err = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-m", "hwlib.ops.bk_prebuild", str(device)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=penv,
                                    text=True, bufsize=1)
            self._procs.append(proc)
            threading.Thread(target=self._serve, args=(proc, err), daemon=True,
                             name="bk-prebuild").start()
        _LIVE.add(self)
        return self

    def _serve(self, proc: subprocess.Popen, err) -> None:
        """Feed one worker the next queued build until the queue is empty or the worker dies."""
        try:
            while (b := self._take()) is not None:
                t0 = time.perf_counter()
                reply = self._ask(proc, b)
                if reply is None:
                    self._finish(b, time.perf_counter() - t0, f"its worker exited ({_tail(proc, err)})")
                    break
                error = None if reply.get("ok") else reply.get("error", "failed")
                self._finish(b, reply.get("s", time.perf_counter() - t0), error)
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            err.close()
            with self._cond:
                self._alive -= 1
                if self._alive == 0:       # no worker left: what is still queued is the caller's
                    for q in self._queue:
                        self._state[q] = "failed"
                        self._error[q] = "no background process left to build it"
                    self._queue.clear()
                self._cond.notify_all()

    def _take(self) -> Build | None:
        with self._cond:
            if not self._queue:
                return None
            b = self._queue.pop(0)
            self._state[b] = "running"
            return b

    @staticmethod
    def _ask(proc: subprocess.Popen, b: Build) -> dict | None:
        """Send ``b`` to the worker and read its reply; None when the worker is gone."""
        try:
            proc.stdin.write(json.dumps(b.launch()) + "\n")
            proc.stdin.flush()
            for line in proc.stdout:
                if line.startswith(PREFIX):
                    return json.loads(line[len(PREFIX):])
        except (OSError, ValueError):
            pass
        return None

    def _finish(self, b: Build, seconds: float, error: str | None) -> None:
        with self._cond:
            self._seconds[b] = seconds
            self._last_end = time.perf_counter()
            self._state[b] = "failed" if error else "done"
            if error:
                self._error[b] = error
            self._cond.notify_all()


def _tail(proc: subprocess.Popen, err, chars: int = 400) -> str:
    """The worker's exit code and the end of its stderr: why a worker died."""
    try:
        proc.wait(timeout=10)
        err.seek(0)
        text = err.read().decode(errors="replace").strip()
    except Exception:   # noqa: BLE001 (a report, never a second failure)
        text = ""
    return f"exit code {proc.returncode}" + (f": ...{text[-chars:]}" if text else "")


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Leave no worker behind when the caller's process ends."""
    for p in list(_LIVE):
        p.close()


def why_not(device) -> str | None:
    """Why nothing can be compiled ahead for ``device`` in this process; None when it can."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"Triton compiles for CUDA tensors only; on {dev.type} there is nothing to compile ahead"
    if triton_interpreted():
        return "TRITON_INTERPRET is set: Triton interprets, nothing compiles"
    why = triton_device_problem(dev)
    if why:
        return why
    try:
        from .bk_core import _triton
        _triton()
    except Unavailable as e:
        return f"Triton is not available: {e}"
    return None


def default_workers() -> int:
    """Worker processes to start: one per core but two, at most MAX_WORKERS, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(MAX_WORKERS, cores - 2))


def prebuild(builds, device, *, workers: int | None = None) -> Prebuild:
    """Start compiling ``builds`` (``Build``s) for ``device`` in background processes, longest
    first; returns the handle at once. A no-op handle (``reason`` says why) where nothing compiles:
    CPU tensors, Triton interpreted or unavailable, no builds."""
    builds = list(builds)
    why = why_not(device) or (None if builds else "no Triton kernel to build")
    if why:
        return Prebuild(reason=why)
    handle = Prebuild(builds)
    return handle._start(str(torch.device(device)), workers or default_workers())


def _worker(device: str) -> None:
    """A worker: build each ``Build`` read from stdin, reply with its seconds or its error."""
    out, sys.stdout = sys.stdout, sys.stderr      # stray prints must not garble the replies
    for line in sys.stdin:
        if not line.strip():
            continue
        t0 = time.perf_counter()
        try:
            run_build(Build.of(**json.loads(line)), device)
            reply = {"ok": True}
        except Exception as e:   # noqa: BLE001 (reported to the caller, who compiles it itself)
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        reply["s"] = time.perf_counter() - t0
        out.write(PREFIX + json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _worker(sys.argv[1] if len(sys.argv) > 1 else "cuda")
