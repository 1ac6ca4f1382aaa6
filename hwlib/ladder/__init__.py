"""The single-GPU ladder: a session of one workload under one step's settings (``session``), the
run loop that measures it (``run``), the same-math check against the step before (``same_math``)
and the records a measurement writes (``record.record``)."""

from . import record
from .run import StepResult, first_timed_step, run_step
from .same_math import MathCheck, compare_curves, same_math
from .session import Session

__all__ = ["MathCheck", "Session", "StepResult", "compare_curves", "first_timed_step", "record", "run_step",
           "same_math"]
