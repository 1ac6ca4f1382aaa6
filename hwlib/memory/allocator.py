"""The CUDA caching allocator's configuration, as far as memory figures depend on it.

Under the default allocator the *reserved* peak of a step is not a function of its tensors alone:
blocks are carved out of fixed segments, so the same tensors allocated in another order leave other
holes, and two runs of the same step at the same batch, with the same peak allocated, can reserve
amounts that differ by several GiB. With ``expandable_segments:True`` a segment grows in place, so
reserved tracks allocated and a reserved peak measured once predicts the next run (notebook 13
measures both). The batch finder records which configuration it measured under.
"""

from __future__ import annotations

import os

import torch

ENV = "PYTORCH_CUDA_ALLOC_CONF"


def _options(conf: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in conf.split(","))):
        key, sep, value = part.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{ENV}={conf!r}: option {part!r} is not of the form key:value; "
                             f"fix or unset {ENV} (and PYTORCH_ALLOC_CONF)")
        out[key.strip()] = value.strip()
    return out


def _format(conf: dict[str, str]) -> str:
    return ",".join(f"{k}:{v}" for k, v in conf.items())


def settings() -> str:
    """The allocator options in force for this process ('' = the defaults)."""
    conf = _options(os.environ.get("PYTORCH_ALLOC_CONF", "") or os.environ.get(ENV, ""))
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        conf.update(_options(getter() or ""))     # set at run time: overrides the environment
    return _format(conf)


def use_expandable_segments() -> str:
    """Turn on expandable segments for this process and the processes it starts; return the settings.

    Call it before the first CUDA allocation: segments reserved before the call keep their old kind.
    Other options already set (``max_split_size_mb`` ...) are kept.
    """
    conf = _options(os.environ.get(ENV, ""))
    conf["expandable_segments"] = "True"
    os.environ[ENV] = _format(conf)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter("expandable_segments:True")
    elif torch.cuda.is_available():   # older torch: the CUDA-only spelling
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return settings()
