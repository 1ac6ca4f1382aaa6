"""Measurements of the BK-Core study (notebook 12): accuracy, speed per backend, and references.

Minimal bytes (each input read once, each output written once), s = bytes of the real dtype:

    forward:           a (N) + b, c (N-1 each) read, G (N complex) written  ~ 3 N s + 2 N s = 5 N s
    forward+backward:  the forward, then a, b, c and the complex incoming grad read, and the three
                       real gradients written                               ~ 5 N s + 5 N s + 3 N s

so 20 B per element forward in float32. ``gbps`` divides those bytes by the measured time: the share
of the measured copy ceiling (handed in by the caller; n/a without one) says how close to the memory
floor a kernel runs. Every timing is of a call whose output was checked against the float64
reference first (computed once per size and direction, shared by the backends timed on the same
inputs and incoming gradients). Records: workload "bk_core", step None, x-values in fields
(``speed_records``, ``first_failing_records``, ``target_records``, ``prebuild_records``).

On a GPU the Triton kernels the notebook launches compile in background processes from its start
(``prebuild_kernels``, ``hwlib.ops.bk_prebuild``): the untimed cells take the handle (``prebuilt``)
and wait for a kernel's build only just before its first launch; the speed sweep waits for every
build before its first timing, so that no compiler competes for the host while anything is timed.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from .. import bench
from ..ops.bk_core import resolvent_diagonal
from ..ops.bk_prebuild import Build, Prebuild, prebuild, why_not
from ..ops.bk_reference import (backward_loop, forward_loop, resolvent_diagonal_dense,
                                resolvent_diagonal_theta_phi)
from ..results import make_record


def random_inputs(batch: int | tuple, n: int, *, dtype=torch.float32, device="cpu", seed: int = 0,
                  symmetric: bool = False, potential: float = 1.0):
    """a = -2 + v with v ~ U(-potential, potential) (the model's a = -2 + v); b, c ~ 1 + 0.2 N(0, 1),
    independent unless ``symmetric``."""
    shape = (batch,) if isinstance(batch, int) else tuple(batch)
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = -2.0 + potential * (2 * torch.rand(*shape, n, generator=g, dtype=torch.float64) - 1)
    b = 1.0 + 0.2 * torch.randn(*shape, max(n - 1, 0), generator=g, dtype=torch.float64)
    c = b.clone() if symmetric else 1.0 + 0.2 * torch.randn(*shape, max(n - 1, 0), generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (a, b, c))


def sets_needed(batch: int, n: int, dtype=torch.float32, direction: str = "forward") -> int:
    """Input sets a timing rotates among: enough to exceed twice the L2 cache (so DRAM, not L2, is
    measured), at most 8."""
    return min(8, max(1, math.ceil(2 * 64 * 2**20 / min_bytes(batch, n, dtype, direction))))


def input_sets(batch: int, n: int, dtype, device, count: int) -> list[tuple]:
    """``count`` input sets for timing, ``random_inputs``' seeds 0..count-1."""
    return [random_inputs(batch, n, dtype=dtype, device=device, seed=i) for i in range(count)]


def min_bytes(batch: int, n: int, dtype=torch.float32, direction: str = "forward") -> int:
    s = torch.finfo(dtype).bits // 8
    fwd = batch * (n * s + 2 * (n - 1) * s + 2 * n * s)
    if direction == "forward":
        return fwd
    return fwd + batch * (n * s + 2 * (n - 1) * s + 2 * n * s) + batch * (n * s + 2 * (n - 1) * s)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in complex128; inf when x has non-finite entries."""
    x, ref = x.to(torch.complex128).cpu(), ref.to(torch.complex128).cpu()
    if not torch.isfinite(torch.view_as_real(x)).all():
        return math.inf
    return (torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref)).item()


DIRECTIONS = ("forward", "forward+backward")
Z = 1j                       # the timed calls' z (the model's)


def _timed_call(backend: str, direction: str, inputs: list, grads: list, kernel_only: bool):
    """fn(i): one call on input set i (rotating), returning what it computed: G forward, the three
    gradients forward+backward."""
    from ..ops.bk_core import _backward, _forward
    if kernel_only:
        def fn(i):
            a, b, c = inputs[i % len(inputs)]
            g = _forward(backend, a, b, c, Z)
            return _backward(backend, a, b, c, Z, grads[i % len(inputs)]) if direction != "forward" else g
    elif direction == "forward":
        def fn(i):
            a, b, c = inputs[i % len(inputs)]
            with torch.no_grad():
                return resolvent_diagonal(a, b, c, Z, backend=backend, check_finite=False)
    else:
        leaves = [tuple(t.clone().requires_grad_(True) for t in s) for s in inputs]

        def fn(i):
            a, b, c = leaves[i % len(leaves)]
            g = resolvent_diagonal(a, b, c, Z, backend=backend, check_finite=False)
            return torch.autograd.grad(g, (a, b, c), grads[i % len(leaves)])
    return fn


def reference_output(direction: str, a, b, c, grad, rows: int = 4) -> list[torch.Tensor]:
    """The float64 loop reference of a timed call on its first ``rows`` sequences: [G] forward, the
    three gradients forward+backward (for the incoming ``grad``)."""
    k = min(rows, a.shape[0])
    a64, b64, c64 = (x[:k].detach().cpu().double() for x in (a, b, c))
    if direction == "forward":
        return [forward_loop(a64, b64, c64, Z)]
    return list(backward_loop(a64, b64, c64, Z, grad[:k].cpu().to(torch.complex128)))


def check_output(backend: str, direction: str, out, a, b, c, grad, rows: int = 4, want: list | None = None) -> float:
    """The timed call's output against the float64 loop reference on its first ``rows`` sequences;
    returns the relative error, raises RuntimeError past the dtype's tolerance: a time is only
    worth recording for a call that computes G. ``want``: that reference (``reference_output``)
    where the caller has it already, else computed here."""
    k = min(rows, a.shape[0])
    got = [out[:k]] if direction == "forward" else [x[:k] for x in out]
    if want is None:
        want = reference_output(direction, a, b, c, grad, rows)
    tol = 1e-3 if a.dtype == torch.float32 else 1e-9
    err = 0.0
    for x, ref in zip(got, want):
        if ref.numel():
            diff = (x.detach().cpu().to(ref.dtype) - ref).abs().max()
            err = max(err, float(diff / ref.abs().max().clamp_min(1e-300)))
    if not err <= tol:                   # also NaN
        raise RuntimeError(f"time_backend: backend {backend!r} ({direction}) differs from the float64 reference "
                           f"by {err:.2e} (tolerance {tol:g}): its timing would be of a wrong result")
    return err


GRAD_SEED = 12                # the timings' incoming gradients (``timing_grads``)


def timing_grads(batch: int, n: int, dtype, device, count: int) -> list[torch.Tensor]:
    """The incoming complex gradients of the forward+backward timings, one per input set: seeded,
    so every backend's backward at a size gets the same ones and one float64 reference serves all."""
    dev = torch.device(device)
    cplx = torch.complex64 if dtype == torch.float32 else torch.complex128
    g = torch.Generator(device=dev).manual_seed(GRAD_SEED)
    return [torch.randn(batch, n, dtype=cplx, device=dev, generator=g) for _ in range(count)]


def time_backend(backend: str, batch: int, n: int, device, *, direction: str = "forward",
                 dtype=torch.float32, iters: int = 20, warmup: int = 3, group: int | None = None,
                 kernel_only: bool = False, verify: bool = True, sets: list | None = None,
                 refs: dict | None = None) -> bench.Timing:
    """Median time of one call (``forward``) or one call and its backward (``forward+backward``).
    Inputs rotate among enough sets to exceed twice the L2 cache, so DRAM, not L2, is measured.
    Each timed sample queues ``group`` calls back to back (default 4 for the kernel backends on a
    GPU, 1 for the torch backends, whose calls take tens of milliseconds), as a training loop does:
    the Python dispatch of one call (validation, autograd) overlaps the device work of the one
    before instead of being counted as device time. ``kernel_only`` calls the backend's launcher on
    prepared contiguous inputs, without the op's validation, dispatch and autograd: the kernel's own
    time, where a short kernel would otherwise be timed by the host's speed at running that Python.
    ``verify`` checks the timed call's output against the float64 reference (``check_output``).
    ``sets``: input sets already drawn at this size (``input_sets``, at least ``sets_needed``), so
    that a sweep timing every backend and direction at one size draws them once; else drawn here.
    ``refs``: a dict the caller shares among the timings on the same ``sets``, where the float64
    reference of each direction is kept once computed (the incoming gradients are seeded: the same
    for every backend), so that the backends timed at one size share one reference."""
    from ..ops.bk_core import select_backend
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'forward' or 'forward+backward', got {direction!r}")
    if kernel_only and backend in ("auto", "torch_loop"):
        raise ValueError(f"kernel_only times one named kernel backend, got {backend!r}")
    dev = torch.device(device)
    if group is None:
        # Only the kernels are short enough for dispatch to matter; the torch backends take 10s of ms.
        group = 4 if dev.type == "cuda" and backend in ("triton", "cuda", "auto") else 1
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if kernel_only:
        select_backend(backend, dev)   # builds it, or raises Unavailable with the reason
    need = sets_needed(batch, n, dtype, direction)
    if sets is None:
        inputs = input_sets(batch, n, dtype, dev, need)
    elif len(sets) < need or any(a.shape != (batch, n) or a.dtype != dtype for a, _, _ in sets):
        raise ValueError(f"sets: need at least {need} (a, b, c) sets with a [{batch}, {n}] in {dtype}, got "
                         f"{len(sets)} with a {[tuple(a.shape) for a, _, _ in sets[:2]]}")
    else:
        inputs = sets[:need]
    grads = timing_grads(batch, n, dtype, dev, len(inputs)) if direction != "forward" else [None] * len(inputs)
    fn = _timed_call(backend, direction, inputs, grads, kernel_only)
    t = bench.time_fn(fn, dev, warmup=warmup, iters=iters, group=group)
    if verify:
        want = None
        if refs is not None:
            key = (direction, batch, n, str(dtype))
            if key not in refs:
                refs[key] = reference_output(direction, *inputs[0], grads[0])
            want = refs[key]
        check_output(backend, direction, fn(0), *inputs[0], grads[0], want=want)
    return t


def cusparse_gtsv_timing(batch: int, n: int, *, iters: int = 20, group: int = 4) -> bench.Timing:
    """One float32 single right-hand-side ``gtsv2StridedBatch`` solve of the same batch (CuPy's
    low-level cuSPARSE bindings): a lower-bound reference, since diag(T^-1) needs N right-hand
    sides from a solver. Raises RuntimeError with the reason where CuPy or cuSPARSE is missing."""
    try:
        import cupy as cp
        from cupy_backends.cuda.libs import cusparse as cs
    except Exception as e:  # CuPy is on the GPU image, not a dependency of hwlib
        raise RuntimeError(f"CuPy with cuSPARSE is not available: {type(e).__name__}: {e}") from None
    rs = cp.random.RandomState(0)
    d = (-2.0 + rs.uniform(-1, 1, batch * n)).astype(cp.float32)
    dl = (1.0 + 0.2 * rs.standard_normal(batch * n)).astype(cp.float32)
    du = (1.0 + 0.2 * rs.standard_normal(batch * n)).astype(cp.float32)
    dl.reshape(batch, n)[:, 0] = 0   # the solver's convention: dl[0] = du[N-1] = 0 per system
    du.reshape(batch, n)[:, -1] = 0
    d += 6.0                         # |d| >= 3 > |dl| + |du|: diagonally dominant, as gtsv2 (no pivoting) needs
    rhs = rs.standard_normal(batch * n).astype(cp.float32)
    x = rhs.copy()
    handle = cp.cuda.device.get_cusparse_handle()
    size = cs.sgtsv2StridedBatch_bufferSizeExt(handle, n, dl.data.ptr, d.data.ptr, du.data.ptr, x.data.ptr,
                                              batch, n)
    buf = cp.empty(max(int(size), 1), dtype=cp.uint8)
    cs.setStream(handle, 0)

    def fn(i):
        cs.sgtsv2StridedBatch(handle, n, dl.data.ptr, d.data.ptr, du.data.ptr, x.data.ptr, batch, n, buf.data.ptr)
    # queued back to back, as time_backend does
    t = bench.time_fn(fn, torch.device("cuda"), warmup=3, iters=iters, group=group)
    # Check the solve: T x = rhs after one fresh solve.
    x[...] = rhs
    fn(0)
    cp.cuda.Device().synchronize()
    xs, ds, dls, dus = (v.reshape(batch, n) for v in (x, d, dl, du))
    tx = ds * xs
    tx[:, 1:] += dls[:, 1:] * xs[:, :-1]
    tx[:, :-1] += dus[:, :-1] * xs[:, 1:]
    resid = float(cp.linalg.norm(tx - rhs.reshape(batch, n)) / cp.linalg.norm(rhs))
    if not resid < 1e-4:
        raise RuntimeError(f"cuSPARSE solve check failed: relative residual {resid:.2e}")
    return t


def scipy_diag_inverse(a, b, c, z) -> torch.Tensor:
    """diag((T - zI)^-1) through SciPy's banded LAPACK solver (one system, all N right-hand sides),
    an independent reference for the float64 dense inverse in torch."""
    import numpy as np
    from ..extras import require
    solve_banded = require("scipy.linalg", "BK-Core's SciPy reference (notebook 12)").solve_banded
    a2 = a.detach().cpu().double().reshape(-1, a.shape[-1]).numpy()
    b2, c2 = (t.detach().cpu().double().reshape(a2.shape[0], -1).numpy() for t in (b, c))
    n = a2.shape[1]
    out = np.empty(a2.shape, dtype=np.complex128)
    for r in range(a2.shape[0]):
        ab = np.zeros((3, n), dtype=np.complex128)
        ab[1] = a2[r] - z
        if n > 1:
            ab[0, 1:] = b2[r]
            ab[2, :-1] = c2[r]
        out[r] = np.diag(solve_banded((1, 1), ab, np.eye(n, dtype=np.complex128)))
    return torch.from_numpy(out).reshape(*a.shape)


def accuracy_sweep(ns: list[int], *, batch: int = 4, z: complex = 1j, seed: int = 0, potential: float = 0.1) -> list[dict]:
    """Relative error of the seed's determinant (theta/phi) recursion and of the stable form, in
    complex64 and complex128, against the stable form in float64 (itself checked against the
    dense inverse where N allows); non-finite results count as error inf."""
    rows = []
    for n in ns:
        a, b, c = random_inputs(batch, n, dtype=torch.float64, seed=seed + n, potential=potential)
        ref = resolvent_diagonal(a, b, c, z, backend="torch_loop")
        if n <= 512:
            rows.append({"N": n, "method": "stable form vs dense inverse", "dtype": "complex128",
                         "rel_err": rel_err(ref, resolvent_diagonal_dense(a, b, c, z))})
        for dt, real in (("complex64", torch.float32), ("complex128", torch.float64)):
            tp = resolvent_diagonal_theta_phi(a.to(real), b.to(real), c.to(real), z,
                                              dtype=torch.complex64 if dt == "complex64" else torch.complex128)
            # in float64 the stable form is the reference's own call (error 0 by construction): reuse it
            st = ref if real == a.dtype else resolvent_diagonal(a.to(real), b.to(real), c.to(real), z,
                                                                backend="torch_loop")
            rows.append({"N": n, "method": "theta/phi (seed)", "dtype": dt, "rel_err": rel_err(tp, ref)})
            rows.append({"N": n, "method": "stable form", "dtype": dt, "rel_err": rel_err(st, ref)})
    return rows


def seed_mixed_precision(ns: list[int], *, batch: int = 4, seed: int = 0, potential: float = 0.1) -> list[dict]:
    """The seed's 'mixed precision': theta/phi in complex64, the final division G = theta phi / theta_N
    in complex128. Its error against the float64 stable form, beside all-complex64 theta/phi."""
    rows = []
    for n in ns:
        a, b, c = random_inputs(batch, n, dtype=torch.float64, seed=seed + n, potential=potential)
        ref = resolvent_diagonal(a, b, c, 1j, backend="torch_loop")
        mixed = resolvent_diagonal_theta_phi(a.float(), b.float(), c.float(), 1j, dtype=torch.complex64,
                                             division_dtype=torch.complex128)
        rows.append({"N": n, "scheme": "theta/phi complex64, division complex128 (seed)", "rel_err": rel_err(mixed, ref)})
    return rows


# --- the notebook's grid: rows, then records (workload "bk_core", x-values in fields) -----------------

CUSPARSE = "cuSPARSE gtsv2StridedBatch (1 RHS)"
CORRECTNESS_CASES = [((), 1), ((3,), 2), ((2, 5), 17), ((3,), 257)]    # (batch shape, N)
CORRECTNESS_DTYPES = [torch.float32, torch.float64]
GRADIENT_BATCH, GRADIENT_N = 2, 13                                     # gradient_rows' inputs (float64)


def launch_builds(direction: str, dtype, batch: int, n: int) -> list[Build]:
    """The Triton builds a triton call of ``direction`` on [batch, n] inputs of ``dtype`` launches:
    the forward, and for forward+backward the backward."""
    kernels = ("forward",) if direction == "forward" else ("forward", "backward")
    return [Build.of(k, dtype, batch, n) for k in kernels]


def triton_builds(sizes: list[tuple[int, int]]) -> list[Build]:
    """Every Triton build notebook 12 launches on a GPU, in its order of use: ``correctness_rows``'
    cases, ``gradient_rows``', then ``speed_rows``' at each (B, N) of ``sizes`` (float32, forward and
    backward); one per Triton specialization (``Build.of``: a batch stands for its class)."""
    out = [b for (shape, n), dt in itertools.product(CORRECTNESS_CASES, CORRECTNESS_DTYPES)
           for b in launch_builds("forward", dt, math.prod(shape), n)]
    out += launch_builds("forward+backward", torch.float64, GRADIENT_BATCH, GRADIENT_N)
    out += [b for B, N in sizes for b in launch_builds("forward+backward", torch.float32, B, N)]
    return list(dict.fromkeys(out))


def prebuild_kernels(sizes: list[tuple[int, int]], device) -> Prebuild:
    """Start compiling, in background processes, the Triton kernels this notebook's cells launch
    (``triton_builds``, speed sweep at ``sizes``) instead of one after another at their first
    launches. Returns the handle at once; a no-op (its ``reason`` says why) where nothing compiles:
    CPU tensors, Triton interpreted or unavailable."""
    why = why_not(device)        # before planning: the plan's order needs Triton's chunk plans
    return Prebuild(reason=why) if why else prebuild(triton_builds(sizes), device)


def _ready(prebuilt: Prebuild | None, backend: str, direction: str, dtype, batch: int, n: int) -> None:
    """Before a triton launch: wait for its background builds, if any (``prebuild_kernels``)."""
    if prebuilt is not None and prebuilt.builds and backend == "triton":
        prebuilt.wait(launch_builds(direction, dtype, batch, n))


def prebuild_records(prebuilt: Prebuild, *, notebook: str, profile: str, device: str) -> list[dict]:
    """metric "triton_prebuild_s": the prebuild's wall seconds (start to its last build), with
    what the cells waited for it (``waited_s``), its builds' states and seconds in ``params``; n/a
    with the reason where nothing was built in the background."""
    wall = prebuilt.wall_s
    built = bool(prebuilt.builds) and wall is not None
    reason = None if built else (prebuilt.reason or "builds still running when recorded")
    return [make_record(notebook=notebook, workload="bk_core", step=None, metric="triton_prebuild_s",
                        value=wall if built else None, unit="s", profile=profile, device=device,
                        status="ok" if built else "n/a", reason=reason,
                        params={"wall_s": wall, "waited_s": prebuilt.waited_s, "kernels": len(prebuilt.builds),
                                "workers": prebuilt.workers, "states": prebuilt.counts(),
                                "build_s": prebuilt.seconds(), "failed": prebuilt.failures()})]


def correctness_rows(backends: list[str], device, *, seed: int = 0, prebuilt: Prebuild | None = None) -> list[dict]:
    """Every backend on fresh random inputs (asymmetric b, c; odd N; batch shapes; Im z from 1 down
    to 0.01; float32 and float64) against the float64 dense inverse and SciPy's banded solver.
    ``prebuilt``: the background Triton builds to wait for (``prebuild_kernels``)."""
    dev = torch.device(device)
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for be in backends:
        for (shape, n), zi, dt in itertools.product(CORRECTNESS_CASES, [1.0, 0.1, 0.01], CORRECTNESS_DTYPES):
            if be == "triton" and dev.type != "cuda" and n > 17:
                continue   # the interpreter is slow; small sizes prove the indexing
            a, b, c = random_inputs(shape, n, dtype=torch.float64, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
            z = complex(0.3, zi)
            _ready(prebuilt, be, "forward", dt, math.prod(shape), n)
            out = resolvent_diagonal(*(t.to(dev, dt) for t in (a, b, c)), z, backend=be)
            rows.append({"backend": be, "dtype": str(dt).removeprefix("torch."), "shape": str(shape), "N": n,
                         "Im z": zi, "err vs dense": rel_err(out, resolvent_diagonal_dense(a, b, c, z)),
                         "err vs SciPy": rel_err(out, scipy_diag_inverse(a, b, c, z))})
    return rows


def worst_errors(rows: list[dict]) -> list[dict]:
    """The worst error of each (backend, dtype) in ``correctness_rows``."""
    worst: dict = {}
    for r in rows:
        k = (r["backend"], r["dtype"])
        worst[k] = max(worst.get(k, 0.0), r["err vs dense"], r["err vs SciPy"])
    return [{"backend": k[0], "dtype": k[1], "worst relative error": v} for k, v in worst.items()]


def gradient_rows(backends: list[str], device, *, seed: int = 7, n: int = GRADIENT_N,
                  prebuilt: Prebuild | None = None) -> list[dict]:
    """Each backend's exact backward against autograd through the dense inverse (float64, odd N).
    ``prebuilt``: the background Triton builds to wait for (``prebuild_kernels``)."""
    dev = torch.device(device)
    rows = []
    for be in backends:
        B = GRADIENT_BATCH
        a, b, c = (t.to(dev).requires_grad_(True) for t in random_inputs((B,), n, dtype=torch.float64, seed=seed))
        w = torch.randn(B, n, dtype=torch.complex128, generator=torch.Generator().manual_seed(seed)).to(dev)
        _ready(prebuilt, be, "forward+backward", torch.float64, B, n)
        got = torch.autograd.grad(resolvent_diagonal(a, b, c, 0.5j, backend=be), (a, b, c), w)
        want = torch.autograd.grad(resolvent_diagonal_dense(a, b, c, 0.5j), (a, b, c), w)
        rows.append({"backend": be, "max relative error of (da, db, dc)": max(rel_err(g, h) for g, h in zip(got, want))})
    return rows


def _row(backend: str, batch: int, n: int, direction: str, t: bench.Timing, nbytes: int) -> dict:
    return {"backend": backend, "B": batch, "N": n, "direction": direction, "ms": t.median_ms, "p20": t.p20_ms,
            "p80": t.p80_ms, "GB/s": nbytes / (t.median_ms / 1e3) / 1e9}


def speed_rows(sizes: list[tuple[int, int]], backends: list[str], device, *, loop_iters: int = 3,
               progress: bool = False, prebuilt: Prebuild | None = None) -> list[dict]:
    """Each backend (and on a GPU each kernel alone) at each (B, N) and direction; the Python loop
    (``torch_loop``) at the first size only, after its other rows, on its input sets; on a GPU one
    cuSPARSE solve of that size. Every timed call's output is checked against the float64 reference first
    (``time_backend``; the reference computed once per size and direction). Each row says what it
    cost: ``wall_s``, the seconds of its timing and check, and ``draw_s``, the seconds its size's
    input sets took to draw (shared by that size's rows). ``prebuilt``: the background Triton builds
    (``prebuild_kernels``), all waited for before the first timing."""
    from tqdm.auto import tqdm
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    # each timing of a size and direction: (backend, kernel alone), the launcher alone on a GPU for the
    # kernels (no validation, dispatch or autograd)
    plan = [(be, alone) for be in backends if be != "torch_loop" and (on_gpu or be != "triton")
            for alone in ((False, True) if on_gpu and be in ("cuda", "triton") else (False,))]
    bar = tqdm(total=len(sizes) * len(DIRECTIONS) * len(plan) + ("torch_loop" in backends) * len(DIRECTIONS)
               + on_gpu, desc="BK-Core sweep", unit="timing", disable=not progress)
    rows = []

    def add(label, B, N, d, nbytes, draw_s, measure):
        t0 = time.perf_counter()
        t = measure()
        rows.append({**_row(label, B, N, d, t, nbytes), "wall_s": time.perf_counter() - t0, "draw_s": draw_s})
        bar.set_postfix_str(f"{label} {B}x{N} {d}")
        bar.update()

    if prebuilt is not None:
        # A compile beside a timing competes for the host (the op rows time Python dispatch too):
        # time nothing until every background build is done.
        prebuilt.wait()
    for i, (B, N) in enumerate(sizes):
        # one draw per size for every backend and direction (drawing costs more than timing here)
        t0 = time.perf_counter()
        sets = input_sets(B, N, torch.float32, dev, max(sets_needed(B, N, direction=d) for d in DIRECTIONS))
        draw_s = time.perf_counter() - t0
        refs: dict = {}   # the float64 reference of each direction, computed by the first check of it
        for d in DIRECTIONS:
            for be, alone in plan:
                # the torch scan takes 10s of ms a call: fewer iterations of it
                iters = 20 if alone else (5 if be == "torch" else 20) if on_gpu else 3
                add(f"{be} (kernel alone)" if alone else be, B, N, d, min_bytes(B, N, direction=d), draw_s,
                    lambda: time_backend(be, B, N, dev, direction=d, iters=iters, kernel_only=alone, sets=sets,
                                         refs=refs))
        if i == 0 and "torch_loop" in backends:       # the Python loop at the first size only
            for d in DIRECTIONS:
                add("torch_loop", B, N, d, min_bytes(B, N, direction=d), draw_s,
                    lambda: time_backend("torch_loop", B, N, dev, direction=d, iters=loop_iters, warmup=1,
                                         sets=sets, refs=refs))
        del sets
    B0, N0 = sizes[0]
    if on_gpu:
        try:
            add(CUSPARSE, B0, N0, "solve", 5 * 4 * B0 * N0, None, lambda: cusparse_gtsv_timing(B0, N0))
        except RuntimeError as e:
            print("cuSPARSE reference not measured:", e)
    bar.close()
    return rows


def add_share_of_copy(rows: list[dict], copy_gbps: float | None) -> list[dict]:
    """Each row's GB/s as a share of the measured copy ceiling; None (n/a) without a ceiling."""
    for r in rows:
        r["share of copy"] = r["GB/s"] / copy_gbps if copy_gbps else None
    return rows


def speed_records(rows: list[dict], *, notebook: str, profile: str, device: str) -> list[dict]:
    """Records of ``speed_rows``: metric "<direction>_ms" ("solve_ms" for cuSPARSE), step None,
    fields {"backend", "B", "N"}."""
    return [make_record(notebook=notebook, workload="bk_core", step=None, metric=f"{r['direction']}_ms",
                        value=r["ms"], p20=r["p20"], p80=r["p80"], unit="ms", profile=profile, device=device,
                        fields={"backend": r["backend"], "B": r["B"], "N": r["N"]},
                        params={"gbps": r["GB/s"], "share_of_copy": r.get("share of copy"), "wall_s": r.get("wall_s"),
                                "draw_s": r.get("draw_s")}) for r in rows]


def first_failing_n(acc: list[dict], tol: float = 1e-4) -> dict[str, int | None]:
    """The first N at which the seed's theta/phi recursion misses ``tol``, per complex dtype."""
    return {dt: min((r["N"] for r in acc if r["method"] == "theta/phi (seed)" and r["dtype"] == dt
                     and not r["rel_err"] < tol), default=None) for dt in ("complex64", "complex128")}


def first_failing_records(first_bad: dict, *, notebook: str, profile: str, device: str) -> list[dict]:
    """metric "theta_phi_first_failing_N", fields {"dtype"}; a dtype that never failed is recorded
    as n/a with the reason, not as a number."""
    return [make_record(notebook=notebook, workload="bk_core", step=None, metric="theta_phi_first_failing_N",
                        value=v, unit="N", profile=profile, device=device, fields={"dtype": dt},
                        status="ok" if v is not None else "n/a",
                        reason=None if v is not None else "no failing N in the measured range")
            for dt, v in first_bad.items()]


def best(rows: list[dict], direction: str, batch: int, n: int) -> dict | None:
    """The fastest row of a direction and size among the vectorised torch backend and the kernels
    (through the op or alone); the Python loop and cuSPARSE are what it is compared with."""
    c = [r for r in rows if r["direction"] == direction and r["B"] == batch and r["N"] == n
         and r["backend"] not in ("torch_loop", CUSPARSE)]
    return min(c, key=lambda r: r["ms"]) if c else None


def kernel_gap(rows: list[dict], batch: int, n: int, direction: str = "forward") -> str | None:
    """One sentence: the Triton kernel's time over the CUDA kernel's (both timed alone) at (batch, n);
    None unless both were timed there."""
    alone = {r["backend"]: r for r in rows if r["direction"] == direction and r["B"] == batch and r["N"] == n
             and r["backend"] in ("triton (kernel alone)", "cuda (kernel alone)")}
    t, c = alone.get("triton (kernel alone)"), alone.get("cuda (kernel alone)")
    if not (t and c):
        return None
    return (f"Timed alone, the Triton {direction} kernel took {t['ms'] / c['ms']:.2f}x the CUDA kernel's time "
            f"({t['ms']:.3f} against {c['ms']:.3f} ms): the same chunked algorithm, tiles staged by the compiler "
            f"against tiles staged by hand.")


# The kernels alone against the copy ceiling, on minimal bytes (``min_bytes``: float32 in, complex64 out,
# 20 B an element forward, 52 forward+backward): both directions are memory-bound, so these are
# bandwidth targets. Judged on the kernel-alone rows: through the op, the host's Python is timed too.
KERNEL_TARGETS = (("cuda", "forward", 0.85), ("cuda", "forward+backward", 0.65), ("triton", "forward", 0.50))


def _share_target(what: str, floor: float, row: dict, prefix: str) -> dict:
    """A target on ``row``'s share of the copy ceiling: n/a, with the reason, where none was measured."""
    share = row.get("share of copy")
    return {"target": f"{what} >= {floor:.0%} of copy bandwidth", "value": share, "unit": "share of copy",
            "measured": prefix + (f"{share:.1%}" if share is not None else "n/a (no copy ceiling)"),
            "met": None if share is None else share >= floor,
            "why": "no copy ceiling measured in this run" if share is None else None}


def targets(rows: list[dict], batch: int, n: int) -> list[dict]:
    """The targets at (batch, n): each {target, value, unit, measured (text), met}; met None (n/a),
    with ``why``, where what it needs was not measured (no copy ceiling in this run). A target whose
    row was not timed at this size is left out."""
    f, fb = best(rows, "forward", batch, n), best(rows, "forward+backward", batch, n)
    loop = next((r for r in rows if r["backend"] == "torch_loop" and r["direction"] == "forward+backward"
                 and r["B"] == batch and r["N"] == n), None)
    cus = next((r for r in rows if r["backend"] == CUSPARSE and r["B"] == batch and r["N"] == n), None)
    out = []
    for backend, direction, floor in KERNEL_TARGETS:
        r = next((r for r in rows if r["backend"] == f"{backend} (kernel alone)" and r["direction"] == direction
                  and r["B"] == batch and r["N"] == n), None)
        if r is None:
            continue
        out.append(_share_target(f"{backend} {direction} alone", floor, r, f"{r['ms']:.4f} ms, "))
    if f:
        out.append(_share_target("best forward", 0.6, f, f"{f['backend']}: "))
    if f and cus:
        x = cus["ms"] / f["ms"]
        out.append({"target": "forward >= 3x faster than one cuSPARSE gtsv2StridedBatch solve", "value": x,
                    "unit": "x", "measured": f"{x:.2f}x ({f['ms']:.3f} vs {cus['ms']:.3f} ms)", "met": x >= 3})
    if fb and loop:
        x = loop["ms"] / fb["ms"]
        out.append({"target": "forward+backward >= 300x faster than the torch loop", "value": x, "unit": "x",
                    "measured": f"{x:.0f}x ({fb['backend']} {fb['ms']:.2f} ms vs {loop['ms']:.0f} ms)", "met": x >= 300})
    return out


def target_records(tgts: list[dict], *, notebook: str, profile: str, device: str) -> list[dict]:
    """metric "target", fields {"target": text}, value = the measured number (its wording in
    ``params["measured"]``), status ok / failed (n/a where it could not be judged)."""
    return [make_record(notebook=notebook, workload="bk_core", step=None, metric="target", value=t["value"],
                        unit=t["unit"], profile=profile, device=device, fields={"target": t["target"]},
                        params={"measured": t["measured"]},
                        status="n/a" if t["met"] is None else "ok" if t["met"] else "failed",
                        reason=(t.get("why") or "not measured in this run") if t["met"] is None else None)
            for t in tgts]
