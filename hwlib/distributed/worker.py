"""The torchrun entry point: one rank of a multi-GPU measurement.

    torchrun --standalone --nproc-per-node=2 -m hwlib.distributed.worker --workloads gpt \\
        --strategies ddp,fsdp2 --scalings weak,strong --profile full

(``hwlib.distributed.launch`` builds this command, checks its arguments first and reports a failing
rank; across nodes, torchrun's rendezvous arguments go before ``-m``.) Each rank binds its local
GPU, joins the process group (NCCL on GPUs, gloo on CPUs) with a bounded collective timeout, and
runs the job's measurements in order (``request.jobs``); rank 0 writes the records through
``hwlib.ladder.record`` (the ladder's own records, with the x-values world_size, strategy, scaling,
per_gpu_batch and global_batch as fields) and one row per measurement for the launcher. A rank that
raises writes its error to ``<out>/errors/rank<r>.json`` and exits non-zero; torchrun then stops the
other ranks.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from .launch import MULTICAST_OFF


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; a clear error outside torchrun."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start this module with torchrun "
                           "(or python -m hwlib.distributed.launch), not directly")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def write_error(out: Path, rank: int, exc: BaseException) -> Path:
    """This rank's error, for the launcher to name the rank that failed first."""
    d = out / "errors"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank{rank}.json"
    path.write_text(json.dumps({"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                                "type": type(exc).__name__, "message": str(exc),
                                "traceback": "".join(traceback.format_exception(exc))}))
    return path


def say(text: str) -> None:
    """A line the launcher shows (it keeps every other line in the job's log only)."""
    print(f"[hwlib] {text}", flush=True)


def describe(job, world: int, res, check, split) -> str:
    head = (f"{job.workload} {job.strategy} {'+'.join(job.scalings)} K={world} "
            f"({job.per_gpu_batch}/GPU, {job.global_batch} in all)")
    if res.status != "ok" or res.timing is None:
        return f"{head}: {res.status}" + (f" ({res.reason})" if res.reason else "")
    t = res.timing
    text = (f"{head}: {t.median_ms:.2f} ms/step (p20 {t.p20_ms:.2f}, p80 {t.p80_ms:.2f}), "
            f"{res.items_per_s:,.0f} {res.unit}/s")
    if res.compile_s is not None:
        text += f", compile {res.compile_s:.1f} s"
    if check is not None:
        text += f" | same math vs 1 process: {check.max_rel_diff:.1e} (tol {check.tolerance:.0e}) " + \
                ("ok" if check.ok else "FAILED")
    if split:
        text += f" | comm {split['comm_ms']:.2f} ms/step, exposed {split['exposed_comm_ms']:.2f}"
    return text


def record_job(req, job, world: int, outcome, device) -> None:
    """Rank 0: the measurement's records (one set per scaling it stands for) and its comm split."""
    from .. import results
    from ..ladder.record import record
    for sc in job.scalings:
        fields = job.fields(world, sc, req.options)
        recs = record(outcome.res, notebook=req.notebook, check=outcome.check, ceilings=req.ceilings, run=req.run,
                      fields=fields)
        if outcome.split:
            mid = recs[0]["measurement"]
            common = dict(notebook=req.notebook, workload=outcome.res.workload, step=outcome.res.step,
                          profile=outcome.res.profile, device=outcome.res.device,
                          fields={**fields, "variant": True}, params={"profiled_steps": outcome.split["steps"]},
                          extra={"measurement": mid})
            results.append([results.make_record(metric=m, value=outcome.split[m], unit="ms", **common)
                            for m in ("compute_ms", "comm_ms", "exposed_comm_ms", "overlapped_comm_ms", "idle_ms",
                                      "step_ms")], req.run)


def row_of(job, world: int, outcome) -> dict:
    res = outcome.res
    t = res.timing
    return {"workload": job.workload, "strategy": job.strategy, "scalings": list(job.scalings), "world_size": world,
            "per_gpu_batch": job.per_gpu_batch, "global_batch": job.global_batch, "step": job.step,
            "status": res.status, "reason": res.reason, "ms_per_step": t.median_ms if t else None,
            "ms_p20": t.p20_ms if t else None, "ms_p80": t.p80_ms if t else None,
            "throughput": res.items_per_s, "unit": f"{res.unit}/s", "compile_s": res.compile_s,
            "check_losses": res.check_losses, "split": outcome.split,
            "same_math": None if outcome.check is None else {"max_rel": outcome.check.max_rel_diff,
                                                              "tolerance": outcome.check.tolerance,
                                                              "ok": outcome.check.ok},
            "notes": res.notes, "env": {k: os.environ.get(k) for k in MULTICAST_OFF}}


