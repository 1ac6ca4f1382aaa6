"""The fused LM head + cross-entropy (``hwlib.steps.s17_fused_lm_head.op``) with its three GEMMs in FP8.

``fused_linear_cross_entropy_fp8(h, weight, targets)`` computes what ``fused_linear_cross_entropy``
does, the mean of ``F.cross_entropy(h @ weight[:vocab].T, targets, ignore_index=...)`` and its
gradients, with FP8 operands for ``torch._scaled_mm``. For each chunk c of C rows:

    z_c          = e4m3(h_c) e4m3(W)^T        fast accumulation, bf16 out       2 C V_pad D FLOPs
    loss_c, lse  = one read of z_c            (17_linear_ce_triton.py's row pass)
    P_c, P_c^T   = e5m2(softmax * 57344) off the targets, from one more read of z_c, in both layouts
                                              (kernels/26_ce_grad_fp8_triton.py)
    dh_c         = P_c e4m3(W) + (p_t - 1) W8[t]          fp32 accumulation, out in h's dtype  2 C V_pad D
    dW          += P_c^T e4m3(h_c), + (p_t - 1) h8_n into row t_n                        2 C V_pad D

The gradient is softmax - onehot(t); its target entries p_t - 1 (p_t = exp(-loss_n), from the row
pass) stay out of FP8: a row of W (of h) per token, gathered (scattered) from the same e4m3 operands
and weighted in fp32. In e5m2 they would round on a grid 1/7 apart near -1, and trained that way
GPT-2's loss fell far behind the bf16 head's (the kernel's doc; ``hwlib.steps.s26_fp8_head.study``).

Scales: h and W one each (per tensor), from their amax on the device; the probabilities a static
one, since every entry lies in [0, 1] (no amax pass over the logits, no sync). The
mean's weight 1 / #targets and the inverse scales go to ``_scaled_mm``. FP8 tensor cores on Hopper
take K-major operands only, so the backward's matmuls need W^T, h_c^T and P_c^T laid out with the
reduction dimension contiguous: W is quantized into both layouts once a call, h_c once a chunk, and
P_c written in both by the gradient kernel (see ``hwlib.steps.s18_fp8.op`` for the same layouts in a linear).

Bytes a logit (bf16 z): the GEMM writes 2; the row pass reads 2; the gradient pass reads 2 and
writes 1 + 1; the two backward GEMMs read 1 each. The bf16 head (``linear_ce`` with its CUDA row
pass) moves 2 + 2 + 2 + 2 + 2: FP8 trades one more read for half the backward's operand bytes and
tensor cores twice as fast. Buffers a chunk: 4 bytes a logit (z, P, P^T), so chunks are sized to
``CHUNK_BYTES`` of them (GPT-2 small's 16,384 x 50,304 logits fit one chunk: no dW accumulation).
Chunks small enough for their logits to stay in the 50 MB L2 between the GEMM and the two passes
over them are slower, not faster: at GPT-2's shape on an H100 the forward GEMM, the row pass and the
gradient pass took 2.96 ms in one chunk, 3.12 in chunks of 4,096 rows, 3.46 of 1,024 and 4.09 of 512
(smaller GEMMs and launches, and the passes did not speed up from L2). Nor does running the passes of one
chunk beside the GEMMs of the next, on a second stream: on an H100 the whole head (forward and backward)
took 4.98 ms in one chunk on one stream and 5.07-6.10 ms in 1-8 chunks on two, 5.20-5.44 with cuBLAS told
to leave 8-32 SMs free (torch's SM carve-out). Its GEMMs are persistent kernels (cuBLAS's nvjet) that hold
every SM, and the forward GEMM writes the bf16 logits at about 1.5 TB/s, so the passes, bound by the
same memory, found neither SMs nor bandwidth to spare: profiled in 4 chunks, the gradient pass took 361 us a
chunk and the row pass 210, against 308 and 143 for a quarter of their one-chunk times in step 26.

Precision (measured on GPUs by notebook 26 against float64): e4m3 keeps 3 mantissa bits, so the
logits move by a few percent of their size (``hwlib.steps.s18_fp8.study``'s head matmuls: 3.8% relative
Frobenius against 0.17% in bf16); e5m2 probabilities keep 2. The backward's GEMMs accumulate in fp32:
with fast accumulation there (K = 50,304 and 16,384 at GPT-2's shape) GPT-2's loss fell far behind
the bf16 head's over 300 steps on an H100, as with the target entries in e5m2. The step that uses
this op states and justifies its tolerance by the loss curves it moves (``hwlib.steps``).

Shapes: ``_scaled_mm`` on CUDA needs every dimension a multiple of 16. Rows, width and vocabulary
that are not are padded with zeros inside (padding rows get ``ignore_index``: no loss, no gradient),
so any shape gives the exact result of the padded problem; GPT-2's shapes need no padding.

Backends: ``triton`` (the two row kernels; CUDA tensors, or CPU ones under TRITON_INTERPRET=1),
``torch`` (the same passes in torch ops, any device torch._scaled_mm runs on, CPU included), ``auto``
(Triton on CUDA where it loads, else torch). On a CUDA GPU older than sm_89 (Ada, Hopper) there are
no FP8 tensor cores: an Unavailable error with that reason, never a crash inside cuBLAS.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from hwlib.device import ChoiceError, Unavailable, fp8_missing, info

from hwlib.ops import fallbacks
from hwlib.ops.sources import constant_result, load_python_kernel, note_backend, select_triton_backend

from ..s17_fused_lm_head.op import chunk_rows, fake_outputs, prepare, rows_torch, save_grads, scale_saved_grads
from ..s18_fp8.op import E4M3, E5M2, CUDA_MULTIPLE, cast_scaled, scale_for, scaled_mm

BACKENDS = ("auto", "triton", "torch")
GRAD_KERNEL_FILE = "26_ce_grad_fp8_triton.py"
CAST_KERNEL_FILE = "26_fp8_cast_triton.py"
TARGET_KERNEL_FILE = "26_ce_target_fp8_triton.py"
# The row pass here only reads (no gradient written over z): its best launch differs from the bf16
# head's. H100, 16,384 x 50,304 bf16 logits: 2048 columns x 4 warps 0.561 ms, against 0.672 for the
# bf16 head's 8192 x 16 and 0.575-0.92 for 9 others (a sweep of 11; the probe is not in the series).
LSE_BLOCK_V, LSE_WARPS = 2048, 4
ROWS_KERNEL_FILE = "17_linear_ce_triton.py"
OP_NAME = "hwlib::linear_cross_entropy_fp8"
GRAD_QMAX = float(torch.finfo(E5M2).max)     # the probabilities' static scale: 0 <= p <= 1
# Per-chunk buffers (z in bf16, P and P^T in FP8: 4 bytes a logit) at most this many bytes.
CHUNK_BYTES = 4 * 2**30


def _round_up(n: int, m: int = CUDA_MULTIPLE) -> int:
    return -(-n // m) * m


@functools.lru_cache(maxsize=None)
def fp8_problem(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on ``device`` (``hwlib.device.fp8_missing``), or None; asked once per
    device (eager calls resolve the backend on every call)."""
    return fp8_missing(info(device))


