"""The BK-Core op: ``resolvent_diagonal(diag, upper, lower, z)`` = diag((T - zI)^-1), batched.

T is tridiagonal with main diagonal ``diag`` [..., N], super-diagonal ``upper`` and sub-diagonal
``lower`` [..., N-1] (real: float32 -> complex64 out, float64 -> complex128 out); ``z`` is a complex
scalar with Im z != 0. The stable continued-fraction form and its exact O(N) gradient are derived
in ``bk_reference.py``; see there for the formulas.

Backends (same math, same results to rounding):

==============  ==========================================================================
``torch_loop``  a Python loop over N, batched over B: the readable spec (``bk_reference``)
``torch``       associative scans, ~log2 N tensor ops (``bk_scan``): long N on any device
``triton``      ``kernels/12_bk_core_triton.py``; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1;
                forward chunked (``bk_forward_chunked``) from N >= 4 chunks, backward two-pass
``cuda``        ``kernels/12_bk_core.cu`` through ``hwlib.ops.build`` (load_inline); CUDA tensors only;
                tiles of sequences x positions, a chunk per thread, chunks joined by scans of
                their Moebius / affine maps: one read of the inputs, one write of the output
``auto``        CUDA tensors: the fastest measured first (notebook 12 on an H100: cuda, then
                triton), then torch; CPU tensors: torch. Resolved once per process and device
                type, up front, before any launch: a backend that cannot build is passed over with
                a warning naming it and the reason, every time ``auto`` resolves to another.
==============  ==========================================================================

A kernel that builds but fails when launched raises ``KernelError`` naming the backend: it is never
retried on another backend, so a kernel bug cannot turn into a slow row of the torch backend.

Bytes and FLOPs per element of each kernel are in the kernel files' headers. Forward and backward
of one call always use the same backend; the backward recomputes the sweeps rather than saving
O(N) complex state per sequence from the forward.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from hwlib.device import ChoiceError, Unavailable

from . import bk_reference, bk_scan, fallbacks
from .sources import load_python_kernel, triton_device_problem, triton_interpreted, warn_fallback

BACKENDS = ("auto", "torch_loop", "torch", "triton", "cuda")
KERNELS = ("triton", "cuda")     # the backends that launch compiled kernels
# fastest measured first (forward and forward+backward, B = 8192, N = 2048, H100: notebook 12)
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("torch",)}
CHUNKED_MIN_CHUNKS = 4  # triton forward: chunked (one lane per chunk) from N >= this many chunks


class KernelError(RuntimeError):
    """A kernel backend that was selected failed while running; the message names the backend."""


# --- backends ------------------------------------------------------------------------------------

def _triton():
    return load_python_kernel("12_bk_core_triton.py")


def _check_backend(name: str, device: torch.device) -> None:
    """Raise Unavailable (with the reason) when ``name`` cannot run on tensors on ``device``."""
    if name in ("torch_loop", "torch"):
        return
    if name == "cuda":
        if device.type != "cuda":
            raise Unavailable(f"backend 'cuda' needs CUDA tensors, got tensors on {device}")
        from . import bk_cuda
        bk_cuda.module()
    elif name == "triton":
        why = triton_device_problem(device)
        if why:
            raise Unavailable(f"backend 'triton': {why}")
        _triton()


@functools.lru_cache(maxsize=None)
def _auto_choice(device_type: str, order: tuple, interpreted: bool) -> tuple[str, tuple]:
    """``auto``'s backend for tensors on ``device_type`` and the (backend, reason) pairs it passed
    over. Decided once per process (and order, and Triton mode): building is slow, and whether a
    backend builds does not change while the process runs."""
    skipped = []
    for name in order:
        try:
            _check_backend(name, torch.device(device_type))
            return name, tuple(skipped)
        except Unavailable as e:
            skipped.append((name, str(e)))
    return "torch", tuple(skipped)       # torch is last in every order


def select_backend(backend: str, device: torch.device | str) -> str:
    """The backend that will run for tensors on ``device``: ``backend`` itself (or Unavailable with
    the reason), or for ``auto`` its resolution, with a RuntimeWarning for each backend it fell back
    from and why."""
    device = torch.device(device)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ChoiceError("backend", backend, BACKENDS)
    if backend != "auto":
        _check_backend(backend, device)
        return backend
    order = _AUTO_ORDER.get(device.type, ("torch",))
    name, skipped = _auto_choice(device.type, tuple(order), triton_interpreted())
    for other, why in skipped:
        warn_fallback("resolvent_diagonal", other, name, device.type, why)
    return name


def _run(name: str, what: str, fn, *args):
    """``fn(*args)``; a kernel backend's failure becomes a KernelError naming it (out-of-memory
    stays itself, with a note, so callers that handle it still can)."""
    if name not in KERNELS:
        return fn(name, *args)
    try:
        return fn(name, *args)
    except torch.OutOfMemoryError as e:
        e.add_note(f"in resolvent_diagonal's {what}, backend {name!r}")
        raise
    except Exception as e:
        raise KernelError(f"resolvent_diagonal: backend {name!r} failed in the {what} ({type(e).__name__}: "
                          f"{e}); nothing falls back: fix the kernel, or pass backend='torch' to run "
                          f"without it") from e


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
        return _run(backend, "forward", _forward, a, b, c, z)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, c = ctx.saved_tensors
        ga, gb, gc = _run(ctx.backend, "backward", _backward, a, b, c, ctx.z, grad.contiguous())
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


def working_range(dtype: torch.dtype) -> tuple[float, float]:
    """(smallest |Im z|, largest scale) that ``dtype`` carries through the continued fractions.

    Every step takes 1 / w as conj(w) / |w|^2, with |w| >= |Im z| (symmetric T) and |w| at most
    ``max|diag| + |z| + 2 max|upper * lower| / |Im z|`` (the scale): |w|^2 must neither underflow nor
    overflow, with a factor 4 of margin either side for the sums and the kernels' 2x2 map products."""
    f = torch.finfo(dtype)
    return 4 * math.sqrt(f.tiny), math.sqrt(f.max) / 4


