"""Run profiles: ``full`` (realistic sizes), ``mid`` (the same models at smaller per-step batches, for
16 and 24 GB GPUs), ``smoke`` (tiny, seconds on a CPU), and ``auto``, which picks one of them.

``auto`` picks the largest profile whose memory need fits the GPU memory this process may use
(``hwlib.device.usable_memory_gib``: the device's, or ``$HWLIB_MEMORY_CAP_GIB`` where that is lower):
``full``, else ``mid``, else ``smoke`` with a message naming the memory found and needed; on a CPU,
``smoke``. ``choose_profile`` returns the choice with its reason, which ``hwlib.notebook.setup`` and
``hwlib reproduce`` print (the latter records it in the run's ``state.json``). The environment
variable ``HWLIB_PROFILE`` overrides the parameter (nbval cannot inject parameters; papermill can).

A profile's need is the largest peak of tensor memory (``torch.cuda.max_memory_allocated``, the
README's "GPU memory per profile") of any step of the single-GPU series, plus room the tensors do
not count:

    NEED_GIB[p] = PEAK_GIB[p] + HEADROOM_GIB

- full: 29.25 GiB measured, GPT-2's fp32 baseline (notebook 01, ``outputs/reference/h100``);
- mid: 8.82 GiB estimated, Vision-BDH's fp32 baseline at batch 192; each workload's ``PROFILES``
  derives its own estimate from its peak in the same records (``workloads.base.PeakMemory``), and
  GPT-2 (8.70), the NLI encoder (8.75) and ResNet-BK (6.84) stay below it;
- headroom, 2.5 GiB: the CUDA context (about 0.5 GiB, outside torch's allocator) and the caching
  allocator's fragmentation (notebook 13's reference records hold up to 1.84 GiB reserved above
  allocated).

Studies whose sizes do not follow a workload's batch (kernel sweeps, ceilings) run at full sizes in
``mid``: ``gpu_sized(profile)`` is the test for "sized for a GPU".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .device import MEMORY_CAP_ENV, ChoiceError, memory_cap_gib, resolve_device, usable_memory_gib

PROFILE_CHOICES = ("auto", "full", "mid", "smoke")
GPU_PROFILES = ("full", "mid")   # sized for a GPU, largest first: the order ``auto`` tries them in

PEAK_GIB = {"full": 29.25, "mid": 8.82}
HEADROOM_GIB = 2.5
NEED_GIB = {p: round(v + HEADROOM_GIB, 2) for p, v in PEAK_GIB.items()}


def gpu_sized(profile: str) -> bool:
    """Whether ``profile`` (resolved) holds sizes meant for a GPU: ``full`` or ``mid``, not ``smoke``."""
    return profile in GPU_PROFILES


@dataclass(frozen=True)
class Plan:
    """How many steps a measurement runs: ``check`` steps from the seed whose losses are compared
    with the step before (they double as warm-up), ``warmup`` more, then ``timed`` steps."""

    check: int
    warmup: int
    timed: int


# mid times as many steps as full: its steps are shorter, not its statistics coarser.
PLANS = {"full": Plan(check=10, warmup=5, timed=30), "mid": Plan(check=10, warmup=5, timed=30),
         "smoke": Plan(check=4, warmup=1, timed=3)}


def _memory(dev: torch.device) -> tuple[str, float, str]:
    """(GPU name, usable GiB, that figure in words) of a CUDA device."""
    props = torch.cuda.get_device_properties(dev)
    total = props.total_memory / 2**30
    usable = usable_memory_gib(dev)
    cap = memory_cap_gib()
    capped = f" ({MEMORY_CAP_ENV}={cap:g} of its {total:.1f} GiB)" if cap and cap < total else ""
    return props.name, usable, f"{usable:.1f} GiB usable{capped}"


def auto_profile(device: str | torch.device = "auto") -> tuple[str, str]:
    """What ``auto`` picks on ``device`` and why: the first of ``GPU_PROFILES`` whose ``NEED_GIB``
    fits the usable GPU memory, else ``smoke``."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return "smoke", f"no CUDA GPU ({dev.type}): smoke, tiny sizes that check that the code runs"
    name, usable, how = _memory(dev)
    short = ""
    for p in GPU_PROFILES:
        if usable >= NEED_GIB[p]:
            return p, f"{name} has {how}: {short}at least the {NEED_GIB[p]:g} GiB {p} needs"
        short += f"less than the {NEED_GIB[p]:g} GiB {p} needs, "
    low = GPU_PROFILES[-1]
    return "smoke", (f"{name} has {how}: less than the {NEED_GIB[low]:g} GiB that even {low} needs, so smoke, "
                     f"tiny sizes whose times say nothing about this GPU (HWLIB_PROFILE={low} runs {low} anyway, "
                     f"each step that does not fit a row skipped)")


def shortfall(profile: str, device: str | torch.device = "auto") -> str | None:
    """A GPU-sized ``profile`` on a GPU whose usable memory is below its need: a sentence naming both
    (the profile still runs; each step that does not fit becomes a row ``skipped``). Else None."""
    if not gpu_sized(profile) or not torch.cuda.is_available():
        return None
    dev = resolve_device(device)
    if dev.type != "cuda":
        return None
    name, usable, how = _memory(dev)
    if usable >= NEED_GIB[profile]:
        return None
    return (f"{name} has {how}, less than the {NEED_GIB[profile]:g} GiB {profile} needs: each step that does "
            f"not fit becomes a row skipped")


def choose_profile(profile: str = "auto", device: str | torch.device = "auto", *,
                   source: str | None = None) -> tuple[str, str]:
    """(profile, reason), the one place a profile is chosen. ``profile`` comes from ``source`` (its
    name in the reason); without one, ``$HWLIB_PROFILE`` overrides ``profile`` (the notebooks' way).
    ``auto`` is resolved by ``auto_profile``; a profile asked for by name is kept, with a shortfall
    of memory said in the reason."""
    if source is None:
        env = os.environ.get("HWLIB_PROFILE")
        profile, source = (env, "HWLIB_PROFILE") if env else (profile, "parameter")
    p = str(profile).strip().lower()
    if p not in PROFILE_CHOICES:
        raise ChoiceError(f"profile ({source})", profile, PROFILE_CHOICES)
    if p == "auto":
        p, why = auto_profile(device)
        return p, f"auto: {why}"
    short = shortfall(p, device)
    return p, source + (f"; {short}" if short else "")


def resolve_profile(profile: str = "auto", device: str | torch.device = "auto") -> str:
    return choose_profile(profile, device)[0]


# Smoke on a CPU checks that the code runs and computes the same math; its times mean nothing. One timed
# step straight after the check steps runs the timed path; a GPU's smoke (a GPU too small for mid) keeps
# smoke's three, which are still times. Each CPU measurement runs 5 steps instead of 8: about a third of
# the smoke steps of `make test`'s notebook suites, where bf16 matmuls are slow on a CPU without bf16 units.
CPU_SMOKE = Plan(check=4, warmup=0, timed=1)


def plan(profile: str, device_type: str | None = None) -> Plan:
    """The plan of ``profile`` on a device of ``device_type`` ("cuda", "cpu"; None: the profile's own)."""
    if profile not in PLANS:
        raise ChoiceError("profile", profile, tuple(PLANS))
    if profile == "smoke" and device_type == "cpu":
        return CPU_SMOKE
    return PLANS[profile]
