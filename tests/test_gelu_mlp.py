"""The MLP with its GELU in the matmuls' epilogues (hwlib.steps.s22_gelu_epilogue.op): forward and every gradient
against the float64 reference on fresh random inputs of odd sizes, on each backend that runs here;
bad input; torch.compile; GPT's blocks with the op against the unfused blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hwlib.blas import LT_WORKSPACE_BYTES
from hwlib.device import ChoiceError, Unavailable
from hwlib.ops import fallbacks
from hwlib.steps.s22_gelu_epilogue import op as gm

GPU = torch.cuda.is_available()


def _inputs(M, K, N, C, *, dtype=torch.float32, device="cpu", seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g)
    w_fc = torch.randn(N, K, generator=g) / K ** 0.5
    b_fc = torch.randn(N, generator=g) * 0.1
    w_proj = torch.randn(C, N, generator=g) / N ** 0.5
    b_proj = torch.randn(C, generator=g) * 0.1
    dy = torch.randn(*lead, M, C, generator=g)
    ts = [t.to(device=device, dtype=dtype) for t in (x, w_fc, b_fc, w_proj, b_proj)]
    return [t.requires_grad_() for t in ts], dy.to(device=device, dtype=dtype)


def _grads(fn, leaves, dy):
    y = fn(*leaves)
    return [y, *torch.autograd.grad(y, leaves, dy)]


def _reference(leaves, dy):
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    return _grads(gm.gelu_mlp_reference, l64, dy.double())


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("M,K,N,C,lead", [(37, 24, 40, 16, ()), (5, 8, 8, 8, (3,)), (1, 3, 5, 7, ()),
                                          (129, 64, 256, 64, (2,))])
def test_torch_backend_matches_float64(M, K, N, C, lead):
    leaves, dy = _inputs(M, K, N, C, seed=M + N, lead=lead)
    got = _grads(lambda *a: gm.gelu_mlp(*a, backend="torch"), leaves, dy)
    ref = _reference(leaves, dy)
    for name, a, b in zip(("y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj"), got, ref):
        assert a.shape == b.shape, name
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))


@pytest.mark.parametrize("backend", ["torch", pytest.param("cublaslt", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (cuBLASLt)"))])
def test_without_the_output_bias(backend):
    """b_proj None (a block that adds the bias after the op): the MLP without it, against float64, and
    no gradient for it; the other gradients as with it."""
    dev, dt = ("cuda", torch.bfloat16) if backend == "cublaslt" else ("cpu", torch.float32)
    leaves, dy = _inputs(67, 16, 64, 24, seed=17, device=dev, dtype=dt)
    four = leaves[:4]
    y = gm.gelu_mlp(*four, None, backend=backend)
    got = [y, *torch.autograd.grad(y, four, dy)]
    l64 = [t.detach().double().requires_grad_() for t in four]
    y64 = gm.gelu_mlp_reference(*l64, None)
    ref = [y64, *torch.autograd.grad(y64, l64, dy.double())]
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    for name, a, b in zip(("y", "dx", "dw_fc", "db_fc", "dw_proj"), got, ref):
        assert a.shape == b.shape and _rel(a, b) < tol, (name, _rel(a, b))


@pytest.mark.parametrize("backend", ["torch", pytest.param("cublaslt", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (cuBLASLt)"))])
def test_with_the_bias_column(backend):
    """bias_column: x carries a column of ones and zeros after its K columns (as add_layer_norm's
    ones_column writes it); the output, dW_fc and db_fc (now a column of one matmul) against float64,
    and x's gradient as wide as x, zero in the extra columns."""
    from hwlib.steps.s21_fused_layernorm.op import BIAS_COLUMNS as P, with_bias_column
    dev, dt = ("cuda", torch.bfloat16) if backend == "cublaslt" else ("cpu", torch.float32)
    leaves, dy = _inputs(67, 16, 64, 24, seed=19, device=dev, dtype=dt)
    x = leaves[0].detach()
    x_wide = with_bias_column(x).requires_grad_()
    y = gm.gelu_mlp(x_wide, *leaves[1:], bias_column=True, backend=backend)
    got = [y, *torch.autograd.grad(y, [x_wide, *leaves[1:]], dy)]
    assert got[1].shape == (67, 16 + P) and float(got[1][:, 16:].abs().max()) == 0.0
    got[1] = got[1][:, :16]
    ref = _reference(leaves, dy)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    for name, a, b in zip(("y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj"), got, ref):
        assert a.shape == b.shape and _rel(a, b) < tol, (name, _rel(a, b))
    with pytest.raises(ValueError, match=r"x's last dimension \(\(67, 16\)\) must equal w_fc's in_features plus the "
                                         r"bias column \(16 \+ 16\)"):
        gm.gelu_mlp(x, *leaves[1:], bias_column=True)
    with pytest.raises(ValueError, match="bias_column must be a bool"):
        gm.gelu_mlp(x, *leaves[1:], bias_column="yes")
    with pytest.raises(ValueError, match="w_fc must be a torch.Tensor"):
        gm.gelu_mlp(x_wide, "w", *leaves[2:], bias_column=True)


