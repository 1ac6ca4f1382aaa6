"""What a ladder step is: a name, the step it builds on, its same-math tolerance with the reason, and
either a change of the recipe's knobs (steps 01-12) or an ``apply(model)`` that swaps modules in
(the steps past the recipe, one folder each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class Precondition(ValueError):
    """A step's ``apply`` met a model it cannot change: the message names what it needs and what it found."""


def require(ok: bool, step: str, needs: str, found: str) -> None:
    """Raise ``Precondition`` naming the step, what it needs and what it found, unless ``ok``."""
    if not ok:
        raise Precondition(f"{step} {needs}; found {found}")


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    change: dict = field(default_factory=dict)   # recipe steps: the Settings fields they set
    tolerance: float = 0.0           # relative, max over K steps, vs the step it builds on
    gpu_only: bool = False
    why_tolerance: str = ""
    workloads: tuple[str, ...] | None = None   # None: every workload; else the ones it applies to
    why_na: dict = field(default_factory=dict)  # workload -> why the step does not apply to it
    same_arithmetic: bool = False   # the change leaves every operation as it was (only data delivery differs)
    beyond_recipe: bool = False     # past the standard recipe the seeds describe (notebooks 17+)
    after: str | None = None        # the step it builds on, where that is not the one listed before it
    # Past the recipe: swaps this step's modules into a model built with the recipe's settings (and every
    # earlier step of its chain applied); raises Precondition when the model is not one it can change.
    apply: Callable | None = None
    # Runs the session's training step itself: trainer(session) -> (batch -> loss), or None where it cannot
    # (the session then steps as usual). Step 31's whole step replayed as a CUDA graph per bucket.
    trainer: Callable | None = None
    # The roofline prediction: predict(ctx) -> hwlib.roofline.Prediction, or None for "nothing counted".
    predict: Callable | None = None
    fp8: bool = False               # runs matmuls in FP8 (needs FP8 tensor cores)
    # Its curve check may widen to how far this workload's training amplifies rounding, scaled from TF32's
    # move of the curve (ladder.same_math.bf16_bound): the step that changes the precision to bf16.
    bound_from_tf32: bool = False
    # What notebook 16's floors (studies.breakdown.gpt_floors) do not count for a chain with this step.
    floor_caveat: str = ""
    folder: str | None = None       # the step's folder under hwlib/steps (past the recipe)
    kernels: tuple[str, ...] = ()   # the kernel files (under kernels/) its change lives in
