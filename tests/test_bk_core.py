"""BK-Core: every backend against the float64 dense inverse, exact gradients, long-N stability, the
bad-input paths, the CUDA loader's error and lock handling, and the .cu file through nvcc.

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
import sys
import time
import warnings
import zlib
from pathlib import Path

import pytest
import torch

from hwlib.ops import build as hcuda
from hwlib.device import ChoiceError, Unavailable
from hwlib.ops import (available_backends, bk_core, resolvent_diagonal, resolvent_diagonal_dense,
                       resolvent_diagonal_theta_phi, select_backend)
from hwlib.ops import bk_reference, bk_scan

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


@pytest.fixture(scope="module")
def triton_device():
    """The device Triton runs on here: CUDA when visible, else CPU under the interpreter, which
    conftest.py selects before triton is first imported."""
    pytest.importorskip("triton")
    from hwlib.ops.sources import triton_interpreted, triton_interpreter_mismatch
    if GPU and not triton_interpreted():
        return "cuda"
    why = triton_interpreter_mismatch()
    if why or not triton_interpreted():
        pytest.skip(why or "no GPU and TRITON_INTERPRET is not set")
    return "cpu"


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


# (B, N, chunk): chunks that divide N and that do not, one chunk, chunk counts not a power of 2.
# The interpreter pays per program, per unrolled position and per scanned chunk: kept small.
CHUNKED_CASES = [(1, 1, 4), (5, 7, 4), (5, 7, 3), (33, 7, 4), (1, 64, 8), (5, 64, 5), (5, 64, 16),
                 (1, 257, 16), (2, 257, 7), (1, 257, 40)]


def test_triton_chunked_forward_matches_reference(triton_device):
    """bk_forward_chunked (one lane per chunk, chunks joined by Moebius-map scans) against the
    float64 dense inverse / forward_loop: float64 at Im z = 0.01, float32 at Im z = 1 and 0.01."""
    from hwlib.ops.bk_core import _triton
    tk = _triton()
    for B, n, chunk in CHUNKED_CASES:
        a, b, c, re = make((B,), n, key=("chunked", chunk))
        for im, tol32 in ((1.0, 2e-6), (0.01, 5e-5)):
            z = complex(re, im)
            ref = resolvent_diagonal_dense(a, b, c, z) if n <= 64 else bk_reference.forward_loop(a, b, c, z)
            x64 = [x.to(triton_device) for x in (a, b, c)]
            if im < 1:
                g = tk.bk_forward_chunked(*x64, z, chunk=chunk, lanes=1)    # one sequence per program
                assert g.dtype == torch.complex128 and rel_err(g.cpu(), ref) < 1e-12, (B, n, chunk, im)
            g32 = tk.bk_forward_chunked(*(x.float() for x in x64), z, chunk=chunk, lanes=1)
            assert g32.dtype == torch.complex64 and rel_err(g32.cpu(), ref) < tol32, (B, n, chunk, im)


def test_triton_chunked_interleaved_layout_and_default_plan(triton_device):
    """[N, B] storage as transposed views, several sequences per program, and the dispatch: the
    triton backend's forward takes the chunked kernel from N >= 4 chunks."""
    from hwlib.ops.bk_core import _triton
    tk = _triton()
    n, B = 70, 3
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
mod = load_python_kernel("bk_core_triton.py")
for kernel in (mod._bk_forward_kernel, mod._bk_backward_kernel):
    for dt in ("fp32", "fp64"):
        # as launched: unit position strides (row-major) and B = N = 1 become constexprs on a GPU
        for consts in ({"BLOCK": 128}, {"BLOCK": 128, "san": 1, "sbn": 1, "scn": 1},
                       {"BLOCK": 64, "B": 1, "N": 1, "sab": 1, "sbb": 1, "scb": 1}):
            sig = {a: "constexpr" if a in consts else f"*{dt}" if a.endswith("_ptr") else "i32"
                   for a in kernel.arg_names}
            k = compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
            assert k.asm.get("cubin"), (kernel, dt, consts)
# the chunked forward: a small plan in both dtypes, and the plan of the B = 8192, N = 2048 benchmark
L, PP, BS, W = mod.chunk_plan(2048)
plans = [("fp32", 4, 16, 8, 4), ("fp64", 4, 16, 8, 4), ("fp32", L, PP, BS, W)]
kernel = mod._bk_forward_chunked_kernel
for dt, L, PP, BS, W in plans:
    consts = {"L": L, "PP": PP, "BS": BS, "san": 1, "sbn": 1, "scn": 1}
    sig = {a: "constexpr" if a in consts else f"*{dt}" if a.endswith("_ptr") else "i32" for a in kernel.arg_names}
    k = compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": W})
    assert k.asm.get("cubin"), (dt, L, PP, BS)
    assert "ld.local" not in k.asm["ptx"], ("local memory", dt, L, PP, BS)
