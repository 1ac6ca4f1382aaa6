"""Start a torchrun job as a subprocess, after checking everything it would need, and bring back
its rows or the error of the rank that failed first.

- Bad input fails here, before anything starts: more processes than GPUs, a world size that does
  not divide a strong-scaling batch, an unknown strategy, workload or scaling (``request.validate``).
- Time is bounded twice: every collective raises on its rank after ``collective_timeout_s`` (a rank
  that hangs), and the whole job is ended (its process group: torchrun and every rank) after
  ``timeout_s``. A rank that raises or dies makes torchrun stop the others at once.
- A failed job raises ``RankFailed`` naming the rank that failed first, its error and the log;
  the measurements it did not finish are recorded as ``failed`` with that reason, never as numbers.
- Every process started gets NVLink multicast off (``MULTICAST_OFF``) in its environment.

Across nodes the same worker runs under torchrun's rendezvous (``Rendezvous``): run
``python -m hwlib.distributed.launch`` on every node with the same arguments (``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import PACKAGE_DIR, run_dir
from .request import Request, jobs as plan_jobs, parser as worker_parser, replace, to_argv, validate

WORKER_MODULE = "hwlib.distributed.worker"
# NVLink multicast stays off in every process of a job, torchrun's included (pitfalls: the machines
# with several GPUs keep it off).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class LaunchError(RuntimeError):
    """A job that could not start or did not finish."""


class LaunchTimeout(LaunchError):
    """The job ran past its time limit and was ended; ``pgid`` is the process group that was ended."""

    def __init__(self, message: str, pgid: int):
        self.pgid = pgid
        super().__init__(message)


class RankFailed(LaunchError):
    """A rank raised or died; ``rank`` failed first, ``error`` is its message, ``detail`` its traceback."""

    def __init__(self, rank: int | None, error: str, detail: str, log: Path, seconds: float):
        self.rank, self.error, self.detail, self.log, self.seconds = rank, error, detail, log, seconds
        who = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(f"{who} failed after {seconds:.1f} s: {error} (log: {log})")


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's rendezvous across nodes. ``nnodes`` is a fixed count (no elastic range: the world
    size has to divide the strong-scaling batch); ``endpoint`` is host:port of the rendezvous
    (c10d: any one node's address); ``node_rank`` only matters to the static backend."""

    nnodes: int
    endpoint: str
    backend: str = "c10d"
    id: str = "hwlib"
    node_rank: int | None = None

    def __post_init__(self):
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"nnodes must be a fixed positive integer (no elastic range), got {self.nnodes!r}")
        if not re.fullmatch(r"[^\s:]+:\d+", str(self.endpoint)):
            raise ValueError(f"rdzv endpoint must be host:port, got {self.endpoint!r}")
        if self.node_rank is not None and not (0 <= self.node_rank < self.nnodes):
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank!r}")


