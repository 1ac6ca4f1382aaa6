"""GPT's MLP, ``y = W_proj gelu_tanh(W_fc x + b_fc) + b_proj``, with the GELU in the matmuls' epilogues.

Compiled, the unfused MLP moves its widest activations ([tokens, 4 d]) more often than its matmuls
need: the first matmul writes the pre-activation and a pointwise kernel reads it back for the GELU;
in backward the second matmul's input gradient is written and read again beside the pre-activation
by the GELU's backward. cuBLASLt can do the bias and GELU (forward) and the GELU's derivative
(backward) inside the matmuls, on the fp32 accumulators before they are rounded:
``kernels/22_gelu_epilogue.cpp`` (the formulas, layouts, bytes, and what was measured and left
out). The whole MLP is one op because the backward's fusion is into the *second* linear's matmul:
dpre = (dy W_proj) * gelu'(pre); the weight gradients and the bias gradients' column sums are plain
torch ops in its backward formula, which torch.compile sees and compiles.

Precision is the unfused path's under autocast: operands in the autocast dtype (bf16), fp32
accumulation, outputs rounded once. Where the unfused path rounds the pre-activation to bf16 before
the GELU (and the input gradient before its product with gelu'), the epilogue applies them to the
fp32 accumulator: other rounding under bf16.

Backends (chosen once per call from the device, never switched on failure):

============  =============================================================================
``cublaslt``  the two epilogue matmuls: CUDA tensors in bf16, widths multiples of 8
``torch``     the same formulas in torch ops: any device and dtype (CPU: the smoke ladder)
``auto``      ``cublaslt`` where it builds and the call fits it, else ``torch``
============  =============================================================================

Both directions are ``torch.library.custom_op``s with fake impls, so torch.compile keeps each as one
node and CUDA graphs capture them (no host sync).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hwlib.blas import LT_WORKSPACE_BYTES, lt_workspace_bytes
from hwlib.device import ChoiceError, Unavailable, info, supports_bf16
from hwlib.precision import compute_dtype

from hwlib.ops import fallbacks
from hwlib.ops.sources import constant_result, note_backend, read_kernel_source, warn_fallback

from ..s21_fused_layernorm.op import BIAS_COLUMNS

BACKENDS = ("auto", "cublaslt", "torch")
KERNEL_FILE = "22_gelu_epilogue.cpp"
ALIGN = 8            # cuBLASLt's leading dimensions: multiples of 16 bytes, 8 bf16 elements

BINDING = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cstdint>
#include <vector>
#include "22_gelu_epilogue.h"

// The workspace each call gets (gelu_mlp.workspace_bytes: 32 MiB, cuBLAS's recommendation on Hopper, or none
// inside hwlib.blas.no_workspace), taken from torch's caching allocator on every call (a CUDA graph's private
// pool while one is captured).
static torch::Tensor workspace(const torch::Tensor& like, int64_t ws_bytes) {
  TORCH_CHECK(ws_bytes >= 0, "gelu_epilogue: ws_bytes must be >= 0, got ", ws_bytes);
  return torch::empty({ws_bytes}, like.options().dtype(torch::kUInt8));
}

static void check_mat(const torch::Tensor& t, const char* name, int64_t dims, bool row_strided = false) {
  TORCH_CHECK(t.is_cuda(), "gelu_epilogue: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "gelu_epilogue: ", name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, "gelu_epilogue: ", name, " must be ", dims, "-d, got ", t.dim(), "-d");
  if (row_strided) {   // rows of unit stride, a multiple of 16 bytes apart
    TORCH_CHECK(t.stride(1) == 1 && t.stride(0) >= t.size(1) && t.stride(0) % 8 == 0, "gelu_epilogue: ", name,
                " must have rows of unit stride, a multiple of 8 elements apart");
  } else {
    TORCH_CHECK(t.is_contiguous(), "gelu_epilogue: ", name, " must be contiguous");
  }
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, "gelu_epilogue: ", name,
              " must be 16-byte aligned");
}

std::vector<torch::Tensor> gelu_forward(torch::Tensor x, torch::Tensor w, torch::Tensor b, int64_t ws_bytes) {
  check_mat(x, "x", 2, true); check_mat(w, "weight", 2); check_mat(b, "bias", 1);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && b.size(0) == N, "gelu_epilogue: x [M, K], weight [N, K], bias [N]");
  TORCH_CHECK(K % 8 == 0 && N % 8 == 0, "gelu_epilogue: K and N must be multiples of 8, got ", K, " and ", N);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty({M, N}, x.options());
  auto pre = torch::empty({M, N}, x.options());
  auto ws = workspace(x, ws_bytes);
  const int err = gelu_epilogue_forward(at::cuda::getCurrentCUDABlasLtHandle(), x.data_ptr(), x.stride(0),
                                        w.data_ptr(), b.data_ptr(), out.data_ptr(), pre.data_ptr(), M, N, K,
                                        ws.data_ptr(), ws_bytes, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "gelu_epilogue forward: ", gelu_epilogue_error_string(err));
  return {out, pre};
}

torch::Tensor gelu_backward(torch::Tensor dy, torch::Tensor w, torch::Tensor pre, int64_t ws_bytes) {
  check_mat(dy, "dy", 2); check_mat(w, "weight", 2); check_mat(pre, "pre", 2);
  const int64_t M = dy.size(0), C = dy.size(1), N = w.size(1);
  TORCH_CHECK(w.size(0) == C && pre.size(0) == M && pre.size(1) == N,
              "gelu_epilogue: dy [M, C], weight [C, N], pre [M, N]");
  TORCH_CHECK(C % 8 == 0 && N % 8 == 0, "gelu_epilogue: C and N must be multiples of 8, got ", C, " and ", N);
  const c10::cuda::CUDAGuard guard(dy.device());
  auto dpre = torch::empty({M, N}, dy.options());
  auto ws = workspace(dy, ws_bytes);
  const int err = gelu_epilogue_backward(at::cuda::getCurrentCUDABlasLtHandle(), dy.data_ptr(), w.data_ptr(),
                                         pre.data_ptr(), dpre.data_ptr(), M, N, C, ws.data_ptr(), ws_bytes,
                                         c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "gelu_epilogue backward: ", gelu_epilogue_error_string(err));
  return dpre;
}

// dx = dpre W into rows `width` wide (>= K, a multiple of 8), the columns past K zero. cuBLASLt's first-ranked
// kernel for it took about 8 us more than torch.mm's plain product (a probe on an H100, GPT-2's MLP shape);
// torch's own call with an output leading dimension (at::cuda::blas::gemm<at::BFloat16>) did not link against
// torch 2.11 (its bf16 specialization is not exported): tried and taken back.
torch::Tensor input_grad_padded(torch::Tensor dpre, torch::Tensor w, int64_t width, int64_t ws_bytes) {
  check_mat(dpre, "dpre", 2); check_mat(w, "weight", 2);
  const int64_t M = dpre.size(0), N = dpre.size(1), K = w.size(1);
  TORCH_CHECK(w.size(0) == N, "gelu_epilogue: dpre [M, N], weight [N, K]");
  TORCH_CHECK(K % 8 == 0 && N % 8 == 0 && width >= K && width % 8 == 0,
              "gelu_epilogue: K, N and the padded width must be multiples of 8, got ", K, ", ", N, " and ", width);
  const c10::cuda::CUDAGuard guard(dpre.device());
  auto dx = torch::empty({M, width}, dpre.options());
  dx.narrow(1, K, width - K).zero_();
  auto ws = workspace(dpre, ws_bytes);
  const int err = gelu_epilogue_input_grad(at::cuda::getCurrentCUDABlasLtHandle(), dpre.data_ptr(), w.data_ptr(),
                                           dx.data_ptr(), width, M, N, K, ws.data_ptr(), ws_bytes,
                                           c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "gelu_epilogue input gradient: ", gelu_epilogue_error_string(err));
  return dx;
}
"""