def select_backend(backend: str, device: torch.device | str) -> str:
    """The backend that runs on ``device``: ``backend`` itself (Unavailable with the reason where it
    cannot), or ``auto``'s choice; Unavailable on a GPU without FP8 matmuls, whatever the backend."""
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ChoiceError("backend", backend, BACKENDS)
    why = fp8_problem(device)
    if why:
        raise Unavailable(f"fused_linear_cross_entropy_fp8: {why}")
    name = select_triton_backend(GRAD_KERNEL_FILE, backend, device)
    if name == "triton":      # the row pass's, the cast's and the target entries' kernel files must load too
        for f in (ROWS_KERNEL_FILE, CAST_KERNEL_FILE, TARGET_KERNEL_FILE):
            select_triton_backend(f, "triton", device)
    return name


@constant_result
def resolve_backend(backend: str, device_type: str) -> str:
    """``select_backend`` for the op: torch.compile calls it once while tracing and keeps the answer."""
    return note_backend("linear_ce_fp8", select_backend(backend, device_type))


# --- the passes over one chunk's logits ------------------------------------------------------------

def _grad_torch(z, lse, t, g, gt, vocab: int, ignore_index: int) -> None:
    """``ce_grad_fp8_triton.ce_grad_fp8``'s math in torch ops (torch's rounding into e5m2)."""
    p = torch.exp(z.float() - lse[:, None])
    p[:, vocab:] = 0
    p.scatter_(1, t.clamp(0, p.shape[1] - 1)[:, None], 0.0)   # a bad or ignored row is all NaN or 0 below
    ignored = t == ignore_index
    bad = ((t < 0) | (t >= vocab)) & ~ignored
    w = torch.where(bad, float("nan"), torch.where(ignored, 0.0, 1.0))   # the kernel's w_n
    q = (p * (w * GRAD_QMAX)[:, None]).to(E5M2)
    g.copy_(q)
    gt.copy_(q.t())


