"""The workspace cuBLAS gets, for torch's matmuls and hwlib's own cuBLASLt calls alike: set and restored
in one place.

With a workspace, cuBLAS on Hopper picks matmul kernels whose tile scheduler keeps counters in it, and
clears them with a ``cudaMemsetAsync`` before every call. In a CUDA graph each memset is a node of its
own, and the matmul after it starts a few microseconds later than after a kernel node: in a profile
of GPT-2's step 25 on an H100, 130 memsets a step (one before most matmuls and two per attention)
came with 0.56 ms of gaps around them and 0.10 ms of their own, in a 31.7 ms step. Without a
workspace cuBLAS picks the same tiles with a scheduler that needs no counters (``ssched`` in the
kernel's name) and no memset. The products are computed in the same tiles and precision. This was
step 28 of GPT-2's ladder until its gain over step 25 measured within the noise on the reference H100
(``hwlib.steps.retired``); notebook 19 now measures it as a toggle on step 25 (``no_gemm_workspace`` in
``hwlib.studies.ablation``), a session per arm, each CUDA graph recorded inside its arm's setting.

How the size is set. torch 2.13 and later: ``torch.backends.cuda.cublas_workspace_size`` and
``cublaslt_workspace_size``, reset to torch's own choice on leaving. Before that, torch reads
``CUBLAS_WORKSPACE_CONFIG`` (cuBLASLt's size capped at cuBLAS's) when it hands a handle its workspace:
torch 2.11, on which this was measured, reads it on every call; older versions may read it once, and
there the setting may not take (the notebook's table says so). hwlib's plain cuBLASLt matmul
(``hwlib.steps.s22_gelu_epilogue.op``'s input gradient) takes ``lt_workspace_bytes()``; its two GELU epilogue matmuls
keep their workspace, without which cuBLASLt has no fused DGELU kernel (``gelu_mlp.workspace_bytes``).
A CUDA graph keeps the kernels it captured: the setting must hold while a graph is recorded, not
while it replays.

torch keeps one workspace per cuBLAS handle and stream. In torch 2.11 it is allocated at the size in
force at its first use and handed to cuBLAS at the size in force at each call: one first made inside
``no_workspace`` is empty, and cuBLAS failed writing past it once the size was back
(``CUBLAS_STATUS_EXECUTION_FAILED``, step 28's first run on an H100). So ``no_workspace`` drops
torch's workspaces on entry and on exit (``torch._C._cuda_clearCublasWorkspaces``, as inductor's
CUDA-graph trees do around every recording), and each is made again at the size of its next use. A
CUDA graph captured before must not be replayed afterwards: the workspace it wrote to may be reused.
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
    """The workspace hwlib's plain cuBLASLt matmul gets now: none inside ``no_workspace``, else 32 MiB."""
    return 0 if _free else LT_WORKSPACE_BYTES


def _sizers():
    """(set cuBLAS's size, set cuBLASLt's size, reset both to torch's own) where torch has them and a
    GPU is there to ask (the getters read the device); None otherwise."""
    c = torch._C
    names = ("_cuda_setCublasWorkspaceSize", "_cuda_setCublasLtWorkspaceSize",
             "_cuda_resetCublasWorkspaceSize", "_cuda_resetCublasLtWorkspaceSize")
    if not all(hasattr(c, n) for n in names) or not torch.cuda.is_available():
        return None
    set_b, set_lt, reset_b, reset_lt = (getattr(c, n) for n in names)
    return set_b, set_lt, lambda: (reset_b(), reset_lt())


def _drop_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


@contextlib.contextmanager
def no_workspace(enabled: bool = True):
    """Run matmuls without a cuBLAS workspace inside the block (``enabled``), restoring torch's own
    sizes after; a no-op context when not ``enabled``, or when already inside one."""
    global _free
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if not enabled or _free:
        yield
        return
    saved_env = {k: os.environ.get(k) for k in _ENV}
    sizers = _sizers()
    try:
        os.environ.update(_ENV)
        if sizers:
            sizers[0](0)
            sizers[1](0)
        _free = True
        _drop_workspaces()
        yield
    finally:
        _free = False
        if sizers:
            sizers[2]()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _drop_workspaces()
