"""The optimizer pinned: what AdamW does to each parameter, read back from the optimizer a step builds,
is the recipe's, and no step changes it without declaring the change
(hwlib.ladder.gradients.optimizer_check, DECLARED_OPTIMIZER_CHANGES)."""

import pytest
import torch

from hwlib.ladder import gradients as G
from hwlib.ladder import session
from hwlib.steps import LADDER, STEP_NAMES, not_applicable
from hwlib.workloads import WORKLOADS

PAIRS = [(w, s.name) for w in WORKLOADS for s in LADDER if not not_applicable(s, w)]


@pytest.mark.parametrize("workload, step", PAIRS, ids=[f"{w}-{s}" for w, s in PAIRS])
def test_no_step_changes_the_optimizer_without_declaring_it(workload, step):
    against, changes = G.optimizer_check(workload, step)
    assert changes == {}, f"{workload} {step} vs {against}: {changes}"
    assert (against is None) == (step == STEP_NAMES[0])


def test_the_recipe_optimizer_is_gpt2s():
    """Every value by hand: a bug common to every step (which no step-to-step comparison can see)
    fails here."""
    cfg = WORKLOADS["gpt"].config("smoke")
    d = G.optimizer_of("gpt", "01_baseline_fp32", cfg)
    no_decay = ["blocks.0.attn.c_attn.bias", "blocks.0.attn.c_proj.bias", "blocks.0.ln_1.bias", "blocks.0.ln_1.weight",
                "blocks.0.ln_2.bias", "blocks.0.ln_2.weight", "blocks.0.mlp_fc.bias", "blocks.0.mlp_proj.bias",
                "blocks.1.attn.c_attn.bias", "blocks.1.attn.c_proj.bias", "blocks.1.ln_1.bias", "blocks.1.ln_1.weight",
                "blocks.1.ln_2.bias", "blocks.1.ln_2.weight", "blocks.1.mlp_fc.bias", "blocks.1.mlp_proj.bias",
                "ln_f.bias", "ln_f.weight"]
    decay = ["blocks.0.attn.c_attn.weight", "blocks.0.attn.c_proj.weight", "blocks.0.mlp_fc.weight",
             "blocks.0.mlp_proj.weight", "blocks.1.attn.c_attn.weight", "blocks.1.attn.c_proj.weight",
             "blocks.1.mlp_fc.weight", "blocks.1.mlp_proj.weight", "wpe.weight", "wte.weight"]
    assert d == {"class": "AdamW",
                 "groups": [{"params": no_decay, "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
                            {"params": decay, "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}],
                 "fused": None, "foreach": None, "amsgrad": False, "maximize": False, "capturable": False,
                 "differentiable": False, "schedule": "constant"}
    assert G.optimizer_of("gpt", "05_fused_optimizer", cfg) == {**d, "fused": True}
    assert G.DECLARED_OPTIMIZER_CHANGES == {"05_fused_optimizer": {"fused": True}}


def _planted(monkeypatch, *, from_step: str = "05_fused_optimizer", decay_all=False, betas=None, lr_scale=1.0):
    """make_optimizer with a bug from ``from_step`` on (the fused optimizer's settings, or every step)."""
    orig = session.make_optimizer

    def planted(model, cfg, settings):
        if from_step == "05_fused_optimizer" and not settings.fused_adamw:
            return orig(model, cfg, settings)
        params = list(model.parameters())
        decay = params if decay_all else [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2 and not decay_all]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}] + ([{"params": rest, "weight_decay": 0.0}]
                                                                         if rest else [])
        return torch.optim.AdamW(groups, lr=cfg.lr * lr_scale, betas=betas or session.BETAS, eps=session.EPS,
                                 **({"fused": True} if settings.fused_adamw else {}))
    monkeypatch.setattr(session, "make_optimizer", planted)


@pytest.mark.parametrize("bug, says", [
    ({"decay_all": True}, "weight_decay of 18 parameters (blocks.0.attn.c_attn.bias"),
    ({"betas": (0.9, 0.999)}, "betas of 28 parameters"),
    ({"lr_scale": 1.1}, "lr of 28 parameters"),
])
def test_the_pin_fails_an_undeclared_change(monkeypatch, bug, says):
    _planted(monkeypatch, **bug)
    against, changes = G.optimizer_check("gpt", "05_fused_optimizer")
    assert against == "04_sdpa_attention" and any(k.startswith(says) for k in changes), changes
    # and the change is carried by every later step, so only 05 (where it enters) is the one to fail
    assert G.optimizer_check("gpt", "06_torch_compile")[1] == {}


@pytest.mark.parametrize("bug", [{"decay_all": True}, {"betas": (0.9, 0.999)}, {"lr_scale": 1.1}])
def test_a_bug_in_every_step_fails_the_recipe_literal(monkeypatch, bug):
    _planted(monkeypatch, from_step="01_baseline_fp32", **bug)
    assert G.optimizer_check("gpt", "05_fused_optimizer")[1] == {}   # step to step, nothing moved
    with pytest.raises(AssertionError):
        test_the_recipe_optimizer_is_gpt2s()


def test_only_the_declared_value_is_allowed():
    cfg = WORKLOADS["gpt"].config("smoke")
    before = G.optimizer_of("gpt", "04_sdpa_attention", cfg)
    fused = {**before, "fused": True}
    assert G.optimizer_changes(before, fused, "05_fused_optimizer") == {}
    assert G.optimizer_changes(before, fused, "06_torch_compile") == {"fused": (None, True)}   # not 06's to make
    foreach = {**before, "fused": True, "foreach": False}
    assert G.optimizer_changes(before, foreach, "05_fused_optimizer") == {"foreach": (None, False)}
    fewer = {**before, "groups": [before["groups"][1]]}
    assert list(G.optimizer_changes(before, fewer, "05_fused_optimizer")) == [
        "parameters in one optimizer only (blocks.0.attn.c_attn.bias, blocks.0.attn.c_proj.bias, blocks.0.ln_1.bias, ...)"]


def test_the_description_refuses_a_tensor_that_is_not_the_models():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="not parameters of the model"):
        session.optimizer_description(m, opt)