print("compiled")
"""


def test_triton_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter skips Triton's compiler: compile the real pipeline (TTIR -> PTX -> cubin) for
    sm_90 here, with the specializations a GPU launch makes (ints equal to 1 become constexprs)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", TRITON_SM90], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, (r.stdout + r.stderr)[-3000:]


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
    a, b, c, re = make((2,), 4, key=("gct",), device=triton_device)
    inputs = tuple(x.requires_grad_() for x in (a, b, c))
    assert torch.autograd.gradcheck(lambda *t: resolvent_diagonal(*t, complex(re, 0.4), backend="triton"),
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
    """notes/seed-systems.md A: complex64 goes non-finite from N = 123 (the seed's own N = 128 fails)."""
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
    assert any("backend 'cuda' unavailable" in m for m in said), said
    assert any("backend 'triton' unavailable" in m for m in said), said
    assert available_backends("cpu")["cuda"] is not None and available_backends("cpu")["torch"] is None


def test_auto_falls_back_when_a_kernel_fails_at_launch(monkeypatch):
    """A backend that builds but fails on its first launch: warned, remembered, result still right."""
    monkeypatch.setitem(bk_core._AUTO_ORDER, "cpu", ("triton", "torch"))
    monkeypatch.setattr(bk_core, "_BROKEN", {})

    def check(name, device):     # triton "builds" here; only the launch fails
        if (name, device.type) in bk_core._BROKEN:
            raise Unavailable(bk_core._BROKEN[(name, device.type)])
    monkeypatch.setattr(bk_core, "_check_backend", check)
    real = bk_core._forward

    def failing(name, *args):
        if name == "triton":
            raise RuntimeError("simulated launch failure")
        return real(name, *args)
    monkeypatch.setattr(bk_core, "_forward", failing)
    a, b, c = _ok()
    with pytest.warns(RuntimeWarning) as rec:
        g = resolvent_diagonal(a, b, c, 1j)
    said = [str(w.message) for w in rec]
    assert len(said) == 1 and "backend 'triton' failed (RuntimeError: simulated launch failure)" in said[0], said
    assert rel_err(g, resolvent_diagonal_dense(a, b, c, 1j)) < 1e-12
    assert ("triton", "cpu") in bk_core._BROKEN


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


def _lock(folder: Path, age_s: float, owner: str | None):
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    lock.write_text("")
    t = time.time() - age_s
    os.utime(lock, (t, t))
    if owner is not None:
        (folder / hcuda._OWNER).write_text(owner)
    return lock


def test_stale_lock_handling(tmp_path):
    import socket
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    cases = [  # (age, owner, removed?)
        (10, None, False),                          # fresh, owner unknown: maybe a build right now
        (3600, None, True),                         # old, owner unknown: killed long ago
        (10, f"{dead.pid} {host}", True),           # owner process gone
        (3600, f"{os.getppid()} {host}", False),    # owner alive: a slow build, leave it
        (10, f"{os.getpid()} {host}", True),        # ourselves, not building: an interrupted build
    ]
    for i, (age, owner, removed) in enumerate(cases):
        lock = _lock(tmp_path / str(i), age, owner)
        if removed:
            with pytest.warns(RuntimeWarning, match="stale build lock"):
                assert hcuda.clear_stale_lock(lock.parent, max_age_s=300)
        else:
            assert not hcuda.clear_stale_lock(lock.parent, max_age_s=300)
        assert lock.exists() != removed, (age, owner)
    assert not hcuda.clear_stale_lock(tmp_path / "none")


# --- the .cu sources through plain nvcc ------------------------------------------------------------

CU_FILES = sorted((ROOT / "kernels").glob("*.cu"))


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_with_plain_nvcc(cu, tmp_path):
    r = subprocess.run([NVCC, "-arch=sm_90", "-c", str(cu), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr.lower(), r.stderr[-3000:]


@pytest.fixture(scope="module")
def bk_host_lib(tmp_path_factory):
    """kernels/bk_core.cu as a shared library: its host path runs the device code's block logic."""
    if NVCC is None:
        pytest.skip("nvcc not on PATH")
    so = tmp_path_factory.mktemp("bk") / "libbk_core.so"
    r = subprocess.run([NVCC, "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC,-O2", str(ROOT / "kernels" / "bk_core.cu"),
                        "-o", str(so)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    lib.bk_core_workspace_elems.restype = ctypes.c_longlong
    lib.bk_core_workspace_elems.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_int]
    lib.bk_core_tile_positions.argtypes = [ctypes.c_int, ctypes.c_int]
    for sfx in ("f32", "f64"):
        getattr(lib, f"bk_core_forward_host_{sfx}").argtypes = \
            [ctypes.c_void_p] * 5 + [ctypes.c_longlong] * 2 + [ctypes.c_double] * 2
        getattr(lib, f"bk_core_backward_host_{sfx}").argtypes = \
            [ctypes.c_void_p] * 8 + [ctypes.c_longlong] * 2 + [ctypes.c_double] * 2
    return lib


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


def test_kernel_only_timing_runs_the_launcher_and_refuses_auto():
    from hwlib.studies import bk_core as bk_study
    for d in ("forward", "forward+backward"):
        t = bk_study.time_backend("torch", 4, 16, "cpu", direction=d, iters=2, warmup=1, kernel_only=True)
        assert t.median_ms > 0 and t.n == 2
    with pytest.raises(ValueError, match="kernel_only"):
        bk_study.time_backend("auto", 4, 16, "cpu", iters=1, kernel_only=True)
    with pytest.raises(ValueError, match="direction"):
        bk_study.time_backend("torch", 4, 16, "cpu", direction="sideways", iters=1, kernel_only=True)
