"""The BK-Core op: ``resolvent_diagonal(diag, upper, lower, z)`` = diag((T - zI)^-1), batched.

T is tridiagonal with main diagonal ``diag`` [..., N], super-diagonal ``upper`` and sub-diagonal
``lower`` [..., N-1] (real: float32 -> complex64 out, float64 -> complex128 out); ``z`` is a complex
scalar with Im z != 0. The stable continued-fraction form and its exact O(N) gradient are derived
in ``bk_reference.py``; see there for the formulas.

Backends (same math, same results to rounding):

==============  ==========================================================================
``torch_loop``  a Python loop over N, batched over B: the readable spec (``bk_reference``)
``torch``       associative scans, ~log2 N tensor ops (``bk_scan``): long N on any device
``triton``      ``kernels/bk_core_triton.py``; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1;
                forward chunked (``bk_forward_chunked``) from N >= 4 chunks, backward two-pass
``cuda``        ``kernels/bk_core.cu`` through ``hwlib.ops.build`` (load_inline); CUDA tensors only;
                tiles of sequences x positions, a chunk per thread, chunks joined by scans of
                their Moebius / affine maps: one read of the inputs, one write of the output
``auto``        CUDA tensors: the fastest measured first (notebook 12 on an H100: cuda, then
                triton), then torch; CPU tensors: torch. A backend that cannot build or run is
                skipped with a warning naming it and the reason.
==============  ==========================================================================

Bytes and FLOPs per element of each kernel are in the kernel files' headers. Forward and backward
of one call always use the same backend; the backward recomputes the sweeps rather than saving
O(N) complex state per sequence from the forward.
"""

from __future__ import annotations

import numbers
import warnings

import torch

from hwlib.device import ChoiceError, Unavailable

from . import bk_reference, bk_scan
from .sources import load_python_kernel, triton_interpreted

BACKENDS = ("auto", "torch_loop", "torch", "triton", "cuda")
# fastest measured first (forward and forward+backward, B = 8192, N = 2048, H100: notebook 12)
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("torch",)}
CHUNKED_MIN_CHUNKS = 4  # triton forward: chunked (one lane per chunk) from N >= this many chunks
_BROKEN: dict = {}      # (backend, device type) -> why it failed to build or run, so we try once


# --- backends ------------------------------------------------------------------------------------

def _triton():
    return load_python_kernel("bk_core_triton.py")


_READY: set = set()      # (backend, "cuda") that built and checked out: not re-checked per call


def _check_backend(name: str, device: torch.device) -> None:
    """Raise Unavailable (with the reason) when ``name`` cannot run on tensors on ``device``."""
    if name in ("torch_loop", "torch") or (name, device.type) in _READY:
        return
    if (name, device.type) in _BROKEN:
        raise Unavailable(_BROKEN[(name, device.type)])
    if name == "cuda":
        if device.type != "cuda":
            raise Unavailable(f"backend 'cuda' needs CUDA tensors, got tensors on {device}")
        from . import bk_cuda
        bk_cuda.module()
    elif name == "triton":
        if device.type == "cpu" and not triton_interpreted():
            raise Unavailable("backend 'triton' runs CPU tensors only under TRITON_INTERPRET=1 "
                              "(set before triton is imported)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise Unavailable("backend 'triton' got a CUDA device, but no CUDA GPU is visible to torch")
        if device.type == "cuda" and triton_interpreted():
            raise Unavailable("TRITON_INTERPRET=1 is set: Triton would interpret, not compile, for CUDA tensors")
        if device.type not in ("cpu", "cuda"):
            raise Unavailable(f"backend 'triton' does not run on {device.type} tensors")
        _triton()
    if device.type == "cuda":   # on CPU, Triton's answer depends on TRITON_INTERPRET: ask every time
        _READY.add((name, device.type))


def select_backend(backend: str, device: torch.device | str, _quiet: tuple = ()) -> str:
    """The backend that will run for tensors on ``device``; warns for each one ``auto`` skips
    (except those in ``_quiet``, whose failure the caller has just reported)."""
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ChoiceError("backend", backend, BACKENDS)
    if backend != "auto":
        _check_backend(backend, device)
        return backend
    for name in _AUTO_ORDER.get(device.type, ("torch",)):
        try:
            _check_backend(name, device)
            return name
        except Unavailable as e:
            if name in _quiet:
                continue
            warnings.warn(f"resolvent_diagonal: backend {name!r} unavailable ({e}); falling back",
                          RuntimeWarning, stacklevel=3)
    return "torch"  # unreachable: torch is last in every order


def _forward(name, a, b, c, z):
    if name == "torch_loop":
        return bk_reference.forward_loop(a, b, c, z)
    if name == "torch":
        return bk_scan.forward_scan(a, b, c, z)
    if name == "triton":
        tk = _triton()
        if a.shape[-1] >= CHUNKED_MIN_CHUNKS * tk.CHUNK:     # B * N / L lanes instead of B
            return tk.bk_forward_chunked(a, b, c, z)
        return tk.bk_forward(a, b, c, z)
    from . import bk_cuda
    return bk_cuda.forward(a, b, c, z)


def _backward(name, a, b, c, z, grad):
    if name == "torch_loop":
        return bk_reference.backward_loop(a, b, c, z, grad)
    if name == "torch":
        return bk_scan.backward_scan(a, b, c, z, grad)
    if name == "triton":
        return _triton().bk_backward(a, b, c, z, grad)
    from . import bk_cuda
    return bk_cuda.backward(a, b, c, z, grad)


class ResolventDiagonal(torch.autograd.Function):
    """a [B, N], b, c [B, N-1] contiguous -> G [B, N]; backward: the exact O(N) tangent sweeps."""

    @staticmethod
    def forward(ctx, a, b, c, z, backend):
        ctx.z, ctx.backend = z, backend
        ctx.save_for_backward(a, b, c)
        return _forward(backend, a, b, c, z)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, c = ctx.saved_tensors
        ga, gb, gc = _backward(ctx.backend, a, b, c, ctx.z, grad.contiguous())
        return ga, gb, gc, None, None


# --- validation ----------------------------------------------------------------------------------

def _as_z(z) -> complex:
    if isinstance(z, torch.Tensor):
        if z.numel() != 1:
            raise ValueError(f"z must be a scalar, got a tensor of shape {tuple(z.shape)}")
        if z.requires_grad:
            raise TypeError("z: gradients with respect to z are not supported; pass a number")
        z = z.item()
    if isinstance(z, bool) or not isinstance(z, numbers.Number):
        raise TypeError(f"z must be a complex number, got {type(z).__name__}")
    z = complex(z)
    if not (abs(z.real) < float("inf") and abs(z.imag) < float("inf")):   # also catches NaN
        raise ValueError(f"z must be finite, got {z}")
    if z.imag == 0:
        raise ValueError(f"z = {z} is real: Im z must be nonzero (on the real axis T - zI can be "
                         f"singular, and G is not defined on the spectrum)")
    return z


def _validate(diag, upper, lower, check_finite: bool):
    for name, x in (("diag", diag), ("upper", upper), ("lower", lower)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} has dtype {x.dtype}: T must be real float32 or float64 "
                            f"(convert with .float() or .double(); half precision would lose G's accuracy)")
    if upper.dtype != diag.dtype or lower.dtype != diag.dtype:
        raise TypeError(f"diag, upper, lower must share one dtype, got {diag.dtype}, {upper.dtype}, {lower.dtype}")
    if diag.dim() < 1:
        raise ValueError("diag must have shape [..., N], got a scalar")
    n = diag.shape[-1]
    if n == 0:
        raise ValueError("diag has N = 0 positions: nothing to invert")
    want = tuple(diag.shape[:-1]) + (n - 1,)
    for name, x in (("upper", upper), ("lower", lower)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want} (diag is {tuple(diag.shape)})")
        if x.device != diag.device:
            raise ValueError(f"{name} is on {x.device}, diag on {diag.device}: put them on one device")
    if check_finite:
        for name, x in (("diag", diag), ("upper", upper), ("lower", lower)):
            if x.numel() and not bool(torch.isfinite(x).all()):
                raise ValueError(f"{name} contains NaN or inf")


