"""Explore recorded results: choose a run, a workload, steps and a metric; see the table and the
plot; compare the run with another (your GPU against ``outputs/reference/h100``) as a ratio per
step with its noise band.

Everything is read through ``hwlib.query`` (via ``hwlib.seeds.lookup.load_records``, which also
reads the committed references when ``HWLIB_OUTPUTS`` points elsewhere). The pure functions
(``find_runs``, ``load_run``, ``rows``, ``compare``, ``problems``) hold the logic and are tested
without a browser; ``Explorer`` wires them to ipywidgets and leaves a static copy (a Markdown
table and a matplotlib figure of the first selection), which is what a papermill run keeps.

Rows: one per step and *variant* (a record's ``fields``, such as ``monitor=live`` or
``technique=bf16``; the ladder's own rows have none). A compared row is matched with the other
run's row of the same step and variant, else with that step's ladder row (said in the row).
The noise band of a ratio a/b is [a_p20 / b_p80, a_p80 / b_p20]: the ratio is within noise when
the band holds 1.

Bad input never raises into the panel: a run with no records, a run that mixes machines or
profiles, two runs of different profiles (their sizes differ: no ratio is shown), a metric that no
record has, are each said in the panel's message line, and the rest keeps working.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import query
from ..paths import REPO_ROOT, outputs_root, run_name
from ..seeds.lookup import default_run, load_records
from ..steps import STEP_NAMES
from ..telemetry import explain

NONE = "(none)"
LOWER_IS_BETTER_UNITS = ("ms", "s", "GiB", "MiB")


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _most(values):
    return max(set(values), key=values.count) if values else None


# --- runs ---------------------------------------------------------------------------------------

def find_runs(root: Path | None = None, reference_root: Path | None = None) -> dict[str, Path]:
    """Runs to choose from, label -> folder: every run under ``outputs/`` (``HWLIB_OUTPUTS``) with a
    ``results.jsonl``, and every committed reference (``outputs/reference/<machine>`` of the
    checkout), references last."""
    root = Path(root) if root is not None else outputs_root()
    refs = Path(reference_root) if reference_root is not None else REPO_ROOT / "outputs" / "reference"
    own, ref = {}, {}
    for depth in ("*", "*/*", "*/*/*"):
        for f in sorted(root.glob(f"{depth}/{query.RESULTS_FILE}")):
            label = f.parent.relative_to(root).as_posix()
            (ref if label.split("/")[0] == "reference" else own)[label] = f.parent
    for f in sorted(refs.glob(f"*/{query.RESULTS_FILE}")):
        ref.setdefault(f"reference/{f.parent.name}", f.parent)
    return {**own, **ref}


@dataclass
class RunData:
    """A run's records and what is wrong with them as a whole."""
    label: str
    path: Path | None
    records: list[dict]
    problems: list[str] = field(default_factory=list)

    @property
    def profile(self) -> str | None:
        return _most([r.get("profile") for r in self.records if r.get("profile")])

    @property
    def device(self) -> str | None:
        return _most([(r.get("device") or {}).get("name") for r in self.records if (r.get("device") or {}).get("name")])

    def workloads(self) -> list[str]:
        seen = []
        for r in self.records:
            if r.get("workload") and r["workload"] not in seen and _num(r.get("value")) is not None:
                seen.append(r["workload"])
        return seen

    def metrics(self, workload: str) -> list[str]:
        """Metrics with a numeric value for ``workload``, ms_per_step first."""
        ms = {r["metric"] for r in self.records if r.get("workload") == workload and _num(r.get("value")) is not None}
        return sorted(ms, key=lambda m: (m != "ms_per_step", m))

    def units(self, workload: str) -> dict[str, str]:
        """Each metric's unit for ``workload``, as its records give it (the newest record's)."""
        return {r["metric"]: str(r["unit"]) for r in self.records
                if r.get("workload") == workload and r.get("unit") and _num(r.get("value")) is not None}

    def steps(self, workload: str) -> list[str]:
        return _ordered({str(r.get("step")) for r in self.records if r.get("workload") == workload})


def _ordered(steps) -> list[str]:
    ladder = [s for s in STEP_NAMES if s in steps]
    return ladder + sorted(s for s in steps if s not in STEP_NAMES)


