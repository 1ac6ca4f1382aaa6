"""What every notebook does around its measurement, as one library call per cell.

``setup`` resolves the parameters and prints the environment; ``show_change`` prints the real code
that applies a step; ``measure`` runs a ladder step for each workload, checks its math against the
step before and records it; ``show_ladder`` and ``what_we_saw`` turn the run's results into the
table, the figure and the prose. The notebooks stay thin and identical in shape.
"""

from __future__ import annotations

import inspect
import warnings

from . import query
from .device import format_env_report, resolve_device
from .ladder import record as record_mod
from .ladder.run import StepResult, run_step
from .ladder.same_math import MathCheck, bf16_floor, earlier_steps, needs_bf16_floor, same_math
from .paths import run_dir
from .profiles import Plan, plan as plan_for, resolve_profile
from .steps import describe, get_step


def resolve(profile: str = "auto", device: str = "auto") -> tuple[str, str]:
    """The notebook's parameters after ``HWLIB_PROFILE`` and 'auto' are applied: (profile, device)."""
    dev = resolve_device(device)
    return resolve_profile(profile, dev), dev.type


def setup(profile: str = "auto", device: str = "auto", run=None) -> tuple[str, str]:
    """Resolve the parameters, print the environment report and the plan; returns (profile, device)."""
    profile, device = resolve(profile, device)
    print(format_env_report(device))
    print(f"profile: {profile} | plan: {plan_for(profile)} | run: {run_dir(run)}")
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


def show_change(step: str, *code) -> None:
    """The step's settings against the step before, and the real source of the code that applies
    them (each object in ``code``: a function, class or method, printed with ``inspect.getsource``)."""
    table(describe(step), ["setting", "before", "after"])
    for obj in code:
        src = inspect.getsource(obj)
        where = f"{inspect.getmodule(obj).__name__}.{getattr(obj, '__qualname__', '')}"
        markdown(f"`{where}`:\n\n```python\n{src.rstrip()}\n```")


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
    floor = None
    if res.status == "ok" and needs_bf16_floor(res):
        key = record_mod.curve_key(res)
        floor = bf16_floor(query.saved_curve(res.workload, "03_bf16_autocast", key, run),
                           query.saved_curve(res.workload, "02_tf32", key, run))
    return same_math(res, against, curve, floor)


def measure(workload: str, step: str, *, notebook: str, profile: str = "auto", device="auto", run=None,
            seed: int = 0, progress: bool = True, config: dict | None = None) -> tuple[StepResult, MathCheck]:
    """Run ``step`` for ``workload``, check its math against the step before, record both.
    The check's verdict is recorded before the caller asserts on it, so a failing check still
    leaves its numbers in the run."""
    res = run_step(workload, step, profile=profile, device=device, seed=seed, progress=progress, config=config)
    check = check_math(res, run)
    record_mod.record(res, notebook=notebook, check=check, ceilings=query.ceilings(run), run=run)
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
        print(f"{w}: {res.status}" + (f" ({res.reason})" if res.reason else "") + f" | {check}")
        for note in res.notes:
            print(f"  note: {note}")
    return out


def assert_same_math(measured: dict[str, tuple[StepResult, MathCheck]]) -> None:
    """Every workload's step computes the same function as the step before (within its tolerance)."""
    failed = [str(chk) for _, chk in measured.values() if not chk.ok]
    assert not failed, "math changed: " + "; ".join(failed)
    bad = [f"{w}: {r.reason}" for w, (r, _) in measured.items() if r.status == "nonfinite"]
    assert not bad, "non-finite loss: " + "; ".join(bad)


def show_ladder(workload: str, run=None, figure: bool = True) -> list[dict]:
    """The cumulative table (and figure) of ``workload`` from this run's results; returns the rows."""
    from .report.tables import ladder_figure, markdown_table
    rows = query.ladder_rows(query.load(run), workload)
    markdown(f"**{workload}**, run `{run_dir(run).name}`\n\n" + markdown_table(rows))
    if figure and any(r["throughput"] for r in rows):
        import matplotlib.pyplot as plt
        ladder_figure(rows, workload, query.ceilings(run))
        plt.show()
    return rows


def what_we_saw(workload: str, step: str, run=None) -> str:
    """This notebook's own step, in words built from the measured numbers."""
    from .report.tables import step_prose
    text = step_prose(query.ladder_rows(query.load(run), workload), workload, get_step(step).name)
    markdown("**What we saw.** " + text)
    return text