def test_non_contiguous_and_empty_inputs():
    leaves, dy = _inputs(12, 16, 32, 8, seed=3)
    x_t = leaves[0].detach().t().contiguous().t().requires_grad_()   # same values, transposed strides
    assert not x_t.is_contiguous()
    dy_t = dy.t().contiguous().t()
    got = _grads(lambda *a: gm.gelu_mlp(*a, backend="torch"), [x_t, *leaves[1:]], dy_t)
    ref = _reference([x_t, *leaves[1:]], dy)
    assert all(_rel(a, b) < 1e-5 for a, b in zip(got, ref))
    x0 = torch.zeros(0, 16, requires_grad=True)
    empty = gm.gelu_mlp(x0, *leaves[1:])
    assert empty.shape == (0, 8)
    grads = torch.autograd.grad(empty.sum(), [x0, *leaves[1:]])
    assert grads[0].shape == (0, 16) and all(float(g.abs().sum()) == 0.0 for g in grads[1:])


def test_autocast_runs_in_its_dtype_like_the_unfused_path():
    leaves, dy = _inputs(33, 16, 64, 16, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gm.gelu_mlp(*leaves)
        unfused = F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2]), approximate="tanh"), leaves[3], leaves[4])
    assert y.dtype == unfused.dtype == torch.bfloat16
    assert _rel(y, unfused.double()) < 2e-2
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    assert [g.dtype for g in grads] == [torch.float32] * 5      # the fp32 leaves get fp32 gradients


def test_bad_input_names_the_argument():
    (x, w_fc, b_fc, w_proj, b_proj), _ = _inputs(4, 8, 16, 8)
    with pytest.raises(ValueError, match="x's last dimension"):
        gm.gelu_mlp(x[:, :5], w_fc, b_fc, w_proj, b_proj)
    with pytest.raises(ValueError, match="w_proj must be"):
        gm.gelu_mlp(x, w_fc, b_fc, w_proj[:, :3], b_proj)
    with pytest.raises(ValueError, match="b_fc must be"):
        gm.gelu_mlp(x, w_fc, b_fc[:3], w_proj, b_proj)
    with pytest.raises(ValueError, match="b_proj must be"):
        gm.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj[:3])
    with pytest.raises(ValueError, match="w_fc must be floating point"):
        gm.gelu_mlp(x, w_fc.long(), b_fc, w_proj, b_proj)
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        gm.gelu_mlp([1.0], w_fc, b_fc, w_proj, b_proj)
    with pytest.raises(ChoiceError, match="backend"):
        gm.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, backend="cutlass")
    with pytest.raises(Unavailable, match="CUDA tensors only"):
        gm.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, backend="cublaslt")
    with pytest.raises(ValueError, match="one device"):
        gm.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj.to("meta"))
    with pytest.raises(ValueError, match="w_fc must be 2-d"):
        gm.gelu_mlp(x, w_fc[0], b_fc, w_proj, b_proj)
    with pytest.raises(ValueError, match="w_proj must be 2-d"):
        gm.gelu_mlp(x, w_fc, b_fc, w_proj[None], b_proj)
    with pytest.raises(ValueError, match="b_proj must be floating point"):
        gm.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj.long())
    with pytest.raises(ValueError, match="x's last dimension"):
        gm.gelu_mlp(torch.tensor(1.0), w_fc, b_fc, w_proj, b_proj)


