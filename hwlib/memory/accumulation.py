"""Exact gradient accumulation, and a training step that survives CUDA out-of-memory errors.

Exactness. For a loss that is a mean over samples, the gradient of a batch of B samples equals the
sum over micro-batches j of (b_j / B) * grad(mean loss of micro-batch j). ``plan_micro_batches``
splits any target B into micro-batches of at most ``micro`` samples, the last one possibly smaller
(B = 128 with micro 13: nine of 13 and one of 11, never 9 x 13 = 117), and ``accumulate`` weights
each by b_j / B, so the accumulated gradient is the large-batch gradient up to rounding. (Workloads
whose samples carry different numbers of loss terms would weight by terms instead.)

Resilience. ``ResilientStep`` runs a step as micro-batches; on an out-of-memory error it drops the
failed attempt's partial gradients, frees the allocator's cache, halves the micro-batch (raising
the number of micro-batches, so the effective batch is unchanged) and retries the same batch: no
sample is dropped and no step is skipped. Each event is recorded. At micro-batch 1 it gives up with
the memory figures. An OOM inside ``optimizer.step`` is not retried: a partly applied update cannot
be undone, so it is re-raised as such.
"""

from __future__ import annotations

import gc
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .tracker import memory_figures

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be a whole number of samples, got {v!r} ({type(v).__name__})")
    if v < 1:
        raise ValueError(f"{name} must be at least one sample, got {v}")
    return int(v)


def plan_micro_batches(target: int, micro: int) -> list[int]:
    """Micro-batch sizes that add up to exactly ``target``, each at most ``micro``."""
    target, micro = _positive_int("target batch", target), _positive_int("micro-batch", micro)
    full, rest = divmod(target, min(micro, target))
    return [min(micro, target)] * full + ([rest] if rest else [])


def batch_size(batch) -> int:
    t = batch if isinstance(batch, torch.Tensor) else batch[0]
    return t.shape[0]


def split_batch(batch, sizes: list[int]):
    """Split a tensor or a tuple/list of tensors (samples first) into consecutive micro-batches."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    n = {t.shape[0] for t in tensors}
    if len(n) != 1:
        raise ValueError(f"batch: its tensors disagree on the number of samples: {sorted(n)}")
    if sum(sizes) != n.pop():
        raise ValueError(f"micro-batch sizes add up to {sum(sizes)}, the batch has {batch_size(batch)} samples")
    parts = list(zip(*(t.split(sizes) for t in tensors)))
    return [p[0] if isinstance(batch, torch.Tensor) else type(batch)(p) if isinstance(batch, tuple) else list(p)
            for p in parts]


def accumulate(forward_backward: Callable, batch, sizes: list[int]) -> torch.Tensor:
    """Gradient of the whole batch, in micro-batches of ``sizes``; returns the batch's mean loss.
    ``forward_backward(micro_batch, weight)`` must add ``weight * grad(loss)`` to the gradients."""
    total = sum(sizes)
    loss = None
    for mb, b in zip(split_batch(batch, sizes), sizes):
        part = forward_backward(mb, b / total) * (b / total)
        loss = part if loss is None else loss + part
    return loss


@dataclass
class OOMEvent:
    step: int | None
    micro_before: int
    micro_after: int
    figures: dict
    error: str
    time: float = field(default_factory=time.time)


class ResilientStep:
    """``step(batch)``: accumulate over micro-batches, halving them on OOM; see the module doc."""

    def __init__(self, forward_backward: Callable, optimizer_step: Callable, zero_grad: Callable,
                 device: torch.device, micro_batch: int):
        self.forward_backward, self.optimizer_step, self.zero_grad = forward_backward, optimizer_step, zero_grad
        self.device = device
        self.micro = _positive_int("micro_batch", micro_batch)
        self.events: list[OOMEvent] = []
        self.history: list[dict] = []

    @classmethod
    def for_session(cls, sess, micro_batch: int) -> "ResilientStep":
        return cls(sess.forward_backward, sess.optimizer_step, lambda: sess.opt.zero_grad(set_to_none=True),
                   sess.device, micro_batch)

    def __call__(self, batch, step: int | None = None) -> torch.Tensor:
        n = batch_size(batch)
        while True:
            sizes = plan_micro_batches(n, min(self.micro, n))
            failed = None
            try:
                loss = accumulate(self.forward_backward, batch, sizes)
            except OOM_ERRORS as e:
                failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if failed is None:
                break
            # Outside the except block the traceback (and the tensors its frames hold) is gone.
            self.zero_grad()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            figs = memory_figures(self.device)
            if min(self.micro, n) == 1:
                shown = ", ".join(f"{k} {v:.2f} GiB" for k, v in figs.items()) or "no allocator figures on this device"
                raise MemoryError(f"out of memory even at micro-batch 1 (step {step}): {shown}; "
                                  f"the model, its states and one sample do not fit. Last error: {failed}")
            new = max(1, min(self.micro, n) // 2)
            self.events.append(OOMEvent(step, min(self.micro, n), new, figs, failed))
            self.micro = new
        self.optimizer_step()
        self.history.append({"step": step, "samples": n, "micro_batch": sizes[0], "micro_batches": len(sizes)})
        return loss
