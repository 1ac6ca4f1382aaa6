"""The FP8 LM head (hwlib.steps.s26_fp8_head.op): loss and gradients against float64, from the same
FP8-rounded operands and exact, at odd sizes (padded to 16 inside); its Triton kernels (compiled on a
GPU, interpreted on CPU tensors: conftest.py sets TRITON_INTERPRET=1) against the torch backend, both
FP8 layouts element by element; ignore_index, bad input, no_grad, torch.compile, opcheck; GPT's head
and the step's skip where FP8 is missing.
"""

from __future__ import annotations

import pytest
import torch

from hwlib.device import DeviceInfo, Unavailable
from hwlib.ops.sources import load_python_kernel
from hwlib.steps import chain, get_step, unavailable, uses_fp8
from hwlib.steps.s18_fp8.op import E4M3, E5M2, cast_scaled, scale_for
from hwlib.steps.s26_fp8_head import op as L8
from hwlib.steps.s26_fp8_head import study as S

from test_linear_ce import make, ref, run

# Triton's interpreter converts to FP8 its own way (values a factor of 2 off torch's cast, seen with
# Triton 3.9 on CPU): on CPU tensors the kernels' indexing is checked (which element lands where, in
# each layout), on a GPU their numbers too, element by element against torch.
INTERPRETED = "the interpreter's FP8 conversions are not the GPU's: the numbers are checked on a GPU"


def rel(a, b) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-300))


# (N, D, V_pad, V, chunk): rows, widths and vocabularies that are multiples of nothing, ragged chunks
SIZES = [(37, 19, 77, 70, None), (50, 33, 130, 127, 16), (1, 3, 5, 5, None), (64, 16, 48, 48, 32)]


@pytest.mark.parametrize("n, d, vp, v, chunk", SIZES, ids=str)
def test_torch_backend_against_float64(n, d, vp, v, chunk):
    h, w, t = make(n, d, vp, v, dtype=torch.float32, ignored=min(2, n - 1), key=("fp8",))
    got = run(h, w, t, fn=L8.fused_linear_cross_entropy_fp8, vocab=v, chunk=chunk, backend="torch")
    fq = L8.linear_cross_entropy_fp8_reference(h.double(), w.double(), t, vocab=v)
    exact = ref(h, w, t, v)
    assert rel(got[0], fq[0]) < S.LOSS_TOL_FQ
    assert rel(got[1], fq[1]) < S.GRAD_TOL_FQ and rel(got[2], fq[2]) < S.GRAD_TOL_FQ
    assert rel(got[0], exact[0]) < S.LOSS_TOL_EXACT
    # a single row's gradient is one softmax: its e5m2 rounding does not average out; the bound is 2^-3
    tol = S.GRAD_TOL_EXACT if n > 1 else 2.0 ** -3
    assert rel(got[1], exact[1]) < tol and rel(got[2], exact[2]) < tol
    assert got[2][v:].abs().max() == 0 if vp > v else True     # padded weight rows: no gradient


@pytest.mark.parametrize("p_t", [0.001, 0.06, 0.3, 0.9, 0.999])
def test_the_target_entry_of_the_gradient_is_exact_at_any_confidence(p_t):
    """With W the identity, dh_n is row n of the gradient itself. Its target entry, p_t - 1, must come
    out to 1e-4 whatever p_t is: rounded in e5m2 it would read -1 for every p_t below 0.07 (6% off at
    0.06), and rounded as p_t it would be off by up to 2^-3 of 1 where p_t is near 1 (1 - p_t = 1e-3)."""
    v = 48
    a = torch.log(torch.tensor((v - 1) * p_t / (1 - p_t)))
    h = torch.zeros(5, v)
    t = torch.tensor([3, 17, 30, 41, 47])
    h[torch.arange(5), t] = a                  # row n: logit a at its target, 0 elsewhere
    h[torch.arange(5), (t + 5) % v] = 1.0      # and one other class, so the per-tensor scale is shared
    w = torch.eye(v)
    got = run(h, w, t, fn=L8.fused_linear_cross_entropy_fp8, vocab=v, backend="torch")
    fq = L8.linear_cross_entropy_fp8_reference(h.double(), w.double(), t, vocab=v)
    want = fq[1][torch.arange(5), t]           # (p_t - 1) / 5 from the same FP8-rounded h
    err = (got[1][torch.arange(5), t].double() - want).abs() / want.abs()
    assert float(err.max()) < 1e-4, (p_t, err)
    # the other entries are probabilities rounded to e5m2: at most 2^-3 of each (plus fp32 noise)
    off = torch.ones(5, v, dtype=torch.bool)
    off[torch.arange(5), t] = False
    bound = fq[1].abs() * 2.0 ** -3 + 1e-12
    assert bool(((got[1].double() - fq[1]).abs() <= bound)[off].all())


