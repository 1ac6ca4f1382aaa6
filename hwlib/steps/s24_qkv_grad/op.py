"""Causal self-attention from its input through the QKV projection, as one op whose backward packs the
projection's gradient and sums its bias's in one pass: ``y = attention(split(x W^T + b))``.

GPT's attention projects x [N, C] (N = B T tokens) to qkv [N, 3C], reads q, k, v out of it as [B, H,
T, D] views and runs fused attention on them. Backward, the attention returns dq, dk, dv as tensors of
their own; compiled, inductor packs them back into qkv's layout in one kernel and sums the bias's
gradient over the tokens in another, which reads them again. This op keeps the projection and the
attention together so that its backward can do both in one pass
(``kernels/24_qkv_grad_triton.py``: the formulas and bytes). The projection's matmuls are torch's
(cuBLAS, with the bias in the forward matmul's epilogue, as ``F.linear``); the attention is torch's
fused kernel for the device, called directly: cuDNN's on CUDA (what SDPA dispatches to on an H100),
the flash-attention CPU kernel on a CPU. Being called directly, it ignores SDPA's backend choice
(``torch.nn.attention.sdpa_kernel``).

Precision is the unfused path's under autocast: the operands are cast to its dtype, the attention
and the matmuls accumulate in fp32, and the bias gradient is summed in fp32 and rounded once into the
bias's dtype (autocast's cast then takes it to the fp32 parameter, as for the unfused bias).

Backends of the gradient's packing (the attention and the matmuls are the same in both):

===========  ===========================================================================
``triton``   the Triton kernel: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
``torch``    a concatenation and a column sum in torch ops (two passes)
``auto``     ``triton`` on CUDA where Triton loads, else ``torch``
===========  ===========================================================================

Both directions are ``torch.library.custom_op``s (``hwlib::qkv_attention`` and its backward) with fake
impls, so torch.compile keeps each as one node and CUDA graphs capture them.
"""

from __future__ import annotations

import functools

import torch

from ...device import Unavailable, info, supports_cudnn_attention
from ...ops import fallbacks
from ...ops.sources import (TRITON_BACKENDS, constant_result, load_python_kernel, read_kernel_source,
                            resolve_triton_backend, select_triton_backend)
from ...precision import compute_dtype

BACKENDS = TRITON_BACKENDS
KERNEL_FILE = "24_qkv_grad_triton.py"


def _kernel():
    return load_python_kernel(KERNEL_FILE)


def kernel_source() -> str:
    """The Triton kernel's file, as it runs (for a notebook to print)."""
    return read_kernel_source(KERNEL_FILE)


def select_backend(backend: str, device: torch.device | str) -> str:
    """The packing backend that runs for tensors on ``device`` (``hwlib.ops.sources``' rules)."""
    return select_triton_backend(KERNEL_FILE, backend, device)


@constant_result
def attention_problem(device_type: str) -> str | None:
    """Why this op cannot run its fused attention on tensors of ``device_type`` ("cuda": the current
    GPU), or None: cuDNN's attention on CUDA (sm_80 or newer, cuDNN 9), the flash-attention kernel on a
    CPU. torch.compile calls it once while tracing and keeps its answer as a constant."""
    return _attention_problem(device_type)


@functools.lru_cache(maxsize=None)
def _attention_problem(device_type: str) -> str | None:
    # asked once per process and device type: an eager step asks on every forward
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        return f"no fused attention kernel of torch's is called for {device_type} tensors"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if not supports_cudnn_attention(di := info("cuda")):
        return (f"cuDNN's fused attention needs an sm_80 or newer GPU and cuDNN 9; {di.name} is sm_"
                f"{''.join(map(str, di.capability))} with cuDNN {di.versions.get('cudnn')}")
    return None


# cuDNN's fused attention kernels: 16-bit operands, head widths a multiple of 8 up to 128
CUDA_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 128


