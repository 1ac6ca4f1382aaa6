"""The workspace cuBLAS gets, for torch's matmuls and hwlib's own cuBLASLt calls alike: set and restored
in one place.

With a workspace, cuBLAS on Hopper picks matmul kernels whose tile scheduler keeps counters in it, and
clears them with a ``cudaMemsetAsync`` before every call. In a CUDA graph each memset is a node of its
own, and the matmul after it starts a few microseconds later than after a kernel node: in a profile
of GPT-2's step 25 on an H100, 130 memsets a step (one before most matmuls and two per attention)
came with 0.56 ms of gaps around them and 0.10 ms of their own, in a 31.7 ms step. Without a
workspace cuBLAS picks the same tiles with a scheduler that needs no counters (``ssched`` in the
kernel's name) and no memset. The products are computed in the same tiles and precision; notebook
28 measures what it changes (``hwlib.studies.gemm_workspace``).

torch reads its cuBLAS workspace size on every call: through ``torch.backends.cuda.cublas_workspace_size``
where it exists (torch 2.13 and later), else from ``CUBLAS_WORKSPACE_CONFIG`` (cuBLASLt's, capped at
cuBLAS's, from ``CUBLASLT_WORKSPACE_SIZE``). hwlib's plain cuBLASLt matmul (``hwlib.ops.gelu_mlp``'s
input gradient) takes ``lt_workspace_bytes()``; its two GELU epilogue matmuls keep their workspace,
without which cuBLASLt has no fused DGELU kernel (``gelu_mlp.workspace_bytes``). A CUDA graph keeps the kernels it captured: the setting must hold while a
graph is recorded, not while it replays.

torch keeps one workspace per cuBLAS handle and stream, allocated at the size in force at its first
use and handed to cuBLAS at the size in force at each call: one first made inside ``no_workspace``
is empty, and cuBLAS would write past it once the size is back. So ``no_workspace`` drops torch's
workspaces on entry and on exit (``torch._C._cuda_clearCublasWorkspaces``, as inductor's CUDA-graph
trees do around every recording), and each is made again at the size of its next use. A CUDA graph
captured before must not be replayed afterwards: the workspace it wrote to may have been reused.
"""

from __future__ import annotations

import contextlib
import os

import torch

LT_WORKSPACE_BYTES = 32 << 20   # cuBLAS's recommended workspace on Hopper, for hwlib's cuBLASLt calls
_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}   # sizes in KiB: none
_free = False


def workspace_free() -> bool:
    """Whether matmuls run without a cuBLAS workspace now (inside ``no_workspace``)."""
    return _free


def lt_workspace_bytes() -> int:
    """The workspace hwlib's cuBLASLt calls get now: none inside ``no_workspace``, else 32 MiB."""
    return 0 if _free else LT_WORKSPACE_BYTES


def _setters():
    # torch 2.13's setters, where its CUDA bindings are built (a CPU build has the Python names only)
    cb = torch.backends.cuda
    if hasattr(cb, "cublaslt_workspace_size") and hasattr(torch._C, "_cuda_setCublasLtWorkspaceSize"):
        return cb.cublas_workspace_size, cb.cublaslt_workspace_size
    return None


def _drop_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


@contextlib.contextmanager
def no_workspace(enabled: bool = True):
    """Run matmuls without a cuBLAS workspace inside the block (``enabled``), restoring the sizes after;
    a no-op context when not ``enabled``."""
    global _free
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if not enabled:
        yield
        return
    saved_env = {k: os.environ.get(k) for k in _ENV}
    setters = _setters()
    saved_sizes = tuple(s() for s in setters) if setters else None
    saved_free = _free
    try:
        os.environ.update(_ENV)
        if setters:
            for s in setters:
                s(0)
        _free = True
        _drop_workspaces()
        yield
    finally:
        _free = saved_free
        if setters:
            for s, size in zip(setters, saved_sizes):
                s(size)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _drop_workspaces()
