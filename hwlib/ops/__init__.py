"""Python faces of the kernels the recipe and the workloads use, and the plumbing every op shares.

The BK-Core's op (``bk_*``, recipe step 12) and the Polychromic trainer's diversity score
(``diversity``); kernel sources and Triton loading (``sources``), the CUDA build (``build``), the
custom ops declared to inductor (``fallbacks``). An op that a step past the recipe introduces lives in
that step's folder (``hwlib/steps/sNN_name/op.py``), and later steps import it from there.
"""

from .bk_core import (BACKENDS, KernelError, ResolventDiagonal, available_backends, resolvent_diagonal,
                      resolvent_features, select_backend, working_range)
from .bk_reference import resolvent_diagonal_dense, resolvent_diagonal_theta_phi

__all__ = ["BACKENDS", "KernelError", "ResolventDiagonal", "available_backends", "resolvent_diagonal",
           "resolvent_features", "select_backend", "working_range", "resolvent_diagonal_dense", "resolvent_diagonal_theta_phi"]
