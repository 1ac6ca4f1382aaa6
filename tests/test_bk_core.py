"""BK-Core: every backend against the float64 dense inverse, exact gradients, long-N stability, the
bad-input paths (at the working precision), backend selection, the CUDA loader's error and lock
handling, the C ABI (one header, checked against the .cu and both bindings), and the .cu file through
nvcc.

Triton runs compiled on CUDA tensors where a GPU is visible, else interpreted on CPU tensors
(conftest.py sets TRITON_INTERPRET=1 on machines without a GPU, before triton is first imported).
Inputs are random per case from a seed derived from the case; HWLIB_TEST_SEED=<int> draws fresh
ones.
"""

from __future__ import annotations

import cmath
import ctypes
import os
import shutil
import subprocess
import socket
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path

import pytest
import torch

from hwlib.ops import build as hcuda
from hwlib.device import ChoiceError, Unavailable
from hwlib.ops import (KernelError, available_backends, bk_core, resolvent_diagonal, resolvent_diagonal_dense,
                       resolvent_diagonal_theta_phi, select_backend, working_range)
from hwlib.ops import bk_cuda, bk_reference, bk_scan
from hwlib.paths import KERNELS_DIR

ROOT = Path(__file__).resolve().parent.parent
GPU = torch.cuda.is_available()
NVCC = shutil.which("nvcc")
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}     # max |G - G_ref| / max |G_ref|
IM_Z = (1.0, 0.1, 0.01)


def _gen(*key) -> torch.Generator:
    seed = int(os.environ.get("HWLIB_TEST_SEED", "0")) + zlib.crc32(repr(key).encode())
    return torch.Generator().manual_seed(seed)


def make(batch, n, dtype=torch.float64, key=(), device="cpu", signs=False):
    """a in (-3, 1) (the model's -2 + v), b, c drawn apart (asymmetric), k = b c > 0 unless signs."""
    g = _gen(batch, n, str(dtype), *key)
    a = torch.rand(*batch, n, generator=g, dtype=torch.float64) * 4 - 3
    b = torch.rand(*batch, n - 1, generator=g, dtype=torch.float64) + 0.5
    c = torch.rand(*batch, n - 1, generator=g, dtype=torch.float64) * 1.8 + 0.2
    if signs:
        c = c * torch.where(torch.rand(c.shape, generator=g) < 0.5, -1.0, 1.0).to(c)
    re = float(torch.rand((), generator=g, dtype=torch.float64)) * 4 - 3
    return [x.to(dtype=dtype, device=device) for x in (a, b, c)] + [re]


