"""Where the time goes (hwlib.studies.breakdown): kernel names from real H100 traces put in the right
category, the LM head's matmuls told apart by size, per-step times and idle from synthetic trace
events, the floors' counts, and the study end to end on CPU."""

import pytest
import torch

from hwlib import trace
from hwlib.studies import breakdown as bd
from hwlib.workloads import get_workload

# Kernel names as torch.profiler reports them on an H100 (GPT-2 small, steps 06-09), by category.
NAMES = {
    "gemm": ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off",
             "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",
             "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)",
             "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
             "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>",
             "triton_tem_fused_mm_0", "sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x128"],
    "attention": ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0",
                  "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_5_64x64x64_4x1x1_kernel0_0",
                  "void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>",
                  "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)"],
    "lm_head_ce": ["_ce_rows_kernel", "void ce::ce_rows_kernel<__nv_bfloat16, 512>(__nv_bfloat16*, long long, long long",
                   "triton_red_fused__log_softmax_nll_loss_forward_12", "triton_red_fused__log_softmax_backward_data_3",
                   "triton_per_fused_nll_loss_backward_nll_loss_forward_2", "_linear_ce_fwd_kernel"],
    "elementwise": ["triton_poi_fused_add_gelu_7", "triton_red_fused_native_layer_norm_native_layer_norm_backward_9",
                    "triton_per_fused_native_layer_norm_4", "_add_ln_fwd_kernel", "_add_ln_bwd_kernel",
                    "triton_poi_fused__scaled_dot_product_cudnn_attention_transpose_view_3",
                    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul>>",
                    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>"],
    "optimizer": ["void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
                  "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
                  "(at::native::ADAM_MODE)1, false>, double, double, double, double, double, double, bool>",
                  "Optimizer.step#AdamW.step", "aten::_fused_adamw_"],
    "other": ["Memcpy HtoD (Pinned -> Device)", "void at::native::index_elementwise_kernel_gather"],
}


def test_kernel_names_fall_in_their_categories():
    for cat, names in NAMES.items():
        for n in names:
            want = "elementwise" if n == "void at::native::index_elementwise_kernel_gather" else cat
            assert bd.classify(n) == want, n
    assert bd.classify("aten::mm") == "gemm" and bd.classify("aten::linear") == "other"
    assert bd.classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    with pytest.raises(TypeError, match="kernel name"):
        bd.classify(None)


def test_the_head_matmuls_are_the_longest_gemms_by_a_margin_or_none():
    # Two steps: per step three head matmuls of ~1.7 ms, many block GEMMs of at most 0.12 ms.
    d = [1.7, 0.1, 0.12, 1.6, 0.05, 1.75, 1.69, 0.11, 1.71, 1.62, 0.1]
    head, why = bd.split_head_gemms(d, steps=2)
    assert why is None and head == {0, 3, 5, 6, 8, 9}
    head, why = bd.split_head_gemms([1.0, 0.9, 0.8, 0.7, 0.6], steps=1)   # no gap: nothing taken
    assert head == set() and "not the longest" in why
    assert bd.split_head_gemms([1.0, 2.0], steps=1)[0] == set()
    with pytest.raises(ValueError):
        bd.split_head_gemms(d, steps=0)


def _k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def test_categorize_sums_kernel_time_per_step_and_the_busy_union():
    ev = []
    for s in range(2):   # two steps of 1000 us, 100 us idle each
        t = s * 1000
        ev += [_k(NAMES["gemm"][0], t, 25), _k(NAMES["gemm"][1], t + 25, 25)]                      # block GEMMs
        ev += [_k(NAMES["gemm"][2], t + 50 + 100 * i, 100) for i in range(3)]                    # the head's
        ev += [_k(NAMES["attention"][0], t + 350, 200), _k(NAMES["elementwise"][0], t + 550, 150),
               _k(NAMES["lm_head_ce"][0], t + 700, 60), _k(NAMES["optimizer"][0], t + 760, 90),
               _k("Memcpy DtoD", t + 850, 50, "gpu_memcpy"), _k("aten::mm", t, 900, "cpu_op")]  # host: not read
    ms, busy, span, top, notes = bd.categorize(ev, "cuda", steps=2)
    assert ms["gemm"] == pytest.approx(0.05) and ms["lm_head_ce"] == pytest.approx(0.3 + 0.06)
    assert ms["attention"] == pytest.approx(0.2) and ms["elementwise"] == pytest.approx(0.15)
    assert ms["optimizer"] == pytest.approx(0.09) and ms["other"] == pytest.approx(0.05)
    assert busy == pytest.approx(0.9) and span == pytest.approx(1.9 / 2) and notes == []
    assert top[0]["category"] == "lm_head_ce" and top[0]["ms_per_step"] == pytest.approx(0.3)
    # Without the head's margin its matmuls stay GEMMs, and the result says why.
    flat = [e for e in ev if not e["name"].startswith("void cutlass")] + [_k(NAMES["gemm"][2], 5000, 30)]
    ms, _, _, _, notes = bd.categorize(flat, "cuda", steps=2)
    assert ms["lm_head_ce"] == pytest.approx(0.06) and notes and "GEMM" in notes[0]


