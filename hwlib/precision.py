"""Precision switches: the fp32 math mode (TF32 or IEEE) and autocast, set and restored in one place.

Both take plain values (``tf32: bool``, ``autocast: None | 'bf16' | 'fp16'``) so that anything that
times a matmul (ceilings, steps, studies) sets them the same way without knowing about the ladder.
"""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_CHOICES = (None, "bf16", "fp16")


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
        mm, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
        saved = (mm.fp32_precision, conv.fp32_precision)
        mode = "tf32" if tf32 else "ieee"
        try:
            mm.fp32_precision, conv.fp32_precision = mode, mode
            yield
        finally:
            mm.fp32_precision, conv.fp32_precision = saved
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
