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
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .checks import positive_int
from .tracker import memory_figures

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)


def plan_micro_batches(target: int, micro: int) -> list[int]:
    """Micro-batch sizes that add up to exactly ``target``, each at most ``micro``."""
    target, micro = positive_int("target batch", target), positive_int("micro-batch", micro)
    full, rest = divmod(target, min(micro, target))
    return [min(micro, target)] * full + ([rest] if rest else [])


def _tensors(batch) -> list[torch.Tensor]:
    """The batch's tensors (one, or a non-empty tuple/list), each with a sample dimension of one size."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch) if isinstance(batch, (tuple, list)) else None
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"batch must be a tensor or a non-empty tuple/list of tensors (samples first), "
                        f"got {type(batch).__name__}" + (f" of {', '.join(sorted({type(t).__name__ for t in tensors}))}"
                                                         if tensors else ""))
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("batch: a 0-d tensor has no sample dimension; give each tensor samples first")
    n = {t.shape[0] for t in tensors}
    if len(n) != 1:
        raise ValueError(f"batch: its tensors disagree on the number of samples: {sorted(n)}")
    return tensors


def batch_size(batch) -> int:
    return _tensors(batch)[0].shape[0]


def split_batch(batch, sizes: list[int]):
    """Split a tensor or a tuple/list of tensors (samples first) into consecutive micro-batches."""
    tensors = _tensors(batch)
    if not isinstance(sizes, (list, tuple)) or not sizes:
        raise TypeError(f"sizes must be a non-empty list of micro-batch sizes (plan_micro_batches), got {sizes!r}")
    sizes = [positive_int(f"sizes[{i}]", b) for i, b in enumerate(sizes)]
    if sum(sizes) != tensors[0].shape[0]:
        raise ValueError(f"micro-batch sizes add up to {sum(sizes)}, the batch has {tensors[0].shape[0]} samples")
    parts = list(zip(*(t.split(sizes) for t in tensors)))
    return [p[0] if isinstance(batch, torch.Tensor) else type(batch)(p) if isinstance(batch, tuple) else list(p)
            for p in parts]


def _callable(name: str, f) -> Callable:
    if not callable(f):
        raise TypeError(f"{name} must be callable, got {type(f).__name__}")
    return f


def accumulate(forward_backward: Callable, batch, sizes: list[int]) -> torch.Tensor:
    """Gradient of the whole batch, in micro-batches of ``sizes``; returns the batch's mean loss.
    ``forward_backward(micro_batch, weight)`` must add ``weight * grad(loss)`` to the gradients."""
    _callable("forward_backward", forward_backward)
    parts = split_batch(batch, sizes)
    total = sum(sizes)
    loss = None
    for mb, b in zip(parts, sizes):
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
        self.forward_backward = _callable("forward_backward", forward_backward)
        self.optimizer_step = _callable("optimizer_step", optimizer_step)
        self.zero_grad = _callable("zero_grad", zero_grad)
        if not isinstance(device, (torch.device, str)):
            raise TypeError(f"device must be a torch.device or a name like 'cuda', got {type(device).__name__}")
        self.device = torch.device(device)
        self.micro = positive_int("micro_batch", micro_batch)
        self.events: list[OOMEvent] = []
        self.history: list[dict] = []

    @classmethod
    def for_session(cls, sess, micro_batch: int) -> "ResilientStep":
        """The step of an open ``hwlib.ladder.Session``: its forward/backward, optimizer step and device."""
        if getattr(sess, "opt", None) is None or not callable(getattr(sess, "forward_backward", None)):
            raise TypeError(f"sess must be an open hwlib.ladder.Session, got {type(sess).__name__}")
        return cls(sess.forward_backward, sess.optimizer_step, lambda: sess.opt.zero_grad(set_to_none=True),
                   sess.device, micro_batch)

    def __call__(self, batch, step: int | None = None) -> torch.Tensor:
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int or None (it labels the OOM events), got {step!r}")
        n = batch_size(batch)
        if n == 0:
            raise ValueError("batch has no samples: there is nothing to step on")
        while True:
            sizes = plan_micro_batches(n, min(self.micro, n))
            failed = None
            try:
                loss = accumulate(self.forward_backward, batch, sizes)
            except OOM_ERRORS as e:
                failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
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
