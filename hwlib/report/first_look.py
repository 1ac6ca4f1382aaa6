"""``hwlib first-look``: which notebooks it runs, and what it says at the end.

The first look runs the environment and its ceilings (00), the standard recipe's last step (09), the
fastest exact step past it (25), where the time of those two goes (16, profiling only them) and the
tables (99), GPT-2 only. Its summary is the headline of the run (GPT-2 at the two steps, ms/step and
tokens/s, and their ratio), where its figure and tables are, and the ratio of each step's tokens/s to
the committed reference run of the same GPU and profile, where one exists. Everything is read from
the run's records; on a CPU or in the smoke profile the summary says that its numbers are not
meaningful as performance.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import query
from ..paths import REPO_ROOT, read_dir
from .tables import NOT_MEANINGFUL, ladder_rows_with_noise, rows_caveat

ONLY = "00,09,25,16,99"
SETS = ("16.steps=[09_cuda_graphs, 25_bias_column]",)
WORKLOAD = "gpt"   # 09 measures every workload by default: the first look asks for GPT-2's only
RECIPE, PAST = "09_cuda_graphs", "25_bias_column"
STEPS = ((RECIPE, "the standard recipe"), (PAST, "past the recipe"))


def _show(path: Path) -> str:
    """A path as a reader would type it: relative to the working folder where it lies inside it."""
    path = Path(path).resolve()
    cwd = Path.cwd().resolve()
    return os.path.relpath(path, cwd) if cwd in path.parents else str(path)


def headline(run) -> dict:
    """GPT-2 at the recipe's step and at the step past it in ``run``: each step's row (None where the run
    has none), the tokens/s of the second over the first (None unless both are ok), the device, its
    kind and the profile the rows were measured with, and why they are not meaningful (None when they are)."""
    rows = {r["step"]: r for r in ladder_rows_with_noise(query.load(run), WORKLOAD)}
    mine = {s: rows.get(s) for s, _ in STEPS}
    ok = {s: r for s, r in mine.items() if r and r["status"] == "ok" and r.get("throughput")}
    ratio = ok[PAST]["throughput"] / ok[RECIPE]["throughput"] if len(ok) == 2 else None
    any_row = next((r for r in mine.values() if r), None) or {}
    return {"rows": mine, "ratio": ratio, "device": any_row.get("device"), "device_kind": any_row.get("device_kind"),
            "profile": any_row.get("profile"), "caveat": rows_caveat([r for r in mine.values() if r])}


def reference_for(device: str | None, profile: str | None, runs: list | None = None,
                  exclude: Path | None = None):
    """The committed reference run measured on ``device`` in ``profile`` with both steps ok: a first look
    (a run named '...first-look') before any other; None where there is none. ``exclude``: the run being
    summarised, never its own reference."""
    if not device or not profile:
        return None
    found = []
    for run in query.reference_runs() if runs is None else runs:
        if exclude is not None and read_dir(run) == Path(exclude).resolve():
            continue
        h = headline(run)
        if h["device"] == device and h["profile"] == profile and h["ratio"] is not None:
            found.append(run)
    found.sort(key=lambda r: (not str(r).rstrip("/").endswith("first-look"), str(r)))
    return found[0] if found else None


def _step_line(step: str, what: str, row: dict | None, run_folder: Path) -> str:
    head = f"  {WORKLOAD} at {step} ({what}): "
    if row is None:
        return head + f"not measured (its log: {_show(run_folder / 'executed')}/)"
    if row["status"] != "ok" or not row.get("throughput"):
        return head + f"{row['status']}" + (f": {row['reason']}" if row.get("reason") else "")
    return head + f"{row['ms_per_step']:.1f} ms/step, {row['throughput']:,.0f} {row['unit']}"


def summary_text(run, references: list[str] | None = None) -> str:
    """What ``hwlib first-look`` prints when its notebooks are done (module doc)."""
    folder = read_dir(run)
    h = headline(run)
    lines = [f"First look: {h['device'] or 'no GPT-2 step measured'}"
             + (f", {h['profile']} profile" if h["profile"] else "") + f", run {_show(folder)}"]
    if h["device_kind"] == "cpu" or h["caveat"]:
        lines.append(f"  Not meaningful as performance: {h['caveat'] or NOT_MEANINGFUL['cpu']}.")
    for step, what in STEPS:
        lines.append(_step_line(step, what, h["rows"][step], folder))
    if h["ratio"] is not None:
        lines.append(f"  {PAST} over {RECIPE}: {h['ratio']:.2f}x the tokens/s")
    fig = folder / "figures" / f"{WORKLOAD}_ladder.png"
    tables = [folder / "tables" / n for n in (f"{WORKLOAD}_ladder.md", "claims.md")]
    lines.append(f"  figure: {_show(fig)}" if fig.is_file() else "  figure: none drawn (no step measured)")
    lines.append("  tables: " + (", ".join(_show(t) for t in tables if t.is_file()) or "none written"))
    lines.append(f"  executed notebooks: {_show(folder / 'executed')}/ (16_where_time_goes: where the time goes)")
    ref = reference_for(h["device"], h["profile"], references, exclude=folder)
    if ref is None:
        lines.append(f"  no reference for {h['device'] or '?'}/{h['profile'] or '?'}: the committed references "
                     f"({', '.join(r.split('/')[-1] for r in query.reference_runs()) or 'none'}) were measured "
                     f"on other machines or profiles")
        return "\n".join(lines)
    r = headline(ref)
    where = os.path.relpath(read_dir(ref), REPO_ROOT) if REPO_ROOT in read_dir(ref).parents else str(read_dir(ref))
    parts = [f"{s} {h['rows'][s]['throughput'] / r['rows'][s]['throughput']:.2f}x" for s, _ in STEPS
             if h["rows"][s] and h["rows"][s]["status"] == "ok" and h["rows"][s].get("throughput")]
    lines.append(f"  against the reference {where} ({r['device']}, {r['profile']}): "
                 + (", ".join(parts) + " its tokens/s" if parts else "no step of this run to compare"))
    return "\n".join(lines)
