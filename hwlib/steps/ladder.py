"""The ladder: the recipe's steps (``recipe``), then each step past it, one folder each
(``sNN_name/``, found in name order), as one ordered tuple.

Step k runs with the changes of steps 01..k. A step past the recipe may build on an earlier step
than the one listed before it (``Step.after``: a branch, such as a bf16 step that leaves the FP8
step out); it then runs with the changes of its own chain. Each step states the tolerance of its
"same math" check: the largest relative difference allowed between its loss curve and the previous
step's over the first K steps from the same seed and data. Exact-math changes get a tight bound that only
reordering of sums can use up; bf16 changes the arithmetic and gets a stated looser bound.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import torch

from ..data.loader import LOADER_MODES
from ..device import ChoiceError, DeviceInfo, Unavailable, fp8_missing, supports_bf16, supports_compile, supports_tf32
from ..settings import Settings
from .recipe import RECIPE
from .step import Step

FOLDER = re.compile(r"s\d\d_[a-z0-9_]+")


def _past_recipe() -> tuple[Step, ...]:
    """Every step folder's ``STEP``, in folder-name order."""
    here = Path(__file__).resolve().parent
    names = sorted(p.name for p in here.iterdir() if p.is_dir() and FOLDER.fullmatch(p.name))
    steps = tuple(importlib.import_module(f"{__package__}.{n}").STEP for n in names)
    for n, s in zip(names, steps):
        if s.folder != n or n[1:] != s.name:
            raise RuntimeError(f"hwlib/steps/{n}: its STEP is {s.name!r} (folder {s.folder!r}); a folder sNN_name "
                               "holds the step NN_name")
    return steps


LADDER: tuple[Step, ...] = RECIPE + _past_recipe()
RECIPE_NAMES = tuple(s.name for s in LADDER if not s.beyond_recipe)

STEP_NAMES = tuple(s.name for s in LADDER)



def get_step(name: str) -> Step:
    for s in LADDER:
        if s.name == name or s.name.split("_", 1)[0] == name:
            return s
    raise ChoiceError("step", name, STEP_NAMES)


def previous(name: str) -> Step | None:
    """The step ``name`` builds on: its ``after``, else the one listed before it; None for the first."""
    step = get_step(name)
    if step.after is not None:
        return get_step(step.after)
    i = STEP_NAMES.index(step.name)
    return LADDER[i - 1] if i else None


def chain(name: str) -> list[Step]:
    """The steps ``name`` builds on, first step first, ending with ``name`` itself."""
    out, st = [], get_step(name)
    while st is not None:
        out.append(st)
        st = previous(st.name)
    return out[::-1]


def settings_for(name: str) -> Settings:
    """Cumulative settings of a step: every change of its chain, up to and including it."""
    kw: dict = {}
    for s in chain(name):
        kw.update(s.change)
    return Settings(**kw)


def unavailable(step: Step, di: DeviceInfo) -> str | None:
    """Why ``step`` cannot run as such on this device (a reason for a 'skipped' row), else None.

    Only the step's own change is judged: a later step on CPU still runs, with the earlier
    GPU-only changes inert there.
    """
    if step.gpu_only and di.kind != "cuda":
        return f"{step.name} is GPU-only ({step.title}); this device is {di.kind}"
    if "tf32" in step.change and di.kind == "cuda" and not supports_tf32(di):
        return f"TF32 needs sm_80 or newer; this GPU is sm_{di.capability[0]}{di.capability[1]}"
    if "compile" in step.change or "cuda_graphs" in step.change:
        ok, why = supports_compile(di)
        if not ok:
            return f"torch.compile unavailable: {why}"
    if step.fp8 and (why := fp8_missing(di)):
        return why
    return None


def not_applicable(step: Step, workload: str) -> str | None:
    """Why ``step`` does not apply to ``workload`` (an 'n/a' row), else None."""
    if step.workloads is not None and workload not in step.workloads:
        if workload in step.why_na:
            return step.why_na[workload]
        return f"{step.name} changes a layer that {workload} does not have (applies to {', '.join(step.workloads)})"
    return None


def resolve_autocast(settings: Settings, di: DeviceInfo) -> Settings:
    """bf16 before Ampere becomes fp16 with a GradScaler (the documented fallback)."""
    if settings.autocast == "bf16" and not supports_bf16(di):
        return dataclasses.replace(settings, autocast="fp16")
    if settings.autocast == "fp16" and di.kind != "cuda":
        raise Unavailable("fp16 autocast with a GradScaler is a CUDA recipe; on CPU use bf16")
    if settings.autocast not in (None, "bf16", "fp16"):
        raise ChoiceError("autocast", settings.autocast, (None, "bf16", "fp16"))
    if settings.attention not in ("manual", "sdpa"):
        raise ChoiceError("attention", settings.attention, ("manual", "sdpa"))

    if settings.loader not in LOADER_MODES:
        raise ChoiceError("loader", settings.loader, LOADER_MODES)
    return settings


def runs_here(di: DeviceInfo) -> list[dict]:
    """What each ladder step does on this device, for notebook 00: runs, runs changed (bf16 autocast
    as fp16 with a GradScaler before sm_80; mixed precision with no tensor cores to run it on before
    sm_70) or is skipped, with the reason. The rest of the series runs what it can around it."""
    rows = []
    for step in LADDER:
        why = unavailable(step, di)
        if why:
            rows.append({"step": step.name, "here": "skipped", "why": why})
            continue
        here, note = "runs", ""
        if step.change.get("autocast") and di.kind == "cuda":
            ran = resolve_autocast(settings_for(step.name), di).autocast   # the fallback the ladder takes
            if ran != step.change["autocast"]:
                here, note = f"runs as {ran} autocast + GradScaler", "no bf16 tensor cores before sm_80"
            if di.capability is not None and di.capability[0] < 7:
                here, note = here + ", no speed-up expected", "no tensor cores (fp16 or bf16) before sm_70"
        rows.append({"step": step.name, "here": here, "why": note})
    return rows


def describe(name: str) -> list[dict]:
    """The step's change against the step it builds on, as rows for a table: the settings a recipe step
    changes, or the function through which a step past the recipe changes the model."""
    step = get_step(name)
    prev = previous(name)
    if step.apply is not None:
        return [{"setting": "apply", "before": prev.name if prev else "-",
                 "after": f"{step.apply.__module__}.{step.apply.__qualname__}"}]
    before = settings_for(prev.name) if prev else Settings()
    after = settings_for(step.name)
    return [{"setting": k, "before": a, "after": b} for k, (a, b) in after.diff(before).items()]


def apply_chain(model: torch.nn.Module, name: str, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """``model`` (built with the recipe's settings of ``name``'s chain) with every step past the recipe in
    that chain applied, first step first, but those named in ``skip``; raises ``Precondition`` where one
    cannot apply (a step whose own precondition was left out, say)."""
    skip = {get_step(s).name for s in skip}
    for st in chain(name):
        if st.apply is not None and st.name not in skip:
            st.apply(model)
    return model


def uses_fp8(name: str) -> bool:
    """Whether any matmul of step ``name`` runs in FP8 (a step of its chain does)."""
    return any(s.fp8 for s in chain(name))
