"""What the GPU (or, without one, the host) was doing while something ran: sampled in a background
thread, summarised per timed window.

A ``Sampler`` reads a *source* a few times a second in a daemon thread and keeps the readings:

* ``NvmlSource`` (through ``nvidia-ml-py``, import name ``pynvml``): GPU and memory utilisation,
  memory used, SM and memory clocks, power, temperature, the active clock-event (throttle) reasons
  and the other processes holding a context on the GPU, plus the host's CPU and memory;
* ``HostSource``: the host's CPU utilisation and memory only. It is what a machine without NVML
  (a CPU, a driverless container, NVML refused) gets, and the sampler says so in ``state``
  ("no GPU telemetry: ..."), never by raising.

NVML calls are ctypes calls, which release the GIL while they wait on the driver, and the thread
does a few of them a few times a second: the cost on a measured step is small, and notebook 98
measures it rather than assuming it. Nothing here launches GPU work or synchronises a stream.

A read that fails mid-run (the GPU fell off the bus, the driver was reloaded, NVML shut down
under us) does not stop the sampler: the failure is kept as ``lost`` with the time it happened, the
sampler goes on with host readings, and every summary made afterwards carries the message.

``summarize`` turns readings into the few numbers that explain a slow or noisy timing: clocks
(min/median/max), power, peak temperature, any throttle reason seen, any other process seen.
The ladder stores that summary in each timed window's ``ms_per_step`` record.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

from .device import resolve_device

# Clock-event reasons (NVML's "throttle reasons"), by bit. GPU idle is not a slowdown of work, and
# application clocks are a setting, so neither counts as throttling in a summary.
REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"),
)
NOT_THROTTLING = frozenset({"gpu_idle", "applications_clocks_setting"})
GIB = 2**30


class TelemetryError(RuntimeError):
    """A telemetry source could not be opened or read."""


def reasons_of(mask: int) -> list[str]:
    """Names of the clock-event reason bits set in ``mask``; unknown bits as hex."""
    names = [name for bit, name in REASONS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


# --- sources --------------------------------------------------------------------------------------

class HostSource:
    """The host's CPU utilisation (percent of all cores since the previous read) and memory in use."""

    kind = "host"
    name = "host"

    def __init__(self):
        try:
            import psutil   # ipykernel depends on it; without it, /proc where there is one
        except ImportError:
            psutil = None
        self._psutil = psutil
        self._last = self._cpu_times()

    def _cpu_times(self):
        if self._psutil is not None:
            t = self._psutil.cpu_times()
            busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
            return busy, sum(t)
        try:
            vals = [float(v) for v in open("/proc/stat").readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
        return sum(vals) - idle, sum(vals)

    def _mem_used_gib(self):
        if self._psutil is not None:
            return self._psutil.virtual_memory().used / GIB
        try:
            info = dict(l.split(":", 1) for l in open("/proc/meminfo"))
            kib = lambda k: float(info[k].split()[0])
            return (kib("MemTotal") - kib("MemAvailable")) / 2**20
        except (OSError, KeyError, ValueError):
            return None

    def read(self) -> dict:
        now = self._cpu_times()
        cpu = None
        if now is not None and self._last is not None and now[1] > self._last[1]:
            cpu = 100.0 * (now[0] - self._last[0]) / (now[1] - self._last[1])
        self._last = now
        return {"cpu_util": cpu, "host_mem_used_gib": self._mem_used_gib()}

    def close(self) -> None:
        pass


class NvmlSource(HostSource):
    """One GPU through NVML (plus the host). Opening it raises ``TelemetryError`` with the reason
    when NVML is missing, refuses, or cannot find the GPU that torch calls ``device``."""

    kind = "nvml"

    def __init__(self, device):
        super().__init__()
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception as e:   # no library, no driver, or refused
            raise TelemetryError(f"NVML unavailable ({type(e).__name__}: {e})") from None
        self._nvml = pynvml
        try:
            self._handle = self._find(device)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            self.close()
            raise
        self._unsupported: set[str] = set()
        self._me = os.getpid()

    def _find(self, device):
        """The NVML handle of torch's ``device``, matched by UUID (CUDA_VISIBLE_DEVICES may reorder)."""
        import torch
        nv = self._nvml
        uuid = str(torch.cuda.get_device_properties(device).uuid).removeprefix("GPU-")
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            u = nv.nvmlDeviceGetUUID(h)
            u = u.decode() if isinstance(u, bytes) else str(u)
            if u.removeprefix("GPU-") == uuid:
                return h
        raise TelemetryError(f"NVML lists no GPU with the UUID of {device} ({uuid})")

    def _optional(self, key: str, fn):
        """A reading this GPU may not support (power on some boards): None, asked once."""
        if key in self._unsupported:
            return None
        try:
            return fn()
        except (self._nvml.NVMLError_NotSupported, self._nvml.NVMLError_NoPermission):
            self._unsupported.add(key)
            return None

    def read(self) -> dict:
        nv, h = self._nvml, self._handle
        out = super().read()
        # Utilisation and memory every GPU reports: a failure here means the GPU or NVML is gone,
        # and it propagates to the sampler, which records it as lost.
        util = nv.nvmlDeviceGetUtilizationRates(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        out.update(gpu_util=float(util.gpu), mem_util=float(util.memory), mem_used_gib=mem.used / GIB,
                   mem_total_gib=mem.total / GIB)
        out["sm_clock_mhz"] = self._optional("sm", lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))
        out["mem_clock_mhz"] = self._optional("mem", lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)))
        out["power_w"] = self._optional("power", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1e3)
        out["temp_c"] = self._optional("temp", lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
        get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons   # the older name, in older nvidia-ml-py
        mask = self._optional("reasons", lambda: int(get_reasons(h)))
        out["reasons"] = reasons_of(mask) if mask is not None else None

        def others():
            procs = list(nv.nvmlDeviceGetComputeRunningProcesses(h)) + list(nv.nvmlDeviceGetGraphicsRunningProcesses(h))
            return sorted({p.pid for p in procs if p.pid != self._me})
        out["other_pids"] = self._optional("procs", others)
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()   # reference-counted: other users' nvmlInit stays valid
        except Exception:   # already gone (the failure being reported, most likely)
            pass


def open_source(device="auto") -> tuple[HostSource, str]:
    """The best source for ``device`` and a one-line state: "nvml: <GPU name>", or
    "no GPU telemetry: <why>" with a ``HostSource``. Never raises for a missing GPU or NVML."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return HostSource(), f"no GPU telemetry: the device is {dev.type} (host CPU and memory only)"
    try:
        src = NvmlSource(dev)
    except Exception as e:
        return HostSource(), f"no GPU telemetry: {e} (host CPU and memory only)"
    return src, f"nvml: {src.name}"


# --- the sampler ----------------------------------------------------------------------------------

class Sampler:
    """Readings of ``source`` (default: ``open_source(device)``) every ``interval_s`` seconds in a
    daemon thread, each a dict with ``t`` (seconds since ``start``) and the source's fields.

    ``state`` says what is sampled ("nvml: ..." or "no GPU telemetry: ..."); ``lost`` says when and
    why GPU readings stopped mid-run (then host readings go on). At most ``max_samples`` readings
    are kept (the oldest are dropped): a monitor left running for hours stays bounded."""

    def __init__(self, device="auto", interval_s: float = 0.2, *, source=None, max_samples: int = 36000):
        if not isinstance(interval_s, (int, float)) or isinstance(interval_s, bool) or not 0.005 <= interval_s <= 60:
            raise ValueError(f"interval_s must be a number of seconds in [0.005, 60], got {interval_s!r}")
        if not isinstance(max_samples, int) or max_samples < 2:
            raise ValueError(f"max_samples must be an int >= 2, got {max_samples!r}")
        if source is None:
            self.source, self.state = open_source(device)
        else:
            self.source, self.state = source, f"{getattr(source, 'kind', 'custom')}: {getattr(source, 'name', '?')}"
        self.interval_s = float(interval_s)
        self.max_samples = max_samples
        self.lost: str | None = None
        self._samples: list[dict] = []
        self._dropped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = None

    @property
    def gpu(self) -> bool:
        """Whether GPU readings are (still) coming in."""
        return getattr(self.source, "kind", "") == "nvml" and self.lost is None

    def _read_once(self) -> None:
        t = time.monotonic() - self._t0
        try:
            s = dict(self.source.read())
        except Exception as e:   # the GPU went away mid-run: say so once, go on with the host
            msg = f"{type(e).__name__}: {e}".strip(": ")
            if self.lost is None:
                self.lost = f"GPU telemetry lost at {t:.1f} s ({msg}); host readings go on"
                old, self.source = self.source, HostSource()
                try:
                    old.close()
                except Exception:
                    pass
            s = {"error": msg}
        s["t"] = t
        with self._lock:
            self._samples.append(s)
            if len(self._samples) > self.max_samples:
                drop = len(self._samples) - self.max_samples
                del self._samples[:drop]
                self._dropped += drop

    def _loop(self) -> None:
        self._read_once()
        while not self._stop.wait(self.interval_s):
            self._read_once()
        self._read_once()   # a window shorter than the interval still gets a reading at its end

    def start(self) -> "Sampler":
        if self._thread is not None:
            raise RuntimeError("Sampler.start: already started (a sampler samples one window)")
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="hwlib-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "Sampler":
        """Stop sampling (idempotent) and release the source."""
        if self._thread is not None and self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=max(5.0, 4 * self.interval_s))
        if not self._stop.is_set():
            self._stop.set()
        try:
            self.source.close()
        except Exception:
            pass
        return self

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def samples(self) -> list[dict]:
        with self._lock:
            return list(self._samples)

    def since(self, n: int) -> tuple[list[dict], int]:
        """Readings after the first ``n`` ever taken, and the new count (for a live view that
        appends only what is new)."""
        with self._lock:
            total = self._dropped + len(self._samples)
            start = max(0, n - self._dropped)
            return list(self._samples[start:]), total

    def summary(self) -> dict:
        return summarize(self.samples, state=self.state, lost=self.lost)


# --- summaries ------------------------------------------------------------------------------------

def _vals(samples, key):
    return [s[key] for s in samples if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool)]


def _spread(vals, digits=1):
    if not vals:
        return None
    return {"min": round(min(vals), digits), "median": round(statistics.median(vals), digits),
            "max": round(max(vals), digits)}


def _mean_max(vals, digits=1):
    if not vals:
        return None
    return {"mean": round(statistics.fmean(vals), digits), "max": round(max(vals), digits)}


def summarize(samples: list[dict], *, state: str = "", lost: str | None = None) -> dict:
    """The few numbers that explain a window's timing, JSON-ready: how many readings over how many
    seconds, GPU utilisation, peak memory, SM and memory clocks, power, peak temperature, throttle
    reasons seen (idle and application clocks left out), other processes seen, host CPU, and the
    state (``gpu_telemetry`` False with the reason when there was none; ``lost`` when it stopped)."""
    ts = _vals(samples, "t")
    reasons = sorted({r for s in samples for r in (s.get("reasons") or ()) if r not in NOT_THROTTLING})
    others = sorted({p for s in samples for p in (s.get("other_pids") or ())})
    gpu = bool(_vals(samples, "gpu_util"))
    mem = _vals(samples, "mem_used_gib")
    temp = _vals(samples, "temp_c")
    host_mem = _vals(samples, "host_mem_used_gib")
    return {
        "state": state or ("nvml" if gpu else "host"),
        "gpu_telemetry": gpu,
        "samples": len(samples),
        "seconds": round(max(ts) - min(ts), 3) if ts else 0.0,
        "errors": sum(1 for s in samples if s.get("error")),
        "lost": lost,
        "gpu_util_pct": _mean_max(_vals(samples, "gpu_util")),
        "mem_used_gib_max": round(max(mem), 3) if mem else None,
        "sm_clock_mhz": _spread(_vals(samples, "sm_clock_mhz"), 0),
        "mem_clock_mhz": _spread(_vals(samples, "mem_clock_mhz"), 0),
        "power_w": _mean_max(_vals(samples, "power_w")),
        "temp_c_max": max(temp) if temp else None,
        "throttle_reasons": reasons,
        "other_pids": others,
        "cpu_util_pct": _mean_max(_vals(samples, "cpu_util")),
        "host_mem_used_gib_max": round(max(host_mem), 2) if host_mem else None,
    }


def explain(summary: dict | None) -> str:
    """A summary in one line, for a table cell beside a timing: what could make it slow or noisy."""
    if not summary:
        return "no telemetry recorded"
    if not isinstance(summary, dict):
        return f"unreadable telemetry ({type(summary).__name__})"
    parts = []
    if not summary.get("gpu_telemetry"):
        parts.append(str(summary.get("state") or "no GPU telemetry"))
    sm = summary.get("sm_clock_mhz")
    if isinstance(sm, dict) and sm.get("min") is not None:
        parts.append(f"SM {sm['min']:.0f}-{sm['max']:.0f} MHz")
    pw = summary.get("power_w")
    if isinstance(pw, dict) and pw.get("max") is not None:
        parts.append(f"power max {pw['max']:.0f} W")
    if summary.get("temp_c_max") is not None:
        parts.append(f"{summary['temp_c_max']:.0f} C max")
    util = summary.get("gpu_util_pct")
    if isinstance(util, dict) and util.get("mean") is not None:
        parts.append(f"GPU busy {util['mean']:.0f}% mean")
    cpu = summary.get("cpu_util_pct")
    if isinstance(cpu, dict) and cpu.get("mean") is not None:
        parts.append(f"host CPU {cpu['mean']:.0f}% mean")
    if summary.get("throttle_reasons"):
        parts.append("throttled: " + ", ".join(map(str, summary["throttle_reasons"])))
    if summary.get("other_pids"):
        parts.append("other processes on the GPU: " + ", ".join(map(str, summary["other_pids"])))
    if summary.get("lost"):
        parts.append(str(summary["lost"]))
    return "; ".join(parts) or "nothing sampled"
