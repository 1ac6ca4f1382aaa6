"""Tables, figures, summary.json and prose, all derived from a run's results; nothing typed.

``hwlib.query.ladder_rows`` turns the records of one workload into the cumulative rows (one per
step, speed-ups against step 01 and against the step before); this module formats them. ``write_all`` rebuilds every table and
figure of a run plus ``summary.json``; the blocks that ``report.pages`` puts between their markers in
README.md and docs/results.md (the reference tables, the seeds' claims tables) are made here. A ladder step that differs from the step before by less than
the spread measured across fresh processes (notebook 19, ``studies.process_noise``) reads "within noise".
"""

from __future__ import annotations

import json
import math
import os
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

from .. import noise, results, source
from ..paths import REPO_ROOT, run_dir
from ..query import _num, ladder_rows, reference_runs, step_metrics, workloads_in
from ..series import order_names
from ..steps.retired import RETIRED, RETIRED_NAMES
from ..workloads.polychromic import fused_decode
from . import recipe
from .. import query
from . import claims

STEP_METRICS = ("ms_per_step", "tokens_per_s", "model_tflops", "mfu", "peak_mem_gib", "final_loss",
                "compile_s", "first_step_s", "same_math_max_rel", "sdpa_backend")
README_START, README_END = "<!-- reference-table:start -->", "<!-- reference-table:end -->"
# The seeds' claims stand in a section of their own, after the notebooks' guide (optional in a README).
CLAIMS_START, CLAIMS_END = "<!-- claims-table:start -->", "<!-- claims-table:end -->"
SMALL_START, SMALL_END = "<!-- small-gpu:start -->", "<!-- small-gpu:end -->"
FIRST_START, FIRST_END = "<!-- first-look:start -->", "<!-- first-look:end -->"
RETIRED_START, RETIRED_END = "<!-- retired-steps:start -->", "<!-- retired-steps:end -->"
# ``make first-look`` from cold caches, one run per GPU it was measured on (the reference H100 first).
FIRST_LOOK_RUNS = ("reference/h100-first-look", "reference/h200-first-look")


def repo_url(path: str) -> str:
    """A file of the repository as a page on its host, at the ref the notebooks install: absolute, since
    the README is also the package's long description, read where a relative link leads nowhere."""
    return f"{source.REPOSITORY}/blob/{source.NOTEBOOK_REF}/{path}"


def raw_url(path: str) -> str:
    """A file of the repository as its bytes (an image that a page outside the repository can show)."""
    raw = source.REPOSITORY.replace("https://github.com/", "https://raw.githubusercontent.com/", 1)
    return f"{raw}/{source.NOTEBOOK_REF}/{path}"


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, str):
        return v
    return format(v, spec)


def md_cell(v) -> str:
    """``v`` as the text of one Markdown table cell: a ``|`` would end the cell and a line break the
    row (a reason or a parameter holding one would break every table after it)."""
    return " ".join(str(v).split("\n")).replace("\r", " ").replace("|", "\\|")


TABLE_COLUMNS = [  # (header, key, format)
    ("step", "step", ""), ("status", "status", ""), ("ms/step (p20-p80)", None, ""),
    ("{unit}", "throughput", ",.0f"), ("x vs {base}", "speedup_vs_baseline", ".2f"),
    ("x vs prev", "speedup_vs_prev", ".2f"), ("TFLOP/s", "model_tflops", ".1f"), ("MFU", "mfu", ".1%"),
    ("peak GiB", "peak_mem_gib", ".2f"), ("same math (max rel / tol)", None, ""),
    ("final loss", "final_loss", ".4f"),
]