def test_what_the_cublaslt_backend_takes():
    assert gm.fit_problem(torch.bfloat16, 768, 3072, 768) is None
    assert "bf16" in gm.fit_problem(torch.float32, 768, 3072, 768)
    assert "hidden" in gm.fit_problem(torch.bfloat16, 768, 3070, 768)
    assert "in_features" in gm.fit_problem(torch.bfloat16, 12, 3072, 768)
    assert "out_features" in gm.fit_problem(torch.bfloat16, 768, 3072, 0)
    t = torch.zeros(9, dtype=torch.bfloat16)
    assert gm.aligned(t) and not gm.aligned(t[1:])
    assert gm.no_worse_than_unfused(0.004, 0.003) and not gm.no_worse_than_unfused(0.02, 0.003)
    assert gm.select_backend("auto", "cpu") == "torch"
    assert gm.select_backend("torch", "cpu") == "torch"


def test_auto_says_why_it_falls_back_from_cublaslt(monkeypatch):
    """On CUDA tensors, a machine where the epilogues cannot run gets a warning naming the reason; a
    call whose sizes they do not take falls back quietly."""
    import warnings
    monkeypatch.setattr(gm, "_cublaslt_problem", lambda device_type: "building kernels/22_gelu_epilogue.cpp failed")
    with pytest.warns(RuntimeWarning, match=r"fell back from 'cublaslt' to 'torch'.*22_gelu_epilogue.cpp failed"):
        assert gm.select_backend("auto", "cuda") == "torch"
    monkeypatch.setattr(gm, "_cublaslt_problem", lambda device_type: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gm.select_backend("auto", "cuda", torch.float32, (768, 3072, 768)) == "torch"
        assert gm.select_backend("auto", "cuda", torch.bfloat16, (768, 3072, 768)) == "cublaslt"


def test_both_ops_are_declared_to_inductor():
    names = {str(op) for op in fallbacks.registered()}
    assert {"hwlib.gelu_mlp.default", "hwlib.gelu_mlp_backward.default"} <= names


def test_compiled_equals_eager():
    """One graph under torch.compile (no graph break), both ops traced through their fake implementations
    into AOT autograd's joint graph, the same values as eager; and each op's fake outputs have the real
    ones' shapes, dtypes and strides (what inductor's compiled code would assert at run time)."""
    from fakes import hwlib_fakes_checked
    leaves, dy = _inputs(21, 16, 32, 8, seed=7)
    # aot_eager, not inductor (tests/fakes.py says why)
    fn = torch.compile(lambda *a: gm.gelu_mlp(*a), fullgraph=True, backend="aot_eager")
    got = _grads(fn, leaves, dy)
    with hwlib_fakes_checked():
        want = _grads(lambda *a: gm.gelu_mlp(*a, backend="torch"), leaves, dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gpt_blocks_with_the_op_compute_the_unfused_model():
    from conftest import gpt_with
    from hwlib.steps.s22_gelu_epilogue.apply import GeluEpilogueMLP
    from hwlib.workloads.gpt import PROFILES
    cfg = PROFILES["smoke"]
    idx = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for fused in (False, True):
        m = gpt_with(*(["22_gelu_epilogue"] if fused else []), cfg=cfg, attention="manual")
        loss = m(idx, idx)
        losses.append(loss.item())
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        assert all(isinstance(b.mlp, GeluEpilogueMLP) is fused for b in m.blocks)
    assert abs(losses[0] - losses[1]) < 1e-5 * abs(losses[0])
    assert _rel(grads[1], grads[0].double()) < 1e-4


def test_fp8_and_the_epilogue_are_one_or_the_other():
    from conftest import gpt_with
    from hwlib.steps import Precondition
    with pytest.raises(Precondition, match=r"22_gelu_epilogue .*\(not after 18_fp8\)"):
        gpt_with("18_fp8", "22_gelu_epilogue")
    with pytest.raises(Precondition, match="18_fp8 .* needs the plain MLP"):
        gpt_with("22_gelu_epilogue", "18_fp8")
    with pytest.raises(Precondition, match="18_fp8 cannot follow 23_branch_bias"):   # the unbiased branch would go around FP8
        gpt_with("21_fused_layernorm", "23_branch_bias", "18_fp8")


# --- on a GPU: the cuBLASLt epilogues ----------------------------------------------------------------

@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLASLt)")
@pytest.mark.parametrize("M,K,N,C", [(1031, 64, 256, 64), (7, 8, 8, 8), (4096 + 3, 768, 3072, 768)])
def test_cublaslt_at_least_as_accurate_as_the_unfused_bf16_path(M, K, N, C):
    """Both paths get the same bf16 operands; each is held against float64 of those operands. The
    epilogue rounds fewer times than the unfused path, so its error must not exceed the unfused one's
    by more than the spread of bf16 rounding itself."""
    leaves, dy = _inputs(M, K, N, C, dtype=torch.bfloat16, device="cuda", seed=M)
    ref = _reference(leaves, dy)
    fused = _grads(lambda *a: gm.gelu_mlp(*a, backend="cublaslt"), leaves, dy)
    unfused = _grads(lambda *a: gm.gelu_mlp(*a, backend="torch"), leaves, dy)
    for name, f, u, r in zip(("y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj"), fused, unfused, ref):
        ef, eu = _rel(f, r), _rel(u, r)
        assert gm.no_worse_than_unfused(ef, eu), (name, ef, eu)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLASLt)")
