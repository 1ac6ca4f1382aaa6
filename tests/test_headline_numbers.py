"""The numbers a reader takes away, each against an independent reference: every workload's FLOPs per
step against torch's FlopCounterMode, MFU against the ceiling of the step's own precision, the
bootstrap interval's coverage at its stated level, and the tolerances as literal tables (so that
loosening one is a change a reviewer sees in this file)."""

import dataclasses
import random
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hwlib import noise
from hwlib.bench import Timing
from hwlib.data import nli as nli_data
from hwlib.ladder import gradients as G
from hwlib.ladder import record as record_mod
from hwlib.ladder.run import StepResult
from hwlib.steps import LADDER, settings_for
from hwlib.workloads import WORKLOADS
from hwlib.workloads.encoder_nli import dataset


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a busy 2-core machine torch's second thread
    made a counted step 20x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def counted_step_flops(workload: str, model, batch) -> int:
    with FlopCounterMode(display=False) as fc:
        WORKLOADS[workload].loss(model, batch).backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("workload", ["gpt", "resnet_bk", "vit_bdh", "vit_bdh_linear"])
def test_flops_per_step_is_what_the_flop_counter_counts(workload):
    """One training step of the smoke config, on batch 0, counted exactly as the formula says.

    The formulas and FlopCounterMode count the same things: matmuls and convolutions (elementwise
    ops, softmax and LayerNorm are neither's), each backward matmul twice its forward (an input
    that needs no gradient, the image under Vision-BDH's patch convolution, once), attention in full
    (the masked half of GPT's causal scores is computed, and counted, as PaLM's MFU counts it), the
    unpadded vocabulary. ResNet-BK's BK-Core is a custom op the counter does not see and the formula
    leaves out (memory-bound, measured by bytes). So they agree exactly: 1e-9 is float rounding."""
    wl = WORKLOADS[workload]
    cfg = wl.config("smoke")
    model = wl.build(cfg, settings_for("01_baseline_fp32"), seed=0)
    batch = wl.batches(cfg, torch.device("cpu"), 0)(0)
    assert counted_step_flops(workload, model, batch) == pytest.approx(wl.flops_per_step(cfg), rel=1e-9)


