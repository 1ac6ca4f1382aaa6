"""Where a training step's time goes: one ladder step profiled, its GPU time by category, beside
each category's roofline floor.

The step runs as the ladder runs it (``hwlib.ladder``: same session, settings, seed and data): the
check and warm-up steps first (compilation, CUDA-graph recording and allocator growth happen
there), then ``timed`` steps timed by ``bench.StepClock`` without the profiler (the step's wall
time), then ``profiled`` more steps under torch.profiler (``hwlib.trace``). Every GPU kernel of the
profiled window is put in one category by its name (``classify``):

* ``gemm``: cuBLAS / CUTLASS / nvjet / inductor template matmuls (bf16, TF32 or FP8);
* ``attention``: fused attention (cuDNN SDPA, flash, memory-efficient ``fmha``);
* ``lm_head_ce``: the output projection's three matmuls (``split_head_gemms``) and the
  cross-entropy's kernels (log-softmax, NLL, a fused linear cross-entropy);
* ``elementwise``: LayerNorm, GELU, residual adds, casts: Triton kernels of inductor, the fused
  residual add + LayerNorm (``_add_ln_*``), the QKV gradient packing (``_qkv_grad_*``), ATen's elementwise and reduction kernels;
* ``optimizer``: the (fused) AdamW's multi-tensor kernels;
* ``other``: copies, memsets, embedding gathers and whatever matched nothing above;

and ``idle``, the step's wall time minus the union of the intervals in which any kernel ran.
Category times are kernel time per step (durations summed over the window over the number of
steps). On a CPU the operators stand in for kernels (each counted with its own time, nested
operators excluded): the code path runs, the times are a CPU's.

The LM head's matmuls carry no name of their own: they are told apart by size. At GPT-2's shapes
each of the head's three matmuls per step (logits, their gradient into the hidden states, the
weight gradient) has 2 V / (24 d) ~ 5x the FLOPs of all of one block's matmuls together and well
over 10x those of its largest, so they are the 3 x steps longest GEMM kernels of the window; the
rule is applied only when the shortest of them is at least ``HEAD_GAP`` times the next GEMM,
otherwise the head's matmuls stay among the GEMMs and the result says so.

Floors (``gpt_floors``, GPT only): a compute-bound category's floor is its FLOPs at the measured
matmul ceiling of the step's precision; a memory-bound one's, its bytes at the measured copy
bandwidth (``hwlib.ceilings``, read by the caller from the run's results). Bytes are counted as one
pass per op, each op reading its inputs and writing its outputs once (see ``gpt_floors``).

The step's floor, for every workload (``workload_floor``, built on ``count_step`` and ``step_floor``):
the step's FLOPs at the matmul ceiling, and the bytes that must move at the copy bandwidth (the
optimizer's state and the activations at a minimal count), whichever is longer; the kernel count
of the profiled window is reported beside it (no per-launch cost is measured: see ``step_floor``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from .. import bench, precision, results, roofline, trace
from ..device import info, resolve_device
from ..ladder.run import StepResult, resolve, timed_window
from ..ladder.session import Session, build_model
from ..paths import run_dir
from ..profiles import Plan
from ..steps import (LADDER, chain, get_step, not_applicable, precision_of, resolve_autocast, settings_for,
                     unavailable)
from ..workloads import get_workload
from ..workloads.base import TokenLMWorkload

CATEGORIES = ("gemm", "attention", "lm_head_ce", "elementwise", "optimizer", "other", "idle")
LABELS = {"gemm": "GEMMs", "attention": "attention", "lm_head_ce": "LM head + cross-entropy",
          "elementwise": "LayerNorm / elementwise", "optimizer": "optimizer", "other": "other", "idle": "idle"}
# The LM head taken with the GEMMs, where its own matmuls were counted as GEMMs (``by_step``).
HEAD_IN_GEMMS = "gemm+lm_head_ce"
LABELS[HEAD_IN_GEMMS] = "GEMMs + LM head + cross-entropy"
HEAD_MATMULS = 3     # per training step: logits, grad of the hidden states, grad of the (tied) weight
HEAD_GAP = 3.0       # the head's shortest matmul over the next GEMM, for the size rule to apply
# How a breakdown's notes say that the size rule did not apply (``split_head_gemms``): by_step reads it back
HEAD_AMONG_GEMMS = "counted among the GEMMs"

# Kernel (or CPU operator) names, lower-cased, matched in this order: the first rule that matches
# decides. Order matters: an inductor kernel that fuses the log-softmax is the loss's; inductor names
# its pointwise and reduction kernels after the ops they fuse ("triton_poi_fused__scaled_dot_product_
# cudnn_attention_transpose_3" is a layout copy feeding attention): those are elementwise work, and
# its matmul templates ("triton_tem_fused_mm_...") GEMMs; attention kernels built on CUTLASS
# ("fmha_cutlassF_...") are attention, not GEMMs.
RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("optimizer", re.compile(r"multi_tensor_apply|adam|optimizer\.|foreach")),
    ("lm_head_ce", re.compile(r"log_softmax|logsoftmax|nll_loss|cross_entropy|logsumexp|linear_ce|ce_rows|ce_grad")),
    ("gemm", re.compile(r"^triton_tem_")),
    ("elementwise", re.compile(r"^triton_(poi|red|per)_")),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|_attn|scaled_dot_product")),
    ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|splitk|gemv|_scaled_mm|"
                        r"^aten::(mm|addmm|bmm|baddbmm)$")),
    ("elementwise", re.compile(r"triton|elementwise|layer_norm|layernorm|_add_ln_|_qkv_grad|gelu|reduce_kernel|vectorized|"
                               r"unrolled|compiledfxgraph|cpp_fused|^aten::(add|mul|sub|div|copy_|_to_copy|"
                               r"fill_|zero_|native_layer_norm|gelu|tanh)")),
)
# On a CPU: operators that only dispatch (their own time is the framework's, not the model's work).
CPU_CATEGORIES = ("cpu_op", "user_annotation")


def classify(name: str) -> str:
    """The category of a GPU kernel (or CPU operator) named ``name``; 'other' when no rule matches."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a kernel name (str), got {type(name).__name__}")
    low = name.lower()
    for cat, pat in RULES:
        if pat.search(low):
            return cat
    return "other"