def test_the_reference_is_the_exact_head_without_fp8_rounding():
    """The FP8 reference must differ from the exact head (it rounds), and by about FP8's error."""
    h, w, t = make(40, 24, 60, 60, key=("fq",))
    fq, exact = L8.linear_cross_entropy_fp8_reference(h, w, t), ref(h, w, t, 60)
    assert 1e-4 < rel(fq[1], exact[1]) < S.GRAD_TOL_EXACT


def test_odd_size_study_rows_on_cpu():
    rows = S.odd_size_rows("cpu", seed=3, sizes=((45, 20, 101, 112), (17, 8, 33, 33)))
    assert [r["rows"] for r in rows] == [45, 17] and all(r["within tolerance"] for r in rows), rows
    assert all(r["backend"] == "torch" for r in rows)


# --- the Triton kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64, 48), (37, 21), (128, 256), (16, 3008)], ids=str)
def test_cast_kernel_writes_both_layouts(triton_device, shape):
    """Every element of q and q^T, against torch's cast; sizes that are multiples of 16 included (a
    tl.trans-ed transposed store wrote wrong elements exactly there on an H100)."""
    ck = load_python_kernel(L8.CAST_KERNEL_FILE)
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(triton_device)
    s = scale_for(x.abs().amax(), E4M3)
    q, qt = ck.cast_both(x, s, E4M3)
    assert qt.shape == shape[::-1]
    assert torch.equal(qt.float().t(), q.float())
    if triton_device == "cuda":     # the interpreter's FP8 conversions are not the GPU's (see INTERPRETED)
        assert torch.equal(q.float(), cast_scaled(x, s, E4M3).float())


@pytest.mark.parametrize("c, vp, v", [(32, 128, 128), (45, 77, 70), (16, 48, 40)], ids=str)
def test_gradient_kernel_writes_both_layouts(triton_device, c, vp, v):
    """G and G^T from the Triton pass against the torch pass, every element (ignored and bad targets
    included: zeros and NaNs), and G^T exactly G transposed."""
    g = torch.Generator().manual_seed(c + vp)
    z = (torch.randn(c, vp, generator=g) * 3).to(torch.float16 if triton_device == "cpu" else torch.bfloat16)
    z = z.to(triton_device)
    t = torch.randint(0, v, (c,), generator=g).to(triton_device)
    t[1], t[2] = -100, v          # one ignored row, one target outside the classes
    lse = torch.logsumexp(z[:, :v].float(), dim=1)
    gk = load_python_kernel(L8.GRAD_KERNEL_FILE)
    g8, gt8 = torch.empty(c, vp, dtype=E5M2, device=triton_device), torch.empty(vp, c, dtype=E5M2, device=triton_device)
    gk.ce_grad_fp8(z, lse, t, g8, gt8, v, -100)
    w8, wt8 = torch.empty_like(g8), torch.empty_like(gt8)
    L8._grad_torch(z, lse, t, w8, wt8, v, -100)
    a = g8.float()
    ok = ~a.isnan()
    assert torch.equal(gt8.float().t().isnan(), a.isnan()) and bool(a[2].isnan().all()) and int(ok.sum()) == (c - 1) * vp
    assert torch.equal(gt8.float().t()[ok], a[ok])
    assert bool((a[1] == 0).all()) and bool((a[:, v:][ok[:, v:]] == 0).all())
    if triton_device == "cuda":
        assert torch.equal(a[ok], w8.float()[ok]) and torch.equal(wt8.float().t()[ok], a[ok])


