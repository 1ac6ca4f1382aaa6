"""Memory: trackers, exact accumulation, OOM-resilient steps, batch-size finder, optimizer-state
offload, and checkpoint/resume of a training run. Notebook 13 measures what each one costs and saves."""

from .accumulation import ResilientStep, accumulate, plan_micro_batches, split_batch
from .checkpoint import load_checkpoint, save_checkpoint
from . import allocator, offload
from .finder import FinderResult, find_batch_size, search_batch
from .tracker import MemoryTracker, memory_figures

__all__ = ["MemoryTracker", "memory_figures", "plan_micro_batches", "split_batch", "accumulate", "ResilientStep",
           "FinderResult", "find_batch_size", "search_batch", "save_checkpoint", "load_checkpoint"]
