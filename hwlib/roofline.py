"""Roofline predictions: what a ladder step removes in FLOPs or bytes, and the time that should save
at the run's measured ceilings (``hwlib.ceilings``), before the step is measured.

A prediction is made of counts and ceilings only; nothing here times or reads results. The
measured times it needs (the step before, for a bound) are handed in by the caller.

* ``estimate``: the change removes (or adds) a counted number of FLOPs or bytes; the time is that
  count over the matmul ceiling of the step's precision, or over the measured copy bandwidth.
* ``bound``: the change removes overhead the roofline does not count (kernel launches, fusion of
  memory-bound ops): at most the time the step before spent above its floor can go.
* ``none``: the change removes nothing a roofline counts (the row says what it removes instead).

The floor of a step is its model FLOPs at the matmul ceiling of its precision (bf16 under autocast,
TF32 with TF32 on, else fp32): no schedule can run the model's FLOPs faster on this device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .ceilings import usable
from .settings import Settings
from .workloads import get_workload

# Passes of the unfused attention over its [B, H, T, T] score matrix in one forward: the QK^T
# matmul writes it, each elementwise op between (scale, mask, softmax) reads and writes it, and
# the AV matmul reads it. Backward runs the same ops' gradients: counted as twice the forward,
# the rule the FLOP counts use. Fused attention keeps the tile in registers: zero passes.
ELEMENTWISE_IN_ATTENTION = {"gpt": 3, "encoder_nli": 3, "vit_bdh": 2}
BACKWARD_FACTOR = 2
# vit_bdh's patch convolution: 3 x 32 x 32 images in, 8 x 8 patches of D channels out.
VIT_IMAGE_ELEMS, VIT_PATCHES = 3 * 32 * 32, 64


@dataclass
class Prediction:
    workload: str
    step: str
    kind: str                          # "estimate", "bound" or "none"
    basis: str                         # what is counted, in words
    flops_removed: float | None = None # per training step; negative: added
    bytes_removed: float | None = None
    saved_ms: float | None = None      # at the measured ceilings; for a bound, the most it can save
    floor_ms: float | None = None      # this step's model FLOPs at its precision's ceiling
    missing: str | None = None         # why saved_ms is None
    clamped: str | None = None         # why saved_ms is less than the count gave (``clamp_to_step``)

    def to_row(self) -> dict:
        return {"workload": self.workload, "kind": self.kind, "GFLOP removed": _g(self.flops_removed),
                "MB removed": None if self.bytes_removed is None else self.bytes_removed / 1e6,
                "predicted saving (ms)": self.saved_ms, "floor (ms)": self.floor_ms,
                "basis": self.basis + "".join(f" ({w})" for w in (self.missing, self.clamped) if w)}

    def clamp_to_step(self, prev_ms: float | None) -> "Prediction":
        """Cap ``saved_ms`` at what the step before's measured ``prev_ms`` leaves above this step's floor: a
        larger saving would predict a step faster than its floor, or than no time at all (counts at ceilings
        measured under contention, or on CPU stand-ins). The cap and its reason are kept (``clamped``)."""
        if prev_ms is None or self.saved_ms is None:
            return self
        room = prev_ms - (self.floor_ms or 0.0)
        if self.saved_ms <= max(room, 0.0):   # a negative saving (a cost the step adds) is never raised to 0
            return self
        if room <= 0:
            self.clamped = (f"clamped from {self.saved_ms:.3g} ms to 0: the step before measured {prev_ms:.3g} ms, "
                            f"not above this step's floor {self.floor_ms or 0.0:.3g} ms (check the ceilings)")
            self.saved_ms = 0.0
        else:
            self.clamped = (f"clamped from {self.saved_ms:.3g} ms to {room:.3g}: the step before measured "
                            f"{prev_ms:.3g} ms, {self.floor_ms or 0.0:.3g} of it this step's floor")
            self.saved_ms = room
        return self


def _g(flops):
    return None if flops is None else flops / 1e9


def _ceiling(v, what: str) -> float | None:
    """``v`` as a ceiling: None where the run did not measure it, else a positive, finite number. A negative,
    zero, NaN, infinite or textual one (hand-edited, or from a bad measurement that slipped past
    ``hwlib.ceilings.check``) would give a negative or absurd time: a ValueError naming it."""
    if v is None:
        return None
    if not usable(v):
        raise ValueError(f"ceilings{what} = {v!r} is not a positive, finite ceiling: measure the ceilings again "
                         "(notebook 00) or remove the entry")
    return float(v)


def _count(v, what: str) -> float:
    """A FLOP or byte count: a finite number (negative: a cost the step adds)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number (negative: added), got {v!r}")
    return float(v)


