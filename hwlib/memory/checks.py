"""Argument checks shared by the memory tools: a wrong type, sign or special value ends in an error
that names the argument and what it accepts, before any work (or any endless loop) starts."""

from __future__ import annotations

import math
import numbers


def positive_int(name: str, v, unit: str = "sample") -> int:
    """``v`` as an int >= 1 (counting ``unit``s); bools, floats and strings are refused (TypeError),
    zero and below too (ValueError)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be a whole number of {unit}s, got {v!r} ({type(v).__name__})")
    if v < 1:
        raise ValueError(f"{name} must be at least one {unit}, got {v}")
    return int(v)


def finite_number(name: str, v, *, low: float | None = None, low_open: bool = False,
                  high: float | None = None, high_open: bool = False) -> float:
    """``v`` as a float, finite and within [low, high] (an open end excludes it), or an error naming it."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
    x = float(v)
    too_low = low is not None and (x <= low if low_open else x < low)
    too_high = high is not None and (x >= high if high_open else x > high)
    if not math.isfinite(x) or too_low or too_high:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
        need = " and ".join(part for part in (lo, hi) if part)
        raise ValueError(f"{name} must be a finite number{' ' + need if need else ''}, got {v!r}")
    return x
