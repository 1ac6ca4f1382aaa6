"""Step 29: Vision-BDH's attention with Q = K read once and the shared values summed per sample."""

import pytest
import torch

from hwlib.ladder.session import build_model
from hwlib.steps import Precondition, chain, get_step, not_applicable
from hwlib.steps.s29_shared_qk_attention import op
from hwlib.steps.s29_shared_qk_attention.apply import SharedQKAttention
from hwlib.workloads import get_workload


def test_matches_float64_on_fresh_odd_sizes_with_gradients():
    rows = op.odd_size_rows(seed=torch.randint(0, 2**31 - 1, ()).item())
    assert len(rows) == 2 * len(op.ODD_SIZES)
    assert all(r["within tolerance"] for r in rows), rows


def test_symmetric_scores_gradient_is_float64_exact():
    q = torch.rand(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(op.symmetric_scores, (q,))


def test_bad_input_is_named():
    q, x = torch.rand(2, 3, 5, 8), torch.rand(3, 5, 4)
    with pytest.raises(ValueError, match="form must be 'softmax' or 'linear', got 'relu'"):
        op.shared_qk_attention(q, x, "relu")
    with pytest.raises(ValueError, match=r"q must be \[H, B, T, N\] and x \[B, T, D\]"):
        op.shared_qk_attention(q, torch.rand(3, 6, 4), "softmax")
    with pytest.raises(ValueError, match="q must have at least 2 dimensions"):
        op.symmetric_scores(torch.rand(4))


@pytest.mark.parametrize("workload", ["vit_bdh", "vit_bdh_linear"])
def test_the_step_swaps_the_attention_and_keeps_the_loss_and_gradients(workload):
    wl = get_workload(workload)
    cfg = wl.config("smoke")
    before = build_model(workload, "10_channels_last", cfg, seed=3)
    after = build_model(workload, "29_shared_qk_attention", cfg, seed=3)
    assert isinstance(after.attend, SharedQKAttention) and not isinstance(before.attend, SharedQKAttention)
    assert [s.name for s in chain("29_shared_qk_attention")][-2:] == ["10_channels_last", "29_shared_qk_attention"]
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
    st = get_step("29_shared_qk_attention")
    assert not not_applicable(st, "vit_bdh") and not_applicable(st, "gpt")
    with pytest.raises(Precondition, match="needs a Vision-BDH model"):
        st.apply(torch.nn.Linear(2, 2))


def test_the_prediction_removes_bytes():
    from hwlib.steps.s29_shared_qk_attention.op import traffic_bytes
    t = traffic_bytes(6, 256, 65, 1024, 192)
    assert t["sdpa (recipe)"] > t["shared q, shared x"] > 0
