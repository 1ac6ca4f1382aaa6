"""FP8 linear layers (hwlib.steps.s18_fp8.op) on CPU: torch._scaled_mm runs there too, so the forward and both
gradients are checked against float64 matmuls of the same FP8-rounded operands (tight) and of the
unrounded ones (within FP8's rounding), on fresh random inputs of odd sizes; the capability gate
and the layer swap of the GPT model."""


import pytest
import torch

from hwlib.device import ChoiceError, DeviceInfo, Unavailable
from hwlib.steps.s18_fp8 import op as fp8
from hwlib.steps import get_step, unavailable, uses_fp8
from hwlib.workloads import get_workload


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_quantize_scales_amax_to_the_format_maximum_and_rounds_like_float8():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(13, 7, generator=g) * 5
    for dtype in (fp8.E4M3, fp8.E5M2):
        q, inv = fp8.quantize(t, dtype)
        assert q.dtype == dtype and q.shape == (13, 7) and inv.dim() == 0
        assert q.float().abs().max().item() == fp8.FMAX[dtype]          # the amax lands on the maximum
        # Dequantized values are the float64 reference's, element for element.
        assert torch.allclose(q.double() * inv.double(), fp8.fake_quantize(t, dtype), rtol=1e-6, atol=0)
        qt, inv_t = fp8.quantize(t, dtype, transposed=True)
        assert qt.shape == (7, 13) and qt.is_contiguous() and torch.equal(qt.float(), q.float().t())
    qr, invr = fp8.quantize(t, fp8.E4M3, rowwise=True)
    assert invr.shape == (13, 1)
    assert torch.equal(qr.float().abs().amax(dim=1), torch.full((13,), fp8.FMAX[fp8.E4M3]))
    z, inv_z = fp8.quantize(torch.zeros(4, 4), fp8.E4M3)                # no division by zero
    assert torch.isfinite(inv_z) and not z.float().any()
    with pytest.raises(ValueError, match="dtype"):
        fp8.quantize(t, torch.bfloat16)
    with pytest.raises(ValueError, match="2-d"):
        fp8.quantize(t[0], fp8.E4M3)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensor", "row"])
