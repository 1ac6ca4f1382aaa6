"""How sure a measured speed-up is: a seeded bootstrap interval for a ratio of two timings.

A speed-up is ``stat(before) / stat(after)``: the time per step without a change over the time with
it (above 1: the change helps). Each arm is timed in several short windows, interleaved with the
other arm's (``interleaved_order``), and each window holds per-step times. The interval comes from
a two-level (hierarchical) bootstrap, which keeps both sources of noise in it:

1. resample the window *pairs* (window i of ``before`` with window i of ``after``, run next to each
   other) with replacement: a drift between repeats (clocks, a neighbour on the host) stays paired,
   so it widens the interval only as much as it moves the ratio;
2. inside each chosen window, resample its steps with replacement: the step-to-step spread.

The point estimate is the statistic of all steps of one arm over that of the other; the interval is
the percentile interval of the resampled ratios. Every draw comes from ``random.Random(seed)``: the
same samples and seed give the same interval, on any machine.

``compare`` places an interval against a threshold: ``above``, ``below`` or ``within noise`` when it
contains the threshold. Pure statistics: no torch, no device, no results.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

STATS = ("median", "mean")
DEFAULT_LEVEL = 0.90         # a 90% interval: 5% of the resampled ratios fall on either side of it
DEFAULT_RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    """A ratio with its bootstrap interval [lo, hi] at confidence ``level``; ``windows`` pairs of
    ``steps`` per-step times each (the fewest in any window)."""

    ratio: float
    lo: float
    hi: float
    level: float
    windows: int
    steps: int
    stat: str = "median"
    method: str = "hierarchical bootstrap (window pairs, then steps)"

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def to_dict(self) -> dict:
        return {"ratio": self.ratio, "lo": self.lo, "hi": self.hi, "level": self.level, "windows": self.windows,
                "steps": self.steps, "stat": self.stat, "method": self.method}


def _stat(name: str):
    if name not in STATS:
        raise ValueError(f"stat must be one of {', '.join(STATS)}, got {name!r}")
    return statistics.median if name == "median" else statistics.fmean


def _windows(name: str, windows) -> list[list[float]]:
    """``windows`` as a list of non-empty lists of finite, positive times, or a ValueError naming it."""
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__len__") or len(windows) == 0:
        raise ValueError(f"{name} must be a non-empty list of windows (lists of per-step times), got {windows!r}")
    out = []
    for i, w in enumerate(windows):
        if isinstance(w, (int, float)):
            raise ValueError(f"{name}[{i}] is a number; each window must be a list of per-step times")
        w = [float(x) for x in w]
        if not w:
            raise ValueError(f"{name}[{i}] is empty: each window needs at least one timed step")
        bad = [x for x in w if not math.isfinite(x) or x <= 0]
        if bad:
            raise ValueError(f"{name}[{i}] holds times that are not finite and positive: {bad[:3]}")
        out.append(w)
    return out


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of ``xs`` (numpy's default); ``q`` in [0, 1], ``xs`` not empty."""
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 1:
        raise ValueError(f"q must be a number in [0, 1] (0.5: the median), got {q!r}")
    s = sorted(xs)
    if not s:
        raise ValueError("xs is empty: a quantile needs at least one value")
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio_interval(before, after, *, level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES,
                   seed: int = 0, stat: str = "median") -> Interval:
    """``stat(before) / stat(after)`` with its bootstrap interval (module doc).

    ``before`` and ``after``: lists of windows, each a list of per-step times (ms); window i of one
    arm ran next to window i of the other, so both need the same number of windows. One window each
    gives the plain two-sample bootstrap of the ratio."""
    f = _stat(stat)
    a, b = _windows("before", before), _windows("after", after)
    if len(a) != len(b):
        raise ValueError(f"before has {len(a)} windows and after {len(b)}: the windows come in interleaved pairs")
    if not (isinstance(level, float) and 0.0 < level < 1.0):
        raise ValueError(f"level must be a float in (0, 1), got {level!r}")
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 100:
        raise ValueError(f"resamples must be an int >= 100 (the interval's tails need them), got {resamples!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    rng = random.Random(seed)
    k = len(a)
    ratios = []
    for _ in range(resamples):
        pick = [rng.randrange(k) for _ in range(k)]
        ra = [x for i in pick for x in rng.choices(a[i], k=len(a[i]))]
        rb = [x for i in pick for x in rng.choices(b[i], k=len(b[i]))]
        ratios.append(f(ra) / f(rb))
    tail = (1.0 - level) / 2
    point = f([x for w in a for x in w]) / f([x for w in b for x in w])
    return Interval(ratio=point, lo=quantile(ratios, tail), hi=quantile(ratios, 1.0 - tail), level=level,
                    windows=k, steps=min(len(w) for w in a + b), stat=stat)


def window_ratios(before, after, stat: str = "median") -> list[float]:
    """Each window pair's own ratio (its spread across repeats, for the records' p20/p80)."""
    f = _stat(stat)
    a, b = _windows("before", before), _windows("after", after)
    if len(a) != len(b):
        raise ValueError(f"before has {len(a)} windows and after {len(b)}: the windows come in interleaved pairs")
    return [f(x) / f(y) for x, y in zip(a, b)]


def interleaved_order(repeats: int, arms=("A", "B")) -> list:
    """The order the arms' windows run in: by default "A" (before) and "B" (after), interleaved A/B,
    A/B, with every second round reversed (A B B A A B B A ...), so that a steady drift over the run
    (a GPU warming up, a cache filling) falls on every arm alike instead of always on the last."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    arms = tuple(arms)
    if not arms or len(set(arms)) != len(arms):
        raise ValueError(f"arms must be distinct names, at least one, got {arms!r}")
    return [arm for r in range(repeats) for arm in (arms if r % 2 == 0 else arms[::-1])]


def compare(lo: float, hi: float, threshold: float) -> str:
    """Where an interval lies against ``threshold``: 'above' (lo > threshold), 'below' (hi < threshold),
    else 'within noise'."""
    for name, v in (("lo", lo), ("hi", hi), ("threshold", threshold)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if lo > hi:
        raise ValueError(f"lo ({lo}) is above hi ({hi})")
    if lo > threshold:
        return "above"
    if hi < threshold:
        return "below"
    return "within noise"


# An effect in words, for prose: "within noise" says what it means for the reader.
EFFECT_WORDS = {"faster": "faster", "slower": "slower", "within noise": "no difference this run can resolve"}


def effect(lo: float, hi: float) -> str:
    """What a toggle did, as the interval [lo, hi] of its speed-up says: 'faster', 'slower' or
    'within noise' (contains 1)."""
    return {"above": "faster", "below": "slower", "within noise": "within noise"}[compare(lo, hi, 1.0)]


def within_spread(ratio: float, spreads) -> bool | None:
    """Whether ``ratio`` (a speed-up, either way round) is smaller than the largest of ``spreads``
    (each slowest over fastest across processes, >= 1; None where not measured): another run could
    land on the other side. None when no spread was measured: nothing is said."""
    known = [s for s in spreads if s]
    return max(ratio, 1.0 / ratio) < max(known) if known else None
