"""What every notebook does around its measurement, as one library call per cell.

``setup`` resolves the parameters and prints the environment; ``show_change`` prints the real code
that applies a step and ``predict`` what the roofline says it should save; ``measure_all`` runs a
ladder step for each workload, checks its math against the step before and records it;
``assert_same_math`` judges the checks; ``show_ladder``, ``outcome`` and ``what_we_saw`` turn the
run's results into the table, the figure, the prediction against the measurement and the prose.
The notebooks stay thin and identical in shape.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import warnings
from pathlib import Path

import torch

from . import ceilings, query, results, roofline, steps
from .device import datasheet, format_env_report, info, resolve_device
from .ladder import record as record_mod
from .ladder.gradients import GradCheck, assert_same_gradients, same_gradients
from .ladder.run import StepResult, run_step
from .ladder.same_math import (BF16_BEFORE, BF16_STEP, MathCheck, bf16_bound, bf16_floor, earlier_steps,
                               needs_bf16_floor, same_math)
from .ops.sources import read_kernel_source
from .paths import apply_compile_cache_env, compile_cache_env, read_dir, run_dir
from .stacks import arm_stack_dump
from .profiles import Plan, auto_profile, choose_profile, plan as plan_for, resolve_profile
from .steps import STEP_NAMES, chain, describe, get_step, previous


def resolve(profile: str = "auto", device: str = "auto") -> tuple[str, str]:
    """The notebook's parameters after ``HWLIB_PROFILE`` and 'auto' are applied: (profile, device)."""
    dev = resolve_device(device)
    return choose_profile(profile, dev)[0], dev.type


def setup(profile: str = "auto", device: str = "auto", run=None, *, triton_on_cpu: bool = False) -> tuple[str, str]:
    """Resolve the parameters, print the environment report, the profile with the reason it was
    chosen (and, when it was named, what ``auto`` would pick here) and the plan; returns (profile,
    device). ``profile`` and ``run`` fall back on ``$HWLIB_PROFILE`` and ``$HWLIB_RUN``.
    ``triton_on_cpu``: a notebook that runs Triton kernels on CPU tensors where there is no GPU (12,
    14) has Triton interpret them; Triton reads TRITON_INTERPRET at its first import, so nothing
    before this call may import it."""
    if triton_on_cpu and not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        if "triton" in sys.modules:
            raise RuntimeError("setup(triton_on_cpu=True): Triton was imported before it: call setup first")
        os.environ["TRITON_INTERPRET"] = "1"
    arm_stack_dump()
    apply_compile_cache_env(compile_cache_env(run_dir(run), results.code_digest()))   # as reproduce sets them
    dev = resolve_device(device)
    profile, why = choose_profile(profile, dev)
    device = dev.type
    print(format_env_report(device))
    print(f"profile: {profile} ({why})")
    if not why.startswith("auto:"):
        auto, auto_why = auto_profile(dev)
        print(f"auto would pick: {auto} ({auto_why})")
    print(f"plan: {plan_for(profile, device)} | run: {run_dir(run)}")
    if query.ceilings(run) is None:
        print("no ceilings measured in this run: MFU will read n/a (notebook 00 measures them)")
    return profile, device


def markdown(text: str):
    try:
        from IPython.display import Markdown, display
        display(Markdown(text))
    except ImportError:  # plain Python: print it
        print(text)


def table(rows: list[dict], columns: list[str] | None = None) -> None:
    """A list of dicts as a Markdown table."""
    if not rows:
        markdown("_nothing to show_")
        return
    cols = columns or list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else
                                       (f"{r[c]:,.4g}" if isinstance(r[c], float) else str(r[c])) for c in cols) + " |")
    markdown("\n".join(lines))


