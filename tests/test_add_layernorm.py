"""Residual add + LayerNorm fused: s, y and the gradients of x, r, weight and bias against float64 on
fresh random inputs of odd sizes, for the torch backend and the Triton kernels (compiled on CUDA where
a GPU is visible, else interpreted on CPU tensors: conftest.py sets TRITON_INTERPRET=1 before triton
is first imported); at least as accurate as the unfused bf16 path; the bad-input paths; the op under
torch.compile; GPT with the fused blocks against GPT without; the kernels through Triton's sm_90
compiler. HWLIB_TEST_SEED=<int> draws fresh inputs.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

from hwlib.device import ChoiceError
from hwlib.steps.s21_fused_layernorm import op as A


def make(m, d, dtype=torch.float64, r_dtype=None, device="cpu", key=()):
    seed = int(os.environ.get("HWLIB_TEST_SEED", "0")) + zlib.crc32(repr((m, d, str(dtype), *key)).encode())
    g = torch.Generator().manual_seed(seed)
    # a stream with an offset and a scale of its own per row, as a residual stream drifts
    x = torch.randn(m, d, generator=g, dtype=torch.float64) * 3 + torch.randn(m, 1, generator=g, dtype=torch.float64)
    r = torch.randn(m, d, generator=g, dtype=torch.float64)
    w = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    b = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    ds = torch.randn(m, d, generator=g, dtype=torch.float64)
    dy = torch.randn(m, d, generator=g, dtype=torch.float64)
    cast = lambda t, dt=dtype: t.to(device, dt)
    return cast(x), cast(r, r_dtype or dtype), cast(w), cast(b), cast(ds), cast(dy)


def run(x, r, w, b, ds, dy, fn, **kw):
    """(s, y, dx, dr, dw, db) through ``fn`` from fresh leaves, with incoming gradients ds for s and dy for y."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    s, y = fn(*leaves, **kw)
    torch.autograd.backward([s, y], [ds.to(s.dtype), dy.to(y.dtype)])
    return [s.detach(), y.detach()] + [t.grad for t in leaves]


def ref(x, r, w, b, ds, dy):
    return run(*(t.double().cpu() for t in (x, r, w, b, ds, dy)), fn=A.add_layer_norm_reference)


def rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


NAMES = ("s", "y", "dx", "dr", "dw", "db")


@pytest.mark.parametrize("m,d", [(37, 71), (5, 50), (130, 96), (1, 33)])
def test_torch_backend_matches_float64(m, d):
    got = run(*make(m, d, torch.float32), fn=A.add_layer_norm, backend="torch")
    want = ref(*make(m, d, torch.float32))
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == torch.float32 and rel(g, w) < 1e-5, (name, rel(g, w))


def test_torch_backend_keeps_float64_through_the_gain_and_bias_gradients():
    """fp64 inputs come back fp64, the op's partial sums of dw and db included: db (a plain sum of dy)
    to fp64 rounding; the rest within the op's float32 mean and rstd (saved for the backward)."""
    got = run(*make(37, 71), fn=A.add_layer_norm, backend="torch")
    want = ref(*make(37, 71))
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == torch.float64 and rel(g, w) < (1e-12 if name == "db" else 1e-7), (name, rel(g, w))


@pytest.mark.parametrize("m,d", [(37, 71), (9, 50), (130, 96)])
def test_triton_kernels_match_float64(m, d, triton_device):
    got = run(*make(m, d, torch.float32, device=triton_device), fn=A.add_layer_norm, backend="triton")
    want = ref(*make(m, d, torch.float32))
    for name, g, w in zip(NAMES, got, want):
        assert torch.isfinite(g).all() and rel(g, w) < 1e-5, (name, rel(g, w))


def _with_branch_bias(m, d, dtype, device="cpu"):
    """make()'s inputs and a branch bias c [D] drawn after them: (x, r, c, w, b, ds, dy)."""
    x, r, w, b, ds, dy = make(m, d, dtype, device=device, key=("r_bias",))
    g = torch.Generator().manual_seed(int(os.environ.get("HWLIB_TEST_SEED", "0")) + m * 1000 + d)
    return x, r, torch.randn(d, generator=g, dtype=torch.float64).to(device, dtype), w, b, ds, dy


