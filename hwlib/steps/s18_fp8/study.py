"""Step 18's study: the LM head's three matmuls in bf16 and in FP8, where FP8 pays and what the layouts cost.

At GPT-2 small's head (M = 16,384 tokens, K = 768 wide, N = 50,304 vocabulary) one training step
runs y = x W^T, dx = dy W and dW = dy^T x: 3 x 2 M N K FLOPs. Variants, each timed as the three
matmuls of one step from the high-precision x, W and dy (``hwlib.bench.time_fn``):

* ``bf16``: three ``torch.mm``; cuBLAS reads transposed operands in place (no copies);
* ``fp8, quantize + transposing copies``: each operand quantized (amax, scale, cast), then the
  backward's operands made K-major with ``.t().contiguous()`` copies of the FP8 tensors, eagerly;
* ``fp8, quantized into each layout``: ``hwlib.steps.s18_fp8.op.quantize`` writes each layout from the
  high-precision tensor, compiled on a GPU so that inductor fuses scale, cast and transposed write;
* ``fp8, matmuls only``: operands quantized beforehand, in their layouts: the most FP8 can give.

Every tensor here is far larger than L2 except x (M K bf16): the runs measure memory, not cache.
Accuracy: each variant's three outputs against float64 matmuls of the same x, W, dy (relative
Frobenius error), FP8 beside bf16.
"""

from __future__ import annotations

import torch

from ... import bench, results
from ...device import ChoiceError, fp8_missing, info, resolve_device
from ...profiles import GPU_PROFILES
from ...shapes import padded
from ...workloads import gpt
from .op import E4M3, E5M2, quantize, quantize_both

# (M, K, N) per profile: GPT-2 small's head at each GPU-sized profile's ladder batch (M = batch x
# context tokens; N the vocabulary padded to a multiple of 64, as step 07 pads it), so that mid's
# M is a quarter of full's as its batch is. The float64 reference of y = x W^T and the float64
# copies each error takes hold M N x 8 B apiece (6.1 GiB at full's M): the study's tensors peaked
# at 23.8 GiB at full's M on an H100, more than a 16 GB GPU has, and at 6.4 GiB at mid's.
HEAD_SHAPE = {p: (gpt.PROFILES[p].batch * gpt.PROFILES[p].context, gpt.PROFILES[p].d_model,
                  padded(gpt.PROFILES[p].vocab, 64)) for p in GPU_PROFILES}
HEAD_SHAPE["smoke"] = (64, 32, 96)
VARIANTS = ("bf16", "fp8, quantize + transposing copies", "fp8, quantized into each layout", "fp8, matmuls only")


def _smm(a, sa, b_col, sb, out_dtype):
    return torch._scaled_mm(a, b_col, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def bf16_step(x, w, dy):
    return x @ w.t(), dy @ w, dy.t() @ x


def fp8_with_copies(x, w, dy):
    """Quantize once per tensor, then transposing copies of the FP8 tensors for the backward."""
    x8, xs = quantize(x, E4M3)
    w8, ws = quantize(w, E4M3)
    g8, gs = quantize(dy, E5M2)
    y = _smm(x8, xs, w8.t(), ws, torch.bfloat16)
    dx = _smm(g8, gs, w8.t().contiguous().t(), ws, torch.bfloat16)      # W^T row-major, passed column-major
    dw = _smm(g8.t().contiguous(), gs, x8.t().contiguous().t(), xs, torch.float32)
    return y, dx, dw


def fp8_layouts(x, w, dy):
    """Each operand quantized straight into the layouts its matmuls need (``quantize_both``: one amax, two casts)."""
    x8, xs, xt8, xts = quantize_both(x, E4M3)
    w8, ws, wt8, wts = quantize_both(w, E4M3)
    g8, gs, gt8, gts = quantize_both(dy, E5M2)
    y = _smm(x8, xs, w8.t(), ws, torch.bfloat16)
    dx = _smm(g8, gs, wt8.t(), wts, torch.bfloat16)
    dw = _smm(gt8, gts, xt8.t(), xts, torch.float32)
    return y, dx, dw


def rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp(min=1e-300)).item()


