"""The one way to time things in hwlib.

* ``time_fn`` times a callable (a kernel, a matmul, a copy): warm-up calls first, then each call
  (or group of calls) timed on its own, so that the spread (p20/p80) is real and not an average of
  averages, with no synchronisation between samples.
* ``StepClock`` times training steps in a loop the caller drives: one CUDA event at every step
  boundary, no synchronisation inside the loop (a sync per step would stall the CPU that queues the
  next step and make eager code look slower than it is), read once at the end.

On a GPU the clock is CUDA events (device time of the work queued between two events); on CPU it
is ``time.perf_counter``. Only GPU numbers are meaningful as absolute times.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .noise import quantile  # noqa: F401  (the one quantile; bench.quantile for callers)


@dataclass
class Timing:
    """Milliseconds per call: median and the 20th/80th percentiles of ``n`` timed calls."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    n: int
    samples_ms: list[float] = field(default_factory=list, repr=False)

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> "Timing":
        if not samples_ms:
            raise ValueError("samples_ms: need at least one timed sample")
        bad = [s for s in samples_ms if not math.isfinite(s) or s < 0]
        if bad:
            raise ValueError(f"samples_ms: {len(bad)} samples are negative or not finite: {bad[:3]}")
        return cls(median_ms=statistics.median(samples_ms), p20_ms=quantile(samples_ms, 0.2),
                   p80_ms=quantile(samples_ms, 0.8), n=len(samples_ms), samples_ms=list(samples_ms))

    def to_dict(self, samples: bool = False) -> dict:
        d = asdict(self)
        if not samples:
            d.pop("samples_ms")
        return d


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Marks step boundaries; ``timing()`` returns per-step times after one final sync."""

    def __init__(self, device: torch.device):
        self.device = device
        self._marks: list = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())

    def last_step(self) -> tuple | None:
        """The two marks around the step just queued (CUDA events or perf_counter times), read
        without a sync: a live monitor times them once the GPU has passed them. None before two marks."""
        return tuple(self._marks[-2:]) if len(self._marks) >= 2 else None

    def samples_ms(self) -> list[float]:
        if len(self._marks) < 2:
            raise ValueError("StepClock: mark() at least twice (before the first and after the last step)")
        synchronize(self.device)
        if self.device.type == "cuda":
            return [a.elapsed_time(b) for a, b in zip(self._marks, self._marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self._marks, self._marks[1:])]

    def timing(self) -> Timing:
        return Timing.from_samples(self.samples_ms())


def time_fn(fn: Callable[[int], object], device: torch.device, *, warmup: int = 3, iters: int = 20,
            group: int = 1, cuda_graph: bool = False) -> Timing:
    """Time ``fn(i)`` per call. ``fn`` gets the call index so it can rotate among input sets
    larger than L2 (otherwise repeated calls measure the cache, not memory). Each sample runs
    ``group`` calls back to back and is their mean: a kernel of tens of microseconds timed one call
    per sample would time the launch as much as the kernel.

    On a GPU every sample is queued between its own two events and nothing synchronises until the
    last one: the host queues the next sample while the device runs this one, so a sample starts
    on a busy device. A sync after each sample would leave the device idle when the next start
    event is recorded, and every sample would then also time the launch of its first call and the
    device's start from idle (on an H100, the kernel studies' rows of 0.05-0.25 ms read 2-11% slower
    that way, timed in groups of 4 to 20 calls). The first sample starts on an idle device all the
    same; one sample of ``iters`` moves the median by one rank at most.

    ``cuda_graph`` (GPU only): the ``group`` calls of one sample are captured once into a CUDA graph after
    the warm-up, and every sample replays it. A kernel shorter than its host-side launch (a Triton
    launch from Python, tens of microseconds) is otherwise timed at the rate the host queues it, not the
    rate the GPU runs it: on an H100, the fused LayerNorm's forward with a bf16 stream took 50.8 us a
    launch timed from Python and 35.2 us in a profile of the same launches. ``fn`` must then be
    capturable: no host sync, the same inputs on every replay (the calls' indices are fixed at capture)."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph replays CUDA graphs: device must be a CUDA device, got {device}")

    def run(k: int) -> None:
        for j in range(group):
            fn(k * group + j)
    for k in range(warmup):
        run(k)
    synchronize(device)
    if device.type == "cuda":
        if cuda_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(warmup)
            synchronize(device)
        events = []
        for i in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if cuda_graph:
                graph.replay()
            else:
                run(warmup + i)
            end.record()
            events.append((start, end))
        synchronize(device)
        return Timing.from_samples([start.elapsed_time(end) / group for start, end in events])
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        run(warmup + i)
        samples.append((time.perf_counter() - t0) * 1e3 / group)
    return Timing.from_samples(samples)


def wall_s(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Wall-clock seconds of one call including everything it waits for (compilation, first-call
    set-up): what a user waits, kept apart from steady-state step time."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out