def _add_target_terms(dh, dw, t, coef, w8, inv_w, h8, inv_h) -> None:
    """``ce_target_fp8_triton.add_target_terms``'s math in torch ops, the gradient's target entries in
    fp32: dh_n += coef_n W8[t_n] / s_w and dW[t_n] += coef_n h8_n / s_h, with ``coef`` (p_t - 1) / #targets
    (0 for an ignored row, added at row 0; NaN for a bad one)."""
    rows = t.clamp(0, w8.shape[0] - 1)   # ignored and bad targets: coef 0 or NaN, at any valid row
    w_t = w8.view(torch.uint8).index_select(0, rows).view(w8.dtype).to(torch.float32)
    dh.copy_(dh.to(torch.float32).add_(w_t.mul_((coef * inv_w)[:, None])))    # summed in fp32, rounded once
    dw.index_add_(0, rows, h8.to(torch.float32).mul_((coef * inv_h)[:, None]))


class Passes(NamedTuple):
    """A backend's four passes, each called as the Triton kernels' Python faces are."""
    rows: Callable          # loss and log-sum-exp of each row (linear_ce_triton.ce_rows_)
    grad: Callable          # the off-target probabilities in FP8 in both layouts (ce_grad_fp8_triton.ce_grad_fp8)
    cast_both: Callable     # a tensor in FP8 in both layouts (fp8_cast_triton.cast_both)
    targets: Callable       # the target entries into dh and dW (ce_target_fp8_triton.add_target_terms)


def _cast_both_torch(x, scale, dtype):
    return cast_scaled(x, scale, dtype), cast_scaled(x.t(), scale, dtype)


