"""The LM head + cross-entropy alone, at one shape: every implementation's time, memory and accuracy.

The shape is GPT-2 small's head (16,384 tokens x width 768 x vocabulary 50,257 padded to 50,304),
inputs as the model hands them over: h fp32 (LayerNorm's output under autocast), the tied weight
fp32, bf16 autocast around the call (fp16 on GPUs without bf16, as the ladder falls back). Each
implementation runs forward + backward to fp32 gradients of h and W; its loss and gradients are
compared with a float64 reference on the same inputs.

=======================  ===================================================================
``unfused, compiled``    ``F.linear`` + slice + ``F.cross_entropy`` under torch.compile (what
                         ladder step 09 runs); on CPU skipped (compile time, nothing to learn)
``unfused, eager``       the same without compile: every logits-sized intermediate exists
``hwlib fused``          ``hwlib.steps.s17_fused_lm_head.op.fused_linear_cross_entropy`` (Triton on CUDA)
``liger``                Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (CUDA, when installed)
``cut-cross-entropy``    Apple's ``cut_cross_entropy.linear_cross_entropy``, its exact variant
                         (no gradient filtering; CUDA, when installed)
=======================  ===================================================================

Liger and Cut Cross-Entropy get the weight's first ``vocab`` rows (they have no padded-vocabulary
option: padded rows would be classes to them) and 16-bit copies of h and W, as autocast would make;
their gradients flow back through those casts to the fp32 leaves, as the others' do.
"""

from __future__ import annotations

import functools
import math

import torch

from ... import bench, precision, results, roofline
from ...device import Unavailable, info, supports_bf16
from ...ops.sources import interpreted_here, read_kernel_source
from ...shapes import padded
from . import STEP, ce_rows_cuda
from .op import (chunk_rows, fused_linear_cross_entropy, linear_cross_entropy_reference, select_backend, traffic_bytes,
                 unfused_linear_cross_entropy)

IMPLS = ("unfused, compiled", "unfused, eager", "hwlib fused", "hwlib fused, Triton row pass", "liger",
         "cut-cross-entropy")
OTHERS = ("liger", "cut-cross-entropy")     # other projects' kernels: a failure there is a row, not a crash
NOTEBOOK = STEP.name   # the records' notebook: the step's own, which bears its name
IGNORED_SHARE = 0.01          # a few ignore_index targets, as padding or masked prompts would give


