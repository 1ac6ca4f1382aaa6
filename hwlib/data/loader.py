"""Batches from a map-style dataset, the same batch ``i`` under every loader setting.

Step 08 changes how batches are produced, never which: ``LoaderBatches(i)`` returns batch ``i`` of
a fixed, seeded order, and every sample's random augmentation is drawn from a generator seeded by
(seed, sample index, epoch), not from a worker's global state. So the simple loader, the tuned
loader and the resident batches feed the model bit-identical tensors and the "same math" check
compares like with like.

Three modes (``Settings.loader``):

- ``simple``: samples are decoded and augmented in the training process, batches are collated in
  pageable memory and copied with a blocking ``.to(device)``: the GPU waits for all of it.
- ``tuned``: ``torch.utils.data.DataLoader`` with worker processes, pinned memory, persistent
  workers and a prefetch queue; the copy is ``non_blocking``, so it overlaps with compute.
- ``resident``: every batch a run needs is produced before timing and kept on the device: data
  cost zero. The floor that the other two are measured against: the share of step time spent on
  data is ``1 - t_resident / t_loader``.

Host time blocked in ``next()`` is recorded too (``wait_s``), but it is not the data-wait share on
its own: while the GPU still has queued work, a blocked host costs nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np
import torch

from ..device import ChoiceError

LOADER_MODES = ("simple", "tuned", "resident")


def default_workers() -> int:
    """Worker processes for the tuned loader: one per spare core, at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def sample_generator(seed: int, index: int, epoch: int) -> np.random.Generator:
    """The generator of one sample's augmentation: a function of (seed, index, epoch) alone."""
    return np.random.default_rng([int(seed), int(index), int(epoch)])