def run_rb(x, r, c, w, b, ds, dy, fn, **kw):
    """run() with the branch bias c passed as r_bias: (s, y, dx, dr, dc, dw, db)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, c, w, b)]
    s, y = fn(leaves[0], leaves[1], leaves[3], leaves[4], 1e-5, r_bias=leaves[2], **kw)
    torch.autograd.backward([s, y], [ds.to(s.dtype), dy.to(y.dtype)])
    return [s.detach(), y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend,m,d", [("torch", 37, 71), ("torch", 1, 33), ("triton", 37, 71), ("triton", 130, 96),
                                         ("triton", 9, 50)])
def test_branch_bias_matches_float64(backend, m, d, triton_device):
    """s = x + (r + c) with the branch bias c, and its gradient (the column sums of the stream's
    gradient, a third partial sum in the backward kernel), against float64."""
    device = triton_device if backend == "triton" else "cpu"
    got = run_rb(*_with_branch_bias(m, d, torch.float32, device), fn=A.add_layer_norm, backend=backend)
    want = run_rb(*(t.double().cpu() for t in _with_branch_bias(m, d, torch.float32)),
                  fn=A.add_layer_norm_reference)
    for name, g, w in zip(("s", "y", "dx", "dr", "dc", "dw", "db"), got, want):
        assert torch.isfinite(g).all() and rel(g, w) < 1e-5, (name, rel(g, w))
    assert got[4].shape == (d,) and rel(got[4], want[2].sum(0)) < 1e-5   # dc is the column sum of dx


@pytest.mark.parametrize("backend,m,d", [("torch", 37, 71), ("triton", 37, 71), ("triton", 9, 48)])
def test_ones_column_after_y(backend, m, d, triton_device):
    """ones_column: y is BIAS_COLUMNS wider, a one then zeros after its D columns; the rest is the op
    without it, to fp32 rounding against float64, whatever gradient arrives for the extra columns."""
    device = triton_device if backend == "triton" else "cpu"
    x, r, w, b, ds, dy = make(m, d, torch.float32, device=device, key=("ones",))
    P = A.BIAS_COLUMNS
    dy_wide = torch.cat([dy, torch.randn(m, P, generator=torch.Generator().manual_seed(9)).to(dy)], dim=1)
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    s, y = A.add_layer_norm(*leaves, ones_column=True, backend=backend)
    assert y.shape == (m, d + P)
    col = torch.zeros(P); col[0] = 1
    assert torch.equal(y[:, d:].detach().cpu(), col.expand(m, P))
    torch.autograd.backward([s, y], [ds, dy_wide])
    got = [s.detach(), y[:, :d].detach()] + [t.grad for t in leaves]
    want = ref(x, r, w, b, ds, dy)
    for name, g, wt in zip(NAMES, got, want):
        assert rel(g, wt) < 1e-5, (name, rel(g, wt))
    with pytest.raises(ValueError, match="ones_column must be a bool"):
        A.add_layer_norm(x, r, w, b, ones_column=1)


@pytest.mark.parametrize("m,d", [(37, 71), (130, 96)])
def test_branch_bias_and_ones_column_together_in_the_kernels(m, d, triton_device):
    """Step 25's launch: the branch bias (HAS_RB) and the bias column (PAD) in one call, against float64."""
    x, r, c, w, b, ds, dy = _with_branch_bias(m, d, torch.float32, triton_device)
    P = A.BIAS_COLUMNS
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, c, w, b)]
    s, y = A.add_layer_norm(leaves[0], leaves[1], leaves[3], leaves[4], r_bias=leaves[2], ones_column=True,
                            backend="triton")
    assert y.shape == (m, d + P) and float(y[:, d].detach().min()) == 1.0 and float(y[:, d + 1:].detach().abs().max()) == 0.0
    torch.autograd.backward([s, y], [ds, torch.cat([dy, torch.ones(m, P).to(dy)], dim=1)])
    got = [s.detach(), y[:, :d].detach()] + [t.grad for t in leaves]
    want = run_rb(*(t.double().cpu() for t in (x, r, c, w, b, ds, dy)), fn=A.add_layer_norm_reference)
    for name, g, wt in zip(("s", "y", "dx", "dr", "dc", "dw", "db"), got, want):
        assert rel(g, wt) < 1e-5, (name, rel(g, wt))


