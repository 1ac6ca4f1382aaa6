"""Step 32: Vision-BDH's encoder and gate with their elementwise work in the matmuls' epilogues."""

import pytest
import torch

from hwlib.ladder.session import build_model
from hwlib.steps import Precondition, chain, get_step, not_applicable
from hwlib.steps.s32_bdh_fused_gates import op, predict
from hwlib.steps.s32_bdh_fused_gates.apply import FusedHebbianGate, FusedSparseEncoder
from hwlib.workloads import get_workload
from hwlib.workloads.vit_bdh import rope_tables

# the Triton kernel runs on CUDA tensors where there is a GPU, else interpreted on CPU ones (conftest)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matches_float64_on_fresh_odd_sizes_with_gradients(backend):
    # "triton" runs the kernel itself: interpreted on a CPU (conftest sets TRITON_INTERPRET), compiled on a GPU
    rows = op.odd_size_rows(seed=torch.randint(0, 2**31 - 1, ()).item(), backend=backend,
                            device=DEV if backend == "triton" else "cpu")
    assert len(rows) == len(op.ODD_SIZES)
    assert all(r["within tolerance"] for r in rows), rows


def _operands(H=2, M=26, D=6, N=8, T=13, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    return r(M, D), r(H, D, N), r(H, M, D), r(H, D, N), r(H, N, D), T


def test_each_epilogue_is_the_formula_it_states():
    # the kernel's three epilogues against the same matmul followed by the stated elementwise ops
    x, E, a, Ev, W, T = _operands(device=DEV)
    kern = op._kernel()
    cos, sin = (t.to(DEV) for t in rope_tables(E.shape[2], T))
    s, q = kern.gates(op.ENCODE, x, E, cos=cos, sin=sin, tokens=T)
    z = torch.bmm(x.expand(2, *x.shape), E)
    assert torch.allclose(s, z.relu(), atol=1e-6)
    v = z.relu().view(2, 2, T, -1)
    even, odd = v[..., 0::2], v[..., 1::2]
    want = torch.stack((even * cos[:, 0::2] - odd * sin[:, 0::2], odd * cos[:, 1::2] + even * sin[:, 1::2]), -1)
    assert torch.allclose(q, want.flatten(-2).view_as(q), atol=1e-6)
    u, gated = kern.gates(op.GATE, a, Ev, s=s)
    z2 = torch.bmm(a, Ev)
    assert torch.allclose(u, z2.relu(), atol=1e-6) and torch.allclose(gated, s * z2.relu(), atol=1e-6)
    dy = x.clone()
    dz, ds = kern.gates(op.GATE_GRAD, dy, W.transpose(1, 2), s=s, u=u)
    dg = torch.bmm(dy.expand(2, *dy.shape), W.transpose(1, 2))
    assert torch.allclose(dz, dg * s * (u > 0), atol=1e-6) and torch.allclose(ds, dg * u, atol=1e-6)


def test_bf16_results_are_rounded_where_the_recipe_rounds_them():
    # under bf16 the fused op's outputs equal the recipe's bf16 path to within one rounding of the matmul
    x, E, a, Ev, W, T = _operands(M=130, T=65, N=34, D=19, device=DEV)
    cos, sin = (t.to(DEV) for t in rope_tables(E.shape[2], T))
    with torch.autocast(DEV, dtype=torch.bfloat16):
        for backend in ("torch", "triton"):
            s, q = op.encode(x, E, cos, sin, T, backend=backend)
            y = op.gate_decode(a, Ev, s, W, backend=backend)
            assert s.dtype == q.dtype == y.dtype == torch.bfloat16
            if backend == "torch":
                ref = (s.float(), q.float(), y.float())
            else:
                for got, want in zip((s, q, y), ref):
                    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max(), (got, want)


def test_bad_input_is_named():
    x, E, a, Ev, W, T = _operands()
    cos, sin = rope_tables(E.shape[2], T)
    with pytest.raises(ValueError, match=r"x must be a \[M, D\] tensor"):
        op.encode(x[None], E, cos, sin, T)
    with pytest.raises(ValueError, match="the encoder must be"):
        op.encode(x, E[:, :3], cos, sin, T)
    with pytest.raises(ValueError, match="must be even"):
        op.encode(x, E[..., :7], cos[:, :7], sin[:, :7], T)
    with pytest.raises(ValueError, match="tokens must be a positive integer dividing"):
        op.encode(x, E, cos, sin, 5)
    with pytest.raises(ValueError, match=r"cos and sin must be \[tokens, N\]"):
        op.encode(x, E, cos[:4], sin[:4], T)
    with pytest.raises(ValueError, match=r"a \[H, M, D\], E_v \[H, D, N\], s \[H, M, N\] and W \[H, N, D\] must agree"):
        op.gate_decode(a, Ev, torch.zeros(2, 26, 9), W)
    with pytest.raises(Exception, match="backend"):
        op.encode(x, E, cos, sin, T, backend="cudnn")


@pytest.mark.parametrize("workload", ["vit_bdh", "vit_bdh_linear"])
def test_the_step_swaps_the_encoder_and_gate_and_keeps_the_loss_and_gradients(workload):
    cfg = get_workload(workload).config("smoke")
    before = build_model(workload, "29_shared_qk_attention", cfg, seed=3)
    after = build_model(workload, "32_bdh_fused_gates", cfg, seed=3)
    assert isinstance(after.encode, FusedSparseEncoder) and isinstance(after.gate, FusedHebbianGate)
    assert not isinstance(before.encode, FusedSparseEncoder)
    assert [s.name for s in chain("32_bdh_fused_gates")][-2:] == ["29_shared_qk_attention", "32_bdh_fused_gates"]
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (before, after):
        loss = m(images).logsumexp(-1).mean()
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = outs
    assert torch.allclose(l0, l1, rtol=1e-6)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-7), n


def test_applies_to_vision_bdh_only_and_says_what_it_needs():
    st = get_step("32_bdh_fused_gates")
    assert not not_applicable(st, "vit_bdh") and not_applicable(st, "gpt")
    with pytest.raises(Precondition, match="needs a Vision-BDH model whose encode"):
        st.apply(torch.nn.Linear(2, 2))


def test_the_prediction_counts_six_passes_a_layer():
    t = predict.traffic_bytes(6, 256, 65, 1024)
    q = 6 * 256 * 65 * 1024 * 2
    assert t["recipe (matmul, then elementwise)"] - t["fused epilogues"] == 6 * q