def _check_range(a, b, c, z: complex, check_finite: bool) -> None:
    """Inputs the working precision cannot carry raise ValueError naming the argument and the limit,
    instead of coming back as NaN. The tensor part (``check_finite``) is one reduction: one
    synchronisation on a GPU."""
    lo, hi = working_range(a.dtype)
    dt = str(a.dtype).removeprefix("torch.")
    way_out = "pass float64 tensors (.double())" if a.dtype == torch.float32 else "rescale T and z together"
    if abs(z.imag) < lo:
        raise ValueError(f"z: |Im z| = {abs(z.imag):.3g} is below {lo:.3g}, the smallest {dt} carries through "
                         f"1 / |w|^2 (|w| >= |Im z|): {way_out}, or move z further from the real axis")
    if not check_finite:
        return
    zero = a.new_zeros(())
    peaks = torch.stack([x.abs().amax() if x.numel() else zero for x in (a, b, c, b * c)]).tolist()
    for name, v in zip(("diag", "upper", "lower"), peaks):
        if not math.isfinite(v):
            raise ValueError(f"{name} contains NaN or inf")
    amax, kmax = peaks[0], peaks[3]
    scale = amax + abs(z) + 2 * kmax / abs(z.imag)
    if scale <= hi:
        return
    if amax + abs(z) > 2 * kmax / abs(z.imag):
        what, size = ("diag", f"max|diag| = {amax:.3g}") if amax >= abs(z) else ("z", f"|z| = {abs(z):.3g}")
    else:
        kmax = float((b.double() * c.double()).abs().amax())       # past the dtype's range: say how far
        what, size = "upper, lower", f"max|upper * lower| = {kmax:.3g} with |Im z| = {abs(z.imag):.3g}"
    here = f"{scale:.3g}" if math.isfinite(scale) else f"beyond {dt}'s range"
    raise ValueError(f"{what}: {size}; {dt} carries the continued fractions only while max|diag| + |z| + "
                     f"2 max|upper * lower| / |Im z| <= {hi:.3g} (here {here}): {way_out}, "
                     f"or scale T and z down together (G scales up by the same factor)")


