"""Inductor's own knobs on GPT-2 small's best bf16 step, each an A/B toggle of ``hwlib.studies.ablation``.

Notebook 16's breakdown of the recipe leaves its headroom in the memory-bound work: the GEMMs run
near the matmul ceiling, the LayerNorm / elementwise kernels (LayerNorm, bias + GELU, residual adds,
casts: Triton kernels inductor wrote) far above their one-pass floor. Inductor has options aimed at
exactly that, off by default because they cost compile time: ``KNOBS`` holds the few that target it,
each with the reason it could help this step. One knob is not an inductor option but a fusion of the
lab's own, the residual add fused into the LayerNorm after it (``hwlib.steps.s21_fused_layernorm.op``, a
``step`` knob: the arm *with* has step 21's modules swapped in), measured the same way to
answer whether inductor's kernels for that work leave anything to take.

Each knob is a *rebuild* toggle of the ablation study (a session per arm, each model of its own
class, so that the compiler never hands one arm the graph it compiled for the other), measured by
``ablation.measure`` in interleaved windows with a bootstrap interval. The arms differ only in
``torch._inductor.config.patch(...)``: the same option keys, off in the arm *without* (whatever the
environment says) and on in the arm *with*. The patch is the arm's context, entered around every
run of the arm's steps, so it is in force at the arm's first call, where its model is compiled (and
at any recompile); inductor reads its options while compiling, and the compiled kernels keep what
they were compiled with.

What each knob reports (``ablation``'s row, with ``knob`` and ``verdict`` added): ms/step without and
with, the speed-up (time without / time with) with its interval, the effect (faster, slower, within
noise), the compile seconds of each arm (the first call less a steady step, as the ladder counts
it; inductor's one-off start in the process is paid before the first arm, by ``warm_compiler``),
and the same-math check: the arms' first K losses, from the same seed and batches, must agree
within the step's tolerance (an autotuned GEMM or another block size changes rounding only). A knob
is kept only when its interval lies above 1 and its math held.

Compile seconds are those of the inductor caches as they stand: a first run compiles and autotunes
from nothing; a later one finds the kernels and the autotuning choices on disk and compiles faster.
Under ``hwlib reproduce`` the run's notebooks share one cache, so the arm *without* (the step's own
options) finds the graph the step's own ladder notebook compiled, while the arm *with* compiles under its new options:
the gap between the two is what the knob costs a user whose step is already compiled.

A combination of knobs (``Knob.parts``) is measured only where one of its parts was kept: each part
already answered whether its options gain anything here.

The step (``best_step``): the fastest compiled bf16 step of the run's ladder (a series runs every
ladder notebook before this study); in a run without ladder rows, 17 (the fused LM head) where it
runs with its Triton row pass, else 09 (the recipe's last step). A ``step`` knob whose step is
already in the chain of the step measured is ``n/a``: the ladder step that made it part of the chain measured it.

On a CPU, inductor writes C++ rather than Triton: the knobs that tune Triton kernels (max-autotune's
GEMM templates, coordinate descent, multi-kernel reductions) are ``skipped`` with the reason, and the
smoke profile measures the one knob whose code path a CPU also has, at the smoke ladder's step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import bench, noise
from ..device import ChoiceError, Unavailable, info, resolve_device, supports_compile
from ..ladder.session import cpu_compile_backend
from ..steps import chain, get_step, not_applicable, settings_for, unavailable, uses_fp8
from . import ablation

STEP, FALLBACK = "17_fused_lm_head", "09_cuda_graphs"
PREFIX = "inductor_"     # a knob's toggle name: "inductor_" + the knob's name


@dataclass(frozen=True)
class InductorConfig:
    """An arm's context: ``torch._inductor.config.patch(changes)`` around the arm's steps (its
    compile among them); ``changes`` maps option names (dotted for a sub-config,
    ``"triton.multi_kernel"``) to values."""
    changes: dict

    def __call__(self, sess, store):
        import torch._inductor.config as inductor_config
        return inductor_config.patch(dict(self.changes))


@dataclass(frozen=True)
class Knob:
    name: str
    on: dict           # the options the arm *with* compiles under
    off: dict          # the same options as the arm *without* compiles under (inductor's defaults)
    title: str
    why: str           # what in GPT-2's step it could make faster
    triton: bool       # acts only on the Triton kernels inductor writes for a GPU
    # knobs this one combines: measured only where one of them was kept (a combination of options that
    # each measured no gain is minutes of compilation for a question the parts already answered)
    parts: tuple = ()
    # "inductor": ``on``/``off`` are inductor options, patched around the arm; "step": the arm *with* has
    # ladder step ``step``'s modules swapped in (its ``apply``): a fusion of hwlib's own that takes work away
    # from inductor (GPT only); ``on``/``off`` are empty
    kind: str = "inductor"
    step: str | None = None

    def __post_init__(self):
        if self.kind == "step":
            if not self.step or self.on or self.off:
                raise ValueError(f"knob {self.name}: a 'step' knob names its step and sets no options")
            return
        if set(self.on) != set(self.off) or self.on == self.off:
            raise ValueError(f"knob {self.name}: 'on' and 'off' must set the same options to different values")
        if self.kind != "inductor":
            raise ValueError(f"knob {self.name}: kind must be 'inductor' or 'step', got {self.kind!r}")


_AUTOTUNE_WHY = ("it times Triton GEMM templates against cuBLAS for each of the step's matmul shapes and, where "
                 "a template wins, can fuse the pointwise op that follows into its epilogue: the MLP's bias + GELU "
                 "and the bias adds after the QKV and output projections, which the breakdown counts as "
                 "LayerNorm / elementwise (one write and one read of each activation saved). The GEMMs already run "
                 "near the matmul ceiling: a gain has to come from the epilogues.")

# Cheapest to compile first: a budget that runs out skips the knobs that cost most (on an H100 at GPT-2's
# step 17, coordinate descent compiled in ~150 s and max-autotune in ~215 s, against ~25 s without; at step 25,
# where hwlib's ops leave inductor fewer kernels, in ~41 s and ~92 s).
KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("aggressive_fusion", {"aggressive_fusion": True}, {"aggressive_fusion": False},
         "aggressive fusion: kernels fused even when they share no input",
         "the backward holds many small independent reductions (each Linear's bias gradient, each LayerNorm's "
         "weight and bias gradients) that read different tensors; fused, they are fewer kernels with fewer "
         "tails. It saves no bytes, so the expected gain is small; its code path exists on a CPU as well (the "
         "smoke run's knob).", triton=False),
    Knob("multi_kernel", {"triton.multi_kernel": 1}, {"triton.multi_kernel": 0},
         "multi-kernel reductions: persistent and looped, picked by timing",
         "each reduction is compiled both persistent (a whole row in registers) and looped, and the faster runs: "
         "LayerNorm forward and backward reduce rows of d = 768, and the bias and LayerNorm-weight gradients "
         "reduce columns over all 16,384 tokens, where one fixed choice does not suit both.", triton=True),
    Knob("coordinate_descent", {"coordinate_descent_tuning": True}, {"coordinate_descent_tuning": False},
         "coordinate-descent tuning of each Triton kernel's block sizes",
         "after inductor's heuristics pick a Triton kernel's block sizes and warps, it times the neighbouring "
         "choices one parameter at a time and keeps a faster one: aimed at the LayerNorm, GELU, residual and cast "
         "kernels, the category furthest above its floor.", triton=True),
    Knob("max_autotune", {"max_autotune": True}, {"max_autotune": False},
         "max-autotune: Triton GEMM templates with epilogue fusion", _AUTOTUNE_WHY, triton=True),
    Knob("max_autotune_coordinate_descent", {"max_autotune": True, "coordinate_descent_tuning": True},
         {"max_autotune": False, "coordinate_descent_tuning": False},
         "max-autotune and coordinate-descent tuning together",
         "what torch.compile's mode='max-autotune' adds to a step that already replays CUDA graphs: the GEMM "
         "templates above and the block sizes of every pointwise and reduction kernel tuned too.", triton=True,
         parts=("max_autotune", "coordinate_descent")),
    # Not an inductor option: the fusion inductor is said to leave (llm.c fuses it by hand), made by hwlib's
    # own op, so that the study answers whether inductor's kernels for it leave anything to take.
    Knob("fused_residual_layernorm", {}, {},
         "residual add + LayerNorm as one hwlib Triton kernel each way (hwlib.ops.add_layernorm)",
         "each block adds its attention and MLP outputs to the fp32 residual stream and normalises the sum; "
         "inductor fuses the add into the LayerNorm's forward, but in backward the LayerNorm's gradient, the "
         "residual gradient's add and cast and the gain and bias reductions can come out as several kernels "
         "that read the same rows again. hwlib's op does each direction in one pass over the rows (28 d bytes "
         "a token and call, forward and backward together).", triton=False, kind="step", step="21_fused_layernorm"),
    # The other fusion the breakdown points at, which inductor's Triton GEMM templates (max-autotune) would
    # have to make: the MLP's bias + GELU, and in backward the GELU's derivative, in the epilogues of
    # cuBLAS's own matmuls (cuBLASLt), through hwlib's op.
    Knob("gelu_epilogue", {}, {},
         "the MLP's bias + GELU and its derivative in cuBLASLt's matmul epilogues (hwlib.ops.gelu_mlp)",
         "the MLP's pre-activation and its gradient are the step's widest activations ([tokens, 4 d]); unfused, "
         "the GELU reads the first back after its matmul, and in backward the input gradient of the second "
         "matmul is written and read again beside the pre-activation: 24 d bytes a token and layer at one pass "
         "per op, forward and backward together, which the epilogues remove.",
         triton=False, kind="step", step="22_gelu_epilogue"),
)}
SMOKE_KNOB = "aggressive_fusion"


def toggle_name(knob: str) -> str:
    return PREFIX + get_knob(knob).name


def get_knob(name: str) -> Knob:
    """The knob named ``name`` (or its toggle's name, ``inductor_<name>``); a ChoiceError naming it else."""
    key = name[len(PREFIX):] if isinstance(name, str) and name.startswith(PREFIX) else name
    if not isinstance(key, str) or key not in KNOBS:
        raise ChoiceError("knob", name, tuple(KNOBS))
    return KNOBS[key]


def _has_option(key: str) -> bool:
    import torch._inductor.config as cfg
    obj = cfg
    for part in key.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _compiles(workload, st, di, step=None):
    if not (st.compile or st.cuda_graphs):
        return "the step does not compile: inductor's options change nothing"
    ok, why = supports_compile(di)
    return None if ok else f"torch.compile unavailable: {why}"


def _skips(knob: Knob):
    def why(di) -> str | None:
        missing = [k for k in knob.on if not _has_option(k)]
        if missing:
            return f"torch {torch.__version__} has no inductor option {', '.join(missing)}"
        if knob.triton and di.kind != "cuda":
            if "max_autotune" in knob.on:
                return ("max-autotune chooses among Triton GEMM templates by timing them on a GPU; on a CPU inductor "
                        "would time its C++ GEMM templates instead, another question than the GPU's, and that "
                        "autotuning takes minutes on a few cores")
            return (f"{knob.name} acts on the Triton kernels inductor writes for a GPU; on a {di.kind} inductor "
                    "writes C++ kernels, which this option leaves as they are: both arms would compile the same code")
        return None
    return why


def _step_applies(knob: Knob):
    """Why a ``step`` knob does not apply at a step: not GPT, not compiled, or the step's chain already has
    the knob's step (the ladder measured it there against the step before, in the same run)."""
    def why(workload, st, di, step=None) -> str | None:
        if workload != "gpt":
            return f"a fusion inside GPT's blocks: {workload} does not use it"
        if step is not None and knob.step in {s.name for s in chain(step)}:
            return (f"already part of this step, since {knob.step}: the ladder measured it there against the step "
                    f"before, in the same run")
        return _compiles(workload, st, di)
    return why


def knob_toggle(knob: Knob) -> ablation.Toggle:
    """The knob as an ablation toggle: a session per arm, each compiled under its own options (or,
    for a ``step`` knob, the arm *with* with the step's modules swapped in)."""
    if knob.kind == "step":
        return ablation.Toggle(PREFIX + knob.name, knob.title, without=ablation.Arm(),
                               with_=ablation.Arm(model=get_step(knob.step).apply), rebuild=True,
                               applies=_step_applies(knob), fallible=True, same_math=True)
    on, off = (", ".join(f"{k}={v!r}" for k, v in d.items()) for d in (knob.on, knob.off))
    return ablation.Toggle(PREFIX + knob.name, f"inductor {on} at compile (vs {off})",
                           without=ablation.Arm(context=InductorConfig(knob.off)),
                           with_=ablation.Arm(context=InductorConfig(knob.on)), rebuild=True,
                           applies=_compiles, skips=_skips(knob), fallible=True, same_math=True)


TOGGLES: dict[str, ablation.Toggle] = {k: knob_toggle(v) for k, v in KNOBS.items()}
ablation.register(*TOGGLES.values())


def fastest_step(rows: list[dict]) -> str | None:
    """The fastest step among ladder ``rows`` (``query.ladder_rows``'s, one workload) that the knobs can
    act on: timed, compiled, in bf16 without FP8 (inductor's options change compiled code only, and FP8 is
    a branch of its own). None where no row qualifies."""
    def fits(r):
        if r.get("status") != "ok" or not isinstance(r.get("ms_per_step"), (int, float)) or r["ms_per_step"] <= 0:
            return False
        st = settings_for(r["step"])
        return bool(st.compile or st.cuda_graphs) and st.autocast == "bf16" and not uses_fp8(r["step"])
    timed = [r for r in rows if fits(r)]
    return min(timed, key=lambda r: r["ms_per_step"])["step"] if timed else None


def best_step(workload: str = "gpt", device: str | torch.device = "auto",
              rows: list[dict] | None = None) -> tuple[str, str | None]:
    """(step, why not the fastest or 17). With ``rows``, the run's ladder rows of ``workload`` (handed in:
    studies do not read results), the fastest step among them that the knobs can act on
    (``fastest_step``): every ladder notebook runs before this study in a series. Without rows, or
    where none qualifies: 17 where it applies and runs with its Triton row pass (on a CPU the smoke
    ladder's step 17 runs the same math in torch), else 09 and the reason."""
    fastest = fastest_step(rows) if rows else None
    if fastest is not None:
        return fastest, None
    from ..steps.s17_fused_lm_head import op as linear_ce   # the fused head's own check of its Triton backend

    di = info(resolve_device(device))
    st = get_step(STEP)
    why = not_applicable(st, workload) or unavailable(st, di)
    if why is None and di.kind == "cuda":
        try:
            linear_ce.select_backend("triton", torch.device("cuda"))
        except (Unavailable, ImportError) as e:
            why = f"its Triton row pass cannot run here ({e})"
    return (STEP, None) if why is None else (FALLBACK, f"{STEP} does not run here: {why}")


@functools.lru_cache(maxsize=None)
def warm_compiler(device_type: str) -> float:
    """Compile a small forward and backward once in this process, before the first arm: inductor's
    one-off start (its imports, the toolchain's first compile) would otherwise be counted in the
    compile time of whichever arm compiles first. Returns its seconds (``bench.wall_s``)."""
    dev = torch.device(device_type)
    x = torch.randn(16, 16, device=dev, requires_grad=True)
    # with the backend the arms' sessions compile with (hwlib.ladder.session.cpu_compile_backend on a CPU)
    backend = cpu_compile_backend() if dev.type == "cpu" else "inductor"
    f = torch.compile(lambda t: torch.nn.functional.gelu(t @ t.T).sum(), backend=backend)
    s, _ = bench.wall_s(lambda: f(x).backward(), dev)
    return s


def check_knobs(knobs) -> list[str]:
    """Knob names, each checked (a ChoiceError naming an unknown one); the list must not be empty."""
    if isinstance(knobs, str) or not knobs or not isinstance(knobs, (list, tuple)):
        raise ValueError(f"knobs must be a non-empty list of knob names ({', '.join(KNOBS)}), got {knobs!r}")
    return [get_knob(k).name for k in knobs]


def verdict(row: dict) -> str:
    """'keep' only when the interval lies above 1 and the arms' math agreed; else 'drop' and why."""
    if row["status"] != "ok":
        return f"not measured ({row['status']})"
    if row.get("same_math") and not row["same_math"]["ok"]:
        return "drop (math changed)"
    return {"faster": "keep", "slower": "drop (slower)", "within noise": "drop (within noise)"}[row["effect"]]


def measure(knobs: list[str] | None = None, *, workload: str = "gpt", step: str | None = None, profile: str = "auto",
            device: str = "auto", window: ablation.Window | None = None, level: float = noise.DEFAULT_LEVEL,
            seed: int = 0, config: dict | None = None, budget_s: float | None = None, notebook: str, run=None,
            progress: bool = False) -> list[dict]:
    """Each knob of ``knobs`` (None: all) as an A/B toggle at ``step`` (None: ``best_step``), through
    ``ablation.measure`` (its arguments, checked there before any work); records under ``notebook``. Returns ablation's rows, each with ``knob``, ``changes``, ``verdict`` and, where the
    step fell back from 17, ``fallback`` (why)."""
    names = check_knobs(list(KNOBS) if knobs is None else knobs)
    why = None
    if step is None:
        step, why = best_step(workload, device)
    toggles = [PREFIX + k for k in names]
    ablation._check(workload, step, toggles, window, level, budget_s)   # every argument, before any work
    dev = resolve_device(device)
    if supports_compile(info(dev))[0]:
        warm_compiler(dev.type)
    rows = ablation.measure(workload, step, toggles, profile=profile, device=device,
                            window=window, level=level, seed=seed, config=config, budget_s=budget_s,
                            notebook=notebook, run=run, progress=progress,
                            skip_if=lambda t, before: combination_skip(get_knob(t.name), before))
    for r, k in zip(rows, names):
        r.update(knob=k, changes=KNOBS[k].on, fallback=why, verdict=verdict(r))
    return rows


def combination_skip(knob: Knob, rows: list[dict]) -> str | None:
    """Why ``knob``, a combination, is not measured (None: measure it): none of its parts was kept
    among ``rows`` (ablation rows of the knobs measured before it, in ``KNOBS``'s order). A part not
    measured at all leaves the question open: the combination is measured."""
    if not knob.parts:
        return None
    parts = {toggle_name(k): k for k in knob.parts}
    got = {parts[r["toggle"]]: r for r in rows if r.get("toggle") in parts}
    if len(got) < len(knob.parts) or any(r["status"] != "ok" or verdict(r) == "keep" for r in got.values()):
        return None
    said = "; ".join(f"{k}: {verdict(got[k])}" for k in knob.parts)
    return f"not compiled: none of its parts was kept ({said}), so their combination asks nothing new"


# --- the breakdown this study starts from ----------------------------------------------------------------

TARGETS = ("gemm", "lm_head_ce", "elementwise")   # what the knobs can reach: matmuls, their epilogues, fused kernels


def breakdown_left(records: list[dict], step: str) -> tuple[list[dict], str]:
    """What notebook 16 measured of ``step`` (or of the step it did profile), from the run's
    ``records`` (handed in: studies do not read results): per target category the measured ms/step,
    its floor, the ms above the floor, and the step's speed-up were that category at its floor
    (step / (step - above)): the most a knob aimed at it could give. Returns (rows, a sentence)."""
    from .breakdown import HEAD_IN_GEMMS, LABELS, by_step

    # the breakdown's own records (by_step reads its metrics: step_ms, category_ms, floor_ms), whichever
    # notebook ran it
    steps = {k: v for k, v in by_step(records).items()
             if "step_ms" in v}
    if not steps:
        return [], (f"Notebook 16 (where the time goes) has not run into this run: there is no breakdown to say "
                    f"what is left at {step}.")
    at = step if step in steps else list(steps)[-1]
    s = steps[at]
    step_ms = s["step_ms"]
    rows = []
    for c in ((HEAD_IN_GEMMS, "elementwise") if s["head_in_gemms"] else TARGETS):
        ms, floor = s["ms"].get(c), s["floor"].get(c)
        above = ms - floor if (ms is not None and floor is not None) else None
        bound = step_ms / (step_ms - above) if (above is not None and step_ms and 0 < above < step_ms) else None
        rows.append({"step": at, "category": LABELS[c], "ms/step": ms, "floor (ms)": floor,
                     "measured / floor": ms / floor if (ms is not None and floor) else None,
                     "above floor (ms)": above, "speed-up at its floor": bound})
    text = f"Notebook 16 profiled {at}" + ("" if at == step else f" (not {step}, where the knobs are measured)")
    if s["head_in_gemms"]:
        text += (" (its LM head + cross-entropy measured below that category's floor: the head's GEMMs were counted "
                 "as GEMMs, so the two are taken together)")
    text += f": a step of {step_ms:.3g} ms"
    known = [r for r in rows if r["above floor (ms)"] is not None]
    if known:
        top = max(known, key=lambda r: r["above floor (ms)"])
        text += (f"; the most time above a floor is in {top['category']}, {top['above floor (ms)']:.3g} ms "
                 f"({top['measured / floor']:.2g}x its floor)")
        if top["speed-up at its floor"]:
            text += f": brought to its floor, the step would run {top['speed-up at its floor']:.3g}x faster"
    else:
        text += "; no floors (the run has no measured ceilings: notebook 00 measures them)"
    return rows, text + "."


# --- table, figure, prose -------------------------------------------------------------------------------

def table_rows(rows: list[dict]) -> list[dict]:
    """One flat row per knob for the notebook's table."""
    out = []
    for r in rows:
        m, c = r.get("same_math") or {}, r.get("compile_s") or {}
        out.append({"knob": r["knob"], "step": r["step"], "status": r["status"], "ms without": r["ms_without"],
                    "ms with": r["ms_with"], "speed-up": r["speedup"],
                    "interval": f"{r['lo']:.3f}-{r['hi']:.3f}" if r["lo"] is not None else None,
                    "effect": r["effect"], "compile s without": c.get("without"), "compile s with": c.get("with"),
                    "loss curves, max rel. diff": m.get("max_rel"), "tolerance": m.get("tolerance"),
                    "verdict": r["verdict"], "reason": r["reason"]})
    return out


def speedup_figure(rows: list[dict], level: float, title: str = ""):
    """Each measured knob's speed-up with its interval; the line at 1 is no effect."""
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 0.4 * max(1, len(ok)) + 1.3))
    for i, r in enumerate(ok):
        colour = {"faster": "tab:green", "slower": "tab:red"}.get(r["effect"], "tab:gray")
        lo, hi = min(r["lo"], r["speedup"]), max(r["hi"], r["speedup"])
        ax.errorbar(r["speedup"], i, xerr=[[r["speedup"] - lo], [hi - r["speedup"]]], fmt="o", color=colour, capsize=3)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(ok)), [f"{r['knob']} ({r['step'].split('_', 1)[0]})" for r in ok], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"speed-up, time without / time with ({level:.0%} interval)")
    ax.set_title(title or "inductor's options, one at a time", fontsize=10)
    fig.tight_layout()
    return fig


