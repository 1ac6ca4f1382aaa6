"""Python faces of the kernels: references, autograd Functions, backend dispatch and fallback."""

from .bk_core import BACKENDS, ResolventDiagonal, available_backends, resolvent_diagonal, select_backend
from .bk_reference import resolvent_diagonal_dense, resolvent_diagonal_theta_phi

__all__ = ["BACKENDS", "ResolventDiagonal", "available_backends", "resolvent_diagonal", "select_backend",
           "resolvent_diagonal_dense", "resolvent_diagonal_theta_phi"]