def test_cpu_operators_count_their_own_time_once():
    ev = [_k("aten::linear", 0, 100, "cpu_op"), _k("aten::addmm", 10, 80, "cpu_op"),
          _k("aten::copy_", 20, 10, "cpu_op"), _k("Optimizer.step#AdamW.step", 200, 50, "user_annotation"),
          _k("aten::_fused_adamw_", 210, 30, "cpu_op"), _k("PyTorch Profiler (0)", 0, 1000, "Trace")]
    own = {e["name"]: t for e, t in trace.exclusive(ev)}
    assert own["aten::linear"] == 20 and own["aten::addmm"] == 70 and own["aten::copy_"] == 10
    ms, busy, span, _, _ = bd.categorize(ev, "cpu", steps=1)
    assert ms["gemm"] == pytest.approx(0.07) and ms["optimizer"] == pytest.approx(0.05)
    assert ms["elementwise"] == pytest.approx(0.01) and ms["other"] == pytest.approx(0.02)
    assert busy == pytest.approx(0.15)


def test_gpt_floors_count_the_model_flops_and_the_stated_bytes():
    wl = get_workload("gpt")
    cfg = wl.config("full")
    ceil = {"copy_gbps": 3000.0, "matmul_tflops": {"bf16": 750.0}}
    f = bd.gpt_floors(cfg, 124_000_000, ceil)
    # GEMMs + head + the full (non-causal) attention are the model's FLOPs per step.
    assert f["gemm"]["flops"] + f["lm_head_ce"]["flops"] + 2 * f["attention"]["flops"] == pytest.approx(wl.flops_per_step(cfg))
    assert f["gemm"]["ms"] == pytest.approx(f["gemm"]["flops"] / 750e12 * 1e3)
    N, L, d = 16384, 12, 768
    assert f["elementwise"]["bytes"] == 3 * N * (L * 48 * d + 6 * d)
    assert f["optimizer"]["ms"] == pytest.approx(28 * 124e6 / 3000e9 * 1e3)
    assert f["idle"]["ms"] == 0 and bd.gpt_floors(cfg, 1, None)["gemm"]["ms"] is None


def test_the_study_runs_on_cpu_and_records_per_category(isolated_run):
    with pytest.raises(ValueError, match="profiled"):
        bd.breakdown("gpt", "05_fused_optimizer", profile="smoke", device="cpu", profiled=0)
    b = bd.breakdown("gpt", "05_fused_optimizer", profile="smoke", device="cpu", profiled=2, progress=False,
                     ceilings={"copy_gbps": 10.0, "matmul_tflops": {"bf16": 0.2}})
    assert b.status == "ok" and b.step_ms > 0 and b.busy_ms > 0
    work = sum(v for c, v in b.ms.items() if c != "idle")
    assert work == pytest.approx(b.busy_ms, rel=0.05)
    assert b.ms["gemm"] > 0 and b.ms["optimizer"] > 0 and b.ms["attention"] > 0
    recs = b.records("16_where_time_goes")
    cats = {r["fields"]["category"] for r in recs if r["metric"] == "category_ms"}
    assert cats == set(bd.CATEGORIES)
    assert len(b.rows()) == len(bd.CATEGORIES)
    text = bd.prose(recs)
    assert "05_fused_optimizer" in text and f"{b.step_ms:.3g} ms" in text
    # the step's floor beside the categories: its parts as fields, the kernels (CPU operators) counted
    floor = {r["fields"]["part"]: r for r in recs if r["metric"] == "floor_ms"}
    assert set(floor) == {"step", "flops", "bytes", "launches"}
    assert floor["step"]["value"] == pytest.approx(max(floor["flops"]["value"], floor["bytes"]["value"]))
    assert floor["launches"]["status"] == "skipped" and "per-launch" in floor["launches"]["reason"]
    assert floor["flops"]["value"] == pytest.approx(b.flops_per_step / 0.2e12 * 1e3)
    launches = [r for r in recs if r["metric"] == "launches_per_step"]
    assert len(launches) == 1 and launches[0]["value"] == b.launches > 0
    assert f"The step's floor is {floor['step']['value']:.3g} ms" in text
    assert bd.by_step(recs)["05_fused_optimizer"]["floor_ms"] == floor["step"]["value"]
    assert b.floor_row()["measured / floor"] == pytest.approx(b.step_ms / b.floor.ms)
    na = bd.breakdown("encoder_nli", "07_nice_shapes", profile="smoke", device="cpu")
    assert na.status == "n/a" and na.records("16")[0]["status"] == "n/a"