def prose(rows: list[dict], level: float, on_gpu: bool, left: list[dict] | None = None) -> str:
    """What the knobs did, in words built from the rows; ``left`` (``breakdown_left``'s rows) sets the
    kept gain, or its absence, against the most the breakdown's floors allow."""
    parts = []
    for r in rows:
        head = f"{r['knob']} at {r['step']}"
        if r["status"] != "ok":
            parts.append(f"{head}: {r['status']} ({r['reason']}).")
            continue
        text = (f"{head}: {r['ms_without']:.3g} ms/step without, {r['ms_with']:.3g} with, {r['speedup']:.3f}x "
                f"({r['lo']:.3f}-{r['hi']:.3f}, {level:.0%}), "
                + noise.EFFECT_WORDS[r["effect"]])
        c = r.get("compile_s") or {}
        if "with" in c and "without" in c:
            text += f"; compiling took {c['with']:.3g} s with it against {c['without']:.3g} s without"
        m = r.get("same_math")
        if m:
            text += (f"; the first {m['k']} losses of the two arms differ by at most {m['max_rel']:.1e} "
                     + ("(within" if m["ok"] else "(beyond") + f" the step's {m['tolerance']:.0e})")
        parts.append(text + ".")
    kept = [r["knob"] for r in rows if r.get("verdict") == "keep"]
    measured = [r for r in rows if r["status"] == "ok"]
    if measured:
        parts.append(f"Kept, a gain beyond noise with the same math: {', '.join(kept)}." if kept else
                     "No option measured a gain beyond noise: inductor's defaults stay.")
    room = [r for r in (left or []) if r.get("above floor (ms)") is not None and r.get("speed-up at its floor")]
    if measured and room:
        top = max(room, key=lambda r: r["above floor (ms)"])
        best = max((r["speedup"] for r in rows if r.get("verdict") == "keep"), default=None)
        floor = (f"{top['category']} at its floor would give {top['speed-up at its floor']:.3g}x "
                 f"({top['above floor (ms)']:.3g} ms above it at {top['step']})")
        parts.append(f"The best kept option gives {best:.3f}x, where {floor}." if best else
                     f"What the breakdown leaves stays where it was: {floor}, and no option reached any of it.")
    if not on_gpu:
        parts.append("On a CPU (smoke) these ratios only show that the code runs; they say nothing of a GPU.")
    return " ".join(parts)