FUNCTIONS = ["gelu_forward", "gelu_backward", "input_grad_padded"]
_MODULE = None


def module():
    """The built extension, loaded once per process; Unavailable with the reason where it cannot build."""
    global _MODULE
    if _MODULE is None:
        from hwlib.ops import build
        _MODULE = build.load("22_gelu_epilogue", BINDING, FUNCTIONS, host=True, libraries=("cublasLt",))
    return _MODULE


def kernel_source() -> str:
    """The cuBLASLt calls' file, as it builds (for a notebook to print)."""
    return read_kernel_source(KERNEL_FILE)


# --- backends ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cublaslt_problem(device_type: str) -> str | None:
    if device_type != "cuda":
        return f"cuBLASLt runs CUDA tensors only, got {device_type} tensors"
    if torch.cuda.is_available() and not supports_bf16(di := info("cuda")):
        return f"the bf16 epilogues need an Ampere (sm_80) or newer GPU; {di.name} has no bf16 tensor cores"
    try:
        module()
    except Unavailable as e:
        return str(e)
    return None


def fit_problem(dtype: torch.dtype, K: int, N: int, C: int) -> str | None:
    """Why the cuBLASLt backend cannot take an MLP of these sizes in ``dtype``; None when it can."""
    if dtype != torch.bfloat16:
        return f"the cuBLASLt epilogues are built for bf16 operands, got {dtype}"
    bad = {n: v for n, v in (("in_features", K), ("hidden", N), ("out_features", C)) if v % ALIGN or v == 0}
    if bad:
        return f"cuBLASLt needs widths that are positive multiples of {ALIGN}: {bad}"
    return None


