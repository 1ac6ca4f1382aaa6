"""One measurement inside a torchrun job: a workload under a strategy, measured exactly as the
single-GPU ladder measures a step.

Every rank builds the ladder's session (``hwlib.ladder.Session``: same model, seed, optimizer and
settings), takes its own rows of each global batch, and runs the ladder's own loop
(``hwlib.ladder.run``: the check steps, the warm-up rule of ``first_timed_step``, one
``bench.StepClock`` event at every step boundary on rank 0). Rank 0's clock is the job's clock:
every strategy synchronises the ranks at each step, so no rank runs ahead of another by more than a
step. Throughput counts the global batch; model TFLOP/s (and MFU) count one GPU's share of it.

The loss of a step is the mean of the ranks' losses over their equal shares of the batch: the loss
of the global batch. At the same global batch, the curve over the check steps equals the
single-process curve up to the order of sums (the same-math check).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import bench
from ..device import info
# The ladder's own plan check, warm-up rule and step loop, not copies: a rank's step is timed by the
# very code that times the single-GPU ladder.
from ..ladder.run import StepResult, check_plan, timed_window, train_steps
from ..ladder.same_math import BF16_STEP, MathCheck, compare_curves
from ..ladder.session import Session, build_model, free
from ..profiles import Plan, plan as plan_for
from ..steps import get_step, not_applicable, settings_for, unavailable
from ..workloads import get_workload
from . import comm, graphed, strategies
from .strategies import Options


class InjectedFault(RuntimeError):
    """Raised on purpose by ``--inject-fault`` (tests of how a failing rank ends a job)."""


class ShardedBatches:
    """Rank ``rank``'s rows of each global batch, on ``device``: batch ``i`` of ``global_batches``
    (built on the CPU), rows ``[rank * n, (rank + 1) * n)`` with ``n = rows / world``. Resident
    batches are produced once and kept on the device."""

    def __init__(self, global_batches, rank: int, world: int, device: torch.device):
        self.global_batches, self.rank, self.world, self.device = global_batches, rank, world, device
        self._resident: dict[int, object] = {}

    def _rows(self, x):
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % self.world:
                raise ValueError(f"a batch tensor of shape {tuple(x.shape)} does not split into {self.world} equal parts")
            n = x.shape[0] // self.world
            return x[self.rank * n:(self.rank + 1) * n].to(self.device)
        if isinstance(x, dict):
            return {k: self._rows(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(self._rows(v) for v in x)
        raise TypeError(f"cannot split a batch field of type {type(x).__name__} between ranks")

    def make_resident(self, n: int) -> None:
        for i in range(n):
            if i not in self._resident:
                self._resident[i] = self._rows(self.global_batches(i))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, i: int):
        if i in self._resident:
            return self._resident[i]
        return self._rows(self.global_batches(i))

    def close(self) -> None:
        self._resident.clear()
        close = getattr(self.global_batches, "close", None)
        if close is not None:
            close()


class DistributedSession(Session):
    """The ladder's ``Session`` of one rank: the model built from the same seed on every rank,
    wrapped by a strategy (``strategies.apply``), fed this rank's rows of the global batch.

    The ladder's loop closes a session when its timed steps end; the profiled steps that follow
    still need this one, so ``close`` waits for ``dispose``."""

    def __init__(self, workload: str, cfg_global, cfg_rank, settings, device: torch.device, seed: int,
                 strategy: str, world: int, rank: int, options: Options | None = None, source: str | None = None,
                 fault_at: int | None = None, step: str | None = None):
        self.wl = get_workload(workload)
        self.micro_batch = None
        self.cfg, self.device, self.seed, self.step_name, self.skip = cfg_rank, device, seed, step, ()
        self.strategy, self.world, self.rank, self.fault_at = strategy, world, rank, fault_at
        cpu_settings = dataclasses.replace(settings, loader="simple")   # global batches built on the host
        self.batches = ShardedBatches(self.wl.batches(cfg_global, torch.device("cpu"), seed, source, cpu_settings),
                                      rank, world, device)
        # the steps past the recipe in ``step``'s chain swap their modules in, as in a one-GPU session
        self.model = build_model(self.wl.name, step, cfg_rank, seed, settings).to(device)
        if settings.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        applied = strategies.apply(strategy, self.model, cfg_rank, settings, device, world, options)
        self.fwd, self.opt, self.notes = applied.fwd, applied.opt, applied.notes
        self.graphed = applied.step   # runs the whole step (strategies.GRAPHED), or None
        # A step's own trainer (Step.trainer: one process's whole step, e.g. step 31's graphs per bucket)
        # does not run across processes: the strategy owns the step here.
        self.trainer = None
        self.scaler = torch.amp.GradScaler("cuda") if settings.autocast == "fp16" else None
        self.compiled = settings.compile
        if applied.probe is None and settings.attention == "sdpa":
            # The ladder's loop probes which SDPA kernel runs with a no-grad forward of ``self.model``;
            # under FSDP that forward would all-gather and compile a graph of its own. The same step
            # in one process reports the kernel; this session skips the probe.
            settings = dataclasses.replace(settings, attention="manual")
            self.notes.append("SDPA kernel not probed under this strategy (the single-process run reports it)")
        elif applied.probe is not None:
            self.model = applied.probe
        self.settings = settings
        self._open = True

    def step(self, i: int) -> torch.Tensor:
        if self.fault_at is not None and i == self.fault_at:
            raise InjectedFault(f"injected fault on rank {self.rank} at step {i} (--inject-fault)")
        if self.graphed is not None:
            return self.graphed.step(self.batches(i), self._loss)
        return super().step(i)

    def _loss(self, batch) -> torch.Tensor:
        with self.autocast():
            return self.wl.loss(self.fwd, batch)

    def close(self) -> None:
        """Called by the ladder's loop when its steps end: kept open for the profiled steps."""

    def dispose(self) -> None:
        if not self._open:
            return
        self._open = False
        if self.graphed is not None:
            self.graphed.close()
        self.batches.close()
        self.graphed = None
        self.batches = self.model = self.opt = self.fwd = self.scaler = None
        if self.compiled:
            torch._dynamo.reset()   # the next measurement in this process compiles its own graphs
        free(self.device)