def head_matmuls(profile: str = "full", device: str | torch.device = "auto", *, shape: tuple | None = None,
                 iters: int = 10, compile_layouts: bool | None = None, seed: int = 0) -> list[dict]:
    """Rows (variant, ms, p20/p80, TFLOP/s, relative errors of y, dx, dW, status) for the head's three
    matmuls at ``shape`` (M, K, N; default ``HEAD_SHAPE[profile]``). On a device without FP8 the FP8
    rows are 'skipped' with the reason; ``compile_layouts`` (default: on a GPU) compiles the
    layout variant, else it runs eagerly and says so."""
    dev = resolve_device(device)
    if shape is None and profile not in HEAD_SHAPE:
        raise ChoiceError("profile", profile, tuple(HEAD_SHAPE))
    M, K, N = shape or HEAD_SHAPE[profile]
    for name, v in (("M", M), ("K", K), ("N", N)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"shape: {name} must be a positive int, got {v!r}")
    if dev.type == "cuda" and any(v % 16 for v in (M, K, N)):
        raise ValueError(f"shape {(M, K, N)}: torch._scaled_mm on CUDA needs multiples of 16")
    _check_iters(iters)
    layouts, compiled = _layouts(dev, compile_layouts)
    x, w, dy = _operands(M, K, N, dev, seed)
    fp8_why = fp8_missing(info(dev))
    pre = None if fp8_why else matmuls_only(x, w, dy)
    fns = {VARIANTS[0]: bf16_step, VARIANTS[1]: fp8_with_copies, VARIANTS[2]: layouts, VARIANTS[3]: pre}
    rows = _timed_rows(fns, x, w, dy, dev, iters, fp8_why, compiled)
    del x, w, dy
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _operands(M: int, K: int, N: int, dev: torch.device, seed: int):
    """bf16 x [M, K] O(1) (LayerNorm'd activations), w [N, K] as GPT-2 initialises weights (std 0.02),
    dy [M, N] O(1 / sqrt(M N)), as a mean loss over the M N outputs gives."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
    w = (0.02 * torch.randn(N, K, device=dev, generator=g)).to(torch.bfloat16)
    dy = ((M * N) ** -0.5 * torch.randn(M, N, device=dev, generator=g)).to(torch.bfloat16)
    return x, w, dy


def _check_iters(iters) -> None:
    if not isinstance(iters, int) or isinstance(iters, bool) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}")


def _layouts(dev: torch.device, compile_layouts: bool | None):
    """(``fp8_layouts``, compiled or not): compiled on a GPU unless ``compile_layouts`` says otherwise, so
    that inductor fuses each operand's scale, cast and transposed write; one compiled function per
    shape it meets."""
    compiled = dev.type == "cuda" if compile_layouts is None else compile_layouts
    return (torch.compile(fp8_layouts, dynamic=False) if compiled else fp8_layouts), compiled


def matmuls_only(x, w, dy):
    """The three FP8 matmuls of (x, w, dy) on operands quantized beforehand, each in the layout its matmul
    reads: a function of the same signature as ``bf16_step`` that times the matmuls alone."""
    q = {k: quantize(t, d, transposed=tr) for k, (t, d, tr) in
         {"x": (x, E4M3, False), "w": (w, E4M3, False), "xt": (x, E4M3, True), "wt": (w, E4M3, True),
          "g": (dy, E5M2, False), "gt": (dy, E5M2, True)}.items()}

    def pre(x_, w_, dy_):
        return (_smm(q["x"][0], q["x"][1], q["w"][0].t(), q["w"][1], torch.bfloat16),
                _smm(q["g"][0], q["g"][1], q["wt"][0].t(), q["wt"][1], torch.bfloat16),
                _smm(q["gt"][0], q["gt"][1], q["xt"][0].t(), q["xt"][1], torch.float32))
    return pre


def _timed_rows(fns: dict, x, w, dy, dev, iters: int, fp8_why: str | None, compiled: bool) -> list[dict]:
    """One row per variant (``fns``: name -> f(x, w, dy) giving (y, dx, dW)): ms, p20/p80, TFLOP/s and the
    relative errors of its outputs against float64 matmuls of the same inputs, ``compiled`` on the
    layouts variant's row (its reason says where it ran eagerly); FP8 variants ``skipped`` with
    ``fp8_why`` where it is set."""
    (M, K), N = x.shape, w.shape[0]
    ref = (x.double() @ w.double().t(), dy.double() @ w.double(), dy.double().t() @ x.double())
    flops = 3 * 2.0 * M * N * K
    rows = []
    for name, fn in fns.items():
        row = {"variant": name, "M": M, "K": K, "N": N, "status": "ok", "reason": None,
               "compiled": name == VARIANTS[2] and compiled}
        if name != "bf16" and fp8_why:
            row.update(status="skipped", reason=fp8_why)
            rows.append(row)
            continue
        out = fn(x, w, dy)   # also the compile, outside the timing
        errs = [rel_error(o, r) for o, r in zip(out, ref)]
        del out
        t = bench.time_fn(lambda i: fn(x, w, dy), dev, warmup=3, iters=iters)
        row.update(ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, tflops=flops / (t.median_ms / 1e3) / 1e12,
                   err_y=errs[0], err_dx=errs[1], err_dw=errs[2])
        if name == VARIANTS[2] and not compiled:
            row["reason"] = "run eagerly (not compiled): its transposed casts are copies here"
        rows.append(row)
    return rows


# --- how far FP8 could go: every matmul of the step, quantization free -------------------------------

def block_linears(profile: str) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of each linear of one GPT-2 block at ``profile``: M tokens of a step, K in, N out."""
    if profile not in gpt.PROFILES:
        raise ChoiceError("profile", profile, tuple(gpt.PROFILES))
    cfg = gpt.PROFILES[profile]
    M, d = cfg.batch * cfg.context, cfg.d_model
    return {"attn_qkv": (M, d, 3 * d), "attn_proj": (M, d, d), "mlp_fc": (M, d, 4 * d), "mlp_proj": (M, 4 * d, d)}


