"""Communication, measured two ways: the all-reduce bus bandwidth of the job's process group, and
the communication time a training step leaves exposed, read off a torch.profiler trace.

Bus bandwidth (the figure nccl-tests report): a ring all-reduce of S bytes over K ranks moves
2 (K - 1) / K x S bytes through each rank's slowest link, so

    algbw = S / t          busbw = algbw x 2 (K - 1) / K

and busbw compares across K (it is the link's speed, whatever K). At K = 1 there is nothing to
reduce and no bus bandwidth.

Exposed communication: over the profiled steps, the time when a communication kernel runs and no
other kernel does. On a GPU, communication kernels are NCCL's (``nccl*`` kernels); everything else
on the device (GEMMs, fused kernels, copies) is compute. Overlapped communication is the rest of
the NCCL time. On a CPU over gloo the communication runs on gloo's own threads
(``gloo:*`` annotations) and compute is the training thread's operators: the split shows that the
code path works; its times are a CPU's.
"""

from __future__ import annotations

import os

import torch

from .. import bench
# The interval arithmetic and the trace's recording and reading are shared with every profiled study.
from ..trace import GPU_CATEGORIES, complete_events, intersection_length, length
from ..trace import record as record_trace


# --- splitting a window's time --------------------------------------------------------------------------

def split(comm, compute, span: float, steps: int) -> dict:
    """Per-step milliseconds of a profiled window of ``steps`` steps, from interval lists in
    microseconds: compute, communication, its exposed (not overlapped) part, the overlapped part and
    idle time (neither runs), with the window's span."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    c, m = length(compute), length(comm)
    both = intersection_length(comm, compute)
    busy = length(list(comm) + list(compute))
    per = 1e-3 / steps   # microseconds over the window -> milliseconds per step
    return {"step_ms": span * per, "compute_ms": c * per, "comm_ms": m * per, "exposed_comm_ms": (m - both) * per,
            "overlapped_comm_ms": both * per, "idle_ms": max(0.0, span - busy) * per, "steps": steps}


# --- reading a trace ------------------------------------------------------------------------------------

def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def trace_intervals(events: list[dict], kind: str) -> tuple[list, list, float]:
    """(communication, compute, span) of a Chrome trace's complete events (``ph == 'X'``, times in
    microseconds), for a device of ``kind`` ('cuda' or 'cpu'); see the module doc."""
    xs = complete_events(events)
    comm, compute = [], []
    if kind == "cuda":
        for e in xs:
            if e.get("cat") in GPU_CATEGORIES:
                (comm if is_comm_kernel(e.get("name", "")) else compute).append((e["ts"], e["ts"] + e["dur"]))
    else:
        comm_threads = set()
        for e in xs:
            if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(("gloo:", "nccl:")):
                comm.append((e["ts"], e["ts"] + e["dur"]))
                comm_threads.add(e.get("tid"))
        for e in xs:
            # c10d::* operators only hand the work to the communication threads.
            if e.get("cat") == "cpu_op" and e.get("tid") not in comm_threads and not str(e.get("name", "")).startswith("c10d::"):
                compute.append((e["ts"], e["ts"] + e["dur"]))
    spanned = comm + compute
    span = (max(e for _, e in spanned) - min(s for s, _ in spanned)) if spanned else 0.0
    return comm, compute, span


def profile_split(run_steps, steps: int, device: torch.device, trace_path: str | os.PathLike,
                  keep_trace: bool = False) -> tuple[dict | None, str | None]:
    """Profile ``run_steps()`` (which runs ``steps`` training steps) and split its time (``split``).
    Returns (split, None), or (None, why) when the profiler could not record or read the steps:
    ``run_steps`` runs exactly once either way, since the other ranks run the same steps and wait in
    their collectives for this one."""
    events, why = record_trace(run_steps, device, trace_path, keep_trace)
    if events is None:
        return None, why
    comm, compute, span = trace_intervals(events, device.type)
    if device.type == "cuda" and not compute:
        return None, "the profiler recorded no GPU kernels (CUPTI unavailable?): no split"
    return split(comm, compute, span, steps), None


# --- bus bandwidth ----------------------------------------------------------------------------------------

def bus_factor(world: int) -> float:
    """busbw / algbw of a ring all-reduce over ``world`` ranks: 2 (K - 1) / K."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return 2.0 * (world - 1) / world


def allreduce_bandwidth(sizes_bytes: list[int], device: torch.device, world: int, *, warmup: int = 3,
                        iters: int = 10) -> list[dict]:
    """Time an fp32 all-reduce of each size on every rank (every rank must call this together) through
    ``bench.time_fn``; rows with the median and p20/p80 milliseconds and the bus bandwidth in GB/s
    (10^9 bytes) at the median and at p80/p20 of the time."""
    import torch.distributed as dist
    rows = []
    factor = bus_factor(world)
    for size in sizes_bytes:
        n = max(1, int(size) // 4)
        # Not zeros: a reduction of zeros could be special-cased anywhere along the way.
        buf = torch.ones(n, dtype=torch.float32, device=device)
        t = bench.time_fn(lambda i: dist.all_reduce(buf), device, warmup=warmup, iters=iters)
        nbytes = n * 4

        def bw(ms):
            return nbytes / (ms / 1e3) / 1e9 * factor if factor else None
        rows.append({"bytes": nbytes, "ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms,
                     "busbw_gbps": bw(t.median_ms), "busbw_p20": bw(t.p80_ms), "busbw_p80": bw(t.p20_ms)})
        del buf
    return rows


def traffic_bytes(strategy: str, param_bytes: float, world: int) -> float:
    """Bytes each rank moves per step through its link in a ring, for fp32 gradients and parameters of
    ``param_bytes`` in all: ``ddp`` all-reduces the gradients, 2 (K-1)/K G; ``ddp_zero1`` adds the
    broadcast of the updated parameters, (K-1)/K G; ``fsdp2`` all-gathers the parameters before
    forward and again before backward and reduce-scatters the gradients, at most 3 (K-1)/K G (the
    root's parameters are not gathered twice); ``graphed`` all-reduces like ``ddp`` and
    ``graphed_zero1`` reduce-scatters the gradients and all-gathers the parameters, the same bytes;
    ``single`` moves nothing."""
    share = (world - 1) / world if world > 1 else 0.0
    factor = {"single": 0.0, "ddp": 2.0, "ddp_zero1": 3.0, "fsdp2": 3.0,
              # reduce-scatter (K-1)/K G and all-gather (K-1)/K G: an all-reduce's bytes, split in two
              "graphed": 2.0, "graphed_zero1": 2.0}
    if strategy not in factor:
        raise ValueError(f"no traffic model for strategy {strategy!r}")
    return factor[strategy] * share * param_bytes


def predicted_ms(strategy: str, param_bytes: float, world: int, busbw_gbps: float | None) -> float | None:
    """The communication time per step of ``traffic_bytes`` at a measured bus bandwidth (busbw is
    defined so that a link moving B bytes at it takes B / busbw); None without a bandwidth or at K = 1."""
    b = traffic_bytes(strategy, param_bytes, world)
    if not b or not busbw_gbps:
        return None
    return b / (busbw_gbps * 1e9) * 1e3


def predicted_allreduce_ms(nbytes: float, busbw_gbps: float, world: int) -> float | None:
    """The time a ring all-reduce of ``nbytes`` takes at a measured bus bandwidth (None at K = 1)."""
    f = bus_factor(world)
    if not f or not busbw_gbps:
        return None
    return nbytes * f / (busbw_gbps * 1e9) * 1e3