def test_wide_rows_take_fewer_rows_per_program_and_stay_exact(triton_device):
    """Rows wider than GPT-2's: fewer rows per program, more warps (``launch_config``), the same results."""
    k = A._kernel()
    assert k.launch_config(768) == (4, 4) and k.launch_config(50) == (4, 4)
    assert k.launch_config(2048) == (2, 4) and k.launch_config(5000) == (1, 8) and k.launch_config(20000) == (1, 16)
    assert k.launch_config(768, k.BACKWARD_BLOCK_M) == (2, 4) and k.launch_config(2048, k.BACKWARD_BLOCK_M) == (2, 4)
    got = run(*make(3, 5000, torch.float32, device=triton_device), fn=A.add_layer_norm, backend="triton")
    want = ref(*make(3, 5000, torch.float32))
    for name, g, w in zip(NAMES, got, want):
        assert rel(g, w) < 1e-5, (name, rel(g, w))


def test_triton_kernels_with_a_half_precision_branch(triton_device):
    """The stream in fp32, the branch in fp16 (the interpreter has no bf16): the branch's gradient comes
    back in fp16, everything else in fp32, within fp16's rounding of float64."""
    x, r, w, b, ds, dy = make(65, 80, torch.float32, r_dtype=torch.float16, device=triton_device)
    got = run(x, r, w, b, ds, dy, fn=A.add_layer_norm, backend="triton")
    want = ref(x, r, w, b, ds, dy)
    assert [t.dtype for t in got] == [torch.float32] * 3 + [torch.float16] + [torch.float32] * 2
    for name, g, wt in zip(NAMES, got, want):
        assert rel(g, wt) < (2e-3 if name == "dr" else 1e-5), (name, rel(g, wt))


def test_kernels_write_every_element_and_the_backward_without_a_stream_gradient(triton_device):
    """Outputs poisoned with NaN first, every element is written; ds = None (s has no other use, as
    after ln_f) gives the LayerNorm's gradient alone; more programs than row blocks leave zero partials."""
    k = A._kernel()
    x, r, w, b, _, dy = make(23, 40, torch.float32, device=triton_device)
    s, y = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    mean, rstd = torch.full((23,), float("nan")).to(x), torch.full((23,), float("nan")).to(x)
    k.add_ln_fwd(x, r, w, b, 1e-5, s, y, mean, rstd)
    assert torch.isfinite(torch.cat([s.flatten(), y.flatten(), mean, rstd])).all()
    dx, dr = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    part = k.add_ln_bwd(dy, None, s, w, mean, rstd, dx, dr, programs=40, block_m=2)
    dw, db = part[:, 0], part[:, 1]
    s64 = (x.double() + r.double()).cpu().requires_grad_()
    w64, b64 = w.double().cpu().requires_grad_(), b.double().cpu().requires_grad_()
    F.layer_norm(s64, (40,), w64, b64).backward(dy.double().cpu())
    assert rel(dx, s64.grad) < 1e-5 and torch.equal(dx, dr)
    assert rel(dw.sum(0), w64.grad) < 1e-5 and rel(db.sum(0), b64.grad) < 1e-5
    assert dw.shape == (40, 40) and (dw[12:] == 0).all()    # 12 row blocks of 2: programs 12.. had no rows


def test_at_least_as_accurate_as_the_unfused_bf16_path():
    """Under bf16 autocast (torch backend on a CPU): y rounded once into bf16, the gradients in fp32
    (the branch's in bf16), each no further from float64 than the unfused add + F.layer_norm path."""
    x, r, w, b, ds, dy = make(129, 96, torch.float32, r_dtype=torch.bfloat16, key=("bf16",))
    want = ref(x, r, w, b, ds, dy)

    def unfused(x, r, w, b):
        s = x + r
        return s, F.layer_norm(s, (s.shape[-1],), w, b).to(torch.bfloat16)

    with torch.autocast("cpu", torch.bfloat16):
        ours = run(x, r, w, b, ds, dy, fn=A.add_layer_norm, backend="torch")
        theirs = run(x, r, w, b, ds, dy, fn=unfused)
    assert ours[1].dtype == torch.bfloat16 and ours[3].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    for name, o, t, wt in zip(NAMES, ours, theirs, want):
        assert rel(o, wt) <= 1.1 * rel(t, wt) + 1e-6, (name, rel(o, wt), rel(t, wt))