@dataclass
class Job:
    """One measurement of a torchrun job; ``scalings`` lists every scaling it stands for (at one
    process the weak and the strong batch can coincide: one measurement, recorded for both)."""

    workload: str
    strategy: str
    scalings: tuple
    per_gpu_batch: int
    global_batch: int
    step: str
    config: dict = field(default_factory=dict)

    def fields(self, world: int, scaling: str, options: Options | None = None) -> dict:
        changed = (options or Options()).changed(self.strategy)
        return {"world_size": world, "strategy": self.strategy, "scaling": scaling,
                "per_gpu_batch": self.per_gpu_batch, "global_batch": self.global_batch,
                **({"options": ",".join(f"{k}={v}" for k, v in sorted(changed.items()))} if changed else {})}


@dataclass
class Outcome:
    res: StepResult
    split: dict | None = None
    check: MathCheck | None = None


def mean_over_ranks(values: list[float], device: torch.device, world: int) -> list[float]:
    """Each position's mean over the ranks (one collective, after the steps: no sync inside them)."""
    import torch.distributed as dist
    if world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)   # SUM: gloo has no AVG
    return (t / world).cpu().tolist()


def job_pids(world: int) -> set[int]:
    """Every rank's pid, and the launcher's: a GPU process of this very job (or the notebook that
    started it and waits for it) is not a contender for the timing."""
    import torch.distributed as dist
    mine = {os.getpid()}
    launcher = os.environ.get("HWLIB_LAUNCHER_PID", "")
    if launcher.isdigit():
        mine.add(int(launcher))
    if world == 1 or not dist.is_initialized():
        return mine
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    return mine | set(pids)


# Splitting a batch between ranks changes only the order of sums (each rank's partial gradient, then
# their mean). In fp32 that moves a loss curve by ~1e-7 per step; taking the step's tolerance, at
# least this, keeps a step whose own tolerance is 0 (the fp32 baseline) checkable. A shard of the wrong
# rows moves the curve by the difference between batches: ~1e-2 and more (a missing average does not
# show under AdamW, whose update does not depend on the gradient's scale).
REORDER_TOLERANCE = 1e-4


def tolerance(step: str, options: Options | None = None, strategy: str | None = None) -> tuple[float, str]:
    """The distributed check's tolerance on top of ``step``, and why.

    Under bf16 autocast, each rank's weight gradients leave its bf16 matmuls rounded to 8 mantissa
    bits before the fp32 all-reduce, where one process rounds the whole batch's once; and the wrapper
    changes the compiled graph (DDPOptimizer's splits, FSDP's units), so the fusions round elsewhere.
    That is a change of rounding under bf16, which the ladder resolves no finer than bf16's own move
    of the curve (``hwlib.ladder.same_math.bf16_floor``, at most step 03's tolerance): the check takes
    that bound. Seen on vit_bdh at step 10: DDP at world size 1, with no split at all, already moved
    the curve 1.5e-2 from one unwrapped process, above the step's own 1e-2."""
    st = get_step(step)
    opts = (options or Options()).changed(strategy) if strategy else {}
    if opts.get("reduce_dtype") == "bf16":
        bf16 = get_step(BF16_STEP)
        return max(bf16.tolerance, st.tolerance), (
            f"gradients reduced in bf16: each rank's gradient rounded to 8 bits of mantissa before the sum, "
            f"a change of rounding checked at bf16's resolution ({bf16.name}'s tolerance)")
    if settings_for(st.name).autocast is not None:
        bf16 = get_step(BF16_STEP)
        if bf16.tolerance > st.tolerance:
            return bf16.tolerance, (f"bf16 rounding resolution ({bf16.name}'s tolerance): each rank's gradients "
                                    "are rounded to bf16 apart and the wrapped graph fuses differently")
    if st.tolerance >= REORDER_TOLERANCE:
        return st.tolerance, f"the step's own tolerance: {st.why_tolerance}"
    return REORDER_TOLERANCE, "the ranks' gradients summed in another order: fp32 rounding through K optimizer steps"