def select_backend(backend: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                   sizes: tuple[int, int, int] = (ALIGN, ALIGN, ALIGN)) -> str:
    """The backend that runs: ``backend`` itself (Unavailable, or ValueError for a call it cannot
    take, with the reason), or ``auto``'s choice."""
    if backend not in BACKENDS:
        raise ChoiceError("backend", backend, BACKENDS)
    if backend == "torch":
        return "torch"
    problem = _cublaslt_problem(torch.device(device).type)
    if backend == "cublaslt":
        if problem:
            raise Unavailable(f"backend='cublaslt': {problem}")
        fit = fit_problem(dtype, *sizes)
        if fit:
            raise ValueError(f"backend='cublaslt': {fit}")
        return "cublaslt"
    if problem and torch.device(device).type == "cuda":   # the machine, not this call's sizes: say so
        warn_fallback("gelu_mlp", "cublaslt", "torch", "cuda", problem)
    return "torch" if problem or fit_problem(dtype, *sizes) else "cublaslt"


@constant_result
def resolve_backend(backend: str, device_type: str, dtype: torch.dtype, K: int, N: int, C: int) -> str:
    """``select_backend`` for the op's forward: torch.compile calls it once while tracing and keeps its
    answer as a constant (building the extension is not traceable)."""
    return note_backend("gelu_mlp", select_backend(backend, device_type, dtype, (K, N, C)))


# --- inputs --------------------------------------------------------------------------------------