@pytest.mark.parametrize("c, d, v", [(40, 24, 30), (64, 768, 100), (7, 1100, 9)], ids=str)
def test_target_kernel_against_the_torch_pass(triton_device, c, d, v):
    """dh's rows and dW's scattered rows from the Triton kernel against the torch pass: targets that
    repeat (the atomic adds to one row of dW), an ignored row (coef 0: nothing moves) and a bad one (NaN)."""
    g = torch.Generator().manual_seed(c + d)
    w8 = (torch.randn(v, d, generator=g) * 2).to(E4M3).to(triton_device)
    h8 = (torch.randn(c, d, generator=g) * 2).to(E4M3).to(triton_device)
    t = torch.randint(0, 4, (c,), generator=g).to(triton_device)          # few targets: many repeats
    coef = (-torch.rand(c, generator=g)).to(triton_device)
    coef[1], coef[2] = 0.0, float("nan")
    t[1] = -100
    inv_w, inv_h = torch.tensor([0.5], device=triton_device), torch.tensor([0.25], device=triton_device)
    dh0 = torch.randn(c, d, generator=g).to(triton_device, torch.bfloat16 if triton_device == "cuda" else torch.float32)
    dw0 = torch.randn(v, d, generator=g).to(triton_device)
    tk = load_python_kernel(L8.TARGET_KERNEL_FILE)
    a_dh, a_dw, b_dh, b_dw = dh0.clone(), dw0.clone(), dh0.clone(), dw0.clone()
    tk.add_target_terms(a_dh, a_dw, t, coef, w8, inv_w, h8, inv_h)
    L8._add_target_terms(b_dh, b_dw, t, coef, w8, inv_w, h8, inv_h)
    assert torch.equal(a_dh[1], dh0[1]) and bool(a_dh[2].isnan().all())
    assert torch.equal(a_dw[4:], dw0[4:])                                   # rows no target names: untouched
    ok = ~torch.arange(c, device=triton_device).eq(2)
    moved = (a_dh[ok] != dh0[ok]).any(dim=1)
    assert torch.equal(moved, (b_dh[ok] != dh0[ok]).any(dim=1))            # the same rows moved
    if triton_device == "cuda":     # the interpreter's FP8 conversions are not the GPU's (see INTERPRETED)
        # fp32 sums rounded once into bf16 (the kernel may fuse the multiply-add: one bf16 step apart at most,
        # up to 2^-7 of the value); the atomic adds' order varies (fp32 sums of a few terms)
        assert torch.allclose(a_dh[ok].float(), b_dh[ok].float(), rtol=2.0 ** -7, atol=0)
        assert torch.allclose(a_dw, b_dw, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert bool(a_dw[t[2]].isnan().all()) and bool(b_dw[t[2]].isnan().all())   # the NaN row's into its target's


def test_target_kernel_names_bad_shapes():
    tk = load_python_kernel(L8.TARGET_KERNEL_FILE)
    w8, h8 = torch.zeros(5, 8, dtype=E4M3), torch.zeros(3, 8, dtype=E4M3)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="dw must be float32"):
        tk.add_target_terms(torch.zeros(3, 8), torch.zeros(5, 8, dtype=torch.float64), torch.zeros(3, dtype=torch.long),
                            torch.zeros(3), w8, one, h8, one)
    with pytest.raises(ValueError, match="shapes"):
        tk.add_target_terms(torch.zeros(3, 7), torch.zeros(5, 8), torch.zeros(3, dtype=torch.long), torch.zeros(3),
                            w8, one, h8, one)


def test_triton_backend_against_the_torch_backend(triton_device):
    if triton_device == "cpu":
        pytest.skip(INTERPRETED)
    h, w, t = make(45, 24, 80, 77, dtype=torch.float32, key=("fp8tri",), device=triton_device)
    a = run(h, w, t, fn=L8.fused_linear_cross_entropy_fp8, vocab=77, backend="triton")
    b = run(h, w, t, fn=L8.fused_linear_cross_entropy_fp8, vocab=77, backend="torch")
    # the same roundings; exp differs in its last bits, which can move an entry across an e5m2 boundary
    assert rel(a[0], b[0]) < 1e-5 and rel(a[1], b[1]) < 1e-3 and rel(a[2], b[2]) < 1e-3