def torchrun_argv(nproc_per_node: int, worker_args: list[str], rendezvous: Rendezvous | None = None,
                  python: str | None = None) -> list[str]:
    """The torchrun command (``python -m torch.distributed.run``, torchrun's own module, so that the
    running interpreter's torch is the one used): standalone on one node, rendezvous across nodes;
    no restarts, so that a failing rank ends the job."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if rendezvous is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(rendezvous.nnodes), "--rdzv-backend", rendezvous.backend,
                "--rdzv-endpoint", rendezvous.endpoint, "--rdzv-id", rendezvous.id]
        if rendezvous.node_rank is not None:
            cmd += ["--node-rank", str(rendezvous.node_rank)]
    return cmd + ["--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", "-m", WORKER_MODULE, *worker_args]


def child_env(nproc_per_node: int, base: dict | None = None) -> dict:
    """The environment of torchrun and its ranks: the caller's, with multicast off, this checkout
    importable, unbuffered output (lines arrive as they are printed) and CPU threads split between the
    ranks."""
    env = dict(os.environ if base is None else base)
    env.update(MULTICAST_OFF)
    root = str(PACKAGE_DIR.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["HWLIB_LAUNCHER_PID"] = str(os.getpid())   # waits idle: not a contender for the ranks' GPUs
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))))
    return env


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check(req: Request, nproc_per_node: int, rendezvous: Rendezvous | None = None) -> list:
    """Validate a job before launch; returns its measurements."""
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be a positive integer, got {nproc_per_node!r}")
    world = nproc_per_node * (rendezvous.nnodes if rendezvous else 1)
    gpu_job = req.device == "cuda" or (req.device == "auto" and visible_gpus() > 0)
    if req.device == "cuda" and visible_gpus() == 0:
        raise ValueError("device='cuda' but no CUDA GPU is visible; use device='cpu' (gloo) or 'auto'")
    return validate(req, world, nproc_per_node=nproc_per_node, gpus=visible_gpus() if gpu_job else None)


@dataclass
class LaunchResult:
    world_size: int
    rows: list
    bandwidth: list
    seconds: float
    log: Path
    argv: list = field(default_factory=list)


def _pump(stream, log_path: Path, echo: bool) -> None:
    with open(log_path, "a") as log:
        for line in iter(stream.readline, ""):
            log.write(line)
            log.flush()
            if echo and line.startswith("[hwlib] "):
                print(line[len("[hwlib] "):], end="", flush=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # a member we may not signal still counts as alive
        return True
    return True


def _end_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to the job's process group (torchrun and every rank), SIGKILL to what is left after
    ``grace_s``: returns when the whole group is gone (or after the SIGKILL's own grace)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid):
                return
            time.sleep(0.05)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def first_failure(out: Path, log: Path) -> tuple[int | None, str, str]:
    """(rank, message, traceback) of the rank that failed first: a rank that torchrun names as the root
    cause and that wrote no error died without a word (a signal, os._exit); otherwise the earliest error
    a rank wrote. Torchrun's root cause is the first exit it observed: a peer's connection error can
    exit in the same poll as the rank that raised and be named instead (seen on gloo under load)."""
    errs = {}
    for p in sorted((out / "errors").glob("rank*.json")):
        try:
            e = json.loads(p.read_text())
            errs[e["rank"]] = e
        except (OSError, ValueError, KeyError, TypeError):
            continue
    text = log.read_text(errors="replace") if log.exists() else ""
    m = ROOT_CAUSE.search(text)
    if m:
        rank, code = int(m.group(1)), int(m.group(2))
        if rank not in errs:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return rank, f"the process {how} without an error of its own", text[-4000:]
    if errs:
        e = min(errs.values(), key=lambda x: x.get("time", float("inf")))
    else:
        return None, "torchrun failed before any rank reported an error", text[-4000:]
    return e.get("rank"), f"{e.get('type')}: {e.get('message')}", e.get("traceback", "")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def record_failed(req: Request, world: int, done: list[dict], reason: str) -> None:
    """Every measurement of the job that brought back no row, recorded as failed with the reason:
    an interrupted job never leaves a number."""
    if not req.record:
        return
    from .. import results
    from ..device import info
    finished = {(r["workload"], r["strategy"], r["per_gpu_batch"], r["global_batch"]) for r in done}
    dev = info("cpu" if req.device == "cpu" else "auto").to_dict()
    recs = []
    for job in plan_jobs(req, world):
        if (job.workload, job.strategy, job.per_gpu_batch, job.global_batch) in finished:
            continue
        for sc in job.scalings:
            recs.append(results.make_record(notebook=req.notebook, workload=job.workload, step=job.step,
                                            metric="ms_per_step", value=None, unit="ms", status="failed",
                                            reason=reason, profile=req.profile, device=dev,
                                            fields={**job.fields(world, sc, req.options), "variant": True}))
    if recs:
        results.append(recs, req.run)


def launch(req: Request, nproc_per_node: int, *, rendezvous: Rendezvous | None = None, timeout_s: float = 540.0,
           job_dir: str | os.PathLike | None = None, echo: bool = True) -> LaunchResult:
    """Run ``req`` on ``nproc_per_node`` processes (times ``rendezvous.nnodes``) under torchrun and
    return rank 0's rows. Raises ``RankFailed`` or ``LaunchTimeout`` (with the failed measurements
    recorded), or a ValueError before launch."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    from ..profiles import resolve_profile
    req = replace(req, profile=resolve_profile(req.profile, "cpu" if req.device == "cpu" else "auto"))
    check(req, nproc_per_node, rendezvous)
    world = nproc_per_node * (rendezvous.nnodes if rendezvous else 1)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(job_dir) if job_dir else (run_dir(req.run) / "distributed" /
                                         f"{stamp}_k{world}_{'+'.join(req.strategies)}_{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    inputs = out / "inputs.json"
    inputs.write_text(json.dumps({"reference": {w: {str(g): v for g, v in d.items()} for w, d in req.reference.items()},
                                  "ceilings": req.ceilings}))
    argv = torchrun_argv(nproc_per_node, to_argv(req, out=str(out), inputs=str(inputs)), rendezvous)
    log = out / "torchrun.log"
    log.write_text("$ " + " ".join(argv) + "\n")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=child_env(nproc_per_node), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, log, echo), daemon=True)
    pump.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        pump.join(timeout=5)
        reason = (f"the job exceeded timeout_s={timeout_s:g} s and was ended after {time.monotonic() - t0:.0f} s "
                  f"(log: {log})")
        record_failed(req, world, _read_jsonl(out / "rows.jsonl"), reason)
        raise LaunchTimeout(reason, proc.pid) from None
    except BaseException:   # interrupted (KeyboardInterrupt): take the job down with us
        _end_group(proc, grace_s=5.0)
        raise
    pump.join(timeout=10)
    seconds = time.monotonic() - t0
    rows = _read_jsonl(out / "rows.jsonl")
    if proc.returncode != 0:
        rank, error, detail = first_failure(out, log)
        record_failed(req, world, rows, f"rank {rank} failed: {error}" if rank is not None else error)
        raise RankFailed(rank, error, detail, log, seconds)
    return LaunchResult(world, rows, _read_jsonl(out / "bandwidth.jsonl"), seconds, log, argv)


