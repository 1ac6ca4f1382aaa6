"""What the machine is: GPU facts, capability gates, Colab detection, the environment report.

Everything here is read off the machine; nothing launches a kernel. The datasheet table holds
vendor figures (dense, no sparsity) so that measured ceilings can be shown beside them; they are
labelled as datasheet figures wherever they appear and never enter a measured ratio.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DEVICE_CHOICES = ("auto", "cuda", "cpu")


class ChoiceError(ValueError):
    """A named argument got a value outside its choices; the message names both."""

    def __init__(self, argument: str, value, choices):
        self.argument, self.value, self.choices = argument, value, tuple(choices)
        super().__init__(f"unknown {argument} {value!r}; choose one of: {', '.join(map(str, self.choices))}")


class SettingError(ValueError):
    """An environment variable hwlib reads holds a value it cannot use; the message names both."""


class Unavailable(RuntimeError):
    """A step, dtype or device that this machine cannot run, with the reason."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda when a GPU is visible, else cpu; 'cuda' without a GPU is a clear error."""
    if isinstance(device, torch.device):
        name = str(device)
    else:
        name = str(device).strip().lower()
    base = name.split(":")[0]
    if base not in DEVICE_CHOICES or (base != "cuda" and name not in (base, f"{base}:0")):
        # cpu:7 names no device (torch has one CPU device); auto takes no index
        raise ChoiceError("device", device, DEVICE_CHOICES + ("cuda:N",))
    memory_cap_gib()   # a bad cap is an error on every device, not only where a GPU applies it
    if base == "auto":
        return apply_memory_cap(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if base == "cuda":
        if not torch.cuda.is_available():
            raise Unavailable(f"device {device!r} asked for, but no CUDA GPU is visible to torch "
                              f"{torch.__version__} (a CPU build, or no driver); use device='cpu' or 'auto'")
        idx = name.split(":")[1] if ":" in name else "0"
        if not idx.isdigit() or int(idx) >= torch.cuda.device_count():
            raise ChoiceError("device", device, [f"cuda:{i}" for i in range(torch.cuda.device_count())])
        return apply_memory_cap(torch.device(f"cuda:{idx}"))
    return torch.device("cpu")


# A smaller GPU, played on a larger one: HWLIB_MEMORY_CAP_GIB=16 lets every process that resolves a
# device (notebooks, their subprocesses, torchrun ranks: the variable is inherited) allocate at most
# that much, through the caching allocator's per-process fraction.
MEMORY_CAP_ENV = "HWLIB_MEMORY_CAP_GIB"


def memory_cap_gib() -> float | None:
    """The cap ``$HWLIB_MEMORY_CAP_GIB`` asks for (GiB), None when unset; a clear error naming the
    variable for anything but a positive number."""
    raw = os.environ.get(MEMORY_CAP_ENV, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not (v > 0 and v != float("inf")):
        raise SettingError(f"{MEMORY_CAP_ENV} must be a positive, finite number of GiB, got {raw!r}: "
                           f"set it to e.g. 16, or unset it for the GPU's whole memory")
    return v


def apply_memory_cap(device: torch.device) -> torch.device:
    """Cap this process's allocations on ``device`` at ``memory_cap_gib()`` (no-op on a CPU, without
    the variable, or with a cap above the GPU's memory). Idempotent: the fraction is set again."""
    cap = memory_cap_gib()
    if cap is None or device.type != "cuda":
        return device
    # torch's fraction setter wants an index: "cuda" alone (what "auto" resolves to) is refused
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total), index)
    return device


def usable_memory_gib(device: torch.device) -> float | None:
    """The GPU memory this process may allocate: the device's, or the cap where it is lower."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    cap = memory_cap_gib()
    return min(total, cap) if cap else total


def other_gpu_processes(device: str | torch.device = "auto") -> list[int] | None:
    """Pids of other processes holding a context on this GPU (through NVML), so that a timing made
    beside them can be marked contended. [] on a CPU; None when NVML cannot tell (no library, no
    permission, or a GPU it cannot map): unknown, which is not the same as none."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return []
    try:
        import pynvml
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
        handle = next((h for h in (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount()))
                       if str(pynvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-") == uuid.removeprefix("GPU-")),
                      None)
        if handle is None:
            return None
        procs = (list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
                 + list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)))
    except Exception:   # NVML missing, too old, or refused: say "unknown", never fail a measurement
        return None
    me = os.getpid()
    return sorted({p.pid for p in procs if p.pid != me})


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


@dataclass
class DeviceInfo:
    kind: str                        # "cuda" or "cpu"
    name: str
    capability: list[int] | None     # [major, minor] for CUDA
    total_mem_gib: float | None
    sm_count: int | None
    l2_mib: float | None
    cpu_count: int
    host: str
    colab: bool
    versions: dict = field(default_factory=dict)
    # the host CPU: steps that launch many small kernels (eager, accumulation, generation) are bound by
    # it, so the same GPU reads differently on another host
    cpu_model: str | None = None

    @property
    def short(self) -> str:
        """A folder-friendly name: 'h100', 'a100', 'cpu'."""
        return short_name(self.name) if self.kind == "cuda" else "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def short_name(gpu_name: str) -> str:
    n = gpu_name.lower()
    for key in ("h200", "h100", "a100", "a10g", "l40s", "l4", "t4", "v100", "4090", "3090", "a6000"):
        if key in n:
            return key
    return "".join(c for c in n if c.isalnum())[:16] or "gpu"