# --- semantics and bad input -----------------------------------------------------------------------

def test_ignored_targets_and_the_all_ignored_nan():
    h, w, t = make(20, 8, 24, 24, dtype=torch.float32, key=("ign",))
    t[:5] = -100
    loss, dh, _ = run(h, w, t, fn=L8.fused_linear_cross_entropy_fp8, vocab=24)
    assert torch.isfinite(loss) and dh[:5].abs().max() == 0
    with torch.no_grad():
        assert torch.isnan(L8.fused_linear_cross_entropy_fp8(h, w, torch.full_like(t, -100), vocab=24))


@pytest.mark.parametrize("args, says", [
    (lambda h, w, t: (h, w[:, :3], t), "widths must match"),
    (lambda h, w, t: (h, w, t[:-1]), "targets has shape"),
    (lambda h, w, t: (h, w, t.float()), "integer class indices"),
    (lambda h, w, t: (h, w, t.clone().fill_(99)), "targets: 99"),
], ids=["width", "targets shape", "float targets", "out of range"])
def test_bad_input_names_the_argument(args, says):
    h, w, t = make(10, 6, 16, 16, dtype=torch.float32, key=("bad",))
    with pytest.raises(ValueError, match=says):
        L8.fused_linear_cross_entropy_fp8(*args(h, w, t))


def test_non_contiguous_inputs_and_bad_backend():
    h, w, t = make(24, 10, 32, 30, dtype=torch.float32, key=("nc",))
    a = run(h, w, t, fn=L8.fused_linear_cross_entropy_fp8, vocab=30)
    b = run(h.t().contiguous().t(), w.t().contiguous().t(), t, fn=L8.fused_linear_cross_entropy_fp8, vocab=30)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="backend"):
        L8.fused_linear_cross_entropy_fp8(h, w, t, backend="cuda")
    with pytest.raises(ValueError, match="backend"):     # "auto" is resolved before the passes are chosen
        L8.passes("auto")
    assert L8.passes("torch").grad is L8._grad_torch


def test_no_grad_computes_the_loss_only_and_backward_says_why():
    h, w, t = make(12, 6, 16, 16, dtype=torch.float32, key=("ng",))
    with torch.no_grad():
        out = L8._linear_ce_fp8_op(h, w, t, 16, -100, 16, "torch", False, torch.float32)
    assert out[1].numel() == 0 and out[2].numel() == 0


def test_a_gpu_without_fp8_is_unavailable_with_the_reason(monkeypatch):
    assert L8.fp8_problem(torch.device("cpu")) is None
    monkeypatch.setattr(L8, "info", lambda device: _gpu((8, 0)))
    L8.fp8_problem.cache_clear()
    try:
        assert "sm_89" in L8.fp8_problem(torch.device("cuda")) and "sm_80" in L8.fp8_problem(torch.device("cuda"))
        with pytest.raises(Unavailable, match="sm_89"):
            L8.select_backend("auto", "cuda")
    finally:
        L8.fp8_problem.cache_clear()      # the next caller asks the real device


def test_compiled_fullgraph_matches_eager():
    h, w, t = make(32, 16, 48, 45, dtype=torch.float32, key=("cmp",))
    eager = run(h, w, t, fn=L8.fused_linear_cross_entropy_fp8, vocab=45)
    fn = torch.compile(lambda h, w, t: L8.fused_linear_cross_entropy_fp8(h, w, t, vocab=45), fullgraph=True,
                       backend="aot_eager")
    got = run(h, w, t, fn=lambda h, w, t, **_: fn(h, w, t))
    assert all(torch.equal(a, b) for a, b in zip(eager, got))


