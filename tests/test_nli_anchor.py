"""The transformers anchor of the NLI encoder (hwlib.studies.nli_anchor): the same size as the lab's
model within the stated differences, the same loss at init, a record per arm, clear errors."""

import dataclasses
import math
import sys

import pytest
import torch

from hwlib import query
from hwlib.extras import MissingExtra
from hwlib.ladder.session import build_model
from hwlib.steps import settings_for
from hwlib.studies import nli_anchor
from hwlib.studies.ablation import Window
from hwlib.workloads import encoder_nli, get_workload

pytest.importorskip("transformers")   # the 'generation' extra

SMOKE = get_workload("encoder_nli").config("smoke")
CPU_EAGER = dataclasses.replace(settings_for(nli_anchor.STEP), compile=False, cuda_graphs=False, loader="simple")


def _parts(model, prefixes):
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes))


@pytest.mark.parametrize("profile", ["smoke", "full"])
def test_same_size_as_the_lab_within_the_stated_differences(profile):
    cfg = get_workload("encoder_nli").config(profile)
    with torch.device("meta"):   # the full model's counts without allocating it
        hf = nli_anchor.build_anchor(cfg)
        lab = encoder_nli.EncoderNLI(cfg, vocab_multiple=settings_for(nli_anchor.STEP).vocab_multiple)
    d = cfg.d_model
    # encoder layers, pooler and classifier: the same parameters exactly (q, k, v apart vs fused)
    assert _parts(hf, ("bert.encoder",)) == _parts(lab, ("blocks",))
    assert _parts(hf, ("bert.pooler", "classifier")) == _parts(lab, ("pool", "classifier"))
    # embeddings: the token-type table (2 d) against the padded vocabulary rows
    assert _parts(hf, ("bert.embeddings.token_type",)) == 2 * d
    assert nli_anchor.param_difference(cfg) == 2 * d - (lab.vocab_padded - cfg.vocab) * d
    assert nli_anchor.param_count(hf) - nli_anchor.param_count(lab) == nli_anchor.param_difference(cfg)
    if profile == "full":
        assert (nli_anchor.param_count(hf), nli_anchor.param_count(lab)) == (109_484_547, 109_487_619)
    # the step's model, built as the ladder builds it, counts as this one
    if profile == "smoke":
        assert nli_anchor.param_count(build_model("encoder_nli", nli_anchor.STEP, cfg, 0)) == nli_anchor.param_count(lab)


def test_one_step_trains_from_ln3_and_padding_does_not_change_the_loss():
    fp32 = dataclasses.replace(CPU_EAGER, autocast=None)
    padded = nli_anchor._Anchor("anchor_hf_bert", SMOKE, fp32, torch.device("cpu"), 0)
    longest = nli_anchor._Anchor("anchor_hf_bert_longest", SMOKE, fp32, torch.device("cpu"), 0)
    try:
        a, b = padded.batches(0), longest.batches(0)
        assert a[0].shape == (SMOKE.batch, SMOKE.context)
        width = b[0].shape[1]
        real = int(a[1].sum(1).max())
        assert width % nli_anchor.PAD_MULTIPLE == 0 or width == SMOKE.context
        assert real <= width < real + nli_anchor.PAD_MULTIPLE
        assert torch.equal(a[0][:, :width], b[0]) and not a[1][:, width:].any()
        with torch.no_grad():   # the mask hides padding: the same loss whatever the padded length
            la, lb = padded.loss(a), longest.loss(b)
        assert abs(la.item() - lb.item()) < 1e-5
        before = padded.model.classifier.weight.detach().clone()
        loss = padded.step()
        assert math.isfinite(loss.item()) and abs(loss.item() - math.log(3)) < 0.15, loss.item()
        assert abs(loss.item() - la.item()) < 1e-6   # step 0's loss is the loss of batch 0 at init
        assert not torch.equal(before, padded.model.classifier.weight)   # the optimizer ran
        # the lab's optimizer: the same groups (matrices decayed), lr and weight decay
        groups = padded.opt.param_groups
        assert {g["weight_decay"] for g in groups} == {SMOKE.weight_decay, 0.0}
        assert all(g["lr"] == SMOKE.lr for g in groups)
        assert padded.opt.defaults["fused"] is True
    finally:
        padded.close()
        longest.close()


def test_measure_records_both_models(isolated_run):
    rows = nli_anchor.measure(profile="smoke", device="cpu", variants=["anchor_hf_bert"], batch=4,
                              window=Window(repeats=1, steps=2, settle=0, warmup=1), notebook="11_nb")
    assert [r["arm"] for r in rows] == [nli_anchor.STEP, "anchor_hf_bert"]
    lab, hf = rows
    assert hf["vs_lab"] == pytest.approx(hf["ms_per_step"] / lab["ms_per_step"], rel=1e-9)
    assert hf["vs_lab_lo"] <= hf["vs_lab"] <= hf["vs_lab_hi"]
    assert hf["params"] - lab["params"] == hf["param_difference"] == nli_anchor.param_difference(SMOKE)
    by = {(r["step"], r["metric"]): r for r in query.load()}
    for arm in (nli_anchor.STEP, "anchor_hf_bert"):
        ms = by[(arm, "ms_per_step")]
        assert ms["workload"] == "encoder_nli" and ms["notebook"] == "11_nb" and ms["unit"] == "ms"
        assert ms["fields"] == {"study": "nli_anchor"} and ms["profile"] == "smoke"
        assert ms["p20"] <= ms["value"] <= ms["p80"]
        assert ms["params"]["config"]["batch"] == 4 and ms["params"]["compiled"] is False
        assert by[(arm, "parameters")]["value"] == {r["arm"]: r["params"] for r in rows}[arm]
        assert math.isfinite(by[(arm, "first_loss")]["value"])
    ratio = by[("anchor_hf_bert", "anchor_over_lab")]
    assert ratio["value"] == pytest.approx(hf["vs_lab"]) and ratio["params"]["against"] == nli_anchor.STEP
    assert (nli_anchor.STEP, "anchor_over_lab") not in by


@pytest.mark.parametrize("kwargs, names", [
    ({"profile": "huge"}, "profile"),
    ({"batch": 0}, "batch"),
    ({"batch": True}, "batch"),
    ({"variants": ["anchor_keras"]}, "variant"),
    ({"variants": "anchor_hf_bert"}, "variants"),
    ({"compile": "yes"}, "compile"),
    ({"level": 2.0}, "level"),
])
def test_bad_input_names_the_argument(isolated_run, kwargs, names):
    with pytest.raises(ValueError, match=names):
        nli_anchor.measure(device="cpu", notebook="11_nb", **{"profile": "smoke", **kwargs})
    assert not (isolated_run / "results.jsonl").exists()


def test_without_transformers_names_the_extra(isolated_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers -> ImportError
    with pytest.raises(MissingExtra, match=r"hwlib\[generation\]"):
        nli_anchor.measure(profile="smoke", device="cpu", notebook="11_nb")
    assert not (isolated_run / "results.jsonl").exists()
