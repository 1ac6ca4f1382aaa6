"""The LM head and its cross-entropy as one op that never holds the [tokens, V] logits.

``fused_linear_cross_entropy(h, weight, targets)`` is ``F.cross_entropy(h @ weight[:vocab].T,
targets, ignore_index=...)`` (mean over the targets that are not ignored), computed in chunks of
rows: for each chunk c of C rows

    z_c   = h_c W^T                     GEMM (cuBLAS), [C, V_pad] in the compute dtype
    loss_c, dz_c (written over z_c)     one row-wise pass (``kernels/17_ce_rows.cu``, which reads
                                        each row once, or ``17_linear_ce_triton.py``, twice: the formulas,
                                        bytes and FLOPs), or the same math in torch
    dh_c  = dz_c W                      GEMM
    dW   += dz_c^T h_c                  GEMM, accumulated over the chunks in fp32

so only one chunk's logits ever exist. The forward computes the gradients eagerly (they are saved,
not the logits) and the backward scales them by the incoming gradient of the loss: the backward is
two multiplies. When no gradient is needed (``no_grad``, eval) only the loss is computed.

Precision: h and W are cast to the compute dtype inside (autocast's dtype when autocast is on for
the device, else ``h``'s) and the GEMMs sum in fp32, as ``F.linear`` under autocast does; the
logits are stored in the compute dtype, as the unfused path's are; the log-sum-exp, the loss and
the softmax are fp32 (the unfused path's bf16 logits enter its fp32 log-softmax the same way).
``dh`` and ``dW`` are summed in fp32 and rounded once, into h's and W's own dtypes: for GPT's fp32
LayerNorm output and fp32 tied weight under autocast they are never rounded to bf16, where the
unfused path rounds both GEMM outputs to bf16 before autocast's casts take them back to fp32.

Backends (chosen once per call from the device, never switched on failure):

===========  ===========================================================================
``cuda``     the row pass in CUDA (``hwlib.steps.s17_fused_lm_head.ce_rows_cuda``): Ampere or newer GPUs, bf16 or
             fp16 logits whose padded width is a multiple of 8 and fits a block's shared memory
``triton``   the row pass in Triton: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
``torch``    the same chunk loop with the row pass in torch ops: any device (CPU: the smoke
             ladder's step 17)
``auto``     ``cuda`` where it builds and takes the call's dtype and width, else ``triton`` on
             CUDA where Triton loads, else ``torch``
===========  ===========================================================================

The op is a ``torch.library.custom_op`` (``hwlib::linear_cross_entropy``) with a fake impl and an
autograd formula, so torch.compile keeps it as one node and CUDA graphs capture it: it has no host
sync and no data-dependent shape inside. Targets outside [0, vocab) that are not ``ignore_index``
raise a ValueError in eager calls (one host sync to look at them); under torch.compile or CUDA-graph
capture there is no such look, and those rows give a NaN loss and NaN gradients instead (the
ladder then reports the step ``nonfinite``, never a number).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hwlib.device import ChoiceError, Unavailable

from hwlib.ops import fallbacks
from hwlib.ops.sources import constant_result, load_python_kernel, note_backend, select_triton_backend, warn_fallback

from . import ce_rows_cuda

BACKENDS = ("auto", "cuda", "triton", "torch")
KERNEL_FILE = "17_linear_ce_triton.py"
OP_NAME = "hwlib::linear_cross_entropy"
# Logits of one chunk at most this many bytes: GPT-2 small (16,384 x 50,304, bf16) runs in 4
# chunks of 4,096 rows (412 MB each, against 1.65 GB for all logits). Fewer, larger chunks keep the
# GEMMs efficient and add dW fewer times; smaller ones save memory.
CHUNK_BYTES = 512 * 2**20
ROW_ALIGN = 128                 # chunk rows: a multiple of the GEMM tile


def _kernel():
    return load_python_kernel(KERNEL_FILE)


# --- inputs --------------------------------------------------------------------------------------

def _check_int(name: str, v, lo: int | None = None) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise ValueError(f"{name} must be an int, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def check_inputs(h, weight, targets, vocab, ignore_index, chunk) -> int:
    """A clear ValueError naming the argument unless the shapes, dtypes and devices fit; returns
    the vocabulary (``vocab``, or the weight's rows when None)."""
    for name, x in (("h", h), ("weight", weight), ("targets", targets)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if h.dim() < 2:
        raise ValueError(f"h must be [..., D] with at least one row dimension, got shape {tuple(h.shape)}")
    if not h.is_floating_point():
        raise ValueError(f"h must be floating point, got {h.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, D] (the head's rows), got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    if weight.shape[1] != h.shape[-1]:
        raise ValueError(f"weight is [V, {weight.shape[1]}] but h's last dimension is {h.shape[-1]}: "
                         f"the widths must match")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class indices, got {targets.dtype}")
    if tuple(targets.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}; it must be h's shape without its last "
                         f"dimension, {tuple(h.shape[:-1])}")
    if h.shape[:-1].numel() == 0:
        raise ValueError("h has no rows: the mean cross-entropy of zero tokens is undefined")
    if weight.shape[0] == 0 or h.shape[-1] == 0:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: it needs at least one class and width >= 1")
    if not (h.device == weight.device == targets.device):
        raise ValueError(f"h, weight and targets must be on one device, got {h.device}, {weight.device}, "
                         f"{targets.device}")
    vocab = weight.shape[0] if vocab is None else _check_int("vocab", vocab, 1)
    if vocab > weight.shape[0]:
        raise ValueError(f"vocab = {vocab} exceeds the weight's {weight.shape[0]} rows")
    _check_int("ignore_index", ignore_index)
    if chunk is not None:
        _check_int("chunk", chunk, 1)
    return vocab


def check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """ValueError naming the first target outside [0, vocab) that is not ``ignore_index``. Reads the
    targets on the host: one sync (the caller skips it where a sync cannot happen)."""
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0, 0])
        raise ValueError(f"targets: {int(targets.reshape(-1)[i])} at flat index {i} is not a class in "
                         f"[0, {vocab}) and not ignore_index ({ignore_index})")


