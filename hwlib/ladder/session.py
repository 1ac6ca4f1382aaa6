"""A workload's model, optimizer, scaler and data under one ``Settings``: everything one training
step needs, and what a checkpoint saves."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import warnings

import torch

from .. import precision
from ..memory.accumulation import accumulate, batch_size, plan_micro_batches
from ..memory.offload import OffloadedAdamW
from ..ops import fallbacks
from ..steps import Settings, apply_chain, chain, get_step, settings_for
from ..workloads import get_workload


# AdamW as GPT-2 trains it, for every workload and step; a step that changes any of it declares the
# change (hwlib.ladder.gradients.DECLARED_OPTIMIZER_CHANGES), or the same-gradients check fails it.
BETAS, EPS = (0.9, 0.95), 1e-8
# The learning rate is the config's for every step: nothing in a session changes it (optimizer_step
# calls opt.step only). A scheduler added later must say so here, where the description reads it.
SCHEDULE = "constant"


def make_optimizer(model: torch.nn.Module, cfg, settings: Settings):
    """AdamW as GPT-2 trains it: matrices decayed, biases and LayerNorm gains not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=cfg.lr, betas=BETAS, eps=EPS)
    if settings.offload_optimizer:
        return OffloadedAdamW(groups, **kw)
    return torch.optim.AdamW(groups, **kw, **({"fused": True} if settings.fused_adamw else {}))