def make_inputs(n: int, d: int, vocab: int, vocab_padded: int, device, seed: int = 0):
    """h [n, d] ~ N(0, 1) (a LayerNorm output), W [vocab_padded, d] ~ N(0, 0.02) (GPT-2's init), targets
    uniform over the vocabulary with IGNORED_SHARE of them ignore_index (-100). Drawn on the CPU from
    ``seed``, so every device gets the same numbers."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(vocab_padded, d, generator=g) * 0.02
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < IGNORED_SHARE] = -100
    return h.to(device), w.to(device), t.to(device)


# --- the implementations: fn(h, w, t) -> loss, called under the caller's autocast ---------------------

def half_dtype(device: torch.device) -> torch.dtype:
    """The autocast dtype the ladder uses on ``device``: bf16, or fp16 where bf16 is missing (T4)."""
    return torch.bfloat16 if supports_bf16(info(device)) else torch.float16


def _liger(vocab: int, dt: torch.dtype):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        call = lambda e, c, t: loss_fn(c, e, t)      # noqa: E731  (weight first, as Liger's module takes it)
    except ImportError:
        # liger_kernel.transformers imports Hugging Face transformers; the autograd Function alone does not
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        call = LigerFusedLinearCrossEntropyFunction.apply     # (input, weight, target), ignore_index -100

    def fn(h, w, t):
        out = call(h.to(dt), w[:vocab].to(dt), t)
        return out[0] if isinstance(out, tuple) else out      # releases that can also return a z-loss
    return fn


def cce_exact_options(module) -> dict:
    """The keyword arguments that ask ``module`` (cut_cross_entropy) for its exact variant, read off what
    the installed release declares: releases whose ``LinearCrossEntropyImpl`` names ``CCE_EXACT`` take that
    preset; later ones (25.x: only CCE and TORCH_COMPILE, ``impl="cce_exact"`` raises NotImplementedError)
    turn gradient filtering off with ``filter_eps=None``, which is the same thing."""
    impls = getattr(module, "LinearCrossEntropyImpl", None)
    if impls is not None and "CCE_EXACT" in getattr(impls, "__members__", {}):
        return {"impl": "cce_exact"}
    return {"filter_eps": None}


def _cce(vocab: int, dt: torch.dtype):
    import cut_cross_entropy

    exact = cce_exact_options(cut_cross_entropy)

    def fn(h, w, t):
        return cut_cross_entropy.linear_cross_entropy(h.to(dt), w[:vocab].to(dt), t, **exact)
    return fn


def implementations(device: torch.device, vocab: int, impls=IMPLS) -> list[tuple[str, object, str | None]]:
    """(name, fn or None, why not) for each of ``impls`` on ``device``."""
    out = []
    for name in impls:
        if name not in IMPLS:
            raise ValueError(f"impls: {name!r} is not one of {IMPLS}")
        fn, why = None, None
        if name == "unfused, eager":
            fn = functools.partial(unfused_linear_cross_entropy, vocab=vocab)
        elif name == "unfused, compiled":
            if device.type == "cuda":
                fn = torch.compile(functools.partial(unfused_linear_cross_entropy, vocab=vocab))
            else:
                why = "compiled on a GPU only (on CPU the smoke profile checks that the code runs)"
        elif name == "hwlib fused":
            fn = functools.partial(fused_linear_cross_entropy, vocab=vocab)
        elif name == "hwlib fused, Triton row pass" and device.type != "cuda":
            why = ("timed on a GPU only: interpreted on a CPU its time means nothing (odd_size_rows checks its "
                   "numbers there)")
        elif name == "hwlib fused, Triton row pass":
            # what 'auto' ran before the CUDA row pass, and runs where that cannot: side by side
            try:
                select_backend("triton", device)
                fn = functools.partial(fused_linear_cross_entropy, vocab=vocab, backend="triton")
            except (Unavailable, ImportError) as e:
                why = str(e)
        elif device.type != "cuda":
            why = f"{name} runs Triton kernels on CUDA tensors only; this device is {device.type}"
        else:
            try:
                fn = (_liger if name == "liger" else _cce)(vocab, half_dtype(device))
            except ImportError as e:
                why = f"not installed ({e})"
            except Exception as e:      # installed but broken against this torch / Triton: a row that says so
                why = f"import failed ({type(e).__name__}: {e})"
        out.append((name, fn, why))
    return out


# (N, D, V_pad, V, chunk): nothing a multiple of a tile; several vocabulary tiles; ragged last chunks
ODD_SIZES = ((1000, 97, 1003, 999, None), (517, 64, 8261, 8209, 200), (3, 5, 7, 7, 2))
# On a CPU the Triton row pass also runs interpreted (``interpreted_here``), at sizes small enough for a
# fraction of a second each (the interpreter runs each row's program in numpy): a row inside one partial
# tile, unpadded; and a row past one tile (BLOCK_V 8192), whose second tile holds one class and the
# weight's padding. Ragged chunks of rows in both.
INTERPRETED_SIZES = ((3, 5, 7, 7, 2), (5, 3, 8203, 8193, 2))


def odd_size_rows(device, sizes=ODD_SIZES, seed: int | None = None, tol: float = 1e-4,
                  interpreted_sizes=INTERPRETED_SIZES) -> list[dict]:
    """The op (backend 'auto': Triton on CUDA) in fp32 with IEEE matmuls against float64 on fresh
    random inputs (``seed`` None: drawn now, and reported) at odd sizes, the first target of each size
    ignored and others too: relative errors of loss, dh and dW, and whether each is within ``tol``. On a
    CPU where Triton interprets, the Triton row pass too at ``interpreted_sizes``."""
    device = torch.device(device)
    seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
    runs = [(select_backend("auto", device, torch.float32, s[2]), s) for s in sizes]
    if device.type == "cpu" and interpreted_here(device):
        runs += [("triton", s) for s in interpreted_sizes]    # the row pass a GPU runs, checked here too
    rows = []
    with precision.tf32_mode(False):
        for i, (backend, (n, d, vp, v, chunk)) in enumerate(runs):
            h, w, t = make_inputs(n, d, v, vp, device, seed + i)
            w = w * 50                                   # logits of order 1, not 0.02
            t[0] = -100                                  # an ignored target at every size, however few rows
            ref_loss, ref_gh, ref_gw = reference(h, w, t, v)
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss = fused_linear_cross_entropy(hh, ww, t, vocab=v, chunk=chunk, backend=backend)
            loss.backward()
            errs = {"loss": abs(float(loss.detach()) - ref_loss) / abs(ref_loss), "dh": _rel(hh.grad, ref_gh),
                    "dW": _rel(ww.grad, ref_gw)}
            rows.append({"N": n, "D": d, "V_pad": vp, "V": v, "chunk": chunk, "seed": seed + i,
                         "backend": backend + (" (interpreted)" if backend == "triton" and device.type == "cpu"
                                               else ""),
                         **{f"{k} rel. error": e for k, e in errs.items()},
                         "padded rows of dW": float(ww.grad[v:].abs().max()) if vp > v else 0.0,
                         "within tolerance": all(e < tol for e in errs.values())})
    return rows


def _amp(device: torch.device) -> str:
    return "bf16" if half_dtype(device) == torch.bfloat16 else "fp16"


def _fwd_bwd(fn, h, w, t, device, amp: str = "bf16"):
    h.grad = w.grad = None
    with precision.autocast(amp, device):
        loss = fn(h, w, t)
    loss.backward()
    return loss


def reference(h, w, t, vocab: int):
    """Float64 loss and gradients of h and of every row of W (the padded rows' gradient is zero)."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    loss = linear_cross_entropy_reference(h64, w64, t, vocab)
    loss.backward()
    return float(loss.detach()), h64.grad, w64.grad


def _rel(x, ref) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def head_rows(n: int, d: int, vocab: int, vocab_padded: int, device, *, impls=IMPLS, warmup: int = 3,
              iters: int = 10, seed: int = 0, progress: bool = True) -> list[dict]:
    """Each implementation: forward + backward ms (median, p20, p80 of ``iters`` calls after ``warmup``),
    peak memory above the inputs during one call (CUDA), and relative errors of loss, dh and dW
    against float64. An implementation that is unavailable (or, for the other projects' kernels,
    fails on its first call) gives a row with status 'skipped' and the reason; one whose loss is not
    finite gives 'nonfinite' and no time."""
    device = torch.device(device)
    h, w, t = make_inputs(n, d, vocab, vocab_padded, device, seed)
    h.requires_grad_(), w.requires_grad_()
    ref_loss, ref_gh, ref_gw = reference(h, w, t, vocab)
    amp = _amp(device)
    rows = []
    todo = implementations(device, vocab, impls)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(todo), desc="LM head implementations", leave=False)
    with precision.tf32_mode(True):
        for name, fn, why in todo:
            row = {"impl": name, "N": n, "D": d, "V": vocab, "status": "skipped" if fn is None else "ok",
                   "reason": why, "ms": None, "p20": None, "p80": None, "first_call_s": None, "peak_extra_gib": None,
                   "loss_rel_err": None, "grad_h_rel_err": None, "grad_w_rel_err": None}
            if fn is not None:
                try:   # first call: compiles, loads, tunes
                    first_s, loss = bench.wall_s(lambda: _fwd_bwd(fn, h, w, t, device, amp), device)
                except Exception as e:
                    if name not in OTHERS:
                        raise                    # ours and torch's own: a failure is a bug to see
                    row.update(status="skipped", reason=f"failed when run ({type(e).__name__}: {str(e)[:200]})")
                    fn = None
            if fn is not None:
                row["first_call_s"] = first_s
                loss = float(loss.detach())
                if not math.isfinite(loss):
                    row.update(status="nonfinite", reason=f"loss {loss}; time not reported")
                else:
                    row["loss_rel_err"] = abs(loss - ref_loss) / abs(ref_loss)
                    row["grad_h_rel_err"] = _rel(h.grad, ref_gh)
                    row["grad_w_rel_err"] = _rel(w.grad, ref_gw)
                    row["peak_extra_gib"] = peak_extra_gib(lambda: _fwd_bwd(fn, h, w, t, device, amp), device)
                    tm = bench.time_fn(lambda i: _fwd_bwd(fn, h, w, t, device, amp), device, warmup=warmup, iters=iters)
                    row.update(ms=tm.median_ms, p20=tm.p20_ms, p80=tm.p80_ms)
                h.grad = w.grad = None
            rows.append(row)
            bar and bar.update(1)
    bar and bar.close()
    return rows