def test_under_torch_compile_the_op_is_one_node_and_matches_eager():
    """No graph break; both ops traced through their fake implementations into AOT autograd's joint graph,
    the same values as eager; and each op's fake outputs have the real ones' shapes, dtypes and strides
    (what inductor's compiled code would assert at run time)."""
    from fakes import hwlib_fakes_checked
    x, r, w, b, ds, dy = make(33, 48, torch.float32, key=("compile",))
    with hwlib_fakes_checked():
        eager = run(x, r, w, b, ds, dy, fn=A.add_layer_norm, backend="torch")
    # aot_eager, not inductor (tests/fakes.py says why)
    compiled = run(x, r, w, b, ds, dy, fn=torch.compile(A.add_layer_norm, fullgraph=True, backend="aot_eager"),
                   backend="torch")
    for name, c, e in zip(NAMES, compiled, eager):
        assert torch.allclose(c, e, rtol=1e-5, atol=1e-6), name


def test_bad_inputs_fail_with_the_argument_named():
    x, r, w, b, _, _ = make(4, 8, torch.float32)
    cases = [((x, r[:, :7], w, b), "r has shape"), ((x, r, w[:7], b), "weight must be [D] = [8]"),
             ((x, r, w, b[None]), "bias must be [D]"), ((x.bfloat16(), r, w, b), "x (torch.bfloat16) is the residual"),
             ((x, r.long(), w, b), "r must be floating point"), ((x, r, "w", b), "weight must be a torch.Tensor"),
             ((x[:, :0], r[:, :0], w[:0], b[:0]), "D >= 1")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            A.add_layer_norm(*args)
    for eps in (0, -1e-5, True, "1e-5"):
        with pytest.raises(ValueError, match="eps must be a positive number"):
            A.add_layer_norm(x, r, w, b, eps)
    with pytest.raises(ChoiceError):
        A.add_layer_norm(x, r, w, b, backend="cuda")
    with pytest.raises(ValueError, match=r"r_bias must be \[D\] = \[8\]"):
        A.add_layer_norm(x, r, w, b, r_bias=w[:5])
    with pytest.raises(ValueError, match="r_bias must be floating point"):
        A.add_layer_norm(x, r, w, b, r_bias=w.long())


def test_gpt_with_fused_blocks_computes_the_same_loss_and_gradients():
    """The smoke GPT built from one seed, unfused and fused (fp32, torch backend on a CPU): the same loss
    and the same gradient for every parameter, to fp32 rounding."""
    from conftest import gpt_with
    from hwlib.workloads import get_workload
    cfg = get_workload("gpt").config("smoke")
    idx = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for fused in (False, True):
        model = gpt_with(*(["21_fused_layernorm"] if fused else []), cfg=cfg)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        out[fused] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        with torch.no_grad():
            assert model(idx).shape == (2, 16, cfg.vocab)     # logits without targets, fused or not
    assert torch.allclose(out[True][0], out[False][0], rtol=1e-6)
    assert out[True][1].keys() == out[False][1].keys()
    for n, g in out[False][1].items():
        assert rel(out[True][1][n], g.double()) < 1e-4, n


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_gpt_with_branch_biases_in_the_layernorm_computes_the_same_loss_and_gradients(fused_mlp, gpt_grads_match):
    """The smoke GPT with fused blocks, each branch's output bias added in the fused LayerNorm or in its
    own linear (torch backends on a CPU): the same loss and gradients, the output projections' biases'
    included."""
    fused = ("21_fused_layernorm",) + (("22_gelu_epilogue",) if fused_mlp else ())
    grads = gpt_grads_match(fused, fused + ("23_branch_bias",), biases=("attn.c_proj", "mlp_proj"))
    moved = [n for n in grads if n.endswith(("attn.c_proj.bias", "mlp_proj.bias"))]
    assert moved and all(grads[n].abs().max() > 0 for n in moved)


def test_gpt_with_the_bias_column_computes_the_same_loss_and_gradients(gpt_grads_match):
    """The smoke GPT with fused blocks, branch biases and the fused MLP, mlp_fc's bias gradient from a column
    sum or from the bias column (torch backends on a CPU): the same loss and gradients."""
    from conftest import gpt_with
    from hwlib.steps import Precondition
    base = ("21_fused_layernorm", "22_gelu_epilogue", "23_branch_bias")
    gpt_grads_match(base, base + ("25_bias_column",), biases=("mlp_fc",), scale=0.3)
    with pytest.raises(Precondition, match="25_bias_column .* needs 22_gelu_epilogue's MLP"):
        gpt_with("21_fused_layernorm", "25_bias_column")
    with pytest.raises(Precondition, match="25_bias_column .* needs 21_fused_layernorm's trunk"):
        gpt_with("22_gelu_epilogue", "25_bias_column")


def test_gpt_refuses_branch_biases_without_fused_blocks():
    from conftest import gpt_with
    from hwlib.steps import Precondition
    with pytest.raises(Precondition, match="23_branch_bias .* needs 21_fused_layernorm's trunk; found Trunk"):
        gpt_with("23_branch_bias")


def test_gpt_refuses_fused_blocks_with_checkpointing():
    from conftest import gpt_with
    from hwlib.steps import Precondition
    with pytest.raises(Precondition, match="21_fused_layernorm cannot run checkpointed blocks"):
        gpt_with("21_fused_layernorm", checkpointing="all")


def test_traffic_is_the_kernel_files_count():
    t = A.traffic_bytes(16384, 768)
    assert t == {"forward": 16384 * (12 * 768 + 8.0), "backward": 16384 * (16 * 768 + 8.0)}
    # a bf16 stream: every stream term at 2 bytes, and dr (dx itself) not written
    assert A.traffic_bytes(16384, 768, stream_bytes=2) == {"forward": 16384 * (8 * 768 + 8.0),
                                                           "backward": 16384 * (8 * 768 + 8.0)}


# --- a 16-bit stream (step 27): the interpreter has no bf16, so the Triton kernels run it in fp16 ------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_half_precision_stream_matches_float64_and_hands_on_one_gradient(backend, triton_device):
    """The stream, the branch and the incoming gradients in one 16-bit dtype (bf16 for torch, fp16 for the
    interpreted kernels): s, y, dx and dr come back in it, within its rounding of float64, and dr is dx's
    memory (the kernel skips its write)."""
    dt = torch.bfloat16 if backend == "torch" else torch.float16
    dev = "cpu" if backend == "torch" else triton_device
    x, r, w, b, ds, dy = make(37, 71, torch.float32, device=dev, key=("stream",))
    x, r, ds, dy = (t.to(dt) for t in (x, r, ds, dy))
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    grads = {}
    leaves[0].register_hook(lambda g: grads.setdefault("x", g))
    leaves[1].register_hook(lambda g: grads.setdefault("r", g))
    s, y = A.add_layer_norm(*leaves, backend=backend)
    torch.autograd.backward([s, y], [ds, dy])
    got = [s.detach(), y.detach()] + [t.grad for t in leaves]
    assert [t.dtype for t in got] == [dt] * 4 + [torch.float32] * 2
    assert grads["x"].data_ptr() == grads["r"].data_ptr()     # one tensor's memory, no copy
    want = ref(x, r, w, b, ds, dy)
    unit = 2.0 ** -8 if dt == torch.bfloat16 else 2.0 ** -11
    for name, g, wt in zip(NAMES, got, want):
        assert rel(g, wt) < 4 * unit, (name, rel(g, wt), unit)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_half_precision_stream_is_normalised_as_rounded(backend, triton_device):
    """y (asked in fp32 from the op) is the LayerNorm of the stored, rounded s to fp32 precision, not of the
    unrounded x + r: the backward, which recomputes s_hat from the stored s, then differentiates what the
    forward computed. The unrounded sum's LayerNorm lies a 16-bit rounding away, which this would see."""
    dt = torch.bfloat16 if backend == "torch" else torch.float16
    dev = "cpu" if backend == "torch" else triton_device
    x, r, w, b, _, _ = make(29, 48, torch.float32, device=dev, key=("rounded",))
    x, r = x.to(dt), r.to(dt)
    s, y, _, _ = torch.ops.hwlib.add_layer_norm(x, r, None, w, b, 1e-5, torch.float32, 0, backend)
    assert s.dtype == dt and y.dtype == torch.float32
    as_rounded = F.layer_norm(s.double().cpu(), (48,), w.double().cpu(), b.double().cpu())
    unrounded = F.layer_norm((x.double() + r.double()).cpu(), (48,), w.double().cpu(), b.double().cpu())
    assert rel(y, as_rounded) < 1e-5
    assert rel(unrounded, as_rounded) > 30 * rel(y, as_rounded)


def test_gpt_with_a_bf16_stream_keeps_it_in_bf16_and_moves_the_loss_by_its_rounding(monkeypatch):
    """The smoke GPT under CPU bf16 autocast, fused blocks (torch backend): with step 27's bf16 stream every fused
    LayerNorm gets a bf16 stream (fp32 without), the loss stays within a few bf16 roundings of the fp32
    stream's, and every parameter's gradient is finite and close to the fp32 stream's."""
    from conftest import gpt_with
    from hwlib.steps.s21_fused_layernorm import apply as fused_trunk
    from hwlib.workloads import get_workload
    seen = []

    def spy(x, *a, **kw):
        seen.append(x.dtype)
        return A.add_layer_norm(x, *a, **kw)
    monkeypatch.setattr(fused_trunk, "add_layer_norm", spy)
    cfg = get_workload("gpt").config("smoke")
    idx = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    out = {}
    for bf16 in (False, True):
        model = gpt_with("21_fused_layernorm", *(["27_bf16_stream"] if bf16 else []), cfg=cfg)
        seen.clear()
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        assert len(seen) == 2 * cfg.n_layer and set(seen) == {torch.bfloat16 if bf16 else torch.float32}, seen
        out[bf16] = (loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()})
    assert abs(out[True][0] / out[False][0] - 1) < 1e-2
    for n, g in out[False][1].items():
        assert torch.isfinite(out[True][1][n]).all() and rel(out[True][1][n], g) < 0.1, (n, rel(out[True][1][n], g))


