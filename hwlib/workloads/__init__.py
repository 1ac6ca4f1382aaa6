"""The seed systems as training workloads behind one small interface (see ``base.Workload``)."""

from __future__ import annotations

from ..device import ChoiceError
from .base import Workload
from .gpt import GPTWorkload
from .resnet_bk import ResNetBKWorkload

WORKLOADS: dict[str, Workload] = {"gpt": GPTWorkload(), "resnet_bk": ResNetBKWorkload()}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[str(name).strip().lower()]
    except KeyError:
        raise ChoiceError("workload", name, tuple(WORKLOADS)) from None


__all__ = ["WORKLOADS", "Workload", "get_workload"]