def same_math_check(res: StepResult, reference: list[float] | None, world: int, options: Options | None = None,
                    strategy: str | None = None) -> MathCheck | None:
    """The job's loss curve against one process's at the same global batch (``tolerance``)."""
    if reference is None or res.status != "ok" or world == 1:
        return None
    tol, why = tolerance(res.step, options, strategy)
    d = compare_curves(res.check_losses, reference)
    k = min(len(reference), res.check_steps)
    return MathCheck(res.step, "1 process", d, tol, k, d <= tol,
                     f"world size {world} against one process at the same global batch; {why}")


def run_job(job: Job, *, profile: str, device: torch.device, rank: int, world: int, seed: int = 0,
            plan: Plan | None = None, options: Options | None = None, source: str | None = None,
            profile_steps: int = 0, trace_dir: str | os.PathLike | None = None, keep_trace: bool = False,
            reference: list[float] | None = None, fault_at: int | None = None, progress: bool = False) -> Outcome:
    """Measure ``job`` on this rank (every rank of the job calls it with the same arguments)."""
    wl, st, di = get_workload(job.workload), get_step(job.step), info(device)
    strategies.check_strategy(job.strategy)
    cfg_global = wl.config(profile, **{**job.config, "batch": job.global_batch})
    cfg_rank = dataclasses.replace(cfg_global, batch=job.per_gpu_batch)
    pl = check_plan(plan or plan_for(profile, torch.device(device).type), False)
    res = StepResult(workload=wl.name, step=st.name, profile=profile, device=di.to_dict(), status="ok",
                     config=dataclasses.asdict(cfg_global), seed=seed, check_steps=pl.check, variant=True,
                     items_per_step=wl.items_per_step(cfg_global), unit=wl.unit,
                     flops_per_step=wl.flops_per_step(cfg_rank))   # one GPU's share: MFU is per GPU
    for status, why in (("n/a", not_applicable(st, wl.name)), ("skipped", unavailable(st, di))):
        if why:
            res.status, res.reason = status, why
            return Outcome(res)
    eff, notes = strategies.distributed_settings(st, di, job.strategy)
    res.settings = {**dataclasses.asdict(eff), "strategy": job.strategy,
                    "options": dataclasses.asdict(options or Options()) if job.strategy != "single" else {}}
    res.notes += notes
    pids = job_pids(world)
    sess = DistributedSession(wl.name, cfg_global, cfg_rank, eff, device, seed, job.strategy, world, rank, options,
                              source, fault_at, step=st.name)
    res.notes += sess.notes
    out = Outcome(res)
    try:
        timed_from = timed_window(res, sess, pl)
        res.warmup_steps = timed_from - pl.check
        total = timed_from + pl.timed
        sess.make_resident(total + profile_steps)
        local = train_steps(res, sess, timed_from, pl.timed, progress)
        g = sess.graphed
        if g is not None and g.capture_error:
            res.notes.append(f"CUDA-graph capture failed ({g.capture_error}); every rank ran the step eagerly")
        elif g is not None and g.graph is not None:
            res.notes.append(f"every step after the first {graphed.EAGER_STEPS} replayed one CUDA graph (captured once)")
        res.losses = mean_over_ranks(local, device, world)
        if res.contended:
            res.contended = [p for p in res.contended if p not in pids]
        bad = next((i for i, v in enumerate(res.losses) if not math.isfinite(v)), None)
        if bad is not None:
            res.status, res.reason, res.timing = "nonfinite", f"loss became {res.losses[bad]} at step {bad}; time not reported", None
        elif eff.compile and res.timing:
            res.compile_s = max(0.0, res.first_step_s - res.timing.median_ms / 1e3)
        if profile_steps and res.status == "ok":
            out.split, why = _profile(sess, total, profile_steps, rank, device, trace_dir, keep_trace, job, world)
            if why:
                res.notes.append(why)
    finally:
        sess.dispose()
    out.check = same_math_check(res, reference, world, options, job.strategy)
    return out


def _profile(sess: DistributedSession, first: int, n: int, rank: int, device: torch.device, trace_dir, keep: bool,
             job: Job, world: int) -> tuple[dict | None, str | None]:
    """Run ``n`` more steps on every rank, profiled on rank 0: the compute / communication split
    (or None and why)."""
    def steps():
        for i in range(first, first + n):
            sess.step(i)

    with sess.precision():
        if rank != 0:
            steps()
            bench.synchronize(device)
            return None, None
        name = f"{job.workload}_{job.strategy}_{'+'.join(job.scalings)}_k{world}_{int(time.time() * 1e3)}.json"
        path = Path(trace_dir or ".") / "traces" / name
        return comm.profile_split(steps, n, device, path, keep_trace=keep)