def load_run(run, label: str | None = None) -> RunData:
    """A run's records (name under ``outputs/`` or folder), with the problems of the run as a
    whole: no records, several machines or several profiles in one folder."""
    if isinstance(run, RunData):
        return run
    if not isinstance(run, (str, Path)):
        raise TypeError(f"run must be a run name or folder, got {type(run).__name__}")
    path = Path(run)
    if not path.is_absolute():
        path = outputs_root() / run_name(run)
    recs = load_records(path)
    rd = RunData(label or str(run), path, recs)
    if not recs:
        rd.problems.append(f"{rd.label}: no records (no results.jsonl in {path}, or it is empty): "
                           "run a notebook into it first")
        return rd
    profiles = sorted({r.get("profile") for r in recs if r.get("profile")})
    devices = sorted({(r.get("device") or {}).get("name") for r in recs if (r.get("device") or {}).get("name")})
    if len(profiles) > 1:
        rd.problems.append(f"{rd.label} mixes profiles ({', '.join(profiles)}): a run folder holds one profile; "
                           "rows show their own")
    if len(devices) > 1:
        rd.problems.append(f"{rd.label} mixes machines ({', '.join(devices)}): a run folder holds one machine; "
                           "rows show their own")
    return rd


# --- rows and ratios ----------------------------------------------------------------------------

def variant_of(rec: dict) -> str:
    f = rec.get("fields") or {}
    return ", ".join(f"{k}={f[k]}" for k in sorted(f))


def rows(rd: RunData, workload: str, metric: str, steps: list[str] | None = None) -> list[dict]:
    """One row per step and variant of ``metric`` for ``workload`` (newest record wins), in ladder
    order: step, variant, value, p20, p80, unit, status, reason, profile, device, telemetry."""
    best: dict = {}
    # The timed window's telemetry sits on its ms_per_step record; every metric of that window shows it.
    window = {(str(r.get("step")), variant_of(r)): r["telemetry"] for r in rd.records
              if r.get("workload") == workload and r.get("metric") == "ms_per_step" and "telemetry" in r}
    for r in rd.records:
        if r.get("workload") != workload or r.get("metric") != metric:
            continue
        if steps is not None and str(r.get("step")) not in steps:
            continue
        key = (str(r.get("step")), variant_of(r))
        if key not in best or (r.get("time") or "") >= (best[key].get("time") or ""):
            best[key] = r
    order = {s: n for n, s in enumerate(_ordered({k[0] for k in best}))}
    out = []
    for (step, var), r in sorted(best.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        out.append({"step": step, "variant": var, "value": _num(r.get("value")), "p20": _num(r.get("p20")),
                    "p80": _num(r.get("p80")), "unit": r.get("unit") or "", "status": r.get("status", "ok"),
                    "reason": r.get("reason"), "profile": r.get("profile"),
                    "device": (r.get("device") or {}).get("name"),
                    "telemetry": explain(r.get("telemetry", window.get((step, var)))) if "telemetry" in r
                    or (step, var) in window else None})
    return out


def band(a: dict, b: dict) -> tuple[float | None, float | None]:
    """The p20-p80 band of the ratio a/b: [a_p20 / b_p80, a_p80 / b_p20]; (None, None) unknown."""
    if None in (a.get("p20"), a.get("p80"), b.get("p20"), b.get("p80")) or not b["p80"] or not b["p20"]:
        return None, None
    return a["p20"] / b["p80"], a["p80"] / b["p20"]


def compare(run_rows: list[dict], ref_rows: list[dict]) -> list[dict]:
    """Each row of the run against the reference's row of the same step and variant (else the
    reference's ladder row of that step): ratio = run / reference, its noise band, and whether the
    band holds 1. Rows without a counterpart or a value are left out."""
    by = {(r["step"], r["variant"]): r for r in ref_rows}
    out = []
    for a in run_rows:
        b, against = by.get((a["step"], a["variant"])), "same variant"
        if b is None and a["variant"]:
            b, against = by.get((a["step"], "")), "the reference's ladder row"
        if b is None or a["value"] is None or not b["value"]:
            continue
        ratio = a["value"] / b["value"]
        lo, hi = band(a, b)
        if lo is None:
            verdict = "no spread recorded"
        elif lo <= 1.0 <= hi:
            verdict = "within noise"
        else:
            verdict = "higher" if lo > 1.0 else "lower"
        out.append({"step": a["step"], "variant": a["variant"], "run": a["value"], "reference": b["value"],
                    "unit": a["unit"], "ratio": ratio, "band_lo": lo, "band_hi": hi, "verdict": verdict,
                    "against": against})
    return out


def problems(rd: RunData, ref: RunData | None, workload: str | None, metric: str | None) -> tuple[list[str], bool]:
    """What to say about this selection, and whether ratios may be shown (same profile)."""
    out = list(rd.problems) + (list(ref.problems) if ref is not None else [])
    comparable = ref is not None and bool(rd.records) and bool(ref.records)
    if not workload:
        out.append(f"{rd.label} has no workload with numeric records")
        return out, False
    if metric and rd.records and not rows(rd, workload, metric):
        out.append(f"{rd.label} has no record of {metric!r} for {workload}")
    if ref is not None and ref.records:
        if metric and not rows(ref, workload, metric):
            out.append(f"{ref.label} has no record of {metric!r} for {workload}")
        if rd.profile and ref.profile and rd.profile != ref.profile:
            out.append(f"not compared: {rd.label} is the {rd.profile} profile and {ref.label} the {ref.profile} "
                       "profile (different sizes: a ratio would mean nothing)")
            comparable = False
        elif rd.device and ref.device and rd.device != ref.device and comparable:
            out.append(f"comparing {rd.device} ({rd.label}) with {ref.device} ({ref.label})")
    return out, comparable


# --- rendering ----------------------------------------------------------------------------------

def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)


