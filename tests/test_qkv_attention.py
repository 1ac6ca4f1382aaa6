"""The QKV projection + causal attention op (hwlib.steps.s24_qkv_grad.op): the heads' output and the
gradients of x, the weight and the bias against float64 on fresh random inputs of odd sizes, for both
packing backends (the Triton kernel compiled on CUDA where a GPU is visible, else interpreted on CPU
tensors); the packing kernel alone on strided inputs; under torch.compile; GPT with the op against
GPT without; the bad-input paths; on a GPU, under bf16 autocast no worse than the unfused path.
HWLIB_TEST_SEED=<int> draws fresh inputs.
"""

from __future__ import annotations

import os
import re
import zlib

import pytest
import torch
import torch.nn.functional as F

from hwlib.device import ChoiceError
from hwlib.steps.s24_qkv_grad import op as Q

GPU = torch.cuda.is_available()


def make(B, T, C, dtype=torch.float32, device="cpu"):
    seed = int(os.environ.get("HWLIB_TEST_SEED", "0")) + zlib.crc32(repr((B, T, C, str(dtype))).encode())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(3 * C, C, generator=g, dtype=torch.float64) / C ** 0.5
    b = 0.3 * torch.randn(3 * C, generator=g, dtype=torch.float64)
    dy = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    return [t.to(device, dtype) for t in (x, w, b)], dy.to(device, dtype)


def grads(fn, leaves, dy, n_head, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves, n_head, **kw)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype))]


def reference(leaves, dy, n_head):
    return grads(Q.qkv_attention_reference, [t.double().cpu() for t in leaves], dy.double().cpu(), n_head)


def rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


NAMES = ("y", "dx", "dw", "db")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B,T,C,H", [(2, 9, 24, 3), (1, 17, 64, 4), (3, 5, 16, 1), (2, 70, 40, 5)])
def test_matches_float64(backend, B, T, C, H, request):
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    if device == "cuda":
        pytest.skip("cuDNN's attention takes 16-bit operands: on a GPU the Triton packing is checked under bf16 "
                    "autocast (test_under_bf16_autocast_no_worse_than_the_unfused_path)")
    leaves, dy = make(B, T, C, device=device)
    got = grads(Q.qkv_attention, leaves, dy, H, backend=backend)
    want = reference(leaves, dy, H)
    for name, g, w in zip(NAMES, got, want):
        assert g.shape == w.shape and torch.isfinite(g).all() and rel(g, w) < 1e-5, (name, rel(g, w))


def test_the_packing_kernel_alone_on_strided_gradients(triton_device):
    """dq, dk, dv with strides of their own (one [B, T, H, D] storage transposed, one contiguous, one a
    slice of a wider tensor), every element of the output written (NaN first), partial sums that add
    up to the column sums, rows past a block's end masked (N = 70 is no multiple of the block)."""
    k = Q._kernel()
    B, H, T, D = 2, 5, 35, 8
    g = torch.Generator().manual_seed(1)
    dq = torch.randn(B, T, H, D, generator=g).transpose(1, 2).to(triton_device)
    dk = torch.randn(B, H, T, D, generator=g).to(triton_device)
    dv = torch.randn(B, H, T, 2 * D, generator=g).to(triton_device)[..., :D]
    out = torch.full((B * T, 3 * H * D), float("nan"), device=triton_device)
    part = k.pack_qkv_grad(dq, dk, dv, out)
    want = torch.cat([t.transpose(1, 2).reshape(B * T, H * D) for t in (dq, dk, dv)], dim=1)
    assert torch.equal(out, want)
    assert part.shape == (k.row_blocks(B * T), 3 * H * D) and part.dtype == torch.float32
    assert torch.allclose(part.sum(0), want.sum(0), rtol=1e-5, atol=1e-5)


def test_under_torch_compile_matches_eager_in_one_graph():
    """No graph break; both ops traced through their fake implementations into AOT autograd's joint graph,
    the same values as eager; and each op's fake outputs have the real ones' shapes, dtypes and strides
    (what inductor's compiled code would assert at run time)."""
    from fakes import hwlib_fakes_checked
    leaves, dy = make(2, 9, 24)
    with hwlib_fakes_checked():
        eager = grads(Q.qkv_attention, leaves, dy, 3, backend="torch")
    # aot_eager, not inductor (tests/fakes.py says why)
    compiled = grads(torch.compile(Q.qkv_attention, fullgraph=True, backend="aot_eager"), leaves, dy, 3,
                     backend="torch")   # fullgraph: no graph break
    for name, c, e in zip(NAMES, compiled, eager):
        assert torch.allclose(c, e, rtol=1e-5, atol=1e-6), name


def test_gpt_with_the_op_computes_the_same_loss_and_gradients(gpt_grads_match):
    """The smoke GPT built from one seed, with and without the op (fp32, on a CPU): the same loss and the
    same gradient for every parameter, the QKV bias's included (drawn nonzero), to fp32 rounding."""
    gpt_grads_match((), ("24_qkv_grad",), biases=("attn.c_attn",), scale=0.3)


def test_gpt_refuses_the_op_without_fused_attention():
    from conftest import gpt_with
    from hwlib.steps import Precondition
    with pytest.raises(Precondition, match="24_qkv_grad runs fused attention: it needs .* attention='sdpa'"):
        gpt_with("24_qkv_grad", attention="manual")