TRITON_SM90 = r"""
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hwlib.ops.sources import load_python_kernel
mod = load_python_kernel("21_add_layernorm_triton.py")
# as a GPU launch specializes GPT-2's blocks: pointers 16-byte aligned, M and D (768) divisible by 16
for k, dtypes, consts in (
        (mod._add_ln_fwd_kernel, {"r_ptr": "*bf16", "y_ptr": "*bf16"}, {"HAS_RB": False, "PAD": 0}),
        (mod._add_ln_fwd_kernel, {"r_ptr": "*bf16", "y_ptr": "*bf16"}, {"HAS_RB": True, "PAD": 0}),
        (mod._add_ln_fwd_kernel, {"r_ptr": "*bf16", "y_ptr": "*bf16"}, {"HAS_RB": True, "PAD": 16}),
        (mod._add_ln_bwd_kernel, {"dy_ptr": "*bf16", "dr_ptr": "*bf16"},
         {"HAS_DS": True, "HAS_RB": False, "WRITE_DR": True, "PAD": 0}),
        (mod._add_ln_bwd_kernel, {"dy_ptr": "*bf16", "dr_ptr": "*bf16"},
         {"HAS_DS": True, "HAS_RB": True, "WRITE_DR": True, "PAD": 0}),
        (mod._add_ln_bwd_kernel, {"dy_ptr": "*bf16", "dr_ptr": "*bf16"},
         {"HAS_DS": True, "HAS_RB": True, "WRITE_DR": True, "PAD": 16}),
        (mod._add_ln_bwd_kernel, {"dy_ptr": "*bf16", "dr_ptr": "*bf16"},
         {"HAS_DS": False, "HAS_RB": False, "WRITE_DR": True, "PAD": 0}),
        # step 27's bf16 stream: x, r, s, y in bf16; dy, ds, dx in bf16 and no dr written
        (mod._add_ln_fwd_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "s_ptr": "*bf16", "y_ptr": "*bf16"},
         {"HAS_RB": True, "PAD": 16}),
        (mod._add_ln_bwd_kernel, {"dy_ptr": "*bf16", "ds_ptr": "*bf16", "s_ptr": "*bf16", "dx_ptr": "*bf16",
                                  "dr_ptr": "*bf16"}, {"HAS_DS": True, "HAS_RB": True, "WRITE_DR": False, "PAD": 16})):
    consts = {**consts, "BLOCK_M": mod.DEFAULT_BLOCK_M if k is mod._add_ln_fwd_kernel else mod.BACKWARD_BLOCK_M,
              "BLOCK_D": 1024}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(k.arg_names)
             if a.endswith("_ptr") or a in ("M", "D")}
    sig = {a: "constexpr" if a in consts else dtypes.get(a, "*fp32") if a.endswith("_ptr") else
           ("fp32" if a == "eps" else "i32") for a in k.arg_names}
    c = compile(ASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": mod.DEFAULT_WARPS})
    ptx = c.asm["ptx"]
    assert c.asm.get("cubin") and "ld.local" not in ptx, (k.fn.__name__, "local memory")
    # the rows move in 16-byte vectors (fp32 x4, bf16 x8), not element by element
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, (k.fn.__name__, consts)
print("compiled")
"""


