"""The shared recipe's global knobs: what every workload's model, data and training loop read.

Steps 01-12 (the recipe) each change one of these; the steps past the recipe change no knob: each is
an ``apply(model)`` in its folder under ``hwlib/steps`` that swaps modules into the model built here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    tf32: bool = False               # TF32 tensor-core matmuls for fp32 tensors
    autocast: str | None = None      # None, "bf16" or "fp16" (fp16 brings a GradScaler)
    attention: str = "manual"        # "manual" (matmul-softmax-matmul) or "sdpa"
    fused_adamw: bool = False        # AdamW(fused=True) and zero_grad(set_to_none=True)
    compile: bool = False            # torch.compile(model)
    vocab_multiple: int = 1          # pad the vocabulary to a multiple of this
    loader: str = "simple"           # "simple", "tuned" or "resident" (hwlib.data.loader)
    cuda_graphs: bool = False        # compiled with mode="reduce-overhead": the step's kernels replayed as CUDA graphs
    channels_last: bool = False      # NHWC memory format for convolutions and their inputs
    packing: bool = False            # sequences packed without padding, attention kept within each sequence
    bk_backend: str = "torch"        # BK-Core backend of the resnet_bk workload (hwlib.ops)
    # Memory techniques (notebook 13), not ladder steps:
    checkpointing: str = "none"      # activation checkpointing: "none", "all" or block indices "0,2,4"
    offload_optimizer: bool = False  # AdamW moments in pinned CPU memory (hwlib.memory.offload)

    def diff(self, other: "Settings") -> dict:
        """Fields where ``self`` differs from ``other``: {name: (other's, self's)}."""
        return {f.name: (getattr(other, f.name), getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)}