def run(req, out: Path, device, rank: int, world: int) -> None:
    import torch
    from . import comm
    from .request import validate
    from .train import run_job
    jobs = validate(req, world)
    for n, job in enumerate(jobs, 1):
        ref = (req.reference.get(job.workload) or {}).get(job.global_batch)
        outcome = run_job(job, profile=req.profile, device=device, rank=rank, world=world, seed=req.seed,
                          plan=req.plan, options=req.options, profile_steps=req.steps_profiled(),
                          trace_dir=out, keep_trace=req.keep_traces, reference=ref,
                          fault_at=req.fault[1] if req.fault and req.fault[0] == rank else None)
        if rank == 0:
            if req.record:
                record_job(req, job, world, outcome, device)
            with open(out / "rows.jsonl", "a") as f:
                f.write(json.dumps(row_of(job, world, outcome)) + "\n")
            say(f"[{n}/{len(jobs)}] " + describe(job, world, outcome.res, outcome.check, outcome.split))
    if req.comm_sizes_mb and world > 1:
        rows = comm.allreduce_bandwidth([int(mb * 2**20) for mb in req.comm_sizes_mb], device, world)
        if rank == 0:
            _record_bandwidth(req, rows, world, device)
            with open(out / "bandwidth.jsonl", "a") as f:
                for r in rows:
                    f.write(json.dumps({"world_size": world, **r}) + "\n")
            say("all-reduce bus bandwidth: " + ", ".join(f"{r['bytes'] / 2**20:g} MiB {r['busbw_gbps']:.1f} GB/s"
                                                        for r in rows))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_bandwidth(req, rows: list[dict], world: int, device) -> None:
    from .. import results
    if not req.record:
        return
    from ..device import info
    dev = info(device).to_dict()
    results.append([results.make_record(notebook=req.notebook, workload=None, step=None,
                                        metric="allreduce_busbw_gbps", value=r["busbw_gbps"], unit="GB/s",
                                        p20=r["busbw_p20"], p80=r["busbw_p80"], profile=req.profile, device=dev,
                                        fields={"world_size": world, "bytes": r["bytes"]},
                                        params={"ms": r["ms"], "p20_ms": r["p20_ms"], "p80_ms": r["p80_ms"],
                                                "dtype": "float32", "op": "all_reduce(sum)"})
                    for r in rows], req.run)


def _main(argv: list[str] | None = None) -> int:
    # Also when torchrun was started by hand: NCCL reads these when the process group initialises.
    for k, v in MULTICAST_OFF.items():
        os.environ[k] = v
    from .request import from_argv
    req, ns = from_argv(argv)
    rank, world, local_rank = rank_env()
    from ..paths import run_dir
    out = Path(ns.out) if ns.out else run_dir(req.run) / "distributed" / f"manual_{int(time.time())}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        import torch
        import torch.distributed as dist
        from ..device import resolve_device
        dev = resolve_device(req.device)
        if dev.type == "cuda":
            # Bind this rank's GPU before anything touches CUDA: a stray context on GPU 0 would show
            # as another process beside rank 0's timing.
            if local_rank >= torch.cuda.device_count():
                raise RuntimeError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible on "
                                   f"{socket.gethostname()}")
            dev = torch.device(f"cuda:{local_rank}")
            torch.cuda.set_device(dev)
        from ..profiles import resolve_profile
        req.profile = resolve_profile(req.profile, dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=req.collective_timeout_s), **kw)
        run(req, out, dev, rank, world)
    except BaseException as e:
        # The error first, and no orderly teardown: with collectives of this rank still in flight, a
        # process-group shutdown could wait on peers that wait on us. Exiting ends them: torchrun stops
        # the other ranks when one exits with an error.
        write_error(out, rank, e)
        raise
    # Every rank done before the group goes: a rank tearing down while a peer still talks to it
    # can abort in gloo's or NCCL's threads.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    # torchrun's own error record (its "Root Cause" summary) beside hwlib's error file.
    from torch.distributed.elastic.multiprocessing.errors import record
    return record(_main)(argv)


if __name__ == "__main__":
    # Leave without the interpreter's teardown either way. After an error (on file by now, ours and
    # torchrun's): a communicator's destructor could wait on peers that are waiting on this rank.
    # After success (records fsynced, rows written): the teardown of torch's C++ threads was seen to
    # abort now and then on gloo, which would turn a finished job into a failed one.
    try:
        code = main()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