def split_head_gemms(durations: list[float], steps: int, per_step: int = HEAD_MATMULS,
                     gap: float = HEAD_GAP) -> tuple[set[int], str | None]:
    """Indices (into ``durations``, the GEMM kernels of a window of ``steps`` steps) of the LM head's
    matmuls by the size rule of the module doc, and None; or (empty set, why) when the rule does
    not apply."""
    if steps < 1 or per_step < 1:
        raise ValueError(f"steps and per_step must be >= 1, got {steps}, {per_step}")
    k = per_step * steps
    if len(durations) <= k:
        return set(), f"{len(durations)} GEMM kernels in {steps} steps: too few to tell the head's {k} apart"
    order = sorted(range(len(durations)), key=lambda i: -durations[i])
    kth, nxt = durations[order[k - 1]], durations[order[k]]
    if kth < gap * nxt:
        return set(), (f"the head's matmuls are not the longest GEMMs by {gap:g}x (the {k}th longest takes "
                       f"{kth / max(nxt, 1e-12):.2f}x the next): {HEAD_AMONG_GEMMS}")
    return set(order[:k]), None


def categorize(events: list[dict], device_kind: str, steps: int, lm_head: bool = True
               ) -> tuple[dict, float, float, list, list[str]]:
    """Milliseconds per step by category, the busy time (union of the work's intervals) and the span
    of the window per step, the top kernels by time, and notes; from a trace's events. ``lm_head``:
    the model ends in a vocabulary projection whose matmuls the size rule looks for (a language
    model's; a classifier's head is a small matmul among the GEMMs)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if device_kind == "cuda":
        work = [(e, float(e["dur"])) for e in trace.device_events(events)]
    else:
        work = [(e, own) for e, own in trace.exclusive(events) if e.get("cat") in CPU_CATEGORIES]
    cats = [classify(str(e.get("name", ""))) if e.get("cat") != "gpu_memcpy" and e.get("cat") != "gpu_memset"
            else "other" for e, _ in work]
    gemms = [i for i, c in enumerate(cats) if c == "gemm"]
    head, why = split_head_gemms([work[i][1] for i in gemms], steps) if lm_head else (set(), None)
    for j in head:
        cats[gemms[j]] = "lm_head_ce"
    per = 1e-3 / steps   # microseconds over the window -> milliseconds per step
    ms = {c: 0.0 for c in CATEGORIES if c != "idle"}
    by_name: dict = {}
    for (e, t), c in zip(work, cats):
        ms[c] += t * per
        key = (c, str(e.get("name", ""))[:80])
        by_name[key] = by_name.get(key, 0.0) + t * per
    ivs = [(e["ts"], e["ts"] + e["dur"]) for e, _ in work]
    busy = trace.length(ivs) * per
    span = (max(b for _, b in ivs) - min(a for a, _ in ivs)) * per if ivs else 0.0
    top = sorted(({"category": c, "kernel": n, "ms_per_step": v} for (c, n), v in by_name.items()),
                 key=lambda r: -r["ms_per_step"])
    return ms, busy, span, top, [why] if why else []


# --- floors ---------------------------------------------------------------------------------------------

def gpt_floors(cfg, n_params: int, ceilings: dict | None, precision: str = "bf16") -> dict[str, dict]:
    """Each category's floor for a GPT step of ``cfg`` (``hwlib.workloads.gpt``): {category: {"flops",
    "bytes", "ms", "basis"}}, ms None without the ceilings. N = batch x context tokens, L layers,
    width d, vocabulary V (the padding the model may carry is not useful work), training = forward
    x 3 in FLOPs (backward twice the forward):

    * GEMMs: 3 x N x L x 24 d^2 (QKV, output projection, MLP);
    * attention: 3 x N x L x 4 T d / 2: the causal half of Q K^T and A V that a causal kernel computes;
    * LM head + cross-entropy: 3 x 2 N d V, the head's matmuls; a loss that never materialises the
      logits moves no more bytes than its inputs, so the matmuls are the floor;
    * LayerNorm / elementwise: bytes, one pass per op under bf16 autocast with an fp32 residual
      stream, per token and layer in the forward: LayerNorm x 2 (read 4d, write 2d), residual add x
      2 (read 4d + 2d, write 4d), bias + GELU (read 8d, write 8d) = 48 d bytes; backward counted as
      twice the forward; plus the final LayerNorm. Fusing GELU into the GEMM's epilogue, or the
      residual add into the next LayerNorm, would go below this count;
    * optimizer: fused AdamW on fp32 parameters reads parameter, gradient and both moments and writes
      parameter and moments: 28 bytes a parameter;
    * other and idle: no floor (0).
    """
    # counts of nothing (or less) would give floors of 0 ms or negative ones: errors naming the value
    for name in ("batch", "context", "n_layer", "d_model", "vocab"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"cfg.{name} must be a positive whole number for a floor, got {v!r}")
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 1:
        raise ValueError(f"n_params must be a positive whole number of parameters, got {n_params!r}")
    _check_ceilings(ceilings)
    N, L, d, T, V = cfg.batch * cfg.context, cfg.n_layer, cfg.d_model, cfg.context, cfg.vocab
    parts = {
        "gemm": (3.0 * N * L * 24 * d * d, 0.0, "3 x N x L x 24 d^2 FLOPs at the matmul ceiling"),
        "attention": (3.0 * N * L * 4 * T * d / 2, 0.0, "causal half of 3 x N x L x 4 T d FLOPs at the matmul ceiling"),
        "lm_head_ce": (3.0 * 2 * N * d * V, 0.0, "3 x 2 N d V FLOPs at the matmul ceiling (logits never stored)"),
        "elementwise": (0.0, 3.0 * N * (L * 48 * d + 6 * d),
                        "one pass per op: 48 d bytes a token and layer forward, x3 with backward, at the copy bandwidth"),
        "optimizer": (0.0, float(ADAMW_FP32_BYTES * n_params),
                      f"fused AdamW: {ADAMW_FP32_BYTES} bytes a parameter at the copy bandwidth"),
        "other": (0.0, 0.0, "no floor counted"),
        "idle": (0.0, 0.0, "no floor: idle time is all overhead"),
    }
    out = {}
    for cat, (flops, nbytes, basis) in parts.items():
        t_f = roofline.flops_ms(flops, ceilings, precision) if flops else 0.0
        t_b = roofline.bytes_ms(nbytes, ceilings) if nbytes else 0.0
        ms = None if (t_f is None or t_b is None) else max(t_f, t_b)
        out[cat] = {"flops": flops, "bytes": nbytes, "ms": ms, "basis": basis}
    return out


def floor_caveats(step: str) -> list[str]:
    """What ``gpt_floors`` does not count for ``step``: each step of its chain says so itself
    (``Step.floor_caveat``: FP8 matmuls above the 16-bit ceiling, epilogues counted as GEMMs, a bf16 stream)."""
    return [s.floor_caveat for s in chain(step) if s.floor_caveat]


# --- the step's floor, for every workload ------------------------------------------------------------------

# The ops whose inputs and outputs ``count_step`` counts as activation bytes: ATen's matmuls, convolutions
# and fused attention (forward and backward), and hwlib's own fused ops (namespace ``hwlib``: the BK-Core).
COUNTED_OPS = re.compile(r"^(mm|addmm|bmm|baddbmm|_addmm_activation|_scaled_mm|convolution|convolution_backward|"
                         r"_scaled_dot_product_\w+|_flash_attention_\w+|_efficient_attention_\w+|_cudnn_attention_\w+)$")
COUNTED_NAMESPACES = ("hwlib",)
# AdamW's traffic a parameter, in units of its element size: parameter read and written, gradient read,
# both moments read and written (the moments in the parameter's dtype, as torch.optim.AdamW keeps them).
ADAMW_PASSES = {"parameter": 2, "gradient": 1, "moments": 4}
ADAMW_FP32_BYTES = 4 * sum(ADAMW_PASSES.values())   # 28 a parameter, all in fp32 (gpt_floors)
FLOOR_PARTS = ("flops", "bytes", "launches")


def _counted(func) -> bool:
    if func.namespace in COUNTED_NAMESPACES:
        return True
    return func.namespace == "aten" and bool(COUNTED_OPS.match(func._overloadpacket.__name__))


def _tensor_bytes(tree) -> int:
    """Bytes of the tensors in ``tree``: each tensor's elements once (an expanded view, stride 0, no more
    than its storage holds)."""
    n = 0
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            nb = t.numel() * t.element_size()
            try:
                nb = min(nb, t.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError):   # a tensor without storage (a subclass)
                pass
            n += nb
    return n


class _ActivationBytes(TorchDispatchMode):
    """Counts the inputs and outputs of every op ``_counted`` picks, once per call, and the calls by op."""

    def __init__(self):
        super().__init__()
        self.bytes, self.calls = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _counted(func):
            self.bytes += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
            name = f"{func.namespace}::{func._overloadpacket.__name__}"
            self.calls[name] = self.calls.get(name, 0) + 1
        return out


def adamw_bytes(params) -> int:
    """Bytes AdamW moves in one step over ``params`` (those with a gradient, or that require one where
    none was made yet): per parameter its element size x (2 for the parameter read and written, 1 for
    the gradient read, 4 for the two moments read and written), the gradient in its own dtype."""
    total = 0
    for p in params:
        if p.grad is None and not p.requires_grad:
            continue
        e = p.element_size()
        g = p.grad.element_size() if p.grad is not None else e
        total += p.numel() * (ADAMW_PASSES["parameter"] * e + ADAMW_PASSES["gradient"] * g + ADAMW_PASSES["moments"] * e)
    return total


@dataclass
class StepCount:
    flops: float              # FlopCounterMode's count of the forward + backward
    activation_bytes: int     # inputs and outputs of the counted ops, once per call
    optimizer_bytes: int      # AdamW over the parameters that got a gradient
    calls: dict               # counted op -> calls


def count_step(model: torch.nn.Module, forward_backward: Callable[[], object]) -> StepCount:
    """Run ``forward_backward()`` (one forward and backward of ``model``, in whatever autocast the caller
    set) under ``FlopCounterMode`` and an op counter, and count what one training step must do:

    * FLOPs: ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, fused attention where it
      has a formula for the backend that ran; a custom op's inner matmuls are not seen);
    * activation bytes: each matmul, convolution, fused attention (forward and backward) and hwlib
      fused op (the BK-Core) reading its inputs and writing its outputs once, at the dtype it ran in
      (bf16 under autocast). Everything between them (LayerNorm, GELU, residual adds, casts, softmax
      of an unfused attention, the loss) is taken as fused into their prologues and epilogues and
      counted at zero. It is a lower bound for any schedule that runs each counted op as its own
      kernel; a kernel fusing two matmuls (fused attention's QK^T and AV, a linear + cross-entropy
      that never stores the logits) moves less, which is why fused attention is one op here;
    * optimizer bytes: ``adamw_bytes`` over the model's parameters that got a gradient.

    The gradients ``forward_backward`` leaves stay on the model."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(forward_backward):
        raise TypeError(f"forward_backward must be a callable running one forward and backward, got "
                        f"{type(forward_backward).__name__}")
    with FlopCounterMode(display=False) as fc, _ActivationBytes() as act:
        forward_backward()
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        raise ValueError("forward_backward made no gradient on the model's parameters: nothing to count")
    return StepCount(float(fc.get_total_flops()), act.bytes, adamw_bytes(params), dict(act.calls))


