"""Memory: trackers, exact accumulation, OOM-resilient steps, the batch-size search, optimizer-state
offload, and checkpoint/resume of a training run. Notebook 13 measures what each one costs and saves."""

from .accumulation import ResilientStep, accumulate, plan_micro_batches, split_batch
from .checkpoint import load_checkpoint, save_checkpoint
from . import allocator, offload
from .finder import FinderResult, search_batch
from .tracker import MemoryTracker, memory_figures

__all__ = ["MemoryTracker", "memory_figures", "plan_micro_batches", "split_batch", "accumulate", "ResilientStep",
           "FinderResult", "search_batch", "save_checkpoint", "load_checkpoint"]