def test_opcheck_schema_fake_and_autograd():
    h, w, t = make(16, 8, 16, 16, dtype=torch.float32, key=("opc",))
    torch.library.opcheck(torch.ops.hwlib.linear_cross_entropy_fp8.default,
                          (h.requires_grad_(), w.requires_grad_(), t, 16, -100, 16, "torch", True, torch.float32),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# --- GPT and the step ----------------------------------------------------------------------------------

def test_gpt_fp8_head_needs_the_fused_head_and_trains_like_the_bf16_head():
    from conftest import gpt_with
    from hwlib.steps import Precondition
    from hwlib.workloads import get_workload
    cfg = get_workload("gpt").profiles["smoke"]
    with pytest.raises(Precondition, match="26_fp8_head .* needs 17_fused_lm_head's head; found Head"):
        gpt_with("26_fp8_head", cfg=cfg)
    idx = torch.randint(0, cfg.vocab, (2, cfg.context), generator=torch.Generator().manual_seed(0))
    losses = [gpt_with("17_fused_lm_head", *(["26_fp8_head"] if f else []), cfg=cfg, attention="manual")(idx, idx)
              for f in (False, True)]
    a, b = (float(x.detach()) for x in losses)
    assert a != b and abs(a - b) / a < S.LOSS_TOL_EXACT


def _gpu(cap):
    return DeviceInfo(kind="cuda", name="GPU", capability=list(cap), total_mem_gib=80.0, sm_count=132, l2_mib=50.0,
                      cpu_count=16, host="h", colab=False, versions={"triton": "3.6"})


def test_the_step_builds_on_25_and_is_skipped_where_fp8_is_missing():
    names = {s.name for s in chain("26_fp8_head")}
    assert {"17_fused_lm_head", "25_bias_column"} <= names and "18_fp8" not in names and uses_fp8("26_fp8_head")
    why = unavailable(get_step("26_fp8_head"), _gpu((8, 6)))
    assert why and "sm_89" in why and "sm_86" in why
    assert unavailable(get_step("26_fp8_head"), _gpu((9, 0))) is None



def test_final_loss_words_say_whether_the_fp8_step_left_the_bf16_band():
    from hwlib.report import recipe
    row = lambda step, loss: {"step": step, "status": "ok", "final_loss": loss}
    bf16 = [row("09_cuda_graphs", 5.72), row("21_fused_layernorm", 5.73), row("25_bias_column", 5.74)]
    rows = bf16 + [row("18_fp8", 5.0), row("26_fp8_head", 5.86)]
    out = recipe.final_loss_words(rows, "26_fp8_head")
    assert "+2.09%" in out and "outside that band" in out and "3 bf16 steps" in out   # 18 is FP8: not in the band
    assert "within that band" in recipe.final_loss_words(bf16 + [row("26_fp8_head", 5.735)], "26_fp8_head")
    assert recipe.final_loss_words(bf16, "26_fp8_head").startswith("No final loss of 26_fp8_head")
    m = recipe.final_loss_move(rows, "26_fp8_head")
    assert m["prev"] == "25_bias_column" and m["outside_band"] and abs(m["band"] - (5.74 / 5.72 - 1)) < 1e-12


def test_long_curves_rows_band_and_words():
    curves = S.long_curves("cpu", "smoke", steps=("01_baseline_fp32", "26_fp8_head"), n=10, progress=False)
    assert list(curves) == ["01_baseline_fp32"] and len(curves["01_baseline_fp32"]) == 10   # 26 needs FP8: left out
    with pytest.raises(ValueError, match="n must be"):
        S.long_curves("cpu", "smoke", n=3)
    fake = {"09_cuda_graphs": [5.0] * 20 + [3.0] * 10, "25_bias_column": [5.0] * 27 + [3.3] * 3,
            "26_fp8_head": [5.0] * 27 + [3.6] * 3}
    assert S.tail_mean(fake["25_bias_column"]) == pytest.approx(3.3)
    rows = S.long_rows(fake)
    assert [r["vs 25"] for r in rows] == pytest.approx([3.0 / 3.3 - 1, 0.0, 3.6 / 3.3 - 1])
    assert S.band(fake) == pytest.approx(0.1) and S.band({"25_bias_column": [1.0]}) is None
    text = S.long_prose(rows, S.band(fake))
    assert "+9.1% from step 25, +9.1% past the highest bf16 end (the bound: 20%" in text and "10.0% apart" in text
    fake["26_fp8_head"][-3:] = [3.1] * 3
    assert "-6.1% from step 25, inside that band" in S.long_prose(S.long_rows(fake), S.band(fake))
    with pytest.raises(ValueError, match="no curve"):
        S.long_rows({"09_cuda_graphs": [1.0]})