def _resolve(obj):
    """A function, class or method, or its dotted name ('hwlib.precision.tf32_mode')."""
    if not isinstance(obj, str):
        return obj
    import importlib
    parts = obj.split(".")
    for i in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            target = getattr(target, attr)
        return target
    raise ValueError(f"show_change: {obj!r} names no importable module; give the object or its dotted name")


def show_source(*code) -> None:
    """The real source of each of ``code`` (a function, class or method, or its dotted name), printed
    with ``inspect.getsource``."""
    for obj in map(_resolve, code):
        src = inspect.getsource(obj)
        where = f"{inspect.getmodule(obj).__name__}.{getattr(obj, '__qualname__', '')}"
        markdown(f"`{where}`:\n\n```python\n{src.rstrip()}\n```")


def show_change(step: str, *code) -> None:
    """The step's settings against the step before, and the real source of the code that applies
    them (each of ``code``: a function, class or method, or its dotted name, printed with
    ``inspect.getsource``)."""
    table(describe(step), ["setting", "before", "after"])
    show_source(*code)


def show_step(step: str, *code) -> None:
    """A step past the recipe as it runs: what it changes against the step it builds on, its folder's
    ``apply.py`` (or the context it runs the session in) and each kernel file its change lives in, whole,
    read from the files that run; then each of ``code`` (as ``show_change`` prints it)."""
    st = get_step(step)
    if st.folder is None:
        raise ValueError(f"show_step: {st.name} is a recipe step (no folder): use show_change")
    table(describe(step), ["setting", "before", "after"])
    apply_py = Path(inspect.getfile(steps)).parent / st.folder / "apply.py"
    markdown(f"`hwlib/steps/{st.folder}/apply.py`:\n\n```python\n{apply_py.read_text().rstrip()}\n```")
    for k in st.kernels:
        lang = "python" if k.endswith(".py") else "cpp"
        markdown(f"`kernels/{k}`:\n\n```{lang}\n{read_kernel_source(k).rstrip()}\n```")
    show_source(*code)


def earlier_curve(res: StepResult, run=None, *, compute: bool = True) -> tuple[str | None, list | None]:
    """The nearest earlier step that ran with ``res``'s config, seed and device, and its check
    curve: this run's saved curve, else (``compute``) its check steps run now, untimed, said aloud."""
    key = record_mod.curve_key(res)
    for name in earlier_steps(res.step):
        curve = query.saved_curve(res.workload, name, key, run)
        if curve is None and compute:
            print(f"  {res.workload}: no saved curve of {name} in this run; running its {res.check_steps} "
                  f"check steps now (untimed) to compare with")
            prev = run_step(res.workload, name, profile=res.profile, device=res.device.get("kind", "cpu"),
                            seed=res.seed, plan=Plan(check=res.check_steps, warmup=0, timed=0), check_only=True,
                            config=res.config)
            curve = prev.check_losses if prev.status == "ok" else None
        if curve is not None:
            return name, curve
    return None, None


def check_math(res: StepResult, run=None) -> MathCheck:
    """``res`` against the nearest earlier step, with the bf16 resolution from this run's saved curves."""
    against, curve = earlier_curve(res, run) if res.status == "ok" else (None, None)
    floor = bound = None
    if res.status == "ok":
        key = record_mod.curve_key(res)
        if needs_bf16_floor(res):
            floor = bf16_floor(query.saved_curve(res.workload, BF16_STEP, key, run),
                               query.saved_curve(res.workload, BF16_BEFORE, key, run))
        if get_step(res.step).bound_from_tf32 and against == BF16_BEFORE:
            bound = bf16_bound(curve, query.saved_curve(res.workload, STEP_NAMES[0], key, run))
    return same_math(res, against, curve, floor, bound)


# Rows of the same-gradients check on a GPU: two fp32 models of the step's widths stepped once each; a
# batch of two keeps them inside a 16 GiB card at the full profile, and every kernel sees its real shapes.
GRAD_CHECK_BATCH = 2