# --- the command line: one node or several ------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``python -m hwlib.distributed.launch [launcher options] [worker options]``: checks the job,
    then runs torchrun (``--dry-run``: prints the command instead). Across nodes, run it on every
    node with the same arguments and ``--nnodes N --rdzv-endpoint HOST:PORT``."""
    p = argparse.ArgumentParser(prog="python -m hwlib.distributed.launch", parents=[worker_parser()],
                                conflict_handler="resolve", description=main.__doc__)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rdzv-endpoint", default=None)
    p.add_argument("--rdzv-backend", default="c10d")
    p.add_argument("--rdzv-id", default="hwlib")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--dry-run", action="store_true")
    ns, _ = p.parse_known_args(argv)
    launcher_flags = {"--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--node-rank",
                      "--timeout-s"}
    worker_args, skip = [], False
    for a in (argv if argv is not None else sys.argv[1:]):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name == "--dry-run":
            continue
        if name in launcher_flags:
            skip = "=" not in a
            continue
        worker_args.append(a)
    from .request import from_argv
    from ..profiles import resolve_profile
    req, _ = from_argv(worker_args)
    req.profile = resolve_profile(req.profile, "cpu" if req.device == "cpu" else "auto")
    rdzv = None
    if ns.nnodes != 1 or ns.rdzv_endpoint:
        if not ns.rdzv_endpoint:
            raise SystemExit("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        rdzv = Rendezvous(ns.nnodes, ns.rdzv_endpoint, ns.rdzv_backend, ns.rdzv_id, ns.node_rank)
    check(req, ns.nproc_per_node, rdzv)
    if ns.dry_run:
        print(" ".join(torchrun_argv(ns.nproc_per_node, to_argv(req), rdzv)))
        return 0
    res = launch(req, ns.nproc_per_node, rendezvous=rdzv, timeout_s=ns.timeout_s)
    print(f"{len(res.rows)} measurement(s) in {res.seconds:.0f} s; log: {res.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