def peak_extra_gib(call, device) -> float | None:
    """Peak memory allocated during ``call()`` above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    bench.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    bench.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def chunk_rows_sweep(n: int, d: int, vocab: int, vocab_padded: int, device, chunks: list[int], *,
                     warmup: int = 3, iters: int = 10, seed: int = 0) -> list[dict]:
    """The fused op at each rows-per-chunk: forward + backward ms and peak memory above the inputs
    (fewer, larger chunks: fuller GEMMs and fewer dW accumulations, more memory)."""
    device = torch.device(device)
    h, w, t = make_inputs(n, d, vocab, vocab_padded, device, seed)
    h.requires_grad_(), w.requires_grad_()
    amp = _amp(device)
    rows = []
    with precision.tf32_mode(True):
        for c in chunks:
            fn = functools.partial(fused_linear_cross_entropy, vocab=vocab, chunk=c)
            _fwd_bwd(fn, h, w, t, device, amp)
            peak = peak_extra_gib(lambda: _fwd_bwd(fn, h, w, t, device, amp), device)
            tm = bench.time_fn(lambda i: _fwd_bwd(fn, h, w, t, device, amp), device, warmup=warmup, iters=iters)
            rows.append({"chunk": c, "chunks": -(-n // c), "ms": tm.median_ms, "p20": tm.p20_ms, "p80": tm.p80_ms,
                         "peak_extra_gib": peak})
    return rows


def kernel_config_rows(n_rows: int, vocab: int, vocab_padded: int, device, configs=None, *, warmup: int = 5,
                       iters: int = 20, seed: int = 0) -> list[dict]:
    """Each row pass alone (``ce_rows_`` with the gradient write) on a [n_rows, vocab_padded] bf16
    chunk: the Triton pass at each (BLOCK_V, num_warps) of ``configs`` (default: its CONFIGS), then
    the CUDA pass at 512 and 1024 threads a row (BLOCK_V: the whole row) where it runs. ms, and GB/s
    on the bytes each moves: the Triton pass two reads of V columns and one write of V_pad per row,
    the CUDA pass one read and one write of V_pad. ``default``: the launch ``auto`` makes. CUDA only:
    the interpreter's times mean nothing."""
    from .op import _kernel
    kern = _kernel()
    auto = select_backend("auto", device, torch.bfloat16, vocab_padded)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    z0 = torch.randn(n_rows, vocab_padded, generator=g, device=device).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n_rows,), generator=g, device=device)
    loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    scale = torch.full((1,), 1.0 / n_rows, device=device)
    z = z0.clone()
    nbytes = traffic_bytes(n_rows, vocab, vocab_padded, 2)
    rows = []
    for bv, nw in (configs or kern.CONFIGS):
        # each call writes a gradient over z, which the next call reads as logits: the same bytes
        # and work (the values only need to be finite)
        tm = bench.time_fn(lambda i: kern.ce_rows_(z, t, loss, scale, vocab, -100, True, bv, nw), device,
                           warmup=warmup, iters=iters)
        z.copy_(z0)
        rows.append({"pass": "triton", "BLOCK_V": bv, "num_warps": nw,
                     "default": auto == "triton" and (bv, nw) == (kern.DEFAULT_BLOCK_V, kern.DEFAULT_WARPS),
                     "ms": tm.median_ms, "p20": tm.p20_ms, "p80": tm.p80_ms,
                     "GB/s": nbytes["row_pass"] / tm.median_ms / 1e6})
    if auto == "cuda":
        for threads in (ce_rows_cuda.THREADS, 1024):
            tm = bench.time_fn(lambda i: ce_rows_cuda.ce_rows_(z, t, loss, scale, vocab, -100, True, threads), device,
                               warmup=warmup, iters=iters)
            z.copy_(z0)
            rows.append({"pass": "cuda", "BLOCK_V": vocab_padded, "num_warps": threads // 32,
                         "default": threads == ce_rows_cuda.THREADS, "ms": tm.median_ms, "p20": tm.p20_ms,
                         "p80": tm.p80_ms, "GB/s": nbytes["row_pass_one_read"] / tm.median_ms / 1e6})
    return rows