# The note a breakdown records where the size rule left the head's matmuls among the GEMMs
AMONG = "the head's matmuls are not the longest GEMMs by 3x (...): " + bd.HEAD_AMONG_GEMMS


def _breakdown_records(step, step_ms, idle, cats, notes=()):
    """Hand-made breakdown records of one step: {category: (ms, floor)}; ``notes`` as the breakdown
    records them in params."""
    def rec(metric, value, category=None):
        return {"step": step, "metric": metric, "value": value, "status": "ok",
                "fields": {"category": category} if category else {}, "params": {"notes": list(notes)}}
    recs = [rec("step_ms", step_ms), rec("category_ms", idle, "idle")]
    for c, (ms, floor) in cats.items():
        recs += [rec("category_ms", ms, c), rec("category_floor_ms", floor, c)]
    return recs


def test_a_head_below_its_floor_is_taken_with_the_gemms():
    """The fused head's matmuls are counted as GEMMs, which leaves the head's category under its floor:
    by_step (and the prose built on it) takes the two together, in the times and the floors alike."""
    cats = {"gemm": (17.2, 11.0), "lm_head_ce": (1.8, 5.0), "attention": (3.8, 1.2), "elementwise": (8.9, 7.4),
            "optimizer": (1.3, 1.2)}
    recs = _breakdown_records("17_fused_lm_head", 34.7, 0.7, cats, notes=[AMONG])
    s = bd.by_step(recs)["17_fused_lm_head"]
    assert s["head_in_gemms"] and "gemm" not in s["ms"] and "lm_head_ce" not in s["floor"]
    assert s["ms"][bd.HEAD_IN_GEMMS] == pytest.approx(19.0) and s["floor"][bd.HEAD_IN_GEMMS] == pytest.approx(16.0)
    text = bd.prose(recs)
    assert "taken together" in text and "GEMMs + LM head + cross-entropy (3 ms above a floor of 16 ms)" in text
    # a head at or above its floor stays its own category
    recs = _breakdown_records("17_fused_lm_head", 34.7, 0.7, {**cats, "lm_head_ce": (5.5, 5.0)}, notes=[AMONG])
    assert not bd.by_step(recs)["17_fused_lm_head"]["head_in_gemms"]


def test_a_head_whose_matmuls_were_found_stays_its_own_category_below_its_floor():
    """Step 26's FP8 head: the size rule found its matmuls (no note says they were counted among the
    GEMMs), and they beat the 16-bit ceiling its floor counts them at. The head stays its own
    category and the prose says why it is under its floor; with the note, the two are taken together."""
    cats = {"gemm": (13.3, 10.4), "lm_head_ce": (4.58, 4.73), "attention": (3.8, 1.2), "elementwise": (4.9, 7.3),
            "optimizer": (1.3, 1.2)}
    recs = _breakdown_records("26_fp8_head", 29.9, 0.8, cats)
    s = bd.by_step(recs)["26_fp8_head"]
    assert not s["head_in_gemms"] and s["ms"]["lm_head_ce"] == pytest.approx(4.58)
    text = bd.prose(recs)
    assert "taken together" not in text and "0.15 ms below that category's floor" in text and "FP8" in text
    assert bd.by_step(_breakdown_records("26_fp8_head", 29.9, 0.8, cats, notes=[AMONG]))["26_fp8_head"]["head_in_gemms"]


