"""Vision-BDH's sparse encoder and Hebbian gate, each as one op whose matmul does its elementwise work in
its epilogue (``kernels/32_bdh_gates_triton.py``: the formulas and the bytes).

Per application of the shared layer, with x [M, D] the normalised token states (M = B T), E, E_v
[H, D, N] and W [H, N, D]:

    encode:       s = ReLU(x E_h),  q = RoPE(s)                                  [H, M, N] each
    gate_decode:  u = ReLU(a_h E_v,h),  g = s * u,  y = sum_h g_h W_h             y [M, D]

The recipe runs each matmul, then inductor's elementwise kernel over the [H, M, N] result it wrote;
here the result never leaves the tile that computed it. Backward, the decoder's input gradient dg =
dy W_h^T is a matmul too: its epilogue writes dz = dg * s * [u > 0] (the gradient entering E_v's
matmul) and ds = dg * u, the two [H, M, N] tensors the rest of the backward reads, instead of dg.
The other backward matmuls are torch's; the elementwise rest of encode's backward (RoPE's transpose,
the sum of the two gradients of s, the ReLU's mask) is left to the compiler, which fuses it into one
kernel.

Precision is the recipe's under autocast: the operands are cast to its dtype, the matmuls accumulate
in fp32, and every result is rounded to the operands' dtype where the recipe rounds it (s and u before
they are used again).

Backends of the fused matmuls:

===========  ===========================================================================
``triton``   the Triton kernel: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
``torch``    the recipe's formula in torch ops (a matmul, then elementwise ops)
``auto``     ``triton`` on CUDA where Triton loads, else ``torch``
===========  ===========================================================================

``reference_layer`` is the float64 formula that the tests, the notebook and the step's check import.
"""

from __future__ import annotations

import torch

from ...ops import fallbacks
from ...ops.sources import TRITON_BACKENDS, load_python_kernel, read_kernel_source, resolve_triton_backend
from ...precision import compute_dtype

BACKENDS = TRITON_BACKENDS
KERNEL_FILE = "32_bdh_gates_triton.py"
ENCODE, GATE, GATE_GRAD = 0, 1, 2   # the kernel's epilogues


def _kernel():
    return load_python_kernel(KERNEL_FILE)


def kernel_source() -> str:
    """The Triton kernel's file, as it runs (for a notebook to print)."""
    return read_kernel_source(KERNEL_FILE)


