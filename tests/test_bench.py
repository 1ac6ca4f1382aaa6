import math
import time

import numpy as np
import pytest
import torch

from hwlib import bench


def test_quantile_matches_numpy():
    rng = np.random.default_rng(1)
    xs = rng.random(37).tolist()
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert bench.quantile(xs, q) == pytest.approx(np.quantile(xs, q))


def test_timing_from_samples():
    t = bench.Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median_ms, t.p20_ms, t.p80_ms, t.n) == (3.0, 1.8, 4.2, 5)
    assert "samples_ms" not in t.to_dict() and t.to_dict(samples=True)["samples_ms"] == [5.0, 1.0, 3.0, 2.0, 4.0]


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, -2.0], [math.inf]])
def test_timing_rejects_bad_samples(bad):
    with pytest.raises(ValueError, match="samples_ms"):
        bench.Timing.from_samples(bad)


def test_step_clock_measures_each_step():
    clock = bench.StepClock(torch.device("cpu"))
    clock.mark()
    for d in (0.02, 0.05, 0.01):
        time.sleep(d)
        clock.mark()
    s = clock.samples_ms()
    assert len(s) == 3
    assert s[0] >= 19 and s[1] >= 49 and s[2] >= 9
    assert s[1] > s[0] > s[2]   # ordered as the sleeps: each step timed on its own


def test_step_clock_needs_two_marks():
    clock = bench.StepClock(torch.device("cpu"))
    clock.mark()
    with pytest.raises(ValueError, match="mark"):
        clock.timing()


def test_time_fn_warms_up_and_passes_rotating_index():
    seen = []
    t = bench.time_fn(lambda i: seen.append(i), torch.device("cpu"), warmup=2, iters=5)
    assert seen == list(range(7)) and t.n == 5
    with pytest.raises(ValueError, match="iters"):
        bench.time_fn(lambda i: None, torch.device("cpu"), iters=0)


def test_time_fn_groups_calls_into_one_sample_of_their_mean():
    seen = []

    def nap(i):
        seen.append(i)
        time.sleep(0.01)
    t = bench.time_fn(nap, torch.device("cpu"), warmup=1, iters=3, group=4)
    assert seen == list(range(16)) and t.n == 3        # 4 groups of 4 calls, indices never repeated
    assert all(9.5 <= s < 30 for s in t.samples_ms), t.samples_ms   # per call, not per group of four
    with pytest.raises(ValueError, match="group"):
        bench.time_fn(nap, torch.device("cpu"), group=0)


def _fake_device_clock(monkeypatch) -> list:
    """CUDA events and synchronize replaced by a log: each queued operation is one tick of the device's
    clock, so (end - start) counts what a sample queued. Returns the log."""
    log = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            log.append("event")
            self.t = len(log)

        def elapsed_time(self, end):
            return float(end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    return log


def test_time_fn_on_a_gpu_queues_every_sample_before_one_sync(monkeypatch):
    """A sync between samples leaves the device idle when the next start event is recorded, so each
    sample would also time its first launch: the samples must all be queued before the one sync."""
    log = _fake_device_clock(monkeypatch)
    t = bench.time_fn(lambda i: log.append(i), torch.device("cuda"), warmup=1, iters=3, group=2)
    assert log == [0, 1, "sync", "event", 2, 3, "event", "event", 4, 5, "event", "event", 6, 7, "event", "sync"]
    assert t.samples_ms == [1.5, 1.5, 1.5]   # (end - start) / group: three ticks over two calls


def test_time_fn_with_a_cuda_graph_captures_one_group_and_replays_it(monkeypatch):
    """cuda_graph: after the warm-up one group of calls is captured, and each sample replays that graph
    between its events (no call runs again from the host); on a CPU device it is refused by name."""
    log = _fake_device_clock(monkeypatch)

    class FakeGraph:
        def replay(self):
            log.append("replay")

    class FakeCapture:
        def __init__(self, graph):
            pass

        def __enter__(self):
            log.append("capture")

        def __exit__(self, *exc):
            log.append("captured")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    t = bench.time_fn(lambda i: log.append(i), torch.device("cuda"), warmup=1, iters=2, group=2, cuda_graph=True)
    assert log == [0, 1, "sync", "capture", 2, 3, "captured", "sync",
                   "event", "replay", "event", "event", "replay", "event", "sync"]
    assert t.samples_ms == [1.0, 1.0]     # (end - start) / group: two ticks over two calls
    with pytest.raises(ValueError, match="cuda_graph .* device must be a CUDA device"):
        bench.time_fn(lambda i: None, torch.device("cpu"), cuda_graph=True)


def test_wall_s_includes_the_call():
    s, out = bench.wall_s(lambda: time.sleep(0.03) or 7, torch.device("cpu"))
    assert s >= 0.029 and out == 7