def test_cublaslt_under_autocast_with_fp32_parameters_as_in_training():
    """GPT's setting: fp32 parameters, bf16 autocast, a non-contiguous incoming gradient."""
    leaves, dy = _inputs(333, 64, 256, 64, device="cuda", seed=13)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = gm.gelu_mlp(*leaves, backend="cublaslt")
        want = gm.gelu_mlp(*leaves, backend="torch")
    assert y.dtype == torch.bfloat16
    dy_t = dy.to(y.dtype).t().contiguous().t()
    got = torch.autograd.grad(y, leaves, dy_t)
    ref = _reference(leaves, dy)
    unf = torch.autograd.grad(want, leaves, dy_t)
    assert [g.dtype for g in got] == [torch.float32] * 5
    for name, f, u, r in zip(("dx", "dw_fc", "db_fc", "dw_proj", "db_proj"), got, unf, ref[1:]):
        assert gm.no_worse_than_unfused(_rel(f, r), _rel(u, r)), name


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLASLt)")
def test_cublaslt_under_cuda_graphs_equals_eager():
    leaves, dy = _inputs(512, 64, 256, 64, dtype=torch.bfloat16, device="cuda", seed=11)
    eager = _grads(lambda *a: gm.gelu_mlp(*a, backend="cublaslt"), leaves, dy)
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: gm.gelu_mlp(*a, backend="cublaslt"), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):   # warm-up, record, replay
        got = _grads(fn, leaves, dy)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLASLt)")
