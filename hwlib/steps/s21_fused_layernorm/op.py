"""Residual add + LayerNorm as one op: ``s = x + r``, ``y = LayerNorm(s)``, forward and backward fused.

A pre-LayerNorm block (``hwlib.workloads.blocks``) adds each branch's output to the residual stream
and normalises the sum for the next branch. Compiled, that is an add fused with a LayerNorm in
forward; in backward the LayerNorm's gradient, the residual gradient's add, its cast for the branch
and the gain's and bias's reductions, which inductor splits over several kernels that read the
same rows again. This op does each direction in one pass over the rows
(``kernels/21_add_layernorm_triton.py``: the formulas, bytes and FLOPs).

Precision is the unfused path's under autocast: ``x`` is the fp32 stream, ``r`` the branch's output
in the autocast dtype, the sum and the normalisation are fp32 (autocast runs ``layer_norm`` in
fp32), and ``y`` is rounded once into the autocast dtype, as the next matmul's autocast cast rounds
the fp32 LayerNorm output. The backward is fp32; the stream's gradient stays fp32 and the branch's
is rounded into ``r``'s dtype, as autograd rounds the gradient of a promoted add.

A 16-bit stream (``x`` in r's dtype, as Megatron-LM keeps it unless ``fp32_residual_connection`` is
set) is the same op with every stream term narrower: the sum is taken in fp32 and rounded once into
the stream's dtype, and the LayerNorm normalises the rounded sum (so the backward, which recomputes
s_hat from the stored s, differentiates the function the forward computed); the statistics and the
backward stay fp32, and the stream's gradient is rounded into its dtype. Where r and the stream share
a dtype the branch's gradient is the stream's, the same tensor: the kernel writes it once.

Backends (chosen once per call from the device, never switched on failure), as ``hwlib.steps.s17_fused_lm_head.op``:

===========  ===========================================================================
``triton``   the two Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
``torch``    the same formulas in torch ops: any device (CPU: the smoke ladder)
``auto``     ``triton`` on CUDA where Triton loads, else ``torch``
===========  ===========================================================================

Both directions are ``torch.library.custom_op``s (``hwlib::add_layer_norm`` and its backward) with fake
impls, so torch.compile keeps each as one node and CUDA graphs capture them (no host sync).
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from ...ops import fallbacks
from ...ops.sources import (TRITON_BACKENDS, load_python_kernel, read_kernel_source, resolve_triton_backend,
                            select_triton_backend)
from ...precision import compute_dtype

BACKENDS = TRITON_BACKENDS
KERNEL_FILE = "21_add_layernorm_triton.py"
# The bias column's width: a one and 15 zeros after each row of y, so that a matmul of y's rows gives the
# next linear's bias gradient beside its weight gradient (hwlib.steps.s22_gelu_epilogue.op). 16 keeps the rows a multiple
# of 32 bytes apart in bf16: Triton vectorizes stores at strides it knows are multiples of 16 elements,
# and cuBLASLt's leading dimensions must be multiples of 16 bytes.
BIAS_COLUMNS = 16


def _kernel():
    return load_python_kernel(KERNEL_FILE)


def kernel_source() -> str:
    """The Triton kernels' file, as it runs (for a notebook to print)."""
    return read_kernel_source(KERNEL_FILE)


# --- inputs --------------------------------------------------------------------------------------