def block_matmuls(profile: str = "full", device: str | torch.device = "auto", *, iters: int = 10,
                  seed: int = 0, compile_layouts: bool | None = None) -> list[dict]:
    """Each block linear's three matmuls (y, dx, dW) at ``profile``'s shapes: in bf16 (``bf16_step``); in
    FP8 with each operand quantized into its layouts by a pass of its own (``fp8_layouts``, compiled on
    a GPU as ``head_matmuls`` does); and in FP8 on operands already quantized (``matmuls_only``: no amax,
    cast or copy counted). Rows as ``head_matmuls``'s, with ``linear``. Gradients O(1 / sqrt(M N)), a
    mean loss's."""
    _check_iters(iters)
    dev = resolve_device(device)
    linears = block_linears(profile)
    layouts, compiled = _layouts(dev, compile_layouts)
    fp8_why = fp8_missing(info(dev))
    rows = []
    for name, (M, K, N) in linears.items():
        x, w, dy = _operands(M, K, N, dev, seed)
        fns = {"bf16": bf16_step, VARIANTS[2]: layouts, VARIANTS[3]: None if fp8_why else matmuls_only(x, w, dy)}
        rows += [{"linear": name, **r} for r in _timed_rows(fns, x, w, dy, dev, iters, fp8_why, compiled)]
        del x, w, dy
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def matmul_headroom(block_rows: list[dict], head_rows: list[dict], n_layer: int) -> dict | None:
    """The most FP8 matmuls could take off one training step were quantizing free: per block linear, its
    three matmuls' bf16 time less their FP8 time (``block_matmuls``'s rows), times ``n_layer``, plus the
    head's (``head_matmuls``'s bf16 and "matmuls only" rows). None where an FP8 row did not run.

        saved = n_layer * sum_linears (t_bf16 - t_fp8) + (t_head_bf16 - t_head_fp8)

    ``blocks_quantized_ms``: the blocks' saving with each operand quantized by a pass of its own
    (the "quantized into each layout" rows), None where those did not run."""
    def ms(rows, variant, **match):
        r = next((r for r in rows if r["variant"] == variant and all(r.get(k) == v for k, v in match.items())), None)
        return r["ms"] if r is not None and r["status"] == "ok" else None
    names = list(dict.fromkeys(r["linear"] for r in block_rows))
    bf16, fp8, passes = ({k: ms(block_rows, v, linear=k) for k in names} for v in ("bf16", VARIANTS[3], VARIANTS[2]))
    ha, hb = ms(head_rows, "bf16"), ms(head_rows, VARIANTS[3])
    if None in (*bf16.values(), *fp8.values(), ha, hb):
        return None
    per_layer = {k: bf16[k] - fp8[k] for k in names}
    blocks = n_layer * sum(per_layer.values())
    # The blocks again with each operand quantized by a pass of its own: what FP8 gives without fusing
    # the quantization into the kernels that produce the operands (negative: it costs).
    quantized = None if None in passes.values() else n_layer * sum(bf16[k] - passes[k] for k in names)
    return {"per_layer_ms": per_layer, "blocks_ms": blocks, "head_ms": ha - hb, "saved_ms": blocks + ha - hb,
            "bf16_ms": n_layer * sum(bf16.values()) + ha, "blocks_quantized_ms": quantized}


