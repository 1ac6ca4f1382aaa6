"""The interface every workload implements; ``train`` knows nothing else about a model."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..steps import Settings


class Workload:
    name: str = ""
    unit: str = "items"  # what throughput counts: tokens, samples

    def config(self, profile: str, **overrides) -> Any:
        """The workload's size for a profile; keyword overrides name config fields."""
        raise NotImplementedError

    def build(self, cfg: Any, settings: Settings, seed: int) -> torch.nn.Module:
        """The model, initialised on the CPU from ``seed`` so that every step, on every device,
        starts from the same weights."""
        raise NotImplementedError

    def batches(self, cfg: Any, device: torch.device, seed: int, source: str | None = None) -> Callable[[int], Any]:
        """``batches(i)`` returns batch ``i``, the same for every step of the ladder."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def flops_per_step(self, cfg: Any) -> float:
        """Useful model FLOPs of one training step (forward + backward), padding excluded."""
        raise NotImplementedError

    def items_per_step(self, cfg: Any) -> int:
        raise NotImplementedError