def check_inputs(x, w_fc, b_fc, w_proj, b_proj, extra_columns: int = 0) -> None:
    """A clear ValueError naming the argument unless shapes, dtypes and devices fit; x carries
    ``extra_columns`` more than w_fc's in_features (the bias column's)."""
    named = (("x", x), ("w_fc", w_fc), ("b_fc", b_fc), ("w_proj", w_proj)) + ((("b_proj", b_proj),) if b_proj is not None else ())
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    for name, w in (("w_fc", w_fc), ("w_proj", w_proj)):
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-d [out_features, in_features], got shape {tuple(w.shape)}")
    N, K = w_fc.shape
    C = w_proj.shape[0]
    if x.dim() < 1 or x.shape[-1] != K + extra_columns:
        with_col = f" plus the bias column ({K} + {extra_columns})" if extra_columns else f" ({K})"
        raise ValueError(f"x's last dimension ({tuple(x.shape)}) must equal w_fc's in_features{with_col}")
    if w_proj.shape[1] != N:
        raise ValueError(f"w_proj must be [out, {N}] (w_fc's out_features), got {tuple(w_proj.shape)}")
    if tuple(b_fc.shape) != (N,):
        raise ValueError(f"b_fc must be [{N}] (w_fc's out_features), got {tuple(b_fc.shape)}")
    if b_proj is not None and tuple(b_proj.shape) != (C,):
        raise ValueError(f"b_proj must be [{C}] (w_proj's out_features), got {tuple(b_proj.shape)}")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        raise ValueError(f"{', '.join(n for n, _ in named)} must be on one device, got {sorted(map(str, devices))}")


# --- the formulas in torch ops (the torch backend, and the unfused path's arithmetic) ----------------

def _fwd_torch(x, w_fc, b_fc, w_proj, b_proj):
    pre = F.linear(x, w_fc, b_fc)
    a = F.gelu(pre, approximate="tanh")
    return F.linear(a, w_proj, b_proj), a, pre


def _dpre_torch(dy, w_proj, pre):
    return torch.ops.aten.gelu_backward(dy @ w_proj, pre, approximate="tanh")


# --- the same through cuBLASLt's epilogues (bf16, widths multiples of 8) ---------------------------

EPILOGUE_CALLS = ("forward", "backward", "input_grad")
FOLLOW_BLAS = ("input_grad",)   # the calls whose workspace follows hwlib.blas (the others keep theirs)


def workspace_bytes(call: str) -> int:
    """The cuBLASLt workspace of one of ``EPILOGUE_CALLS``. The two epilogue matmuls keep theirs: without
    one (``hwlib.blas.no_workspace``) cuBLASLt answered the DGELU matmul with a plain matmul and a separate
    epilogue kernel, 472 us against 158 us a call, and the GELU forward with a kernel that took 160 us
    against 158 (H100, GPT-2's MLP, captured in CUDA graphs: the matmul table of step 28, since retired, in
    a run made before these two kept their workspace). The plain input gradient follows ``hwlib.blas`` (notebook
    19's ``no_gemm_workspace`` toggle)."""
    if call not in EPILOGUE_CALLS:
        raise ValueError(f"call must be one of {EPILOGUE_CALLS}, got {call!r}")
    return lt_workspace_bytes() if call in FOLLOW_BLAS else LT_WORKSPACE_BYTES


def forward_epilogues(x, w_fc, b_fc, w_proj, b_proj):
    """(y, a, pre): bias + GELU in the first matmul's epilogue, which also keeps pre; the second
    matmul is torch's (its bias in cuBLAS's own epilogue)."""
    a, pre = module().gelu_forward(x, w_fc, b_fc, workspace_bytes("forward"))
    return F.linear(a, w_proj, b_proj), a, pre


def dpre_epilogue(dy, w_proj, pre):
    """dpre = (dy W_proj) * gelu'(pre): the GELU's derivative in the input-gradient matmul's epilogue."""
    return module().gelu_backward(dy, w_proj, pre, workspace_bytes("backward"))


