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

from dataclasses import dataclass

import torch

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

    def to_row(self) -> dict:
        return {"workload": self.workload, "kind": self.kind, "GFLOP removed": _g(self.flops_removed),
                "MB removed": None if self.bytes_removed is None else self.bytes_removed / 1e6,
                "predicted saving (ms)": self.saved_ms, "floor (ms)": self.floor_ms,
                "basis": self.basis + (f" ({self.missing})" if self.missing else "")}


def _g(flops):
    return None if flops is None else flops / 1e9


def matmul_ceiling(ceilings: dict | None, precision: str) -> float | None:
    """TFLOP/s of the measured matmul ceiling of ``precision``; without TF32 (a CPU) fp32 stands in."""
    mm = (ceilings or {}).get("matmul_tflops") or {}
    return mm.get(precision) or (mm.get("fp32") if precision == "tf32" else None)


def flops_ms(flops: float, ceilings: dict | None, precision: str) -> float | None:
    peak = matmul_ceiling(ceilings, precision)
    return flops / (peak * 1e12) * 1e3 if peak else None


def bytes_ms(nbytes: float, ceilings: dict | None) -> float | None:
    gbps = (ceilings or {}).get("copy_gbps")
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
