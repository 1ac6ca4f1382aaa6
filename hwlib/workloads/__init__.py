"""The seed systems as training workloads behind one small interface (see ``base.Workload``)."""

from __future__ import annotations

from ..device import ChoiceError
from .base import Workload
from .encoder_nli import EncoderNLIWorkload
from .gpt import GPTWorkload
from .resnet_bk import ResNetBKWorkload
from .vit_bdh import VitBDHLinearWorkload, VitBDHWorkload

WORKLOADS: dict[str, Workload] = {"gpt": GPTWorkload(), "resnet_bk": ResNetBKWorkload(),
                                  "vit_bdh": VitBDHWorkload(), "vit_bdh_linear": VitBDHLinearWorkload(),
                                  "encoder_nli": EncoderNLIWorkload()}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[str(name).strip().lower()]
    except KeyError:
        raise ChoiceError("workload", name, tuple(WORKLOADS)) from None


__all__ = ["WORKLOADS", "Workload", "get_workload"]