ROW_COLUMNS = ("step", "variant", "value", "p20", "p80", "unit", "status", "telemetry")
COMPARE_COLUMNS = ("step", "variant", "run", "reference", "unit", "ratio", "band_lo", "band_hi", "verdict", "against")


def html_table(table: list[dict], columns, caption: str = "") -> str:
    if not table:
        return f"<p><i>{html.escape(caption + ': ' if caption else '')}nothing to show</i></p>"
    head = "".join(f"<th style='text-align:left;padding:2px 6px'>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td style='padding:2px 6px'>{html.escape(_cell(r.get(c)))}</td>" for c in columns)
                   + "</tr>" for r in table)
    cap = f"<caption style='text-align:left;font-weight:bold'>{html.escape(caption)}</caption>" if caption else ""
    return f"<table class='hwlib-table' style='border-collapse:collapse;font-size:12px'>{cap}<tr>{head}</tr>{body}</table>"


def markdown_table(table: list[dict], columns) -> str:
    if not table:
        return "_nothing to show_"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)).replace("|", "/") for c in columns) + " |" for r in table]
    return "\n".join(lines)


def _label(r: dict) -> str:
    return r["step"].split("_")[0] + (f"\n{r['variant']}" if r["variant"] else "")


def figure(run_rows: list[dict], cmp_rows: list[dict] | None, *, title: str, metric: str):
    """The run's values (p20-p80 bars), and beside them the ratios to the reference with their
    noise bands when there is a comparison."""
    import matplotlib.pyplot as plt
    two = bool(cmp_rows)
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(11 if two else 6.5, 3.4), squeeze=False)
    a = axes[0][0]
    ok = [r for r in run_rows if r["value"] is not None]
    if ok:
        x = range(len(ok))
        err = [[r["value"] - r["p20"] if r["p20"] is not None else 0 for r in ok],
               [r["p80"] - r["value"] if r["p80"] is not None else 0 for r in ok]]
        a.bar(x, [r["value"] for r in ok], yerr=err, capsize=3, color="#1f77b4")
        a.set_xticks(list(x), [_label(r) for r in ok], fontsize=7)
        a.set_ylabel(f"{metric} ({ok[0]['unit']})", fontsize=8)
    else:
        a.text(0.5, 0.5, "no values", ha="center", va="center", transform=a.transAxes)
    a.set_title(title, fontsize=9)
    if two:
        b = axes[0][1]
        x = list(range(len(cmp_rows)))
        ratio = [r["ratio"] for r in cmp_rows]
        lo = [r["ratio"] - r["band_lo"] if r["band_lo"] is not None else 0 for r in cmp_rows]
        hi = [r["band_hi"] - r["ratio"] if r["band_hi"] is not None else 0 for r in cmp_rows]
        b.errorbar(x, ratio, yerr=[lo, hi], fmt="o", capsize=4, color="#d62728")
        b.axhline(1.0, color="k", lw=0.8)
        b.set_xticks(x, [_label(r) for r in cmp_rows], fontsize=7)
        b.set_ylabel("run / reference", fontsize=8)
        b.set_title("ratio per step, with the p20-p80 noise band", fontsize=9)
    fig.tight_layout()
    return fig


def png(fig, dpi: int = 80) -> bytes:
    """A figure as PNG bytes (closed afterwards)."""
    import io

    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return buf.getvalue()


# --- the widget ---------------------------------------------------------------------------------

