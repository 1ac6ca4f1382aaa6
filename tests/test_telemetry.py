"""Telemetry: NVML readings (through a fake NVML on CPU machines), the background sampler, a read
that fails mid-run, the summary of a window, and the ladder's records carrying it."""

import os
import sys
import time
import types

import pytest
import torch

from hwlib import query, results, telemetry
from hwlib.ladder import record
from hwlib.ladder.run import run_step
from hwlib.profiles import Plan


class Boom(Exception):
    """What NVML raises when the GPU fell off the bus (NVMLError_GpuIsLost)."""


def fake_nvml(monkeypatch, *, power=True, lose_after=None):
    """A pynvml module with two GPUs; torch's device 0 is NVML's index 1 (matched by UUID). With
    ``lose_after``, utilisation reads raise after that many calls (a GPU reset mid-run)."""
    calls = {"util": 0, "init": 0, "shutdown": 0}

    class NotSupported(Exception):
        pass

    class NoPermission(Exception):
        pass

    def util(h):
        calls["util"] += 1
        if lose_after is not None and calls["util"] > lose_after:
            raise Boom("GPU is lost")
        return types.SimpleNamespace(gpu=87, memory=40)

    def power_usage(h):
        if not power:
            raise NotSupported()
        return 612_500   # mW

    procs = [types.SimpleNamespace(pid=os.getpid()), types.SimpleNamespace(pid=4242)]
    nv = types.SimpleNamespace(
        NVMLError_NotSupported=NotSupported, NVMLError_NoPermission=NoPermission,
        NVML_CLOCK_SM=0, NVML_CLOCK_MEM=1, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: ["GPU-other", "GPU-abc"][h].encode(),
        nvmlDeviceGetName=lambda h: b"Fake H100",
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30),
        nvmlDeviceGetClockInfo=lambda h, kind: [1980, 2619][kind],
        nvmlDeviceGetPowerUsage=power_usage,
        nvmlDeviceGetTemperature=lambda h, kind: 61,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4 | 0x1,
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs if h == 1 else [],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [],
    )
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="abc"))
    return calls


def test_nvml_readings_come_from_the_gpu_torch_uses(monkeypatch):
    calls = fake_nvml(monkeypatch)
    src = telemetry.NvmlSource("cuda:0")
    assert src.name == "Fake H100" and src._handle == 1      # matched by UUID, not by index
    s = src.read()
    assert (s["gpu_util"], s["mem_util"], s["mem_used_gib"], s["mem_total_gib"]) == (87.0, 40.0, 3.0, 80.0)
    assert (s["sm_clock_mhz"], s["mem_clock_mhz"], s["power_w"], s["temp_c"]) == (1980.0, 2619.0, 612.5, 61.0)
    assert s["reasons"] == ["gpu_idle", "sw_power_cap"]
    assert s["other_pids"] == [4242]                           # this process is not "another"
    src.close()
    assert calls["shutdown"] == calls["init"] == 1


def test_an_unsupported_reading_is_none_not_an_error(monkeypatch):
    fake_nvml(monkeypatch, power=False)
    src = telemetry.NvmlSource("cuda:0")
    assert src.read()["power_w"] is None and src.read()["gpu_util"] == 87.0


def test_no_nvml_is_a_clear_state_never_an_error(monkeypatch):
    def refuse():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=refuse))
    with pytest.raises(telemetry.TelemetryError, match="NVML unavailable.*libnvidia-ml"):
        telemetry.NvmlSource("cuda:0")
    src, state = telemetry.open_source("cpu")
    assert isinstance(src, telemetry.HostSource) and state.startswith("no GPU telemetry")
    with telemetry.Sampler("cpu", interval_s=0.01) as s:
        time.sleep(0.05)
    summ = s.summary()
    assert summ["gpu_telemetry"] is False and summ["state"].startswith("no GPU telemetry")
    assert summ["samples"] >= 2 and summ["gpu_util_pct"] is None and summ["cpu_util_pct"] is not None
    assert 0.0 <= summ["cpu_util_pct"]["mean"] <= 100.0


def test_a_gpu_lost_mid_run_is_said_once_and_host_readings_go_on(monkeypatch):
    fake_nvml(monkeypatch, lose_after=3)
    s = telemetry.Sampler("cpu", interval_s=0.01, source=telemetry.NvmlSource("cuda:0")).start()
    deadline = time.monotonic() + 5
    while len(s.samples) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    got = s.samples
    assert [x.get("gpu_util") for x in got[:3]] == [87.0] * 3
    assert got[3].get("error") == "Boom: GPU is lost"
    assert all("cpu_util" in x and "gpu_util" not in x for x in got[4:])   # host readings after the loss
    assert s.lost.startswith("GPU telemetry lost at") and "Boom: GPU is lost" in s.lost and not s.gpu
    summ = s.summary()
    assert summ["lost"] == s.lost and summ["errors"] == 1 and summ["gpu_telemetry"] is True