def test_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter skips Triton's compiler: compile the real pipeline (TTIR -> PTX -> cubin) for
    sm_90 at the default launch configuration with GPT-2's dtypes: no local memory, 16-byte accesses."""
    compile_for_sm90(TRITON_SM90)


# --- rows whose fp32 squares overflow: NaN, as the torch backend gives, never the bias --------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_whose_squares_overflow_are_nan_in_both_backends(backend, triton_device):
    """Rows 1 and 5 of an fp32 stream scaled past ~1.8e19: their squares overflow, the variance is inf and
    1/sqrt(inf) = 0 would make every y of the row the bias (finite, and wrong). Both backends give NaN for
    those rows of y and of the stream's gradient; the other rows match float64, and the bias's gradient
    (a sum of dy) stays exact. The Triton kernels run compiled on a GPU, interpreted on a CPU."""
    import warnings
    dev = "cpu" if backend == "torch" else triton_device
    m, d = 7, 37
    x, r, w, b, ds, dy = make(m, d, torch.float32, key=("overflow",))
    x[[1, 5]] *= 3e19
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the interpreter's numpy warns of the overflow
        s, y, dx, dr, dw, db = run(*(t.to(dev) for t in (x, r, w, b, ds, dy)), fn=A.add_layer_norm, backend=backend)
    bad, good = [1, 5], [0, 2, 3, 4, 6]
    assert torch.isnan(y[bad]).all() and torch.isnan(dx[bad]).all() and torch.isnan(dr[bad]).all()
    assert torch.isnan(dw).any()             # the gain's gradient sums dy * s_hat over every row
    want = ref(*(t[good] for t in (x, r)), w, b, *(t[good] for t in (ds, dy)))
    for name, g, wt in zip(("s", "y", "dx", "dr"), (s[good], y[good], dx[good], dr[good]), want[:4]):
        assert torch.isfinite(g).all() and rel(g, wt) < 1e-5, (name, rel(g, wt))
    assert rel(db, dy.double().sum(0)) < 1e-5