def test_no_rows_take_the_torch_path_each_way():
    leaves, _ = _inputs(0, 64, 256, 64, dtype=torch.bfloat16, device="cuda")
    y = gm.gelu_mlp(*leaves, backend="cublaslt")
    assert y.shape == (0, 64)
    grads = torch.autograd.grad(y.sum(), leaves)
    assert grads[0].shape == (0, 64) and all(float(g.abs().sum()) == 0.0 for g in grads[1:])


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLASLt)")
def test_a_misaligned_operand_takes_the_torch_path():
    leaves, dy = _inputs(64, 64, 256, 64, dtype=torch.bfloat16, device="cuda", seed=17)
    x = leaves[0].detach()
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    x_off = buf[1:].view_as(x)
    x_off.copy_(x)
    assert x_off.is_contiguous() and not gm.aligned(x_off)
    args = [t.detach() for t in leaves[1:]]
    got = torch.ops.hwlib.gelu_mlp(x_off, *args, "cublaslt")[0]
    assert torch.equal(got, torch.ops.hwlib.gelu_mlp(x_off, *args, "torch")[0])
    pre = torch.ops.hwlib.gelu_mlp(x, *args, "torch")[2]
    dy_off = torch.empty(dy.numel() + 1, dtype=dy.dtype, device="cuda")[1:].view_as(dy).copy_(dy)
    assert not gm.aligned(dy_off)
    got = torch.ops.hwlib.gelu_mlp_backward(dy_off, args[2], pre, "cublaslt")
    assert torch.equal(got, torch.ops.hwlib.gelu_mlp_backward(dy_off, args[2], pre, "torch"))


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLASLt)")
def test_cublaslt_refuses_widths_it_cannot_take():
    leaves, _ = _inputs(16, 8, 12, 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiples of 8"):
        gm.gelu_mlp(*leaves, backend="cublaslt")
    assert gm.gelu_mlp(*leaves).shape == (16, 8)   # auto: the torch path


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLASLt)")
@pytest.mark.parametrize("ws_bytes", [LT_WORKSPACE_BYTES, 0])
def test_the_epilogues_compute_the_tanh_gelu_and_its_derivative(ws_bytes):
    """Exact operands (one nonzero product per output, so the fp32 accumulator holds pre exactly) over
    pre in [-4, 4]: the epilogues' GELU and GELU' must be the tanh form's, rounded once to bf16 (within
    two units in the last place), and must not be the erf form's, which differs by more at many of these
    points (the accuracy bound elsewhere cannot tell the two apart)."""
    M, n = 1024, 8
    v = torch.linspace(-4, 4, M, dtype=torch.float64).to(torch.bfloat16)
    x = torch.zeros(M, n, dtype=torch.bfloat16)
    x[:, 0] = v
    w = torch.zeros(n, n, dtype=torch.bfloat16)
    w[:, 0] = 1                                      # every output column: pre = v
    m = gm.module()
    a, pre = m.gelu_forward(x.cuda(), w.cuda(), torch.zeros(n, dtype=torch.bfloat16, device="cuda"), ws_bytes)
    assert torch.equal(pre[:, 0].cpu(), v)
    dpre = m.gelu_backward(torch.ones(M, n, dtype=torch.bfloat16, device="cuda"),
                           torch.eye(n, dtype=torch.bfloat16, device="cuda"), pre, ws_bytes)   # dy W = 1: dpre = gelu'(pre)
    v64 = v.double().requires_grad_()
    for got, form in ((a, "value"), (dpre, "derivative")):
        got = got[:, 0].double().cpu()
        want = {}
        for approx in ("tanh", "none"):
            y = F.gelu(v64, approximate=approx)
            t = y if form == "value" else torch.autograd.grad(y.sum(), v64)[0]
            want[approx] = t.detach().to(torch.bfloat16).double()
        ulp = want["tanh"].abs().clamp(min=2.0 ** -126) * 2.0 ** -7
        off = ((got - want["tanh"]).abs() / ulp).max().item()
        assert off <= 2, (form, off)   # the epilogue's fp32 tanh rounds apart from float64's by a unit or so
        # the erf form's bf16 values lie more than 4 units from the tanh form's at 13-18% of these points
        assert ((got - want["none"]).abs() > 4 * ulp).float().mean() > 0.1, form


def test_step_25s_check_runs_the_interpreted_layernorm_on_a_cpu_and_catches_a_wrong_column(triton_device, monkeypatch):
    """Notebook 25 checks ``s25_bias_column.study.odd_size_rows``: on a CPU its rows hold the
    LayerNorm's Triton kernels, interpreted, writing the bias column the MLP reads, beside the torch
    backend; a forward kernel that writes 0.999 for the column's ones fails them (db_fc)."""
    from hwlib.steps.s21_fused_layernorm import op as A
    from hwlib.steps.s25_bias_column import study
    if triton_device != "cpu":
        pytest.skip("on a GPU the study runs the step's own kernels, compiled")
    small = ((5, 8, 8, 8),)
    rows = study.odd_size_rows("cpu", sizes=small)
    assert [r["backend"] for r in rows] == ["torch"] + ["triton LayerNorm (interpreted), torch MLP"] * len(
        study.INTERPRETED_SIZES)
    assert [(r["rows"], r["K"], r["N"], r["C"]) for r in rows[1:]] == list(study.INTERPRETED_SIZES)
    assert all(r["within tolerance"] for r in rows), rows
    k = A._kernel()
    fwd = k.add_ln_fwd

    def ones_a_little_small(x, r, w, b, eps, s, y, *rest, **kw):
        fwd(x, r, w, b, eps, s, y, *rest, **kw)
        if y.shape[1] > x.shape[1]:
            y[:, x.shape[1]] = 0.999
    monkeypatch.setattr(k, "add_ln_fwd", ones_a_little_small)
    rows = study.odd_size_rows("cpu", sizes=small)
    assert [r["within tolerance"] for r in rows] == [True, False], rows
    assert rows[1]["db_fc rel err"] > study.FP32_TOL and rows[1]["y rel err"] < study.FP32_TOL
