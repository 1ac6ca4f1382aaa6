"""The interface every workload implements; ``train`` knows nothing else about a model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..settings import Settings


def init_lm_weights(model: torch.nn.Module, seed: int, vocab: int, n_layer: int, residual_out: tuple[str, ...]):
    """GPT-2 initialisation from a CPU generator, parameter by parameter in a fixed order:
    N(0, 0.02) weights, N(0, 0.02 / sqrt(2 L)) for projections into the residual stream (names
    ending in ``residual_out``), zero biases, unit LayerNorm gains. Padded vocabulary rows of
    ``wte`` start at zero; with the padded logits sliced off before the loss they get no gradient,
    so a padded model computes the unpadded model's function."""
    g = torch.Generator().manual_seed(seed)
    std_proj = 0.02 / math.sqrt(2 * n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("wte"):
                p.zero_()
                p[:vocab].normal_(0.0, 0.02, generator=g)
            elif name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0)
            elif name.endswith(residual_out):
                p.normal_(0.0, std_proj, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def check_positive_ints(cfg, names: tuple[str, ...]) -> None:
    """Every config field in ``names`` is a positive integer (not a bool), or a ValueError names it."""
    for f in names:
        v = getattr(cfg, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{type(cfg).__name__}.{f} must be a positive integer, got {v!r}")


def check_finite_numbers(cfg, positive: tuple[str, ...] = ("lr",), non_negative: tuple[str, ...] = ("weight_decay",)) -> None:
    """Every config field in ``positive`` is a finite number > 0, every one in ``non_negative`` a
    finite number >= 0, or a ValueError names the field. Strings ("0.1"), bools, NaN and inf are
    refused: a NaN learning rate trains to NaN losses, and a string fails deep inside the optimizer."""
    for names, need, ok in ((positive, "positive", lambda v: v > 0), (non_negative, "non-negative", lambda v: v >= 0)):
        for f in names:
            v = getattr(cfg, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"{type(cfg).__name__}.{f} must be a finite {need} number, got {v!r} "
                                 f"({type(v).__name__}); pass e.g. {f}={getattr(type(cfg), f, 1e-3)!r}")


@dataclass(frozen=True)
class PeakMemory:
    """A workload's largest measured peak of tensor memory (``peak_mem_gib``: the step's
    ``torch.cuda.max_memory_allocated``) at ``batch``, read from the reference run's records, and
    the part of it that does not grow with the batch (``fixed_gib``: fp32 weights, gradients and
    AdamW's two moments, 16 B a parameter). The rest (activations, resident batches) is taken as
    proportional to the batch, so at another batch b:

        peak(b) = fixed + (measured - fixed) * b / batch

    a profile's batch is chosen from it (``hwlib.profiles.PEAK_GIB`` holds the largest result)."""

    step: str
    batch: int
    measured_gib: float
    fixed_gib: float
    run: str = "reference/h100"

    def at(self, batch: int) -> float:
        return self.fixed_gib + (self.measured_gib - self.fixed_gib) * batch / self.batch


class Workload:
    name: str = ""
    unit: str = "items"  # what throughput counts: tokens, samples
    profiles: dict = {}  # profile name -> frozen config dataclass
    checkpoint_parts: tuple[str, ...] = ()   # what Settings.checkpointing can recompute: "blocks", "head"

    def config(self, profile: str, **overrides) -> Any:
        """The workload's size for a profile; keyword overrides name config fields."""
        import dataclasses

        from ..device import ChoiceError
        if profile not in self.profiles:
            raise ChoiceError("profile", profile, tuple(self.profiles))
        base = self.profiles[profile]
        fields = [f.name for f in dataclasses.fields(base)]
        bad = sorted(set(overrides) - set(fields))
        if bad:
            raise ChoiceError(f"{type(base).__name__} field", bad[0], fields)
        return dataclasses.replace(base, **overrides)

    def build(self, cfg: Any, settings: Settings, seed: int) -> torch.nn.Module:
        """The model, initialised on the CPU from ``seed`` so that every step, on every device,
        starts from the same weights."""
        raise NotImplementedError

    def batches(self, cfg: Any, device: torch.device, seed: int, source: str | None = None,
                settings: Settings | None = None) -> Callable[[int], Any]:
        """``batches(i)`` returns batch ``i``, the same for every step of the ladder. Workloads with
        a CPU-side pipeline honour ``settings.loader`` (``hwlib.data.loader``), ``settings.packing`` and
        ``settings.channels_last``; the callable may have ``close()`` (called when the run ends)
        and ``make_resident(n)`` (batches 0..n-1 kept on the device before timing)."""
        raise NotImplementedError

    def batch_shapes(self, cfg: Any, batches: Callable[[int], Any], n: int) -> list | None:
        """A key per batch 0..n-1 of ``batches`` (what ``self.batches`` returned) that changes when
        its tensor shapes change, computed without building the batches; None when every batch has
        the same shapes (the usual case)."""
        return None

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def flops_per_step(self, cfg: Any) -> float:
        """Useful model FLOPs of one training step (forward + backward), padding excluded."""
        raise NotImplementedError

    def items_per_step(self, cfg: Any) -> int:
        raise NotImplementedError


class TokenLMWorkload(Workload):
    """A next-token language model over ``hwlib.data.tokens`` token streams: config profiles, batches and
    loss are the same for every such workload; subclasses give the model, its config and FLOPs."""

    unit = "tokens"

    def batches(self, cfg, device: torch.device, seed: int, source: str | None = None, settings=None):
        from ..data.tokens import TokenBatches, cached_synthetic_tokens, text_file_tokens
        tokens = text_file_tokens(source, cfg.vocab) if source else cached_synthetic_tokens(cfg.data_tokens, cfg.vocab, seed)
        return TokenBatches(tokens, cfg.batch, cfg.context, device)

    def loss(self, model, batch):
        x, y = batch
        return model(x, y)

    def items_per_step(self, cfg) -> int:
        return cfg.batch * cfg.context
