"""Run profiles: ``full`` (realistic sizes, GPU), ``smoke`` (tiny, seconds on a CPU), ``auto``.

``auto`` picks ``full`` when a CUDA GPU is visible and ``smoke`` otherwise; the environment variable
``HWLIB_PROFILE`` overrides the choice (nbval cannot inject parameters; papermill can).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .device import ChoiceError, resolve_device

PROFILE_CHOICES = ("auto", "full", "smoke")


@dataclass(frozen=True)
class Plan:
    """How many steps a measurement runs: ``check`` steps from the seed whose losses are compared
    with the step before (they double as warm-up), ``warmup`` more, then ``timed`` steps."""

    check: int
    warmup: int
    timed: int


PLANS = {"full": Plan(check=10, warmup=5, timed=30), "smoke": Plan(check=4, warmup=1, timed=3)}


def resolve_profile(profile: str = "auto", device: str | torch.device = "auto") -> str:
    env = os.environ.get("HWLIB_PROFILE")
    if env:
        profile = env
    p = str(profile).strip().lower()
    if p not in PROFILE_CHOICES:
        raise ChoiceError("profile", profile, PROFILE_CHOICES)
    if p == "auto":
        return "full" if resolve_device(device).type == "cuda" else "smoke"
    return p


def plan(profile: str) -> Plan:
    if profile not in PLANS:
        raise ChoiceError("profile", profile, tuple(PLANS))
    return PLANS[profile]