def matmul_ceiling(ceilings: dict | None, precision: str) -> float | None:
    """TFLOP/s of the measured matmul ceiling of ``precision``; without TF32 (a CPU) fp32 stands in. None
    where it was not measured; ValueError naming it where it is not a positive, finite number."""
    mm = (ceilings or {}).get("matmul_tflops") or {}
    own = _ceiling(mm.get(precision), f"['matmul_tflops'][{precision!r}]")
    if own is None and precision == "tf32":
        return _ceiling(mm.get("fp32"), "['matmul_tflops']['fp32']")
    return own


def flops_ms(flops: float, ceilings: dict | None, precision: str) -> float | None:
    """``flops`` at the matmul ceiling of ``precision``, in ms (None without that ceiling)."""
    flops = _count(flops, "flops")
    peak = matmul_ceiling(ceilings, precision)
    return flops / (peak * 1e12) * 1e3 if peak else None


def bytes_ms(nbytes: float, ceilings: dict | None) -> float | None:
    """``nbytes`` at the measured copy bandwidth, in ms (None without it)."""
    nbytes = _count(nbytes, "nbytes")
    gbps = _ceiling((ceilings or {}).get("copy_gbps"), "['copy_gbps']")
    return nbytes / (gbps * 1e9) * 1e3 if gbps else None


def attention_score_bytes(workload: str, cfg, elem_bytes: int) -> float | None:
    """Bytes the unfused attention moves through its score matrices in one training step."""
    ops = ELEMENTWISE_IN_ATTENTION.get(workload)
    if ops is None:
        return None
    tokens = getattr(cfg, "context", None) or VIT_PATCHES + 1
    scores = cfg.batch * cfg.n_head * tokens * tokens * cfg.n_layer
    passes = (2 + 2 * ops) * (1 + BACKWARD_FACTOR)
    return float(scores * passes * elem_bytes)


def parameter_count(workload: str, profile: str) -> int:
    """Parameters of the workload's model, built on the meta device (no memory, no init cost)."""
    wl = get_workload(workload)
    with torch.device("meta"):
        model = wl.build(wl.config(profile), Settings(), 0)
    return sum(p.numel() for p in model.parameters())


@dataclass
class Context:
    """What a step's ``predict`` is handed: the workload and its config at the profile, the run's
    ceilings, the element size of its activations and the matmul precision of the step and of the
    step before, and, for a bound, the step before's measured time and floor."""
    workload: str
    step: str
    profile: str
    cfg: object
    ceilings: dict | None
    elem: int                          # bytes an activation element: 2 under autocast, else 4
    precision: str                     # "bf16", "tf32" or "fp32"
    before: str | None                 # the step before's precision
    prev_ms: float | None = None
    prev_floor_ms: float | None = None

    @property
    def wl(self):
        return get_workload(self.workload)

    @property
    def tokens(self) -> int:
        return self.wl.items_per_step(self.cfg)

    @property
    def flops(self) -> float:
        return self.wl.flops_per_step(self.cfg)

    def bytes_prediction(self, basis: str, nbytes: float) -> Prediction:
        return Prediction(self.workload, self.step, "estimate", basis, bytes_removed=nbytes,
                          saved_ms=bytes_ms(nbytes, self.ceilings))