def grad_check(workload: str, step: str, *, profile: str = "auto", device="auto", seed: int = 0,
               config: dict | None = None) -> GradCheck:
    """The same-gradients check of ``step`` against the step it builds on (``hwlib.ladder.gradients``):
    one training step of each in fp32 from the same weights and batch, at this run's profile (on a GPU
    at ``GRAD_CHECK_BATCH`` rows of it); seconds, before the step is timed."""
    dev = resolve_device(device)
    prof = resolve_profile(profile, dev)
    cfg = dict(config or {})
    if dev.type == "cuda":
        cfg.setdefault("batch", GRAD_CHECK_BATCH)
    return same_gradients(workload, step, profile=prof, device=dev.type, seed=seed, config=cfg)


def measure(workload: str, step: str, *, notebook: str, profile: str = "auto", device="auto", run=None,
            seed: int = 0, progress: bool = True, config: dict | None = None) -> tuple[StepResult, MathCheck]:
    """Check ``step``'s gradients against the step before (``grad_check``), run it for ``workload``, check
    its loss curve against the step before, and record all three.
    The check's verdict is recorded before the caller asserts on it, so a failing check still
    leaves its numbers in the run."""
    grads = grad_check(workload, step, profile=profile, device=device, seed=seed, config=config)
    res = run_step(workload, step, profile=profile, device=device, seed=seed, progress=progress, config=config)
    check = check_math(res, run)
    check.grads = grads
    record_mod.record(res, notebook=notebook, check=check, ceilings=query.ceilings(run), run=run)
    results.append([results.make_record(notebook=notebook, workload=res.workload, step=res.step, profile=res.profile,
                                        device=res.device, **grads.record_fields())], run)
    if res.status == "nonfinite":
        warnings.warn(f"{workload} {step}: {res.reason}", stacklevel=2)
    return res, check


def measure_all(workloads: list[str], step: str, *, notebook: str, profile: str = "auto", device="auto",
                run=None, seed: int = 0) -> dict[str, tuple[StepResult, MathCheck]]:
    """``measure`` for each workload, printing each check and notes; asserts nothing, so that every
    workload is recorded before ``assert_same_math`` judges them."""
    out = {}
    for w in workloads:
        res, check = measure(w, step, notebook=notebook, profile=profile, device=device, run=run, seed=seed)
        out[w] = (res, check)
        t = res.timing
        print(f"{w}: {res.status}" + (f" ({res.reason})" if res.reason else "")
              + (f", {t.median_ms:.2f} ms/step (p20 {t.p20_ms:.2f}, p80 {t.p80_ms:.2f})" if t else "") + f" | {check}")
        print(f"  {check.grads}")
        for note in res.notes:
            print(f"  note: {note}")
    return out


def assert_same_math(measured: dict[str, tuple[StepResult, MathCheck]]) -> None:
    """Every workload's step computes the same function as the step before: the same gradients and
    update over one fp32 step (``grad_check``), and the same loss curve within its tolerance:
    each step that ran was compared with an earlier step's curve (only the baseline has none), over
    all its check losses, all finite."""
    assert measured, "nothing measured: give at least one workload"
    failed = [str(chk) for _, chk in measured.values() if not chk.ok]
    assert not failed, "math changed: " + "; ".join(failed)
    grads = [chk.grads for _, chk in measured.values() if chk.grads is not None]
    if grads:
        assert_same_gradients(grads)
    bad = [f"{w}: {r.status}: {r.reason}" for w, (r, _) in measured.items() if r.status not in ("ok", "skipped", "n/a")]
    assert not bad, "; ".join(bad)
    for w, (r, chk) in measured.items():
        if r.status != "ok":
            continue
        assert len(r.check_losses) == r.check_steps and all(math.isfinite(v) for v in r.losses), f"{w}: {r.losses}"
        assert chk.against is not None or previous(r.step) is None, \
            f"{w} {r.step}: no earlier step's curve to compare with, so its math was not checked"