def aligned(*ts: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary, as cuBLASLt's epilogue kernels need (a view
    with a storage offset may not; fresh allocations always do)."""
    return all(t.data_ptr() % 16 == 0 for t in ts)


def _epilogues_take(rows: torch.Tensor, *ts: torch.Tensor) -> bool:
    """Whether this call's operands suit the epilogue kernels: some rows (cuBLASLt runs no empty
    matmul) and every operand aligned. Checked per call, in the op, where the tensors are real; the
    backend chosen for a traced graph cannot know them."""
    return rows.shape[0] > 0 and aligned(rows, *ts)


# --- the ops -------------------------------------------------------------------------------------

@torch.library.custom_op("hwlib::gelu_mlp", mutates_args=())
def _fwd_op(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor, b_proj: torch.Tensor | None,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (y, a, pre): the GELU's output and input are kept for the backward. x's first K columns are the
    # input: with the bias column, x is wider (gelu_mlp's bias_column) and the matmul reads a row-strided view
    x = x[:, :w_fc.shape[1]]
    if backend == "torch" or not _epilogues_take(x, w_fc, b_fc):   # else the same math in torch
        return _fwd_torch(x, w_fc, b_fc, w_proj, b_proj)
    return forward_epilogues(x, w_fc, b_fc, w_proj, b_proj)


@_fwd_op.register_fake
def _(x, w_fc, b_fc, w_proj, b_proj, backend):
    M, N, C = x.shape[0], w_fc.shape[0], w_proj.shape[0]
    return x.new_empty((M, C)), x.new_empty((M, N)), x.new_empty((M, N))


@torch.library.custom_op("hwlib::gelu_mlp_backward", mutates_args=())
def _bwd_op(dy: torch.Tensor, w_proj: torch.Tensor, pre: torch.Tensor, backend: str) -> torch.Tensor:
    # dpre; the weight gradients' matmuls and the bias gradients' column sums are in the formula below,
    # where torch.compile sees them (inductor compiles the sums: cuBLASLt's bias-gradient epilogues measured
    # slower, kernels/22_gelu_epilogue.cpp)
    if backend == "torch" or not _epilogues_take(dy, w_proj, pre):
        return _dpre_torch(dy, w_proj, pre)
    return dpre_epilogue(dy, w_proj, pre)


@_bwd_op.register_fake
def _(dy, w_proj, pre, backend):
    return torch.empty_like(pre)


@torch.library.custom_op("hwlib::gelu_mlp_input_grad", mutates_args=())
def _dx_op(dpre: torch.Tensor, w_fc: torch.Tensor, width: int, backend: str) -> torch.Tensor:
    # dx = dpre W_fc written into rows `width` wide, zero past K: the gradient of an input that carries the
    # bias column. cuBLASLt writes the rows in place (its output's leading dimension); torch pads a copy.
    if backend == "torch" or not _epilogues_take(dpre, w_fc):
        return F.pad(dpre @ w_fc, (0, width - w_fc.shape[1]))
    return module().input_grad_padded(dpre, w_fc, width, workspace_bytes("input_grad"))


@_dx_op.register_fake
def _(dpre, w_fc, width, backend):
    return dpre.new_empty((dpre.shape[0], width))


def _setup_context(ctx, inputs, output):
    x, w_fc, _, w_proj, b_proj, backend = inputs
    _, a, pre = output
    ctx.save_for_backward(x, w_fc, w_proj, a, pre)
    ctx.backend, ctx.has_b_proj = backend, b_proj is not None
    ctx.bias_column = x.shape[1] != w_fc.shape[1]
    ctx.set_materialize_grads(False)   # a and pre are outputs for the backward only: no zero gradients for them


def mlp_backward(ctx, dy, _da, _dpre):
    """The MLP's gradients: dpre from the op (the GELU's derivative in the matmul's epilogue), then
    dx = dpre W_fc, dW_fc = dpre^T x, db_fc and db_proj as column sums, dW_proj = dy^T a (no db_proj
    when the op ran without b_proj: the bias was added, and its gradient summed, where the branch's
    output meets the residual stream, ``hwlib.steps.s21_fused_layernorm.op``). With the bias column (x = [x, 1, 0...]),
    dW_fc and db_fc are the first K columns and the next of one matmul, dpre^T x, and dx has x's width."""
    x, w_fc, w_proj, a, pre = ctx.saved_tensors
    dy = dy.contiguous()
    dpre = torch.ops.hwlib.gelu_mlp_backward(dy, w_proj, pre, ctx.backend)
    db_proj = dy.sum(0) if ctx.has_b_proj else None
    if ctx.bias_column:
        K = w_fc.shape[1]
        dwb = dpre.t() @ x
        return (torch.ops.hwlib.gelu_mlp_input_grad(dpre, w_fc, x.shape[1], ctx.backend), dwb[:, :K], dwb[:, K],
                dy.t() @ a, db_proj, None)
    return dpre @ w_fc, dpre.t() @ x, dpre.sum(0), dy.t() @ a, db_proj, None