def matmul_records(rows: list[dict], metric: str, *, keys: tuple[str, ...], notebook: str, step: str, profile: str,
                   device) -> list[dict]:
    """A ``metric`` record (ms: median, p20, p80) per row of ``head_matmuls`` or ``block_matmuls``, its
    ``keys`` in the fields and its errors and TFLOP/s in the params; a row that did not run is a record
    with its status and reason and no value."""
    recs = []
    for r in rows:
        common = dict(notebook=notebook, workload="gpt", step=step, metric=metric, unit="ms", profile=profile,
                      fields={k: r[k] for k in keys}, device=device)
        if r["status"] == "ok":
            recs.append(results.make_record(value=r["ms"], p20=r["p20_ms"], p80=r["p80_ms"],
                                            params={k: r[k] for k in ("err_y", "err_dx", "err_dw", "tflops")}, **common))
        else:
            recs.append(results.make_record(value=None, status=r["status"], reason=r["reason"], **common))
    return recs


def headroom_words(room: dict, n_layer: int, best: str | None = None, ladder_ms: dict | None = None) -> str:
    """``matmul_headroom``'s figures in words; with the run's fastest bf16 step ``best`` and the ladder's
    ms/step (``ladder_ms``, step 09's among them), the most FP8 could make of that step against step 09."""
    text = (f"**How far FP8 could go.** The step's matmuls take {room['bf16_ms']:.2f} ms in bf16 here "
            f"({n_layer} blocks and the head), and {room['bf16_ms'] - room['saved_ms']:.2f} ms in FP8 on operands "
            f"quantized for free: ")
    text += (f"{room['saved_ms']:.2f} ms saved at most ({room['blocks_ms']:.2f} in the blocks, "
             f"{room['head_ms']:.2f} in the head)." if room["saved_ms"] > 0 else
             "FP8's matmuls are no faster than bf16's on this device, so no FP8 step can gain here.")
    q = room["blocks_quantized_ms"]
    if q is not None:
        text += (" With each operand quantized by a pass of its own, the blocks' matmuls would "
                 + (f"save {q:.2f} ms a step." if q > 0 else f"cost {-q:.2f} ms a step more than in bf16."))
    ms = ladder_ms or {}
    if best in ms and "09_cuda_graphs" in ms and room["saved_ms"] > 0:
        floor = ms[best] - room["saved_ms"]
        text += (f" From this run's fastest bf16 step, {best} at {ms[best]:.2f} ms, that leaves at least {floor:.2f} ms: "
                 f"at most {ms['09_cuda_graphs'] / floor:.2f}x step 09 ({ms['09_cuda_graphs']:.2f} ms) before "
                 f"quantizing costs anything.")
    return text