def show_ladder(workload: str, run=None, figure: bool = True, step: str | None = None) -> list[dict]:
    """The cumulative table (and figure) of ``workload`` from this run's results, ``step`` (a ladder
    notebook's own) drawn in its own colour; returns the rows."""
    from .report.tables import caveat_line, ladder_figure, ladder_rows_with_noise, markdown_table, rows_caveat
    rows = ladder_rows_with_noise(query.load(run), workload)
    # read_dir: a committed reference is read where it is committed, and no folder is made for it
    markdown(f"**{workload}**, run `{read_dir(run).name}`\n\n" + caveat_line(rows_caveat(rows)) + markdown_table(rows))
    if figure and any(r["throughput"] for r in rows):
        show_figure(ladder_figure(rows, workload, query.ceilings(run), highlight=step))
    return rows


REFERENCE = "reference/h100"   # what a reader sees before measuring anything (run_or_reference)


def run_or_reference(run=None, reference: str = REFERENCE):
    """``run`` when it has ladder rows; else ``reference`` (a committed run, read where it is
    committed and never written), said in a line: notebook 99 opened on its own shows the lab's
    results rather than failing on an empty run."""
    if query.workloads_in(query.load(run)):
        return run
    if not query.workloads_in(query.load(reference)):
        raise FileNotFoundError(
            f"run {read_dir(run).name!r} has no ladder rows, and the reference {reference!r} is not here "
            f"({read_dir(reference)}): run the ladder notebooks (01-11) into this run first, or open this "
            f"notebook in a clone of the repository, which commits outputs/{reference}")
    markdown(f"_Run `{read_dir(run).name}` has no ladder rows yet, so this notebook shows the committed "
             f"reference `outputs/{reference}` (nothing is written there). Run the ladder notebooks (01-11) into "
             f"this run, or `hwlib reproduce`, and open it again to see your own._")
    return reference


def show_figure(fig, dpi: int = 110) -> None:
    """A figure made outside pyplot (``matplotlib.figure.Figure``) shown as a PNG: IPython renders a
    bare Figure as its text repr unless pyplot's inline integration happens to be loaded, so the
    image is given to it; the same in JupyterLab, an executed copy and a headless run."""
    import io
    from IPython.display import Image, display
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    display(Image(data=buf.getvalue(), format="png"))


# --- the roofline's prediction, and the measurement against it -------------------------------------

def _before(rows: list[dict], step: str) -> dict | None:
    """The nearest row of the steps ``step`` builds on (its chain) with a measured time."""
    by = {r["step"]: r for r in rows if r["throughput"]}
    earlier = [by[s.name] for s in chain(step)[:-1] if s.name in by]
    return earlier[-1] if earlier else None


def predict(step: str, workloads: list[str], profile: str, run=None) -> dict[str, roofline.Prediction]:
    """What the roofline says ``step`` removes for each workload, in FLOPs or bytes, and the time that
    should save at this run's measured ceilings; printed as a table, returned for ``outcome``."""
    ceil = query.ceilings(run)
    recs = query.load(run)
    out = {}
    for w in workloads:
        prev = _before(query.ladder_rows(recs, w), step)
        out[w] = steps.predict(w, step, profile, ceil, prev_ms=prev["ms_per_step"] if prev else None)
    if ceil is None:
        markdown("_No ceilings in this run: the predicted times need notebook 00's ceilings "
                 "(the counts below stand without them)._")
    _say_caveat(recs, profile)
    table([p.to_row() for p in out.values()])
    return out


def _say_caveat(recs: list[dict], profile: str | None = None) -> str | None:
    """Say above a table when this run's times are not meaningful as performance (a CPU, the smoke
    profile); returns the reason."""
    from .report.tables import caveat_line, records_caveat
    why = records_caveat(recs + ([{"profile": profile}] if profile else []))
    if why:
        markdown(caveat_line(why).strip())
    return why