def check_inputs(x, r, weight, bias, eps, r_bias=None) -> None:
    """A clear ValueError naming the argument unless shapes, dtypes and devices fit."""
    named = (("x", x), ("r", r), ("weight", weight), ("bias", bias)) + ((("r_bias", r_bias),) if r_bias is not None else ())
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., D] with D >= 1, got shape {tuple(x.shape)}")
    if tuple(r.shape) != tuple(x.shape):
        raise ValueError(f"r has shape {tuple(r.shape)}; it must be x's, {tuple(x.shape)}")
    D = x.shape[-1]
    for name, t in named[2:]:
        if tuple(t.shape) != (D,):
            raise ValueError(f"{name} must be [D] = [{D}] (x's last dimension), got {tuple(t.shape)}")
    if len({t.device for _, t in named}) > 1:
        raise ValueError(f"{', '.join(n for n, _ in named)} must be on one device, got "
                         f"{', '.join(str(t.device) for _, t in named)}")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not 0 < eps < float("inf"):
        raise ValueError(f"eps must be a positive number (and finite), got {eps!r}")
    if torch.promote_types(x.dtype, r.dtype) != x.dtype:
        raise ValueError(f"x ({x.dtype}) is the residual stream and must be at least as wide as r ({r.dtype}): "
                         f"x + r would promote to {torch.promote_types(x.dtype, r.dtype)}")


# --- backends ------------------------------------------------------------------------------------

def select_backend(backend: str, device: torch.device | str) -> str:
    """The backend that runs for tensors on ``device``: ``backend`` itself (Unavailable with the
    reason when it cannot), or ``auto``'s choice, made once per process and device type."""
    return select_triton_backend(KERNEL_FILE, backend, device)


