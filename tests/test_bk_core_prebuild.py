"""The background prebuild of the BK-Core's Triton kernels (``hwlib.ops.bk_prebuild``, started by
notebook 12 through ``hwlib.studies.bk_core.prebuild_kernels``): a no-op where nothing compiles, a
plan that holds each Triton specialization the notebook launches once, longest first, workers that
launch exactly those specializations (Triton's own specialization of the launch arguments, compared
on CPU under the interpreter), and workers whose failures and exits never reach the caller.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from hwlib import bench
from hwlib.ops import bk_core, bk_prebuild
from hwlib.ops.bk_prebuild import Build, Prebuild
from hwlib.studies import bk_core as bk_study

BENCH_SIZES = [(8192, 2048), (1024, 2048), (8192, 512), (2048, 8192)]   # notebook 12's, full profile


@pytest.mark.gpu   # with a GPU (and Triton compiling) a "cuda" prebuild does start: only "cpu" is a no-op there
def test_the_prebuild_is_a_no_op_where_nothing_compiles(monkeypatch):
    """On CPU (and on a machine without a GPU, or with Triton interpreted) no process starts, every
    wait returns at once, and the record says n/a with the reason."""
    from hwlib.ops.sources import triton_interpreted
    monkeypatch.setattr(Prebuild, "_start", lambda *a, **k: pytest.fail("a prebuild started its workers"))
    compiles = torch.cuda.is_available() and not triton_interpreted()
    for device in ("cpu",) if compiles else ("cpu", "cuda"):
        h = bk_study.prebuild_kernels([(64, 63)], device)
        assert h.builds == () and h.reason and h.workers == 0
        t0 = time.perf_counter()
        assert h.wait() is h and h.wait(bk_study.launch_builds("forward+backward", torch.float32, 64, 63)) is h
        assert time.perf_counter() - t0 < 1 and h.wall_s == 0 and h.counts() == {}
        assert h.summary() == f"prebuild: nothing built in the background ({h.reason})"
        h.close()
        (rec,) = bk_study.prebuild_records(h, notebook="12_bk_core", profile="smoke", device="cpu")
        assert (rec["metric"], rec["value"], rec["status"], rec["reason"]) == ("triton_prebuild_s", None, "n/a", h.reason)
    assert "cpu" in bk_study.prebuild_kernels([(64, 63)], "cpu").reason
    # the study's launches wait on a no-op handle without planning anything
    rows = bk_study.correctness_rows(["torch"], "cpu", prebuilt=h)
    assert rows and all(r["backend"] == "torch" for r in rows)


def test_builds_are_equal_when_triton_compiles_them_once():
    """A batch stands for its class (1, divisible by 16, other); the forward keeps its N (the chunk
    plan's constexprs come from it), the backward only N's classes."""
    f = lambda B, N: Build.of("forward", torch.float32, B, N)   # noqa: E731
    assert f(8192, 2048) == f(1024, 2048) == f(16, 2048) and f(8192, 2048).batch == 16
    assert f(8192, 2048) != f(8190, 2048) and f(8190, 2048).batch == 17
    assert f(1, 17) != f(3, 17) and f(3, 17) == f(5, 17) and f(2048, 2048) != f(2048, 512)
    assert f(3, 17) != Build.of("forward", torch.float64, 3, 17)
    bwd = lambda B, N: Build.of("backward", torch.float32, B, N)   # noqa: E731
    assert bwd(8192, 2048) == bwd(8192, 512) == bwd(2048, 8192)        # the same int classes
    assert bwd(3, 17) != bwd(3, 13) and bwd(3, 1) != bwd(3, 2) != bwd(3, 3)   # N - 1 = 16, 0 and 1: other classes
    with pytest.raises(ValueError, match="kernel must be"):
        Build.of("sideways", torch.float32, 3, 4)


def test_the_plan_holds_what_the_notebook_launches_once_longest_first():
    """For notebook 12's sizes: each (kernel, dtype, N, chunk plan) its cells launch, once, the
    chunked forwards (their unrolled chunks: the longest compiles) first."""
    tk = bk_core._triton()
    plan = bk_study.triton_builds(BENCH_SIZES)
    assert len(plan) == len(set(plan))
    chunked = {(b.dtype, b.n, b.chunk_plan()) for b in plan if b.chunk_plan()}
    assert chunked == {(dt, n, tk.chunk_plan(n)) for dt, n in [("float32", 257), ("float64", 257), ("float32", 2048),
                                                              ("float32", 512), ("float32", 8192)]}
    assert {tk.chunk_plan(n)[0] for n in (257, 512, 2048, 8192)} == {tk.CHUNK}
    plain = {(b.kernel, b.dtype, b.batch, b.n) for b in plan if not b.chunk_plan()}
    assert plain == {("forward", dt, B, n) for dt in ("float32", "float64") for B, n in [(1, 1), (3, 2), (10, 17)]} | {
        ("forward", "float64", 2, 13), ("backward", "float64", 2, 13), ("backward", "float32", 16, 2048)}
    # every launch of the sweep is in the plan: each size and direction, in float32
    for (B, N), d in itertools.product(BENCH_SIZES, bk_study.DIRECTIONS):
        assert set(bk_study.launch_builds(d, torch.float32, B, N)) <= set(plan), (B, N, d)
    order = Prebuild(plan).builds
    # the 5 chunked forwards first, then the sweeping kernels
    assert all(b.chunk_plan() for b in order[:5]) and not any(b.chunk_plan() for b in order[5:])


class _Spy:
    """A Triton kernel that records Triton's own specialization of each launch's arguments (what
    its compile cache is keyed on, beside the source), then launches it where ``launch`` says so.
    The specialization is of the arguments alone: under the interpreter, launches whose results
    nothing checks are left out (the same sets of specializations either way; 51 s of CPU against 32 s
    on a 2-core machine)."""

    def __init__(self, name, kernel, seen, specialize, launch=True):
        self.name, self.kernel, self.seen, self.specialize, self.launch = name, kernel, seen, specialize, launch

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            spec = tuple(self.specialize(x) for x in args)
            self.seen.add((self.name, spec, tuple(sorted(kwargs.items()))))
            if self.launch:
                return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_workers_launch_each_specialization_the_notebook_launches(monkeypatch, triton_device):
    """The notebook's launches (its correctness and gradient cells, and the sweep's timings at
    small sizes standing for the GPU's) against the launches of the builds planned for them, by
    Triton's specialization of the arguments: every launch of the notebook's is one a worker made,
    so it loads from the cache. A batch of 16 stands in for the GPU's 8192 (one class)."""
    try:   # Triton's own specialization of an argument (as its launcher computes it; Triton >= 3.4)
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError as e:
        pytest.skip(f"this Triton has no native_specialize_impl: {e}")
    tk = bk_core._triton()
    seen: set = set()
    spies = [_Spy(name, getattr(tk, name), seen, lambda x: native_specialize_impl(BaseBackend, x, False, True, True))
             for name in ("_bk_forward_kernel", "_bk_forward_chunked_kernel", "_bk_backward_kernel")]
    for spy in spies:
        monkeypatch.setattr(tk, spy.name, spy)

    checked = {spy.name for spy in spies}   # the kernels whose output the caller checks

    def launching(on: bool):   # under the interpreter, only where the caller checks what the kernels computed
        for spy in spies:
            spy.launch = (on and spy.name in checked) or triton_device == "cuda"
    # chunked (N = 4 chunks) on a batch of 16, the class of the GPU's 8192; unchunked (N = 7) on a batch of
    # the other class, odd as its stand-in 17 is. The interpreter's time grows with B x N, and the launches'
    # specializations are of the same classes: 3 took half the CPU seconds of 40 here, and N = 7 launched
    # the same specializations as N = 63 (N, N - 1 and 2N divisible by 16 neither) in a fifth of them
    sizes = [(16, bk_core.CHUNKED_MIN_CHUNKS * tk.CHUNK), (3, 7)]
    waited = []

    class Recorder:          # the handle the cells wait on: each wait must name a planned build
        builds = (None,)

        def wait(self, builds):
            waited.extend(builds)

    # time_backend checks the output of one call after its timed ones against the float64 reference:
    # under the interpreter only that call launches (the timed calls' launches are specialized and
    # recorded all the same; launching them too took twice the CPU seconds)
    time_fn = bench.time_fn

    def untimed_launches(*args, **kwargs):
        launching(False)
        try:
            return time_fn(*args, **kwargs)
        finally:
            launching(True)
    monkeypatch.setattr(bench, "time_fn", untimed_launches)
    launching(False)
    bk_study.correctness_rows(["triton"], triton_device, prebuilt=Recorder())
    bk_study.gradient_rows(["triton"], triton_device, prebuilt=Recorder())
    launching(True)
    # the kernel alone (kernel_only) launches through the same wrappers: one size of it suffices (and the
    # interpreter takes seconds a launch at the larger ones)
    for (B, N), d, alone in itertools.product(sizes, bk_study.DIRECTIONS, (False, True)):
        if not alone or (B, N) == sizes[-1] or triton_device == "cuda":
            # forward+backward checks the three gradients, which the backward computes from a, b, c alone:
            # the forward's G is not checked (the chunked forward took 1.5 CPU-s a launch at (16, 128))
            checked.clear()
            checked.update(s.name for s in spies if d == "forward" or s.name == "_bk_backward_kernel")
            launching(True)
            bk_study.time_backend("triton", B, N, triton_device, direction=d, iters=1, warmup=0, group=1,
                                  kernel_only=alone)
    notebook, _ = set(seen), seen.clear()
    plan = bk_study.triton_builds(sizes)
    assert waited and set(waited) <= set(plan)
    launching(False)
    for b in plan:
        # the interpreter is slow; the correctness cell skips N = 257 too
        if b.n <= sizes[0][1] or triton_device == "cuda":
            bk_prebuild.run_build(b, triton_device)
    assert notebook and notebook <= seen, sorted(notebook - seen)
    assert {s[0] for s in notebook} == {"_bk_forward_kernel", "_bk_forward_chunked_kernel", "_bk_backward_kernel"}


def test_workers_build_report_failures_and_leave_no_process(triton_device, capsys):
    """Real worker processes (under the interpreter here: they launch, nothing compiles): builds
    finish, a failing one is reported once and left to the caller, a build no worker has started is
    the caller's, and the workers exit (or are ended by close) and are reaped."""
    if triton_device != "cpu":
        pytest.skip("drives the workers under Triton's interpreter")
    ok = [Build.of("backward", torch.float64, 2, 4), Build.of("forward", torch.float32, 3, 5)]
    bad = Build.of("forward", torch.float16, 2, 4)        # bk_forward refuses float16: the worker's launch raises
    mine = Build.of("forward", torch.float32, 3, 6)
    h = Prebuild(ok + [bad, mine])._start("cpu", 1, env={"TRITON_INTERPRET": "1"})
    assert h.workers == 1
    h.wait([mine])                                       # queued behind the others: the caller's now
    h.wait()
    assert h.counts() == {"done": 2, "failed": 1, "claimed": 1}, (h.counts(), h.failures())
    assert "TypeError" in h.failures()[str(bad)] and h.wall_s > 0
    out = capsys.readouterr().out
    assert out.count("failed in the background") == 1 and "it compiles here instead" in out
    h.wait([bad])
    assert "failed in the background" not in capsys.readouterr().out      # reported once
    assert all(p.wait(timeout=60) == 0 for p in h._procs)
    s = h.summary()
    assert "2 of 4 Triton kernels built in 1 background processes" in s and "1 failed" in s and "1 compiled in the notebook" in s
    (rec,) = bk_study.prebuild_records(h, notebook="12_bk_core", profile="smoke", device="cpu")
    assert rec["status"] == "ok" and rec["value"] == h.wall_s and rec["params"]["states"] == h.counts()

    h2 = Prebuild([Build.of("forward", torch.float32, 3, 7), Build.of("forward", torch.float32, 3, 8)])._start(
        "cpu", 2, env={"TRITON_INTERPRET": "1"})
    h2.close()                                           # at once, mid-start: ended and reaped
    assert all(p.poll() is not None for p in h2._procs)
    t0 = time.perf_counter()
    h2.wait(timeout=60)
    assert time.perf_counter() - t0 < 60 and h2.wall_s is not None
    assert set(h2.counts()) <= {"done", "failed", "claimed"}


def test_the_sweep_times_nothing_until_the_background_builds_are_done(monkeypatch):
    """A compile beside a timing would compete for the host: the sweep waits for every build first."""
    events = []

    class Handle:
        builds = ()

        def wait(self, builds=None):
            events.append(("wait", builds))
            return self

    real = bk_study.time_backend
    monkeypatch.setattr(bk_study, "time_backend", lambda *a, **k: events.append(("time", a[0])) or real(*a, **k))
    rows = bk_study.speed_rows([(3, 9)], ["torch"], "cpu", prebuilt=Handle())
    assert events == [("wait", None)] + [("time", "torch")] * len(rows) and len(rows) == 2
