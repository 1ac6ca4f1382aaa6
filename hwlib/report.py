"""Tables, figures, summary.json and prose, all derived from a run's results; nothing typed.

``ladder_frame`` turns the records of one workload into the cumulative table (one row per step,
speed-ups against step 01 and against the step before). ``write_all`` rebuilds every table and
figure of a run plus ``summary.json``; ``update_readme`` puts the reference table between markers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from . import results
from .steps import LADDER, STEP_NAMES

STEP_METRICS = ("ms_per_step", "tokens_per_s", "model_tflops", "mfu", "peak_mem_gib", "final_loss",
                "compile_s", "first_step_s", "same_math_max_rel", "sdpa_backend")
README_START, README_END = "<!-- reference-table:start -->", "<!-- reference-table:end -->"


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def ladder_rows(records: list[dict], workload: str) -> list[dict]:
    """One dict per measured step of ``workload``, in ladder order."""
    by_step: dict[str, dict] = {}
    for r in records:
        if r.get("workload") != workload or r.get("step") not in STEP_NAMES:
            continue
        by_step.setdefault(r["step"], {})[r["metric"]] = r
    rows = []
    base = prev = None
    for st in LADDER:
        m = by_step.get(st.name)
        if not m:
            continue
        ms = m.get("ms_per_step", {})
        if ms.get("measurement"):   # only metrics of the same measurement as the newest step time
            m = {k: v for k, v in m.items() if v.get("measurement") in (None, ms["measurement"])}
        status = ms.get("status", "ok")
        check = m.get("same_math_max_rel")
        if check and check.get("status") == "failed":
            status = "math changed"
        row = {"step": st.name, "change": st.title, "status": status, "reason": ms.get("reason"),
               "ms_per_step": _num(ms.get("value")), "ms_p20": _num(ms.get("p20")), "ms_p80": _num(ms.get("p80"))}
        for k in ("model_tflops", "mfu", "peak_mem_gib", "final_loss", "compile_s"):
            row[k] = _num(m.get(k, {}).get("value"))
        thr = next((v for k, v in m.items() if k.endswith("_per_s")), {})
        row["unit"] = (thr.get("unit") or "items/s")
        row["throughput"] = _num(thr.get("value"))
        row["same_math_max_rel"] = _num(check.get("value")) if check else None
        row["same_math_tol"] = check.get("unit", "").replace("relative, tolerance ", "") if check else None
        sdpa = m.get("sdpa_backend", {}).get("value")
        row["sdpa_backend"] = None if sdpa in (None, "none found") else sdpa   # no attention in the model
        row["profile"] = ms.get("profile")
        row["device"] = (ms.get("device") or {}).get("name")
        # A step whose math changed keeps its measured speed-up; its status says not to trust it.
        if row["throughput"]:
            base = base or row["throughput"]
            row["speedup_vs_baseline"] = row["throughput"] / base
            row["speedup_vs_prev"] = row["throughput"] / prev if prev else None
            prev = row["throughput"]
        else:
            row["speedup_vs_baseline"] = row["speedup_vs_prev"] = None
        rows.append(row)
    return rows


def ladder_frame(records: list[dict], workload: str):
    import pandas as pd
    return pd.DataFrame(ladder_rows(records, workload))


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, str):
        return v
    return format(v, spec)


TABLE_COLUMNS = [  # (header, key, format)
    ("step", "step", ""), ("status", "status", ""), ("ms/step (p20-p80)", None, ""),
    ("{unit}", "throughput", ",.0f"), ("x vs 01", "speedup_vs_baseline", ".2f"),
    ("x vs prev", "speedup_vs_prev", ".2f"), ("TFLOP/s", "model_tflops", ".1f"), ("MFU", "mfu", ".1%"),
    ("peak GiB", "peak_mem_gib", ".2f"), ("same math (max rel / tol)", None, ""),
    ("final loss", "final_loss", ".4f"),
]


def markdown_table(rows: list[dict]) -> str:
    """The ladder as a Markdown table; skipped steps show their reason."""
    if not rows:
        return "_no measurements yet_\n"
    unit = rows[0].get("unit", "items/s")
    heads = [h.format(unit=unit) for h, _, _ in TABLE_COLUMNS]
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
            else:
                cells.append(_fmt(r.get(key), spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_table(rows: list[dict]) -> str:
    import csv
    import io
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


def ladder_figure(rows: list[dict], workload: str, ceilings: dict | None = None, path=None):
    """Throughput per step (median, p20-p80 whiskers) with the speed-up over step 01 on each bar,
    and MFU beside it. Returns the matplotlib figure; saved when ``path`` is given."""
    import matplotlib
    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    ok = [r for r in rows if r["throughput"]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    labels = [r["step"].split("_", 1)[0] + "\n" + r["step"].split("_", 1)[1] for r in ok]
    vals = [r["throughput"] for r in ok]
    unit = ok[0]["unit"] if ok else "items/s"
    err = [[max(0.0, v - r["ms_per_step"] / r["ms_p80"] * v) for v, r in zip(vals, ok)],
           [max(0.0, r["ms_per_step"] / r["ms_p20"] * v - v) for v, r in zip(vals, ok)]]
    bars = ax.bar(range(len(ok)), vals, yerr=err, capsize=3, color="#4c72b0")
    for b, r in zip(bars, ok):
        ax.annotate(f"{r['speedup_vs_baseline']:.1f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(ok)), labels, fontsize=7)
    ax.set_ylabel(unit)
    dev = ok[0]["device"] if ok else ""
    ax.set_title(f"{workload}: throughput per step ({dev}, {ok[0]['profile'] if ok else ''})", fontsize=10)
    mfu = [(r["mfu"] or 0) * 100 for r in ok]
    ax2.plot(range(len(ok)), mfu, "o-", color="#dd8452")
    ax2.set_xticks(range(len(ok)), [r["step"].split("_", 1)[0] for r in ok])
    ax2.set_ylabel("MFU, % of measured bf16 matmul")
    ax2.set_ylim(0, max(mfu + [1]) * 1.25)
    ax2.set_title("model FLOP utilisation", fontsize=10)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def what_we_saw(rows: list[dict], workload: str) -> str:
    """A paragraph made of the measured numbers of the ladder, for the notebooks and the README."""
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
    if last.get("mfu") is not None:
        parts.append(f"The last step uses {last['mfu']:.1%} of the measured bf16 matmul ceiling "
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

def workloads_in(records: list[dict]) -> list[str]:
    seen = []
    for r in records:
        w = r.get("workload")
        if w and r.get("step") in STEP_NAMES and w not in seen:
            seen.append(w)
    return seen


def summary(run=None) -> dict:
    """summary.json's content (schema in DESIGN.md), derived from the run's records."""
    recs = results.load(run)
    ceil = results.read_json(results.run_dir(run) / "ceilings.json", {}) or {}
    dev = next((r.get("device") for r in recs if r.get("device")), {}) or {}
    vers = next((r.get("versions") for r in recs if r.get("versions")), {}) or {}
    prof = next((r.get("profile") for r in recs if r.get("profile")), None)
    out = {"device": dev, "versions": vers, "profile": prof,
           "ceilings": {"copy_gbps": ceil.get("copy_gbps"), "matmul_tflops": ceil.get("matmul_tflops", {})},
           "workloads": {}, "kernels": {}}
    for w in workloads_in(recs):
        rows = ladder_rows(recs, w)
        cfg = next((r["params"].get("config") for r in recs if r.get("workload") == w and r.get("params")), {})
        out["workloads"][w] = {"config": cfg, "steps": [
            {"step": r["step"], "status": r["status"], "reason": r["reason"], "ms_per_step": r["ms_per_step"],
             "ms_p20": r["ms_p20"], "ms_p80": r["ms_p80"], "throughput": r["throughput"], "unit": r["unit"],
             r["unit"].replace("/s", "_per_s"): r["throughput"],   # tokens_per_s or samples_per_s
             "model_tflops": r["model_tflops"], "mfu": r["mfu"], "peak_mem_gib": r["peak_mem_gib"],
             "speedup_vs_baseline": r["speedup_vs_baseline"], "final_loss": r["final_loss"],
             "compile_s": r["compile_s"], "same_math_max_rel": r["same_math_max_rel"],
             "sdpa_backend": r["sdpa_backend"]} for r in rows]}
    return out


def write_all(run=None) -> dict:
    """Rebuild every table and figure of a run, and summary.json. Returns the paths written."""
    d = results.run_dir(run)
    recs = results.load(d)
    ceil = results.read_json(d / "ceilings.json")
    written = {}
    for w in workloads_in(recs):
        rows = ladder_rows(recs, w)
        written[f"{w}.md"] = results.write_atomic(d / "tables" / f"{w}_ladder.md",
                                                  f"# {w}: cumulative ladder\n\n" + markdown_table(rows)
                                                  + "\n" + what_we_saw(rows, w) + "\n")
        written[f"{w}.csv"] = results.write_atomic(d / "tables" / f"{w}_ladder.csv", csv_table(rows))
        if any(r["throughput"] for r in rows):
            import matplotlib.pyplot as plt
            fig = ladder_figure(rows, w, ceil, path=d / "figures" / f"{w}_ladder.png")
            plt.close(fig)
            written[f"{w}.png"] = d / "figures" / f"{w}_ladder.png"
    from . import claims
    written["claims.md"] = results.write_atomic(d / "tables" / "claims.md", "# The seeds' claims beside this run's measurements\n\n"
                                                + claims.markdown(claims.evaluate(d), level=2))
    written["summary.json"] = results.write_json(d / "summary.json", summary(d))
    return written


def readme_block(run) -> str:
    """The README's reference section: one ladder table per workload, with its provenance."""
    s = summary(run)
    recs = results.load(run)
    dev = s["device"].get("name", "?")
    v = s["versions"]
    import os
    src = os.path.relpath(results.run_dir(run), results.REPO_ROOT)
    mm = s["ceilings"]["matmul_tflops"] or {}
    lines = [f"Measured on **{dev}** ({s['profile']} profile; torch {v.get('torch')}, CUDA {v.get('cuda')}); "
             f"source: `{src}/summary.json`. Ceilings measured in the same run: device copy "
             f"{_fmt(s['ceilings']['copy_gbps'], ',.0f')} GB/s, matmul bf16 {_fmt(mm.get('bf16'), ',.0f')}, "
             f"tf32 {_fmt(mm.get('tf32'), ',.0f')}, fp32 {_fmt(mm.get('fp32'), ',.0f')} TFLOP/s.", ""]
    for w in s["workloads"]:
        rows = ladder_rows(recs, w)
        lines += [f"**{w}**", "", markdown_table(rows), what_we_saw(rows, w), ""]
    from . import claims
    lines += ["### The seeds' claims, measured", "",
              "Each claim of the five seed write-ups beside the ratio this run measured for the same change "
              "(`hwlib/claims.py` says how each is looked up; the verdicts are derived, not typed).", "",
              claims.markdown(claims.evaluate(run), level=4), ""]
    lines.append(time_table(run))
    return "\n".join(lines)