class StepSampler(torch.utils.data.Sampler):
    """Yields the index lists of batches ``start, start + 1, ...`` of a seeded order (a fresh
    permutation each epoch; the last partial batch of an epoch is dropped)."""

    def __init__(self, n: int, batch: int, seed: int, start: int = 0):
        self.n, self.batch, self.seed, self.start = n, batch, seed, start
        self.per_epoch = n // batch
        self._epoch, self._perm = None, None

    def indices(self, i: int) -> list[int]:
        """The sample indices of batch ``i``."""
        epoch, k = divmod(i, self.per_epoch)
        if epoch != self._epoch:   # one permutation per epoch, not per batch
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch, 7]).permutation(self.n)
        return [int(j) for j in self._perm[k * self.batch:(k + 1) * self.batch]]

    def __iter__(self):
        i = self.start
        while True:
            yield [(j, i // self.per_epoch) for j in self.indices(i)]
            i += 1

    def __len__(self):  # endless; DataLoader only asks for progress bars
        return 2**31 - 1


class _Indexed(torch.utils.data.Dataset):
    """Adapts ``dataset.sample(index, epoch)`` to DataLoader's ``dataset[key]``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, key):
        index, epoch = key
        return self.dataset.sample(index, epoch)

    def __len__(self):
        return len(self.dataset)


class LoaderBatches:
    """``batches(i)``: batch ``i`` on ``device``, produced the way ``mode`` says.

    ``dataset`` needs ``__len__`` and ``sample(index, epoch)`` returning a tuple of tensors (CPU,
    deterministic given its arguments); ``collate`` turns a list of samples into a batch tuple
    (default: stack each field); ``to_device`` moves a batch (default: ``.to`` each tensor).
    Batches are read in order; asking for an earlier batch restarts the stream there.
    """

    def __init__(self, dataset, batch: int, device: torch.device, seed: int, mode: str = "simple", *,
                 workers: int | None = None, prefetch: int = 4, collate: Callable | None = None,
                 to_device: Callable | None = None):
        if mode not in LOADER_MODES:
            raise ChoiceError("loader", mode, LOADER_MODES)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}")
        if len(dataset) < batch:
            raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one batch of {batch}")
        self.dataset, self.batch, self.device, self.seed, self.mode = dataset, batch, torch.device(device), seed, mode
        self.workers = default_workers() if workers is None else int(workers)
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers!r}")
        self.prefetch = prefetch
        self.collate = collate or _stack
        self.to_device = to_device or _to
        self.wait_s = 0.0          # host time blocked waiting for batches (see the module doc)
        self.n_waits = 0
        self._it = None
        self._next = 0
        self._loader = None
        self._resident: dict[int, Any] = {}
        self._last = None          # (i, batch i): the batch just delivered

    # --- modes -------------------------------------------------------------------------------
    def _stream(self, start: int):
        sampler = StepSampler(len(self.dataset), self.batch, self.seed, start)
        if self.mode == "tuned" and self.workers > 0:
            pin = self.device.type == "cuda"
            self._loader = torch.utils.data.DataLoader(
                _Indexed(self.dataset), batch_sampler=sampler, num_workers=self.workers,
                collate_fn=self.collate, pin_memory=pin, persistent_workers=True,
                prefetch_factor=self.prefetch, worker_init_fn=_quiet_worker)
            return iter(self._loader)
        return (self.collate([self.dataset.sample(j, e) for j, e in idx]) for idx in sampler)

    def make_resident(self, n: int) -> None:
        """Produce batches 0..n-1 now and keep them on the device."""
        saved, self.mode = self.mode, "simple"
        try:
            for i in range(n):
                self._resident[i] = self.to_device(self._host_batch(i), self.device, False)
        finally:
            self.mode = saved
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _host_batch(self, i: int):
        if self._it is None or i != self._next:
            self.close()
            self._it = self._stream(i)
        self._next = i + 1
        return next(self._it)

    def __call__(self, i: int):
        if self.mode == "resident":
            if i not in self._resident:
                raise IndexError(f"batch {i} is not resident: make_resident(n) produced {len(self._resident)} batches")
            return self._resident[i]
        if self._last is not None and self._last[0] == i:   # asked again (a probe before the step): no restart
            return self._last[1]
        t0 = time.perf_counter()
        host = self._host_batch(i)
        out = self.to_device(host, self.device, self.mode == "tuned")
        self.wait_s += time.perf_counter() - t0
        self.n_waits += 1
        self._last = (i, out)
        return out

    def close(self) -> None:
        it, self._it, self._last = self._it, None, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self._loader = None


def _quiet_worker(_):
    torch.set_num_threads(1)   # workers decode with numpy; torch threads in each would oversubscribe


def _stack(samples: list) -> tuple:
    return tuple(torch.stack(field) for field in zip(*samples))


def _to(batch, device: torch.device, non_blocking: bool):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: _to(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device, non_blocking) for v in batch)
    return batch


def throughput(like: LoaderBatches, workers: int, n_batches: int = 30, warmup: int = 3) -> dict:
    """How fast a loader alone delivers batches to the device, model excluded: the supply side of
    the step. ``like`` gives the dataset, batch size, collate and device; ``workers`` 0 means the
    simple loader (everything in this process, blocking copy), more means the tuned one. Timing
    starts after ``warmup`` batches (worker start-up is reported apart) and ends with the device
    synchronised, so the copies are inside the time."""
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    mode = "tuned" if workers > 0 else "simple"
    b = LoaderBatches(like.dataset, like.batch, like.device, like.seed, mode, workers=workers,
                      prefetch=like.prefetch, collate=like.collate, to_device=like.to_device)
    sync = torch.cuda.synchronize if like.device.type == "cuda" else (lambda *_: None)
    try:
        t0 = time.perf_counter()
        for i in range(warmup):
            b(i)
        sync()
        t1 = time.perf_counter()
        for i in range(warmup, warmup + n_batches):
            b(i)
        sync()
        t2 = time.perf_counter()
    finally:
        b.close()
    per_s = n_batches / (t2 - t1)
    return {"workers": workers, "mode": mode, "batches_per_s": per_s, "samples_per_s": per_s * like.batch,
            "ms_per_batch": 1e3 / per_s, "startup_s": t1 - t0}
