"""Steps taken off the ladder: a step stays on a workload's ladder while its gain over the step it
builds on lies outside the noise on the reference GPU; one inside it becomes a toggle of notebook 19
(``hwlib.studies.ablation``), measured with its own interval, and its folder and notebook go.

A retired step's records stay in the committed runs that measured it. The ladder tables leave them
out (``query.ladder_rows`` reads ``LADDER`` only); the report's "Retired steps" block
(``hwlib.report.tables.retired_block``) shows each one against the step it built on, from those
records, and the time table marks its notebook as retired.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Retired:
    name: str            # the step's name, as its records and its notebook were named
    title: str           # what it changed
    after: str           # the ladder step it built on
    workloads: tuple[str, ...]
    toggle: str          # the ablation toggle (hwlib.studies.ablation.TOGGLES) that measures the change now
    why: str             # why it left the ladder, besides its figure (the block gives that from the records)


RETIRED: tuple[Retired, ...] = (
    Retired("28_gemm_workspace", "torch's matmuls and hwlib's plain cuBLASLt matmul without cuBLAS's workspace "
            "(hwlib.blas.no_workspace): no memset before them in the CUDA graph", after="25_bias_column",
            workloads=("gpt",), toggle="no_gemm_workspace",
            why="the memsets it removes exist only where cuBLAS picks a kernel that clears counters in its "
                "workspace: on an H200 the step's own GPU test found none to remove, with the workspace or "
                "without it"),
)
RETIRED_NAMES = tuple(r.name for r in RETIRED)

