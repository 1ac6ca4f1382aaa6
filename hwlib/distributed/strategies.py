"""How one model is spread over the processes of a torchrun job, each strategy on top of a ladder
step's settings.

============  ===================================================================================
``single``    one process, no wrapper: the ladder's step as it runs on one GPU. The reference of
              every efficiency and of the same-math check.
``ddp``       DistributedDataParallel: parameters replicated, gradients all-reduced in buckets
              while backward still runs (``bucket_cap_mb``, ``gradient_as_bucket_view``,
              ``static_graph``); torch.compile of the wrapped model on top, so that DDPOptimizer
              splits the graph at bucket boundaries and each bucket's all-reduce starts as soon as
              its part of backward is done.
``fsdp2``     ``fully_shard`` (FSDP2): parameters, gradients and AdamW states sharded; a unit's
              parameters are all-gathered before it runs and its gradients reduce-scattered after.
              Units are the model's blocks, each compiled before it is sharded (FSDP's hooks stay
              outside the compiled graphs); a model without blocks is one compiled unit.
``ddp_zero1`` ``ddp`` with ``ZeroRedundancyOptimizer`` (ZeRO stage 1): the ladder's AdamW, its
              states sharded; each rank updates its shard and broadcasts the updated parameters.
``graphed``   DDP's math (bucketed mean all-reduce launched from gradient hooks during backward)
              over flat buffers, so that the whole step, reductions and AdamW included, is one
              CUDA graph (``hwlib.distributed.graphed``); blocks compiled one by one.
``graphed_zero1`` ``graphed`` with each bucket reduce-scattered, AdamW on this rank's shards only
              (ZeRO-1) and the updated parameters all-gathered, inside the same graph.
============  ===================================================================================

``Options.reduce_dtype='bf16'`` reduces the gradients in bf16: DDP through torch's
``bf16_compress_hook``, the graphed strategies by casting each bucket before its collective.
At world size 1 ``ddp`` does not wrap the model: there is nothing to reduce, and DDP's reducer
hooks and DDPOptimizer's graph splits cost one H100 29% of its step (51.8 against 36.8 ms).

Every strategy keeps the ladder's AdamW (same parameter groups, fused when the step fuses it) and
fp32 gradients and reductions: under bf16 autocast the arithmetic of a step stays the step's own, so
the loss curve at world size K matches one process at the same global batch (``hwlib.distributed.train``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..device import ChoiceError, DeviceInfo
from ..ladder.session import compile_model, make_optimizer
from ..steps import LADDER, Settings, Step, get_step, not_applicable, resolve_autocast, settings_for
from ..workloads import get_workload

STRATEGIES = ("single", "ddp", "fsdp2", "ddp_zero1", "graphed", "graphed_zero1")
GRAPHED = ("graphed", "graphed_zero1")
DESCRIPTIONS = {
    "single": "one process, no wrapper (the ladder's step)",
    "ddp": "DDP, gradients all-reduced in buckets during backward, compiled (DDPOptimizer)",
    "fsdp2": "FSDP2 fully_shard per block, each block compiled before sharding",
    "ddp_zero1": "DDP with ZeroRedundancyOptimizer (AdamW states sharded)",
    "graphed": "the whole step one CUDA graph: bucketed all-reduce from gradient hooks inside it, blocks compiled",
    "graphed_zero1": "graphed, with reduce-scatter, AdamW on each rank's shard and all-gather (ZeRO-1) inside it",
}
# The options each strategy reads (a record names only those, when they differ from the defaults).
OPTIONS_READ = {"single": (), "ddp": ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "reduce_dtype"),
                "ddp_zero1": ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph"),
                "fsdp2": ("reshard_after_forward",), "graphed": ("graph_bucket_mb", "reduce_dtype", "cuda_graph"),
                "graphed_zero1": ("graph_bucket_mb", "reduce_dtype", "cuda_graph", "overlap_gather")}

# Settings a multi-process step cannot take as they are, and why; the base step leaves them off.
NOT_DISTRIBUTED = {
    "cuda_graphs": "CUDA graphs replay the compiled forward and backward, but DDP's and FSDP's collectives "
                   "are launched by autograd hooks between those graphs; reduce-overhead mode is not "
                   "supported under them",
    "packing": "a packed batch carries per-sequence offsets across its rows: it cannot be split by rows "
               "between processes",
}
RESIDENT_WHY = ("batches are produced before timing and kept on each rank's device (the loader is "
                "notebook 08's subject): the scaling measures compute and communication")


def check_strategy(name: str) -> str:
    if name not in STRATEGIES:
        raise ChoiceError("strategy", name, STRATEGIES)
    return name


@dataclass(frozen=True)
class Options:
    """The strategies' knobs. DDP: bucket size in MiB, gradients as views into the buckets (no copy
    between .grad and the bucket), static graph (bucket order fixed after the first step). FSDP2:
    reshard after forward (None: FSDP's default, True for blocks and False for the root).

    The bucket size sets how many graphs torch.compile's DDPOptimizer cuts the model into (one per
    bucket), and each graph costs the host its own call. GPT-2 small, strong scaling on two H100s
    (8 rows a GPU, step 07's settings, static graph; one launch each, median ms/step with p20-p80):
    25 MiB (torch's default) 41.5 (40.1-43.0), 100 MiB 43.2 (42.4-45.8, with 20 ms of all-reduce in its
    profiled window), 200 MiB 29.7 (28.0-31.2), 500 MiB 32.5 (32.0-33.7). At 25 MiB the profiled
    window sat idle 44 of 67 ms a step, waiting for the host; at 200 MiB 13 of 35."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    reshard_after_forward: bool | None = None
    # The graphed strategies: bucket size (MiB of fp32 gradients; no host cost per bucket inside a
    # graph, so small buckets start the reductions early), the dtype gradients are reduced in (also
    # DDP's, through a comm hook), and whether the step is captured (False: the same step eager).
    graph_bucket_mb: float = 25.0
    reduce_dtype: str = "fp32"
    cuda_graph: bool = True
    # graphed_zero1: the all-gathers of the updated parameters run behind the next step's forward
    # (each block waits for its own buckets) instead of ending the step. GPT-2 small, strong scaling
    # on two H200s (8 rows a GPU; one launch each, same machine): at the step's end 21.55 ms a step
    # with 1.59 ms of communication exposed, behind the forward 21.13 ms with 1.02 (graphed: 20.98, 0.68).
    overlap_gather: bool = False

    def __post_init__(self):
        for f in ("bucket_cap_mb", "graph_bucket_mb"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{f} must be a finite number > 0 (MiB), got {v!r}")
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise ValueError(f"reduce_dtype must be 'fp32' or 'bf16', got {self.reduce_dtype!r}")
        for f in ("gradient_as_bucket_view", "static_graph", "cuda_graph", "overlap_gather"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be True or False, got {getattr(self, f)!r}")
        if self.reshard_after_forward not in (None, True, False):
            raise ValueError(f"reshard_after_forward must be None, True or False, got {self.reshard_after_forward!r}")

    def changed(self, strategy: str | None = None) -> dict:
        """The options that differ from the defaults (they become part of a record's fields); with
        ``strategy``, only those it reads."""
        base = Options()
        read = OPTIONS_READ[check_strategy(strategy)] if strategy else [f.name for f in dataclasses.fields(self)]
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name in read and getattr(self, f.name) != getattr(base, f.name)}


# --- which ladder step the strategies go on top of --------------------------------------------------

def base_step(workload: str) -> str:
    """The workload's best single-GPU step of the standard recipe that the strategies can run: the
    last recipe step that applies to it whose own change is not one of ``NOT_DISTRIBUTED`` (its
    cumulative settings are then made distributable by ``distributed_settings``). The steps past the
    recipe are single-GPU studies; the scaling is measured on the recipe the seeds describe."""
    wl = get_workload(workload)
    for st in reversed([s for s in LADDER if not s.beyond_recipe]):
        if not_applicable(st, wl.name) is None and not set(st.change) & set(NOT_DISTRIBUTED):
            return st.name
    return LADDER[0].name


def distributed_settings(step: str | Step, di: DeviceInfo, strategy: str = "ddp") -> tuple[Settings, list[str]]:
    """The step's cumulative settings as every rank runs them under ``strategy``, and a note for each
    change: ``NOT_DISTRIBUTED`` settings off, batches resident, FSDP2 without channels_last weights,
    bf16 before Ampere as fp16."""
    st = get_step(step) if isinstance(step, str) else step
    wanted = settings_for(st.name)
    notes, change = [], {}
    for name, why in NOT_DISTRIBUTED.items():
        if getattr(wanted, name):
            change[name] = False
            notes.append(f"{name} off: {why}")
    if strategy == "fsdp2" and wanted.channels_last:
        change["channels_last"] = False
        notes.append("channels_last off: FSDP2 shards contiguous parameters only (the convolution runs NCHW; "
                     "same math, another layout)")
    if wanted.loader != "resident":
        change["loader"] = "resident"
        notes.append(f"loader '{wanted.loader}' -> resident: {RESIDENT_WHY}")
    eff = resolve_autocast(dataclasses.replace(wanted, **change), di)
    if eff.autocast != wanted.autocast:
        notes.append(f"bf16 unsupported on {di.name}: fp16 autocast with a GradScaler instead")
    if eff.offload_optimizer:
        raise ValueError("offload_optimizer is a single-process memory technique; the strategies shard instead")
    return eff, notes


# --- the strategies ----------------------------------------------------------------------------------

@dataclass
class Applied:
    """A strategy applied to a model: what the training step calls (``fwd``), the optimizer, the
    module a no-grad probe may call without collectives (``probe``: None when it cannot), and notes."""

    fwd: torch.nn.Module
    opt: torch.optim.Optimizer
    probe: torch.nn.Module | None
    notes: list
    step: object = None   # a graphed.GraphedStep that runs the whole step, or None (the ladder's step)


def apply(strategy: str, model: torch.nn.Module, cfg, settings: Settings, device: torch.device, world: int,
          options: Options | None = None) -> Applied:
    """Wrap ``model`` (already on ``device``, identical on every rank) for ``strategy``."""
    check_strategy(strategy)
    options = options or Options()
    if strategy == "single":
        if world != 1:
            raise ValueError(f"strategy 'single' runs one process; this job has world size {world}")
        return apply_single(model, cfg, settings, device)
    if strategy == "fsdp2":
        return apply_fsdp2(model, cfg, settings, device, world, options)
    if strategy in GRAPHED:
        return apply_graphed(model, cfg, settings, device, world, options, shard=strategy == "graphed_zero1")
    return apply_ddp(model, cfg, settings, device, options, zero=strategy == "ddp_zero1", world=world)


def _compiled(m: torch.nn.Module, settings: Settings, device: torch.device) -> torch.nn.Module:
    # Inductor's default mode, as step 06 compiles: CUDA graphs are off under every strategy.
    return compile_model(m, device=device) if settings.compile else m


def apply_single(model, cfg, settings: Settings, device: torch.device) -> Applied:
    return Applied(_compiled(model, settings, device), make_optimizer(model, cfg, settings), model, [])


def apply_ddp(model, cfg, settings: Settings, device: torch.device, options: Options, zero: bool = False,
              world: int = 2) -> Applied:
    from torch.nn.parallel import DistributedDataParallel as DDP
    if world == 1 and not zero:
        # One rank reduces nothing: the unwrapped model computes the same step without DDP's reducer
        # hooks, its bucket copies and DDPOptimizer's split graphs.
        return Applied(_compiled(model, settings, device), make_optimizer(model, cfg, settings), model,
                       ["world size 1: nothing to reduce, so the model is not wrapped in DDP (the same step as "
                        "one process)"])
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=options.bucket_cap_mb, gradient_as_bucket_view=options.gradient_as_bucket_view,
              static_graph=options.static_graph)
    opt = make_optimizer(model, cfg, settings)
    notes = []
    if zero:
        bucketed = zero_bucketed(opt)
        opt = zero_redundancy(opt)
        notes.append("AdamW states sharded by ZeroRedundancyOptimizer; updated parameters broadcast by their owner, "
                     + ("one flat bucket per rank" if bucketed else
                        "one parameter at a time (a channels_last weight cannot live in a flat bucket)"))
    if options.reduce_dtype == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
        notes.append("gradients all-reduced in bf16 (a comm hook): each bucket divided by the world size, "
                     "cast to bf16, summed, cast back")
    if settings.compile:
        notes.append("torch.compile over DDP: DDPOptimizer splits the graph at bucket boundaries")
    # The probe calls the inner module: a forward outside DDP launches no collective.
    return Applied(_compiled(ddp, settings, device), opt, model, notes)


def bf16_hook(state, bucket):
    """DDP comm hook: the bucket's mean all-reduced in bf16. torch's ``bf16_compress_hook`` does the
    same but refuses any backend other than NCCL; this one runs over gloo too (CI checks its math)."""
    import torch.distributed as dist
    buf = bucket.buffer()
    wire = buf.div(dist.get_world_size()).to(torch.bfloat16)
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf
    return fut.then(back)


def zero_redundancy(opt: torch.optim.Optimizer):
    """The ladder's optimizer (its class, parameter groups and hyper-parameters, fused or not) with
    its states sharded over the ranks.

    After its step each rank broadcasts the parameters it updated. Left to its default, ZeRO sends
    them one broadcast per parameter (about 150 collectives a step for GPT-2 small, each with its
    launch and wait on the host, even at world size 1); ``parameters_as_bucket_view`` packs each
    rank's parameters into one flat buffer (``param.data`` becomes a view into it) and sends one
    broadcast per rank. The buffer is flat: a channels_last weight would turn contiguous under it,
    so a model that has one keeps the per-parameter broadcasts (``zero_bucketed``)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
    kw = {k: opt.defaults[k] for k in ("lr", "betas", "eps") if k in opt.defaults}
    if opt.defaults.get("fused"):
        kw["fused"] = True
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(opt),
                                   parameters_as_bucket_view=zero_bucketed(opt), **kw)


def zero_bucketed(opt: torch.optim.Optimizer) -> bool:
    """Whether ZeRO may pack ``opt``'s parameters into flat buckets: every one contiguous."""
    return all(p.is_contiguous() for g in opt.param_groups for p in g["params"])


def apply_fsdp2(model, cfg, settings: Settings, device: torch.device, world: int, options: Options) -> Applied:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    kw = {} if options.reshard_after_forward is None else {"reshard_after_forward": options.reshard_after_forward}
    blocks = getattr(model, "blocks", None)
    notes = []
    if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
        # Compile each block, then shard the compiled module (the recipe FSDP2 documents): the
        # all-gather and reduce-scatter hooks run eagerly around the compiled block. The blocks share
        # one compiled graph; what lies outside them (embeddings, final norm, head, loss) runs eager.
        for i, block in enumerate(blocks):
            unit = _compiled(block, settings, device)
            fully_shard(unit, mesh=mesh, **kw)
            blocks[i] = unit
        fully_shard(model, mesh=mesh)
        fwd = model
        notes.append(f"{len(blocks)} blocks sharded one by one" + (", each compiled; embeddings, head and loss "
                                                                   "eager" if settings.compile else ""))
    else:
        fwd = _compiled(model, settings, device)
        fully_shard(fwd, mesh=mesh, **kw)
        notes.append("no blocks to shard apart: the whole model is one FSDP unit" +
                     (", compiled before sharding" if settings.compile else ""))
    # Parameters are sharded DTensors from here on: the optimizer steps on each rank's shards only.
    opt = make_optimizer(model, cfg, settings)
    # A no-grad probe of the model would all-gather (a collective) and, compiled, compile a graph of its
    # own: none here.
    return Applied(fwd, opt, None, notes)


def apply_graphed(model, cfg, settings: Settings, device: torch.device, world: int, options: Options,
                  shard: bool = False) -> Applied:
    """The whole step as one CUDA graph with the gradient sync inside (``hwlib.distributed.graphed``),
    AdamW with the ladder's hyper-parameters (capturable when captured: its step counts on the GPU)."""
    import torch.distributed as dist
    from .graphed import EAGER_STEPS, GraphedStep, compile_units
    if settings.autocast == "fp16":
        raise ValueError("the graphed strategies have no GradScaler (its skipped steps need the host): "
                         "fp16 autocast cannot run under them")
    notes = []
    if settings.compile:
        notes.append("compiled unit by unit: " + ", ".join(compile_units(model)))
    ref = make_optimizer(model, cfg, settings)   # the ladder's optimizer: its hyper-parameters, read back
    decay = max(g["weight_decay"] for g in ref.param_groups)
    capture = options.cuda_graph and device.type == "cuda"
    kw = {k: ref.defaults[k] for k in ("lr", "betas", "eps")}
    if ref.defaults.get("fused"):
        kw["fused"] = True
    if capture:
        kw["capturable"] = True
    del ref

    def make_adamw(groups):
        return torch.optim.AdamW([{"params": g["params"], "weight_decay": decay if g["decay"] else 0.0}
                                  for g in groups], **kw)

    rank = dist.get_rank() if world > 1 else 0
    step = GraphedStep(model, make_adamw, device, world, rank, shard=shard, reduce_dtype=options.reduce_dtype,
                       bucket_mb=options.graph_bucket_mb, cuda_graph=options.cuda_graph,
                       overlap_gather=options.overlap_gather)
    lay = step.layout
    notes.append(f"{len(lay.spans)} buckets of about {options.graph_bucket_mb:g} MiB, each "
                 + (("reduce-scattered (AdamW on this rank's shards, parameters all-gathered "
                     + ("behind the next forward)" if options.overlap_gather else "at the step's end)"))
                    if shard else "all-reduced")
                 + (" in bf16" if options.reduce_dtype == "bf16" else "") + " as soon as backward has its gradients; "
                 + (f"the step captured as one CUDA graph after {EAGER_STEPS} eager steps" if capture
                    else "the step runs eagerly"))
    # The probe's no-grad forward would compile the blocks once more: the single process reports the kernel.
    return Applied(model, step.opt, None, notes, step)
