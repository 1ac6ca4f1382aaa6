"""Precision switches: the fp32 math mode (TF32 or IEEE) and autocast, set and restored in one place.

Both take plain values (``tf32: bool``, ``autocast: None | 'bf16' | 'fp16'``) so that anything that
times a matmul (ceilings, steps, studies) sets them the same way without knowing about the ladder.
"""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_CHOICES = (None, "bf16", "fp16")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an op that autocast would cast computes ``x`` in: autocast's dtype where autocast is on
    for x's device, else x's own (the ops that make their own casts, as autocast would, ask this)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _new_precision_api() -> bool:
    # torch >= 2.9 has per-backend fp32_precision; mixing it with the legacy allow_tf32 flags
    # raises, so hwlib uses exactly one of the two APIs.
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


@contextlib.contextmanager
def tf32_mode(tf32: bool):
    """Set the fp32 math mode a step needs (matmuls and cuDNN convolutions), restore it after.

    Baseline means IEEE fp32 everywhere: cuDNN convolutions default to TF32, so they are set too.
    """
    if _new_precision_api():
        mm, conv, cpu_mm = torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.mkldnn.matmul
        saved = (torch.get_float32_matmul_precision(), mm.fp32_precision, conv.fp32_precision, cpu_mm.fp32_precision)
        try:
            # through the legacy setter, which moves CUDA's matmul precision and the legacy value
            # together: inductor's max-autotune reads the legacy value, and torch raises ("mix of the
            # legacy and new APIs") while it disagrees with the per-backend one
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
            cpu_mm.fp32_precision = saved[3]        # CPU matmuls keep their own setting
            conv.fp32_precision = "tf32" if tf32 else "ieee"
            yield
        finally:
            torch.set_float32_matmul_precision(saved[0])
            mm.fp32_precision, conv.fp32_precision, cpu_mm.fp32_precision = saved[1:]
    else:
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        try:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def autocast(mode: str | None, device: torch.device):
    """``torch.autocast`` for ``mode`` (None: a no-op context)."""
    if mode not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast mode {mode!r}: choose None, 'bf16' or 'fp16'")
    if mode is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if mode == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
