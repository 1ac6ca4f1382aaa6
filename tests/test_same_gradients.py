"""The same-gradients check (hwlib.ladder.gradients): every (workload, step) pair that runs on a CPU
agrees with the step it builds on to its tolerance, and the check fails on each planted bug that the
loss-curve check let through (issue 51), each planted only in the code path of the step under check."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from hwlib.device import info
from hwlib.ladder import gradients as G
from hwlib.ladder import session
from hwlib.steps import LADDER, not_applicable, unavailable
from hwlib.workloads import WORKLOADS
from hwlib.workloads import encoder_nli as nli_mod

# The modules of the steps past the recipe whose ops a bug is planted in (by module: a step's package
# exports its apply function under the same name as the module).
HEAD_17 = importlib.import_module("hwlib.steps.s17_fused_lm_head.apply")
TRUNK_21 = importlib.import_module("hwlib.steps.s21_fused_layernorm.apply")

pytestmark = pytest.mark.filterwarnings("ignore:synthetic NLI set")

CPU = info(torch.device("cpu"))
PAIRS = [(w, s.name) for w in WORKLOADS for s in LADDER
         if not not_applicable(s, w) and not unavailable(s, CPU) and G.against(w, s.name, CPU) is not None]


@pytest.fixture(autouse=True)
def shared_data(isolated_run, monkeypatch, tmp_path_factory):
    """One data folder for the module: the synthetic sets are made once, not once per pair."""
    monkeypatch.setenv("HWLIB_DATA", str(tmp_path_factory.getbasetemp() / "same-gradients-data"))


@pytest.mark.parametrize("workload, step", PAIRS, ids=[f"{w}-{s}" for w, s in PAIRS])
def test_every_step_computes_the_gradients_of_the_step_before(workload, step):
    chk = G.same_gradients(workload, step)
    assert chk.status == "ok" and chk.ok, str(chk)
    assert chk.against == G.against(workload, step, CPU)
    assert 0.0 <= chk.max_rel_diff <= chk.tolerance == G.TOLERANCES[step][0]
    assert set(chk.figures) == {"loss", "param", "grad", "update", "state"}
    assert chk.figures["param"]["max_rel_diff"] == 0.0   # the same initial weights, drawn biases included
    assert chk.optimizer_diff == {}


def test_the_pairs_cover_every_workload_and_the_steps_past_the_recipe():
    assert {w for w, _ in PAIRS} == set(WORKLOADS)
    steps = {s for _, s in PAIRS}
    assert {"04_sdpa_attention", "05_fused_optimizer", "11_sequence_packing", "12_bk_core", "17_fused_lm_head",
            "21_fused_layernorm", "24_qkv_grad", "25_bias_column"} <= steps


def test_a_step_skipped_here_is_passed_over_and_adds_nothing():
    # 02 (TF32) and 09 (CUDA graphs) are GPU-only: on a CPU 03 is checked against 01, GPT's 17 against 07
    assert G.against("gpt", "03_bf16_autocast", CPU) == "01_baseline_fp32"
    assert G.against("gpt", "17_fused_lm_head", CPU) == "07_nice_shapes"
    # n/a steps are passed over too: ResNet-BK has no attention (04) and no loader step (08)
    assert G.against("resnet_bk", "05_fused_optimizer", CPU) == "03_bf16_autocast"
    assert G.against("resnet_bk", "12_bk_core", CPU) == "07_nice_shapes"
    # a branch builds on its own chain: 21 on 17, not on the FP8 step 18 listed before it
    assert G.against("gpt", "21_fused_layernorm", CPU) == "17_fused_lm_head"
    chk = G.same_gradients("gpt", "17_fused_lm_head")
    assert chk.tolerance == G.TOLERANCES["17_fused_lm_head"][0] == 1e-5   # not 07's + 09's + 17's


def test_the_baseline_n_a_and_skipped_steps_say_why():
    assert G.same_gradients("gpt", "01_baseline_fp32").status == "baseline"
    na = G.same_gradients("resnet_bk", "04_sdpa_attention")
    assert na.status == "n/a" and "attention" in na.detail and na.ok
    sk = G.same_gradients("gpt", "09_cuda_graphs")
    assert sk.status == "skipped" and "GPU-only" in sk.detail and sk.ok


def test_the_inputs_exercise_biases_gains_and_ignored_targets():
    cfg = WORKLOADS["gpt"].config("smoke")
    st = G.Stepper("gpt", "01_baseline_fp32", cfg, torch.device("cpu"), 0)
    biases = [p for n, p in st.model.named_parameters() if n.endswith("bias")]
    gains = [p for n, p in st.model.named_parameters() if ".ln_" in n and n.endswith("weight")]
    assert biases and gains
    assert all(p.abs().min() > 0 for p in biases) and all((p - 1).abs().max() > 0.05 for p in gains)
    targets = st.batch[-1]
    share = (targets == G.IGNORE_INDEX).float().mean().item()
    assert share == pytest.approx(1 / G.IGNORED_SHARE, abs=0.01)
    loss, grads = st.backward()
    assert math.isfinite(loss.item()) and all(g.abs().sum() > 0 for n, g in grads.items() if n.endswith("bias"))


def test_rel_diff_counts_the_rows_only_one_side_has():
    a, b = torch.ones(4, 3), torch.ones(5, 3)
    b[4] = 0.0
    assert G.rel_diff(a, b) == 0.0                          # a padded row left at zero
    b[4] = 1.0
    assert G.rel_diff(a, b) == pytest.approx(math.sqrt(3) / math.sqrt(15))
    assert G.rel_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert G.rel_diff(torch.tensor([float("nan")]), torch.ones(1)) == math.inf


# --- planted bugs: each one only where the step under check runs, so the step before stays clean ---------

def _sdpa_causal_sees_next(monkeypatch):
    orig = F.scaled_dot_product_attention

    def leaky(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if is_causal:   # each token also sees the next one
            T = q.size(-2)
            attn_mask, is_causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(1), False
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", leaky)


def _sdpa_scale_dropped(monkeypatch):
    orig = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, scale=None, **kw: orig(q, k, v, scale=1.0, **kw))


def _head_label_smoothing(monkeypatch):
    def smoothed(h, weight, targets, vocab, **kw):
        logits = F.linear(h, weight)[..., :vocab]
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), label_smoothing=0.1)
    monkeypatch.setattr(HEAD_17, "fused_linear_cross_entropy", smoothed)


def _head_gradient_doubled(monkeypatch):
    orig = HEAD_17.fused_linear_cross_entropy

    def doubled(h, weight, targets, **kw):
        w = weight * 1.0
        w.register_hook(lambda g: 2 * g)   # the head's share of the tied embedding's gradient, twice
        return orig(h, w, targets, **kw)
    monkeypatch.setattr(HEAD_17, "fused_linear_cross_entropy", doubled)


def _layernorm_bias_left_out(monkeypatch):
    orig = TRUNK_21.add_layer_norm

    def no_bias(x, r, weight, bias, *a, **kw):
        return orig(x, r, weight, torch.zeros_like(bias), *a, **kw)
    monkeypatch.setattr(TRUNK_21, "add_layer_norm", no_bias)


def _packed_pairs_see_each_other(monkeypatch):
    orig = nli_mod.SelfAttention.forward

    def leak(self, x, mask):
        if mask.size(-2) > 1:            # the packed, block-diagonal mask: every token of a row sees every other
            mask = torch.ones_like(mask)
        return orig(self, x, mask)
    monkeypatch.setattr(nli_mod.SelfAttention, "forward", leak)


def _fused_optimizer(monkeypatch, **change):
    """make_optimizer as it is, but from the fused optimizer (step 05) on: ``decay_all`` puts every
    parameter in the decayed group; ``betas``, ``lr_scale`` change those."""
    orig = session.make_optimizer

    def planted(model, cfg, settings):
        if not settings.fused_adamw:
            return orig(model, cfg, settings)
        params = list(model.parameters())
        decay = params if change.get("decay_all") else [p for p in params if p.dim() >= 2]
        rest = [p for p in params if all(p is not q for q in decay)]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}] + (
            [{"params": rest, "weight_decay": 0.0}] if rest else [])
        return torch.optim.AdamW(groups, lr=cfg.lr * change.get("lr_scale", 1.0),
                                 betas=change.get("betas", session.BETAS), eps=session.EPS, fused=True)
    monkeypatch.setattr(session, "make_optimizer", planted)


MUTANTS = {
    "causal mask shifted by one": ("gpt", "04_sdpa_attention", _sdpa_causal_sees_next),
    "attention scale dropped": ("gpt", "04_sdpa_attention", _sdpa_scale_dropped),
    "label smoothing 0.1 in the fused head": ("gpt", "17_fused_lm_head", _head_label_smoothing),
    "head gradient doubled": ("gpt", "17_fused_lm_head", _head_gradient_doubled),
    "LayerNorm bias left out": ("gpt", "21_fused_layernorm", _layernorm_bias_left_out),
    "packed pairs attend to each other": ("encoder_nli", "11_sequence_packing", _packed_pairs_see_each_other),
    "weight decay on biases and gains": ("gpt", "05_fused_optimizer", lambda mp: _fused_optimizer(mp, decay_all=True)),
    "betas (0.9, 0.999)": ("gpt", "05_fused_optimizer", lambda mp: _fused_optimizer(mp, betas=(0.9, 0.999))),
    "learning rate 10% higher": ("gpt", "05_fused_optimizer", lambda mp: _fused_optimizer(mp, lr_scale=1.1)),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_the_check_catches_a_planted_bug(name, monkeypatch):
    workload, step, plant = MUTANTS[name]
    plant(monkeypatch)
    chk = G.same_gradients(workload, step)
    assert chk.status == "failed" and not chk.ok, f"{name}: not caught: {chk}"
    # caught by the figures themselves, far above the tolerance (the optimizer's are also caught by the pin)
    assert chk.max_rel_diff > 100 * chk.tolerance, f"{name}: {chk}"


def test_a_mutant_of_the_optimizer_is_named_by_the_pin(monkeypatch):
    _fused_optimizer(monkeypatch, betas=(0.9, 0.999))
    chk = G.same_gradients("gpt", "05_fused_optimizer")
    assert any(k.startswith("betas of") for k in chk.optimizer_diff), chk.optimizer_diff
    assert chk.worst.startswith("state exp_avg_sq")   # beta2 shows in the second moment after one step


# --- at the step's own precision ----------------------------------------------------------------------

OWN = [("gpt", "17_fused_lm_head"), ("gpt", "21_fused_layernorm"), ("vit_bdh", "04_sdpa_attention"),
       ("encoder_nli", "11_sequence_packing")]


@pytest.mark.parametrize("workload, step", OWN, ids=[f"{w}-{s}" for w, s in OWN])
def test_at_its_own_precision_a_step_agrees_within_the_derived_tolerance(workload, step):
    chk = G.same_gradients(workload, step, precision="own")
    assert chk.status == "ok" and chk.precision == "bf16", str(chk)
    assert chk.figures["grad"]["tolerance"] == 16 * 2.0 ** -8
    assert chk.figures["update"]["tolerance"] == chk.figures["state"]["tolerance"] == 1e-5   # fp32 optimizer
    assert chk.figures["grad"]["max_rel_diff"] > 0   # bf16 did round differently: the check is at bf16


def test_at_its_own_precision_the_check_still_catches_the_slimmest_bug(monkeypatch):
    _head_label_smoothing(monkeypatch)   # 1.05e-1 in fp32, the smallest gradient figure of the planted bugs
    chk = G.same_gradients("gpt", "17_fused_lm_head", precision="own")
    assert chk.status == "failed" and chk.max_rel_diff > chk.tolerance, str(chk)


def test_the_derived_tolerances():
    assert G.tolerances("04_sdpa_attention", None, False)[0] == {
        "loss": 1e-5, "param": 0.0, "grad": 1e-5, "update": 1e-5, "state": 1e-5}
    tols, why = G.tolerances("04_sdpa_attention", "bf16", False)
    assert tols["grad"] == tols["loss"] == 0.0625 and tols["update"] == 1e-5 and "16 u" in why
    assert G.tolerances("02_tf32", None, True)[0]["grad"] == 16 * 2.0 ** -11
    with pytest.raises(ValueError, match="precision"):
        G.same_gradients("gpt", "04_sdpa_attention", precision="bf16")


def test_a_check_becomes_a_record_and_a_failure_an_assertion(monkeypatch):
    from hwlib import results
    ok = G.same_gradients("gpt", "04_sdpa_attention")
    G.assert_same_gradients({"gpt": ok, "na": G.same_gradients("resnet_bk", "04_sdpa_attention")})
    rec = results.make_record(notebook="04", workload="gpt", step=ok.step, profile="smoke", device={"name": "cpu"},
                              **ok.record_fields())
    assert rec["value"] == ok.max_rel_diff and rec["status"] == "ok" and rec["against"] == "03_bf16_autocast"
    assert rec["grad_check"]["figures"]["grad"]["tolerance"] == 1e-5
    _sdpa_scale_dropped(monkeypatch)
    bad = G.same_gradients("gpt", "04_sdpa_attention")
    assert bad.record_fields()["status"] == "failed" and "FAILED" in bad.record_fields()["reason"]
    with pytest.raises(AssertionError, match="gradients changed: gpt 04_sdpa_attention vs 03_bf16_autocast"):
        G.assert_same_gradients([ok, bad])
    base = G.same_gradients("gpt", "01_baseline_fp32").record_fields()
    assert base["status"] == "n/a" and base["value"] is None and "nothing to compare" in base["reason"]
    results.make_record(notebook="01", workload="gpt", step="01_baseline_fp32", device={"name": "cpu"}, **base)


def test_the_check_leaves_the_callers_random_state_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    G.same_gradients("gpt", "04_sdpa_attention")
    assert torch.equal(torch.rand(3), expected)