_fwd_op.register_autograd(mlp_backward, setup_context=_setup_context)
fallbacks.register(_fwd_op)
fallbacks.register(_bwd_op)
fallbacks.register(_dx_op)


def gelu_mlp(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor,
             b_proj: torch.Tensor | None, *, bias_column: bool = False, backend: str = "auto") -> torch.Tensor:
    """``F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)``.

    ``x`` [..., K]; ``w_fc`` [N, K], ``b_fc`` [N]; ``w_proj`` [C, N], ``b_proj`` [C] or None (no output
    bias: a caller that adds it elsewhere, ``hwlib.workloads.blocks``). Under autocast the
    operands are cast to its dtype (as autocast casts ``F.linear``'s), else computed in x's dtype;
    the result is [..., C] in that dtype. Non-contiguous inputs are made contiguous (a copy).

    ``bias_column``: x is [..., K + BIAS_COLUMNS] as ``add_layer_norm(..., ones_column=True)`` writes it,
    the input, then a column of ones, then zeros; the MLP reads the first K columns, and its backward
    takes b_fc's gradient from the weight-gradient matmul (one more column of dpre^T x) instead of a
    column sum of its own; x's gradient is as wide as x (zero in the extra columns). That gradient of
    b_fc is right only where column K of x is all ones, as ``add_layer_norm`` writes it: the op does not
    check it (a check would read the column again)."""
    if not isinstance(bias_column, bool):
        raise ValueError(f"bias_column must be a bool, got {bias_column!r}")
    check_inputs(x, w_fc, b_fc, w_proj, b_proj, extra_columns=BIAS_COLUMNS if bias_column else 0)
    dev = x.device.type
    dtype = compute_dtype(x)
    W, K, N, C = x.shape[-1], w_fc.shape[1], w_fc.shape[0], w_proj.shape[0]
    name = resolve_backend(backend, dev, dtype, K, N, C)
    lead = x.shape[:-1]
    with torch.autocast(dev, enabled=False):   # the op's own casts, once, as autocast would make them
        args = [None if t is None else t.to(dtype).contiguous() for t in (x.reshape(-1, W), w_fc, b_fc, w_proj, b_proj)]
        y, _, _ = torch.ops.hwlib.gelu_mlp(*args, name)
    return y.view(*lead, C)


def gelu_mlp_reference(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor,
                       b_proj: torch.Tensor | None) -> torch.Tensor:
    """The spec in float64, differentiable (for reference gradients, pass float64 leaves)."""
    h = F.gelu(F.linear(x.double(), w_fc.double(), b_fc.double()), approximate="tanh")
    return F.linear(h, w_proj.double(), None if b_proj is None else b_proj.double())


def bytes_removed(rows: int, hidden: int, elem: int = 2) -> dict:
    """Bytes the epilogues remove per MLP call at one pass per op (the kernel file's count), forward
    and backward: the pre-activation's re-read by the GELU (forward); the input gradient's write and
    re-read (backward). The bias gradients' column sums stay outside the matmuls: they count in neither."""
    mn = float(rows * hidden * elem)
    return {"forward": mn, "backward": 2.0 * mn}


# How far the cuBLASLt backend's error (bf16 operands, against float64) may exceed the unfused bf16
# path's on the same operands: a factor and a slack of the size of bf16's own rounding (2^-8).
ERROR_FACTOR, ERROR_SLACK = 1.5, 4e-3


def no_worse_than_unfused(err: float, unfused_err: float) -> bool:
    """Whether a relative error of the cuBLASLt backend is within the unfused path's, by the bound above."""
    return err <= ERROR_FACTOR * unfused_err + ERROR_SLACK