def _programs(M: int, D: int, device: torch.device) -> int:
    """Persistent backward programs for [M, D] rows at the kernel's launch configuration: a few per
    multiprocessor, never more than there are row blocks."""
    k = _kernel()
    blocks = max(1, -(-M // k.launch_config(D, k.BACKWARD_BLOCK_M)[0]))
    if device.type != "cuda":
        return min(blocks, 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(blocks, sms * k.PROGRAMS_PER_SM)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch backend's statistics and gradients are taken in: the stream's, at least fp32
    (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _fwd_torch(x, r, r_bias, w, b, eps, y_dtype, pad: int = 0):
    acc = _acc(x.dtype)
    sa = x.to(acc) + (r.to(acc) if r_bias is None else r.to(acc) + r_bias.to(acc))
    s = sa.to(x.dtype)          # rounded once into the stream's dtype, and normalised as rounded
    sa = s.to(acc)
    mean = sa.mean(-1)
    sc = sa - mean[:, None]
    var = (sc * sc).mean(-1)
    # A row whose squares overflow (fp32 values past ~1.8e19) has no variance to normalise by: NaN,
    # as torch's layer_norm gives, not the 0.0 that 1/sqrt(inf) would make of every element.
    rstd = torch.where(torch.isinf(var), torch.nan, torch.rsqrt(var + eps))
    y = (sc * rstd[:, None] * w.to(acc) + b.to(acc)).to(y_dtype)
    return s, with_bias_column(y) if pad else y, mean.float(), rstd.float()


def with_bias_column(y: torch.Tensor) -> torch.Tensor:
    """y [M, D] followed by the bias column, [M, D + BIAS_COLUMNS]: a one, then zeros (what ``ones_column``
    writes; the torch backend's, and the input a test or study builds for ``gelu_mlp(bias_column=True)``)."""
    col = torch.zeros(y.shape[0], BIAS_COLUMNS, dtype=y.dtype, device=y.device)
    col[:, 0] = 1
    return torch.cat([y, col], dim=1)


def _bwd_torch(dy, ds, s, w, mean, rstd, r_dtype, r_bias: bool):
    acc = _acc(s.dtype)
    s_hat = (s.to(acc) - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]
    dyf = dy[:, :s.shape[1]].to(acc)   # dy may carry the bias column's (unused) gradient after D
    g = dyf * w.to(acc)
    dx = (g - s_hat * (g * s_hat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True)) * rstd.to(acc)[:, None]
    if ds is not None:
        dx = dx + ds.to(acc)
    sums = [(dyf * s_hat).sum(0), dyf.sum(0)] + ([dx.sum(0)] if r_bias else [])
    dr = _dr_buffer(s, r_dtype)
    if dr.numel():
        dr.copy_(dx)
    return dx.to(s.dtype), dr, torch.stack(sums)


def _dr_buffer(s: torch.Tensor, r_dtype: torch.dtype) -> torch.Tensor:
    """The branch's gradient as the backward op returns it: [M, D] in r's dtype, or nothing (0 elements)
    where r has the stream's dtype and ``_backward`` hands on dx itself."""
    return s.new_empty(0) if r_dtype == s.dtype else torch.empty(s.shape, dtype=r_dtype, device=s.device)


# --- the ops: one node each for torch.compile, fake impls, the autograd formula ---------------------

@torch.library.custom_op("hwlib::add_layer_norm", mutates_args=())
def _fwd_op(x: torch.Tensor, r: torch.Tensor, r_bias: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
            eps: float, y_dtype: torch.dtype, pad: int,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # pad: 0, or BIAS_COLUMNS for y with the bias column after its D columns
    if pad not in (0, BIAS_COLUMNS):   # the kernel's tl.arange(0, PAD) needs a power of two: only these are built
        raise ValueError(f"pad must be 0 or {BIAS_COLUMNS}, got {pad}")
    if backend == "torch":
        return _fwd_torch(x, r, r_bias, weight, bias, eps, y_dtype, pad)
    M, D = x.shape
    s, y = torch.empty_like(x), torch.empty((M, D + pad), dtype=y_dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    _kernel().add_ln_fwd(x, r, weight, bias, eps, s, y, mean, rstd, r_bias)
    return s, y, mean, rstd


@_fwd_op.register_fake
def _(x, r, r_bias, weight, bias, eps, y_dtype, pad, backend):
    M, D = x.shape
    return (torch.empty_like(x), torch.empty((M, D + pad), dtype=y_dtype, device=x.device),
            x.new_empty(M, dtype=torch.float32), x.new_empty(M, dtype=torch.float32))


@torch.library.custom_op("hwlib::add_layer_norm_backward", mutates_args=())
def _bwd_op(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
            rstd: torch.Tensor, r_dtype: torch.dtype, r_bias: bool,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (dx, dr, partial [dw; db] sums [programs, 2, D] (with r_bias [dw; db; dr_bias], [programs, 3, D],
    # dr_bias = the column sums of ds): float32 from the kernel, one partial in the
    # stream's dtype, at least fp32, from the torch backend, so fp64 stays fp64; dr has 0 elements where r has
    # the stream's dtype: _backward hands on dx for it). The sum over the programs is left to
    # the autograd formula, outside this op: compiled, inductor writes it as one of its reductions. Done
    # in here, it ran as an eager column reduction of GPT-2 small's 528 x 1536 partials (3 MB): 0.42 ms
    # a step over 24 calls in step 22's trace on an H100, about 17 us a call.
    if backend == "torch":
        dx, dr, sums = _bwd_torch(dy, ds, s, weight, mean, rstd, r_dtype, r_bias)
        return dx, dr, sums[None]
    k = _kernel()
    dx, dr = torch.empty_like(s), _dr_buffer(s, r_dtype)
    part = k.add_ln_bwd(dy.contiguous(), None if ds is None else ds.contiguous(), s, weight, mean, rstd, dx,
                        dr if dr.numel() else None, _programs(*s.shape, s.device), r_bias=r_bias)
    return dx, dr, part


@_bwd_op.register_fake
def _(dy, ds, s, weight, mean, rstd, r_dtype, r_bias, backend):
    programs, acc = (1, _acc(s.dtype)) if backend == "torch" else (_programs(*s.shape, s.device), torch.float32)
    return (torch.empty_like(s), _dr_buffer(s, r_dtype),
            s.new_empty((programs, 3 if r_bias else 2, weight.shape[0]), dtype=acc))


def _setup_context(ctx, inputs, output):
    _, r, r_bias, weight, bias, _, _, _, backend = inputs
    s, _, mean, rstd = output
    ctx.save_for_backward(s, weight, mean, rstd)
    ctx.r_dtype, ctx.backend, ctx.bias_dtype = r.dtype, backend, bias.dtype
    ctx.r_bias_dtype = None if r_bias is None else r_bias.dtype


def _backward(ctx, ds, dy, _dmean, _drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    has_rb = ctx.r_bias_dtype is not None
    dx, dr, part = torch.ops.hwlib.add_layer_norm_backward(dy, ds, s, weight, mean, rstd, ctx.r_dtype, has_rb,
                                                           ctx.backend)
    sums = part.sum(0).unbind(0)
    drb = sums[2].to(ctx.r_bias_dtype) if has_rb else None
    # dx is s's dtype, x's; where r's is the same, dx is r's gradient too (the op returned no copy)
    if ctx.r_dtype == s.dtype:
        dr = dx
    return dx, dr, drb, sums[0].to(weight.dtype), sums[1].to(ctx.bias_dtype), None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)
fallbacks.register(_fwd_op)
fallbacks.register(_bwd_op)


def add_layer_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
                   *, r_bias: torch.Tensor | None = None, ones_column: bool = False,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, y)``: the new residual stream ``s = x + r`` (x's dtype) and ``y = layer_norm(s, weight,
    bias, eps)``, in autocast's dtype when autocast is on for the device, else in x's.

    ``x`` [..., D] is the residual stream, ``r`` the same shape (a branch's output, of x's dtype or
    narrower); ``weight``, ``bias`` [D]. ``r_bias`` [D], optional, is the branch's output bias, left
    out of its last matmul: then ``s = x + (r + r_bias)`` in x's dtype, and its gradient (the column
    sums of the stream's gradient) comes out of the backward kernel's pass. With ``ones_column``, y is
    ``BIAS_COLUMNS`` wider, [..., D + BIAS_COLUMNS]: y, then a column of ones, then zeros (the bias column
    a following ``gelu_mlp(..., bias_column=True)`` takes its bias gradient from). Non-contiguous inputs
    are made contiguous (a copy)."""
    check_inputs(x, r, weight, bias, eps, r_bias)
    if not isinstance(ones_column, bool):
        raise ValueError(f"ones_column must be a bool, got {ones_column!r}")
    name = resolve_triton_backend(KERNEL_FILE, backend, x.device.type)
    y_dtype = compute_dtype(x)
    shape, D = x.shape, x.shape[-1]
    s, y, _, _ = torch.ops.hwlib.add_layer_norm(x.reshape(-1, D).contiguous(), r.reshape(-1, D).contiguous(),
                                                None if r_bias is None else r_bias.contiguous(),
                                                weight.contiguous(), bias.contiguous(), float(eps), y_dtype,
                                                BIAS_COLUMNS if ones_column else 0, name)
    return s.view(shape), y.view(*shape[:-1], y.shape[-1])


def add_layer_norm_reference(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                             eps: float = 1e-5, r_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec in float64, differentiable: ``s = x + r (+ r_bias)``, ``y = F.layer_norm(s, ...)`` (for
    reference gradients, pass float64 leaves)."""
    s = x.double() + r.double() + (0.0 if r_bias is None else r_bias.double())
    return s, F.layer_norm(s, (s.shape[-1],), weight.double(), bias.double(), eps)


def traffic_bytes(rows: int, width: int, stream_bytes: int = 4, branch_bytes: int = 2) -> dict:
    """Bytes one call moves at its fewest passes (the kernel file's count): forward, backward. A stream
    as narrow as the branch is taken to share its dtype (GPT's bf16 stream): dr is dx, not written."""
    fwd = rows * width * (2 * stream_bytes + 2 * branch_bytes) + 8 * rows
    dr = 0 if stream_bytes == branch_bytes else branch_bytes
    bwd = rows * width * (3 * stream_bytes + branch_bytes + dr) + 8 * rows
    return {"forward": float(fwd), "backward": float(bwd)}
