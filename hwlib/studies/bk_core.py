"""Measurements of the BK-Core study (notebook 12): accuracy, speed per backend, and references.

Minimal bytes (each input read once, each output written once), s = bytes of the real dtype:

    forward:           a (N) + b, c (N-1 each) read, G (N complex) written  ~ 3 N s + 2 N s = 5 N s
    forward+backward:  the forward, then a, b, c and the complex incoming grad read, and the three
                       real gradients written                               ~ 5 N s + 5 N s + 3 N s

so 20 B per element forward in float32. ``gbps`` divides those bytes by the measured time: the share
of the measured copy ceiling says how close to the memory floor a kernel runs.
"""

from __future__ import annotations

import math

import torch

from .. import bench
from ..ops.bk_core import resolvent_diagonal
from ..ops.bk_reference import resolvent_diagonal_dense, resolvent_diagonal_theta_phi


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


def per_call(t: bench.Timing, group: int) -> bench.Timing:
    """A Timing of samples that each ran ``group`` calls, as milliseconds per call."""
    return bench.Timing.from_samples([s / group for s in t.samples_ms])


def time_backend(backend: str, batch: int, n: int, device, *, direction: str = "forward",
                 dtype=torch.float32, iters: int = 20, warmup: int = 3, group: int | None = None,
                 kernel_only: bool = False) -> bench.Timing:
    """Median time of one call (``forward``) or one call and its backward (``forward+backward``).
    Inputs rotate among enough sets to exceed twice the L2 cache, so DRAM, not L2, is measured.
    Each timed sample queues ``group`` calls back to back (default 4 for the kernel backends on a
    GPU, 1 for the torch backends, whose calls take tens of milliseconds), as a training loop does: the Python dispatch of one call (validation, autograd)
    overlaps the device work of the one before instead of being counted as device time.
    ``kernel_only`` calls the backend's launcher on prepared contiguous inputs, without the op's
    validation, dispatch and autograd: the kernel's own time, where a short kernel would otherwise
    be timed by the host's speed at running that Python."""
    dev = torch.device(device)
    if group is None:
        # Only the kernels are short enough for dispatch to matter; the torch backends take 10s of ms.
        group = 4 if dev.type == "cuda" and backend in ("triton", "cuda", "auto") else 1
    per_set = min_bytes(batch, n, dtype, direction)
    sets = max(1, math.ceil(2 * 64 * 2**20 / per_set))
    inputs = [random_inputs(batch, n, dtype=dtype, device=dev, seed=i) for i in range(min(sets, 8))]
    if kernel_only:
        from ..ops.bk_core import _backward, _forward, select_backend
        if backend in ("auto", "torch_loop"):
            raise ValueError(f"kernel_only times one named kernel backend, got {backend!r}")
        select_backend(backend, dev)   # builds it, or raises Unavailable with the reason
        cplx = torch.complex64 if dtype == torch.float32 else torch.complex128
        grads = [torch.randn(batch, n, dtype=cplx, device=dev) for _ in inputs]

        def fn(i):
            a, b, c = inputs[i % len(inputs)]
            g = _forward(backend, a, b, c, 1j)
            if direction == "forward+backward":
                return _backward(backend, a, b, c, 1j, grads[i % len(inputs)])
            return g
        if direction not in ("forward", "forward+backward"):
            raise ValueError(f"direction must be 'forward' or 'forward+backward', got {direction!r}")
    elif direction == "forward":
        def fn(i):
            a, b, c = inputs[i % len(inputs)]
            with torch.no_grad():
                return resolvent_diagonal(a, b, c, 1j, backend=backend, check_finite=False)
    elif direction == "forward+backward":
        leaves = [tuple(t.clone().requires_grad_(True) for t in s) for s in inputs]
        grads = [torch.randn(batch, n, dtype=torch.complex64 if dtype == torch.float32 else torch.complex128,
                             device=dev) for _ in leaves]

        def fn(i):
            a, b, c = leaves[i % len(leaves)]
            g = resolvent_diagonal(a, b, c, 1j, backend=backend, check_finite=False)
            return torch.autograd.grad(g, (a, b, c), grads[i % len(leaves)])
    else:
        raise ValueError(f"direction must be 'forward' or 'forward+backward', got {direction!r}")

    def fn_group(i):
        for j in range(group):
            fn(i * group + j)
    return per_call(bench.time_fn(fn_group, dev, warmup=warmup, iters=iters), group)


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

    def fn_group(i):             # queued back to back, as time_backend does
        for j in range(group):
            fn(j)
    t = per_call(bench.time_fn(fn_group, torch.device("cuda"), warmup=3, iters=iters), group)
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
    from scipy.linalg import solve_banded
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
            st = resolvent_diagonal(a.to(real), b.to(real), c.to(real), z, backend="torch_loop")
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