def outcome_rows(predicted: dict[str, roofline.Prediction], run=None) -> list[dict]:
    """Each workload's measured saving (the step before's ms/step minus this step's) beside the
    prediction."""
    recs = query.load(run)
    rows = []
    for w, p in predicted.items():
        lrows = query.ladder_rows(recs, w)
        me = next((r for r in lrows if r["step"] == p.step), None)
        prev = _before(lrows, p.step)
        saved = prev["ms_per_step"] - me["ms_per_step"] if (me and prev and me["ms_per_step"] is not None) else None
        rows.append({"workload": w, "kind": p.kind, "against": prev["step"] if prev else None,
                     "predicted saving (ms)": p.saved_ms, "measured saving (ms)": saved,
                     "measured / predicted": saved / p.saved_ms if (saved is not None and p.saved_ms) else None,
                     "status": me["status"] if me else "not measured"})
    return rows


def outcome(predicted: dict[str, roofline.Prediction], run=None) -> list[dict]:
    """``outcome_rows`` as a table; returns the rows."""
    rows = outcome_rows(predicted, run)
    _say_caveat(query.load(run))
    table(rows)
    return rows


def prediction_prose(p: roofline.Prediction, row: dict | None) -> str:
    """One sentence: the prediction against the measurement, from the numbers."""
    if p.kind == "n/a":
        return ""
    if p.saved_ms is None:
        return f"The roofline predicted no time for this change ({p.missing or p.basis})."
    saved = row and row.get("measured saving (ms)")
    said = (f"The roofline {'allowed at most' if p.kind == 'bound' else 'predicted'} {p.saved_ms:.3g} ms "
            f"saved per step ({p.basis})")
    if saved is None:
        return said + "; nothing was measured to compare with."
    moved = f"saved {saved:.3g} ms" if saved >= 0 else f"was slower by {-saved:.3g} ms"
    return said + f"; the measured step {moved} against {row['against']}."


def what_we_saw(workload: str, step: str | None = None, run=None, predicted: dict | None = None) -> str:
    """This notebook's own ``step``, in words built from the measured numbers (with the roofline's
    prediction beside it when ``predicted`` is given); the whole ladder when ``step`` is None."""
    from .report.tables import ladder_rows_with_noise, step_prose, what_we_saw as ladder_prose
    rows = ladder_rows_with_noise(query.load(run), workload)
    if step is None:
        text = ladder_prose(rows, workload)
    else:
        text = step_prose(rows, workload, get_step(step).name)
        if predicted and workload in predicted:
            p = predicted[workload]
            text = (text + " " + prediction_prose(p, outcome_rows({workload: p}, run)[0])).strip()
    markdown("**What we saw.** " + text)
    return text


# --- side measurements and ceilings, recorded by the conventions (x-values in fields) --------------

def record_value(metric: str, value, unit: str, *, notebook: str, workload: str | None, step: str | None,
                 fields: dict, profile: str, run=None, params: dict | None = None, device="auto",
                 p20=None, p80=None) -> dict:
    """Record one side measurement; its x-values go in ``fields``, never in the metric's name."""
    rec = results.make_record(notebook=notebook, workload=workload, step=step, metric=metric, value=value,
                              p20=p20, p80=p80, unit=unit, profile=profile, fields=fields, params=params,
                              device=device)
    results.append(rec, run)
    return rec


def record_time(timing, *, metric: str, **kw) -> dict:
    """``record_value`` of a time: a ``bench.Timing``, or a row with ``ms``, ``p20_ms`` and ``p80_ms``."""
    med, p20, p80 = ((timing.median_ms, timing.p20_ms, timing.p80_ms) if hasattr(timing, "median_ms")
                     else (timing["ms"], timing["p20_ms"], timing["p80_ms"]))
    return record_value(metric, med, "ms", p20=p20, p80=p80, **kw)