def test_encoder_nli_flops_per_step_is_the_counted_flops_of_its_pairs():
    """flops_per_step counts real tokens only, averaged over the synthetic set: B times the mean, over
    its pairs, of one unpadded pair's counted FLOPs. What one pair of n tokens costs is a quadratic in
    n (its linear layers grow with n, its attention scores with n^2, the pooler and classifier are
    one per pair): counted at three lengths it is known at every length, which a fourth confirms;
    its mean over the set is then the quadratic at the set's E[n] and E[n^2]."""
    wl = WORKLOADS["encoder_nli"]
    cfg = wl.config("smoke")
    model = wl.build(cfg, settings_for("01_baseline_fp32"), seed=0)
    g = torch.Generator().manual_seed(0)

    def pair(n):
        ids = torch.randint(nli_data.N_RESERVED, cfg.vocab, (1, n), generator=g)
        return counted_step_flops("encoder_nli", model, (ids, torch.ones(1, n, dtype=torch.bool), torch.tensor([1])))

    f1, f2, f3 = pair(16), pair(32), pair(48)
    b2 = (f3 - 2 * f2 + f1) / (2 * 16 * 16)          # second difference: the n^2 coefficient
    b1 = (f2 - f1) / 16 - b2 * (16 + 32)
    b0 = f1 - b1 * 16 - b2 * 16 * 16
    assert pair(61) == pytest.approx(b0 + b1 * 61 + b2 * 61 * 61, rel=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the smoke set truncates some pairs to its context
        lengths = dataset(cfg, 0).lengths.astype("float64")
    mean = b0 + b1 * lengths.mean() + b2 * (lengths ** 2).mean()
    assert wl.flops_per_step(cfg) == pytest.approx(cfg.batch * mean, rel=1e-9)


# --- MFU -----------------------------------------------------------------------------------------

# The ceiling each step's MFU is taken against: the precision its matmuls run in (an FP8 step's other
# matmuls stay in bf16, whose ceiling it keeps).
PRECISION = {"01_baseline_fp32": "fp32", "02_tf32": "tf32", **{s.name: "bf16" for s in LADDER[2:]}}
CEILINGS = {"matmul_tflops": {"fp32": 50.0, "tf32": 400.0, "bf16": 800.0, "fp16": 700.0}}   # all distinct


def result(step: str, settings=None) -> StepResult:
    """A step that ran at 10 TFLOP/s (1e12 FLOPs in 100 ms)."""
    s = settings if settings is not None else settings_for(step)
    return StepResult(workload="gpt", step=step, profile="smoke", device={"name": "test"}, status="ok",
                      settings=dataclasses.asdict(s), flops_per_step=1e12,
                      timing=Timing(median_ms=100.0, p20_ms=99.0, p80_ms=101.0, n=10))


@pytest.mark.parametrize("step", [s.name for s in LADDER])
def test_mfu_is_taken_against_the_ceiling_of_the_steps_own_precision(step):
    assert set(PRECISION) == {s.name for s in LADDER}
    res = result(step)
    assert res.model_tflops == pytest.approx(10.0)
    value, why = record_mod.mfu(res, CEILINGS)
    assert why is None and value == pytest.approx(10.0 / CEILINGS["matmul_tflops"][PRECISION[step]], rel=1e-12)
    if PRECISION[step] == "bf16":
        # a GPU without bf16 (a T4) runs the step as fp16 autocast: the fp16 ceiling, not the bf16 one
        fp16 = result(step, dataclasses.replace(settings_for(step), autocast="fp16"))
        assert record_mod.mfu(fp16, CEILINGS)[0] == pytest.approx(10.0 / 700.0, rel=1e-12)
        # bf16 without a bf16 ceiling (none measured there) falls back to fp16's, and says so
        only_fp16 = {"matmul_tflops": {"fp16": 700.0, "fp32": 50.0}}
        assert record_mod.mfu_ceiling(only_fp16, "bf16") == ("fp16", 700.0)
    else:
        # an fp32 or TF32 step never borrows another precision's ceiling
        other = {"matmul_tflops": {p: v for p, v in CEILINGS["matmul_tflops"].items() if p != PRECISION[step]}}
        assert record_mod.mfu(res, other)[0] is None


@pytest.mark.parametrize("step, precision", [("01_baseline_fp32", "fp32"), ("02_tf32", "tf32"),
                                             ("03_bf16_autocast", "bf16"), ("25_bias_column", "bf16")])
def test_the_mfu_record_names_the_ceiling_it_used(step, precision):
    rec = next(r for r in record_mod.record(result(step), notebook="t", ceilings=CEILINGS) if r["metric"] == "mfu")
    assert rec["value"] == pytest.approx(10.0 / CEILINGS["matmul_tflops"][precision], rel=1e-12)
    assert f"measured {precision} matmul" in rec["unit"]


# --- the bootstrap interval -----------------------------------------------------------------------

def test_the_interval_covers_a_known_ratio_at_its_stated_level():
    """300 simulated A/B comparisons with a known speed-up (medians 10 and 8 ms: 1.25), one window of 20
    steps an arm, 5% noise. The interval at the default level must contain 1.25 in that share of them:
    with 300 trials the binomial standard error at 0.9 is 0.017, and [0.85, 0.95] is about 3 of them
    either side; each tail misses at most 0.09 (5% + 3 standard errors of 0.013). Measured: 0.903.
    An 80% interval labelled 90% covers 0.81 here. 200 resamples an interval instead of the default
    2000 keep the test at a few seconds; the quantiles they give are unbiased, only noisier."""
    assert noise.DEFAULT_LEVEL == 0.90
    rng, true = random.Random(0), 10.0 / 8.0
    low = high = 0
    trials = 300
    for t in range(trials):
        a = [[10.0 * (1 + rng.gauss(0, 0.05)) for _ in range(20)]]
        b = [[8.0 * (1 + rng.gauss(0, 0.05)) for _ in range(20)]]
        iv = noise.ratio_interval(a, b, resamples=200, seed=t)
        assert iv.level == noise.DEFAULT_LEVEL
        low += iv.hi < true
        high += iv.lo > true
    coverage = 1 - (low + high) / trials
    assert 0.85 <= coverage <= 0.95, coverage
    assert low / trials <= 0.09 and high / trials <= 0.09, (low, high)


# --- tolerances, literally -----------------------------------------------------------------------

def test_the_loss_curve_tolerances_are_these():
    assert {s.name: s.tolerance for s in LADDER} == {
        "01_baseline_fp32": 0.0, "02_tf32": 5e-3, "03_bf16_autocast": 3e-2, "04_sdpa_attention": 1e-2,
        "05_fused_optimizer": 1e-2, "06_torch_compile": 1e-2, "07_nice_shapes": 1e-2, "08_dataloader": 1e-2,
        "09_cuda_graphs": 1e-2, "10_channels_last": 1e-2, "11_sequence_packing": 1e-2, "12_bk_core": 1e-2,
        "17_fused_lm_head": 1e-2, "18_fp8": 1e-2, "21_fused_layernorm": 1e-2, "22_gelu_epilogue": 1e-2,
        "23_branch_bias": 1e-2, "24_qkv_grad": 1e-2, "25_bias_column": 1e-2, "26_fp8_head": 1e-2,
        "27_bf16_stream": 1e-2, "29_shared_qk_attention": 2e-2,
        "30_bk_fused_head": 1e-2, "31_bucketed_graphs": 1e-2}


def test_the_same_gradients_tolerances_are_these():
    assert {k: tol for k, (tol, _) in G.TOLERANCES.items()} == {
        "01_baseline_fp32": 0.0, **{s.name: 1e-5 for s in LADDER[1:]}}
    assert all(why for _, why in G.TOLERANCES.values())
    assert G.NOT_EXACT.keys() == {"18_fp8", "26_fp8_head"}