def head_prediction(n: int, d: int, vocab: int, vocab_padded: int, ceilings: dict | None,
                    backend: str = "cuda") -> list[dict]:
    """The head's counts and floors at this run's ceilings: the three GEMMs' FLOPs (2 N D V_pad each)
    at the bf16 matmul ceiling, plus the row pass's bytes (``traffic_bytes``) at the copy ceiling
    (the GEMMs' own logits bytes overlap their FLOPs); and the largest logits buffer each path
    holds (bf16; the unfused path's fp32 copies depend on what the compiler fuses, and are not
    counted). The op's row comes first for the row pass it runs (``backend``: cuda or triton), the
    other pass second; the GEMMs alone last."""
    flops = 3 * 2.0 * n * d * vocab_padded
    tb = traffic_bytes(n, vocab, vocab_padded, 2)
    chunk = chunk_rows(n, vocab_padded, 2)
    gemm_ms = roofline.flops_ms(flops, ceilings, "bf16")

    def row(path: str, row_bytes: float, logits_rows: int | None) -> dict:
        row_ms = roofline.bytes_ms(row_bytes, ceilings) if row_bytes else 0.0
        return {"path": path, "GFLOP": flops / 1e9, "row-pass GB": row_bytes / 1e9,
                "floor (ms)": None if gemm_ms is None or row_ms is None else gemm_ms + row_ms,
                "largest logits buffer (GB)": logits_rows * vocab_padded * 2 / 1e9 if logits_rows else None}

    fused = [row("hwlib fused, CUDA row pass (one read a row)", tb["row_pass_one_read"], chunk),
             row("hwlib fused, Triton row pass (two reads)", tb["row_pass"], chunk)]
    if backend != "cuda":
        fused.reverse()
    return fused + [row("unfused, at its fewest passes", tb["row_pass"], n), row("the GEMMs alone", 0.0, None)]