def time_table(run) -> str:
    """Where the wall time of ``hwlib reproduce`` went, per notebook, from the run's state.json,
    with the compile time that the compiled steps report."""
    state = results.read_json(results.run_dir(run) / "state.json", {}) or {}
    nbs = {k: v for k, v in state.items() if not k.startswith("_")}
    if not nbs:
        return ""
    compile_s = {}
    for r in results.load(run):
        if r.get("metric") == "compile_s" and _num(r.get("value")) is not None:
            compile_s[r["notebook"]] = compile_s.get(r["notebook"], 0.0) + r["value"]
    total = sum(v["seconds"] for v in nbs.values())
    lines = [f"Wall time of `hwlib reproduce` for this run: {total:.0f} s over {len(nbs)} notebooks "
             f"(each a fresh kernel: imports, CUDA start, data, then its measurements).", "",
             "| notebook | status | seconds | share | of which compilation (s) |", "|---|---|---|---|---|"]
    for k, v in nbs.items():
        c = compile_s.get(k)
        lines.append(f"| {k} | {v['status']} | {v['seconds']:.1f} | {v['seconds'] / total:.0%} | "
                     f"{_fmt(c, '.1f')} |")
    return "\n".join(lines) + "\n"


def update_readme(readme: str | Path, run) -> bool:
    """Replace what stands between the README's markers with ``readme_block(run)``.
    Returns True when the file changed."""
    p = Path(readme)
    text = p.read_text(encoding="utf-8")
    pat = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.S)
    if not pat.search(text):
        raise ValueError(f"{p}: markers {README_START} ... {README_END} not found")
    new = pat.sub(lambda _: README_START + "\n" + readme_block(run) + "\n" + README_END, text)
    if new != text:
        results.write_atomic(p, new)
        return True
    return False