def optimizer_description(model: torch.nn.Module, opt) -> dict:
    """What ``opt`` does to ``model``, read back from the optimizer itself rather than from what was
    meant: each parameter group's parameters by name (which decay, which not) with its lr, betas, eps
    and weight decay; the options that pick the implementation (fused, foreach, ...); the schedule.
    Plain data, for a record and for comparing one step's optimizer with another's."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for g in opt.param_groups:
        stray = sum(1 for p in g["params"] if id(p) not in names)
        if stray:
            raise ValueError(f"optimizer_description: the optimizer holds {stray} tensors that are not parameters "
                             "of the model")
        groups.append({"params": sorted(names[id(p)] for p in g["params"]), "lr": float(g["lr"]),
                       "betas": [float(b) for b in g["betas"]], "eps": float(g["eps"]),
                       "weight_decay": float(g["weight_decay"])})
    groups.sort(key=lambda g: (g["weight_decay"], g["params"]))
    d = getattr(opt, "defaults", {})
    return {"class": type(opt).__name__, "groups": groups,
            **{k: d.get(k) for k in ("fused", "foreach", "amsgrad", "maximize", "capturable", "differentiable")},
            "schedule": SCHEDULE}


def build_model(workload: str, step: str | None, cfg, seed: int = 0, settings: Settings | None = None,
                skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """The model of ``step`` for ``workload``, on the CPU, initialised from ``seed``: the workload's model
    under the recipe's settings of the step's chain (``settings`` replaces them), with every step past the
    recipe in that chain applied (``hwlib.steps.apply_chain``). ``step=None``: the model of ``settings``
    alone; ``skip``: steps of the chain left out (an ablation's arm)."""
    if step is None and settings is None:
        raise ValueError("build_model needs a step or settings")
    model = get_workload(workload).build(cfg, settings if settings is not None else settings_for(step), seed)
    return apply_chain(model, step, skip) if step is not None else model


CPU_COMPILE_BACKEND_ENV = "HWLIB_CPU_COMPILE_BACKEND"
CPU_COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def cpu_compile_backend() -> str:
    """The backend ``torch.compile`` uses on a CPU: inductor, unless ``HWLIB_CPU_COMPILE_BACKEND`` says
    ``aot_eager`` or ``eager``. ``aot_eager`` still runs what a GPU compile shares with a CPU one
    (dynamo's tracing, the custom ops' fake implementations, AOT autograd's joint graph) but not
    inductor's C++ code generation, which no GPU run uses and which costs 20-80 s per graph on a small
    CPU; ``eager`` keeps dynamo's tracing (the forward's fake implementations and graph breaks) and
    leaves out the joint graph too. The test suites set them (the Makefile says which and why). A GPU
    always compiles with inductor."""
    backend = os.environ.get(CPU_COMPILE_BACKEND_ENV, "inductor") or "inductor"
    if backend not in CPU_COMPILE_BACKENDS:
        raise ValueError(f"{CPU_COMPILE_BACKEND_ENV}={backend!r}: must be one of {CPU_COMPILE_BACKENDS}")
    return backend


def compile_model(model: torch.nn.Module, mode: str | None = None, device: torch.device | None = None):
    """``torch.compile(model, mode=mode)`` after hwlib's custom ops are declared to inductor
    (``hwlib.ops.fallbacks``: an undeclared op fed by a deep graph can keep inductor busy for minutes).
    On a CPU ``device``, with the backend ``cpu_compile_backend`` names."""
    if device is not None and device.type == "cpu" and cpu_compile_backend() != "inductor":
        # modes are inductor's; eager and aot_eager never lower to inductor, so nothing is declared
        # (importing inductor's lowering module for it cost each notebook of the suites 2 s of CPU)
        return torch.compile(model, backend=cpu_compile_backend())
    fallbacks.declare()
    return torch.compile(model, mode=mode)


# The compiled model whose dynamo cache a CPU process keeps past ``Session.close``: the next Session that
# compiles the same model (same workload, config, step chain and settings but the loader, which never
# enters the model) reuses the traced graphs, and any other resets dynamo first, as closing did, so
# the cache holds one model's graphs at most and never nears dynamo's recompile limit (past it a frame
# runs eager, silently). Reuse is only ever what dynamo's guards allow. Notebook 08 compiles each
# workload's step twice (timed, then with resident batches): on a 2-core CPU the second trace of a
# smoke model cost 2.4 s and its reuse 0.2 s. A GPU resets at close, as before.
_kept_compile: tuple | None = None


def _compiled_key(workload: str, cfg, settings: Settings, step: str | None, skip: tuple, device) -> tuple:
    return (workload, repr(cfg), repr(dataclasses.replace(settings, loader="")), step, tuple(skip), str(device))


def _reuse_or_reset(key: tuple) -> None:
    """Before a CPU compile: keep dynamo's cache when it holds ``key``'s model, else reset it."""
    global _kept_compile
    if _kept_compile is not None and _kept_compile != key:
        torch._dynamo.reset()
    _kept_compile = key


class Session:
    """One workload under one ``Settings`` on one device, with the steps past the recipe in ``step``'s chain
    applied to its model. Callers wrap use in ``session.precision()``."""

    def __init__(self, workload: str, cfg, settings: Settings, device: torch.device, seed: int = 0,
                 source: str | None = None, micro_batch: int | None = None, step: str | None = None,
                 skip: tuple[str, ...] = ()):
        self.wl = get_workload(workload)
        # Gradient accumulation: each step's batch runs as exact micro-batches of at most this size.
        self.micro_batch = micro_batch
        self.cfg, self.settings, self.device, self.seed, self.step_name = cfg, settings, device, seed, step
        self.skip = tuple(skip)
        self.batches = self.wl.batches(cfg, device, seed, source, settings)
        # step: the steps past the recipe in its chain swap their modules in (None: the settings alone)
        self.model = build_model(self.wl.name, step, cfg, seed, settings, skip).to(device)
        if settings.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)   # 4-d weights only
        self.opt = make_optimizer(self.model, cfg, settings)
        self.scaler = torch.amp.GradScaler("cuda") if settings.autocast == "fp16" else None
        self.fwd = self.model
        if settings.compile or settings.cuda_graphs:
            # reduce-overhead records the forward and backward graphs as CUDA graphs and replays them.
            mode = "reduce-overhead" if settings.cuda_graphs and device.type == "cuda" else None
            if device.type == "cpu":
                _reuse_or_reset(_compiled_key(self.wl.name, cfg, settings, step, self.skip, device))
            self.fwd = compile_model(self.model, mode=mode, device=device)
        # A step of the chain that runs the whole training step itself (Step.trainer), if it can here.
        make = next((s.trainer for s in chain(step) if s.trainer and s.name not in {get_step(k).name for k in skip}),
                    None) if step else None
        self.trainer = make(self) if make is not None else None

    @contextlib.contextmanager
    def precision(self):
        """The fp32 math mode of these settings (TF32 or IEEE), for the whole session's work."""
        with precision.tf32_mode(self.settings.tf32):
            yield

    def autocast(self):
        return precision.autocast(self.settings.autocast, self.device)

    def forward_backward(self, batch, weight: float = 1.0) -> torch.Tensor:
        """Loss of ``batch`` and its gradient, scaled by ``weight``, added to ``.grad``."""
        with self.autocast():
            loss = self.wl.loss(self.fwd, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise TypeError(f"workload {self.wl.name!r}: loss must be a scalar tensor attached to the graph, "
                            f"got {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        scaled = loss * weight if weight != 1.0 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        # A CUDA-graph output lives in the graph's memory pool and is overwritten by the next replay.
        return loss.detach().clone() if self.settings.cuda_graphs else loss.detach()

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=self.settings.fused_adamw)

    def step(self, i: int) -> torch.Tensor:
        if self.trainer is not None:
            return self.trainer(self.batches(i))
        # A new iteration: earlier outputs may be reused. A CPU records no CUDA graphs, and there the call
        # would only import inductor (2 s of CPU).
        if self.settings.cuda_graphs and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        batch = self.batches(i)
        if self.micro_batch:
            loss = accumulate(self.forward_backward, batch, plan_micro_batches(batch_size(batch), self.micro_batch))
        else:
            loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss

    def make_resident(self, steps: int) -> None:
        """Produce the first ``steps`` batches now and keep them on the device: zero data cost."""
        make = getattr(self.batches, "make_resident", None)
        if make is not None:
            make(steps)
        else:  # a plain batch function: call it now for every step, keep the results
            kept = {i: self.batches(i) for i in range(steps)}
            self.batches = kept.__getitem__

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()
        # Resident batches live on the device: drop them before the cache is emptied.
        self.batches = self.model = self.opt = self.fwd = self.scaler = self.trainer = None
        if (self.settings.compile or self.settings.cuda_graphs) and self.device.type != "cpu":
            torch._dynamo.reset()   # a CPU keeps the graphs for a Session of the same model (_kept_compile)
        free(self.device)


def free(device: torch.device) -> None:
    """Hands a device's memory back after a session: cycles collected, then the allocator's cache
    emptied. A CPU has no cache to empty, and a full collection cost 0.3 s of CPU per session once
    dynamo's objects were alive (456k objects): Python's own collections take what a CPU leaves."""
    if device.type == "cpu":
        return
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


SDPA_KERNELS = (("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU kernel)"),
                ("_scaled_dot_product_flash_attention", "flash"),
                ("_scaled_dot_product_cudnn_attention", "cudnn"),
                ("_scaled_dot_product_efficient_attention", "memory-efficient"),
                ("_scaled_dot_product_fused_attention_overrideable", "fused (overrideable)"),
                ("_scaled_dot_product_attention_math", "math (unfused)"))


def detect_sdpa_backend(fn) -> str | None:
    """Which attention kernel ran, read off the aten ops that ``fn()`` dispatched; None when the
    model has no attention."""
    from torch.profiler import ProfilerActivity, profile   # the profiler is heavy: only when asked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the profiler's notes on event cycles are not ours to show
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    names = {e.name for e in prof.events()}
    for key, label in SDPA_KERNELS:
        if any(key in n for n in names):
            return label
    return None
