"""Batch-size finder that counts everything a training step holds.

Each trial runs full steps (forward, backward and the optimizer step, under the step's autocast
and compile settings), so weights, gradients, optimizer states and activations are all in the
measured peak; the peak is the allocator's *reserved* peak, what it had to take from the device.
Batches double from ``start`` until one does not fit within the budget (capacity minus the margin)
or runs out of memory; a straight line peak(b) = a + c b through the fitting trials predicts the
largest batch within the budget; that batch is run and its peak measured, and it is stepped down
until it fits. The result reports the batch, the margin kept, the predicted and the measured peak,
and the allocator settings it measured under: under the default allocator a reserved peak depends on
the order of allocations (``hwlib.memory.allocator``), so a later run at the same batch can reserve
less than predicted; with expandable segments reserved tracks allocated and the prediction holds.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field
from typing import Callable

import torch

from .checks import finite_number, positive_int

GiB = 2**30


@dataclass
class FinderResult:
    batch: int
    predicted_peak_gib: float
    measured_peak_gib: float
    capacity_gib: float
    margin: float
    budget_gib: float
    fit: tuple[float, float]            # (a, c): peak = a + c * batch, GiB
    trials: list[dict] = field(default_factory=list)
    allocator: str | None = None        # allocator settings in force ('' = defaults; None = not measured on CUDA)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    if len(points) == 1:
        b, p = points[0]
        return 0.0, p / b   # one point: assume all memory scales with the batch (pessimistic)
    pts = points[-3:]        # the largest trials: fixed costs are amortised, the slope is clean
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mp = sum(p for _, p in pts) / n
    c = sum((b - mb) * (p - mp) for b, p in pts) / max(1e-12, sum((b - mb) ** 2 for b, _ in pts))
    return mp - c * mb, c


def _peak(try_batch: Callable, b: int) -> float | None:
    """``try_batch(b)``, checked: None (out of memory) or a finite peak >= 0 GiB."""
    p = try_batch(b)
    if p is None:
        return None
    return finite_number(f"try_batch({b}) (peak GiB, or None for out of memory)", p, low=0.0)


def search_batch(try_batch: Callable[[int], float | None], capacity_gib: float, *, margin: float = 0.1,
                 start: int = 1, max_batch: int = 4096) -> FinderResult:
    """The search itself: ``try_batch(b)`` returns the measured peak in GiB, or None on OOM."""
    if not callable(try_batch):
        raise TypeError(f"try_batch must be callable (batch -> peak GiB or None), got {type(try_batch).__name__}")
    start, max_batch = positive_int("start", start), positive_int("max_batch", max_batch)
    if start > max_batch:
        raise ValueError(f"start ({start}) must be at most max_batch ({max_batch})")
    capacity_gib = finite_number("capacity_gib", capacity_gib, low=0.0, low_open=True)
    margin = finite_number("margin", margin, low=0.0, high=1.0, high_open=True)
    budget = capacity_gib * (1 - margin)
    trials, fits = [], []
    first_bad = None
    b = start
    while b <= max_batch:
        peak = _peak(try_batch, b)
        ok = peak is not None and peak <= budget
        trials.append({"batch": b, "peak_gib": peak, "fits": ok})
        if not ok:
            first_bad = b
            break
        fits.append((b, peak))
        b *= 2
    if not fits:
        raise MemoryError(f"batch {start} does not fit within {budget:.2f} GiB ({capacity_gib:.2f} GiB capacity, "
                          f"margin {margin:.0%}): measured peak {trials[0]['peak_gib']} GiB (None = out of memory)")
    a, c = _fit(fits)
    upper = (first_bad - 1) if first_bad else max_batch
    best_known = fits[-1][0]
    guess = int((budget - a) / c) if c > 0 else upper
    cand = max(best_known, min(upper, guess))
    peak = dict(fits).get(cand)
    while peak is None:
        p = _peak(try_batch, cand)
        trials.append({"batch": cand, "peak_gib": p, "fits": p is not None and p <= budget})
        if p is not None and p <= budget:
            peak = p
        else:                       # step down towards the largest batch known to fit
            cand = best_known + (cand - best_known) // 2
            peak = dict(fits).get(cand)
    return FinderResult(batch=cand, predicted_peak_gib=a + c * cand, measured_peak_gib=peak,
                        capacity_gib=capacity_gib, margin=margin, budget_gib=budget, fit=(a, c), trials=trials)


def as_dict(r: FinderResult) -> dict:
    return dataclasses.asdict(r)
