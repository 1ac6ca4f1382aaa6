"""The batch-size finder on a real workload: each trial runs full training steps of a ``Session``
(``hwlib.memory.finder.search_batch`` is the search itself, tested without a GPU)."""

from __future__ import annotations

import gc

import torch

from .. import precision
from ..ladder.session import Session
from ..memory import allocator
from ..memory.accumulation import OOM_ERRORS
from ..memory.finder import GiB, FinderResult, search_batch
from ..workloads import get_workload


def find_batch_size(workload: str, settings, device: torch.device, *, profile: str = "full", margin: float = 0.1,
                    start: int = 1, max_batch: int = 1024, steps: int = 2, **config) -> FinderResult:
    """Largest batch of ``workload`` under ``settings`` that fits this GPU with ``margin`` to spare."""
    if device.type != "cuda":
        raise ValueError("find_batch_size measures GPU memory: device must be a CUDA device "
                         "(search_batch takes any measuring function)")
    wl = get_workload(workload)
    gc.collect()
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    capacity = (free + torch.cuda.memory_reserved(device)) / GiB
    allocated: dict[int, float] = {}     # batch -> peak allocated, reported beside the reserved peak

    def try_batch(b: int) -> float | None:
        sess, peak = None, None
        try:
            cfg = wl.config(profile, **{**config, "batch": b})
            torch.cuda.reset_peak_memory_stats(device)
            with precision.tf32_mode(settings.tf32):
                sess = Session(workload, cfg, settings, device)
                for i in range(steps):   # the first step allocates the optimizer states
                    sess.step(i)
                torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_reserved(device) / GiB
            allocated[b] = torch.cuda.max_memory_allocated(device) / GiB
        except OOM_ERRORS:
            peak = None
        finally:
            if sess is not None:
                sess.close()
            sess = None
            gc.collect()
            torch.cuda.empty_cache()
        return peak

    r = search_batch(try_batch, capacity, margin=margin, start=start, max_batch=max_batch)
    for t in r.trials:
        t["peak_alloc_gib"] = allocated.get(t["batch"])     # None for a batch that ran out of memory
    r.allocator = allocator.settings()
    return r