def _check_ceilings(ceilings: dict | None) -> None:
    if ceilings is None:
        return
    if not isinstance(ceilings, dict):
        raise TypeError(f"ceilings must be the run's ceilings dict (hwlib.query.ceilings), got {type(ceilings).__name__}")
    mm = ceilings.get("matmul_tflops") or {}
    if not isinstance(mm, dict):
        raise TypeError(f"ceilings['matmul_tflops'] must be a dict of TFLOP/s by precision, got {type(mm).__name__}")
    # a ceiling this run did not measure leaves its times None; one it holds must be a usable number
    for what, v in (("copy_gbps", ceilings.get("copy_gbps")), *((f"matmul_tflops[{k!r}]", x) for k, x in mm.items())):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise ValueError(f"ceilings {what} must be a positive finite number, got {v!r}")


def step_floor(flops: float, nbytes: float, ceilings: dict | None, precision: str = "bf16",
               launches: float | None = None) -> dict:
    """The floor of a step of ``flops`` FLOPs that must move ``nbytes`` bytes: {"flops_ms", "bytes_ms",
    "launches", "launch_ms", "ms", "bound"}. ``ms`` = max(flops_ms, bytes_ms): one stream runs its kernels
    one after another, and each is held by its FLOPs or its bytes, so the step takes at least the longer
    of the two totals. ``launches`` (the kernels of a step) are reported, not timed: no per-launch cost is
    measured (notebook 00's ceilings hold none), so ``launch_ms`` is None and the floor leaves them out.
    A ceiling the run did not measure (no ceilings at all: None) leaves its times None; one it holds must
    be positive and finite (ValueError naming it)."""
    for name, v in (("flops", flops), ("nbytes", nbytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative finite number, got {v!r}")
    if launches is not None and (isinstance(launches, bool) or not isinstance(launches, (int, float)) or launches < 0):
        raise ValueError(f"launches must be a non-negative count or None, got {launches!r}")
    if precision not in ("bf16", "fp16", "tf32", "fp32"):
        raise ValueError(f"precision must be one of bf16, fp16, tf32, fp32, got {precision!r}")
    _check_ceilings(ceilings)
    t_f = roofline.flops_ms(flops, ceilings, precision) if ceilings else None
    t_b = roofline.bytes_ms(nbytes, ceilings) if ceilings else None
    ms = None if t_f is None or t_b is None else max(t_f, t_b)
    bound = None if ms is None else ("flops" if t_f >= t_b else "bytes")
    return {"flops_ms": t_f, "bytes_ms": t_b, "launches": launches, "launch_ms": None, "ms": ms, "bound": bound}


@dataclass
class Floor:
    """A workload's step floor (``workload_floor``): the counts, and their times at the run's ceilings."""
    workload: str
    step: str
    precision: str
    flops: float              # the workload's model FLOPs (``Workload.flops_per_step``): the floor's
    flops_counted: float      # FlopCounterMode's count of the same step (padding and all), beside it
    activation_bytes: int
    optimizer_bytes: int
    calls: dict
    launches: float | None = None
    flops_ms: float | None = None
    bytes_ms: float | None = None
    launch_ms: float | None = None
    ms: float | None = None
    bound: str | None = None

    @property
    def nbytes(self) -> int:
        return self.activation_bytes + self.optimizer_bytes

    def params(self) -> dict:
        return {"flops": self.flops, "flops_counted": self.flops_counted, "activation_bytes": self.activation_bytes,
                "optimizer_bytes": self.optimizer_bytes, "launches": self.launches, "precision": self.precision,
                "bound": self.bound, "counted_ops": self.calls,
                "basis": "max(model FLOPs at the matmul ceiling, (AdamW state + each matmul's, convolution's and "
                         "fused op's inputs and outputs once) at the copy bandwidth); launches counted, not timed"}


def floor_settings(step: str, device: torch.device):
    """The settings the floor's model runs under: the step's recipe settings (its precision, attention,
    packing, BK-Core backend), eager: the floor counts ops, and a compiled or graphed model hides them
    from the counter; the simple loader (the same batches, no worker processes)."""
    eff = resolve_autocast(settings_for(step), info(device))
    return dataclasses.replace(eff, compile=False, cuda_graphs=False, loader="simple")


def workload_floor(workload: str, step: str, *, profile: str = "smoke", device: str | torch.device = "cpu",
                   ceilings: dict | None = None, seed: int = 0, config: dict | None = None,
                   launches: float | None = None) -> Floor:
    """The floor of one training step of ``workload`` at ``step`` (``step_floor``): its model FLOPs
    (``Workload.flops_per_step``, the count MFU uses; FlopCounterMode's count beside it) and the bytes
    ``count_step`` counts on one forward + backward of the real model at ``profile`` on ``device``, with
    the step's precision. The model is the recipe's model of the step's chain, without the steps past
    the recipe: they change how the same math runs (the ladder's same-math check holds them to it), and
    their custom ops would hide their matmuls from the counters. ``launches``: the kernels of a profiled
    step, carried into the floor's record."""
    wl = get_workload(workload)
    st = get_step(step)
    if (why := not_applicable(st, wl.name)):
        raise ValueError(f"step {st.name!r} does not apply to workload {wl.name!r}: {why}")
    prec = precision_of(st.name)
    _check_ceilings(ceilings)
    dev = resolve_device(device)
    cfg = wl.config(profile, **(config or {}))
    settings = floor_settings(st.name, dev)
    model = build_model(wl.name, None, cfg, seed, settings).to(dev)
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    batches = wl.batches(cfg, dev, seed, None, settings)
    try:
        batch = batches(0)

        def forward_backward():
            with precision.autocast(settings.autocast, dev):
                loss = wl.loss(model, batch)
            loss.backward()
        with precision.tf32_mode(settings.tf32):
            c = count_step(model, forward_backward)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    del model, batch
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    flops = float(wl.flops_per_step(cfg))
    f = step_floor(flops, c.activation_bytes + c.optimizer_bytes, ceilings, prec, launches)
    return Floor(workload=wl.name, step=st.name, precision=prec, flops=flops, flops_counted=c.flops,
                 activation_bytes=c.activation_bytes, optimizer_bytes=c.optimizer_bytes, calls=c.calls,
                 launches=launches, flops_ms=f["flops_ms"], bytes_ms=f["bytes_ms"], launch_ms=f["launch_ms"],
                 ms=f["ms"], bound=f["bound"])


def last_step(workload: str, device: str | torch.device = "auto") -> str:
    """The last ladder step that applies to ``workload`` and runs on ``device``: on a GPU the last whose own
    change this GPU can run, its FP8 steps included (an FP8 step in its chain needs FP8 tensor cores too);
    on a CPU the last step of the recipe that applies (a GPU-only one is profiled with its change inert)."""
    wl = get_workload(workload)
    dev = resolve_device(device)
    di = info(dev)
    found = None
    for st in LADDER:
        if not_applicable(st, wl.name):
            continue
        if dev.type != "cuda":
            ok = not st.beyond_recipe
        else:
            ok = unavailable(st, di) is None and all(unavailable(c, di) is None for c in chain(st.name) if c.fp8)
        if ok:
            found = st.name
    if found is None:
        raise ValueError(f"no ladder step applies to workload {wl.name!r} on {dev.type}")
    return found


def steps_for(workloads, steps=None, device: str | torch.device = "auto") -> dict[str, list[str]]:
    """Which steps to profile for each of ``workloads`` (a name or a list of names): ``steps`` None gives each
    its ``last_step`` on ``device``; a list gives every workload those steps (one that does not apply comes
    back 'n/a'); a dict {workload: [steps]} gives each its own (a workload it leaves out: its last step)."""
    names = [workloads] if isinstance(workloads, str) else list(workloads or ())
    if not names:
        raise ValueError("workloads must name at least one workload")
    names = list(dict.fromkeys(get_workload(w).name for w in names))
    if isinstance(steps, str):
        steps = [steps]
    if steps is not None and not isinstance(steps, (list, tuple, dict)):
        raise TypeError(f"steps must be None, a list of step names or a dict of them by workload, got {type(steps).__name__}")
    own = {get_workload(w).name: v for w, v in steps.items()} if isinstance(steps, dict) else {}
    out = {}
    for w in names:
        chosen = own.get(w) if isinstance(steps, dict) else steps
        chosen = [chosen] if isinstance(chosen, str) else chosen
        out[w] = [get_step(s).name for s in chosen] if chosen else [last_step(w, device)]
    return out


def launches_per_step(events: list[dict], device_kind: str, steps: int) -> float:
    """Kernels (with copies and memsets) a step launched in a profiled window of ``steps`` steps; on a
    CPU the operators counted in its breakdown stand in."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if device_kind == "cuda":
        return len(trace.device_events(events)) / steps
    return sum(1 for e, _ in trace.exclusive(events) if e.get("cat") in CPU_CATEGORIES) / steps


# --- the study ------------------------------------------------------------------------------------------

@dataclass
class Breakdown:
    workload: str
    step: str
    profile: str
    device: dict
    status: str                         # ok, skipped, n/a, failed
    reason: str | None = None
    profiled: int = 0                   # steps in the profiled window
    timing: bench.Timing | None = None  # wall time of unprofiled steps
    busy_ms: float | None = None        # per step: union of the kernels' intervals
    span_ms: float | None = None        # per step: first kernel start to last kernel end
    ms: dict = field(default_factory=dict)       # category -> ms per step (idle included)
    floors: dict = field(default_factory=dict)   # category -> gpt_floors' entry
    top: list = field(default_factory=list)      # kernels by time
    flops_per_step: float = 0.0
    items_per_step: int = 0             # tokens (or samples) a step
    sol_ms: float | None = None         # flops_per_step at the matmul ceiling: the speed of light
    precision: str = "bf16"
    notes: list = field(default_factory=list)
    launches: float | None = None       # kernels (copies, memsets) a profiled step; CPU operators on a CPU
    floor: Floor | None = None          # the step's floor, every workload (``workload_floor``)
    floor_why: str | None = None        # why there is no floor (its count failed)

    @property
    def step_ms(self) -> float | None:
        return self.timing.median_ms if self.timing else None

    @property
    def items_per_s(self) -> float | None:
        return self.items_per_step / (self.step_ms / 1e3) if self.step_ms else None

    @property
    def sol_share(self) -> float | None:
        return self.sol_ms / self.step_ms if (self.sol_ms and self.step_ms) else None

    def floor_row(self) -> dict:
        """The step against its floor, one row: measured ms, the floor and what bounds it, its parts."""
        f = self.floor
        row = {"workload": self.workload, "step": self.step, "status": self.status, "ms/step": self.step_ms,
               "floor (ms)": f.ms if f else None, "bound by": f.bound if f else None,
               "measured / floor": self.step_ms / f.ms if (f and f.ms and self.step_ms) else None,
               "FLOPs at ceiling (ms)": f.flops_ms if f else None, "bytes at copy (ms)": f.bytes_ms if f else None,
               "GFLOP": f.flops / 1e9 if f else None,
               "optimizer MB": f.optimizer_bytes / 1e6 if f else None,
               "activation MB": f.activation_bytes / 1e6 if f else None, "kernels/step": self.launches}
        if self.status != "ok":
            row["why"] = self.reason
        elif f is None:
            row["why"] = self.floor_why
        return row

    def rows(self) -> list[dict]:
        """One row per category: measured ms/step, share of the step, floor, measured over floor."""
        if self.status != "ok":
            return [{"step": self.step, "category": None, "ms/step": None, "status": self.status, "why": self.reason}]
        out = []
        for c in CATEGORIES:
            f = self.floors.get(c, {})
            m, fl = self.ms.get(c), f.get("ms")
            out.append({"step": self.step, "category": LABELS[c], "ms/step": m,
                        "share of step": m / self.step_ms if (m is not None and self.step_ms) else None,
                        "floor (ms)": fl, "measured / floor": m / fl if (m is not None and fl) else None,
                        "floor basis": f.get("basis")})
        return out

    def floor_records(self, common: dict) -> list[dict]:
        """The step's floor (metric ``floor_ms``, one record per part in ``fields["part"]``: ``step``, the
        floor itself, and ``flops``, ``bytes``, ``launches``, its parts) and the kernels a step launched
        (``launches_per_step``)."""
        recs = [results.make_record(metric="launches_per_step", value=self.launches, unit="count",
                                    fields={"window": "profiled"},
                                    params={"counted": "kernels, copies and memsets" if self.device.get("kind") == "cuda"
                                            else "CPU operators standing in for kernels"}, **common)]
        f = self.floor
        if f is None:
            return recs + [results.make_record(metric="floor_ms", value=None, unit="ms", status="failed",
                                               reason=self.floor_why, fields={"part": "step"}, **common)]
        nonone = "no ceilings in this run (notebook 00 measures them)"
        values = {"step": (f.ms, nonone), "flops": (f.flops_ms, nonone), "bytes": (f.bytes_ms, nonone),
                  "launches": (f.launch_ms, "no per-launch cost is measured (notebook 00's ceilings hold none): "
                                            "the kernels are counted (launches_per_step), not timed")}
        for part, (v, why) in values.items():
            recs.append(results.make_record(metric="floor_ms", value=v, unit="ms", fields={"part": part},
                                            status="ok" if v is not None else "skipped",
                                            reason=None if v is not None else why, params=f.params(), **common))
        return recs

    def records(self, notebook: str) -> list[dict]:
        """The study's records (x-values in fields: the category), ready for ``results.append``."""
        common = dict(notebook=notebook, workload=self.workload, step=self.step, profile=self.profile,
                      device=self.device)
        if self.status != "ok":
            return [results.make_record(metric="category_ms", value=None, unit="ms", status=self.status,
                                        reason=self.reason, fields={"category": "all"}, **common)]
        params = {"profiled_steps": self.profiled, "precision": self.precision, "notes": self.notes}
        t = self.timing
        recs = [results.make_record(metric="step_ms", value=t.median_ms, p20=t.p20_ms, p80=t.p80_ms, unit="ms",
                                    fields={"window": "unprofiled"}, params=params, **common),
                results.make_record(metric="gpu_busy_ms", value=self.busy_ms, unit="ms", fields={"window": "profiled"},
                                    params=params, **common),
                results.make_record(metric="sol_share", value=self.sol_share, unit="ratio", params=params,
                                    status="ok" if self.sol_share is not None else "skipped",
                                    reason=None if self.sol_share is not None else "no matmul ceiling in this run",
                                    **common)]
        recs += self.floor_records(common)
        for c in CATEGORIES:
            recs.append(results.make_record(metric="category_ms", value=self.ms.get(c), unit="ms",
                                            fields={"category": c}, params=params, **common))
            f = self.floors.get(c)
            if f is not None:
                recs.append(results.make_record(
                    metric="category_floor_ms", value=f["ms"], unit="ms", fields={"category": c},
                    status="ok" if f["ms"] is not None else "skipped",
                    reason=None if f["ms"] is not None else "no ceilings in this run (notebook 00 measures them)",
                    params={"flops": f["flops"], "bytes": f["bytes"], "basis": f["basis"]}, **common))
        return recs


def breakdown(workload: str = "gpt", step: str = "09_cuda_graphs", *, profile: str = "auto",
              device: str | torch.device = "auto", seed: int = 0, profiled: int = 3, ceilings: dict | None = None,
              plan: Plan | None = None, config: dict | None = None, keep_trace: bool = False,
              progress: bool = True, run=None) -> Breakdown:
    """Profile ``profiled`` steps of ``workload`` under ``step``'s settings after the ladder's warm-up
    and ``plan.timed`` unprofiled timed steps; returns the ``Breakdown``. ``ceilings`` (the run's,
    ``hwlib.query.ceilings``) give the floors; without them the floors are None. ``keep_trace``
    keeps the Chrome trace under ``<run>/traces/``. A step this device cannot run, or that does not
    apply to the workload, comes back 'skipped' or 'n/a' with the reason, before any work."""
    if not isinstance(profiled, int) or isinstance(profiled, bool) or profiled < 1:
        raise ValueError(f"profiled must be a positive int (steps under the profiler), got {profiled!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    _check_ceilings(ceilings)
    dev, prof, wl, st, di, cfg, pl = resolve(workload, step, profile, device, config, plan)
    out = Breakdown(workload=wl.name, step=st.name, profile=prof, device=di.to_dict(), status="ok",
                    profiled=profiled, flops_per_step=wl.flops_per_step(cfg),
                    items_per_step=wl.items_per_step(cfg), precision=precision_of(st.name))
    if not_applicable(st, wl.name):
        out.status, out.reason = "n/a", not_applicable(st, wl.name)
        return out
    why = unavailable(st, di)
    if why and st.gpu_only and dev.type == "cpu":
        # A CPU profile shows the code path (operators, categories, records), not GPU times: the step
        # runs with its cumulative settings, its own GPU-only change inert, as later ladder steps do.
        out.notes.append(f"{why}: profiled on the CPU with that change inert (the code path, not its times)")
    elif why:
        out.status, out.reason = "skipped", why
        return out
    eff = resolve_autocast(settings_for(st.name), di)
    res = StepResult(workload=wl.name, step=st.name, profile=prof, device=out.device, status="ok",
                     config=dataclasses.asdict(cfg), seed=seed, check_steps=pl.check)
    sess = Session(wl.name, cfg, eff, dev, seed, step=st.name)
    try:
        n_params = sum(p.numel() for p in sess.model.parameters())
        start = timed_window(res, sess, pl)
        out.notes += res.notes
        with sess.precision():
            bar = None
            if progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=start + pl.timed + profiled, desc=f"{wl.name} {st.name} breakdown", leave=False)
            for i in range(start):
                sess.step(i)
                bar and bar.update(1)
            bench.synchronize(dev)
            clock = bench.StepClock(dev)
            clock.mark()
            for i in range(start, start + pl.timed):
                sess.step(i)
                clock.mark()
                bar and bar.update(1)
            out.timing = clock.timing()

            def window():
                for i in range(start + pl.timed, start + pl.timed + profiled):
                    sess.step(i)
                    bar and bar.update(1)
            path = run_dir(run) / "traces" / f"{wl.name}_{st.name}_breakdown.json"
            events, why = trace.record(window, dev, path, keep_trace)
            bar and bar.close()
    finally:
        sess.close()
    if events is None:
        out.status, out.reason = "failed", why
        return out
    ms, out.busy_ms, out.span_ms, out.top, notes = categorize(events, dev.type, profiled,
                                                              lm_head=isinstance(wl, TokenLMWorkload))
    out.notes += notes
    ms["idle"] = max(0.0, out.timing.median_ms - out.busy_ms)
    if out.busy_ms > out.timing.median_ms:
        out.notes.append("the profiled window was busier than the unprofiled step's wall time: idle read as 0")
    out.ms = ms
    out.launches = launches_per_step(events, dev.type, profiled)
    try:
        out.floor = workload_floor(wl.name, st.name, profile=prof, device=dev, ceilings=ceilings, seed=seed,
                                   config=config, launches=out.launches)
    except (RuntimeError, ValueError, TypeError) as e:   # out of memory, an op the counters cannot run
        out.floor_why = f"the floor's count failed: {type(e).__name__}: {str(e)[:300]}"
        out.notes.append(out.floor_why)
    if wl.name == "gpt":
        out.floors = gpt_floors(cfg, n_params, ceilings, out.precision)
        if not why:
            out.notes += floor_caveats(st.name)
    else:
        out.notes.append(f"per-category floors are counted for GPT only: {wl.name} has the step's floor alone")
    peak = roofline.matmul_ceiling(ceilings, out.precision)
    out.sol_ms = out.flops_per_step / (peak * 1e12) * 1e3 if peak else None
    return out


# --- the figure -----------------------------------------------------------------------------------------

def breakdown_figure(bds: list[Breakdown], path=None):
    """Stacked bars: each step's measured ms per category beside its floors, stacked the same way."""
    import matplotlib.pyplot as plt
    ok = [b for b in bds if b.status == "ok"]
    fig, ax = plt.subplots(figsize=(2.2 + 2.4 * max(1, len(ok)), 4.2))
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    xs, names = [], []
    for j, b in enumerate(ok):
        for k, (kind, vals) in enumerate((("measured", b.ms), ("floor", {c: (b.floors.get(c) or {}).get("ms") or 0.0
                                                                           for c in CATEGORIES}))):
            x = 3 * j + k
            bottom = 0.0
            for c in CATEGORIES:
                v = vals.get(c) or 0.0
                ax.bar(x, v, bottom=bottom, color=colors[c], label=LABELS[c] if (j, k) == (0, 0) else None,
                       hatch="//" if kind == "floor" else None, edgecolor="white")
                bottom += v
            xs.append(x)
            several = len({o.workload for o in ok}) > 1
            names.append(f"{b.workload + ' ' if several else ''}{b.step.split('_', 1)[0]} {kind}")
    ax.set_xticks(xs, names, rotation=20)
    ax.set_ylabel("ms per step")
    ax.set_title("where the time goes: measured against each category's floor", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def floor_figure(bds: list[Breakdown], path=None):
    """One panel per profiled workload step: its measured ms by category beside its floor's two parts,
    the FLOPs at the matmul ceiling and the bytes at the copy bandwidth (the optimizer's and the
    activations'), with the floor (the longer of the two) drawn across."""
    import matplotlib.pyplot as plt
    ok = [b for b in bds if b.status == "ok" and b.floor is not None and b.floor.ms]
    fig, axes = plt.subplots(1, max(1, len(ok)), figsize=(1.0 + 3.0 * max(1, len(ok)), 4.2), squeeze=False)
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    for ax, b in zip(axes[0], ok):
        f = b.floor
        bottom = 0.0
        for c in CATEGORIES:
            v = b.ms.get(c) or 0.0
            ax.bar(0, v, bottom=bottom, color=colors[c], edgecolor="white", label=LABELS[c] if b is ok[0] else None)
            bottom += v
        ax.bar(1, f.flops_ms, color="0.35", label="FLOPs at the matmul ceiling" if b is ok[0] else None)
        opt = f.bytes_ms * f.optimizer_bytes / f.nbytes if f.nbytes else 0.0
        ax.bar(2, opt, color="0.6", hatch="//", edgecolor="white", label="optimizer bytes at copy" if b is ok[0] else None)
        ax.bar(2, f.bytes_ms - opt, bottom=opt, color="0.8", hatch="..", edgecolor="white",
               label="activation bytes at copy" if b is ok[0] else None)
        ax.axhline(f.ms, color="black", ls="--", lw=1)
        ax.set_xticks([0, 1, 2], ["measured", "FLOPs", "bytes"])
        ax.set_title(f"{b.workload} {b.step.split('_', 1)[0]}: {b.step_ms / f.ms:.1f}x its floor", fontsize=9)
        ax.set_ylabel("ms per step")
    if ok:
        fig.legend(fontsize=7, loc="lower center", ncol=4)
        fig.suptitle("each workload's step against its floor (dashed: the longer of FLOPs and bytes)", fontsize=10)
        fig.tight_layout(rect=(0, 0.14, 1, 1))
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# --- the prose ------------------------------------------------------------------------------------------

def by_step(records: list[dict]) -> dict[str, dict]:
    """A breakdown's records, per profiled step: ``{"ms": {category: ms}, "floor": {category: ms},
    "step_ms", "sol_share", "head_in_gemms"}``, and where recorded the step's floor (``floor_ms``, its
    ``floor_bound`` and ``floor_parts``; ``floor_why`` where it has none) and ``launches``. Where the size rule did not apply, the head's matmuls
    were counted as GEMMs (the fused head's chunked matmuls are plain cuBLAS calls the rule cannot
    tell from the model's; the breakdown's notes say so), and the head then measures below its own
    floor: the two are one category, ``HEAD_IN_GEMMS``, in both the times and the floors, so that no
    category reads as faster than its floor. A head below its floor whose matmuls the rule did find
    (FP8 matmuls, faster than the 16-bit ceiling its floor counts them at) stays its own category."""
    steps: dict = {}
    for r in records:
        part = (r.get("fields") or {}).get("part")
        if r.get("metric") == "floor_ms" and part == "step" and (r.get("status") != "ok" or r.get("value") is None):
            steps.setdefault(r["step"], {"ms": {}, "floor": {}, "head_in_gemms": False})["floor_why"] = r.get("reason")
        if r.get("status") != "ok" or r.get("value") is None:
            continue
        s = steps.setdefault(r["step"], {"ms": {}, "floor": {}, "head_in_gemms": False})
        if r["metric"] == "floor_ms":   # the step's floor: ``floor_ms`` the whole, ``floor_parts`` by part
            if part == "step":
                s["floor_ms"], s["floor_bound"] = r["value"], (r.get("params") or {}).get("bound")
            else:
                s.setdefault("floor_parts", {})[part] = r["value"]
            continue
        if r["metric"] == "launches_per_step":
            s["launches"], s["launches_counted"] = r["value"], (r.get("params") or {}).get("counted") or "kernels"
            continue
        if r["metric"] == "step_ms":   # the measurement's notes (``Breakdown.records``)
            s["notes"] = list((r.get("params") or {}).get("notes") or ())
        cat = (r.get("fields") or {}).get("category")
        if r["metric"] == "category_ms":
            s["ms"][cat] = r["value"]
        elif r["metric"] == "category_floor_ms":
            s["floor"][cat] = r["value"]
        elif r["metric"] in ("step_ms", "sol_share"):
            s[r["metric"]] = r["value"]
    pair = ("gemm", "lm_head_ce")
    for s in steps.values():
        among = any(HEAD_AMONG_GEMMS in n for n in s.get("notes", ()))
        if (among and all(c in s["ms"] and c in s["floor"] for c in pair)
                and s["ms"]["lm_head_ce"] < s["floor"]["lm_head_ce"]):
            for d in (s["ms"], s["floor"]):
                d[HEAD_IN_GEMMS] = d.pop("gemm") + d.pop("lm_head_ce")
            s["head_in_gemms"] = True
    return steps


def _fp8_head(step: str) -> bool:
    try:
        return "26_fp8_head" in {s.name for s in chain(step)}
    except ValueError:    # a step name the ladder does not know (hand-made records)
        return False


def prose(records: list[dict]) -> str:
    """What the breakdown records of one workload say, per step, in words built from their values."""
    out = []
    for step, s in by_step(records).items():
        if "step_ms" not in s or not s["ms"]:
            continue
        t = s["step_ms"]
        big = max((c for c in s["ms"] if c != "idle"), key=lambda c: s["ms"][c])
        text = (f"At {step} a step took {t:.3g} ms; the largest share went to {LABELS[big]} "
                f"({s['ms'][big]:.3g} ms, {s['ms'][big] / t:.0%} of the step), and the device sat idle for "
                f"{s['ms'].get('idle', 0.0):.3g} ms.")
        if s["head_in_gemms"]:
            text += (f" Its {LABELS['lm_head_ce']} measured below that category's floor: the head's matmuls were "
                     f"counted as {LABELS['gemm']}, so the two are taken together.")
        elif s["ms"].get("lm_head_ce", 0.0) < s["floor"].get("lm_head_ce", 0.0):
            text += (f" Its {LABELS['lm_head_ce']}, its matmuls included, measured "
                     f"{s['floor']['lm_head_ce'] - s['ms']['lm_head_ce']:.3g} ms below that category's floor, which "
                     f"counts those matmuls at the 16-bit ceiling" + (": they run in FP8." if _fp8_head(step) else "."))
        counted = ((HEAD_IN_GEMMS,) if s["head_in_gemms"] else ("gemm", "lm_head_ce")) + (
            "attention", "elementwise", "optimizer")   # the categories with a floor
        gaps = {c: s["ms"][c] - s["floor"][c] for c in s["floor"] if c in s["ms"] and c != "idle"}
        if all(c in s["floor"] for c in counted):
            g = max(gaps, key=gaps.get)
            text += (f" Against the floors, the most time above its floor is in {LABELS[g]} ({gaps[g]:.3g} ms above "
                     f"a floor of {s['floor'][g]:.3g} ms); all categories together sit "
                     f"{sum(gaps.values()) + s['ms'].get('idle', 0.0):.3g} ms above theirs, idle included.")
        if s.get("floor_ms"):
            parts = s.get("floor_parts") or {}
            other = "bytes" if s.get("floor_bound") == "flops" else "flops"
            text += (f" The step's floor is {s['floor_ms']:.3g} ms, set by its "
                     f"{'FLOPs at the matmul ceiling' if s.get('floor_bound') == 'flops' else 'bytes at the copy bandwidth'}"
                     + (f" (its {'bytes' if other == 'bytes' else 'FLOPs'} would take {parts[other]:.3g} ms)"
                        if parts.get(other) is not None else "")
                     + f": the step takes {t / s['floor_ms']:.3g}x it.")
        elif not s["floor"]:
            text += " No floors: " + (s.get("floor_why") or "this run has no measured ceilings (notebook 00 measures them)") + "."
        if s.get("launches") is not None:
            text += (f" A step ran {s['launches']:.0f} {s['launches_counted']} (counted, not timed: no per-launch "
                     f"cost is measured).")
        if s.get("sol_share") is not None:
            text += (f" The model's FLOPs at the measured matmul ceiling would take {s['sol_share']:.0%} of the "
                     f"measured step (its share of the speed of light).")
        out.append(text)
    return " ".join(out) if out else "Nothing was profiled in this run."
