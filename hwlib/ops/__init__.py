"""Python faces of the kernels: references, autograd Functions, backend selection."""

from .bk_core import (BACKENDS, KernelError, ResolventDiagonal, available_backends, resolvent_diagonal,
                      resolvent_features, select_backend, working_range)
from .bk_reference import resolvent_diagonal_dense, resolvent_diagonal_theta_phi

__all__ = ["BACKENDS", "KernelError", "ResolventDiagonal", "available_backends", "resolvent_diagonal",
           "resolvent_features", "select_backend", "working_range", "resolvent_diagonal_dense", "resolvent_diagonal_theta_phi"]