def passes(backend: str) -> Passes:
    """The four passes the chunk loop runs outside its GEMMs, for ``backend`` ("triton" or "torch"): what the
    op calls, and what a study times alone (``hwlib.steps.s26_fp8_head.study``)."""
    if backend not in ("triton", "torch"):
        raise ChoiceError("backend", backend, ("triton", "torch"))
    if backend == "triton":
        rows = functools.partial(load_python_kernel(ROWS_KERNEL_FILE).ce_rows_, block_v=LSE_BLOCK_V, num_warps=LSE_WARPS)
        return Passes(rows, load_python_kernel(GRAD_KERNEL_FILE).ce_grad_fp8,
                       load_python_kernel(CAST_KERNEL_FILE).cast_both, load_python_kernel(TARGET_KERNEL_FILE).add_target_terms)
    return Passes(rows_torch, _grad_torch, _cast_both_torch, _add_target_terms)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` [r, c] zero-padded to [rows, cols] (``x`` itself when no padding is needed)."""
    if tuple(x.shape) == (rows, cols):
        return x
    out = x.new_zeros(rows, cols)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| in one reduction (``x.abs().amax()`` writes |x| first: a pass over W's 154 MB more)."""
    return torch.linalg.vector_norm(x, float("inf"))


def _chunk_loop(h, w, t, vocab, ignore_index, chunk, backend, need_grad, cdt):
    """(mean loss, dh in h's dtype, dW in w's dtype) of a [N, D] h; see the module doc."""
    N, D = h.shape
    V = w.shape[0]
    Np, Dp, Vp = _round_up(N), _round_up(D), _round_up(V)
    hp = _padded(h, Np, Dp)
    tp = t if Np == N else torch.cat([t, t.new_full((Np - N,), ignore_index)])
    n_valid = (t != ignore_index).sum()
    mean_w = 1.0 / n_valid.clamp_min(1).to(torch.float32)
    # One scale per tensor, on the device: W's both layouts now, h's chunk by chunk.
    wp = _padded(w, Vp, Dp)
    s_w = scale_for(_amax(wp), E4M3)
    ps = passes(backend)
    w8, wt8 = ps.cast_both(wp, s_w, E4M3)
    s_h = scale_for(_amax(hp), E4M3)
    inv_w, inv_h = s_w.reciprocal(), s_h.reciprocal()
    inv_g = (mean_w / GRAD_QMAX).reshape(())
    rows = _round_up(min(chunk, Np))    # a multiple of 16, like every dimension _scaled_mm takes on CUDA
    losses = torch.empty(Np, dtype=torch.float32, device=h.device)
    lse = torch.empty(rows, dtype=torch.float32, device=h.device)
    unused_scale = torch.ones(1, dtype=torch.float32, device=h.device)   # the row pass writes no gradient
    ghs, gw = [], None
    for r0 in range(0, Np, rows):
        r1 = min(Np, r0 + rows)
        C, hc = r1 - r0, hp[r0:r1]
        h8, ht8 = ps.cast_both(hc, s_h, E4M3)
        z = scaled_mm(h8, inv_h, w8, inv_w, cdt, fast_accum=True)
        ps.rows(z, tp[r0:r1], losses[r0:r1], unused_scale, vocab, ignore_index, write_grad=False,
                lse_out=lse[:C])
        if not need_grad:
            continue
        g = torch.empty(C, Vp, dtype=E5M2, device=h.device)
        gt = torch.empty(Vp, C, dtype=E5M2, device=h.device)
        ps.grad(z, lse[:C], tp[r0:r1], g, gt, vocab, ignore_index)
        del z
        gh = scaled_mm(g, inv_g, wt8, inv_w, h.dtype)
        dw = scaled_mm(gt, inv_g, ht8, inv_h, torch.float32)
        del g, gt
        # (p_t - 1) / #targets: 0 on an ignored row (its loss is 0), NaN on a bad one (its loss is NaN)
        coef = torch.expm1(-losses[r0:r1]) * mean_w
        ps.targets(gh, dw, tp[r0:r1], coef, w8, inv_w, h8, inv_h)
        ghs.append(gh)
        gw = dw if gw is None else gw.add_(dw)
    loss = losses[:N].sum() / n_valid           # NaN when every target is ignored, as F.cross_entropy
    if not need_grad:
        return loss, h.new_empty(0), w.new_empty(0)
    gh = ghs[0] if len(ghs) == 1 else torch.cat(ghs)
    if (Np, Dp) != (N, D):
        gh = gh[:N, :D].contiguous()
    return loss, gh, gw[:V, :D].to(w.dtype).contiguous()


# --- the op ----------------------------------------------------------------------------------------

@torch.library.custom_op(OP_NAME, mutates_args=())
def _linear_ce_fp8_op(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int, ignore_index: int,
                      chunk: int, backend: str, need_grad: bool,
                      compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(h.device.type, enabled=False):
        return _chunk_loop(h, w, targets, vocab, ignore_index, chunk, backend, need_grad, compute_dtype)


@_linear_ce_fp8_op.register_fake
def _(h, w, targets, vocab, ignore_index, chunk, backend, need_grad, compute_dtype):
    return fake_outputs(h, w, need_grad, compute_dtype)


_linear_ce_fp8_op.register_autograd(scale_saved_grads, setup_context=save_grads)
fallbacks.register(_linear_ce_fp8_op)


def fused_linear_cross_entropy_fp8(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                   vocab: int | None = None, ignore_index: int = -100, chunk: int | None = None,
                                   backend: str = "auto") -> torch.Tensor:
    """``hwlib.steps.s17_fused_lm_head.op.fused_linear_cross_entropy`` with FP8 GEMMs (see the module doc): the same
    arguments, checks and errors. The logits come out of their GEMM in autocast's dtype when autocast
    is on, else in h's; ``chunk``: rows per chunk (default: as many as ``CHUNK_BYTES`` allows)."""
    a = prepare(h, weight, targets, vocab, ignore_index, chunk)
    if a.cdt not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the logits' dtype must be bfloat16, float16 or float32 (FP8 GEMM outputs), got {a.cdt}")
    name = resolve_backend(backend, h.device.type)
    rows = chunk_rows(_round_up(a.h.shape[0]), _round_up(a.w.shape[0]), 4, chunk, budget=CHUNK_BYTES)
    loss, _, _ = torch.ops.hwlib.linear_cross_entropy_fp8(a.h, a.w, a.t, a.vocab, int(ignore_index), rows, name,
                                                          a.need_grad, a.cdt)
    return loss


def linear_cross_entropy_fp8_reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, vocab: int | None = None,
                                       ignore_index: int = -100):
    """(loss, dh, dW) in float64 from the FP8-rounded operands the op uses, where only the rounding of
    the logits (to bf16) and of the gradient's entries (to e5m2) is left out: what the op computes
    when its accumulation is exact. Per-tensor scales for h and W, the static one for the gradient."""
    from ..s18_fp8.op import fake_quantize
    vocab = w.shape[0] if vocab is None else vocab
    h2, t2 = h.reshape(-1, h.shape[-1]), t.reshape(-1).long()
    hq, wq = fake_quantize(h2, E4M3), fake_quantize(w, E4M3)
    z = hq @ wq[:vocab].t()
    keep = t2 != ignore_index
    n = keep.sum().clamp_min(1)
    lse = torch.logsumexp(z, dim=1)
    safe = torch.where(keep, t2, 0)
    loss = ((lse - z.gather(1, safe[:, None])[:, 0]) * keep).sum() / keep.sum()
    g = torch.exp(z - lse[:, None])
    g.scatter_add_(1, safe[:, None], -torch.ones_like(g[:, :1]))
    g = g * keep[:, None] / n
    dh = g @ wq[:vocab]
    dw = torch.zeros_like(w, dtype=torch.float64)
    dw[:vocab] = g.t() @ hq
    return loss, dh.reshape(h.shape), dw
