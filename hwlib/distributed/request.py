"""What a torchrun job measures, in one definition for both sides of the launch: the launcher
turns a ``Request`` into the worker's command line (``to_argv``), the worker parses it back
(``from_argv``), and both validate it the same way (``validate``) before anything starts.

A job runs, for each workload, scaling and strategy, one measurement (``train.Job``):

- weak scaling: the per-GPU batch is fixed (the workload's batch, or ``per_gpu_batch``); the global
  batch grows with the world size;
- strong scaling: the global batch is fixed (the workload's batch, or ``global_batch``); each rank
  takes ``global / world`` rows, so the world size must divide it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field

from ..device import ChoiceError
from ..profiles import PROFILE_CHOICES, Plan
from ..steps import get_step
from ..workloads import WORKLOADS, get_workload
from .strategies import STRATEGIES, Options, base_step, check_strategy
from .train import Job

# The records' notebook where the caller names none (a launch from the command line): what measured them,
# not a notebook of the series; readers find scaling records by their fields (``scaling.rows``).
STUDY = "multi_gpu"
SCALINGS = ("weak", "strong")
DEFAULT_PROFILE_STEPS = {"full": 3, "mid": 3, "smoke": 1}
RESOLVED_PROFILES = tuple(p for p in PROFILE_CHOICES if p != "auto")


def check_scaling(name: str) -> str:
    if name not in SCALINGS:
        raise ChoiceError("scaling", name, SCALINGS)
    return name


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


@dataclass
class Request:
    workloads: tuple = ("gpt",)
    strategies: tuple = ("ddp",)
    scalings: tuple = SCALINGS
    profile: str = "auto"                  # resolved to "full", "mid" or "smoke" before anything runs
    device: str = "auto"                   # "auto", "cuda" or "cpu" (each rank takes its local GPU)
    step: str | None = None                # None: each workload's ``strategies.base_step``
    per_gpu_batch: dict = field(default_factory=dict)   # workload -> rows per GPU (weak); else its batch
    global_batch: dict = field(default_factory=dict)    # workload -> rows in all (strong); else its batch
    config: dict = field(default_factory=dict)          # workload config overrides, for every workload
    plan: Plan | None = None               # None: the profile's plan (hwlib.profiles), as the ladder
    seed: int = 0
    options: Options = field(default_factory=Options)
    profile_steps: int | None = None       # profiled steps after the timed ones (None: per profile; 0: none)
    comm_sizes_mb: tuple = ()              # all-reduce sizes of the bus-bandwidth sweep (K > 1)
    reference: dict = field(default_factory=dict)       # workload -> {global batch: one process's check losses}
    ceilings: dict | None = None           # the run's measured ceilings (for MFU)
    run: str | None = None
    notebook: str = STUDY                  # the records' notebook: the caller's (notebook 15 names itself)
    collective_timeout_s: float = 300.0    # a collective waiting longer than this raises on its rank
    fault: tuple | None = None             # (rank, step): that rank raises at that step (tests)
    record: bool = True
    keep_traces: bool = False

    def steps_profiled(self) -> int:
        return DEFAULT_PROFILE_STEPS.get(self.profile, 0) if self.profile_steps is None else self.profile_steps


class Unsplittable(ValueError):
    """A strong-scaling global batch that does not split over the world size: that measurement
    cannot exist at that K (``scaling.measure`` makes it a skipped row, not a failed launch)."""


def batches(req: Request, workload: str, scaling: str, world: int) -> tuple[int, int]:
    """(per-GPU batch, global batch) of ``workload`` under ``scaling`` at ``world`` processes."""
    wl = get_workload(workload)
    default = wl.config(req.profile, **req.config).batch
    if scaling == "weak":
        per = _positive_int(f"per_gpu_batch[{workload}]", req.per_gpu_batch.get(wl.name, default))
        return per, per * world
    check_scaling(scaling)
    glob = _positive_int(f"global_batch[{workload}]", req.global_batch.get(wl.name, default))
    if glob % world:
        raise Unsplittable(f"global_batch {glob} of {workload} (strong scaling) does not split over world size "
                         f"{world}: choose a global batch divisible by {world}, or another world size")
    return glob // world, glob


def jobs(req: Request, world: int) -> list[Job]:
    """The job's measurements in order (workload, strategy, then scaling); scalings whose batches
    coincide (weak and strong at one process) share one measurement."""
    out: list[Job] = []
    for w in req.workloads:
        step = get_step(req.step).name if req.step else base_step(w)
        for s in req.strategies:
            by_batch: dict = {}
            for sc in req.scalings:
                by_batch.setdefault(batches(req, w, sc, world), []).append(sc)
            for (per, glob), scs in by_batch.items():
                out.append(Job(get_workload(w).name, s, tuple(scs), per, glob, step, dict(req.config)))
    return out


def validate(req: Request, world: int, *, nproc_per_node: int | None = None, gpus: int | None = None) -> list[Job]:
    """Every argument of a job checked before anything starts; returns its measurements. ``gpus``:
    the GPUs this node can give (None: not a GPU job)."""
    if not req.workloads or not req.strategies or not req.scalings:
        raise ValueError("workloads, strategies and scalings each need at least one entry")
    _positive_int("world size", world)
    for w in req.workloads:
        get_workload(w)
    for s in req.strategies:
        check_strategy(s)
        if s == "single" and world != 1:
            raise ValueError(f"strategy 'single' runs one process, not {world}: measure it at world size 1")
    for sc in req.scalings:
        check_scaling(sc)
    if req.profile not in RESOLVED_PROFILES:
        raise ChoiceError("profile (resolved)", req.profile, RESOLVED_PROFILES)
    if req.step is not None:
        get_step(req.step)
    for name, d in (("per_gpu_batch", req.per_gpu_batch), ("global_batch", req.global_batch)):
        unknown = sorted(set(d) - {get_workload(w).name for w in req.workloads})
        if unknown:
            raise ValueError(f"{name} names {unknown}, which this job does not measure (workloads: {list(req.workloads)})")
    if nproc_per_node is not None and gpus is not None and nproc_per_node > gpus:
        raise ValueError(f"nproc_per_node={nproc_per_node} processes, but only {gpus} GPU(s) visible on this node: "
                         f"one process per GPU; ask for at most {gpus}")
    if req.fault is not None:
        r, st = req.fault
        if not (0 <= r < world) or st < 0:
            raise ValueError(f"fault {req.fault!r}: the rank must be in [0, {world}) and the step >= 0")
    t = req.collective_timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"collective_timeout_s must be a finite number of seconds > 0, got {t!r}")
    if req.profile_steps is not None:
        if isinstance(req.profile_steps, bool) or not isinstance(req.profile_steps, int) or req.profile_steps < 0:
            raise ValueError(f"profile_steps must be an integer >= 0, got {req.profile_steps!r}")
    for mb in req.comm_sizes_mb:
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or mb <= 0:
            raise ValueError(f"comm_sizes_mb must hold sizes > 0 (MiB), got {mb!r}")
    return jobs(req, world)


# --- the worker's command line --------------------------------------------------------------------------

def _csv(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _per_workload(text: str) -> dict:
    """'gpt=16,vit_bdh=256' -> {'gpt': 16, 'vit_bdh': 256}."""
    out = {}
    for part in _csv(text):
        name, sep, val = part.partition("=")
        if not sep or not val.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{part!r}: give workload=rows, e.g. gpt=16")
        out[name.strip()] = int(val)
    return out


def _plan(text: str) -> Plan:
    parts = _csv(text)
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give check,warmup,timed, e.g. 10,5,30")
    return Plan(*map(int, parts))


def _fault(text: str) -> tuple:
    r, sep, s = text.partition(":")
    if not sep or not r.isdigit() or not s.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give RANK:STEP, e.g. 1:2")
    return int(r), int(s)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hwlib.distributed.worker",
                                description="One rank of a multi-GPU measurement (start it with torchrun).")
    p.add_argument("--workloads", type=_csv, default=("gpt",), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--strategies", type=_csv, default=("ddp",), help=f"comma-separated, of {', '.join(STRATEGIES)}")
    p.add_argument("--scalings", type=_csv, default=SCALINGS, help="weak, strong or both")
    p.add_argument("--profile", default="auto", help="auto (full, mid or smoke: what fits the GPU's memory; "
                                                     "$HWLIB_PROFILE overrides), full, mid or smoke")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--step", default=None, help="ladder step the strategies go on top of (default: each workload's best)")
    p.add_argument("--per-gpu-batch", type=_per_workload, default={}, help="weak scaling rows per GPU, e.g. gpt=16")
    p.add_argument("--global-batch", type=_per_workload, default={}, help="strong scaling rows in all, e.g. gpt=16")
    p.add_argument("--config", type=json.loads, default={}, help='workload config overrides as JSON, e.g. \'{"n_layer": 2}\'')
    p.add_argument("--plan", type=_plan, default=None, help="check,warmup,timed steps (default: the profile's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=Options.bucket_cap_mb)
    p.add_argument("--no-gradient-as-bucket-view", action="store_true")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--reshard-after-forward", choices=("default", "true", "false"), default="default")
    p.add_argument("--graph-bucket-mb", type=float, default=Options.graph_bucket_mb)
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default=Options.reduce_dtype)
    p.add_argument("--no-cuda-graph", action="store_true", help="graphed strategies: run the step eagerly")
    p.add_argument("--overlap-gather", action="store_true",
                   help="graphed_zero1: all-gather the parameters behind the next forward")
    p.add_argument("--profile-steps", type=int, default=None, help="profiled steps for the communication split")
    p.add_argument("--comm-sizes-mb", type=lambda t: tuple(float(x) for x in _csv(t)), default=(),
                   help="all-reduce sizes (MiB) of the bus-bandwidth sweep")
    p.add_argument("--inputs", default=None, help="JSON file with 'reference' curves and 'ceilings' (from the launcher)")
    p.add_argument("--run-name", dest="run", default=None, help="run folder under outputs/ (default: $HWLIB_RUN or 'interactive')")
    p.add_argument("--notebook", default=STUDY, help="the records' notebook (default: %(default)s)")
    p.add_argument("--out", default=None, help="folder for rank 0's rows and every rank's error file")
    p.add_argument("--collective-timeout-s", type=float, default=300.0)
    p.add_argument("--inject-fault", type=_fault, default=None, help="RANK:STEP: that rank raises at that step")
    p.add_argument("--no-record", action="store_true", help="write no records (rows only)")
    p.add_argument("--keep-traces", action="store_true")
    return p


def from_argv(argv: list[str] | None) -> tuple[Request, argparse.Namespace]:
    ns = parser().parse_args(argv)
    inputs = {}
    if ns.inputs:
        with open(ns.inputs) as f:
            inputs = json.load(f)
    raf = {"default": None, "true": True, "false": False}[ns.reshard_after_forward]
    req = Request(workloads=ns.workloads, strategies=ns.strategies, scalings=ns.scalings, profile=ns.profile,
                  device=ns.device, step=ns.step, per_gpu_batch=ns.per_gpu_batch, global_batch=ns.global_batch,
                  config=ns.config, plan=ns.plan, seed=ns.seed,
                  options=Options(bucket_cap_mb=ns.bucket_cap_mb, gradient_as_bucket_view=not ns.no_gradient_as_bucket_view,
                                  static_graph=ns.static_graph, reshard_after_forward=raf,
                                  graph_bucket_mb=ns.graph_bucket_mb, reduce_dtype=ns.reduce_dtype,
                                  cuda_graph=not ns.no_cuda_graph, overlap_gather=ns.overlap_gather),
                  profile_steps=ns.profile_steps, comm_sizes_mb=ns.comm_sizes_mb,
                  reference={w: {int(g): v for g, v in d.items()} for w, d in (inputs.get("reference") or {}).items()},
                  ceilings=inputs.get("ceilings"), run=ns.run, notebook=ns.notebook,
                  collective_timeout_s=ns.collective_timeout_s, fault=ns.inject_fault, record=not ns.no_record,
                  keep_traces=ns.keep_traces)
    return req, ns


def to_argv(req: Request, *, out: str | None = None, inputs: str | None = None) -> list[str]:
    """The worker's arguments for ``req`` (reference curves and ceilings travel in the ``inputs`` file)."""
    a = ["--workloads", ",".join(req.workloads), "--strategies", ",".join(req.strategies),
         "--scalings", ",".join(req.scalings), "--profile", req.profile, "--device", req.device, "--seed", str(req.seed),
         "--notebook", req.notebook, "--collective-timeout-s", f"{req.collective_timeout_s:g}"]
    if req.step:
        a += ["--step", req.step]
    for flag, d in (("--per-gpu-batch", req.per_gpu_batch), ("--global-batch", req.global_batch)):
        if d:
            a += [flag, ",".join(f"{k}={v}" for k, v in d.items())]
    if req.config:
        a += ["--config", json.dumps(req.config)]
    if req.plan:
        a += ["--plan", f"{req.plan.check},{req.plan.warmup},{req.plan.timed}"]
    o = req.options
    a += ["--bucket-cap-mb", f"{o.bucket_cap_mb:g}"]
    if not o.gradient_as_bucket_view:
        a.append("--no-gradient-as-bucket-view")
    if o.static_graph:
        a.append("--static-graph")
    if o.reshard_after_forward is not None:
        a += ["--reshard-after-forward", str(o.reshard_after_forward).lower()]
    a += ["--graph-bucket-mb", f"{o.graph_bucket_mb:g}", "--reduce-dtype", o.reduce_dtype]
    if not o.cuda_graph:
        a.append("--no-cuda-graph")
    if o.overlap_gather:
        a.append("--overlap-gather")
    if req.profile_steps is not None:
        a += ["--profile-steps", str(req.profile_steps)]
    if req.comm_sizes_mb:
        a += ["--comm-sizes-mb", ",".join(f"{x:g}" for x in req.comm_sizes_mb)]
    if inputs:
        a += ["--inputs", inputs]
    if req.run is not None:
        a += ["--run-name", str(req.run)]
    if out:
        a += ["--out", out]
    if req.fault is not None:
        a += ["--inject-fault", f"{req.fault[0]}:{req.fault[1]}"]
    if not req.record:
        a.append("--no-record")
    if req.keep_traces:
        a.append("--keep-traces")
    return a


def replace(req: Request, **kw) -> Request:
    return dataclasses.replace(req, **kw)