def chunk_rows(n_rows: int, width: int, elem_bytes: int, chunk: int | None = None, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk: ``chunk``, or the most rows whose [rows, width] buffers of ``elem_bytes`` an
    element fit ``budget`` bytes (a multiple of ROW_ALIGN), balanced so the chunks are about equal."""
    if chunk is None:
        chunk = max(ROW_ALIGN, budget // (width * elem_bytes) // ROW_ALIGN * ROW_ALIGN)
    chunk = min(chunk, n_rows)
    n_chunks = -(-n_rows // chunk)
    return -(-n_rows // n_chunks)


# --- backends ------------------------------------------------------------------------------------

def select_backend(backend: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                   vocab_padded: int = 64) -> str:
    """The backend that runs for logits of ``dtype`` and width ``vocab_padded`` on ``device``:
    ``backend`` itself (Unavailable where it cannot run on this machine, ValueError where it cannot
    take this dtype or width, each with the reason), or ``auto``'s choice."""
    device = torch.device(device)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ChoiceError("backend", backend, BACKENDS)
    if backend in ("cuda", "auto"):
        problem = ce_rows_cuda.device_problem(device.type)
        fit = None if problem else ce_rows_cuda.fit_problem(dtype, vocab_padded, ce_rows_cuda.smem_limit(device))
        if backend == "cuda":
            if problem:
                raise Unavailable(f"backend 'cuda': {problem}")
            if fit:
                raise ValueError(f"backend 'cuda': {fit}")
            return "cuda"
        if not (problem or fit):
            return "cuda"
        chosen = select_triton_backend(KERNEL_FILE, backend, device)
        if problem and device.type == "cuda":   # the machine, not this call's dtype or width: say so
            warn_fallback("fused_linear_cross_entropy", "cuda", chosen, "cuda", problem)
        return chosen
    return select_triton_backend(KERNEL_FILE, backend, device)


@constant_result
def resolve_backend(backend: str, device_type: str, dtype: torch.dtype, vocab_padded: int) -> str:
    """``select_backend`` for the op's forward: torch.compile calls it once while tracing and keeps its
    answer as a constant (building or loading a kernel is not traceable)."""
    return note_backend("linear_ce", select_backend(backend, device_type, dtype, vocab_padded))


def _rows_pass(backend: str):
    """The row pass of ``backend`` (cuda, triton), called as ``ce_rows_(z, t, loss, scale, vocab,
    ignore_index, write_grad=...)``; None for torch."""
    if backend == "cuda":
        return ce_rows_cuda.ce_rows_
    return _kernel().ce_rows_ if backend == "triton" else None


def rows_torch(z: torch.Tensor, t: torch.Tensor, loss_out: torch.Tensor, scale: torch.Tensor, vocab: int,
               ignore_index: int, write_grad: bool, lse_out: torch.Tensor | None = None) -> None:
    """The Triton row pass's math in torch ops (same results to rounding), in place on ``z``; each
    row's log-sum-exp into ``lse_out`` when given."""
    x = z[:, :vocab].to(loss_out.dtype)      # fp32 (fp64 for fp64 inputs)
    lse = torch.logsumexp(x, dim=1)
    if lse_out is not None:
        lse_out.copy_(lse)
    ignored = t == ignore_index
    bad = ((t < 0) | (t >= vocab)) & ~ignored
    safe = torch.where(ignored | bad, 0, t)
    loss = lse - x.gather(1, safe[:, None])[:, 0]
    nan = torch.full_like(loss, float("nan"))
    loss_out.copy_(torch.where(bad, nan, torch.where(ignored, torch.zeros_like(loss), loss)))
    if write_grad:
        w = torch.where(bad, nan, torch.where(ignored, torch.zeros_like(loss), scale.to(loss.dtype).expand_as(loss)))
        g = torch.exp(x - lse[:, None])
        g.scatter_add_(1, safe[:, None], -(~ignored & ~bad).to(g.dtype)[:, None])
        z[:, :vocab] = (g * w[:, None]).to(z.dtype)
        z[:, vocab:] = 0


# Products rounded once into a wider buffer (dW over the chunks, dh into fp32): newer torch has
# cuBLAS take an fp32 C with bf16 A, B (addmm out_dtype); older torch only an fp32 output (mm
# out_dtype, then one add per chunk); else the bf16 products are added.
_MM_MODES = ("addmm_fp32", "mm_fp32", "add")
_MM_MODE: dict = {}


def _mm_mode(dtype: torch.dtype) -> str:
    """How this torch forms bf16/fp16 products into fp32 on CUDA, tried once per dtype on tiny
    tensors (it reads the result back: a sync, so never inside a CUDA-graph capture, where the
    plain products are added instead; CUDA graphs are recorded after eager warm-up calls)."""
    if dtype not in _MM_MODE:
        if torch.cuda.is_current_stream_capturing():
            return "add"
        _MM_MODE[dtype] = _probe_mm_mode(dtype)
    return _MM_MODE[dtype]


def _probe_mm_mode(dtype: torch.dtype) -> str:
    a = torch.ones(2, 3, dtype=dtype, device="cuda")
    b = torch.ones(3, 2, dtype=dtype, device="cuda")
    c = torch.ones(2, 2, dtype=torch.float32, device="cuda")
    try:
        torch.mm(a, b, out_dtype=torch.float32, out=c)
        if not bool((c == 3).all()):
            return "add"
    except (TypeError, RuntimeError, NotImplementedError):
        return "add"
    try:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        if bool((c == 6).all()):
            return "addmm_fp32"
    except (TypeError, RuntimeError, NotImplementedError):
        pass
    return "mm_fp32"


def _mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False,
        mode: str | None = None) -> None:
    """``out = a @ b`` (or ``+=``): a, b in the compute dtype, ``out`` in it or wider, where the products
    are summed in fp32 and rounded once, into ``out``'s dtype. ``mode`` (one of _MM_MODES) is this
    torch's way on CUDA, probed once; given, it is used as is (tests run each on meta tensors)."""
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, beta=1 if accumulate else 0, out=out)
        return
    if mode is None and out.device.type != "cuda":
        # CPU: the product of the (already rounded) compute-dtype values, formed in out's dtype
        prod = a.to(out.dtype) @ b.to(out.dtype)
        out.add_(prod) if accumulate else out.copy_(prod)
        return
    mode = mode or _mm_mode(a.dtype)
    if mode != "add" and not accumulate:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif mode == "addmm_fp32":
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        prod = torch.mm(a, b, out_dtype=out.dtype) if mode == "mm_fp32" else a @ b
        out.add_(prod) if accumulate else out.copy_(prod)