class Explorer:
    """Dropdowns for run, reference, workload and metric, a step selector, a message line, the
    table and the plot; every change redraws them. ``run``: the run shown first (default: the
    current run, ``HWLIB_RUN``); ``reference``: the run it is compared with ('auto': this machine's
    committed reference, else the H100's; None: no comparison)."""

    def __init__(self, run=None, reference="auto", *, workload: str | None = None, metric: str = "ms_per_step"):
        if reference is not None and not isinstance(reference, (str, Path)):
            raise TypeError(f"reference must be a run name, a folder, 'auto' or None, got {type(reference).__name__}")
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a metric's name, got {metric!r}")
        self.runs = find_runs()
        self.run_label = run_name(run)
        self.runs.setdefault(self.run_label, outputs_root() / self.run_label)
        if reference == "auto":
            ref = default_run()
            reference = next((k for k, v in self.runs.items() if Path(v).resolve() == ref.resolve()), None)
            if reference is None and (ref / query.RESULTS_FILE).exists():
                reference = f"reference/{ref.name}"
                self.runs[reference] = ref
        elif reference is not None:
            reference = str(reference)
            self.runs.setdefault(reference, outputs_root() / run_name(reference) if not Path(reference).is_absolute()
                                 else Path(reference))
        self.ref_label = reference
        self._cache: dict[str, RunData] = {}
        self.workload, self.metric, self.steps = workload, metric, None
        self.messages: list[str] = []
        self.table: list[dict] = []
        self.comparison: list[dict] = []
        self.widgets = None
        self._busy = False
        self._select_defaults()

    def data(self, label: str | None) -> RunData | None:
        if label in (None, NONE):
            return None
        if label not in self._cache:
            self._cache[label] = load_run(self.runs.get(label, label), label=label)
        return self._cache[label]

    def _select_defaults(self) -> None:
        rd, ref = self.data(self.run_label), self.data(self.ref_label)
        workloads = rd.workloads() or (ref.workloads() if ref else [])
        if self.workload not in workloads:
            self.workload = workloads[0] if workloads else None

    def options(self) -> dict:
        """What each selector offers for the current run, reference and workload."""
        rd, ref = self.data(self.run_label), self.data(self.ref_label)
        both = [rd] + ([ref] if ref else [])
        wls = list(dict.fromkeys(w for d in both for w in d.workloads()))
        metrics = list(dict.fromkeys(m for d in both for m in d.metrics(self.workload))) if self.workload else []
        if self.metric and self.metric not in metrics:
            metrics.append(self.metric)   # kept selectable, and said to be missing in place
        steps = _ordered({s for d in both for s in d.steps(self.workload)}) if self.workload else []
        units = {k: v for d in reversed(both) for k, v in (d.units(self.workload) if self.workload else {}).items()}
        # The dropdown shows each metric with its unit ("ms_per_step (ms)") and selects the metric's name.
        labels = [(f"{m} ({units[m]})" if m in units else m, m) for m in metrics]
        return {"runs": list(self.runs), "references": [NONE] + list(self.runs), "workloads": wls,
                "metrics": metrics, "metric_labels": labels, "steps": steps}

    def update(self) -> None:
        """Recompute messages, table and comparison for the current selection; never raises."""
        try:
            rd, ref = self.data(self.run_label), self.data(self.ref_label)
            msgs, comparable = problems(rd, ref, self.workload, self.metric)
            self.table = rows(rd, self.workload, self.metric, self.steps) if self.workload else []
            if comparable and ref is not None:
                self.comparison = compare(self.table, rows(ref, self.workload, self.metric, self.steps))
                if not self.comparison and self.table:
                    msgs.append(f"no step of {self.workload} has {self.metric!r} in both {rd.label} and {ref.label}")
            else:
                self.comparison = []
            self.messages = list(dict.fromkeys(msgs))   # a run compared with itself says each thing once
        except Exception as e:   # said in place: the panel keeps working
            self.table, self.comparison = [], []
            self.messages = [f"could not read this selection ({type(e).__name__}: {e})"]

    def title(self) -> str:
        return f"{self.workload or '-'} · {self.metric} · {self.run_label}"

    def html(self) -> str:
        msg = "".join(f"<div style='color:#b35900'>{html.escape(m)}</div>" for m in self.messages)
        parts = [msg, html_table(self.table, ROW_COLUMNS, f"{self.run_label}: {self.metric}")]
        if self.ref_label not in (None, NONE):
            parts.append(html_table(self.comparison, COMPARE_COLUMNS, f"{self.run_label} / {self.ref_label}"))
        return "".join(parts)

    # --- widgets ---------------------------------------------------------------------------------

    def widget(self):
        """The panel (built once)."""
        if self.widgets is not None:
            return self.widgets["panel"]
        from ..extras import require
        w = require("ipywidgets", "the explorer's panel")
        opts = self.options()
        dd = dict(style={"description_width": "initial"}, layout=w.Layout(width="auto"))
        sel = {
            "run": w.Dropdown(options=opts["runs"], value=self.run_label, description="run", **dd),
            "reference": w.Dropdown(options=opts["references"], value=self.ref_label or NONE,
                                    description="compare with", **dd),
            "workload": w.Dropdown(options=opts["workloads"], value=self.workload, description="workload", **dd),
            "metric": w.Dropdown(options=opts["metric_labels"], value=self.metric, description="metric", **dd),
            "steps": w.SelectMultiple(options=opts["steps"], value=tuple(opts["steps"]), description="steps",
                                      rows=min(8, max(2, len(opts["steps"]))), **dd),
        }
        for name, widget in sel.items():
            widget.add_class(f"hwlib-explorer-{name}")
        out = w.HTML(value="")
        out.add_class("hwlib-explorer-table")
        plot = w.Image(format="png", layout=w.Layout(max_width="100%"))   # bytes: drawn the same with or without a kernel
        plot.add_class("hwlib-explorer-plot")
        panel = w.VBox([w.HBox([sel["run"], sel["reference"]]), w.HBox([sel["workload"], sel["metric"]]),
                        sel["steps"], out, plot])
        panel.add_class("hwlib-explorer")
        self.widgets = {**sel, "table": out, "plot": plot, "panel": panel}
        for name in sel:
            sel[name].observe(lambda change, name=name: self._on_change(name, change["new"]), names="value")
        self._redraw()
        return panel

    def _on_change(self, name: str, value) -> None:
        if self._busy:   # options being reset below fire their own changes: one redraw for all
            return
        try:
            if name == "run":
                self.run_label = value
            elif name == "reference":
                self.ref_label = None if value == NONE else value
            elif name == "workload":
                self.workload = value
            elif name == "metric":
                self.metric = value
            elif name == "steps":
                self.steps = list(value) if value else None
            if name in ("run", "reference", "workload"):
                self._reset_options()
        except Exception as e:
            self.messages = [f"could not apply {name}={value!r} ({type(e).__name__}: {e})"]
        self._redraw()

    def _reset_options(self) -> None:
        self._busy = True
        try:
            opts = self.options()
            wd = self.widgets
            if self.workload not in opts["workloads"] and opts["workloads"]:
                self.workload = opts["workloads"][0]
                opts = self.options()
            wd["workload"].options = opts["workloads"]
            wd["workload"].value = self.workload if self.workload in opts["workloads"] else None
            wd["metric"].options = opts["metric_labels"]
            wd["metric"].value = self.metric if self.metric in opts["metrics"] else None
            wd["steps"].options = opts["steps"]
            wd["steps"].value = tuple(opts["steps"])
            self.steps = None
        finally:
            self._busy = False

    def _redraw(self) -> None:
        self.update()
        wd = self.widgets
        wd["table"].value = self.html()
        try:
            wd["plot"].value = png(figure(self.table, self.comparison, title=self.title(), metric=self.metric)) \
                if self.table else b""
        except Exception as e:   # said in place, in the table area
            wd["table"].value = (f"<div style='color:#b35900'>could not draw the plot ({html.escape(type(e).__name__)}: "
                                 f"{html.escape(str(e))})</div>" + self.html())

    def show(self, static: bool = True) -> "Explorer":
        """Display the panel and (``static``) a static copy of the first selection below it: a
        table and a figure, which is what a papermill run keeps."""
        from IPython.display import Markdown, display
        from ..extras import MissingExtra
        try:
            display(self.widget())
        except MissingExtra as e:   # the static copy below needs no widgets
            display(Markdown(f"*{e}*"))
        if static:
            self.update()
            display(Markdown(self.static_markdown()))
            if self.table:
                import matplotlib.pyplot as plt
                fig = figure(self.table, self.comparison, title=self.title(), metric=self.metric)
                display(fig)
                plt.close(fig)
        return self

    def static_markdown(self) -> str:
        text = [f"**Static copy of the explorer's selection** ({self.title()})", ""]
        text += [f"- {m}" for m in self.messages] + ([""] if self.messages else [])
        text.append(markdown_table(self.table, ROW_COLUMNS))
        if self.ref_label not in (None, NONE):
            text += ["", f"**{self.run_label} / {self.ref_label}**", "", markdown_table(self.comparison, COMPARE_COLUMNS)]
        return "\n".join(text)
