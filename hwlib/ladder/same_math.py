"""The "same math" check: a step's first K losses against the nearest earlier step that ran.

Pure functions of the curves they are handed: finding the earlier curve (this run's saved one, or
one computed now) is the caller's job (``hwlib.notebook.measure``), so nothing here reads files or
runs training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..steps import STEP_NAMES, Step, chain, get_step, not_applicable, previous
from .run import StepResult

BF16_STEP, BF16_BEFORE = "03_bf16_autocast", "02_tf32"


@dataclass
class MathCheck:
    step: str
    against: str | None
    max_rel_diff: float | None
    tolerance: float
    k: int
    ok: bool
    detail: str = ""
    grads: object = None   # the same step's same-gradients check (hwlib.ladder.gradients.GradCheck), if run

    def __str__(self) -> str:
        if self.against is None:
            return f"{self.step}: {self.detail or 'baseline, nothing to compare'}"
        return (f"{self.step} vs {self.against}: max relative loss difference over {self.k} steps "
                f"{self.max_rel_diff:.2e} (tolerance {self.tolerance:.0e}) -> {'same math' if self.ok else 'FAILED'}"
                + (f"; {self.detail}" if self.detail else ""))


def compare_curves(curr: list[float], prev: list[float], tolerance: float = 0.0) -> float:
    """Largest relative difference between two loss curves over their common length (inf when
    either holds a non-finite loss)."""
    k = min(len(curr), len(prev))
    if k == 0:
        raise ValueError("compare_curves: both curves need at least one loss")
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curr[:k], prev[:k])]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else float("inf")


def earlier_steps(step: str) -> list[str]:
    """The steps before ``step``, nearest first: where its check looks for a curve to compare with."""
    out, prev = [], previous(step)
    while prev is not None:
        out.append(prev.name)
        prev = previous(prev.name)
    return out


def _between(after: str, upto: str) -> list[Step]:
    """The steps of ``upto``'s chain after ``after``, ``upto`` included."""
    steps = chain(upto)
    return steps[[s.name for s in steps].index(after) + 1:]


def needs_bf16_floor(res: StepResult) -> bool:
    """Whether ``res``'s check resolves no finer than bf16's own move of the curve: a step after 03,
    under autocast, that changes the order of arithmetic."""
    if not res.settings.get("autocast") or res.step not in STEP_NAMES:
        return False
    if STEP_NAMES.index(res.step) <= STEP_NAMES.index(BF16_STEP):
        return False
    return not get_step(res.step).same_arithmetic   # same arithmetic keeps the step's own bound


def bf16_floor(curve_03: list[float] | None, curve_02: list[float] | None) -> float | None:
    """How far bf16 moved this workload's loss curve (step 03 against 02, same config and seed),
    capped by step 03's own tolerance; None without both curves."""
    if curve_03 is None or curve_02 is None:
        return None
    return min(compare_curves(curve_03, curve_02), get_step(BF16_STEP).tolerance)


# Unit roundoff of TF32 (10 explicit mantissa bits) and bf16 (7): 8x apart.
U_TF32, U_BF16 = 2.0 ** -11, 2.0 ** -8
ROUNDING_MARGIN = 2.0


def bf16_bound(curve_02: list[float] | None, curve_01: list[float] | None) -> float | None:
    """How far bf16 may move this workload's curve, scaled from how far TF32 moved it (step 02
    against 01, same config and seed): times bf16's 8x coarser unit roundoff, times a margin of 2.

    Training amplifies a change of rounding by a factor of its own, larger where the loss falls
    steeply. On an H100, Vision-BDH's first 10 steps moved 3.6e-3 (batch 256) and 4.0e-3 (batch 192)
    under TF32, and 2.9e-2 and 5.2e-2 under bf16 (7.9x and 13x); the ratio was 1.4x to 13x for the
    other workloads where TF32 moved the curve by more than 1e-4. None without both curves."""
    if curve_02 is None or curve_01 is None:
        return None
    return ROUNDING_MARGIN * (U_BF16 / U_TF32) * compare_curves(curve_02, curve_01)


def same_math(res: StepResult, against: str | None, curve: list[float] | None,
              floor: float | None = None, bound: float | None = None) -> MathCheck:
    """Compare ``res``'s first K losses with ``curve``, the check losses of step ``against`` (the
    nearest earlier step that ran with the same config, seed and device), within the tolerances of
    every step in between. ``floor`` (``bf16_floor``) widens the tolerance to what bf16 can resolve;
    ``bound`` (``bf16_bound``, step 03 only) to how far this workload's training amplifies rounding."""
    st = get_step(res.step)
    if res.status in ("skipped", "n/a"):  # nothing ran, nothing to compare; the row says why
        return MathCheck(res.step, None, None, st.tolerance, 0, True, f"skipped: {res.reason}")
    if res.status != "ok":
        return MathCheck(res.step, None, None, st.tolerance, 0, False, f"{res.status}: {res.reason}")
    if against is None or curve is None:
        return MathCheck(res.step, None, None, 0.0, 0, True)
    if against not in earlier_steps(res.step):
        raise ValueError(f"same_math: {against!r} is not a step before {res.step!r}")
    d = compare_curves(res.check_losses, curve)
    # Tolerances of the steps in between that apply to this workload add up: their changes are part of
    # this diff. A step n/a for the workload changes nothing in it and adds nothing.
    tol = sum(s.tolerance for s in _between(against, res.step) if not_applicable(s, res.workload) is None)
    why = st.why_tolerance
    if floor is not None and floor > tol:
        tol = floor
        why += (f"; under bf16 a change of rounding alone moves this workload's curve as far as bf16 itself did "
                f"(03 vs 02: {floor:.1e}), so that is the resolution of the check")
    if bound is not None and bound > tol:
        tol = bound
        coarser = U_BF16 / U_TF32
        why += (f"; this workload's training amplifies rounding: TF32 moved its curve "
                f"{bound / ROUNDING_MARGIN / coarser:.1e} (02 vs 01), which at bf16's {coarser:g}x coarser rounding "
                f"and a margin of {ROUNDING_MARGIN:g} allows {bound:.1e}")
    return MathCheck(res.step, against, d, tol, min(len(curve), res.check_steps), d <= tol, why)