def versions() -> dict:
    # str(): torch's version is its own str subclass, and a record holding it unpickles only where torch
    # imports (a worker that appends records would load torch for it)
    out = {"python": platform.python_version(), "torch": str(torch.__version__),
           "cuda": torch.version.cuda, "cudnn": None, "triton": None}
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # a CPU build has no cuDNN
        pass
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        try:
            import pynvml
            pynvml.nvmlInit()
            drv = pynvml.nvmlSystemGetDriverVersion()
            out["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        except Exception:  # NVML missing or not initialisable: report what torch knows
            out["driver"] = None
    return out


@functools.lru_cache(maxsize=1)
def cpu_model() -> str | None:
    """The host CPU's model name (Linux: /proc/cpuinfo; elsewhere what ``platform`` knows), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def info(device: str | torch.device = "auto") -> DeviceInfo:
    dev = resolve_device(device)
    common = dict(cpu_count=os.cpu_count() or 1, host=platform.node(), colab=in_colab(), versions=versions(),
                  cpu_model=cpu_model())
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return DeviceInfo(kind="cuda", name=p.name, capability=[p.major, p.minor],
                          total_mem_gib=round(p.total_memory / 2**30, 2), sm_count=p.multi_processor_count,
                          l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1) or None, **common)
    return DeviceInfo(kind="cpu", name=platform.processor() or platform.machine(), capability=None,
                      total_mem_gib=None, sm_count=None, l2_mib=None, **common)


# --- capability gates -----------------------------------------------------------------------------

def supports_bf16(di: DeviceInfo) -> bool:
    """bf16 tensor-core math needs Ampere (sm_80) or newer; CPUs emulate it (slowly) in torch."""
    return di.kind == "cpu" or (di.capability is not None and di.capability[0] >= 8)


def supports_tf32(di: DeviceInfo) -> bool:
    return di.kind == "cuda" and di.capability is not None and di.capability[0] >= 8


def supports_cp_async(di: DeviceInfo) -> bool:
    """Asynchronous global-to-shared copies (cp.async) need Ampere (sm_80) or newer."""
    return di.kind == "cuda" and di.capability is not None and di.capability[0] >= 8


def supports_cudnn_attention(di: DeviceInfo) -> bool:
    """cuDNN's fused attention (the kernels SDPA dispatches to on Hopper) needs Ampere (sm_80) or newer
    and cuDNN 9 in torch."""
    return (di.kind == "cuda" and di.capability is not None and di.capability[0] >= 8
            and (di.versions.get("cudnn") or 0) >= 90000)


def supports_fp8(di: DeviceInfo) -> bool:
    return di.kind == "cuda" and di.capability is not None and tuple(di.capability) >= (8, 9)


def fp8_missing(di: DeviceInfo) -> str | None:
    """Why a GPU cannot run FP8 matmuls (no FP8 tensor cores before Ada and Hopper), or None; None on
    CPUs too, where torch._scaled_mm runs (slowly) with per-tensor scales."""
    if di.kind != "cuda" or supports_fp8(di):
        return None
    return f"FP8 matmuls need sm_89 or newer (Ada, Hopper); this GPU is sm_{di.capability[0]}{di.capability[1]}"


def supports_compile(di: DeviceInfo) -> tuple[bool, str]:
    """torch.compile's inductor needs Triton on a GPU (sm_70+) or a C++ compiler on CPU."""
    if di.kind == "cuda":
        if di.capability[0] < 7:
            return False, f"inductor needs sm_70 or newer, this GPU is sm_{di.capability[0]}{di.capability[1]}"
        if di.versions.get("triton") is None:
            return False, "Triton is not installed"
        return True, ""
    import shutil
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return False, "no C++ compiler on PATH for inductor's CPU backend"
    return True, ""


# --- datasheet-class figures (dense, vendor): shown beside measured ceilings, never used in ratios ---

DATASHEET = {
    # name: (memory TB/s, bf16 TFLOP/s, tf32 TFLOP/s, fp32 TFLOP/s, source)
    "h100": (3.35, 989.0, 494.7, 66.9, "NVIDIA H100 SXM5 datasheet, dense"),
    "h200": (4.8, 989.0, 494.7, 66.9, "NVIDIA H200 SXM datasheet, dense"),
    "a100": (2.04, 312.0, 156.0, 19.5, "NVIDIA A100 80GB SXM datasheet, dense"),
    "a10g": (0.6, 125.0, 62.5, 31.2, "NVIDIA A10 datasheet, dense"),
    "l4": (0.3, 121.0, 60.0, 30.3, "NVIDIA L4 datasheet, dense"),
    "t4": (0.32, None, None, 8.1, "NVIDIA T4 datasheet (no bf16, no TF32)"),
    "v100": (0.9, None, None, 15.7, "NVIDIA V100 SXM2 datasheet (no bf16, no TF32)"),
}


def datasheet(di: DeviceInfo) -> dict | None:
    row = DATASHEET.get(di.short) if di.kind == "cuda" else None
    if row is None:
        return None
    return {"copy_gbps": row[0] * 1000, "matmul_tflops": {"bf16": row[1], "tf32": row[2], "fp32": row[3]},
            "source": row[4]}


# --- reports --------------------------------------------------------------------------------------

def env_report(device: str | torch.device = "auto") -> dict:
    di = info(device)
    rep = di.to_dict()
    rep["short"] = di.short
    rep["gates"] = {"bf16": supports_bf16(di), "tf32": supports_tf32(di), "fp8": supports_fp8(di),
                    "compile": supports_compile(di)[0]}
    return rep


def format_env_report(device: str | torch.device = "auto") -> str:
    r = env_report(device)
    v = r["versions"]
    lines = [f"device      {r['kind']}: {r['name']}"]
    if r["kind"] == "cuda":
        lines.append(f"capability  sm_{r['capability'][0]}{r['capability'][1]}, {r['sm_count']} SMs, "
                     f"{r['total_mem_gib']} GiB, L2 {r['l2_mib']} MiB, driver {v.get('driver')}")
        if memory_cap_gib() is not None and memory_cap_gib() < r["total_mem_gib"]:
            lines.append(f"memory cap  {memory_cap_gib():g} GiB per process (${MEMORY_CAP_ENV}): a smaller GPU played on "
                         "this one; a step that does not fit is skipped with the memory it asked for")
    lines.append(f"gates       " + ", ".join(f"{k}={'yes' if ok else 'no'}" for k, ok in r["gates"].items()))
    lines.append(f"software    python {v['python']}, torch {v['torch']}, CUDA {v['cuda']}, "
                 f"cuDNN {v['cudnn']}, triton {v['triton']}")
    cpu = f" ({r['cpu_model']})" if r.get("cpu_model") else ""
    lines.append(f"host        {r['host']}, {r['cpu_count']} CPUs{cpu}{', Colab' if r['colab'] else ''}")
    return "\n".join(lines)


def recommended_settings(di: DeviceInfo) -> list[dict]:
    """Settings derived from capability and memory, each with the reason it follows from.

    The micro-batch estimate for GPT-2 small follows Korthikanti et al. 2022 (activation memory per
    layer of about 34*s*h bytes with fused attention in 16-bit) plus 16 bytes per parameter for
    fp32 weights, gradients and AdamW moments; it is an estimate, and notebook 13 measures it.
    """
    rows = []
    bf16, tf32 = supports_bf16(di), supports_tf32(di)
    gpu = di.kind == "cuda"
    if gpu:
        prec = "bf16 autocast" if bf16 else "fp16 autocast + GradScaler"
        why = ("sm_80+ has bf16 tensor cores; bf16 keeps fp32's exponent range, no loss scaling"
               if bf16 else "no bf16 before sm_80: fp16 needs a GradScaler against underflow")
    else:
        prec, why = "fp32", "CPU: autocast gains little; smoke runs only"
    rows.append({"setting": "precision", "value": prec, "why": why})
    rows.append({"setting": "TF32 matmuls", "value": "on" if tf32 else "n/a",
                 "why": "fp32 matmuls on tensor cores (sm_80+)" if tf32 else "needs an sm_80+ GPU"})
    ok, reason = supports_compile(di)
    rows.append({"setting": "torch.compile", "value": "on" if ok else "off", "why": reason or "inductor available"})
    rows.append({"setting": "attention", "value": "F.scaled_dot_product_attention",
                 "why": "flash kernel on sm_80+ for head dim <= 256" if bf16 and gpu else "fused math kernel"})
    rows.append({"setting": "AdamW", "value": "fused=True" if gpu else "fused=True (CPU kernel)",
                 "why": "one kernel for all parameters instead of several per tensor group"})
    if gpu and di.total_mem_gib:
        params = 124.4e6
        state_gib = 16 * params / 2**30
        act_gib = 12 * 34 * 1024 * 768 / 2**30 + 1024 * 50304 * (2 + 4 + 4) / 2**30  # blocks + logits/loss
        usable = 0.85 * di.total_mem_gib - state_gib - 0.5
        mb = max(0, int(usable / act_gib))
        pow2 = 2 ** (mb.bit_length() - 1) if mb > 0 else 0
        rows.append({"setting": "GPT-2 small micro-batch (1024 tokens)", "value": str(pow2),
                     "why": f"estimate: {di.total_mem_gib:.0f} GiB x 0.85 - {state_gib:.1f} GiB states, "
                            f"{act_gib:.2f} GiB per sequence; largest power of two"})
    rows.append({"setting": "DataLoader workers", "value": str(min(8, max(1, (di.cpu_count or 2) // 2))),
                 "why": f"half of {di.cpu_count} CPUs, at most 8; notebook 08 measures the data wait"})
    return rows