def _forward_backward(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, vocab: int, ignore_index: int,
                      chunk: int, backend: str, need_grad: bool, cdt: torch.dtype):
    """The chunk loop: (mean loss, dh in h's dtype, dW in w's dtype) of a [N, D] h, GEMMs in ``cdt``.
    Autocast is off inside: the dtypes are chosen here (an autocast matmul would round the fp32
    products to bf16)."""
    with torch.autocast(h.device.type, enabled=False):
        return _chunk_loop(h, w, t, vocab, ignore_index, chunk, backend, need_grad, cdt)


def _chunk_loop(h, w, t, vocab, ignore_index, chunk, backend, need_grad, cdt):
    N, D = h.shape
    Vp = w.shape[0]
    wc = w.to(cdt)                                     # no copy when w is already in cdt
    acc = _acc_dtype(cdt)
    n_valid = (t != ignore_index).sum()
    scale = (1.0 / n_valid.clamp_min(1).to(acc)).reshape(1)   # on the device: no sync
    losses = torch.empty(N, dtype=acc, device=h.device)
    elem = cdt.itemsize
    rows = chunk_rows(N, Vp, elem, chunk)
    z_buf = torch.empty(rows, Vp, dtype=cdt, device=h.device)
    gh = torch.empty_like(h) if need_grad else h.new_empty(0)
    gw = torch.empty(Vp, D, dtype=acc, device=h.device) if need_grad else None
    row_pass = _rows_pass(backend)
    for i, r0 in enumerate(range(0, N, rows)):
        r1 = min(N, r0 + rows)
        hc, z = h[r0:r1].to(cdt), z_buf[: r1 - r0]
        torch.mm(hc, wc.t(), out=z)
        if row_pass is not None:
            row_pass(z, t[r0:r1], losses[r0:r1], scale, vocab, ignore_index, write_grad=need_grad)
        else:
            rows_torch(z, t[r0:r1], losses[r0:r1], scale, vocab, ignore_index, need_grad)
        if need_grad:
            _mm(gh[r0:r1], z, wc)                       # dh: fp32 for an fp32 h, as dW
            _mm(gw, z.t(), hc, accumulate=i > 0)
    loss = losses.sum() / n_valid          # NaN when every target is ignored, as F.cross_entropy
    if not need_grad:
        return loss, gh, w.new_empty(0)
    return loss, gh, gw if gw.dtype == w.dtype else gw.to(w.dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Loss, softmax and dW accumulation: fp32, or fp64 for fp64 inputs (the torch backend is then
    exact to float64 rounding; the Triton kernel computes in fp32 whatever it is given)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- the op: one node for torch.compile, its fake impl and its autograd formula -----------------------

@torch.library.custom_op(OP_NAME, mutates_args=())
def _linear_ce_op(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int, ignore_index: int,
                  chunk: int, backend: str, need_grad: bool,
                  compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_backward(h, w, targets, vocab, ignore_index, chunk, backend, need_grad, compute_dtype)


def fake_outputs(h, w, need_grad: bool, compute_dtype: torch.dtype):
    """The (loss, dh, dW) shapes and dtypes of an op of this signature, for its fake impl."""
    loss = h.new_empty((), dtype=_acc_dtype(compute_dtype))
    if not need_grad:
        return loss, h.new_empty(0), w.new_empty(0)
    return loss, torch.empty_like(h), torch.empty_like(w)


@_linear_ce_op.register_fake
def _(h, w, targets, vocab, ignore_index, chunk, backend, need_grad, compute_dtype):
    return fake_outputs(h, w, need_grad, compute_dtype)


def save_grads(ctx, inputs, output):
    """Autograd context of an op that returns (loss, dh, dW), its gradients computed in the forward."""
    _, gh, gw = output
    ctx.save_for_backward(gh, gw)


def scale_saved_grads(ctx, g_loss, _g_gh, _g_gw):
    """The backward of such an op: the saved gradients times the loss's incoming gradient (two
    multiplies); None for its seven non-tensor arguments after h and W."""
    gh, gw = ctx.saved_tensors
    if gh.numel() == 0 and gw.numel() == 0:
        raise RuntimeError("linear_cross_entropy: backward through a call made without gradients "
                           "(no_grad, or neither h nor weight required grad)")
    return (gh * g_loss).to(gh.dtype), (gw * g_loss).to(gw.dtype), None, None, None, None, None, None, None


_linear_ce_op.register_autograd(scale_saved_grads, setup_context=save_grads)
fallbacks.register(_linear_ce_op)


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               vocab: int | None = None, ignore_index: int = -100, chunk: int | None = None,
                               backend: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight[:vocab].T`` against ``targets`` without the logits tensor.

    ``h`` [..., D]; ``weight`` [V_pad, D] (rows past ``vocab`` are padding, never a class: GPT's
    vocabulary padded to a multiple of 64); ``targets`` [...] integer, ``ignore_index`` entries add
    no loss and no gradient, and the mean is over the others (NaN when there are none, as
    ``F.cross_entropy``). ``chunk``: rows per chunk (default: ``chunk_rows``). Non-contiguous
    inputs are made contiguous (a copy). Under autocast the GEMMs run in autocast's dtype."""
    a = prepare(h, weight, targets, vocab, ignore_index, chunk)
    name = resolve_backend(backend, h.device.type, a.cdt, weight.shape[0])
    rows = chunk_rows(a.h.shape[0], a.w.shape[0], a.cdt.itemsize, chunk)
    loss, _, _ = torch.ops.hwlib.linear_cross_entropy(a.h, a.w, a.t, a.vocab, int(ignore_index), rows, name,
                                                      a.need_grad, a.cdt)
    return loss


class Prepared(NamedTuple):
    h: torch.Tensor          # [N, D], contiguous
    w: torch.Tensor          # [V_pad, D], contiguous
    t: torch.Tensor          # [N] int64, contiguous
    vocab: int
    cdt: torch.dtype         # the logits' dtype: autocast's when it is on, else h's
    need_grad: bool


def prepare(h, weight, targets, vocab, ignore_index, chunk) -> Prepared:
    """The checks and layouts a fused head's op gets its arguments in (this module's and
    ``linear_ce_fp8``'s): ValueErrors naming the argument, targets looked at where a sync may happen."""
    vocab = check_inputs(h, weight, targets, vocab, ignore_index, chunk)
    dev_type = h.device.type
    if torch.is_autocast_enabled(dev_type):
        # h and W are cast inside, chunk by chunk, and their gradients come back in their own dtypes
        cdt = torch.get_autocast_dtype(dev_type)
    elif h.dtype != weight.dtype:
        raise ValueError(f"h is {h.dtype} but weight is {weight.dtype}: outside autocast they must match")
    else:
        cdt = h.dtype
    h2 = h.reshape(-1, h.shape[-1]).contiguous()
    t = targets.reshape(-1).to(torch.int64).contiguous()
    w = weight.contiguous()
    if not torch.compiler.is_compiling() and not (dev_type == "cuda" and torch.cuda.is_current_stream_capturing()):
        check_targets(t, vocab, ignore_index)
    need_grad = torch.is_grad_enabled() and (h2.requires_grad or w.requires_grad)
    return Prepared(h2, w, t, vocab, cdt, need_grad)


def linear_cross_entropy_reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, vocab: int | None = None,
                                   ignore_index: int = -100) -> torch.Tensor:
    """The spec in float64: ``F.cross_entropy(h @ w[:vocab].T, t, ignore_index)``, mean over the
    targets that are not ignored; differentiable in ``h`` and ``w`` (for reference gradients, pass
    float64 leaves)."""
    vocab = w.shape[0] if vocab is None else vocab
    logits = h.reshape(-1, h.shape[-1]).double() @ w[:vocab].double().t()
    return F.cross_entropy(logits, t.reshape(-1).long(), ignore_index=ignore_index)


def unfused_linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, vocab: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """The path the fused op replaces, as GPT's head runs it: ``F.linear`` (under the caller's
    autocast), the padded columns sliced off, ``F.cross_entropy``; the [tokens, V] logits exist."""
    vocab = w.shape[0] if vocab is None else vocab
    logits = F.linear(h.reshape(-1, h.shape[-1]), w)
    if vocab != w.shape[0]:
        logits = logits[:, :vocab]
    return F.cross_entropy(logits, t.reshape(-1), ignore_index=ignore_index)


def traffic_bytes(n_rows: int, vocab: int, vocab_padded: int, elem_bytes: int = 2) -> dict:
    """Bytes that pass through logits-sized buffers in one forward + backward, counted, not measured:

    ``row_pass``  the softmax work outside the GEMMs in two reads: the Triton row pass reads the
                  logits twice (V columns each) and writes the gradient (V_pad). An unfused path does
                  at least the same (its log-softmax reads the logits in forward, reads them again and
                  writes the gradient in backward); what it does beyond that depends on what the
                  compiler fuses
    ``row_pass_one_read``  the same in one read: the CUDA row pass holds a row in shared memory
                  between its passes (V_pad read, V_pad written)
    ``gemm``      the GEMMs' own logits traffic (one write, two reads of V_pad): at GPT-2's width
                  each GEMM is compute-bound, so these bytes overlap its FLOPs rather than add time
    ``logits``    one pass over [n_rows, V_pad]
    """
    zp, zv = n_rows * vocab_padded * elem_bytes, n_rows * vocab * elem_bytes
    return {"row_pass": float(2 * zv + zp), "row_pass_one_read": float(2 * zp), "gemm": float(3 * zp),
            "logits": float(zp)}
