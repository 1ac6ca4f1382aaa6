"""Tensor-core friendly shapes: padding a dimension (``hwlib.studies.shapes`` measures what it buys).

A GEMM whose dimensions are multiples of the tile sizes (64 or 128 on Hopper for 16-bit inputs)
runs without ragged edge tiles and with aligned, vectorised loads. GPT-2's vocabulary, 50257, is
odd; padded to 50304 (a multiple of 64, +0.09% work) the output projection runs on full tiles.
"""

from __future__ import annotations


def padded(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    if n < 1 or multiple < 1:
        raise ValueError(f"padded: n and multiple must be >= 1, got n={n}, multiple={multiple}")
    return -(-n // multiple) * multiple
