"""Batch-size finder that counts everything a training step holds.

Each trial runs full steps (forward, backward and the optimizer step, under the step's autocast
and compile settings), so weights, gradients, optimizer states and activations are all in the
measured peak; the peak is the allocator's *reserved* peak, what it had to take from the device.
Batches double from ``start`` until one does not fit within the budget (capacity minus the margin)
or runs out of memory; a straight line peak(b) = a + c b through the last three fitting trials predicts
the largest batch within the budget; that batch is run and its peak measured, and it is stepped down
until it fits. The result reports the batch, the margin kept, the predicted and the measured peak,
and the allocator settings it measured under: under the default allocator a reserved peak depends on
the order of allocations (``hwlib.memory.allocator``), so a later run at the same batch can reserve
less than predicted; with expandable segments reserved tracks allocated and the prediction holds.

``start`` (a power of two) only saves trials: the batches below it would only have located the range,
and where it skipped one of the three the line goes through, that one is run after all
(``informed_start`` picks a start from a peak measured earlier).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from .checks import finite_number, positive_int

GiB = 2**30
FIT_POINTS = 3       # the line goes through this many of the largest fitting trials


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
    start: int = 1                      # the doubling began here: smaller batches ran only where the fit needed them


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    if len(points) == 1:
        b, p = points[0]
        return 0.0, p / b   # one point: assume all memory scales with the batch (pessimistic)
    pts = points[-FIT_POINTS:]   # the largest trials: fixed costs are amortised, the slope is clean
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


def budget_of(capacity_gib: float, margin: float) -> float:
    """The GiB a fitting trial's peak may reach: the capacity less the margin (both checked). The
    search and a trial that stops early (``hwlib.studies.batch_finder``) judge against the same figure."""
    capacity_gib = finite_number("capacity_gib", capacity_gib, low=0.0, low_open=True)
    margin = finite_number("margin", margin, low=0.0, high=1.0, high_open=True)
    return capacity_gib * (1 - margin)


def informed_start(budget_gib: float, batch: int, peak_gib: float, *, headroom: int = 8) -> int:
    """A ``start`` for ``search_batch`` from a reserved peak of ``peak_gib`` measured at ``batch``: the
    largest power of two <= budget / (peak / batch) / headroom, at least 1.

    peak / batch counts the fixed costs (weights, optimizer states) as if each sample paid them, so
    budget / (peak / batch) is at most the largest batch that fits, while the peak grows linearly and
    the measured batch fits; the first doubling that fails lies above it. A power of two at most a
    quarter of the estimate is then at most an eighth of that failure, so the three doublings the line
    goes through (an eighth, a quarter and half the failure) all run; a headroom of 8 keeps them while
    the estimate is up to twice too high (a peak growing faster than the line). A start too high
    costs trials, not the result: ``search_batch`` then runs the skipped batches the line needs."""
    budget_gib = finite_number("budget_gib", budget_gib, low=0.0, low_open=True)
    batch = positive_int("batch", batch)
    peak_gib = finite_number("peak_gib", peak_gib, low=0.0, low_open=True)
    headroom = positive_int("headroom", headroom, unit="time")
    most = budget_gib * batch / peak_gib / headroom
    return 1 << max(0, int(most).bit_length() - 1)


def _check_start(start, max_batch) -> tuple[int, int]:
    start, max_batch = positive_int("start", start), positive_int("max_batch", max_batch)
    if start & (start - 1):
        raise ValueError(f"start must be a power of two (1, 2, 4, ...), got {start}: doubling from it then "
                         "tries the batches a search from 1 tries, and finds the same batch")
    if start > max_batch:
        raise ValueError(f"start ({start}) must be at most max_batch ({max_batch})")
    return start, max_batch


class _Trials:
    """The trials run so far (in order), the fitting ones by batch, and the smallest that failed."""

    def __init__(self, try_batch: Callable, budget: float):
        self.try_batch, self.budget = try_batch, budget
        self.trials: list[dict] = []
        self.fits: list[tuple[int, float]] = []    # ascending batch
        self.first_bad: int | None = None

    def run(self, b: int) -> tuple[bool, float | None]:
        peak = _peak(self.try_batch, b)
        ok = peak is not None and peak <= self.budget
        self.trials.append({"batch": b, "peak_gib": peak, "fits": ok})
        return ok, peak

    def double(self, start: int, max_batch: int) -> None:
        """start, 2 start, 4 start, ... up to the first that does not fit (or max_batch)."""
        b = start
        while b <= max_batch:
            ok, peak = self.run(b)
            if not ok:
                self.first_bad = b
                return
            self.fits.append((b, peak))
            b *= 2

    def backfill(self, start: int) -> None:
        """The batches below ``start`` that a search from 1 would have fit the line through: halving
        until FIT_POINTS fit, or down to 1. One that fails where a larger one fitted is where a
        search from 1 would have stopped: the fits above it go, as they would never have run."""
        b = start // 2
        while len(self.fits) < FIT_POINTS and b >= 1:
            ok, peak = self.run(b)
            if ok:
                self.fits.insert(0, (b, peak))
            else:
                self.fits, self.first_bad = [], b
            b //= 2


def search_batch(try_batch: Callable[[int], float | None], capacity_gib: float, *, margin: float = 0.1,
                 start: int = 1, max_batch: int = 4096) -> FinderResult:
    """The search itself: ``try_batch(b)`` returns the measured peak in GiB, or None on OOM. ``start``
    (a power of two) is where the doubling begins; while peaks grow with the batch, the batch found
    and its fit are those of start=1."""
    if not callable(try_batch):
        raise TypeError(f"try_batch must be callable (batch -> peak GiB or None), got {type(try_batch).__name__}")
    start, max_batch = _check_start(start, max_batch)
    budget = budget_of(capacity_gib, margin)
    capacity_gib, margin = float(capacity_gib), float(margin)
    t = _Trials(try_batch, budget)
    t.double(start, max_batch)
    t.backfill(start)
    if not t.fits:
        low = min(t.trials, key=lambda x: x["batch"])
        raise MemoryError(f"batch {low['batch']} does not fit within {budget:.2f} GiB ({capacity_gib:.2f} GiB "
                          f"capacity, margin {margin:.0%}): measured peak {low['peak_gib']} GiB (None = out of memory)")
    fits = t.fits
    a, c = _fit(fits)
    upper = (t.first_bad - 1) if t.first_bad else max_batch
    best_known = fits[-1][0]
    guess = int((budget - a) / c) if c > 0 else upper
    cand = max(best_known, min(upper, guess))
    peak = dict(fits).get(cand)
    while peak is None:
        ok, p = t.run(cand)
        if ok:
            peak = p
        else:                       # step down towards the largest batch known to fit
            cand = best_known + (cand - best_known) // 2
            peak = dict(fits).get(cand)
    return FinderResult(batch=cand, predicted_peak_gib=a + c * cand, measured_peak_gib=peak,
                        capacity_gib=capacity_gib, margin=margin, budget_gib=budget, fit=(a, c), trials=t.trials,
                        start=start)


def as_dict(r: FinderResult) -> dict:
    return dataclasses.asdict(r)