def test_the_studys_check_runs_the_interpreted_kernels_on_a_cpu_and_catches_a_wrong_one(triton_device, monkeypatch):
    """Notebooks 21, 23 and 27 check ``study.odd_size_rows``: on a CPU its rows hold the Triton kernels,
    interpreted at small odd sizes, beside the torch backend; a kernel that writes a wrong y fails them."""
    from hwlib.steps.s21_fused_layernorm import study
    if triton_device != "cpu":
        pytest.skip("on a GPU the study's auto backend is the compiled kernels themselves")
    for kw in ({}, {"branch_bias": True, "stream": torch.bfloat16}):
        rows = study.odd_size_rows("cpu", sizes=((5, 33),), **kw)
        interp = [r for r in rows if r["backend"] == "triton (interpreted)"]
        assert [(r["M"], r["D"]) for r in interp] == list(study.INTERPRETED_SIZES)
        assert all(r["within tolerance"] for r in rows), rows
    k = A._kernel()
    fwd = k.add_ln_fwd

    def off_by_a_little(x, r, w, b, eps, s, y, *rest, **kw):
        fwd(x, r, w, b, eps, s, y, *rest, **kw)
        y.add_(1e-3)
    monkeypatch.setattr(k, "add_ln_fwd", off_by_a_little)
    rows = study.odd_size_rows("cpu", sizes=((5, 33),))
    assert [r["within tolerance"] for r in rows] == [True] + [False] * len(study.INTERPRETED_SIZES)