def test_summary_of_a_window():
    samples = [
        {"t": 0.0, "gpu_util": 50, "sm_clock_mhz": 1400, "power_w": 300.0, "temp_c": 60, "mem_used_gib": 2.0,
         "reasons": ["gpu_idle"], "other_pids": [], "cpu_util": 10.0},
        {"t": 0.5, "gpu_util": 100, "sm_clock_mhz": 1980, "power_w": 700.0, "temp_c": 70, "mem_used_gib": 9.5,
         "reasons": ["sw_power_cap"], "other_pids": [77], "cpu_util": 30.0},
        {"t": 1.0, "gpu_util": 90, "sm_clock_mhz": 1755, "power_w": 650.0, "temp_c": 66, "mem_used_gib": 9.0,
         "reasons": ["hw_thermal_slowdown", "sw_power_cap"], "other_pids": [77, 12], "cpu_util": 20.0},
        {"t": 1.5, "error": "x"},
    ]
    s = telemetry.summarize(samples, state="nvml: Fake")
    assert (s["samples"], s["seconds"], s["errors"], s["gpu_telemetry"]) == (4, 1.5, 1, True)
    assert s["sm_clock_mhz"] == {"min": 1400, "median": 1755, "max": 1980}
    assert s["gpu_util_pct"] == {"mean": 80.0, "max": 100} and s["power_w"] == {"mean": 550.0, "max": 700.0}
    assert (s["temp_c_max"], s["mem_used_gib_max"]) == (70, 9.5)
    assert s["throttle_reasons"] == ["hw_thermal_slowdown", "sw_power_cap"]   # idle is not throttling
    assert s["other_pids"] == [12, 77] and s["cpu_util_pct"] == {"mean": 20.0, "max": 30.0}
    line = telemetry.explain(s)
    assert "SM 1400-1980 MHz" in line and "throttled: hw_thermal_slowdown, sw_power_cap" in line
    assert "other processes on the GPU: 12, 77" in line
    assert telemetry.reasons_of(0x4 | 0x1 | 0x1000) == ["gpu_idle", "sw_power_cap", "0x1000"]
    assert telemetry.explain(None) == "no telemetry recorded" and "unreadable" in telemetry.explain("x")


def test_sampler_bounds_and_arguments():
    src = types.SimpleNamespace(kind="fake", name="f", read=lambda: {"cpu_util": 1.0}, close=lambda: None)
    s = telemetry.Sampler(source=src, interval_s=0.005, max_samples=5).start()
    deadline = time.monotonic() + 5
    while s.since(0)[1] < 12 and time.monotonic() < deadline:
        time.sleep(0.005)
    s.stop()
    new, total = s.since(0)
    assert len(s.samples) == 5 and total >= 12 and len(new) == 5          # only the newest are kept
    assert s.since(total) == ([], total)
    with pytest.raises(RuntimeError, match="already started"):
        s.start()
    with pytest.raises(ValueError, match="interval_s"):
        telemetry.Sampler("cpu", interval_s=0)
    with pytest.raises(ValueError, match="max_samples"):
        telemetry.Sampler("cpu", max_samples=1)
    with pytest.raises(TypeError, match="telemetry"):
        results.make_record(notebook="n", workload="w", step="s", metric="m", value=1, unit="ms", telemetry="hot")


def test_the_ladder_records_the_timed_window(isolated_run):
    plan = Plan(check=1, warmup=0, timed=2)
    res = run_step("gpt", "01_baseline_fp32", profile="smoke", device="cpu", plan=plan)
    t = res.telemetry
    assert t is not None and t["samples"] >= 2 and t["gpu_telemetry"] is False and t["lost"] is None
    assert t["state"].startswith("no GPU telemetry")
    record.record(res, notebook="t")
    recs = {r["metric"]: r for r in query.load()}
    assert recs["ms_per_step"]["telemetry"] == t
    assert "telemetry" not in recs["model_tflops"]           # the window's summary sits on its timing
    bare = run_step("gpt", "01_baseline_fp32", profile="smoke", device="cpu", plan=plan, telemetry=False)
    assert bare.telemetry is None and bare.timing.n == 2