def markdown_table(rows: list[dict]) -> str:
    """The ladder as a Markdown table; skipped steps show their reason."""
    if not rows:
        return "_no measurements yet_\n"
    unit = rows[0].get("unit", "items/s")
    # the speed-up column names the step it is taken against: the first one measured in this run
    base = next((r["base_step"][:2] for r in rows if r.get("base_step")), "01")
    heads = [h.format(unit=unit, base=base) for h, _, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
    for r in rows:
        cells = []
        for h, key, spec in TABLE_COLUMNS:
            if h.startswith("ms/step"):
                cells.append(f"{_fmt(r['ms_per_step'], '.1f')} ({_fmt(r['ms_p20'], '.1f')}-{_fmt(r['ms_p80'], '.1f')})"
                             if r["ms_per_step"] is not None else "-")
            elif h.startswith("same math"):
                cells.append(f"{_fmt(r['same_math_max_rel'], '.1e')} / {r['same_math_tol']}"
                             if r["same_math_max_rel"] is not None else "-")
            elif key == "status" and r["status"] != "ok" and r.get("reason"):
                cells.append(f"{r['status']}: {r['reason']}")
            elif key == "speedup_vs_prev" and r.get("within_noise"):
                cells.append(f"{_fmt(r.get(key), spec)} (within noise)")
            else:
                cells.append(_fmt(r.get(key), spec))
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n" + noise_note(rows)


# --- noise across processes (notebook 19's process_spread records) --------------------------------

def process_spreads(recs: list[dict], workload: str) -> dict[str, dict]:
    """``workload``'s measured spread across fresh processes per ladder step, the newest of each
    (``studies.process_noise``): {step: {"spread", "processes", "lo", "hi"}}; only what ran ok."""
    out: dict[str, dict] = {}
    found = [r for r in recs if r.get("metric") == "process_spread" and r.get("workload") == workload
             and r.get("status", "ok") == "ok" and _num(r.get("value")) is not None]
    for r in sorted(found, key=lambda r: str(r.get("time") or "")):
        iv = (r.get("params") or {}).get("interval") or {}
        out[r["step"]] = {"spread": _num(r["value"]), "processes": (r.get("fields") or {}).get("processes"),
                          "lo": _num(iv.get("lo")), "hi": _num(iv.get("hi")),
                          "time": r.get("time"), "code_digest": r.get("code_digest")}
    return out


def describes(spread: dict | None, row: dict) -> bool:
    """Whether a step's measured spread still describes its ladder row: measured on the same code, or
    after the row was timed. A spread from other code, older than the row, is of a step that has
    changed since (a rerun after a code change): it says nothing about this row."""
    if not spread:
        return False
    same_code = spread.get("code_digest") is not None and spread.get("code_digest") == row.get("code_digest")
    after = not row.get("measured_at") or str(spread.get("time") or "") >= str(row["measured_at"])
    return same_code or after


def mark_within_noise(rows: list[dict], spreads: dict[str, dict]) -> list[dict]:
    """Copies of ladder ``rows`` with ``process_spread`` (the step's own, None when not measured or
    when it no longer ``describes`` the row),
    ``noise_spread`` (the larger spread measured for the step or the timed step before it) and
    ``within_noise``: True when the step's speed-up over the step before, either way, is smaller
    than that spread; False when larger; None when neither step's spread was measured (nothing
    is said where nothing was measured)."""
    by_step = {r["step"]: r for r in rows}
    spreads = {s: v for s, v in spreads.items() if s in by_step and describes(v, by_step[s])}
    out = []
    for r in rows:
        r = dict(r)
        own = spreads.get(r["step"])
        r["process_spread"] = own["spread"] if own else None
        r["noise_spread"] = r["within_noise"] = None
        x, prev = r.get("speedup_vs_prev"), r.get("prev_step")   # the step it was taken against
        if r.get("throughput") and prev is not None and x:
            known = [s["spread"] for s in (spreads.get(prev), own) if s]
            r["noise_spread"] = max(known) if known else None
            r["within_noise"] = noise.within_spread(x, known)
        out.append(r)
    return out


def ladder_rows_with_noise(recs: list[dict], workload: str) -> list[dict]:
    """``query.ladder_rows`` marked by the run's measured spread across processes (``mark_within_noise``),
    each with the kind of device its time was measured on (``device_kind``: "cuda" or "cpu")."""
    kinds = {r.get("step"): (r.get("device") or {}).get("kind") for r in recs
             if r.get("workload") == workload and r.get("metric") == "ms_per_step"}
    rows = mark_within_noise(ladder_rows(recs, workload), process_spreads(recs, workload))
    for r in rows:
        r["device_kind"] = kinds.get(r["step"])
    return rows


# --- retired steps (hwlib.steps.retired) ------------------------------------------------------------

def retired_rows(recs: list[dict]) -> list[dict]:
    """One row per retired step and workload that a run's records measured (the ladder tables leave them
    out: ``ladder_rows`` reads the ladder only): its ms/step and throughput, the step it built on as the
    ladder has it, the ratio of their throughputs, and each one's spread across processes where notebook
    19 measured one that still ``describes`` its row; ``within_noise`` as ``mark_within_noise`` says it."""
    out = []
    for ret in RETIRED:
        for w in ret.workloads:
            own = step_metrics(recs, w, (ret.name,)).get(ret.name, {})
            ms = own.get("ms_per_step")
            thr = next((v for k, v in own.items() if k.endswith("_per_s")), None)
            before = next((x for x in ladder_rows(recs, w) if x["step"] == ret.after), None)
            if ms is None or thr is None or before is None or not before.get("throughput") \
                    or ms.get("status", "ok") != "ok" or _num(thr.get("value")) is None:
                continue
            row = {"step": ret.name, "throughput": _num(thr["value"]), "prev_step": ret.after,
                   "speedup_vs_prev": _num(thr["value"]) / before["throughput"],
                   "measured_at": ms.get("time"), "code_digest": ms.get("code_digest")}
            spreads = process_spreads(recs, w)
            before_m, row_m = mark_within_noise([before, row], spreads)
            out.append({"step": ret.name, "workload": w, "title": ret.title, "why": ret.why, "toggle": ret.toggle,
                        "after": ret.after, "ms_per_step": _num(ms.get("value")), "ms_p20": _num(ms.get("p20")),
                        "ms_p80": _num(ms.get("p80")), "throughput": row["throughput"], "unit": thr.get("unit"),
                        "after_ms": before["ms_per_step"], "after_p20": before["ms_p20"],
                        "after_p80": before["ms_p80"], "after_throughput": before["throughput"],
                        "speedup_vs_after": row["speedup_vs_prev"], "within_noise": row_m["within_noise"],
                        "spread": spreads.get(ret.name) if row_m["process_spread"] is not None else None,
                        "after_spread": spreads.get(ret.after) if before_m["process_spread"] is not None else None,
                        "device": (ms.get("device") or {}).get("name"), "profile": ms.get("profile")})
    return out


def _spread_words(step: str, sp: dict | None) -> str | None:
    if not sp:
        return None
    iv = f" ({sp['lo']:.3f}-{sp['hi']:.3f})" if sp.get("lo") is not None and sp.get("hi") is not None else ""
    return f"{step[:2]}: {sp['spread']:.3f}x{iv}"


def retired_block(run) -> str:
    """The README's "Retired steps": each step taken off the ladder against the step it built on, from the
    run's records (``retired_rows``), and why it left; a retired step the run never measured says so."""
    recs = query.load(run)
    rows = {(r["step"], r["workload"]): r for r in retired_rows(recs)}
    where = Path(os.path.relpath(run_dir(run), REPO_ROOT)).as_posix()
    lines = ["A step stays on a workload's ladder while its gain over the step it builds on lies outside the spread "
             "measured across fresh processes on the reference GPU (notebook 19); one inside it leaves the ladder, "
             "its folder and notebook with it, and becomes a toggle of notebook 19, measured there with its own "
             f"interval. Figures from `{where}/results.jsonl`; the spreads are slowest over fastest process, with "
             "their interval.", "",
             "| retired step | workload | ms/step (p20-p80) | built on: ms/step (p20-p80) | x vs it | "
             "spread across processes | measured now by |", "|---|---|---|---|---|---|---|"]
    whys = []
    for ret in RETIRED:
        for w in ret.workloads:
            r = rows.get((ret.name, w))
            now = f"notebook 19, toggle `{ret.toggle}` on {ret.after}"
            if r is None:
                lines.append(f"| {ret.name} | {w} | not measured in this run | {ret.after} | - | - | {now} |")
                continue
            x = f"{r['speedup_vs_after']:.3f}" + {True: " (within noise)", False: " (outside the noise)"}.get(
                r["within_noise"], "")
            spreads = "; ".join(filter(None, (_spread_words(ret.name, r["spread"]),
                                              _spread_words(ret.after, r["after_spread"])))) or "not measured"
            lines.append(f"| {ret.name} | {w} | {_fmt(r['ms_per_step'], '.1f')} ({_fmt(r['ms_p20'], '.1f')}-"
                         f"{_fmt(r['ms_p80'], '.1f')}) on {r['device']} ({r['profile']}) | {ret.after}: "
                         f"{_fmt(r['after_ms'], '.1f')} ({_fmt(r['after_p20'], '.1f')}-{_fmt(r['after_p80'], '.1f')}) | "
                         f"{x} | {spreads} | {now} |")
        whys.append(f"- **{ret.name}**: {ret.title}. Retired: its gain over {ret.after} measured within the noise "
                    f"above, and {ret.why}.")
    return "\n".join(lines + [""] + whys)


# --- what a CPU or smoke run's numbers are worth ---------------------------------------------------

NOT_MEANINGFUL = {
    "cpu": "measured on a CPU: these times and ratios show that the code runs, not what it buys on a GPU",
    "smoke": "smoke profile: sizes made to check the code path in seconds, too small for their times and "
             "ratios to mean anything",
}


def _caveat(kinds, profiles) -> str | None:
    """Why times from these device kinds and profiles are not meaningful as performance; None when they are."""
    why = [NOT_MEANINGFUL[k] for k, seen in (("cpu", "cpu" in kinds), ("smoke", "smoke" in profiles)) if seen]
    return "; ".join(why) or None


def rows_caveat(rows: list[dict]) -> str | None:
    """``_caveat`` of the measured rows of a ladder (``ladder_rows_with_noise``)."""
    timed = [r for r in rows if r.get("throughput")]
    return _caveat({r.get("device_kind") for r in timed}, {r.get("profile") for r in timed})


def records_caveat(recs: list[dict]) -> str | None:
    """``_caveat`` of a run's records (every record with a device or a profile)."""
    return _caveat({(r.get("device") or {}).get("kind") for r in recs}, {r.get("profile") for r in recs})


def caveat_line(caveat: str | None) -> str:
    """The line that goes above a table or prose from such a run: empty when its numbers mean something."""
    return f"**Not meaningful as performance**: {caveat}.\n\n" if caveat else ""


def noise_note(rows: list[dict]) -> str:
    """The line under a ladder table that says which steps' spread across processes was measured
    and what "within noise" means; empty when none was."""
    measured = [r for r in rows if r.get("process_spread") is not None]
    if not measured:
        return ""
    return ("\nSpread of the median ms/step across fresh processes (notebook 19, slowest over fastest): "
            + ", ".join(f"{r['step']} {r['process_spread']:.3f}x" for r in measured)
            + ". \"within noise\": the step differs from the step before by less than the spread measured "
              "for either of the two.\n")


def csv_table(rows: list[dict]) -> str:
    import csv
    import io
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


def _short(step: str) -> str:
    num, _, name = step.partition("_")
    return f"{num} {name.replace('_', ' ')}"


HIGHLIGHT = "#dd8452"     # the notebook's own step
FP8_HATCH = "//"


def _branch_labels(steps: list[str]) -> list[str]:
    """Each step's short name, and "on NN" where it builds on a step other than the bar before it."""
    from ..steps.ladder import LADDER
    after = {s.name: s.after for s in LADDER}
    out = []
    for i, st in enumerate(steps):
        a = after.get(st)
        on = f" (on {a.split('_')[0]})" if a and i and steps[i - 1] != a else ""
        out.append(_short(st) + on)
    return out


def _bold_highlight(ax, ok: list[dict], highlight: str | None) -> None:
    for lab, r in zip(ax.get_xticklabels(), ok):
        if r["step"] == highlight:
            lab.set_fontweight("bold")


def ladder_figure(rows: list[dict], workload: str, ceilings: dict | None = None, path=None,
                  highlight: str | None = None):
    """Left: throughput per step (median, p20-p80 whiskers), speed-up over the first step on each bar.
    Right: time per step split into the speed-of-light floor (the step's model FLOPs at the measured
    16-bit matmul ceiling) and the gap above it, with the gap as a multiple of the floor: where the
    bars say how fast, this says how far from the limit. Without ceilings the right panel says so.
    Returns the matplotlib figure; saved when ``path`` is given. The figure is made with the
    object-oriented API (``matplotlib.figure.Figure``), outside pyplot: it draws and saves without a
    display, leaves the kernel's backend as it was, and is never shown twice (``notebook.show_figure``
    shows it). ``highlight``: a step drawn in its own colour (a ladder notebook's own step). A step
    that builds on another than the bar before it names that one under its label ("on 25"), and the
    FP8 steps, a branch of other math, are hatched."""
    from matplotlib.figure import Figure
    from ..steps.ladder import uses_fp8
    ok = [r for r in rows if r["throughput"]]
    fig = Figure(figsize=(13, 4.6))
    ax, ax2 = fig.subplots(1, 2)
    labels = _branch_labels([r["step"] for r in ok])
    vals = [r["throughput"] for r in ok]
    unit = ok[0]["unit"] if ok else "items/s"
    err = [[max(0.0, v - r["ms_per_step"] / r["ms_p80"] * v) for v, r in zip(vals, ok)],
           [max(0.0, r["ms_per_step"] / r["ms_p20"] * v - v) for v, r in zip(vals, ok)]]
    colors = [HIGHLIGHT if r["step"] == highlight else "#4c72b0" for r in ok]
    bars = ax.bar(range(len(ok)), vals, yerr=err, capsize=3, color=colors,
                  hatch=[FP8_HATCH if uses_fp8(r["step"]) else None for r in ok])
    for b, r in zip(bars, ok):
        ax.annotate(f"{r['speedup_vs_baseline']:.1f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(ok)), labels, rotation=35, ha="right", fontsize=8)
    _bold_highlight(ax, ok, highlight)
    if any(uses_fp8(r["step"]) for r in ok):
        from matplotlib.patches import Patch
        ax.legend(handles=[Patch(facecolor="#4c72b0", hatch=FP8_HATCH, label="FP8: a branch of other math")],
                  fontsize=8, loc="upper left")
    ax.set_ylabel(unit)
    dev = ok[0]["device"] if ok else ""
    ax.set_title(f"{workload}: throughput per step ({dev}, {ok[0]['profile'] if ok else ''})", fontsize=10)
    caveat = rows_caveat(ok)
    if caveat:   # said on the figure itself: a PNG travels without its table
        fig.suptitle(f"Not meaningful as performance: {caveat}", fontsize=9, color="#b35900", wrap=True)
    peak = max(((ceilings or {}).get("matmul_tflops") or {}).get(p) or 0 for p in ("bf16", "fp16")) or None
    ms = [r["ms_per_step"] for r in ok]
    floor = [r["model_tflops"] * r["ms_per_step"] / peak if (peak and r["model_tflops"]) else None for r in ok]
    # A floor needs a GPU's positive ceiling; a step measured below its own floor means the ceiling
    # is wrong (a CPU's, a smoke size's), and a multiple of it would say nothing.
    no_floor = ("a CPU run: its matmul ceiling is no GPU's speed of light" if any(r.get("device_kind") == "cpu" for r in ok)
                else "no 16-bit matmul ceiling in this run" if not peak
                else "a step has no model FLOPs" if any(f is None for f in floor)
                else "a step measured below its floor: the ceiling is too low" if any(m < f for m, f in zip(ms, floor))
                else None)
    if no_floor is None:
        ax2.bar(range(len(ok)), floor, color="#55a868", label=f"floor: model FLOPs at {peak:.3g} TFLOP/s")
        ax2.bar(range(len(ok)), [m - f for m, f in zip(ms, floor)], bottom=floor, alpha=0.7,
                color=[HIGHLIGHT if r["step"] == highlight else "#c44e52" for r in ok],
                label="time above the floor")
        for i, (m, f) in enumerate(zip(ms, floor)):
            ax2.annotate(f"{m / f:.1f}x", (i, m), ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                         textcoords="offset points")
        ax2.set_yscale("log")
        # A bar from 0 has no bottom on a log axis: without a limit below the lowest floor, the axis
        # starts above it and the floor's bars are not drawn at all.
        ax2.set_ylim(min(floor) / 2, max(ms) * 2)
        ax2.legend(fontsize=8, loc="upper right")
        ax2.set_title("ms per step against the speed-of-light floor (x: times the floor)", fontsize=10)
    else:
        ax2.bar(range(len(ok)), ms, color="#8c8c8c")
        ax2.set_title(f"ms per step (no floor drawn: {no_floor})", fontsize=10)
    ax2.set_xticks(range(len(ok)), labels, rotation=35, ha="right", fontsize=8)
    _bold_highlight(ax2, ok, highlight)
    ax2.set_ylabel("ms per step")
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def step_prose(rows: list[dict], workload: str, step: str) -> str:
    """What this notebook's own step did for ``workload``, from the measured numbers: its time
    against the step it builds on (and whether the difference is inside the p20-p80 spread), its
    same-math check, and why it did not run when it did not."""
    text = _step_prose(rows, workload, step)
    caveat = rows_caveat([r for r in rows if r["step"] == step])
    return f"Not meaningful as performance ({caveat}). {text}" if caveat else text


def _step_prose(rows: list[dict], workload: str, step: str) -> str:
    row = next((r for r in rows if r["step"] == step), None)
    if row is None:
        return f"{step} has not been measured for {workload} in this run."
    if row["status"] not in ("ok", "math changed"):
        return f"For {workload}, {step} is {row['status']}: {row['reason'] or 'see the check above'}."
    if not row["throughput"]:
        return f"For {workload}, {step} ran but recorded no time ({row['reason'] or row['status']})."
    # the step it builds on (its chain's nearest measured step: a branch skips the steps listed between)
    prev = next((r for r in rows if r["step"] == row.get("prev_step") and r["throughput"]), None)
    unit = row["unit"].replace("/s", "")
    parts = [f"On {row['device']} ({row['profile']} profile), {workload} at {step} ran "
             f"{row['ms_per_step']:.2f} ms/step ({row['throughput']:,.0f} {unit}/s)."]
    if prev is not None:
        ratio = prev["ms_per_step"] / row["ms_per_step"]
        overlap = not (row["ms_p80"] < prev["ms_p20"] or row["ms_p20"] > prev["ms_p80"])
        parts.append(f"Against {prev['step']} ({prev['ms_per_step']:.2f} ms/step) that is {ratio:.2f}x"
                     + (", within the p20-p80 spread of the two: no difference this run can resolve."
                        if overlap else ", outside the p20-p80 spread of both."))
        if row.get("within_noise") is not None:
            parts.append(f"Timed again in fresh processes, the two steps' medians spread by up to "
                         f"{row['noise_spread']:.3f}x from process to process: "
                         + ("the difference is within that noise." if row["within_noise"]
                            else "the difference is larger than that."))
    if row.get("mfu") is not None:
        parts.append(f"It uses {row['mfu']:.1%} of the measured {row.get('mfu_ceiling') or '16-bit'} matmul ceiling.")
    elif row.get("mfu_reason"):
        parts.append(f"MFU n/a: {row['mfu_reason']}.")
    if row.get("sdpa_backend"):
        parts.append(f"SDPA dispatched the '{row['sdpa_backend']}' kernel (read off the aten ops).")
    if row.get("op_backends"):
        parts.append(f"hwlib's ops ran these backends: {row['op_backends']}.")
    if row["same_math_max_rel"] is not None:
        parts.append(f"Its loss curve differs from the step before by at most {row['same_math_max_rel']:.1e} "
                     f"(tolerance {row['same_math_tol']}): "
                     + ("same math." if row["status"] == "ok" else "the math changed; do not trust the speed-up."))
    return " ".join(parts)


def what_we_saw(rows: list[dict], workload: str) -> str:
    """A paragraph made of the measured numbers of the ladder, for the notebooks and the README; led by
    what they are not worth when they come from a CPU or the smoke profile."""
    text = _what_we_saw(rows, workload)
    caveat = rows_caveat(rows)
    return f"Not meaningful as performance ({caveat}). {text}" if caveat else text


def _what_we_saw(rows: list[dict], workload: str) -> str:
    ok = [r for r in rows if r["throughput"]]
    if not ok:
        return f"No step of {workload} has been measured in this run yet."
    unit = ok[0]["unit"].replace("/s", "")
    first, last = ok[0], ok[-1]
    parts = [f"On {first['device']} ({first['profile']} profile), {workload} went from "
             f"{first['throughput']:,.0f} {unit}/s at {first['step']} ({first['ms_per_step']:.1f} ms/step) to "
             f"{last['throughput']:,.0f} {unit}/s at {last['step']} ({last['ms_per_step']:.1f} ms/step), "
             f"{last['speedup_vs_baseline']:.2f}x."]
    steps = [r for r in ok[1:] if r["speedup_vs_prev"]]
    if steps:
        best = max(steps, key=lambda r: r["speedup_vs_prev"])
        worst = min(steps, key=lambda r: r["speedup_vs_prev"])
        parts.append(f"The largest single gain was {best['step']} ({best['change']}): "
                     f"{best['speedup_vs_prev']:.2f}x over the step before; the smallest was "
                     f"{worst['step']} ({worst['change']}): {worst['speedup_vs_prev']:.2f}x.")
    if last.get("mfu") is not None:   # against the ceiling of the precision the step ran in
        parts.append(f"The last step uses {last['mfu']:.1%} of the measured {last.get('mfu_ceiling') or 'matmul'} "
                     f"matmul ceiling "
                     f"({last['model_tflops']:.0f} model TFLOP/s).")
    sdpa = next((r for r in rows if r.get("sdpa_backend")), None)
    if sdpa:
        parts.append(f"The attention kernel that SDPA dispatched from {sdpa['step']} on was "
                     f"'{sdpa['sdpa_backend']}' (read off the aten ops, not assumed).")
    skipped = [r for r in rows if r["status"] != "ok"]
    for r in skipped:
        parts.append(f"{r['step']} is {r['status']}: {r['reason'] or 'see the check above'}.")
    checks = [r for r in ok if r["same_math_max_rel"] is not None]
    if checks:
        worst = max(checks, key=lambda r: r["same_math_max_rel"])
        parts.append(f"Every step's loss curve stayed within its stated tolerance of the step before "
                     f"(largest difference {worst['same_math_max_rel']:.1e}, at {worst['step']})."
                     if all(r["status"] == "ok" for r in checks) else
                     "At least one step changed the math beyond its tolerance: see the status column.")
    return " ".join(parts)


# --- whole-run outputs ----------------------------------------------------------------------------

def generation_section(recs: list[dict]) -> dict:
    """summary.json's ``generation``: notebook 14's rungs (tokens/s, cycle time, shares), from records."""
    from ..studies.generation import summary_rows
    return {"steps": summary_rows(recs)}


def multi_gpu_section(recs: list[dict]) -> dict:
    """summary.json's ``multi_gpu``: notebook 15's rows per workload (world size, strategy, scaling,
    batches, throughput, efficiency against one process, exposed communication, same math)."""
    from ..distributed.scaling import rows as scaling_rows
    out: dict = {}
    for r in scaling_rows(recs):
        out.setdefault(r["workload"], []).append(
            {k: r[k] for k in ("world_size", "strategy", "scaling", "per_gpu_batch", "global_batch", "options",
                               "status", "reason", "ms_per_step", "ms_p20", "ms_p80", "throughput", "unit")}
            | {r["unit"].replace("/s", "_per_s"): r["throughput"], "efficiency": r["efficiency"],
               "speedup": r["speedup"], "mfu": r["mfu"], "exposed_comm_ms": r["exposed_comm_ms"],
               "comm_ms": r["comm_ms"], "same_math_max_rel": r["same_math_max_rel"]})
    return out


def summary(run=None) -> dict:
    """summary.json's content (its schema: docs/architecture.md, Results), derived from the run's records."""
    recs = query.load(run)
    ceil = query.ceilings(run) or {}
    dev = next((r.get("device") for r in recs if r.get("device")), {}) or {}
    vers = next((r.get("versions") for r in recs if r.get("versions")), {}) or {}
    prof = next((r.get("profile") for r in recs if r.get("profile")), None)
    out = {"device": dev, "versions": vers, "profile": prof,
           "ceilings": {"copy_gbps": ceil.get("copy_gbps"), "matmul_tflops": ceil.get("matmul_tflops", {})},
           "workloads": {}, "kernels": {}}
    for w in workloads_in(recs):
        rows = ladder_rows_with_noise(recs, w)
        cfg = next((r["params"].get("config") for r in recs if r.get("workload") == w and r.get("params")), {})
        out["workloads"][w] = {"config": cfg, "steps": [
            {"step": r["step"], "status": r["status"], "reason": r["reason"], "ms_per_step": r["ms_per_step"],
             "ms_p20": r["ms_p20"], "ms_p80": r["ms_p80"], "throughput": r["throughput"], "unit": r["unit"],
             r["unit"].replace("/s", "_per_s"): r["throughput"],   # tokens_per_s or samples_per_s
             "model_tflops": r["model_tflops"], "mfu": r["mfu"], "peak_mem_gib": r["peak_mem_gib"],
             "speedup_vs_baseline": r["speedup_vs_baseline"], "final_loss": r["final_loss"],
             "compile_s": r["compile_s"], "same_math_max_rel": r["same_math_max_rel"],
             "sdpa_backend": r["sdpa_backend"], "process_spread": r["process_spread"],
             "within_noise": r["within_noise"]} for r in rows]}
    out["generation"] = generation_section(recs)
    out["multi_gpu"] = multi_gpu_section(recs)
    return out


def write_all(run=None) -> dict:
    """Rebuild every table and figure of a run, and summary.json. Returns the paths written."""
    d = run_dir(run)
    recs = query.load(d)
    ceil = query.ceilings(d)
    written = {}
    for w in workloads_in(recs):
        rows = ladder_rows_with_noise(recs, w)
        written[f"{w}.md"] = results.write_atomic(d / "tables" / f"{w}_ladder.md",
                                                  f"# {w}: cumulative ladder\n\n" + caveat_line(rows_caveat(rows))
                                                  + markdown_table(rows)
                                                  + "\n" + what_we_saw(rows, w) + "\n")
        written[f"{w}.csv"] = results.write_atomic(d / "tables" / f"{w}_ladder.csv", csv_table(rows))
        if any(r["throughput"] for r in rows):
            ladder_figure(rows, w, ceil, path=d / "figures" / f"{w}_ladder.png")
            written[f"{w}.png"] = d / "figures" / f"{w}_ladder.png"
    written["claims.md"] = results.write_atomic(d / "tables" / "claims.md", "# The seeds' claims beside this run's measurements\n\n"
                                                + claims.run_markdown(d, level=2))
    written["summary.json"] = results.write_json(d / "summary.json", summary(d))
    return written


def readme_block(run) -> str:
    """The README's reference section: one ladder table per workload, with its provenance."""
    s = summary(run)
    recs = query.load(run)
    dev = s["device"].get("name", "?")
    v = s["versions"]
    import os
    src = os.path.relpath(run_dir(run), REPO_ROOT)
    mm = s["ceilings"]["matmul_tflops"] or {}
    lines = [f"Measured on **{dev}** ({s['profile']} profile; torch {v.get('torch')}, CUDA {v.get('cuda')}); "
             f"source: `{src}/summary.json`. Ceilings of its newest notebook 00 (each record's MFU was "
             f"taken against the ceilings of the run that measured it): device copy "
             f"{_fmt(s['ceilings']['copy_gbps'], ',.0f')} GB/s, matmul bf16 {_fmt(mm.get('bf16'), ',.0f')}, "
             + (f"fp16 {_fmt(mm.get('fp16'), ',.0f')}, " if mm.get("fp16") else "")
             + f"tf32 {_fmt(mm.get('tf32'), ',.0f')}, fp32 {_fmt(mm.get('fp32'), ',.0f')} TFLOP/s.", ""]
    for w in s["workloads"]:
        rows = ladder_rows_with_noise(recs, w)
        lines += [f"**{w}**", "", markdown_table(rows), what_we_saw(rows, w), ""]
        if w == recipe.WORKLOAD and (past := recipe.sentence(rows, recs)):
            lines += [past, ""]
    lines += generation_lines(s["generation"]["steps"])
    lines += decode_ladder_lines(DECODE_RUNS)
    lines += cycle_lines(CYCLE_RUNS)
    lines += toggle_lines(toggle_rows(recs, run_windows(query.state(run))))
    lines += multi_gpu_lines(reference_runs())
    lines.append(time_table(run))
    return "\n".join(lines)


def generation_lines(steps: list[dict]) -> list[str]:
    """The generation ladder (notebook 14) of a run's summary as README lines; none without rows."""
    if not steps:
        return []
    first = next((r for r in steps if r["status"] == "ok" and r.get("gen_tokens_per_s")), None)
    out = ["**polychromic** (notebook 14: generation and the diversity bonus, one 5-step trainer cycle per rung)", "",
           "| rung | status | generated tokens/s | x the seed's way | s per cycle | generation share | "
           "decode GB/s | of copy ceiling |", "|---|---|---|---|---|---|---|---|"]
    for r in steps:
        x = (r["gen_tokens_per_s"] / first["gen_tokens_per_s"]
             if first and r["status"] == "ok" and r.get("gen_tokens_per_s") else None)
        cyc = r["ms_per_cycle"] / 1e3 if _num(r.get("ms_per_cycle")) is not None else None
        out.append(f"| {r['step']} | {md_cell(r['status'])} | {_fmt(r.get('gen_tokens_per_s'), ',.1f')} | {_fmt(x, '.1f')} | "
                   f"{_fmt(cyc, '.2f')} | {_fmt(r.get('share_generation'), '.0%')} | "
                   f"{_fmt(r.get('decode_gbps'), ',.0f')} | {_fmt(r.get('decode_share_of_copy'), '.1%')} |")
    return out + [""]


# Where the fused decode ladder (hwlib.studies.decode_bench) of each machine was measured: a reference run's
# own folder, or one under it.
DECODE_RUNS = ("reference/h100/generation_decode", "reference/h200-decode")
DECODE_STEP = "14e_fused_decode"


def decode_rows(run) -> list[dict]:
    """The fused decode ladder of one run (``decode_bench``'s records; its newest of each model size and
    rung), in the order measured, with each rung's speed-up over the fused rung measured before it."""
    by = {}
    for r in query.load(run):
        f = r.get("fields") or {}
        if r.get("step") != DECODE_STEP or not f.get("decode_rung") or not f.get("model_size"):
            continue
        row = by.setdefault((f["model_size"], f["decode_rung"]), {"model_size": f["model_size"], "rung": f["decode_rung"],
                                                                  "device": (r.get("device") or {}).get("name")})
        if r.get("metric") == "decode_ms_per_step":
            row.update(ms=_num(r.get("value")), p20=_num(r.get("p20")), p80=_num(r.get("p80")))
        elif r.get("metric") == "decode_share_of_copy":
            row["share"] = _num(r.get("value"))
    rows = [row for row in by.values() if row.get("ms") is not None]
    for row, x in zip(rows, fused_decode.speedups([(r["model_size"], r["rung"], r["ms"]) for r in rows])):
        row["x"] = x
    return rows


def decode_ladder_lines(runs) -> list[str]:
    """The fused decode ladder of each run in ``runs`` that holds one, as README lines; none without rows."""
    out = []
    for run in runs:
        rows = decode_rows(run)      # none where the run holds no records
        if not rows:
            continue
        if not out:
            out = ["**The decode step past rung d** (hwlib.studies.decode_bench: batch 12, 100 tokens; each rung "
                   "cumulative; x: over the rung before it, a variant over its rung, in the same process)", ""]
        out += [f"On {rows[0]['device'] or '?'} (`outputs/{run}`):", "",
                "| model | rung | ms/step (p20-p80) | x | of copy ceiling |", "|---|---|---|---|---|"]
        for r in rows:
            span = f" ({r['p20']:.3f}-{r['p80']:.3f})" if r.get("p20") is not None and r.get("p80") is not None else ""
            out.append(f"| {r['model_size']} | {md_cell(r['rung'])} | {r['ms']:.3f}{span} | {_fmt(r['x'], '.2f')} | "
                       f"{_fmt(r.get('share'), '.1%')} |")
        out.append("")
    return out


# Where the trainer's cycle at every rung and model size (hwlib.studies.trainer_cycle) was measured.
CYCLE_RUNS = ("reference/h200-cycle/ladder", "reference/h200-cycle/compiled_train")


def cycle_rows(run) -> list[dict]:
    """The trainer cycle of one run (``trainer_cycle``'s ``ms_per_cycle`` records, the newest of each model
    size and rung), in the order measured, with each rung's speed-up over the one measured before it at
    the same size."""
    by = {}
    for r in query.load(run):
        f = r.get("fields") or {}
        if r.get("notebook") != "trainer_cycle" or r.get("metric") != "ms_per_cycle" or not f.get("model_size"):
            continue
        if r.get("status") == "ok" and _num(r.get("value")) is not None:
            by[(f["model_size"], r.get("step"))] = {
                "model_size": f["model_size"], "rung": r.get("step"), "s": r["value"] / 1e3,
                "p20": _num(r.get("p20")), "p80": _num(r.get("p80")), "device": (r.get("device") or {}).get("name")}
    rows, prev = list(by.values()), {}
    for row in rows:
        before = prev.get(row["model_size"])
        row["x"] = before / row["s"] if before else None
        prev[row["model_size"]] = row["s"]
    return rows


def cycle_lines(runs) -> list[str]:
    """The trainer cycle of each run in ``runs`` that holds one, as page lines; none without rows."""
    out = []
    for run in runs:
        rows = cycle_rows(run)
        if not rows:
            continue
        if not out:
            out = ["**The trainer's cycle at every rung** (hwlib.studies.trainer_cycle: five LoRA trainer steps, the "
                   "last with the diversity bonus; x: over the rung measured before it at that size, in the same "
                   "process; each folder's README has the share of each phase)", ""]
        out += [f"On {rows[0]['device'] or '?'} (`outputs/{run}`):", "",
                "| model | rung | s per cycle (p20-p80) | x |", "|---|---|---|---|"]
        for r in rows:
            span = (f" ({r['p20'] / 1e3:.3f}-{r['p80'] / 1e3:.3f})"
                    if r.get("p20") is not None and r.get("p80") is not None else "")
            out.append(f"| {r['model_size']} | {md_cell(r['rung'])} | {r['s']:.3f}{span} | {_fmt(r['x'], '.2f')} |")
        out.append("")
    return out


def toggle_rows(recs: list[dict], windows: dict | None = None) -> list[dict]:
    """One row per setting toggled on its own (notebook 19's ablations, notebook 20's inductor knobs),
    from a run's records as ``query.load`` gives them (a re-measured toggle: its newest record only):
    each ``speedup`` record's interval, the effect it supports (faster or slower only when the
    interval excludes 1) and the "with" arm's compile seconds where the arms compiled.

    ``windows``: each notebook's last run (``run_window`` of its state.json entry). Where that run
    measured a toggle, the toggle's records from earlier runs of the notebook at other steps are
    left out: the notebook now measures it where its last run did (notebook 20 at the ladder's
    fastest step), and a fresh run would show only those rows."""
    def key(r):
        return r["notebook"], r["workload"], r["step"], r["fields"]["toggle"], r["fields"].get("mode")

    def measured(r):   # a toggle across steps
        return r["notebook"], r["workload"], r["fields"]["toggle"], r["fields"].get("mode")

    toggled = [r for r in recs if "toggle" in (r.get("fields") or {})]
    windows = windows or {}
    last_run = {measured(r) for r in toggled if _inside(r, windows.get(r["notebook"]))}
    toggled = [r for r in toggled if _inside(r, windows.get(r["notebook"])) or measured(r) not in last_run]
    compile_with = {key(r): r["value"] for r in toggled
                    if r.get("metric") == "compile_s" and r["fields"].get("arm") == "with"}
    rows = []
    for r in (r for r in toggled if r.get("metric") == "speedup"):
        iv = (r.get("params") or {}).get("interval") or {}
        lo, hi = iv.get("lo"), iv.get("hi")
        effect = None if lo is None or hi is None else noise.effect(lo, hi)
        k = key(r)
        rows.append({"notebook": k[0], "workload": k[1], "step": k[2], "toggle": k[3],
                     "change": (r.get("params") or {}).get("what"), "mode": k[4], "status": r.get("status"),
                     "speedup": r.get("value"), "lo": lo, "hi": hi, "level": iv.get("level"), "effect": effect,
                     "compile_s_with": compile_with.get(k), "reason": r.get("reason")})
    return sorted(rows, key=lambda x: (x["notebook"], x["workload"], x["step"], x["toggle"], x["mode"] or ""))


def _inside(r: dict, win: tuple | None) -> bool:
    """``r`` was made inside the run window ``win`` (``run_window``); False without a window."""
    t = _when(r.get("time"))
    return win is not None and t is not None and win[0] <= t <= win[1]


def toggle_lines(rows: list[dict]) -> list[str]:
    """``toggle_rows`` as README lines; none without rows."""
    if not rows:
        return []
    out = ["**One setting at a time** (notebooks 19 and 20; speed-up = time per step without the change / with it, "
           "interleaved windows; faster or slower only where the interval excludes 1)", "",
           "| notebook | workload | step | change | mode | speed-up (interval) | effect | compile s with it |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            sp, eff = f"{r['status']}: {r['reason'] or '-'}", "-"
        else:
            sp = (f"{_fmt(r['speedup'], '.3f')} ({_fmt(r['lo'], '.3f')}-{_fmt(r['hi'], '.3f')}, "
                  f"{_fmt(r['level'], '.0%')})")
            eff = r["effect"] or "-"
        mode = "a process per window" if r["mode"] == "processes" else "one process"
        out.append(f"| {r['notebook'][:2]} | {r['workload']} | {r['step']} | {md_cell(r['change'] or r['toggle'])} | "
                   f"{mode} | {md_cell(sp)} | {md_cell(eff)} | {_fmt(r['compile_s_with'], '.0f')} |")
    return out + [""]


def multi_gpu_lines(runs: list[str]) -> list[str]:
    """Notebook 15's scaling rows of each reference run that has them, side by side in one table."""
    from ..distributed.scaling import label as scaling_label, rows as scaling_rows
    body = []
    for run in runs:
        name = run.split("/")[-1]
        for r in scaling_rows(query.load(run)):
            body.append(f"| {name} | {r['workload']} | {r['world_size']} | {scaling_label(r)} | {r['scaling']} | "
                        f"{md_cell(r['status'])} | {_fmt(r['ms_per_step'], '.2f')} ({_fmt(r['ms_p20'], '.2f')}-"
                        f"{_fmt(r['ms_p80'], '.2f')}) | {_fmt(r['throughput'], ',.0f')} {r['unit']} | "
                        f"{_fmt(r['efficiency'], '.0%')} | {_fmt(r['exposed_comm_ms'], '.2f')} | "
                        f"{_fmt(r['same_math_max_rel'], '.1e')} |")
    if not body:
        return []
    return ["**Several GPUs** (notebook 15; efficiency = throughput at K / (K x one process's); exposed NCCL "
            "time from a profiler trace; same math: the loss curve against one process at the same global batch)",
            "", "| reference | workload | K | strategy | scaling | status | ms/step (p20-p80) | throughput | "
            "efficiency | exposed comm ms | same math |", "|---|---|---|---|---|---|---|---|---|---|---|",
            *body, ""]


def _when(stamp) -> datetime | None:
    """An ISO time as an aware datetime; a naive one is taken as UTC (the reference machines' clocks)."""
    try:
        t = datetime.fromisoformat(stamp)
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


RUN_SLACK_S = 5.0   # state.json's seconds and a record's time are taken a moment apart


def run_window(entry: dict) -> tuple[datetime, datetime] | None:
    """When a notebook's last run in ``state.json`` went on (start, end), or None where its entry does
    not say."""
    end, secs = _when(entry.get("finished")), _num(entry.get("seconds"))
    if end is None or secs is None:
        return None
    return end - timedelta(seconds=secs + RUN_SLACK_S), end + timedelta(seconds=RUN_SLACK_S)


def run_windows(state: dict) -> dict:
    """{notebook: ``run_window``} of each notebook's entry in a run's state.json (None where the entry
    does not say)."""
    return {k: run_window(v) for k, v in state.items() if not k.startswith("_")}


def time_table(run) -> str:
    """Where the wall time of ``hwlib reproduce`` went, per notebook in the run's order, from the
    run's state.json, with the compile time that the compiled steps report and the parameters a
    notebook ran with where they were not its own (``hwlib reproduce --set``, ``--workloads``).
    Compile seconds count only where their record was made while the notebook ran (``run_window``):
    a study run on its own into the same folder adds rows to the notebook's tables, not seconds to
    its wall time."""
    state = query.state(run)
    nbs = {k: state[k] for k in order_names(k for k in state if not k.startswith("_"))}   # as a run goes
    if not nbs:
        return ""
    compile_s = {}
    windows = run_windows(state)
    # every record, superseded ones too: a notebook's own run may have been measured again since
    for r in query.load(run, latest_only=False):
        if r.get("metric") == "compile_s" and _num(r.get("value")) is not None:
            win, t = windows.get(r["notebook"]), _when(r.get("time"))
            if win is not None and t is not None and not (win[0] <= t <= win[1]):
                continue   # measured outside the notebook's timed run (a study called on its own): not its time
            compile_s[r["notebook"]] = compile_s.get(r["notebook"], 0.0) + r["value"]
    total = sum(v["seconds"] for v in nbs.values())
    params = any(v.get("parameters") for v in nbs.values())
    lines = [f"Wall time of `hwlib reproduce` for this run: {total:.0f} s over {len(nbs)} notebooks "
             f"(each a fresh kernel: imports, CUDA start, data, then its measurements).", "",
             "| notebook | status | seconds | share | of which compilation (s) |" + (" parameters set |" if params else ""),
             "|---|---|---|---|---|" + ("---|" if params else "")]
    for k, v in nbs.items():
        c = compile_s.get(k)
        share = v["seconds"] / total if total > 0 else None   # every entry 0 s: no share to give
        # a retired step's notebook ran in this run but is no longer in the series (hwlib.steps.retired)
        name = f"{k} (retired step)" if k in RETIRED_NAMES else k
        row = f"| {name} | {md_cell(v['status'])} | {v['seconds']:.1f} | {_fmt(share, '.0%')} | {_fmt(c, '.1f')} |"
        if params:
            p = v.get("parameters") or {}
            row += " " + md_cell("; ".join(f"`{n}={json.dumps(x)}`" for n, x in p.items()) or "-") + " |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _device_name(recs: list[dict]) -> str:
    """The GPU (or CPU) a run's records were measured on: the first record's that names one."""
    return next((r["device"].get("name") for r in recs if isinstance(r.get("device"), dict)), "?")


def small_gpu_block(runs: list[str]) -> str:
    """The README's part on smaller GPUs: each reference run made in a profile other than full, with
    the reason its profile was picked, its ladder tables and where its time went."""
    out = []
    for run in runs:
        state = query.state(run)
        if state.get("_profile") in (None, "full"):
            continue
        recs = query.load(run)
        dev = _device_name(recs)
        folder = f"outputs/{run}"
        ladders = sorted(p.name for p in (run_dir(run, create=False) / "tables").glob("*_ladder.md"))
        out += [f"**`{folder}`**, {dev}, profile `{state['_profile']}`: {state.get('_profile_reason', '')}.", "",
                "Ladder tables: " + ", ".join(f"[{n[:-len('_ladder.md')]}]({repo_url(f'{folder}/tables/{n}')})"
                                              for n in ladders)
                + ".", "", time_table(run)]
    return "\n".join(out) if out else "No reference run in a smaller profile yet."


def first_look_block(runs=FIRST_LOOK_RUNS) -> str:
    """The README's part on ``make first-look``: where the time of each of its reference runs went (one
    per GPU)."""
    parts = []
    for run in runs:
        folder = run_dir(run, create=False)
        if not (folder / "state.json").is_file():
            continue
        name = f"outputs/{run}" if isinstance(run, str) else folder.name
        parts.append(f"**`{name}`**, {_device_name(query.load(run))}, from cold caches:\n\n" + time_table(run))
    return "\n\n".join(parts) or "No first-look reference run yet."


def source_markdown(source: str) -> str:
    """A seed's public source (``Seed.source``: 'owner/repo, path (commit abc)' or 'owner/repo (a fork
    of ...), path') with its repository linked and its file in code type."""
    m = re.match(r"\s*([\w.-]+/[\w.-]+)(\s*\([^)]*\))?\s*,\s*(\S+)(.*)$", source or "")
    if not m:
        return source or "-"
    repo, aside, path, rest = m.groups()
    return f"[{repo}](https://github.com/{repo}){aside or ''}, `{path}`{rest}"


def claims_block(run) -> str:
    """The README's claims tables: the seed write-ups with their public sources and how their
    claims fared, then each seed's claims beside what ``run`` measured (claims it cannot measure
    are read from the other reference runs, and say so)."""
    others = tuple(r for r in reference_runs() if run_dir(r, create=False) != run_dir(run, create=False))
    rows = claims.evaluate(run, elsewhere=others)
    lines = ["| seed | the write-up | public source (repository, file) | lab workloads | claims | verdicts |",
             "|---|---|---|---|---|---|"]
    for sid, seed in claims.SEEDS.items():
        mine = [r for r in rows if r["seed"] == sid]
        tally = ", ".join(f"{n} {v}" for v in claims.VERDICTS if (n := sum(r["verdict"] == v for r in mine)))
        lines.append(f"| {sid} | {seed.title} | {source_markdown(seed.source)} | {', '.join(seed.workloads)} | "
                     f"{len(mine)} | {tally or '-'} |")
    return "\n".join(lines) + "\n\n" + claims.markdown(rows, level=4)