def record_ceilings(ceil: dict, *, notebook: str, profile: str, run=None) -> list[dict]:
    """``copy_gbps`` and ``matmul_tflops`` (fields {"dtype"}) of measured ceilings, appended to the run."""
    dev = ceil.get("kind", "auto")
    recs = [results.make_record(notebook=notebook, workload=None, step=None, metric="copy_gbps",
                                value=ceil["copy_gbps"], unit="GB/s", profile=profile, device=dev,
                                params={"bytes": ceil.get("copy_bytes")})]
    for dt in ceilings.MATMUL_DTYPES:
        v, why = ceil["matmul_tflops"].get(dt), ceil.get("skipped", {}).get(dt)
        recs.append(results.make_record(notebook=notebook, workload=None, step=None, metric="matmul_tflops",
                                        value=v, unit="TFLOP/s", profile=profile, device=dev,
                                        fields={"dtype": dt}, status="ok" if v is not None else "skipped",
                                        reason=why, params={"n": ceil.get("matmul_n")}))
    results.append(recs, run)
    return recs


def show_ceilings(ceil: dict, device: str = "auto") -> list[dict]:
    """Measured ceilings beside the datasheet figures of this device, as a table and a figure."""
    di = info(device)
    sheet = datasheet(di)
    rows = [{"ceiling": "device copy", "measured": ceil["copy_gbps"], "datasheet": sheet and sheet["copy_gbps"],
             "unit": "GB/s"}]
    for dt in ceilings.MATMUL_DTYPES:
        if dt not in ceil["matmul_tflops"] and dt not in ceil.get("skipped", {}):
            continue    # ceilings measured before this dtype was
        rows.append({"ceiling": f"matmul {dt}", "measured": ceil["matmul_tflops"].get(dt),
                     "datasheet": sheet and sheet["matmul_tflops"].get(dt), "unit": "TFLOP/s"})
    for r in rows:
        r["measured / datasheet"] = r["measured"] / r["datasheet"] if (r["measured"] and r["datasheet"]) else None
    table(rows, ["ceiling", "measured", "datasheet", "measured / datasheet", "unit"])
    print("datasheet source:", sheet["source"] if sheet else f"none on file for {di.name}")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
    for a, part, unit in ((ax[0], [r for r in rows[1:] if r["measured"]], "TFLOP/s"), (ax[1], rows[:1], "GB/s")):
        a.bar([r["ceiling"] for r in part], [r["measured"] for r in part], label="measured")
        if sheet:
            a.scatter([r["ceiling"] for r in part], [r["datasheet"] or 0 for r in part], color="k", marker="_",
                      s=400, label="datasheet (dense)")
        a.set_ylabel(unit)
        a.legend()
    ax[0].set_title(f"matmul, {di.name}", fontsize=10)
    ax[1].set_title("memory", fontsize=10)
    fig.tight_layout()
    plt.show()
    return rows


def ceilings_prose(ceil: dict, device: str = "auto") -> str:
    """What notebook 00 saw, from the measured ceilings."""
    di = info(device)
    sheet = datasheet(di)
    mm = ceil["matmul_tflops"]
    text = (f"{di.name}: the measured device copy reached {ceil['copy_gbps']:,.0f} GB/s"
            + (f" ({ceil['copy_gbps'] / sheet['copy_gbps']:.0%} of the datasheet figure)" if sheet else "")
            + "; matmul " + ", ".join(f"{dt} {v:,.1f} TFLOP/s" for dt, v in mm.items())
            + (f". bf16 runs {mm['bf16'] / mm['fp32']:.1f}x fp32 on this device" if mm.get("bf16") and mm.get("fp32")
               else "")
            + ". MFU in every later notebook is model TFLOP/s over the measured 16-bit figure; the roofline "
              "predictions divide by these ceilings.")
    markdown("**What we saw.** " + text)
    return text