def test_the_fp8_and_epilogue_steps_carry_their_floor_caveats():
    """Step 18 runs its MLP matmuls in FP8: its GEMM floor (16-bit ceiling) is an upper bound and its
    casts have no floor; step 22 moves the GELU's passes into the GEMMs, below the elementwise floor's
    count. The breakdown says so; the other 16-bit steps carry no such note."""
    for step in ("09_cuda_graphs", "17_fused_lm_head", "21_fused_layernorm"):
        assert bd.floor_caveats(step) == [], step
    notes = bd.floor_caveats("18_fp8")
    assert len(notes) == 1 and "FP8" in notes[0] and "upper bound" in notes[0]
    notes = bd.floor_caveats("22_gelu_epilogue")
    assert len(notes) == 1 and "epilogues" in notes[0] and "below its floor" in notes[0]


# --- the step's floor, every workload -----------------------------------------------------------------------

B, IN, OUT = 5, 7, 3   # odd sizes: a transposed or padded operand would show in the count


def _linear_step(autocast):
    torch.manual_seed(0)
    lin = torch.nn.Linear(IN, OUT)
    x = torch.randn(B, IN, requires_grad=True)

    def forward_backward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = lin(x)
        y.float().square().sum().backward()   # square: a materialised output gradient (sum's alone is a stride-0 view)
    return lin, forward_backward


def test_one_linear_with_adamw_is_counted_by_hand():
    """Forward addmm (bias, x, W^T in; y out), backward mm for dx (g, W in; dx out) and for dW (g, x in; dW out):
    FLOPs 3 x 2 B IN OUT; each matmul's operands and result once, in the dtype it ran in (bf16 under autocast:
    half the bytes); AdamW 28 bytes per fp32 parameter."""
    elems = OUT + 3 * B * IN + 3 * IN * OUT + 3 * B * OUT
    n_params = IN * OUT + OUT
    for autocast, elem in ((False, 4), (True, 2)):
        lin, fb = _linear_step(autocast)
        c = bd.count_step(lin, fb)
        assert c.flops == 6 * B * IN * OUT
        assert c.activation_bytes == elem * elems, autocast
        assert c.optimizer_bytes == 28 * n_params
        assert c.calls == {"aten::addmm": 1, "aten::mm": 2}
    ceil = {"copy_gbps": 1e-6, "matmul_tflops": {"fp32": 1e-9, "bf16": 1e-8}}
    f = bd.step_floor(c.flops, c.activation_bytes + c.optimizer_bytes, ceil, "bf16", launches=9)
    assert f["flops_ms"] == pytest.approx(6 * B * IN * OUT / 1e4 * 1e3)
    assert f["bytes_ms"] == pytest.approx((2 * elems + 28 * n_params) / 1e3 * 1e3)
    assert f["ms"] == max(f["flops_ms"], f["bytes_ms"]) and f["bound"] == "bytes"
    assert f["launches"] == 9 and f["launch_ms"] is None     # counted, never given an invented cost
    f = bd.step_floor(c.flops, 0.0, ceil, "fp32")
    assert f["bound"] == "flops" and f["ms"] == pytest.approx(6 * B * IN * OUT / 1e3 * 1e3)
    assert bd.step_floor(1.0, 1.0, None)["ms"] is None


def test_adamw_bytes_take_each_tensor_in_its_dtype():
    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    p.grad = torch.zeros(10, dtype=torch.bfloat16)
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.zeros(3)
    frozen = torch.zeros(100)                      # requires no gradient: AdamW never sees it
    assert bd.adamw_bytes([p, q, frozen]) == 10 * 7 * 2 + 3 * 28


def test_bad_floor_input_names_the_argument():
    good = {"copy_gbps": 3000.0, "matmul_tflops": {"bf16": 700.0}}
    with pytest.raises(ValueError, match="ceilings copy_gbps"):
        bd.step_floor(1.0, 1.0, {**good, "copy_gbps": 0})
    with pytest.raises(ValueError, match=r"ceilings matmul_tflops\['bf16'\]"):
        bd.step_floor(1.0, 1.0, {**good, "matmul_tflops": {"bf16": 0.0}})
    with pytest.raises(ValueError, match="ceilings copy_gbps"):
        bd.step_floor(1.0, 1.0, {**good, "copy_gbps": float("nan")})
    with pytest.raises(ValueError, match="flops"):
        bd.step_floor(-1.0, 1.0, good)
    with pytest.raises(ValueError, match="nbytes"):
        bd.step_floor(1.0, float("inf"), good)
    with pytest.raises(ValueError, match="precision"):
        bd.step_floor(1.0, 1.0, good, "int8")
    with pytest.raises(ValueError, match="workload"):
        bd.workload_floor("llama", "09_cuda_graphs")
    with pytest.raises(ValueError, match="step"):
        bd.workload_floor("gpt", "99_warp_drive")
    with pytest.raises(ValueError, match="does not apply"):
        bd.workload_floor("gpt", "10_channels_last")
    with pytest.raises(ValueError, match="ceilings copy_gbps"):
        bd.workload_floor("gpt", "09_cuda_graphs", ceilings={**good, "copy_gbps": 0.0})
    with pytest.raises(ValueError, match="workload"):
        bd.last_step("llama", "cpu")
    with pytest.raises(TypeError, match="forward_backward"):
        bd.count_step(torch.nn.Linear(2, 2), None)


