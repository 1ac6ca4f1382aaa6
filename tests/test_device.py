import pytest
import torch

from hwlib import device as D


def fake(kind="cuda", cap=(9, 0), mem=80.0, name="NVIDIA H100 80GB HBM3", triton="3.6.0"):
    return D.DeviceInfo(kind=kind, name=name, capability=list(cap) if kind == "cuda" else None,
                        total_mem_gib=mem if kind == "cuda" else None, sm_count=132, l2_mib=50.0, cpu_count=16,
                        host="h", colab=False, versions={"triton": triton})


def test_unknown_device_names_value_and_choices():
    with pytest.raises(D.ChoiceError) as e:
        D.resolve_device("tpu")
    assert "'tpu'" in str(e.value) and "cuda" in str(e.value) and "cpu" in str(e.value)


def test_cuda_without_gpu_is_a_clear_error(cpu_only):
    with pytest.raises(D.Unavailable, match="no CUDA GPU"):
        D.resolve_device("cuda")


def test_auto_and_cpu_resolve():
    assert D.resolve_device("cpu") == torch.device("cpu")
    assert D.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert D.resolve_device(" CPU ") == torch.device("cpu")


@pytest.mark.parametrize("cap,bf16,tf32,fp8", [((7, 5), False, False, False), ((8, 0), True, True, False),
                                               ((8, 9), True, True, True), ((9, 0), True, True, True)])
def test_capability_gates(cap, bf16, tf32, fp8):
    di = fake(cap=cap)
    assert (D.supports_bf16(di), D.supports_tf32(di), D.supports_fp8(di)) == (bf16, tf32, fp8)


@pytest.mark.parametrize("cap,cudnn,ok", [((9, 0), 91900, True), ((8, 0), 90100, True), ((7, 5), 91900, False),
                                         ((9, 0), 8907, False), ((9, 0), None, False)])
def test_cudnn_attention_gate(cap, cudnn, ok):
    di = fake(cap=cap)
    di.versions["cudnn"] = cudnn
    assert D.supports_cudnn_attention(di) is ok
    assert not D.supports_cudnn_attention(fake(kind="cpu"))


def test_cpu_gates():
    di = fake(kind="cpu")
    assert D.supports_bf16(di) and not D.supports_tf32(di) and not D.supports_fp8(di)


def test_compile_gate_on_old_gpu_and_without_triton():
    assert D.supports_compile(fake(cap=(6, 0)))[0] is False
    ok, why = D.supports_compile(fake(triton=None))
    assert not ok and "Triton" in why


def test_short_names_and_datasheet():
    assert D.short_name("NVIDIA H100 80GB HBM3") == "h100"
    assert D.short_name("NVIDIA A100-SXM4-40GB") == "a100"
    sheet = D.datasheet(fake())
    assert sheet["matmul_tflops"]["bf16"] == pytest.approx(989.0) and sheet["copy_gbps"] == pytest.approx(3350)
    assert D.datasheet(fake(name="Mystery GPU")) is None
    assert D.datasheet(fake(kind="cpu")) is None


def test_recommended_settings_follow_capability_and_memory():
    old = {r["setting"]: r for r in D.recommended_settings(fake(cap=(7, 5), mem=16.0, name="Tesla T4"))}
    new = {r["setting"]: r for r in D.recommended_settings(fake(cap=(9, 0), mem=80.0))}
    assert old["precision"]["value"].startswith("fp16") and "GradScaler" in old["precision"]["value"]
    assert new["precision"]["value"] == "bf16 autocast"
    assert old["TF32 matmuls"]["value"] == "n/a" and new["TF32 matmuls"]["value"] == "on"
    mb_old = int(old["GPT-2 small micro-batch (1024 tokens)"]["value"])
    mb_new = int(new["GPT-2 small micro-batch (1024 tokens)"]["value"])
    assert 0 < mb_old < mb_new and mb_new & (mb_new - 1) == 0   # a power of two, growing with memory
    assert all(r["why"] for r in new.values())


def test_env_report_on_this_machine():
    rep = D.env_report("auto")
    assert rep["kind"] in ("cpu", "cuda") and rep["versions"]["torch"] == torch.__version__
    text = D.format_env_report("auto")
    assert "torch " + torch.__version__ in text and "gates" in text


def test_ceilings_include_fp16_for_gpus_without_bf16(tmp_path, monkeypatch):
    """fp16 is measured beside bf16: MFU of a step on a GPU without bf16 (T4) needs it."""
    from hwlib import ceilings, notebook, query
    # CPU sizes small enough for a test (fp16 matmuls on a CPU are slow): what is measured, not how fast
    monkeypatch.setitem(ceilings.SIZES, "cpu", {"copy_bytes": 1 << 20, "matmul_n": 64})
    c = ceilings.measure("cpu")
    assert set(c["matmul_tflops"]) | set(c["skipped"]) == set(ceilings.MATMUL_DTYPES)
    assert c["matmul_tflops"]["fp16"] > 0
    recs = notebook.record_ceilings(c, notebook="00_environment", profile="smoke", run="ceil")
    fp16 = [r for r in recs if r["fields"].get("dtype") == "fp16"]
    assert len(fp16) == 1 and fp16[0]["value"] == c["matmul_tflops"]["fp16"]
    assert len(query.select(query.load("ceil"), metric="matmul_tflops")) == len(ceilings.MATMUL_DTYPES)


def test_the_report_names_the_host_cpu_that_bounds_launch_heavy_steps(monkeypatch):
    from hwlib import device
    monkeypatch.setattr(device, "cpu_model", lambda: "Example CPU @ 2.0GHz")
    i = device.info("cpu")
    assert i.cpu_model == "Example CPU @ 2.0GHz" and i.to_dict()["cpu_model"] == i.cpu_model
    assert "(Example CPU @ 2.0GHz)" in device.format_env_report("cpu")
    monkeypatch.setattr(device, "cpu_model", lambda: None)
    assert "()" not in device.format_env_report("cpu")
