"""torch.profiler traces: recording one, reading its events back, and the interval arithmetic that
turns kernel (or operator) events into busy time.

A Chrome trace holds complete events (``ph == 'X'``) with a start ``ts`` and a duration ``dur`` in
microseconds. On a GPU the device's work is the events of ``GPU_CATEGORIES`` (kernels, copies,
memsets); on a CPU it is the operators (``cpu_op``), which nest: an operator's own time is its
duration minus its children's (``exclusive``).

Every profiled study (the exposed communication of ``hwlib.distributed.comm``, the breakdown of a
step in ``hwlib.studies.breakdown``) records and reads its trace here.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# --- interval arithmetic (pure) -----------------------------------------------------------------------

def union(intervals) -> list[tuple[float, float]]:
    """Disjoint, sorted cover of ``(start, end)`` intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def intersection_length(a, b) -> float:
    """Total length covered by both interval sets."""
    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


# --- events ---------------------------------------------------------------------------------------------

def complete_events(events: list[dict]) -> list[dict]:
    """The complete events (``ph == 'X'``) that carry a numeric start and duration."""
    return [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("dur"), (int, float))]


def device_events(events: list[dict]) -> list[dict]:
    """Kernels, copies and memsets: what ran on the GPU."""
    return [e for e in complete_events(events) if e.get("cat") in GPU_CATEGORIES]


def exclusive(events: list[dict]) -> list[tuple[dict, float]]:
    """Each event with its own time (its duration minus that of the events nested directly inside
    it on the same thread), so that summing own times never counts a nested operator twice."""
    out = []
    by_tid: dict = {}
    for e in complete_events(events):
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        own = [float(e["dur"]) for e in evs]
        stack: list[int] = []   # indices of the open events enclosing the current one
        for i, e in enumerate(evs):
            while stack and evs[stack[-1]]["ts"] + evs[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]] -= e["dur"]
            stack.append(i)
        out += [(e, max(0.0, t)) for e, t in zip(evs, own)]
    return out


def read_trace(path: str | os.PathLike) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def record(fn, device: torch.device, trace_path: str | os.PathLike, keep_trace: bool = False
           ) -> tuple[list[dict] | None, str | None]:
    """Run ``fn()`` once under torch.profiler (the GPU's kernels on a GPU, the operators on a CPU)
    and return (the trace's events, None), or (None, why) when the profiler could not record or the
    trace could not be read: ``fn`` runs exactly once either way, since a caller may be one rank of
    several that run the same steps together."""
    from torch.profiler import ProfilerActivity, profile   # heavy: only when a trace is asked for
    # On a GPU only the device's kernels are read: the host's operators would multiply the trace.
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    if device.type == "cuda":
        torch.cuda.synchronize(device)   # nothing queued before the window is recorded in it
    try:
        prof = profile(activities=acts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the profiler's own start-up notes are not the caller's
            prof.__enter__()
    except Exception as e:   # no profiler here: the work still runs, unprofiled
        prof, why = None, f"the profiler did not start: {type(e).__name__}: {e}"
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if prof is None:
        return None, why
    trace_path = Path(trace_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.__exit__(None, None, None)
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        events = read_trace(trace_path)
    except Exception as e:   # a trace that cannot be written or read costs the breakdown, not the run
        return None, f"the profiler's trace could not be read: {type(e).__name__}: {e}"
    finally:
        if not keep_trace:
            trace_path.unlink(missing_ok=True)
    if device.type == "cuda" and not device_events(events):
        return None, "the profiler recorded no GPU kernels (CUPTI unavailable?)"
    return events, None
