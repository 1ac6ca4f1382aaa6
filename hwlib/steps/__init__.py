"""The optimizations: the shared recipe's knobs (steps 01-12) and one folder per step past it.

``LADDER`` is every step in order; a step past the recipe is ``hwlib/steps/sNN_name/``: its ``STEP``
(name, the step it builds on, tolerance and reason, where it applies), its ``apply(model)`` that swaps
modules in, its roofline ``predict``, the op it introduces (``op.py``; later steps import it from
there) and its study (``study.py``: the op against float64 and its kernels alone). A study is a runner:
nothing in the core, this package's ``__init__``, ``apply``, ``predict`` and ``op`` included, imports
one. The helpers below find a step, its chain and its settings. ``RETIRED`` (``retired.py``) lists the
steps taken off the ladder, for the records they left.
"""

from ..settings import Settings
from .ladder import (LADDER, RECIPE_NAMES, STEP_NAMES, apply_chain, chain, describe, get_step,
                     not_applicable, previous, resolve_autocast, runs_here, settings_for, unavailable, uses_fp8)
from .prediction import floor_ms, precision_of, predict
from .retired import RETIRED, RETIRED_NAMES, Retired
from .step import Precondition, Step

__all__ = ["LADDER", "RECIPE_NAMES", "RETIRED", "RETIRED_NAMES", "STEP_NAMES", "Precondition", "Retired", "Settings", "Step",
           "apply_chain", "chain", "describe", "floor_ms", "get_step", "not_applicable",
           "precision_of", "predict", "previous", "resolve_autocast", "runs_here", "settings_for", "unavailable",
           "uses_fp8"]