def kernel_source() -> str:
    """The Triton row pass's kernel, read from the kernel file (no Triton import needed)."""
    src = read_kernel_source("17_linear_ce_triton.py")
    start = src.index("@triton.jit")
    return src[start: src.index("\ndef ", src.index("def _ce_rows_kernel") + 1)].rstrip()


def cuda_kernel_source() -> str:
    """The CUDA row pass's kernel function, read from ``17_ce_rows.cu``."""
    src = ce_rows_cuda.kernel_source()
    start = src.index("template <typename T, int THREADS>\n__global__")
    return src[start: src.index("\ntemplate", start + 1)].rstrip()


# --- prose, from the measured rows ---------------------------------------------------------------

def _ms(r: dict) -> str:
    return f"{r['ms']:.3g} ms (p20 {r['p20']:.3g}, p80 {r['p80']:.3g})"


def head_prose(rows: list[dict], floor_rows: list[dict], sweep: list[dict], configs: list[dict]) -> str:
    """What the head-alone comparison showed, in words built from its rows."""
    by = {r["impl"]: r for r in rows}
    ours = by.get("hwlib fused")
    if not ours or ours["status"] != "ok":
        return "The fused op did not run: " + (ours["reason"] if ours else "not measured") + "."
    shape = f"At N {ours['N']}, D {ours['D']}, V {ours['V']}"
    parts = [f"{shape} the fused op took {_ms(ours)} for forward + backward"]
    base = next((by[k] for k in ("unfused, compiled", "unfused, eager") if by.get(k, {}).get("status") == "ok"), None)
    if base:
        parts[0] += (f", the {base['impl']} head {_ms(base)}: {base['ms'] / ours['ms']:.2f}x its speed")
        if ours["peak_extra_gib"] is not None and base["peak_extra_gib"]:
            parts[0] += (f"; peak memory above the inputs {ours['peak_extra_gib']:.3g} GiB against "
                         f"{base['peak_extra_gib']:.3g} GiB ({ours['peak_extra_gib'] / base['peak_extra_gib']:.0%})")
        parts.append(f"Against float64, its dh error was {ours['grad_h_rel_err']:.2g} and its dW error "
                     f"{ours['grad_w_rel_err']:.2g}, the {base['impl']} head's {base['grad_h_rel_err']:.2g} and "
                     f"{base['grad_w_rel_err']:.2g} (loss {ours['loss_rel_err']:.2g} against {base['loss_rel_err']:.2g})")
    floor = floor_rows[0]["floor (ms)"] if floor_rows else None
    if floor:
        parts.append(f"The floor at this run's ceilings (GEMMs plus the row pass's bytes) is {floor:.3g} ms: the op "
                     f"ran at {floor / ours['ms']:.0%} of that speed")
    for name in ("hwlib fused, Triton row pass", "unfused, compiled", "unfused, eager", "liger", "cut-cross-entropy"):
        r = by.get(name)
        if not r or r is base:
            continue
        if r["status"] == "ok":
            mem = f", {r['peak_extra_gib']:.3g} GiB" if r["peak_extra_gib"] is not None else ""
            parts.append(f"{name}: {_ms(r)}{mem}, dW error {r['grad_w_rel_err']:.2g}")
        else:
            parts.append(f"{name} did not run ({r['reason']})")
    if sweep:
        best = min(sweep, key=lambda r: r["ms"])
        chunks = f"{best['chunks']} chunk" + ("s" if best["chunks"] != 1 else "")
        parts.append(f"Of the chunk sizes tried, {best['chunk']} rows ({chunks}) was fastest at "
                     f"{best['ms']:.3g} ms" + (f" with {best['peak_extra_gib']:.3g} GiB" if best["peak_extra_gib"] else ""))
    if configs:
        best = min(configs, key=lambda r: r["ms"])
        default = next((r for r in configs if r["default"]), None)
        parts.append(f"The row pass alone ran fastest as the {best.get('pass', 'triton')} pass at BLOCK_V "
                     f"{best['BLOCK_V']}, {best['num_warps']} warps ({best['ms']:.3g} ms, {best['GB/s']:,.0f} GB/s on "
                     "its bytes)"
                     + (f"; the default launch took {default['ms']:.3g} ms" if default and default is not best else
                        ", the default launch"))
        by_pass = {k: min((r for r in configs if r.get("pass", "triton") == k), key=lambda r: r["ms"], default=None)
                   for k in ("triton", "cuda")}
        if by_pass["triton"] and by_pass["cuda"]:
            tr, cu = by_pass["triton"], by_pass["cuda"]
            parts.append(f"The Triton pass at its best took {tr['ms'] / cu['ms']:.2f}x the CUDA pass's time: it reads "
                         f"each row twice, and moved its bytes at {tr['GB/s']:,.0f} GB/s against the CUDA pass's "
                         f"{cu['GB/s']:,.0f}")
    return ". ".join(parts) + "."


