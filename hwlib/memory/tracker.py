"""Allocated and reserved memory, current and peak, per phase of a training step.

    tracker = MemoryTracker(device)
    with tracker.phase("forward"):  loss = model(x, y)
    with tracker.phase("backward"): loss.backward()
    with tracker.phase("optimizer"): opt.step()
    tracker.table()   # per phase: allocated before/after, peak allocated, peak reserved (GiB)

Each phase resets the allocator's peak counters on entry, so its peak is its own; the tracker keeps
the maximum over all phases and calls as the step's peak. On a CPU there are no allocator counters:
every figure is None and ``available`` is False. ``stats`` can be injected (tests, other devices).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Callable

import torch

GiB = 2**30
STAT_KEYS = ("allocated", "reserved", "peak_allocated", "peak_reserved")


def _cuda_stats(device: torch.device) -> dict:
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device)}


def _device(device) -> torch.device:
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device or a name like 'cuda', got {type(device).__name__}")
    return torch.device(device)


def memory_figures(device: torch.device | str) -> dict:
    """Allocated, reserved, free and total memory of a GPU in GiB (what an OOM message shows)."""
    device = _device(device)
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    s = _cuda_stats(device)
    return {"allocated_gib": s["allocated"] / GiB, "reserved_gib": s["reserved"] / GiB,
            "free_gib": free / GiB, "total_gib": total / GiB}


@dataclass
class PhaseRecord:
    phase: str
    allocated_before_gib: float | None
    allocated_after_gib: float | None
    peak_allocated_gib: float | None
    peak_reserved_gib: float | None


class MemoryTracker:
    def __init__(self, device: torch.device | str, stats: Callable[[], dict] | None = None,
                 reset: Callable[[], None] | None = None):
        device = self.device = _device(device)
        for name, f in (("stats", stats), ("reset", reset)):
            if f is not None and not callable(f):
                raise TypeError(f"{name} must be callable or None, got {type(f).__name__}")
        if stats is None and device.type == "cuda":
            stats, reset = (lambda: _cuda_stats(device)), (lambda: torch.cuda.reset_peak_memory_stats(device))
        self._stats, self._reset = stats, reset or (lambda: None)
        self.available = stats is not None
        self.records: list[PhaseRecord] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        if not isinstance(name, str) or not name:
            raise TypeError(f"phase name must be a non-empty str, got {name!r}")
        if not self.available:
            try:
                yield
            finally:
                self.records.append(PhaseRecord(name, None, None, None, None))
            return
        self._reset()
        before = self._read()["allocated"]
        try:
            yield
        finally:
            s = self._read()
            self.records.append(PhaseRecord(name, before / GiB, s["allocated"] / GiB,
                                            s["peak_allocated"] / GiB, s["peak_reserved"] / GiB))

    def _read(self) -> dict:
        s = self._stats()
        missing = [k for k in STAT_KEYS if not isinstance(s, dict) or not isinstance(s.get(k), (int, float))]
        if missing:
            raise ValueError(f"stats() must return a dict of byte counts {', '.join(STAT_KEYS)}; "
                             f"{', '.join(missing)} missing or not a number")
        return s

    def summary(self) -> dict[str, dict]:
        """Per phase, the maximum over all its calls of each figure."""
        out: dict[str, dict] = {}
        for r in self.records:
            d = out.setdefault(r.phase, {k: None for k in asdict(r) if k != "phase"} | {"calls": 0})
            d["calls"] += 1
            for k, v in asdict(r).items():
                if k != "phase" and v is not None:
                    d[k] = v if d[k] is None else max(d[k], v)
        return out

    @property
    def peak_allocated_gib(self) -> float | None:
        vals = [r.peak_allocated_gib for r in self.records if r.peak_allocated_gib is not None]
        return max(vals) if vals else None

    @property
    def peak_reserved_gib(self) -> float | None:
        vals = [r.peak_reserved_gib for r in self.records if r.peak_reserved_gib is not None]
        return max(vals) if vals else None

    def table(self) -> list[dict]:
        return [{"phase": k, **v} for k, v in self.summary().items()]