def test_bad_inputs_fail_with_the_argument_named():
    (x, w, b), _ = make(2, 4, 8)
    cases = [((x[0], w, b, 2), "x must be [B, T, C]"), ((x[:, :0], w, b, 2), "at least one sequence and one token"), ((x, w[:, :7], b, 2), "weight must be [3C, C] = [24, 8]"),
             ((x, w, b[:5], 2), "bias must be [3C] = [24]"), ((x, w, b, 3), "n_head must be a positive integer"),
             ((x, w, b, 0), "n_head must be"), ((x, w.long(), b, 2), "weight must be floating point"),
             ((x, "w", b, 2), "weight must be a torch.Tensor")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            Q.qkv_attention(*args)
    with pytest.raises(ChoiceError):
        Q.qkv_attention(x, w, b, 2, backend="cuda")


def test_traffic_is_the_kernel_files_count():
    t = Q.traffic_bytes(16384, 768)
    assert t == {"fused": 2 * 16384 * 3 * 768 * 2.0, "unfused": 3 * 16384 * 3 * 768 * 2.0}


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuDNN attention)")
def test_under_bf16_autocast_no_worse_than_the_unfused_path():
    """GPT's setting on a GPU: fp32 parameters, bf16 autocast, T and C of GPT-2's kind but small; the
    op against the unfused projection + SDPA (which dispatches to the same cuDNN kernel), each against
    float64: no more than 1.5 times the unfused error plus bf16's rounding."""
    leaves, dy = make(4, 128, 192, device="cuda")
    want = reference(leaves, dy, 3)

    def unfused(x, w, b, n_head):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in F.linear(x, w, b).split(C, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = grads(Q.qkv_attention, leaves, dy, 3)
        theirs = grads(unfused, leaves, dy, 3)
    assert ours[0].dtype == torch.bfloat16 and [g.dtype for g in ours[1:]] == [torch.float32] * 3
    for name, o, t, w in zip(NAMES, ours, theirs, want):
        assert rel(o, w) <= 1.5 * rel(t, w) + 4e-3, (name, rel(o, w), rel(t, w))


def test_what_cudnn_takes_is_said_before_a_call():
    """fp32 operands or odd head widths on CUDA: a ValueError naming them (cuDNN's kernels would return
    garbage for fp32, not an error); a CPU takes any."""
    assert Q.fit_problem("cuda", torch.float32, 64).startswith("cuDNN's fused attention takes bf16 or fp16")
    assert "multiples of 8 up to 128, got 12" in Q.fit_problem("cuda", torch.bfloat16, 12)
    assert "got 256" in Q.fit_problem("cuda", torch.float16, 256)
    assert Q.fit_problem("cuda", torch.bfloat16, 64) is None and Q.fit_problem("cpu", torch.float32, 12) is None


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuDNN attention)")
def test_fp32_on_a_gpu_is_refused_and_gpt_takes_the_unfused_path():
    (x, w, b), _ = make(2, 16, 64, device="cuda")
    with pytest.raises(ValueError, match="takes bf16 or fp16 operands, got torch.float32"):
        Q.qkv_attention(x, w, b, 2)
    from conftest import gpt_with
    from hwlib.workloads import get_workload
    cfg = get_workload("gpt").config("smoke")
    idx = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(4)).cuda()
    losses = [gpt_with(*(["24_qkv_grad"] if f else []), cfg=cfg).cuda()(idx[:, :-1], idx[:, 1:]) for f in (0, 1)]
    assert torch.isfinite(losses[1]) and torch.allclose(losses[0], losses[1])


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuDNN attention)")
def test_under_cuda_graphs_equals_eager():
    leaves, dy = make(2, 64, 128, dtype=torch.bfloat16, device="cuda")
    eager = grads(Q.qkv_attention, leaves, dy, 2)
    torch._dynamo.reset()
    fn = torch.compile(Q.qkv_attention, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):   # warm-up, record, replay
        got = grads(fn, leaves, dy, 2)
    for name, a, b in zip(NAMES, got, eager):
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2), name


def test_the_studys_check_runs_the_interpreted_kernel_on_a_cpu_and_catches_a_wrong_one(triton_device, monkeypatch):
    """Notebook 24 checks ``study.odd_size_rows``: on a CPU its rows hold the packing kernel, interpreted
    at a small odd size (a partial second block of rows), beside the torch backend; a kernel that loses
    the partial block's bias sums fails them."""
    from hwlib.steps.s24_qkv_grad import study
    if triton_device != "cpu":
        pytest.skip("on a GPU the study's auto backend is the compiled kernel itself")
    small = ((2, 9, 48, 3),)
    rows = study.odd_size_rows("cpu", sizes=small)
    assert [r["backend"] for r in rows] == ["torch"] + ["triton (interpreted)"] * len(study.INTERPRETED_SIZES)
    assert [(r["B"], r["T"], r["C"], r["heads"]) for r in rows[1:]] == list(study.INTERPRETED_SIZES)
    assert all(r["within tolerance"] for r in rows), rows
    assert all(B * T > Q._kernel().BLOCK_N for B, T, _, _ in study.INTERPRETED_SIZES)   # two blocks of rows
    k = Q._kernel()
    real = k.pack_qkv_grad

    def last_block_lost(dq, dk, dv, out):
        part = real(dq, dk, dv, out)
        part[-1] = 0
        return part
    monkeypatch.setattr(k, "pack_qkv_grad", last_block_lost)
    rows = study.odd_size_rows("cpu", sizes=small)
    assert [r["within tolerance"] for r in rows] == [True, False], rows
    assert rows[1]["db rel err"] > study.FP32_TOL and rows[1]["dx rel err"] < study.FP32_TOL