def memory_prose(ladder_rows: list[dict], step: str) -> str:
    """The training step's peak memory at ``step`` against the nearest earlier step that has one."""
    rows = [r for r in ladder_rows if r.get("peak_mem_gib") is not None]
    me = next((r for r in rows if r["step"] == step), None)
    before = [r for r in rows if r["step"] < step]
    if me is None or not before:
        return "Peak memory of the training step is measured on CUDA only; no pair of steps to compare here."
    b = before[-1]
    return (f"Peak memory of the training step: {me['peak_mem_gib']:.3g} GiB at {step} against "
            f"{b['peak_mem_gib']:.3g} GiB at {b['step']} ({b['peak_mem_gib'] - me['peak_mem_gib']:+.3g} GiB freed).")


# --- records --------------------------------------------------------------------------------------

_HEAD_METRICS = (("loss_rel_err", "relative"), ("grad_h_rel_err", "relative"), ("grad_w_rel_err", "relative"),
                 ("peak_extra_gib", "GiB"), ("first_call_s", "s"))


def head_records(rows: list[dict], *, profile: str, device) -> list[dict]:
    """One record per metric per implementation; x-values (impl, N, D, V) in fields."""
    recs = []
    for r in rows:
        f = {"study": "lm_head", "impl": r["impl"], "N": r["N"], "D": r["D"], "V": r["V"]}
        st = "ok" if r["status"] == "ok" else ("skipped" if r["status"] == "skipped" else "failed")
        recs.append(results.make_record(notebook=NOTEBOOK, workload="gpt", step=None, metric="head_fwd_bwd_ms",
                                        value=r["ms"], p20=r["p20"], p80=r["p80"], unit="ms", status=st,
                                        reason=r["reason"], profile=profile, device=device, fields=f))
        if st == "ok":
            recs += [results.make_record(notebook=NOTEBOOK, workload="gpt", step=None, metric=m, value=r[m], unit=u,
                                         profile=profile, device=device, fields=f)
                     for m, u in _HEAD_METRICS if r[m] is not None]
    return recs


def sweep_records(rows: list[dict], *, metric: str, keys: tuple, profile: str, device, fields: dict) -> list[dict]:
    """A sweep's rows (chunk sizes, kernel configs) as ms records, the swept values in fields."""
    return [results.make_record(notebook=NOTEBOOK, workload="gpt", step=None, metric=metric, value=r["ms"],
                                p20=r["p20"], p80=r["p80"], unit="ms", profile=profile, device=device,
                                fields={**fields, **{k: r[k] for k in keys}}) for r in rows]


def gpt2_head_shape(batch: int = 16, context: int = 1024, d: int = 768, vocab: int = 50257, multiple: int = 64):
    """(N, D, V, V_pad) of GPT-2 small's head at the ladder's batch."""
    return batch * context, d, vocab, padded(vocab, multiple)