def test_quantize_both_equals_the_two_quantize_calls(rowwise):
    """Both layouts from one call: bit for bit what quantize gives for each (one amax pass when the
    scale is per tensor), on an odd shape with a wide range of magnitudes."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(37, 19, generator=g) * torch.logspace(-3, 3, 19)
    for dtype in (fp8.E4M3, fp8.E5M2):
        q, s, qt, st = fp8.quantize_both(t, dtype, rowwise=rowwise)
        q1, s1 = fp8.quantize(t, dtype, rowwise=rowwise)
        qt1, st1 = fp8.quantize(t, dtype, transposed=True, rowwise=rowwise)
        assert q.shape == (37, 19) and qt.shape == (19, 37) and qt.is_contiguous()
        for got, want in ((q, q1), (qt, qt1)):
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(s, s1) and torch.equal(st, st1)
        if not rowwise:
            assert torch.equal(s, st) and torch.equal(qt.float(), q.float().t())
    with pytest.raises(ValueError, match="dtype"):
        fp8.quantize_both(t, torch.float16)
    with pytest.raises(ValueError, match="2-d"):
        fp8.quantize_both(t[0], fp8.E4M3)


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(37, 29, 53), (5, 3, 11)])
def test_fp8_linear_forward_and_gradients_against_float64(scaling, shape):
    M, K, N = shape
    g = torch.Generator().manual_seed(M * 7 + K)
    x = torch.randn(M, K, generator=g, dtype=torch.float64) * 3
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.02
    dy = torch.randn(M, N, generator=g, dtype=torch.float64) * 1e-3
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    if scaling == "row" and (why := fp8.rowwise_unsupported("cpu")):
        # a torch whose CPU _scaled_mm takes per-tensor scales only (2.11): a clear error, not its RuntimeError
        with pytest.raises(Unavailable, match=r"scaling='row': torch .* takes no row-wise scales on cpu"):
            fp8.fp8_linear(xr, wr, scaling=scaling)
        pytest.skip(why)
    y = fp8.fp8_linear(xr, wr, scaling=scaling)
    y.backward(dy.float())
    assert y.dtype == torch.float32 and xr.grad.dtype == torch.float32 and wr.grad.dtype == torch.float32
    # Same rounded operands, exact accumulation: only fp32 accumulation and the inverse scale differ.
    # Row-wise scaled kernels write bf16 only: the weight's gradient is rounded to bf16 there (2^-9).
    tols = (1e-5, 1e-5, 2 ** -8 if scaling == "row" else 1e-5)
    for got, want, tol in zip((y, xr.grad, wr.grad), fp8.fp8_linear_reference(x.float(), w.float(), dy.float(),
                                                                               scaling == "row"), tols):
        assert rel(got, want) < tol
    # Against the unrounded matmuls: within FP8's rounding (e4m3: 2^-4 relative per element at worst,
    # e5m2: 2^-3), and clearly coarser than bf16's (2^-9): FP8 is really what ran.
    for got, want in ((y, x @ w.t()), (xr.grad, dy @ w), (wr.grad, dy.t() @ x)):
        assert 2 ** -8 < rel(got, want) < 2 ** -3


def test_fp8_linear_keeps_leading_dims_adds_the_bias_and_refuses_bad_input():
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(24, 40)
    x = torch.randn(2, 5, 24, generator=g)
    layer = fp8.FP8Linear.from_linear(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias        # the very same parameters
    y = layer(x)
    assert y.shape == (2, 5, 40) and rel(y, lin(x)) < 0.1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16                          # follows autocast's dtype
    with pytest.raises(ValueError, match="scaling"):
        fp8.fp8_linear(x, lin.weight, scaling="block")
    with pytest.raises(ValueError, match="in_features"):
        fp8.fp8_linear(torch.randn(3, 23), lin.weight)
    with pytest.raises(ValueError, match="weight must be 2-d"):
        fp8.fp8_linear(x, lin.weight[0])
    with pytest.raises(TypeError, match="floating point"):
        fp8.fp8_linear(torch.ones(3, 24, dtype=torch.long), lin.weight)
    with pytest.raises(ValueError, match="scaling"):
        fp8.FP8Linear.from_linear(lin, "block")


def test_the_gpt_model_swaps_its_mlp_linears_and_keeps_its_parameters():
    from hwlib.ladder.session import build_model
    cfg = get_workload("gpt").config("smoke")
    plain, f8 = build_model("gpt", "17_fused_lm_head", cfg, 0), build_model("gpt", "18_fp8", cfg, 0)
    swapped = [n for n, m in f8.named_modules() if isinstance(m, fp8.FP8Linear)]
    assert sorted(swapped) == sorted(f"blocks.{i}.{n}" for i in range(cfg.n_layer) for n in fp8.MLP_LINEARS)
    a, b = plain.state_dict(), f8.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)   # same names, same init
    assert fp8.swap_mlp_linears(f8) == 0                                    # already swapped: nothing to do
    x = torch.randint(0, cfg.vocab, (2, cfg.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = plain(x, x).item(), f8(x, x).item()
    assert la != lb and abs(la - lb) / la < 2e-2


def _gpu(cap):
    return DeviceInfo(kind="cuda", name="GPU", capability=list(cap), total_mem_gib=80.0, sm_count=132, l2_mib=50.0,
                      cpu_count=16, host="h", colab=False, versions={"triton": "3.6"})


def test_the_fp8_step_is_skipped_with_the_reason_where_fp8_is_missing():
    st = get_step("18_fp8")
    why = unavailable(st, _gpu((8, 0)))
    assert why and "sm_89" in why and "sm_80" in why
    assert unavailable(st, _gpu((9, 0))) is None and unavailable(st, _gpu((8, 9))) is None
    assert "GPU-only" in unavailable(st, DeviceInfo(kind="cpu", name="x", capability=None, total_mem_gib=None,
                                                     sm_count=None, l2_mib=None, cpu_count=2, host="h", colab=False))
    assert uses_fp8("18_fp8") and st.fp8 and not uses_fp8("17_fused_lm_head")


def test_head_matmuls_rows_on_cpu():
    from hwlib.steps.s18_fp8 import study
    rows = study.head_matmuls("smoke", "cpu", shape=(48, 32, 80), iters=2)
    assert [r["variant"] for r in rows] == list(study.VARIANTS) and all(r["status"] == "ok" for r in rows)
    bf16, fp8_rows = rows[0], rows[1:]
    assert all(r["err_y"] < 2 ** -7 for r in [bf16])
    for r in fp8_rows:   # the same quantized operands in every FP8 variant: the same results
        assert r["err_y"] == pytest.approx(fp8_rows[0]["err_y"], rel=1e-4) and 2 ** -8 < r["err_dw"] < 2 ** -3
    with pytest.raises(ValueError, match="M must be a positive int"):
        study.head_matmuls("smoke", "cpu", shape=(0, 32, 80))


def test_block_matmuls_time_every_linear_of_a_block_and_check_it_against_float64():
    from hwlib.steps.s18_fp8 import study
    from hwlib.workloads import gpt
    cfg = gpt.PROFILES["smoke"]
    M, d = cfg.batch * cfg.context, cfg.d_model
    assert study.block_linears("smoke") == {"attn_qkv": (M, d, 3 * d), "attn_proj": (M, d, d),
                                           "mlp_fc": (M, d, 4 * d), "mlp_proj": (M, 4 * d, d)}
    rows = study.block_matmuls("smoke", "cpu", iters=2)
    assert [(r["linear"], r["variant"]) for r in rows] == [(k, v) for k in study.block_linears("smoke")
                                                           for v in ("bf16", study.VARIANTS[2], study.VARIANTS[3])]
    assert not any(r["compiled"] for r in rows)   # on a CPU the quantizing passes run eagerly, and say so
    assert all("run eagerly" in (r["reason"] or "") for r in rows if r["variant"] == study.VARIANTS[2])
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and (r["M"], r["K"], r["N"]) == study.block_linears("smoke")[r["linear"]]
        # bf16 within bf16's rounding of float64; FP8 coarser than bf16 and within e4m3/e5m2's
        lo, hi = (0, 2 ** -7) if r["variant"] == "bf16" else (2 ** -8, 2 ** -3)
        assert all(lo < r[k] < hi for k in ("err_y", "err_dx", "err_dw")), r
    with pytest.raises(ChoiceError, match="profile"):
        study.block_linears("huge")
    with pytest.raises(ValueError, match="iters"):
        study.block_matmuls("smoke", "cpu", iters=0)


def test_matmul_headroom_is_the_layers_savings_plus_the_heads():
    from hwlib.steps.s18_fp8 import study
    fp8 = study.VARIANTS[3]

    def row(variant, ms, linear=None, status="ok"):
        return {"variant": variant, "ms": ms, "status": status, **({"linear": linear} if linear else {})}
    block = [row("bf16", 1.0, "attn_qkv"), row(fp8, 0.6, "attn_qkv"), row("bf16", 2.0, "mlp_fc"), row(fp8, 1.5, "mlp_fc")]
    head = [row("bf16", 5.0), row(study.VARIANTS[1], 9.0), row(fp8, 3.0)]
    got = study.matmul_headroom(block, head, n_layer=12)
    assert got["per_layer_ms"] == pytest.approx({"attn_qkv": 0.4, "mlp_fc": 0.5})
    assert got["blocks_ms"] == pytest.approx(12 * 0.9) and got["head_ms"] == pytest.approx(2.0)
    assert got["saved_ms"] == pytest.approx(12 * 0.9 + 2.0) and got["bf16_ms"] == pytest.approx(12 * 3.0 + 5.0)
    assert got["blocks_quantized_ms"] is None   # no rows with the quantizing passes
    passes = [row(study.VARIANTS[2], 1.2, "attn_qkv"), row(study.VARIANTS[2], 1.7, "mlp_fc")]
    assert study.matmul_headroom(block + passes, head, 12)["blocks_quantized_ms"] == pytest.approx(12 * (-0.2 + 0.3))
    # an FP8 row that did not run: no bound
    assert study.matmul_headroom(block[:3] + [row(fp8, None, "mlp_fc", status="skipped")], head, 12) is None
    assert study.matmul_headroom(block, head[:2], 12) is None


def test_matmul_records_and_headroom_words():
    from hwlib.steps.s18_fp8 import study
    ok = {"variant": "bf16", "linear": "mlp_fc", "M": 16, "K": 32, "N": 48, "status": "ok", "reason": None,
          "ms": 0.5, "p20_ms": 0.4, "p80_ms": 0.6, "err_y": 1e-3, "err_dx": 2e-3, "err_dw": 3e-3, "tflops": 9.0}
    skipped = {**{k: ok[k] for k in ("linear", "M", "K", "N")}, "variant": study.VARIANTS[3], "status": "skipped",
               "reason": "FP8 matmuls need sm_89 or newer"}
    a, b = study.matmul_records([ok, skipped], "block_matmuls_ms", keys=("linear", "variant"), notebook="18_fp8",
                                step="18_fp8", profile="smoke", device="cpu")
    assert (a["value"], a["p20"], a["p80"], a["unit"], a["status"]) == (0.5, 0.4, 0.6, "ms", "ok")
    assert a["fields"] == {"linear": "mlp_fc", "variant": "bf16"} and a["params"]["tflops"] == 9.0
    assert b["value"] is None and b["status"] == "skipped" and b["reason"] == skipped["reason"]
    room = {"bf16_ms": 18.0, "saved_ms": 6.0, "blocks_ms": 4.0, "head_ms": 2.0, "blocks_quantized_ms": -7.0}
    text = study.headroom_words(room, 12, "25_bias_column", {"25_bias_column": 31.0, "09_cuda_graphs": 36.0})
    assert "18.00 ms in bf16" in text and "12.00 ms in FP8" in text and "6.00 ms saved at most" in text
    assert "cost 7.00 ms a step more" in text and "at least 25.00 ms" in text and "at most 1.44x step 09" in text
    slower = study.headroom_words({**room, "saved_ms": -1.0, "blocks_quantized_ms": None}, 12, "25_bias_column",
                                  {"25_bias_column": 31.0, "09_cuda_graphs": 36.0})
    assert "no FP8 step can gain here" in slower and "step 09" not in slower and "pass of its own" not in slower