def rel_err(x, ref):
    ref = ref.to(x.device)
    return float((x.to(ref.dtype) - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


# --- forward against the dense inverse --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch", [(), (3,), (2, 5)], ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 17, 256])
@pytest.mark.parametrize("backend", ["torch_loop", "torch"])
def test_torch_backends_match_dense_inverse(backend, n, batch, dtype):
    for im in IM_Z:
        a, b, c, re = make(batch, n, dtype, key=(backend, im))
        z = complex(re, im)
        g = resolvent_diagonal(a, b, c, z, backend=backend)
        assert g.shape == (*batch, n) and g.dtype == bk_reference.COMPLEX_OF[dtype]
        err = rel_err(g, resolvent_diagonal_dense(a, b, c, z))
        assert err < TOL[dtype], f"Im z = {im}: relative error {err:.2e}"


def test_negative_im_z_and_mixed_sign_couplings():
    # k_j < 0 makes T non-symmetrizable; the recursions still hold wherever T - zI is regular
    for z in (0.3 - 0.5j, -1 + 1j):
        a, b, c, _ = make((4,), 33, key=("signs", z), signs=True)
        ref = resolvent_diagonal_dense(a, b, c, z)
        for backend in ("torch_loop", "torch"):
            assert rel_err(resolvent_diagonal(a, b, c, z, backend=backend), ref) < 1e-9


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_triton_matches_dense_inverse(triton_device, dtype):
    cases = [(batch, n) for n in (1, 2, 3, 17) for batch in ((), (3,), (2, 5))] + [((3,), 256)]
    for batch, n in cases:
        im = IM_Z[n % 3]
        a, b, c, re = make(batch, n, dtype, key=("triton", im), device=triton_device)
        z = complex(re, im)
        g = resolvent_diagonal(a, b, c, z, backend="triton")
        assert g.device.type == triton_device and g.dtype == bk_reference.COMPLEX_OF[dtype]
        err = rel_err(g.cpu(), resolvent_diagonal_dense(a.cpu(), b.cpu(), c.cpu(), z))
        assert err < TOL[dtype], f"N={n} batch={batch}: {err:.2e}"


def test_triton_interleaved_layout(triton_device):
    """[N, B] storage passed as transposed views: the coalesced layout gives the same G."""
    from hwlib.ops.bk_core import _triton
    n, B = 9, 6
    a, b, c, re = make((B,), n, key=("nb",))
    a_nb, b_nb, c_nb = (x.t().contiguous().to(triton_device) for x in (a, b, c))
    out_nb = torch.empty(n, B, dtype=torch.complex128, device=triton_device)
    _triton().bk_forward(a_nb.t(), b_nb.t(), c_nb.t(), complex(re, 0.3), out=out_nb.t())
    assert rel_err(out_nb.t().cpu(), resolvent_diagonal_dense(a, b, c, complex(re, 0.3))) < 1e-12


# (B, N, chunk): chunks (powers of 2) that divide N and that do not, one chunk, chunk counts not a
# power of 2.
# The interpreter pays per program, per unrolled position and per scanned chunk: kept small.
# (B, N, chunk, lanes): one position; a chunk longer than N; a remainder chunk; more sequences than a
# block (lanes 64: blocks of 32 sequences, the last holding one); several chunks with and without a
# remainder; the interpreter is slow, so few N = 257 cases. lanes=1: one sequence per program, so
# the long cases take one or two sequences (its cost is per program; several sequences are (5, 7, ...)'s).
CHUNKED_CASES = [(1, 1, 4, 1), (5, 7, 4, 1), (5, 7, 2, 1), (33, 7, 4, 64), (2, 64, 8, 1), (1, 257, 8, 1),
                 (1, 257, 32, 1)]


def test_triton_chunked_forward_matches_reference(triton_device):
    """bk_forward_chunked (one lane per chunk, chunks joined by Moebius-map scans) against the
    float64 dense inverse / forward_loop: float64 at Im z = 0.01, float32 at Im z = 1 and 0.01."""
    from hwlib.ops.bk_core import _triton
    tk = _triton()
    for B, n, chunk, lanes in CHUNKED_CASES:
        a, b, c, re = make((B,), n, key=("chunked", chunk))
        bs = tk.chunk_plan(n, chunk, lanes)[2]   # sequences a program takes: 1, or blocks with a partial last one
        assert bs == 1 if lanes == 1 else 1 < bs < B and B % bs, (B, n, chunk, lanes, bs)
        for im, tol32 in ((1.0, 2e-6), (0.01, 5e-5)):
            z = complex(re, im)
            ref = resolvent_diagonal_dense(a, b, c, z) if n <= 64 else bk_reference.forward_loop(a, b, c, z)
            x64 = [x.to(triton_device) for x in (a, b, c)]
            if im < 1:
                g = tk.bk_forward_chunked(*x64, z, chunk=chunk, lanes=lanes)
                assert g.dtype == torch.complex128 and rel_err(g.cpu(), ref) < 1e-12, (B, n, chunk, im)
            g32 = tk.bk_forward_chunked(*(x.float() for x in x64), z, chunk=chunk, lanes=lanes)
            assert g32.dtype == torch.complex64 and rel_err(g32.cpu(), ref) < tol32, (B, n, chunk, im)


@pytest.mark.parametrize("chunk", [0, 3, 12, -4])
def test_triton_chunked_forward_rejects_a_chunk_that_is_not_a_power_of_2(chunk):
    """The chunk is split into halves at compile time: a clear error naming ``chunk``, before any launch."""
    from hwlib.ops.bk_core import _triton
    a, b, c, re = make((2,), 40, key=("chunk-arg",))
    with pytest.raises(ValueError, match=f"chunk must be a power of 2, got {chunk}"):
        _triton().bk_forward_chunked(a, b, c, complex(re, 0.3), chunk=chunk)


def test_triton_chunked_interleaved_layout_and_default_plan(triton_device):
    """[N, B] storage as transposed views, several sequences per program, and the dispatch: the
    triton backend's forward takes the chunked kernel from N >= 4 chunks."""
    from hwlib.ops.bk_core import _triton
    tk = _triton()
    n, B = 131, 3
    a, b, c, re = make((B,), n, key=("nb-chunked",))
    z = complex(re, 0.3)
    ref = resolvent_diagonal_dense(a, b, c, z)
    a_nb, b_nb, c_nb = (x.t().contiguous().to(triton_device) for x in (a, b, c))
    out_nb = torch.empty(n, B, dtype=torch.complex128, device=triton_device)
    tk.bk_forward_chunked(a_nb.t(), b_nb.t(), c_nb.t(), z, chunk=8, out=out_nb.t(), lanes=8)
    assert rel_err(out_nb.t().cpu(), ref) < 1e-12
    assert n >= bk_core.CHUNKED_MIN_CHUNKS * tk.CHUNK
    calls = []
    real = tk.bk_forward_chunked
    try:
        tk.bk_forward_chunked = lambda *args, **kw: calls.append(1) or real(*args, **kw)
        g = resolvent_diagonal(*(x.to(triton_device) for x in (a, b, c)), z, backend="triton")
    finally:
        tk.bk_forward_chunked = real
    assert calls and rel_err(g.cpu(), ref) < 1e-12


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU, nvcc and ninja")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_cuda_matches_dense_inverse(dtype):
    # up to several tiles per sequence (the two-sweep path) and N = 16384 against the loop
    for batch, n in [((), 1), ((3,), 2), ((2, 5), 17), ((130,), 256), ((3,), 1000), ((2,), 4501), ((2,), 16384)]:
        a, b, c, re = make(batch, n, dtype, key=("cuda",), device="cuda")
        z = complex(re, 0.05)
        g = resolvent_diagonal(a, b, c, z, backend="cuda")
        x64 = [x.cpu().double() for x in (a, b, c)]
        ref = resolvent_diagonal_dense(*x64, z) if n <= 1000 else bk_reference.forward_loop(*x64, z)
        assert rel_err(g.cpu(), ref) < TOL[dtype], (batch, n)


TRITON_SM90 = r"""
import os, sys
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hwlib.ops.sources import load_python_kernel
mod = load_python_kernel("12_bk_core_triton.py")
SPECS = ({"BLOCK": 128}, {"BLOCK": 128, "san": 1, "sbn": 1, "scn": 1},
         {"BLOCK": 64, "B": 1, "N": 1, "sab": 1, "sbb": 1, "scb": 1})
for kernel in (mod._bk_forward_kernel, mod._bk_backward_kernel):
    # as launched: unit position strides (row-major) and B = N = 1 become constexprs on a GPU; each
    # specialization once in fp32, and fp64 once (the dtype changes types, not control flow)
    for dt, consts in [("fp32", c) for c in SPECS] + [("fp64", SPECS[1])]:
        sig = {a: "constexpr" if a in consts else f"*{dt}" if a.endswith("_ptr") else "i32"
               for a in kernel.arg_names}
        k = compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert k.asm.get("cubin"), (kernel, dt, consts)
# the chunked forward: a small plan in both dtypes, and the plan of the B = 8192, N = 2048 benchmark
L, PP, BS, W = mod.chunk_plan(2048)
# (the small plans with a partial last chunk, masked; the benchmark's chunks are whole)
plans = [("fp32", 4, 16, 8, 4, False), ("fp64", 4, 16, 8, 4, False), ("fp32", L, PP, BS, W, PP * L == 2048)]
kernel = mod._bk_forward_chunked_kernel
for dt, L, PP, BS, W, whole in plans:
    consts = {"LOG2L": L.bit_length() - 1, "PP": PP, "BS": BS, "OUT_PACKED": True, "WHOLE": whole,
              "san": 1, "sbn": 1, "scn": 1}
    sig = {a: "constexpr" if a in consts else f"*{dt}" if a.endswith("_ptr") else "i32" for a in kernel.arg_names}
    k = compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": W})
    assert k.asm.get("cubin"), (dt, L, PP, BS)
    assert "ld.local" not in k.asm["ptx"], ("local memory", dt, L, PP, BS)
print("compiled")
"""


def test_triton_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter skips Triton's compiler: compile the real pipeline (TTIR -> PTX -> cubin) for
    sm_90 here, with the specializations a GPU launch makes (ints equal to 1 become constexprs)."""
    compile_for_sm90(TRITON_SM90)


# --- gradients --------------------------------------------------------------------------------

def _grads(backend, a, b, c, z, w):
    leaves = [x.detach().clone().requires_grad_() for x in (a, b, c)]
    g = resolvent_diagonal(*leaves, z, backend=backend)
    (g * w.conj()).real.sum().backward()    # a loss with complex weights on Re and Im
    return [x.grad for x in leaves]


@pytest.mark.parametrize("backend", ["torch_loop", "torch"])
def test_gradcheck_float64(backend):
    a, b, c, re = make((2,), 5, key=("gc", backend))
    inputs = tuple(x.requires_grad_() for x in (a, b, c))
    assert torch.autograd.gradcheck(lambda *t: resolvent_diagonal(*t, complex(re, 0.4), backend=backend),
                                    inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_triton(triton_device):
    # G as (Re, Im) pairs: one check of the whole Jacobian, both parts' rows, from one set of perturbed
    # evaluations (a complex output is checked as two functions, Re G and Im G, each evaluating the op
    # at the same perturbed inputs again: twice the launches, ~60 ms each when interpreted)
    a, b, c, re = make((2,), 4, key=("gct",), device=triton_device)
    inputs = tuple(x.requires_grad_() for x in (a, b, c))
    assert torch.autograd.gradcheck(
        lambda *t: torch.view_as_real(resolvent_diagonal(*t, complex(re, 0.4), backend="triton")),
        inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch_loop", "torch"])
@pytest.mark.parametrize("n", [1, 2, 17])
def test_gradient_equals_dense_autograd(backend, n):
    """The analytic O(N) backward against autograd through a dense inverse (no finite differences)."""
    a, b, c, re = make((3,), n, key=("grad", backend))
    z = complex(re, 0.05)
    w = torch.randn(3, n, dtype=torch.complex128, generator=_gen("w", n))
    leaves = [x.clone().requires_grad_() for x in (a, b, c)]
    (resolvent_diagonal_dense(*leaves, z) * w.conj()).real.sum().backward()
    for got, ref, name in zip(_grads(backend, a, b, c, z, w), leaves, ("diag", "upper", "lower")):
        if ref.numel():
            assert rel_err(got, ref.grad) < 1e-9, name


def test_gradient_float32_and_triton_match_reference(triton_device):
    a, b, c, re = make((3,), 17, key=("g32",))
    z = complex(re, 0.1)
    w = torch.randn(3, 17, dtype=torch.complex128, generator=_gen("w32"))
    ref = bk_reference.backward_loop(a, b, c, z, w)
    for backend, dev, dtype, tol in (("torch", "cpu", torch.float32, 1e-4),
                                     ("triton", triton_device, torch.float64, 1e-10),
                                     ("triton", triton_device, torch.float32, 1e-4)):
        got = _grads(backend, *(x.to(dev, dtype) for x in (a, b, c)), z, w.to(dev))
        for g_, r_ in zip(got, ref):
            assert g_.dtype == dtype and rel_err(g_.cpu().double(), r_) < tol, (backend, dtype)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU, nvcc and ninja")
def test_cuda_gradients():
    a, b, c, re = make((130,), 100, key=("gcu",))
    z = complex(re, 0.1)
    w = torch.randn(130, 100, dtype=torch.complex128, generator=_gen("wcu"))
    ref = bk_reference.backward_loop(a, b, c, z, w)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        got = _grads("cuda", *(x.to("cuda", dtype) for x in (a, b, c)), z, w.to("cuda"))
        for g_, r_ in zip(got, ref):
            assert rel_err(g_.cpu().double(), r_) < tol, dtype
    inputs = (a[:2, :5].contiguous().cuda().requires_grad_(),
              b[:2, :4].contiguous().cuda().requires_grad_(), c[:2, :4].contiguous().cuda().requires_grad_())
    assert torch.autograd.gradcheck(lambda *t: resolvent_diagonal(*t, z, backend="cuda"), inputs,
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradients_reach_expanded_and_strided_leaves():
    n = 6
    a, _, _, re = make((4,), n, key=("leaf",))
    ones = torch.ones(n - 1, dtype=torch.float64, requires_grad=True)
    at = a.t().contiguous().requires_grad_()           # stored [N, B]; passed as a strided view
    g = resolvent_diagonal(at.t(), ones.expand(4, n - 1), ones.expand(4, n - 1), complex(re, 0.5), backend="torch")
    g.imag.sum().backward()
    a2, b2 = a.clone().requires_grad_(), torch.ones(4, n - 1, dtype=torch.float64, requires_grad=True)
    resolvent_diagonal(a2, b2, torch.ones(4, n - 1, dtype=torch.float64), complex(re, 0.5)).imag.sum().backward()
    assert torch.allclose(at.grad.t(), a2.grad, atol=1e-12)
    # upper and lower share the leaf: its gradient is the batch sum of d/db + d/dc = 2 d/db (b = c)
    assert torch.allclose(ones.grad, 2 * b2.grad.sum(0), atol=1e-12)


# --- long N: the stable form stays accurate; the determinant form overflows --------------------

def test_stable_at_n_16384():
    n = 16384
    g_ = _gen("long")
    a = -2 + 0.3 * torch.randn(2, n, dtype=torch.float64, generator=g_)
    a[0] = -2.0                                   # the model's default matrix in row 0
    ones = torch.ones(2, n - 1, dtype=torch.float64)
    z = 1j
    loop = resolvent_diagonal(a, ones, ones, z, backend="torch_loop")
    scan = resolvent_diagonal(a, ones, ones, z, backend="torch")
    assert loop.isfinite().all() and rel_err(scan, loop) < 1e-12
    assert float(loop.abs().max()) <= 1 / abs(z.imag) + 1e-12     # |G_ii| <= 1 / Im z, T symmetric
    # the middle of the uniform chain is the infinite chain's G = 1 / sqrt((a - z)^2 - 4k), Im G > 0
    g_inf = 1 / cmath.sqrt((-2 - z) ** 2 - 4)
    g_inf = g_inf if g_inf.imag > 0 else -g_inf
    assert abs(complex(loop[0, n // 2]) - g_inf) < 1e-12
    scan32 = resolvent_diagonal(a.float(), ones.float(), ones.float(), z, backend="torch")
    assert scan32.dtype == torch.complex64 and rel_err(scan32, loop) < 1e-5
    # the seed's theta/phi recursion: non-finite at this length in complex64 and complex128
    for dtype in (torch.complex64, torch.complex128):
        assert not resolvent_diagonal_theta_phi(a[:1], ones[:1], ones[:1], z, dtype=dtype).isfinite().all()


def test_theta_phi_overflow_onset_on_the_default_matrix():
    """The seed 000 write-up's theta/phi recursion: complex64 goes non-finite from N = 123 (the seed's own N = 128 fails)."""
    def finite(n, dtype):
        a, k = torch.full((n,), -2.0), torch.ones(n - 1)
        return bool(resolvent_diagonal_theta_phi(a, k, k, 1j, dtype=dtype).isfinite().all())
    assert finite(122, torch.complex64) and not finite(123, torch.complex64)
    assert finite(900, torch.complex128) and not finite(1024, torch.complex128)
    a, k = torch.full((128,), -2.0, dtype=torch.float64), torch.ones(127, dtype=torch.float64)
    ok = resolvent_diagonal_theta_phi(a, k, k, 1j, dtype=torch.complex128)   # fine in complex128 at 128
    assert rel_err(ok, resolvent_diagonal_dense(a, k, k, 1j)) < 1e-10


def test_backward_scan_matches_loop_at_long_n():
    n = 4096
    a = -2 + 0.3 * torch.randn(1, n, dtype=torch.float64, generator=_gen("lb"))
    b = torch.full((1, n - 1), 1.3, dtype=torch.float64)
    c = torch.full((1, n - 1), 0.7, dtype=torch.float64)
    w = torch.randn(1, n, dtype=torch.complex128, generator=_gen("lbw"))
    for got, want in zip(bk_scan.backward_scan(a, b, c, 0.2j, w), bk_reference.backward_loop(a, b, c, 0.2j, w)):
        assert got.isfinite().all() and rel_err(got, want) < 1e-10


# --- bad input ----------------------------------------------------------------------------------

def _ok(n=5, batch=(2,), dtype=torch.float64):
    a, b, c, _ = make(batch, n, dtype, key=("bad",))
    return a, b, c


@pytest.mark.parametrize("mutate, exc, word", [
    (lambda a, b, c: (a, b[..., :-1], c), ValueError, "upper"),
    (lambda a, b, c: (a, b, c[:1]), ValueError, "lower"),
    (lambda a, b, c: (a, b.unsqueeze(0), c), ValueError, "upper"),
    (lambda a, b, c: (a[..., :0], b[..., :0], c[..., :0]), ValueError, "N = 0"),
    (lambda a, b, c: (a[0, 0], b, c), ValueError, "diag"),
    (lambda a, b, c: (a.tolist(), b, c), TypeError, "diag"),
    (lambda a, b, c: (a.long(), b, c), TypeError, "diag"),
    (lambda a, b, c: (a, b.half(), c), TypeError, "upper"),
    (lambda a, b, c: (a, b, c.to(torch.complex128)), TypeError, "lower"),
    (lambda a, b, c: (a.float(), b, c), TypeError, "share one dtype"),
    (lambda a, b, c: (a, b, c.to("meta")), ValueError, "lower is on meta"),
    (lambda a, b, c: (a.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan"), dtype=a.dtype)),
                      b, c), ValueError, "diag contains NaN"),
    (lambda a, b, c: (a, b.clone().fill_(float("inf")), c), ValueError, "upper contains NaN or inf"),
    (lambda a, b, c: (a, b, c.clone().fill_(-float("inf"))), ValueError, "lower contains NaN or inf"),
], ids=["upper-len", "lower-batch", "upper-rank", "N0", "scalar", "list", "int", "half", "complex",
        "mixed", "device", "nan", "inf", "-inf"])
def test_bad_tensors_name_the_argument(mutate, exc, word):
    a, b, c = mutate(*_ok())
    with pytest.raises(exc, match=word):
        resolvent_diagonal(a, b, c, 1j)


@pytest.mark.parametrize("z, exc, word", [
    (1.0, ValueError, "Im z"), (2 + 0j, ValueError, "Im z"), (0, ValueError, "Im z"),
    (torch.tensor(1.5 + 0j), ValueError, "Im z"), (complex("nan+1j"), ValueError, "finite"),
    (complex(0, float("inf")), ValueError, "finite"), ("1j", TypeError, "z must be"),
    (True, TypeError, "z must be"), (torch.ones(2) * 1j, ValueError, "scalar"),
    (torch.tensor(1j, requires_grad=False) * torch.ones((), requires_grad=True), TypeError, "gradients"),
])
def test_bad_z(z, exc, word):
    with pytest.raises(exc, match=word):
        resolvent_diagonal(*_ok(), z)


def test_z_as_zero_dim_tensor_and_int_real_part():
    a, b, c = _ok()
    ref = resolvent_diagonal_dense(a, b, c, 1 + 0.5j)
    assert rel_err(resolvent_diagonal(a, b, c, torch.tensor(1 + 0.5j)), ref) < 1e-12


def test_unknown_backend_is_a_choice_error():
    with pytest.raises(ChoiceError, match="backend 'tritn'.*torch_loop"):
        resolvent_diagonal(*_ok(), 1j, backend="tritn")
    with pytest.raises(ChoiceError):
        resolvent_diagonal(*_ok(), 1j, backend=None)


def test_non_contiguous_and_expanded_inputs_give_the_contiguous_result():
    a, b, c = _ok(n=7, batch=(3, 4))
    ref = resolvent_diagonal(a, b, c, 0.5j)
    a_t = a.transpose(0, 1).contiguous().transpose(0, 1)      # same values, non-contiguous
    assert not a_t.is_contiguous()
    assert torch.equal(resolvent_diagonal(a_t, b, c, 0.5j), ref)
    row = torch.rand(6, dtype=torch.float64) + 0.5
    exp = row.expand(3, 4, 6)
    assert rel_err(resolvent_diagonal(a, exp, exp, 0.5j), resolvent_diagonal_dense(a, exp, exp, 0.5j)) < 1e-12


def test_empty_batch_returns_empty():
    a, b, c = (torch.zeros(0, 4, 5, dtype=torch.float32), torch.zeros(0, 4, 4, dtype=torch.float32),
               torch.zeros(0, 4, 4, dtype=torch.float32))
    g = resolvent_diagonal(a, b, c, 1j)
    assert g.shape == (0, 4, 5) and g.dtype == torch.complex64


def test_cuda_backend_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors; diag is on cpu"):
        resolvent_diagonal(*_ok(), 1j, backend="cuda")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(Unavailable, match="TRITON_INTERPRET=1"):
        resolvent_diagonal(*_ok(), 1j, backend="triton")


# --- auto and fallback --------------------------------------------------------------------------

def test_auto_on_cpu_tensors_is_torch_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_backend("auto", "cpu") == "torch"
        a, b, c = _ok()
        assert rel_err(resolvent_diagonal(a, b, c, 1j), resolvent_diagonal_dense(a, b, c, 1j)) < 1e-12


def test_auto_falls_back_with_a_warning_when_cuda_is_unavailable(cpu_only):
    with pytest.warns(RuntimeWarning) as rec:
        assert select_backend("auto", "cuda") == "torch"
    said = [str(w.message) for w in rec]
    assert any("fell back from 'cuda' to 'torch'" in m and "CPU build" in m for m in said), said
    assert any("fell back from 'triton' to 'torch'" in m for m in said), said
    assert available_backends("cpu")["cuda"] is not None and available_backends("cpu")["torch"] is None


@pytest.fixture
def triton_first_on_cpu(monkeypatch):
    """auto's CPU order with a kernel backend first, and a fresh resolution."""
    monkeypatch.setitem(bk_core._AUTO_ORDER, "cpu", ("triton", "torch"))
    bk_core._auto_choice.cache_clear()
    yield
    bk_core._auto_choice.cache_clear()


def test_auto_resolves_once_up_front(monkeypatch, triton_first_on_cpu):
    """auto checks its backends once, before the first launch, and keeps its answer; a backend it
    passes over is named, with the reason, in a warning at every resolution to another."""
    checks = []

    def check(name, device):
        checks.append(name)
        if name == "triton":
            raise Unavailable("simulated: no compiler")
    monkeypatch.setattr(bk_core, "_check_backend", check)
    a, b, c = _ok(n=7, batch=(3,))
    for _ in range(3):
        with pytest.warns(RuntimeWarning, match="fell back from 'triton' to 'torch' on cpu tensors: simulated: no compiler"):
            g = resolvent_diagonal(a, b, c, 0.5j)
        assert rel_err(g, resolvent_diagonal_dense(a, b, c, 0.5j)) < 1e-12
    assert checks == ["triton", "torch"], checks        # resolved once, not per call


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_kernel_that_fails_at_launch_raises_naming_the_backend(monkeypatch, triton_first_on_cpu, where):
    """No catch-all: a selected kernel's failure raises KernelError naming it, on every call, and no
    torch row is computed in its place."""
    monkeypatch.setattr(bk_core, "_check_backend", lambda name, device: None)   # triton "builds" here
    ran = []
    real_f, real_b = bk_core._forward, bk_core._backward

    def forward(name, *args):
        ran.append(("forward", name))
        if name == "triton" and where == "forward":
            raise RuntimeError("simulated launch failure")
        return real_f("torch", *args)

    def backward(name, *args):
        ran.append(("backward", name))
        if name == "triton":
            raise RuntimeError("simulated launch failure")
        return real_b(name, *args)
    monkeypatch.setattr(bk_core, "_forward", forward)
    monkeypatch.setattr(bk_core, "_backward", backward)
    a, b, c = (x.requires_grad_() for x in _ok(n=9, batch=(2,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # and no fallback warning either
        for _ in range(2):
            with pytest.raises(KernelError, match=f"backend 'triton' failed in the {where} "
                                                  r"\(RuntimeError: simulated launch failure\)"):
                resolvent_diagonal(a, b, c, 1j).real.sum().backward()
    assert all(name == "triton" for _, name in ran), ran
    assert not hasattr(bk_core, "_BROKEN") and not hasattr(bk_core, "_READY")


def test_out_of_memory_in_a_kernel_stays_itself(monkeypatch, triton_first_on_cpu):
    """Callers that handle OOM (the memory tools) still see torch.OutOfMemoryError, with the backend noted."""
    monkeypatch.setattr(bk_core, "_check_backend", lambda name, device: None)

    def forward(name, *args):
        raise torch.OutOfMemoryError("simulated")
    monkeypatch.setattr(bk_core, "_forward", forward)
    with pytest.raises(torch.OutOfMemoryError) as e:
        resolvent_diagonal(*_ok(), 1j)
    assert any("backend 'triton'" in n for n in getattr(e.value, "__notes__", [])), e.value


# --- the op as one graph node (resolvent_features) -------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "torch_loop"])
@pytest.mark.parametrize("batch, n", [((3,), 1), ((2, 3), 17), ((5,), 64)], ids=str)
def test_features_are_g_as_real_pairs_with_its_gradients(backend, batch, n):
    """Against the float64 dense inverse (forward) and dense autograd (gradients), fresh inputs."""
    a, b, c, re = make(batch, n, key=("feat", backend))
    z = complex(re, 0.3)
    w = torch.randn(*batch, n, 2, dtype=torch.float64, generator=_gen("featw", n))
    leaves = [x.clone().requires_grad_() for x in (a, b, c)]
    r = bk_core.resolvent_features(*leaves, z, backend=backend)
    assert r.shape == (*batch, n, 2) and r.dtype == torch.float64
    (r * w).sum().backward()
    dense = [x.clone().requires_grad_() for x in (a, b, c)]
    ref = torch.view_as_real(resolvent_diagonal_dense(*dense, z))
    (ref * w).sum().backward()
    assert rel_err(r.detach(), ref.detach()) < 1e-10
    for got, want, name in zip(leaves, dense, ("diag", "upper", "lower")):
        if want.numel():
            assert rel_err(got.grad, want.grad) < 1e-9, name


def _kernel_backends(triton_device):
    out = [("triton", triton_device)]
    if GPU and NVCC:
        out.append(("cuda", "cuda"))
    return out


def test_features_through_the_kernel_backends(triton_device):
    """The op runs each kernel backend it is given: the same G and gradients as ``resolvent_diagonal``
    by that backend (which the tests above check against float64), bit for bit."""
    a, b, c, re = make((6,), 37, key=("feat-k",))
    z = complex(re, 0.2)
    for backend, dev in _kernel_backends(triton_device):
        x = [t.to(dev, torch.float32).requires_grad_() for t in (a, b, c)]
        y = [t.to(dev, torch.float32).requires_grad_() for t in (a, b, c)]
        w = torch.randn(6, 37, 2, generator=_gen("feat-kw")).to(dev)
        r = bk_core.resolvent_features(*x, z, backend=backend)
        g = torch.view_as_real(resolvent_diagonal(*y, z, backend=backend, check_finite=False))
        assert torch.equal(r, g), backend
        (r * w).sum().backward()
        (g * w).sum().backward()
        for p, q in zip(x, y):
            assert torch.equal(p.grad, q.grad), backend


def test_features_gradcheck_and_opcheck():
    a, b, c, re = make((2,), 5, key=("feat-gc",))
    inputs = tuple(x.requires_grad_() for x in (a, b, c))
    assert torch.autograd.gradcheck(lambda *t: bk_core.resolvent_features(*t, complex(re, 0.4), backend="torch"),
                                    inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    torch.library.opcheck(torch.ops.hwlib.resolvent_features.default, (*inputs, re, 0.4, "auto"))
    grad = torch.randn(2, 5, 2, dtype=torch.float64, generator=_gen("feat-gc-g"))
    for backend in ("torch", "torch_loop"):   # a conjugate bit left unresolved failed its compiled checks
        torch.library.opcheck(torch.ops.hwlib.resolvent_features_backward.default,
                              (*(x.detach() for x in inputs), re, 0.4, backend, grad))


def test_triton_z_is_made_once_per_value_and_device(triton_device):
    """The op runs inside the training step's CUDA graph, where a host-to-device copy is not allowed:
    the Triton backend's z tensor is made on the first call (the graph's warm-up) and reused."""
    tk = bk_core._triton()
    a = torch.zeros(2, 3, device=triton_device)
    z1 = tk._z_tensor(0.25 + 1j, a)
    assert tk._z_tensor(complex(0.25, 1.0), a) is z1 and z1.tolist() == [0.25, 1.0]
    z64 = tk._z_tensor(0.25 + 1j, a.double())
    assert z64 is not z1 and z64.dtype == torch.float64


def test_features_take_any_gradient_layout_and_an_empty_batch():
    a, b, c, re = make((3,), 6, key=("feat-odd",))
    z = complex(re, 0.3)
    w = torch.randn(3, 6, 2, dtype=torch.float64, generator=_gen("feat-odd-w"))
    want = None
    for shape in ("plain", "odd offset", "expanded"):
        leaves = [x.clone().requires_grad_() for x in (a, b, c)]
        r = bk_core.resolvent_features(*leaves, z, backend="torch")
        if shape == "plain":
            (r * w).sum().backward()
        elif shape == "odd offset":   # the gradient reaches the op as a view at an odd offset of its storage
            flat = torch.cat([torch.zeros(1, dtype=r.dtype), r.reshape(-1)])
            (flat[1:] * w.reshape(-1)).sum().backward()
        else:                          # .sum() hands back an expanded (stride 0) gradient
            r.sum().backward()
            leaves_plain = [x.clone().requires_grad_() for x in (a, b, c)]
            (bk_core.resolvent_features(*leaves_plain, z, backend="torch") * torch.ones_like(w)).sum().backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(leaves, leaves_plain))
            continue
        got = [x.grad for x in leaves]
        want = want or got
        assert all(torch.equal(p, q) for p, q in zip(got, want)), shape
    e = [x[:0].clone().requires_grad_() for x in (a, b, c)]
    out = bk_core.resolvent_features(*e, 1j)
    out.sum().backward()
    assert out.shape == (0, 6, 2) and e[0].grad.shape == (0, 6)


def test_resnet_bk_features_are_re_then_im_per_head():
    """The mixer's features: [Re G of heads 0..H-1 | Im G of heads 0..H-1] per token, G of each head's
    potentials (the layout the projection after it was trained with)."""
    from hwlib.workloads import resnet_bk as R
    cfg = R.PROFILES["smoke"]
    mixer = R.BKMixer(cfg, "torch")
    x = torch.randn(2, 9, cfg.d_model, generator=_gen("mixer"))
    seen = {}
    mixer.from_features.register_forward_pre_hook(lambda m, args: seen.setdefault("feats", args[0]))
    mixer(x)
    v = torch.tanh(mixer.to_potential(x)).float()                      # [B, N, H]
    ones = torch.ones(9 - 1)
    g = torch.stack([torch.stack([resolvent_diagonal(v[bi, :, h] - 2.0, ones, ones, mixer.z, backend="torch")
                                  for h in range(cfg.n_head)], -1) for bi in range(2)])   # [B, N, H]
    assert torch.allclose(seen["feats"], torch.cat([g.real, g.imag], -1), rtol=1e-5, atol=1e-6)


def test_features_bad_input_names_the_argument():
    a, b, c = _ok()
    with pytest.raises(ChoiceError, match="backend 'tritn'"):
        bk_core.resolvent_features(a, b, c, 1j, backend="tritn")
    with pytest.raises(ValueError, match="upper"):
        bk_core.resolvent_features(a, b[..., :-1], c, 1j)
    with pytest.raises(ValueError, match="Im z"):
        bk_core.resolvent_features(a, b, c, 2.0)
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        bk_core.resolvent_features(a, b, c, 1j, backend="cuda")
    empty = bk_core.resolvent_features(a[:0], b[:0], c[:0], 1j)
    assert empty.shape == (0, 5, 2)


def test_resnet_bk_compiles_without_a_graph_break():
    """The BK-Core call is one node of the compiled forward (a graph break there would leave CUDA
    graphs the pieces between the calls, and the torch backend's rounds launched from the host),
    and the compiled step computes what the eager one does."""
    from hwlib.workloads import resnet_bk as R
    cfg = R.PROFILES["smoke"]
    g = _gen("rbk")
    idx = torch.randint(0, cfg.vocab, (2, cfg.context), generator=g)
    tgt = torch.randint(0, cfg.vocab, (2, cfg.context), generator=g)
    model = R.ResNetBK(cfg).init_weights(0)
    eager = model(idx, tgt)
    eager.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    # aot_eager: the graph through AOT autograd as inductor gets it, without inductor's code generation
    # (tens of seconds on a CPU; notebook 06's smoke run compiles this model with inductor). One trace
    # checks both: fullgraph raises at any graph break, naming it, and the backend sees the graph.
    from torch._dynamo.backends.debugging import aot_eager
    graphs = []
    got = torch.compile(model, backend=lambda gm, args: graphs.append(gm) or aot_eager(gm, args),
                        fullgraph=True)(idx, tgt)
    got.backward()
    torch._dynamo.reset()
    assert len(graphs) == 1 and "resolvent_features" in str(graphs[0].graph), graphs
    assert abs(got.item() - eager.item()) <= 1e-5 * abs(eager.item())
    for p, w in zip(model.parameters(), want):
        assert torch.allclose(p.grad, w, rtol=1e-3, atol=1e-6)


# --- the load_inline loader on a machine without CUDA ----------------------------------------------

def test_cuda_loader_raises_unavailable_without_cuda(cpu_only):
    from hwlib.ops import bk_cuda
    with pytest.raises(Unavailable, match="CPU build|no CUDA GPU"):
        hcuda.check_available()
    with pytest.raises(Unavailable):
        bk_cuda.module()


def test_extensions_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert hcuda.extensions_dir() == hcuda.REPO_ROOT / ".torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert hcuda.extensions_dir() == tmp_path


HOST = socket.gethostname()


def _owner(folder: Path, text: str | None, age_s: float = 0.0, torch_lock: bool = True) -> Path:
    """A build folder as a builder leaves it: its owner file ("pid host") and torch's ``lock``."""
    folder.mkdir(parents=True, exist_ok=True)
    owner = folder / hcuda._OWNER
    if text is not None:
        owner.write_text(text)
        t = time.time() - age_s
        os.utime(owner, (t, t))
    if torch_lock:
        (folder / "lock").write_text("")
    return owner


@pytest.fixture
def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_owner_state(tmp_path, dead_pid):
    cases = [  # (owner text, age, stale?)
        (None, 0, False),                               # nobody holds it
        (f"{dead_pid} {HOST}", 0, True),                # owner process gone
        (f"{os.getppid()} {HOST}", 3600, False),        # owner alive here: a slow build, never cleared
        (f"{os.getpid()} {HOST}", 0, True),             # ourselves, not building: an interrupted build
        ("123 another-host", 10, False),                # another host, refreshed recently
        ("123 another-host", 3600, True),               # another host, no refresh for an hour
        ("", 10, False),                                # unreadable owner: judged by its age
        ("garbage", 3600, True),
    ]
    for i, (text, age, stale) in enumerate(cases):
        _owner(tmp_path / str(i), text, age)
        who, why = hcuda.owner_state(tmp_path / str(i), stale_s=300)
        assert (why is not None) == stale, (text, age, who, why)


def test_a_dead_owner_is_cleared_and_the_waiter_builds(tmp_path, dead_pid):
    owner = _owner(tmp_path, f"{dead_pid} {HOST}")
    with pytest.warns(RuntimeWarning) as rec:
        got = hcuda.acquire_build_lock(tmp_path, wait_s=5, poll_s=0.01)
    said = " | ".join(str(w.message) for w in rec)
    assert "stale build lock" in said and f"process {dead_pid}" in said and "torch's build lock" in said, said
    assert got == owner and owner.read_text() == f"{os.getpid()} {HOST}"
    assert not (tmp_path / "lock").exists()            # torch's lock of the killed build went with it


def test_a_waiter_never_overwrites_a_live_owner_and_its_wait_is_bounded(tmp_path, monkeypatch):
    """A live but stuck owner: the waiter leaves its file alone and gives up after the bound, with
    an error naming the lock and how to clear it (the bound from the argument, else the variable)."""
    text = f"{os.getppid()} {HOST}"
    owner = _owner(tmp_path, text)
    before = owner.stat()
    for how in ("argument", "env"):
        monkeypatch.setenv("HWLIB_BUILD_WAIT_S", "0.3")
        t0 = time.monotonic()
        with pytest.raises(hcuda.BuildLockTimeout) as e:
            hcuda.acquire_build_lock(tmp_path, wait_s=0.3 if how == "argument" else None, poll_s=0.05)
        assert 0.25 <= time.monotonic() - t0 < 5
        msg = str(e.value)
        assert str(owner) in msg and "delete" in msg and "HWLIB_BUILD_WAIT_S" in msg and text in msg, msg
        assert owner.read_text() == text and owner.stat().st_ino == before.st_ino   # untouched
        assert isinstance(e.value, Unavailable)        # auto passes over the backend, visibly
    assert (tmp_path / "lock").exists()


def test_a_waiter_rechecks_staleness_while_waiting(tmp_path):
    """The owner dies while another process waits: the waiter clears it then, not only on entry."""
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _owner(tmp_path, f"{builder.pid} {HOST}")
        threading.Timer(0.5, lambda: (builder.kill(), builder.wait())).start()   # reaped: no zombie
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning) as rec:
            hcuda.acquire_build_lock(tmp_path, wait_s=20, poll_s=0.05)
        said = " | ".join(str(w.message) for w in rec)
        assert f"process {builder.pid} on this host is gone" in said and "torch's build lock" in said, said
        assert time.monotonic() - t0 < 10
    finally:
        builder.kill()
        builder.wait()
    assert (tmp_path / hcuda._OWNER).read_text() == f"{os.getpid()} {HOST}"


def test_the_builder_refreshes_its_lock_and_releases_it(tmp_path):
    owner = hcuda.acquire_build_lock(tmp_path, wait_s=1)
    os.utime(owner, (time.time() - 100, time.time() - 100))
    with hcuda._Heartbeat(owner, 0.05):
        time.sleep(0.3)
        assert time.time() - owner.stat().st_mtime < 5
    assert not owner.exists()


def _build_one_at_a_time(folder: Path, out: Path) -> None:
    """A builder process: takes the lock, holds it 0.4 s, writes when it held it, releases it."""
    hcuda.acquire_build_lock(folder, wait_s=30, poll_s=0.02)
    t0 = time.time()
    time.sleep(0.4)
    out.write_text(f"{t0} {time.time()}")
    (folder / hcuda._OWNER).unlink()


def test_two_processes_build_one_at_a_time(tmp_path):
    # Forked from this process, which has imported the lock's module already: two processes of their own
    # (their own pids in the owner file), without two more imports of torch (~4 CPU-s each).
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build_one_at_a_time, args=(tmp_path, tmp_path / f"span{i}")) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    spans = sorted(tuple(map(float, (tmp_path / f"span{i}").read_text().split())) for i in range(2))
    assert len(spans) == 2 and spans[0][1] <= spans[1][0], spans     # the second started after the first ended


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_build_wait_must_be_a_number(monkeypatch, value):
    monkeypatch.setenv("HWLIB_BUILD_WAIT_S", value)
    with pytest.raises(ValueError, match="HWLIB_BUILD_WAIT_S"):
        hcuda.build_wait_s()
    assert hcuda.build_wait_s(2) == 2.0


# --- the .cu sources through plain nvcc ------------------------------------------------------------

CU_FILES = sorted(KERNELS_DIR.glob("*.cu"))


@pytest.fixture(scope="module")
def nvcc_object(tmp_path_factory):
    """``nvcc_object(cu)``: the nvcc run that compiles ``cu`` for sm_90 to an object file, once per module
    (the plain-nvcc check and the host library below share 12_bk_core.cu's, which takes most of a minute
    of CPU on a loaded machine). Plain nvcc flags, with the host code position-independent so that the
    object links into a shared library, and at -O2, whose host warnings are a superset of -O0's."""
    if NVCC is None:
        pytest.skip("nvcc not on PATH")
    out, done = tmp_path_factory.mktemp("nvcc"), {}

    def compile_cu(cu: Path) -> tuple[subprocess.CompletedProcess, Path]:
        if cu not in done:
            obj = out / f"{cu.stem}.o"
            r = subprocess.run([NVCC, "-arch=sm_90", "-c", "-Xcompiler", "-fPIC,-O2", str(cu), "-o", str(obj)],
                               capture_output=True, text=True, timeout=300)
            done[cu] = (r, obj)
        return done[cu]
    return compile_cu


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_with_plain_nvcc(cu, nvcc_object):
    r, _ = nvcc_object(cu)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr.lower(), r.stderr[-3000:]


@pytest.fixture(scope="module")
def bk_host_lib(tmp_path_factory, nvcc_object):
    """kernels/12_bk_core.cu as a shared library: its host path runs the device code's block
    logic. Its launchers are declared to ctypes from 12_bk_core.h (``bk_cuda.bind_ctypes``)."""
    r, obj = nvcc_object(KERNELS_DIR / "12_bk_core.cu")
    assert r.returncode == 0, r.stderr[-3000:]
    so = tmp_path_factory.mktemp("bk") / "libbk_core.so"
    r = subprocess.run([NVCC, "-arch=sm_90", "-shared", str(obj), "-o", str(so)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return bk_cuda.bind_ctypes(ctypes.CDLL(str(so)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_cu_block_logic_on_host(bk_host_lib, dtype):
    """The .cu forward and backward (same block code as the kernels: tiles of several sequences or
    one, chunk maps, their scans, the two-sweep path of sequences longer than a tile, several blocks)
    run on the CPU against the float64 reference; outputs poisoned first."""
    lib, sfx = bk_host_lib, "f64" if dtype == torch.float64 else "f32"
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())
    cd = bk_reference.COMPLEX_OF[dtype]
    dbl = int(sfx == "f64")
    wf, wb = lib.bk_core_tile_positions(dbl, 0), lib.bk_core_tile_positions(dbl, 1)
    cases = [(1, 1), (3, 2), (70, 17), (65, 16), (2, 33), (130, 100), (3, 64),
             (2, wf), (1, wf + 1), (1, 2 * wf + 37)] + ([(1, wb + 3), (1, 2 * wb + 5)] if wb != wf else [])
    for B, n in cases:
        a, b, c, re = make((B,), n, dtype, key=("host",))
        z = complex(re, 0.05)
        ref_f = (resolvent_diagonal_dense if n <= 130 else bk_reference.forward_loop)(a, b, c, z)
        out = torch.full((B, n), complex("nan+nanj"), dtype=cd)
        ws = torch.full((lib.bk_core_workspace_elems(B, n, dbl, 0) + 1,), float("nan"), dtype=dtype)
        assert getattr(lib, f"bk_core_forward_host_{sfx}")(ptr(a), ptr(b), ptr(c), ptr(out), ptr(ws), B, n,
                                                           z.real, z.imag) == 0
        assert rel_err(out, ref_f) < TOL[dtype], (B, n)
        w = torch.randn(B, n, dtype=cd, generator=_gen("hw", B, n))
        wr = torch.view_as_real(w)
        grads = [torch.full(s, float("nan"), dtype=dtype) for s in ((B, n), (B, n - 1), (B, n - 1))]
        ws = torch.full((lib.bk_core_workspace_elems(B, n, dbl, 1) + 1,), float("nan"), dtype=dtype)
        assert getattr(lib, f"bk_core_backward_host_{sfx}")(ptr(a), ptr(b), ptr(c), ptr(wr), *map(ptr, grads),
                                                            ptr(ws), B, n, z.real, z.imag) == 0
        for got, want in zip(grads, bk_reference.backward_loop(a.double(), b.double(), c.double(), z, w)):
            if want.numel():
                assert rel_err(got, want) < 10 * TOL[dtype], (B, n)


# --- the C ABI: declared once, in 12_bk_core.h ---------------------------------------------------------

CU_TEXT = (KERNELS_DIR / "12_bk_core.cu").read_text()
H_TEXT = (KERNELS_DIR / bk_cuda.HEADER).read_text()


def abi_problems(header: str, cu: str = CU_TEXT, wrapper: str = bk_cuda.WRAPPER) -> list[str]:
    """Where the header, the .cu's definitions and the torch binding's calls disagree."""
    declared = bk_cuda.parse_prototypes(header)
    defined = bk_cuda.parse_prototypes(cu, definitions=True)
    out = [f"{n}: defined in 12_bk_core.cu as {defined.get(n)}, declared as {declared.get(n)}"
           for n in sorted(set(declared) | set(defined)) if declared.get(n) != defined.get(n)]
    return out + bk_cuda.check_binding(declared, wrapper)


def test_the_header_the_cu_and_the_binding_agree():
    assert abi_problems(H_TEXT) == []
    protos = bk_cuda.prototypes()
    assert len(protos) == 11 and protos["bk_core_forward_f32"].params[-1] == "void*"
    assert protos["bk_core_workspace_elems"].restype == "long long"
    # one declaration: both C++ sides include the header, neither repeats it
    assert '#include "12_bk_core.h"' in CU_TEXT and '#include "12_bk_core.h"' in bk_cuda.BINDING
    assert 'extern "C"' not in bk_cuda.BINDING
    for proto in protos.values():           # and ctypes reads the same declarations
        restype, argtypes = bk_cuda.ctypes_signature(proto)
        assert len(argtypes) == len(proto.params)
    assert "torch/" not in H_TEXT and "cuda_runtime" not in H_TEXT     # includable from plain C++


ALTERED = {  # what a drifted copy looks like -> what the check must say
    "a parameter dropped": (("long long N, double zr, double zi, void* stream);\nint bk_core_forward_f64",
                             "long long N, double zr, double zi);\nint bk_core_forward_f64"),
                            "bk_core_forward_f32: called with 10 arguments, 12_bk_core.h declares 9"),
    "a type changed": (("int bk_core_backward_f64(const double* a", "int bk_core_backward_f64(const float* a"),
                       "bk_core_backward_f64: defined in 12_bk_core.cu as"),
    "a launcher renamed": (("const char* bk_core_error_string(int code);", "const char* bk_core_error_text(int code);"),
                           "bk_core_error_string: called by the binding, not declared"),
    "a host launcher gone": (("int bk_core_forward_host_f64(", "int bk_core_forward_host_f64_(", ),
                             "bk_core_forward_host_f64: defined in 12_bk_core.cu as"),
}


@pytest.mark.parametrize("how", ALTERED)
def test_a_drifted_header_copy_fails_the_check(how):
    (old, new), says = ALTERED[how]
    assert old in H_TEXT
    problems = abi_problems(H_TEXT.replace(old, new, 1))
    assert any(says in p for p in problems), problems


def test_a_binding_call_with_the_wrong_arguments_fails_the_check():
    wrapper = bk_cuda.WRAPPER.replace("ws.data_ptr<double>(), B, N, zr, zi, stream)\n      : bk_core_backward_f32",
                                      "ws.data_ptr<double>(), B, N, zr, stream)\n      : bk_core_backward_f32", 1)
    assert wrapper != bk_cuda.WRAPPER
    assert any("bk_core_backward_f64: called with 12 arguments, 12_bk_core.h declares 13" in p
               for p in abi_problems(H_TEXT, wrapper=wrapper))


def test_the_cuda_backend_refuses_to_build_a_drifted_binding(monkeypatch):
    drifted = bk_cuda.parse_prototypes(H_TEXT.replace("double zr, double zi, void* stream);\nint bk_core_forward_f64",
                                                      "double zr, void* stream);\nint bk_core_forward_f64", 1))
    monkeypatch.setattr(bk_cuda, "prototypes", lambda: drifted)
    monkeypatch.setattr(bk_cuda, "_MODULE", None)
    with pytest.raises(RuntimeError, match="disagrees with 12_bk_core.h: bk_core_forward_f32: called with 10"):
        bk_cuda.module()


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_nvcc_refuses_a_cu_that_differs_from_its_header(tmp_path):
    shutil.copy(KERNELS_DIR / "12_bk_core.cu", tmp_path)
    (tmp_path / "12_bk_core.h").write_text(H_TEXT.replace("long long B, long long N, double zr, double zi, void* stream);\n"
                                                       "int bk_core_forward_f64",
                                                       "long long B, int N, double zr, double zi, void* stream);\n"
                                                       "int bk_core_forward_f64", 1))
    r = subprocess.run([NVCC, "-arch=sm_90", "-c", str(tmp_path / "12_bk_core.cu"), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "bk_core_forward_f32" in r.stderr, r.stderr[-2000:]


# --- input checks at the working precision ------------------------------------------------------------

def test_an_im_z_float32_cannot_carry_is_refused_and_float64_is_exact():
    a, b, c, re = make((3,), 7, key=("tiny z",))
    z = complex(re, 1e-50)
    for check in (True, False):             # needs no read of the tensors: checked even without check_finite
        with pytest.raises(ValueError, match=r"z: \|Im z\| = 1e-50 is below 4\.3\de-19.*float32.*float64"):
            resolvent_diagonal(a.float(), b.float(), c.float(), z, check_finite=check)
    ref = resolvent_diagonal_dense(a, b, c, z)
    for backend in ("torch_loop", "torch"):
        g = resolvent_diagonal(a, b, c, z, backend=backend)
        assert g.isfinite().all() and rel_err(g, ref) < 1e-9, backend
    z = complex(re, 1e-15)                  # small, but inside float32's range: computed, and right
    g = resolvent_diagonal(a.float(), b.float(), c.float(), z, backend="torch")
    assert rel_err(g, resolvent_diagonal_dense(a, b, c, z)) < TOL[torch.float32]


@pytest.mark.parametrize("what, mutate, says", [
    ("off-diagonals", lambda a, b, c: (a, b * 0 + 1e20, c * 0 + 1e20), r"upper, lower: max\|upper \* lower\| = 1e\+40"),
    ("diagonal", lambda a, b, c: (a * 0 + 1e20, b, c), r"diag: max\|diag\| = 1e\+20"),
])
def test_a_scale_float32_cannot_carry_is_refused_and_float64_is_exact(what, mutate, says):
    """Finite inputs whose squares leave float32's range: the kernels would return NaN (or zeros)
    where the dense inverse is finite; the op raises instead, naming the argument and the limit."""
    a, b, c = mutate(*make((2,), 13, key=("huge", what))[:3])
    a32, b32, c32 = (x.float() for x in (a, b, c))
    assert not bk_scan.forward_scan(a32, b32, c32, 1j).isfinite().all() or what == "diagonal"
    with pytest.raises(ValueError, match=says + r".*float32 carries .* <= 4\.61e\+18.*float64"):
        resolvent_diagonal(a32, b32, c32, 1j)
    ref = resolvent_diagonal_dense(a, b, c, 1j)
    for backend in ("torch_loop", "torch"):
        g = resolvent_diagonal(a, b, c, 1j, backend=backend)
        assert g.isfinite().all() and rel_err(g, ref) < 1e-9, backend


def test_a_large_z_is_refused_in_float32():
    with pytest.raises(ValueError, match=r"z: \|z\| = 1e\+20"):
        resolvent_diagonal(*(x.float() for x in _ok()), 1e20 + 1j)


def test_scales_inside_float32s_range_are_computed_by_every_backend(triton_device):
    """Couplings of 1e18 (|w|^2 near 1e36) still pass, and every backend stays accurate there."""
    a, b, _, re = make((3,), 7, key=("big k",))
    big = torch.full_like(b, 1e9)
    ref = resolvent_diagonal_dense(a, big, big, 1j)
    for backend in ("torch_loop", "torch", "triton"):
        x = [t.float().to(triton_device if backend == "triton" else "cpu") for t in (a, big, big)]
        g = resolvent_diagonal(*x, 1j, backend=backend)
        assert rel_err(g.cpu(), ref) < TOL[torch.float32], backend
    lo, hi = working_range(torch.float32)
    assert 1e-19 < lo < 1e-18 and 1e18 < hi < 1e19
    assert working_range(torch.float64)[0] < 1e-150


# --- the study's timings: of the right result, and of the calls they say ----------------------------

def test_timing_checks_what_it_timed_and_counts_its_calls(monkeypatch):
    from hwlib.studies import bk_core as bk_study
    real_f, real_b = bk_core._forward, bk_core._backward
    calls = []
    monkeypatch.setattr(bk_core, "_forward", lambda name, *a: calls.append(name) or real_f(name, *a))
    for d in bk_study.DIRECTIONS:
        for kernel_only in (False, True):
            calls.clear()
            t = bk_study.time_backend("torch", 5, 17, "cpu", direction=d, iters=3, warmup=2, group=2,
                                      kernel_only=kernel_only)
            assert t.n == 3 and len(t.samples_ms) == 3 and 0 < t.p20_ms <= t.median_ms <= t.p80_ms
            assert calls == ["torch"] * ((2 + 3) * 2 + 1), (d, kernel_only, calls)  # warm-up, timed, the check
    monkeypatch.setattr(bk_core, "_forward", lambda name, *a: real_f(name, *a) * 1.01)     # 1% wrong
    for kernel_only in (False, True):
        with pytest.raises(RuntimeError, match="'torch' \\(forward\\) differs from the float64 reference"):
            bk_study.time_backend("torch", 5, 17, "cpu", iters=1, warmup=0, kernel_only=kernel_only)
    monkeypatch.setattr(bk_core, "_forward", real_f)
    monkeypatch.setattr(bk_core, "_backward", lambda name, *a: [g * 1.01 for g in real_b(name, *a)])
    with pytest.raises(RuntimeError, match="forward\\+backward\\) differs"):
        bk_study.time_backend("torch", 5, 17, "cpu", direction="forward+backward", iters=1, warmup=0)


def test_kernel_only_timing_refuses_auto_and_unknown_directions():
    from hwlib.studies import bk_core as bk_study
    with pytest.raises(ValueError, match="kernel_only"):
        bk_study.time_backend("auto", 4, 16, "cpu", iters=1, kernel_only=True)
    with pytest.raises(ValueError, match="direction"):
        bk_study.time_backend("torch", 4, 16, "cpu", direction="sideways", iters=1, kernel_only=True)


def test_study_records_keep_x_values_in_fields():
    from hwlib.studies import bk_core as bk_study
    rows = bk_study.add_share_of_copy(bk_study.speed_rows([(4, 9)], ["torch_loop", "torch"], "cpu", loop_iters=1), None)
    recs = bk_study.speed_records(rows, notebook="12_bk_core", profile="smoke", device="cpu")
    assert {r["metric"] for r in recs} == {"forward_ms", "forward+backward_ms"}
    assert sorted((r["fields"]["backend"], r["fields"]["B"], r["fields"]["N"], r["metric"]) for r in recs) == sorted(
        (be, 4, 9, f"{d}_ms") for be in ("torch", "torch_loop") for d in bk_study.DIRECTIONS)
    assert all(r["step"] is None and r["workload"] == "bk_core" and r["params"]["share_of_copy"] is None for r in recs)
    first = bk_study.first_failing_records({"complex64": 123, "complex128": None}, notebook="12_bk_core", profile="smoke", device="cpu")
    assert [(r["metric"], r["fields"], r["value"], r["status"]) for r in first] == [
        ("theta_phi_first_failing_N", {"dtype": "complex64"}, 123, "ok"),
        ("theta_phi_first_failing_N", {"dtype": "complex128"}, None, "n/a")]
    tg = bk_study.target_records(bk_study.targets(rows, 4, 9), notebook="12_bk_core", profile="smoke", device="cpu")
    assert [(r["metric"], r["status"]) for r in tg] == [("target", "n/a"), ("target", "failed")]   # no ceiling; loop
    assert tg[0]["fields"] == {"target": "best forward >= 60% of copy bandwidth"}


def test_kernel_targets_judge_the_kernels_timed_alone_against_the_copy_ceiling():
    from hwlib.studies import bk_core as bk_study
    row = lambda backend, direction, share, n=16: {"backend": backend, "direction": direction, "B": 4, "N": n,
                                                  "ms": 0.1, "share of copy": share}
    rows = [row("cuda (kernel alone)", "forward", 0.86), row("cuda", "forward", 0.99),
            row("cuda (kernel alone)", "forward+backward", 0.64), row("triton (kernel alone)", "forward", None),
            row("triton (kernel alone)", "forward", 0.9, n=32)]
    got = {t["target"]: t["met"] for t in bk_study.targets(rows, 4, 16)}
    assert got["cuda forward alone >= 85% of copy bandwidth"] is True        # not the op's row
    assert got["cuda forward+backward alone >= 65% of copy bandwidth"] is False
    assert got["triton forward alone >= 50% of copy bandwidth"] is None      # no ceiling: n/a, not met
    assert got["best forward >= 60% of copy bandwidth"] is True
    recs = bk_study.target_records(bk_study.targets(rows, 4, 16), notebook="12_bk_core", profile="smoke", device="cpu")
    assert [r["status"] for r in recs][:3] == ["ok", "failed", "n/a"]
    assert recs[2]["reason"] == "no copy ceiling measured in this run"
    assert bk_study.targets(rows, 4, 64) == []                               # nothing timed at that size


def test_kernel_gap_compares_the_kernels_timed_alone_at_one_size():
    from hwlib.studies import bk_core as bk_study
    row = lambda backend, ms, n=16, direction="forward": {"backend": backend, "ms": ms, "B": 4, "N": n, "direction": direction}
    rows = [row("triton (kernel alone)", 0.42), row("cuda (kernel alone)", 0.16), row("triton", 0.1),
            row("cuda (kernel alone)", 9.0, n=32), row("triton (kernel alone)", 9.0, direction="forward+backward")]
    assert bk_study.kernel_gap(rows, 4, 16).startswith("Timed alone, the Triton forward kernel took 2.62x the CUDA "
                                                        "kernel's time (0.420 against 0.160 ms)")
    assert bk_study.kernel_gap(rows, 4, 32) is None                       # no Triton row at that size
    assert bk_study.kernel_gap(rows, 4, 16, "forward+backward") is None   # no CUDA row in that direction


def test_a_sweep_draws_each_sizes_inputs_once(monkeypatch):
    """speed_rows times every backend and direction at one size on the same input sets, drawn once
    per size (drawing them costs more than timing them); time_backend refuses sets of another size."""
    from hwlib.studies import bk_core as bk_study
    drawn = []
    real = bk_study.random_inputs
    monkeypatch.setattr(bk_study, "random_inputs", lambda *a, **k: drawn.append((a[:2], k.get("seed"))) or real(*a, **k))
    rows = bk_study.speed_rows([(3, 9), (4, 9)], ["torch"], "cpu")
    assert len(rows) == 4 and all(r["ms"] > 0 for r in rows)
    # each row says what it cost: its timing and check, and its size's draw (one figure per size)
    assert all(r["wall_s"] > 0 and r["draw_s"] > 0 for r in rows)
    assert len({r["draw_s"] for r in rows if r["B"] == 3}) == 1
    recs = bk_study.speed_records(rows, notebook="12_bk_core", profile="smoke", device="cpu")
    assert [r["params"]["wall_s"] for r in recs] == [r["wall_s"] for r in rows]
    per_size = max(bk_study.sets_needed(3, 9, direction=d) for d in bk_study.DIRECTIONS)
    assert drawn == [((B, 9), i) for B in (3, 4) for i in range(per_size)]
    sets = bk_study.input_sets(3, 9, torch.float32, "cpu", per_size)
    with pytest.raises(ValueError, match="sets: need at least"):
        bk_study.time_backend("torch", 4, 9, "cpu", iters=1, warmup=0, sets=sets)
    with pytest.raises(ValueError, match="sets: need at least"):
        bk_study.time_backend("torch", 3, 9, "cpu", iters=1, warmup=0, sets=sets[:1])


def test_a_sweep_computes_each_reference_once_and_still_checks_every_timing(monkeypatch):
    """The float64 loop reference is computed once per size and direction and shared by every
    backend timed there (the incoming gradients are seeded, so the same for each); every timing is
    still checked against it, a wrong result still fails, and the torch loop reuses the first size's
    input sets instead of drawing them again."""
    from hwlib.studies import bk_core as bk_study
    refs, checks, drawn = [], [], []
    for name in ("forward_loop", "backward_loop"):
        real = getattr(bk_study, name)
        monkeypatch.setattr(bk_study, name, lambda *a, _real=real, _name=name: refs.append(_name) or _real(*a))
    real_check, real_draw = bk_study.check_output, bk_study.random_inputs
    monkeypatch.setattr(bk_study, "check_output", lambda *a, **k: checks.append(a[:2]) or real_check(*a, **k))
    monkeypatch.setattr(bk_study, "random_inputs", lambda *a, **k: drawn.append((a[:2], k.get("seed"))) or real_draw(*a, **k))
    rows = bk_study.speed_rows([(3, 9), (4, 9)], ["torch_loop", "torch"], "cpu", loop_iters=1)
    assert [(r["backend"], r["B"], r["direction"]) for r in rows] == [
        (be, B, d) for B, be in [(3, "torch"), (3, "torch_loop"), (4, "torch")] for d in bk_study.DIRECTIONS]
    assert sorted(refs) == ["backward_loop"] * 2 + ["forward_loop"] * 2            # 2 sizes x 2 directions
    assert len(checks) == len(rows)
    per_size = max(bk_study.sets_needed(3, 9, direction=d) for d in bk_study.DIRECTIONS)
    assert drawn == [((B, 9), i) for B in (3, 4) for i in range(per_size)]         # none for the loop's rows
    assert [r["draw_s"] for r in rows if r["backend"] == "torch_loop"] == [rows[0]["draw_s"]] * 2

    # the shared reference is the one each check would compute, and a wrong result still fails against it
    sets, shared = bk_study.input_sets(3, 9, torch.float32, "cpu", per_size), {}
    for d in bk_study.DIRECTIONS:
        bk_study.time_backend("torch", 3, 9, "cpu", direction=d, iters=1, warmup=0, sets=sets, refs=shared)
    grads = bk_study.timing_grads(3, 9, torch.float32, "cpu", 2)
    assert torch.equal(grads[0], bk_study.timing_grads(3, 9, torch.float32, "cpu", 1)[0])   # seeded: every backend's
    for d in bk_study.DIRECTIONS:
        want = bk_study.reference_output(d, *sets[0], grads[0])
        assert all(torch.equal(x, y) for x, y in zip(shared[(d, 3, 9, "torch.float32")], want))
    real_b = bk_core._backward
    monkeypatch.setattr(bk_core, "_backward", lambda name, *a: [g * 1.01 for g in real_b(name, *a)])
    with pytest.raises(RuntimeError, match="forward\\+backward\\) differs"):
        bk_study.time_backend("torch", 3, 9, "cpu", direction="forward+backward", iters=1, warmup=0, sets=sets,
                              refs=shared)


def test_the_accuracy_sweep_reuses_its_float64_reference(monkeypatch):
    """The complex128 stable form is the reference's own call: computed once, its row kept (0)."""
    from hwlib.studies import bk_core as bk_study
    calls = []
    real = bk_study.resolvent_diagonal
    monkeypatch.setattr(bk_study, "resolvent_diagonal", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    rows = bk_study.accuracy_sweep([16, 96])
    assert calls == [torch.float64, torch.float32] * 2
    assert [(r["N"], r["method"], r["dtype"]) for r in rows] == [
        (n, m, dt) for n in (16, 96) for m, dt in [("stable form vs dense inverse", "complex128"),
                                                    ("theta/phi (seed)", "complex64"), ("stable form", "complex64"),
                                                    ("theta/phi (seed)", "complex128"), ("stable form", "complex128")]]
    assert all(r["rel_err"] == 0.0 for r in rows if r["method"] == "stable form" and r["dtype"] == "complex128")
    assert all(0 < r["rel_err"] < 1e-5 for r in rows if r["method"] == "stable form" and r["dtype"] == "complex64")


def test_notebook_12s_gradient_check_runs_the_interpreted_kernel_on_a_cpu_and_catches_a_wrong_one(triton_device,
                                                                                                 monkeypatch):
    """Notebook 12 (``triton_on_cpu=True``) checks ``gradient_rows`` over every available backend: on a CPU
    that holds the Triton backward, interpreted (N = 13), against autograd through the dense inverse; a
    backward kernel whose gradients are 1e-6 too large fails the notebook's bound (1e-9)."""
    from hwlib.studies import bk_core as bk_study
    if triton_device != "cpu":
        pytest.skip("on a GPU the kernels are compiled; this checks the CPU's interpreted rows")
    assert "triton" in [k for k, v in available_backends("cpu").items() if v is None]
    key = "max relative error of (da, db, dc)"
    assert bk_study.gradient_rows(["triton"], "cpu")[0][key] < 1e-9
    tk = bk_core._triton()
    real = tk.bk_backward
    monkeypatch.setattr(tk, "bk_backward", lambda *a, **kw: tuple(g * (1 + 1e-6) for g in real(*a, **kw)))
    assert bk_study.gradient_rows(["triton"], "cpu")[0][key] > 1e-9