def resolvent_diagonal(diag: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, z,
                       backend: str = "auto", *, check_finite: bool = True) -> torch.Tensor:
    """diag((T - zI)^-1) for tridiagonal T = tridiag(lower, diag, upper), batched over leading dims.

    diag [..., N], upper/lower [..., N-1], float32 or float64, any strides (copied to contiguous
    where needed; gradients flow back through views and expands). Returns complex [..., N].
    Differentiable in diag, upper, lower (exact; gradcheck-tested). ``check_finite`` costs one
    read of the inputs and, on a GPU, a synchronisation: turn it off inside timed loops.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ChoiceError("backend", backend, BACKENDS)
    z = _as_z(z)
    _validate(diag, upper, lower, check_finite)
    if backend == "cuda" and diag.device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors; diag is on {diag.device} "
                         f"(move them with .cuda(), or use backend='auto')")
    batch, n = tuple(diag.shape[:-1]), diag.shape[-1]
    a = diag.reshape(-1, n).contiguous()
    b = upper.reshape(a.shape[0], n - 1).contiguous()      # not -1: ambiguous when N = 1
    c = lower.reshape(a.shape[0], n - 1).contiguous()
    if a.shape[0] == 0:
        out = bk_reference.COMPLEX_OF[a.dtype]
        return (a.to(out) * 0).reshape(*batch, n)       # keeps the graph for an empty batch
    name = select_backend(backend, a.device)
    if backend != "auto":
        return ResolventDiagonal.apply(a, b, c, z, name).reshape(*batch, n)
    while True:
        try:
            return ResolventDiagonal.apply(a, b, c, z, name).reshape(*batch, n)
        except Exception as e:  # a kernel that builds but fails at its first launch
            if name in ("torch", "torch_loop"):
                raise
            _BROKEN[(name, a.device.type)] = f"{type(e).__name__}: {e}"
            _READY.discard((name, a.device.type))
            warnings.warn(f"resolvent_diagonal: backend {name!r} failed ({type(e).__name__}: {e}); "
                          f"falling back", RuntimeWarning, stacklevel=2)
            name = select_backend("auto", a.device, _quiet=(name,))


def available_backends(device: torch.device | str = "cpu") -> dict[str, str | None]:
    """{backend: None if it can run on ``device``, else the reason}. Builds what it needs to know."""
    out = {}
    for name in BACKENDS[1:]:
        try:
            _check_backend(name, torch.device(device))
            out[name] = None
        except Unavailable as e:
            out[name] = str(e)
    return out
