"""Step 30: ResNet-BK's LM head and cross-entropy through step 17's fused op."""

import pytest
import torch

from hwlib.ladder import gradients
from hwlib.ladder.session import build_model
from hwlib.steps import Precondition, chain, get_step, not_applicable
from hwlib.steps.s17_fused_lm_head.apply import FusedLinearCEHead
from hwlib.steps.s30_bk_fused_head.predict import removed_bytes
from hwlib.workloads import get_workload
from hwlib.workloads.gpt import Head

STEP = "30_bk_fused_head"


def _models(seed=3):
    cfg = get_workload("resnet_bk").config("smoke")
    return cfg, build_model("resnet_bk", "12_bk_core", cfg, seed=seed), build_model("resnet_bk", STEP, cfg, seed=seed)


def test_the_step_swaps_the_head_and_keeps_the_loss_and_gradients():
    cfg, before, after = _models()
    assert type(before.head) is Head and isinstance(after.head, FusedLinearCEHead)
    assert [s.name for s in chain(STEP)][-2:] == ["12_bk_core", STEP]
    # step 07 pads the tied weight's rows to a multiple of 64: the fused op must mask them out of the softmax
    assert before.vocab_padded > cfg.vocab and after.wte.weight.shape[0] == before.vocab_padded
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (3, cfg.context), generator=g)
    targets = torch.randint(0, cfg.vocab, (3, cfg.context), generator=g)
    targets[:, ::4] = -100                                # F.cross_entropy's ignore index, as the ladder's data can hold
    outs = []
    for m in (before, after):
        loss = m(idx, targets)
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = outs
    assert torch.allclose(l0, l1, rtol=1e-6), (l0, l1)
    assert g0.keys() == g1.keys()
    for n in g0:
        diff = ((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-30)).item()
        assert diff < 1e-5, (n, diff)
    assert g1["wte.weight"][cfg.vocab:].abs().max() == 0     # the padded rows are never a class
    # without targets both give the same logits, padded columns sliced off
    with torch.no_grad():
        z0, z1 = before(idx), after(idx)
    assert z1.shape == (3, cfg.context, cfg.vocab) and torch.equal(z0, z1)


def test_the_state_dict_is_unchanged():
    _, before, after = _models()
    sd0, sd1 = before.state_dict(), after.state_dict()
    assert list(sd0) == list(sd1) and not any(k.startswith("head") for k in sd1)
    after.load_state_dict(sd0)                           # a step-12 checkpoint loads into step 30 as it is


def test_applies_to_resnet_bk_only_and_says_what_it_needs():
    st = get_step(STEP)
    assert not not_applicable(st, "resnet_bk")
    assert all(not_applicable(st, w) for w in ("gpt", "encoder_nli", "vit_bdh", "vit_bdh_linear"))
    with pytest.raises(Precondition, match="30_bk_fused_head needs a ResNet-BK model .* found a Linear without one"):
        st.apply(torch.nn.Linear(2, 2))
    _, _, after = _models()
    with pytest.raises(Precondition, match="found a ResNetBK with head FusedLinearCEHead"):
        st.apply(after)                                  # applied twice: its head is no longer the recipe's


def test_the_same_gradients_tolerance_is_fp32s():
    tol, why = gradients.TOLERANCES[STEP]
    assert tol == 1e-5 and "online over vocabulary tiles" in why


def test_the_prediction_counts_the_second_read_of_the_logits():
    # full profile: 16,384 tokens, V = 50,257 padded to 50,304, bf16 logits
    b = removed_bytes(16384, 50257, 50304)
    assert b["unfused, fewest passes"] == 2 * (2 * 16384 * 50257) + 2 * 16384 * 50304
    assert b["fused, one read a row"] == 2 * (2 * 16384 * 50304)
    assert b["removed"] == 2 * 16384 * (2 * 50257 - 50304) == 1_645_281_280


def test_the_fused_head_compiles_as_one_node_without_a_graph_break():
    # a graph break around the head would leave CUDA graphs (step 09, in this step's chain) the pieces between
    _, _, after = _models()
    cfg = after.cfg
    g = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, cfg.vocab, (2, cfg.context), generator=g) for _ in range(2))
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(after)(idx, tgt)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(r.reason)[:120] for r in explained.break_reasons]
    assert "linear_cross_entropy" in str(explained.graphs[0].graph)