def test_the_floor_of_real_workloads_on_cpu():
    """vit_bdh's FLOP formula and FlopCounterMode agree exactly (its matmuls are plain bmm / mm / conv);
    AdamW's bytes are 28 a parameter of the fp32 model; the bf16 step moves about half the activation
    bytes of the fp32 one, the same matmuls in half the element size."""
    ceil = {"copy_gbps": 10.0, "matmul_tflops": {"bf16": 0.2, "fp32": 0.1}}
    wl = get_workload("vit_bdh")
    f = bd.workload_floor("vit_bdh", "03_bf16_autocast", profile="smoke", ceilings=ceil)
    n_params = sum(p.numel() for p in wl.build(wl.config("smoke"), bd.settings_for("03_bf16_autocast"), 0).parameters())
    assert f.flops == wl.flops_per_step(wl.config("smoke")) == pytest.approx(f.flops_counted, rel=1e-9)
    assert f.optimizer_bytes == 28 * n_params and f.precision == "bf16"
    assert f.ms == pytest.approx(max(f.flops / 0.2e12, (f.activation_bytes + f.optimizer_bytes) / 10e9) * 1e3)
    fp32 = bd.workload_floor("vit_bdh", "01_baseline_fp32", profile="smoke", ceilings=ceil)
    # most of its matmuls run in bf16 under autocast; the few it keeps in fp32 hold the ratio under 2
    assert 1.9 < fp32.activation_bytes / f.activation_bytes <= 2.0 and fp32.precision == "fp32"
    assert fp32.flops_ms == pytest.approx(2 * f.flops_ms)
    # the BK-Core, a fused hwlib op, is counted with the matmuls
    bk = bd.workload_floor("resnet_bk", "12_bk_core", profile="smoke")
    assert bk.calls.get("hwlib::resolvent_features") and bk.ms is None


def test_each_workload_defaults_to_its_last_step():
    want = {"gpt": "09_cuda_graphs", "vit_bdh": "10_channels_last", "vit_bdh_linear": "10_channels_last",
            "encoder_nli": "11_sequence_packing", "resnet_bk": "12_bk_core"}
    assert {w: bd.last_step(w, "cpu") for w in want} == want


def test_a_classifier_has_no_lm_head_to_split():
    ev = [_k(NAMES["gemm"][2], 100 * i, 100) for i in range(3)] + [_k(NAMES["gemm"][0], 300 + 10 * i, 10) for i in range(5)]
    ms, _, _, _, notes = bd.categorize(ev, "cuda", steps=1)
    assert ms["lm_head_ce"] == pytest.approx(0.3)
    ms, _, _, _, notes = bd.categorize(ev, "cuda", steps=1, lm_head=False)
    assert ms["lm_head_ce"] == 0 and ms["gemm"] == pytest.approx(0.35) and notes == []
    assert bd.launches_per_step(ev, "cuda", steps=2) == 4


def test_steps_for_each_workload():
    assert bd.steps_for("gpt", None, "cpu") == {"gpt": ["09_cuda_graphs"]}
    assert bd.steps_for(["gpt", "resnet_bk"], ["05", "12_bk_core"], "cpu") == {
        "gpt": ["05_fused_optimizer", "12_bk_core"], "resnet_bk": ["05_fused_optimizer", "12_bk_core"]}
    assert bd.steps_for(["gpt", "encoder_nli"], {"gpt": ["05_fused_optimizer"]}, "cpu") == {
        "gpt": ["05_fused_optimizer"], "encoder_nli": ["11_sequence_packing"]}
    with pytest.raises(ValueError, match="workload"):
        bd.steps_for(["gpt", "llama"], None, "cpu")
    with pytest.raises(ValueError, match="workloads"):
        bd.steps_for([], None, "cpu")
    with pytest.raises(ValueError, match="step"):
        bd.steps_for("gpt", ["42_nothing"], "cpu")