def rope_pairs(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """BDH's RoPE of v [..., T, N]: pairs (2i, 2i + 1) rotated by their token's phase (cos, sin [T, N])."""
    rot = torch.stack((-v[..., 1::2], v[..., ::2]), dim=-1).flatten(-2)
    return v * cos + rot * sin


def _by_token(t: torch.Tensor, tokens: int) -> torch.Tensor:
    H, M, N = t.shape
    return t.view(H, M // tokens, tokens, N)


# --- the three matmuls with their epilogues, in torch ops (backend "torch") ------------------------

def _torch_gates(epilogue: int, a, b, s=None, u=None, cos=None, sin=None, tokens: int = 1):
    H = b.shape[0]
    a3 = a.expand(H, *a.shape) if a.dim() == 2 else a
    z = torch.bmm(a3, b)
    if epilogue == ENCODE:
        s = torch.relu(z)
        return s, rope_pairs(_by_token(s, tokens), cos, sin).view_as(s)
    if epilogue == GATE:
        u = torch.relu(z)
        return u, s * u
    return z * s * (u > 0), z * u


def _gates(epilogue: int, backend: str, a, b, **kw):
    if backend == "torch":
        return _torch_gates(epilogue, a, b, **kw)
    return _kernel().gates(epilogue, a, b, **kw)


# --- the ops -------------------------------------------------------------------------------------

@torch.library.custom_op("hwlib::bdh_encode", mutates_args=())
def _encode_op(x: torch.Tensor, enc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: int,
               backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _gates(ENCODE, backend, x, enc, cos=cos, sin=sin, tokens=tokens)


@_encode_op.register_fake
def _(x, enc, cos, sin, tokens, backend):
    out = x.new_empty((enc.shape[0], x.shape[0], enc.shape[2]))
    return out, torch.empty_like(out)


def _encode_setup(ctx, inputs, output):
    x, enc, cos, sin, tokens, backend = inputs
    ctx.save_for_backward(x, enc, cos, sin, output[0])
    ctx.tokens = tokens


def _encode_backward(ctx, ds, dq):
    """dz = (ds + RoPE^T dq) [s > 0] (RoPE^T = RoPE by the opposite phase); dx = sum_h dz_h E_h^T, dE_h = x^T dz_h."""
    x, enc, cos, sin, s = ctx.saved_tensors
    dv = ds + (rope_pairs(_by_token(dq, ctx.tokens), cos, -sin).view_as(dq))
    dz = torch.where(s > 0, dv, 0.0).to(s.dtype)
    dx = torch.bmm(dz, enc.transpose(1, 2)).sum(0)
    denc = torch.bmm(x.t().expand(enc.shape[0], *x.t().shape), dz)
    return dx, denc, None, None, None, None


_encode_op.register_autograd(_encode_backward, setup_context=_encode_setup)


@torch.library.custom_op("hwlib::bdh_gate_decode", mutates_args=())
def _gate_op(a: torch.Tensor, enc_v: torch.Tensor, s: torch.Tensor, dec: torch.Tensor,
             backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (y, u, g): u and g are kept for the backward
    u, g = _gates(GATE, backend, a, enc_v, s=s)
    return torch.bmm(g, dec).sum(0), u, g


@_gate_op.register_fake
def _(a, enc_v, s, dec, backend):
    return a.new_empty((a.shape[1], dec.shape[2])), torch.empty_like(s), torch.empty_like(s)


@torch.library.custom_op("hwlib::bdh_gate_grad", mutates_args=())
def _gate_grad_op(dy: torch.Tensor, dec: torch.Tensor, s: torch.Tensor, u: torch.Tensor,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    # (dz, ds): dg = dy W_h^T, rounded as the recipe's bmm rounds it, then its two products
    return _gates(GATE_GRAD, backend, dy, dec.transpose(1, 2), s=s, u=u)


@_gate_grad_op.register_fake
def _(dy, dec, s, u, backend):
    return torch.empty_like(s), torch.empty_like(s)


def _gate_setup(ctx, inputs, output):
    a, enc_v, s, dec, backend = inputs
    _, u, g = output
    ctx.save_for_backward(a, enc_v, s, dec, u, g)
    ctx.backend = backend
    ctx.set_materialize_grads(False)   # u and g are outputs for the backward only


def _gate_backward(ctx, dy, _du, _dg):
    if dy is None:
        return None, None, None, None, None
    a, enc_v, s, dec, u, g = ctx.saved_tensors
    dy = dy.to(g.dtype)
    dz, ds = torch.ops.hwlib.bdh_gate_grad(dy, dec, s, u, ctx.backend)
    H = dec.shape[0]
    ddec = torch.bmm(g.transpose(1, 2), dy.expand(H, *dy.shape))
    da = torch.bmm(dz, enc_v.transpose(1, 2))
    denc_v = torch.bmm(a.transpose(1, 2), dz)
    return da, denc_v, ds, ddec, None


_gate_op.register_autograd(_gate_backward, setup_context=_gate_setup)
for _op in (_encode_op, _gate_op, _gate_grad_op):
    fallbacks.register(_op)


# --- what the model calls ------------------------------------------------------------------------

def check_shapes(x: torch.Tensor, enc: torch.Tensor, tokens: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [M, D] tensor (M = B T tokens), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(enc, torch.Tensor) or enc.dim() != 3 or enc.shape[1] != x.shape[1]:
        raise ValueError(f"the encoder must be [H, D, N] with D = x's {x.shape[1]}, got "
                         f"{tuple(enc.shape) if isinstance(enc, torch.Tensor) else type(enc).__name__}")
    if enc.shape[2] % 2:
        raise ValueError(f"the encoder's N ({enc.shape[2]}) must be even: RoPE rotates pairs of neurons")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1 or x.shape[0] % tokens:
        raise ValueError(f"tokens must be a positive integer dividing x's M = {x.shape[0]}, got {tokens!r}")


def encode(x: torch.Tensor, enc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: int, *,
           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(s, q) [H, M, N]: s = ReLU(x E_h) and q = RoPE(s) for x [M, D] (row m is token m % ``tokens``),
    E [H, D, N], cos and sin [tokens, N]."""
    check_shapes(x, enc, tokens)
    if tuple(cos.shape) != (tokens, enc.shape[2]) or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must be [tokens, N] = [{tokens}, {enc.shape[2]}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    name = resolve_triton_backend(KERNEL_FILE, backend, x.device.type)
    dtype = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):   # the op's own casts, as autocast would make them
        return torch.ops.hwlib.bdh_encode(*(t.to(dtype).contiguous() for t in (x, enc, cos, sin)), tokens, name)


def gate_decode(a: torch.Tensor, enc_v: torch.Tensor, s: torch.Tensor, dec: torch.Tensor, *,
                backend: str = "auto") -> torch.Tensor:
    """y [M, D] = sum_h (s_h * ReLU(a_h E_v,h)) W_h for a [H, M, D], E_v [H, D, N], s [H, M, N], W [H, N, D]."""
    H, M, D = a.shape
    if tuple(enc_v.shape[:2]) != (H, D) or tuple(s.shape) != (H, M, enc_v.shape[2]) or \
            tuple(dec.shape) != (H, enc_v.shape[2], D):
        raise ValueError(f"a [H, M, D], E_v [H, D, N], s [H, M, N] and W [H, N, D] must agree, got "
                         f"{tuple(a.shape)}, {tuple(enc_v.shape)}, {tuple(s.shape)} and {tuple(dec.shape)}")
    name = resolve_triton_backend(KERNEL_FILE, backend, a.device.type)
    dtype = compute_dtype(a)
    with torch.autocast(a.device.type, enabled=False):
        y, _, _ = torch.ops.hwlib.bdh_gate_decode(*(t.to(dtype).contiguous() for t in (a, enc_v, s, dec)), name)
    return y


# --- the float64 reference -------------------------------------------------------------------------

def reference_encode(x, enc, cos, sin, tokens: int):
    """(s, q) in float64, differentiable: the recipe's formula (``hwlib.workloads.vit_bdh``)."""
    s = torch.relu(torch.bmm(x.double().expand(enc.shape[0], *x.shape), enc.double()))
    return s, rope_pairs(_by_token(s, tokens), cos.double(), sin.double()).view_as(s)


def reference_gate_decode(a, enc_v, s, dec):
    """y in float64, differentiable: sum_h (s_h * ReLU(a_h E_v,h)) W_h."""
    g = s.double() * torch.relu(torch.bmm(a.double(), enc_v.double()))
    return torch.bmm(g, dec.double()).sum(0)


# (H, M, D, N, tokens): sizes that are multiples of nothing, one token, one neuron pair, one row among them
ODD_SIZES = ((3, 26, 7, 10, 13), (2, 130, 19, 34, 65), (1, 1, 1, 2, 1))


def odd_size_rows(seed: int = 0, sizes=ODD_SIZES, backend: str = "auto", device="cpu") -> list[dict]:
    """Both ops in fp32 (``backend``, on ``device``) against the float64 formulas on fresh random inputs at
    ``sizes``: the outputs, and every input's gradient under random incoming gradients (relative norm
    differences)."""
    from ...workloads.vit_bdh import rope_tables
    g = torch.Generator().manual_seed(seed)
    rows = []
    for H, M, D, N, T in sizes:
        cos, sin = (t.to(device) for t in rope_tables(N, T))
        ins = {"x": torch.randn(M, D, generator=g, dtype=torch.float64),
               "E": torch.randn(H, D, N, generator=g, dtype=torch.float64) / D ** 0.5,
               "a": torch.randn(H, M, D, generator=g, dtype=torch.float64),
               "E_v": torch.randn(H, D, N, generator=g, dtype=torch.float64) / D ** 0.5,
               "W": torch.randn(H, N, D, generator=g, dtype=torch.float64) / N ** 0.5}
        ws, wq, wy = (torch.randn(H, M, N, generator=g, dtype=torch.float64),
                      torch.randn(H, M, N, generator=g, dtype=torch.float64),
                      torch.randn(M, D, generator=g, dtype=torch.float64))
        ins, ws, wq, wy = {k: v.to(device) for k, v in ins.items()}, ws.to(device), wq.to(device), wy.to(device)
        outs = {}
        for kind, dt in (("op", torch.float32), ("ref", torch.float64)):
            t = {k: v.to(dt).requires_grad_() for k, v in ins.items()}
            if kind == "op":
                s, q = encode(t["x"], t["E"], cos, sin, T, backend=backend)
                y = gate_decode(t["a"], t["E_v"], s, t["W"], backend=backend)
            else:
                s, q = reference_encode(t["x"], t["E"], cos, sin, T)
                y = reference_gate_decode(t["a"], t["E_v"], s, t["W"])
            ((s * ws.to(dt)).sum() + (q * wq.to(dt)).sum() + (y * wy.to(dt)).sum()).backward()
            outs[kind] = {"s": s.detach(), "q": q.detach(), "y": y.detach(),
                          **{f"d{k}": v.grad for k, v in t.items()}}
        errs = {k: ((outs["op"][k].double() - v).norm() / v.norm().clamp_min(1e-300)).item()
                for k, v in outs["ref"].items()}
        rows.append({"H, M, D, N, T": (H, M, D, N, T), **{f"rel err {k}": v for k, v in errs.items()},
                     "within tolerance": all(v < 1e-5 for v in errs.values())})
    return rows