def _flat_inputs(diag, upper, lower, z, backend: str, check_finite: bool):
    """The arguments checked (a clear error naming the one at fault) and flattened over the batch:
    (z as a complex, batch shape, N, a [B, N], b, c [B, N-1]), contiguous."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ChoiceError("backend", backend, BACKENDS)
    z = _as_z(z)
    _validate(diag, upper, lower, check_finite)
    if diag.device.type == "meta":   # no values to compute from: any result would be made up
        raise ValueError("diag, upper, lower are meta tensors, which hold shapes but no values: "
                         "resolvent_diagonal computes values; pass CPU or CUDA tensors")
    if backend == "cuda" and diag.device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors; diag is on {diag.device} "
                         f"(move them with .cuda(), or use backend='auto')")
    batch, n = tuple(diag.shape[:-1]), diag.shape[-1]
    a = diag.reshape(-1, n).contiguous()
    b = upper.reshape(a.shape[0], n - 1).contiguous()      # not -1: ambiguous when N = 1
    c = lower.reshape(a.shape[0], n - 1).contiguous()
    return z, batch, n, a, b, c


def resolvent_diagonal(diag: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, z,
                       backend: str = "auto", *, check_finite: bool = True) -> torch.Tensor:
    """diag((T - zI)^-1) for tridiagonal T = tridiag(lower, diag, upper), batched over leading dims.

    diag [..., N], upper/lower [..., N-1], float32 or float64, any strides (copied to contiguous
    where needed; gradients flow back through views and expands). Returns complex [..., N].
    Differentiable in diag, upper, lower (exact; gradcheck-tested).

    Inputs are checked at their own precision (``working_range``): a ``|Im z|`` or a scale of T
    that the dtype cannot carry raises ValueError naming the argument and the limit. ``check_finite``
    (the finite and scale checks of the tensors) costs one read of the inputs and, on a GPU, one
    synchronisation: turn it off inside timed loops.
    """
    z, batch, n, a, b, c = _flat_inputs(diag, upper, lower, z, backend, check_finite)
    if a.shape[0] == 0:
        out = bk_reference.COMPLEX_OF[a.dtype]
        return (a.to(out) * 0).reshape(*batch, n)       # keeps the graph for an empty batch
    _check_range(a, b, c, z, check_finite)
    name = select_backend(backend, a.device)
    return ResolventDiagonal.apply(a, b, c, z, name).reshape(*batch, n)


# --- the op as one graph node ------------------------------------------------------------------------
#
# torch.compile cannot trace the kernels, and tracing the torch backends would unroll their loops
# into the graph. Called as a plain function, the op must be hidden from the compiler
# (``torch.compiler.disable``), which breaks the graph at every call: CUDA graphs (ladder step 09)
# then capture the pieces between the calls, and the torch backend's ops (at N = 2048 about 900
# forward and 1,200 backward, in ~log2 N rounds; aten calls counted by the profiler) still launch
# one by one from the host. As a custom op it is one node of the graph, which
# runs its backend eagerly when traced and is replayed inside the step's CUDA graph. Its output is
# [Re G, Im G] as real pairs (``torch.view_as_real``): no complex tensor enters the compiled graph.

@torch.library.custom_op("hwlib::resolvent_features", mutates_args=())
def _features_op(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z_real: float, z_imag: float,
                 backend: str) -> torch.Tensor:
    # a [B, N], b, c [B, N-1], contiguous; backend unresolved ("auto" resolves here, outside the graph)
    z = complex(z_real, z_imag)
    _check_range(a, b, c, z, False)
    name = select_backend(backend, a.device)
    return torch.view_as_real(_run(name, "forward", _forward, a, b, c, z))


@_features_op.register_fake
def _(a, b, c, z_real, z_imag, backend):
    return a.new_empty((*a.shape, 2))


@torch.library.custom_op("hwlib::resolvent_features_backward", mutates_args=())
def _features_bwd_op(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z_real: float, z_imag: float,
                     backend: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the gradient of view_as_real's output is view_as_complex of its gradient: the complex
    # gradient ``ResolventDiagonal.backward`` gets from autograd through G.real and G.imag
    name = select_backend(backend, a.device)
    if not grad.is_contiguous() or grad.storage_offset() % 2:   # view_as_complex needs whole pairs
        grad = grad.clone(memory_format=torch.contiguous_format)
    return _run(name, "backward", _backward, a, b, c, complex(z_real, z_imag), torch.view_as_complex(grad))


@_features_bwd_op.register_fake
def _(a, b, c, z_real, z_imag, backend, grad):
    return torch.empty_like(a), torch.empty_like(b), torch.empty_like(c)


def _features_setup(ctx, inputs, output):
    a, b, c, ctx.z_real, ctx.z_imag, ctx.backend = inputs
    ctx.save_for_backward(a, b, c)


def _features_backward(ctx, grad):
    a, b, c = ctx.saved_tensors
    ga, gb, gc = torch.ops.hwlib.resolvent_features_backward(a, b, c, ctx.z_real, ctx.z_imag, ctx.backend, grad)
    return ga, gb, gc, None, None, None


_features_op.register_autograd(_features_backward, setup_context=_features_setup)
fallbacks.register(_features_op)
fallbacks.register(_features_bwd_op)


def resolvent_features(diag: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, z,
                       backend: str = "auto") -> torch.Tensor:
    """``torch.view_as_real(resolvent_diagonal(diag, upper, lower, z, backend, check_finite=False))``:
    [..., N, 2] (Re G, Im G), float32 or float64 as the inputs, differentiable in all three, as one
    custom op (``hwlib::resolvent_features``) that torch.compile keeps in its graph, with no graph
    break and no host synchronisation: what a model calls inside a compiled, CUDA-graphed step.
    Same checks as ``resolvent_diagonal`` but the tensor ones (``check_finite``): those need a sync."""
    z, batch, n, a, b, c = _flat_inputs(diag, upper, lower, z, backend, False)
    if a.shape[0] == 0:       # nothing to compute; zeros that keep the graph (any gradient flows back)
        return torch.stack([a * 0, a * 0], dim=-1).reshape(*batch, n, 2)
    return _features_op(a, b, c, z.real, z.imag, backend).reshape(*batch, n, 2)


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