def fit_problem(device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why this call's operands do not suit the fused attention kernel, or None."""
    if device_type != "cuda":
        return None
    if dtype not in CUDA_DTYPES:
        return f"cuDNN's fused attention takes bf16 or fp16 operands, got {dtype} (run under autocast)"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"cuDNN's fused attention takes head widths that are multiples of 8 up to {MAX_HEAD_DIM}, got {head_dim}"
    return None


# --- inputs --------------------------------------------------------------------------------------

def check_inputs(x, weight, bias, n_head) -> None:
    """A clear ValueError naming the argument unless shapes, dtypes and devices fit."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if x.dim() != 3 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must be [B, T, C] with at least one sequence and one token, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    if not isinstance(n_head, int) or isinstance(n_head, bool) or n_head < 1 or C % n_head:
        raise ValueError(f"n_head must be a positive integer dividing C = {C}, got {n_head!r}")
    if tuple(weight.shape) != (3 * C, C):
        raise ValueError(f"weight must be [3C, C] = [{3 * C}, {C}] (x's last dimension C), got {tuple(weight.shape)}")
    if tuple(bias.shape) != (3 * C,):
        raise ValueError(f"bias must be [3C] = [{3 * C}], got {tuple(bias.shape)}")
    if not (x.device == weight.device == bias.device):
        raise ValueError(f"x, weight and bias must be on one device, got {x.device}, {weight.device}, {bias.device}")


# --- the attention kernels, called directly --------------------------------------------------------

def _heads(qkv: torch.Tensor, T: int, n_head: int):
    """q, k, v as [B, H, T, D] views of qkv [B T, 3C] (no copy)."""
    N, C3 = qkv.shape
    C = C3 // 3
    return [t.view(N // T, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=1)]


def _attend(q, k, v):
    """(out [B, H, T, D], logsumexp, philox seed, philox offset) of causal attention, no dropout."""
    if q.device.type == "cuda":
        out, lse, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0,
                                                                                        True, False)
    else:
        (out, lse), seed, offset = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True), None, None
    # no dropout: the seeds are unused; an op's outputs must be tensors of their own
    none = lambda t: t if t is not None else torch.empty(0, dtype=torch.int64, device=q.device)
    return out, lse, none(seed), none(offset)


def _attend_backward(dout, q, k, v, out, lse, seed, offset):
    """(dq, dk, dv) of ``_attend``."""
    if q.device.type == "cuda":
        T = q.shape[2]
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, None, None, T, T, 0.0, True)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True)


# --- the ops -------------------------------------------------------------------------------------

def _forward(x, weight, bias, T, n_head):
    qkv = torch.addmm(bias, x, weight.t())
    out, lse, seed, offset = _attend(*_heads(qkv, T, n_head))
    return qkv, out, lse, seed, offset


@torch.library.custom_op("hwlib::qkv_attention", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, T: int, n_head: int,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # (qkv, out, lse, seed, offset): qkv and the attention's own outputs are kept for the backward
    return _forward(x, weight, bias, T, n_head)


@_fwd_op.register_fake
def _(x, weight, bias, T, n_head, backend):
    return _forward(x, weight, bias, T, n_head)   # every op inside has a meta kernel: the same shapes and strides


def backward_packed(dout, qkv, out, lse, seed, offset, T: int, n_head: int, backend: str):
    """(dqkv [N, 3C], partial column sums of dqkv [rows, 3C]): the attention's backward, then dq, dk, dv
    packed into qkv's layout and summed over the tokens in one pass (the Triton kernel), or in two
    (torch). The sum of the partials over their rows (db) is left to the autograd formula, where
    torch.compile writes it as one small reduction."""
    dq, dk, dv = _attend_backward(dout, *_heads(qkv, T, n_head), out, lse, seed, offset)
    if backend == "torch":
        dqkv = torch.cat([t.transpose(1, 2).reshape(qkv.shape[0], -1) for t in (dq, dk, dv)], dim=1)
        return dqkv, dqkv.sum(0, dtype=_acc(qkv.dtype))[None]
    dqkv = torch.empty_like(qkv)
    return dqkv, _kernel().pack_qkv_grad(dq, dk, dv, dqkv)


@torch.library.custom_op("hwlib::qkv_attention_backward", mutates_args=())
def _bwd_op(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, seed: torch.Tensor,
            offset: torch.Tensor, T: int, n_head: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return backward_packed(dout, qkv, out, lse, seed, offset, T, n_head, backend)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@_bwd_op.register_fake
def _(dout, qkv, out, lse, seed, offset, T, n_head, backend):
    rows = 1 if backend == "torch" else _kernel().row_blocks(qkv.shape[0])
    return torch.empty_like(qkv), qkv.new_empty((rows, qkv.shape[1]), dtype=_acc(qkv.dtype))


def _setup_context(ctx, inputs, output):
    x, weight, bias, T, n_head, backend = inputs
    qkv, out, lse, seed, offset = output
    ctx.save_for_backward(x, weight, qkv, out, lse, seed, offset)
    ctx.T, ctx.n_head, ctx.backend, ctx.bias_dtype = T, n_head, backend, bias.dtype
    ctx.set_materialize_grads(False)   # qkv, lse and the seeds are outputs for the backward only


def _backward(ctx, _dqkv, dout, _dlse, _dseed, _doffset):
    """dx = dqkv W, dW = dqkv^T x, db = the column sums of dqkv (partials from the packing pass)."""
    if dout is None:
        return None, None, None, None, None, None
    x, weight, qkv, out, lse, seed, offset = ctx.saved_tensors
    dqkv, part = torch.ops.hwlib.qkv_attention_backward(dout, qkv, out, lse, seed, offset, ctx.T, ctx.n_head,
                                                        ctx.backend)
    return dqkv @ weight, dqkv.t() @ x, part.sum(0).to(ctx.bias_dtype), None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)
fallbacks.register(_fwd_op)
fallbacks.register(_bwd_op)


def qkv_attention(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_head: int, *,
                  backend: str = "auto") -> torch.Tensor:
    """Causal self-attention's heads, [B, T, C], from x [B, T, C] through the QKV projection
    ``F.linear(x, weight, bias)`` (weight [3C, C], bias [3C]; q, k, v in that order along 3C): the same
    as ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on its [B, H, T, C / H] heads,
    transposed back to [B, T, C], before any output projection.

    Under autocast the operands are cast to its dtype (as autocast casts ``F.linear``'s), else
    computed in x's dtype. ``Unavailable`` where the device has no fused attention kernel this op calls
    (``attention_problem``); a ValueError where the call's dtype or head width does not suit it
    (``fit_problem``: on CUDA, bf16 or fp16 and head widths multiples of 8 up to 128)."""
    check_inputs(x, weight, bias, n_head)
    why = attention_problem(x.device.type)
    if why:
        raise Unavailable(f"qkv_attention: {why}")
    name = resolve_triton_backend(KERNEL_FILE, backend, x.device.type)
    dev = x.device.type
    dtype = compute_dtype(x)
    B, T, C = x.shape
    fit = fit_problem(dev, dtype, C // n_head)
    if fit:
        raise ValueError(f"qkv_attention: {fit}")
    with torch.autocast(dev, enabled=False):   # the op's own casts, once, as autocast would make them
        xs, w, b = (t.to(dtype).contiguous() for t in (x.reshape(B * T, C), weight, bias))
        _, out, _, _, _ = torch.ops.hwlib.qkv_attention(xs, w, b, T, n_head, name)
    return out.transpose(1, 2).reshape(B, T, C)


def qkv_attention_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_head: int) -> torch.Tensor:
    """The spec in float64, differentiable: the projection, causal softmax attention written out, the
    heads transposed back (for reference gradients, pass float64 leaves)."""
    B, T, C = x.shape
    qkv = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    q, k, v = (t.reshape(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
    att = (q @ k.transpose(-2, -1)) / (C // n_head) ** 0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    att = att.masked_fill(~causal, float("-inf")).softmax(-1)
    return (att @ v).transpose(1, 2).reshape(B, T, C)


def traffic_bytes(tokens: int, width: int, elem: int = 2) -> dict:
    """Bytes of the gradient's packing at one pass (the kernel file's count), and of the unfused pair
    (the packing copy, then the bias gradient's reduction reading dq, dk, dv again)."""
    n = float(tokens * 3 * width * elem)
    return {"fused": 2 * n, "unfused": 3 * n}
