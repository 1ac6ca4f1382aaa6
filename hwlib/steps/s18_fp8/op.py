"""FP8 linear layers through ``torch._scaled_mm``: e4m3 activations and weights in the forward, e5m2
gradients in the backward (per-tensor scales), or e4m3 throughout with row-wise scales.

A linear y = x W^T (x: [M, K], W: [N, K]) is three matmuls per training step:

    forward      y  = x  W^T        [M, K] x [K, N]
    grad input   dx = dy W          [M, N] x [N, K]
    grad weight  dW = dy^T x        [N, M] x [M, K]

each 2 M N K FLOPs. ``torch._scaled_mm(a, b, scale_a, scale_b)`` computes (a * scale_a) @ (b *
scale_b) from FP8 operands and needs ``a`` row-major and ``b`` column-major (on Hopper FP8 tensor
cores both operands are K-major: the "TN" layout). The forward gets both for free (x is row-major,
and W^T of a row-major W is column-major). The backward does not: dx needs W^T row-major, and dW
needs dy^T and x^T row-major. A naive version quantizes, then copies each FP8 tensor through
``.t().contiguous()``: three extra passes over memory, the largest over dy ([M, N]).

Here every tensor is quantized straight into each layout its matmuls need (``quantize`` with
``transposed=True`` writes the transposed FP8 tensor from the high-precision one), and the forward
saves the transposed FP8 copies of x and W that the backward uses, not x and W. Under
``torch.compile`` (the ladder's steps 06+) inductor fuses the amax reduction's consumer, the scale,
the cast and the transposed write into its quantization kernels, so no pass copies an FP8 tensor;
in eager mode the transposed cast is an elementwise op followed by a copy (the naive cost, which
``hwlib.steps.s18_fp8.study`` measures against the compiled one).

Scales are computed on the device from each tensor's amax (no host sync, CUDA-graph safe):
scale = fmax / amax, and ``_scaled_mm`` gets the inverse. e4m3 (``torch.float8_e4m3fn``) keeps 3
mantissa bits up to 448, e5m2 2 bits up to 57344: gradients span a wider range than activations.

Bytes: quantizing an [R, C] bf16 tensor into both layouts (``quantize_both``, one scale per tensor)
reads it once for the amax and once per layout for the cast, and writes 1 byte an element per
layout: 8 bytes an element (10 with an amax pass per layout, as separate ``quantize`` calls do).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...device import Unavailable
from ...precision import compute_dtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
EPS = 1e-12          # amax floor: an all-zero tensor gets a finite scale (and quantizes to zeros)
SCALINGS = ("tensor", "row")
# _scaled_mm's CUDA kernels need every dimension of both operands to be a multiple of 16.
CUDA_MULTIPLE = 16


def _check(t: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in FMAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if t.dim() != 2:
        raise ValueError(f"quantize needs a 2-d tensor, got shape {tuple(t.shape)}")


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps ``amax`` onto ``dtype``'s largest finite value (fp32, on amax's device)."""
    return FMAX[dtype] / amax.float().clamp(min=EPS)


def finite_abs(t: torch.Tensor) -> torch.Tensor:
    """|t| with NaN and infinity as 0: the magnitude a scale is taken from. One infinite element must
    not make the scale 0 (and every row of the product NaN): it stays non-finite in its own rows only."""
    return torch.nan_to_num(t.abs(), nan=0.0, posinf=0.0)


def cast_scaled(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``src * scale`` saturated into ``dtype``'s range and cast, written contiguous (a transposed
    view of ``src`` gives the transposed layout). A NaN or infinite element becomes NaN (FP8 e4m3 has
    no infinity), never a saturated finite value: the product's rows it reaches stay non-finite."""
    x = src.float() * scale
    return (x.clamp(-FMAX[dtype], FMAX[dtype]) + (x - x)).to(dtype).contiguous()   # x - x: 0, or NaN where x is not finite


def quantize(t: torch.Tensor, dtype: torch.dtype, *, transposed: bool = False, rowwise: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` ([R, C]) in ``dtype`` (FP8) and the inverse scale that ``_scaled_mm`` multiplies back.

    ``transposed``: the result is t^T ([C, R]), stored row-major. ``rowwise``: one scale per row of
    the result (the amax over its columns, the matmul's reduction dimension), shape [rows, 1];
    else one per tensor (a 0-d tensor)."""
    _check(t, dtype)
    src = t.t() if transposed else t
    a = finite_abs(src)
    scale = scale_for(a.amax(dim=1, keepdim=True) if rowwise else a.amax(), dtype)
    return cast_scaled(src, scale, dtype), scale.reciprocal()


def quantize_both(t: torch.Tensor, dtype: torch.dtype, *, rowwise: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize(t)`` and ``quantize(t, transposed=True)``: (q, inverse scale, q^T, its inverse
    scale). With one scale per tensor the two layouts share it, so the amax pass over ``t`` runs
    once, not once per layout (row-wise scales reduce over different dimensions: two passes)."""
    if rowwise:
        return (*quantize(t, dtype, rowwise=True), *quantize(t, dtype, transposed=True, rowwise=True))
    _check(t, dtype)
    scale = scale_for(finite_abs(t).amax(), dtype)
    inv = scale.reciprocal()
    return cast_scaled(t, scale, dtype), inv, cast_scaled(t.t(), scale, dtype), inv


def scaled_mm(a8, sa, b8_t, sb, out_dtype, fast_accum: bool = False) -> torch.Tensor:
    """a8 ([M, K] row-major) @ b8_t^T, where ``b8_t`` is [N, K] row-major, so that ``b8_t.t()`` is the
    column-major [K, N] operand ``_scaled_mm`` wants; ``sb`` has one entry per row of ``b8_t``
    (row-wise) or one in all. Row-wise scales of b are laid out [1, N]. On CPU the FP8 values go
    through an fp32 matmul instead: every e4m3 and e5m2 value, and every product of two, is exact in
    fp32, so it is the same product with fp32 accumulation, where torch's CPU ``_scaled_mm`` took 16 s
    for a 1008 x 208 x 3008 product (0.04 GFLOP/s)."""
    sb = sb.reshape(1, -1) if sb.dim() else sb
    if a8.device.type == "cpu":
        return (a8.to(torch.float32) @ b8_t.to(torch.float32).t()).mul_(sa * sb).to(out_dtype)
    return torch._scaled_mm(a8, b8_t.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)


class FP8Matmul(torch.autograd.Function):
    """y = x W^T for 2-d x ([M, K]) and W ([N, K]) with FP8 operands; see the module doc."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype, rowwise):
        grad_dtype = E4M3 if rowwise else E5M2
        # [M, K] with scales per M, and [K, M] (per K); [N, K] (per N) and [K, N] (per K). The
        # transposed ones are saved for the backward, already in the layouts its matmuls need.
        x8, xs, xt8, xts = quantize_both(x, E4M3, rowwise=rowwise)
        w8, ws, wt8, wts = quantize_both(weight, E4M3, rowwise=rowwise)
        ctx.save_for_backward(xt8, xts, wt8, wts)
        ctx.grad_dtype, ctx.rowwise, ctx.w_dtype, ctx.x_dtype = grad_dtype, rowwise, weight.dtype, x.dtype
        # Fast accumulation in the forward only (as torchao does): gradients keep full accumulation.
        return scaled_mm(x8, xs, w8, ws, out_dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        xt8, xts, wt8, wts = ctx.saved_tensors
        dy = dy.contiguous()
        g8, gs, gt8, gts = quantize_both(dy, ctx.grad_dtype, rowwise=ctx.rowwise)   # [M, N] per M, [N, M] per N
        dx = scaled_mm(g8, gs, wt8, wts, ctx.x_dtype)                              # [M, N] x [N, K]
        # Row-wise scaled kernels write bf16 only; per-tensor ones write fp32, the weights' gradient dtype.
        dw = scaled_mm(gt8, gts, xt8, xts, torch.bfloat16 if ctx.rowwise else torch.float32)
        return dx, dw.to(ctx.w_dtype), None, None


@functools.lru_cache(maxsize=None)
def rowwise_unsupported(device_type: str) -> str | None:
    """Why ``torch._scaled_mm`` on ``device_type`` tensors cannot take row-wise scales in this torch, or
    None where it can: asked once per process, of a 16 x 16 product (torch 2.11's CPU kernel, for one,
    takes per-tensor scales only and says so in a RuntimeError)."""
    dev = torch.device(device_type)
    a = torch.ones(16, 16, device=dev).to(E4M3)
    s = torch.ones(16, 1, device=dev)
    try:
        torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.t().contiguous(), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"torch {torch.__version__}'s _scaled_mm takes no row-wise scales on {device_type} tensors ({first})"
    return None


def check_shapes(x: torch.Tensor, weight: torch.Tensor, scaling: str) -> None:
    """A clear error, naming the argument, for inputs ``fp8_linear`` cannot take."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-d [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension ({tuple(x.shape)}) must equal weight's in_features ({weight.shape[1]})")
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, weight on {weight.device}: put them on one device")
    if scaling == "row" and (why := rowwise_unsupported(x.device.type)):
        raise Unavailable(f"scaling='row': {why}; scaling='tensor' runs here")
    if x.device.type == "cuda":
        m = x.numel() // x.shape[-1]
        bad = {n: v for n, v in (("tokens (x's leading dimensions)", m), ("in_features", weight.shape[1]),
                                 ("out_features", weight.shape[0])) if v % CUDA_MULTIPLE}
        if bad:
            raise ValueError(f"torch._scaled_mm on CUDA needs multiples of {CUDA_MULTIPLE}: {bad}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               out_dtype: torch.dtype | None = None, scaling: str = "tensor") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 matmuls. ``out_dtype``: the autocast dtype when autocast
    is on, else x's. The bias is added outside the FP8 matmul, in ``out_dtype``."""
    check_shapes(x, weight, scaling)
    if out_dtype is None:
        out_dtype = compute_dtype(x)
    lead = x.shape[:-1]
    if x.numel() == 0:   # no rows (or K = 0): nothing to scale; the product is empty (or zeros), as F.linear's
        y = x.to(out_dtype) @ weight.to(out_dtype).t()
        return y if bias is None else y + bias.to(y.dtype)
    y = FP8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, out_dtype, scaling == "row")
    y = y.reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run in FP8 (``fp8_linear``): same parameters, names and state dict."""

    scaling: str = "tensor"

    def forward(self, x):
        return fp8_linear(x, self.weight, self.bias, scaling=self.scaling)

    @classmethod
    def from_linear(cls, lin: nn.Linear, scaling: str = "tensor") -> "FP8Linear":
        """The same layer (its very parameters, not copies) with FP8 matmuls."""
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        new.weight, new.bias = lin.weight, lin.bias
        new.scaling = scaling
        return new


MLP_LINEARS = ("mlp_fc", "mlp_proj")


def swap_mlp_linears(model: nn.Module, scaling: str = "tensor") -> int:
    """Replace the MLP linears of every pre-LayerNorm block (``hwlib.workloads.blocks``) in ``model``
    by ``FP8Linear``s sharing their parameters; returns how many were swapped."""
    n = 0
    for m in model.modules():
        for name in MLP_LINEARS:
            lin = getattr(m, name, None)
            if type(lin) is nn.Linear:
                setattr(m, name, FP8Linear.from_linear(lin, scaling))
                n += 1
    return n


# --- references (float64), for tests and the notebook -----------------------------------------------

def fake_quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """``t`` rounded as ``quantize`` rounds it, returned dequantized in float64 (scale per tensor, or
    per slice along ``dim``'s complement when ``dim`` is the reduction dimension)."""
    t64 = t.double()
    amax = t64.abs().amax() if dim is None else t64.abs().amax(dim=dim, keepdim=True)
    scale = (FMAX[dtype] / amax.float().clamp(min=EPS)).double()
    q = (t64 * scale).float().clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)
    return q.double() / scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, rowwise: bool = False):
    """(y, dx, dW) in float64 from the same FP8-rounded operands ``FP8Matmul`` uses: what it computes
    when only its accumulation is exact. Per-tensor scales, or row-wise along each matmul's K."""
    g = E4M3 if rowwise else E5M2
    k1, k0 = (1, 0) if rowwise else (None, None)
    y = fake_quantize(x, E4M3, k1) @ fake_quantize(weight, E4M3, k1).t()
    dx = fake_quantize(dy, g, k1) @ fake_quantize(weight, E4M3, k0)
    dw = fake_quantize(dy, g, k0).t() @ fake_quantize(x, E4M3, k0)
    return y, dx, dw
