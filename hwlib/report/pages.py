"""The generated parts of README.md and docs/results.md, rebuilt by ``hwlib readme``; nothing typed.

A page holds any of the blocks below, each between its pair of markers; ``render_page`` rebuilds
every block it finds. The README keeps what a reader takes in first (the two commands and how long
they took, one line and one figure per workload) and the steps retired from the ladder; docs/results.md holds the long tables (every
ladder, the toggles, several GPUs, the smaller profile's run, the first look's times, the seeds'
claims).

Links are absolute (``source.REPOSITORY`` at ``source.NOTEBOOK_REF``): the README is also the
package's long description, read on the package index where a relative link leads nowhere; the
results page uses the same links, so that one block reads the same in either file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .. import query, results
from ..paths import REPO_ROOT, read_dir
from ..query import _num, reference_runs
from ..series import order_names
from ..steps import uses_fp8
from . import tables
from .tables import (CLAIMS_END, CLAIMS_START, FIRST_END, FIRST_LOOK_RUNS, FIRST_START, README_END, README_START,
                     RETIRED_END, RETIRED_START, SMALL_END, SMALL_START, claims_block, first_look_block, raw_url,
                     readme_block, repo_url, retired_block, small_gpu_block)

GLANCE_START, GLANCE_END = "<!-- glance:start -->", "<!-- glance:end -->"
COMMANDS_START, COMMANDS_END = "<!-- commands:start -->", "<!-- commands:end -->"
REFERENCE_RUN = "reference/h100"   # the full series on the reference GPU: the README's numbers
RESULTS_PAGE = REPO_ROOT / "docs" / "results.md"


def repo_path(folder: Path) -> str:
    """``folder`` as a path inside the repository ('outputs/reference/h100'); a folder outside it
    (a test's scratch run) by its name under outputs/."""
    folder = Path(folder).resolve()
    root = REPO_ROOT.resolve()
    if root in folder.parents:
        return Path(os.path.relpath(folder, root)).as_posix()
    return f"outputs/{folder.name}"


# --- results at a glance ---------------------------------------------------------------------------

def _sol_share(recs: list[dict], workload: str, step: str) -> float | None:
    """The share of the speed of light notebook 16 measured for ``step`` (its whole-step ``sol_share``
    record, not a category's), or None where it did not profile that step."""
    found = [r for r in recs if r.get("metric") == "sol_share" and r.get("workload") == workload
             and r.get("step") == step and not r.get("fields") and r.get("status", "ok") == "ok"]
    return _num(found[-1].get("value")) if found else None


def sibling_runs(run: str) -> list[str]:
    """The committed runs of the same machine beside ``run`` (``reference/h100-anchor`` beside
    ``reference/h100``): studies run on their own, whose peers the glance shows too."""
    name = Path(run).name
    return [r for r in reference_runs() if Path(r).name.startswith(f"{name}-")]


def _step_floor(recs: list[dict], workload: str, step: str) -> dict | None:
    """Notebook 16's floor of ``step`` (its ``floor_ms`` record of part "step": the longer of its model
    FLOPs at the matmul ceiling and its bytes at the copy bandwidth) beside the profiled step's time
    (``step_ms``), or None where it did not count one."""
    def last(metric, **fields):
        found = [r for r in recs if r.get("metric") == metric and r.get("workload") == workload
                 and r.get("step") == step and (r.get("fields") or {}) == fields and r.get("status", "ok") == "ok"
                 and _num(r.get("value")) is not None]
        return found[-1] if found else None
    floor, took = last("floor_ms", part="step"), last("step_ms", window="unprofiled")
    if floor is None or took is None:
        return None
    return {"floor_ms": _num(floor["value"]), "step_ms": _num(took["value"]),
            "bound": (floor.get("params") or {}).get("bound")}


def _own_first(read, recs: list[dict], beside: list[dict], workload: str, step: str):
    """``read`` of the run's own records, or where they have none of it, of the sibling runs' too."""
    mine = read(recs, workload, step)
    return mine if mine is not None else read(beside, workload, step)


def peers(recs: list[dict], workload: str) -> list[dict]:
    """Other projects' code measured beside the lab's in the same process (an anchor: e.g. transformers'
    BERT beside the NLI encoder, llm.c beside GPT-2): each ``anchor_over_lab`` record of ``workload``
    (its step names the anchor; its value is the anchor's time over that of the lab step its params name
    ``against``, with the interval of the interleaved windows), with the anchor's own throughput."""
    thr = {(r.get("step"), r.get("notebook")): r for r in recs if str(r.get("metric", "")).endswith("_per_s")
           and (r.get("fields") or {}) and r.get("workload") == workload}
    out = []
    for r in recs:
        p = r.get("params") or {}
        if (r.get("metric") != "anchor_over_lab" or r.get("workload") != workload or r.get("status", "ok") != "ok"
                or _num(r.get("value")) is None or not p.get("against")):
            continue
        iv = p.get("interval") or {}
        t = thr.get((r.get("step"), r.get("notebook"))) or {}
        out.append({"peer": r.get("step"), "what": p.get("what") or r.get("step"), "ratio": _num(r["value"]),
                    "lo": _num(iv.get("lo")), "hi": _num(iv.get("hi")), "against": p["against"],
                    "notebook": r.get("notebook"), "throughput": _num(t.get("value")), "unit": t.get("unit")})
    return out


def glance_rows(run=REFERENCE_RUN) -> list[dict]:
    """Per workload of the run's summary: its first measured step, its fastest step without FP8 (the
    fastest of all where it has no FP8 step), the FP8 branch's fastest where that is faster still, the
    share of the speed of light notebook 16 measured for the fastest step, and the peers measured
    beside it. Only steps whose status is ok count."""
    s = tables.summary(run)
    recs = query.load(run)
    beside = recs + [r for other in sibling_runs(run) for r in query.load(other)]
    out = []
    for w, body in s["workloads"].items():
        ok = [x for x in body["steps"] if x["status"] == "ok" and _num(x.get("throughput"))]
        if not ok:
            continue
        exact = [x for x in ok if not uses_fp8(x["step"])]
        best = max(exact or ok, key=lambda x: x["throughput"])
        fp8 = max((x for x in ok if uses_fp8(x["step"])), key=lambda x: x["throughput"], default=None)
        out.append({"workload": w, "base": ok[0], "best": best, "fp8_exists": any(uses_fp8(x["step"]) for x in ok),
                    "fp8": fp8 if fp8 and fp8["throughput"] > best["throughput"] else None,
                    "sol_share": _own_first(_sol_share, recs, beside, w, best["step"]),
                    "floor": _own_first(_step_floor, recs, beside, w, best["step"]),
                    "peers": peers(beside, w)})
    return out


def glance_line(g: dict) -> str:
    base, best = g["base"], g["best"]
    unit = best["unit"]
    which = "its fastest step without FP8" if g["fp8_exists"] else "its fastest step"
    parts = [f"**{g['workload']}**: {base['throughput']:,.0f} -> {best['throughput']:,.0f} {unit}, "
             f"{base['step']} -> {best['step']} ({which}): **{best['throughput'] / base['throughput']:.2f}x**"]
    if best.get("mfu") is not None:
        parts.append(f"MFU {best['mfu']:.1%}")
    if g["sol_share"] is not None:
        parts.append(f"{g['sol_share']:.0%} of the speed of light (notebook 16)")
    if g.get("floor"):
        f = g["floor"]
        parts.append(f"its step floor {f['floor_ms']:.1f} ms ({f['bound'] or 'FLOPs or bytes'}-bound, notebook 16) "
                     f"against {f['step_ms']:.1f} ms profiled: {f['step_ms'] / f['floor_ms']:.1f}x above it")
    text = "; ".join(parts) + "."
    if g["fp8"]:
        f = g["fp8"]
        text += f" The FP8 branch's fastest, {f['step']}: {f['throughput'] / base['throughput']:.2f}x."
    for p in g["peers"]:
        iv = f" ({p['lo']:.2f}-{p['hi']:.2f})" if p["lo"] is not None and p["hi"] is not None else ""
        own = f", {p['throughput']:,.0f} {p['unit']}" if p["throughput"] is not None else ""
        # The peer was timed beside the step its record names, which need not be the fastest one above.
        text += (f" Measured beside {p['against']} in one process (notebook {p['notebook']}): {p['what']}{own}; "
                 f"{p['against']} runs {p['ratio']:.2f}x{iv} as fast.")
    return text


def glance_block(run=REFERENCE_RUN) -> str:
    """The README's results at a glance: one line per workload and its ladder figure, from the run's
    summary (``tables.summary``, what summary.json holds) and figures."""
    folder = read_dir(run)
    recs = query.load(run)
    where = repo_path(folder)
    dev = tables._device_name(recs)
    prof = next((r.get("profile") for r in recs if r.get("profile")), "?")
    lines = [tables.caveat_line(tables.records_caveat(recs)).rstrip(),
             f"Measured on **{dev}** ({prof} profile), from fp32 eager (step 01) to the fastest step whose status "
             f"is ok (its loss curve stayed within its tolerance of the step before); MFU: model FLOP/s over the "
             f"bf16 matmul ceiling measured on the same GPU. Source: [`{where}/summary.json`]({repo_url(where + '/summary.json')}); every "
             f"step of every ladder: [docs/results.md]({repo_url('docs/results.md')}).", ""]
    for g in glance_rows(run):
        lines += [f"- {glance_line(g)}", ""]
        fig = f"{where}/figures/{g['workload']}_ladder.png"
        if (folder / "figures" / f"{g['workload']}_ladder.png").is_file():
            lines += [f"  [![{g['workload']}: throughput per step, and time per step against its floor]"
                      f"({raw_url(fig)})]({repo_url(fig)})", ""]
    if (decode := decode_glance_line()):
        lines += [f"- {decode}", ""]
    if (cycle := cycle_glance_line()):
        lines += [f"- {cycle}", ""]
    return "\n".join(lines).strip()


def decode_glance_line(runs=tables.DECODE_RUNS) -> str | None:
    """One line for the generation workload's decode step: per machine that measured the fused decode
    ladder, each model size's fastest rung, its time and share of the copy ceiling; None without rows."""
    parts = []
    for run in runs:
        rows = tables.decode_rows(run)
        best = {}
        for r in rows:
            if r["model_size"] not in best or r["ms"] < best[r["model_size"]]["ms"]:
                best[r["model_size"]] = r
        if best:
            parts.append(f"on {next(iter(best.values()))['device'] or '?'}, " + "; ".join(
                f"{size} {r['ms']:.2f} ms per decode step of 12 rows ({r['rung']}), {tables._fmt(r.get('share'), '.0%')} "
                f"of the copy ceiling" for size, r in best.items()))
    if not parts:
        return None
    return ("**polychromic decode** (notebook 14's generation, the fused decode ladder): " + "; ".join(parts)
            + f". Every rung: [docs/results.md]({repo_url('docs/results.md')}).")


def cycle_glance_line(runs=tables.CYCLE_RUNS) -> str | None:
    """One line for the trainer's cycle: per machine and model size, its slowest and fastest rung measured
    (seconds per cycle); None without rows."""
    by: dict = {}
    for run in runs:
        for r in tables.cycle_rows(run):
            by.setdefault(r["device"] or "?", {}).setdefault(r["model_size"], []).append(r)
    if not by:
        return None
    parts = []
    for device, sizes in by.items():
        each = []
        for size, rows in sizes.items():
            slow, fast = max(rows, key=lambda r: r["s"]), min(rows, key=lambda r: r["s"])
            each.append(f"{size} {slow['s']:.1f} s per cycle at {slow['rung']}, {fast['s']:.2f} s at {fast['rung']}")
        parts.append(f"on {device}, " + "; ".join(each))
    return ("**polychromic trainer cycle** (five LoRA steps and one diversity bonus, every rung): " + "; ".join(parts)
            + f". Every rung: [docs/results.md]({repo_url('docs/results.md')}).")


# --- the two commands and how long they took -------------------------------------------------------

def _took(run) -> dict | None:
    """What a run's state.json says of it: notebooks, their seconds added up, its device and profile."""
    state = query.state(run)
    nbs = order_names(k for k in state if not k.startswith("_"))
    if not nbs:
        return None
    secs = sum(_num(state[k].get("seconds")) or 0.0 for k in nbs)
    recs = query.load(run)
    return {"notebooks": nbs, "seconds": secs, "device": state.get("_device") or tables._device_name(recs),
            "profile": state.get("_profile"), "where": repo_path(read_dir(run))}


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" + (f" ({seconds / 60:.0f} min)" if seconds >= 120 else "")


def commands_block(run=REFERENCE_RUN, first=FIRST_LOOK_RUNS) -> str:
    """The first look and the whole series, each with the notebooks its reference run ran and how long
    they took (state.json's seconds per notebook, added up), on which machine: the first look once per
    reference run of it that exists (``first``: its runs)."""
    rows = ["| command | what it runs | how long it took |", "|---|---|---|"]
    firsts = [(r, _took(r)) for r in first]
    firsts = [f for f in firsts if f[1] is not None] or firsts[:1]
    for cmd, t, how in ([("`make first-look` (`hwlib first-look`)", t, "from cold caches") for _, t in firsts]
                        + [("`make reproduce` (`hwlib reproduce`)", _took(run), "the notebooks' seconds added up")]):
        if t is None:
            rows.append(f"| {cmd} | - | no reference run yet |")
            continue
        what = (", ".join(t["notebooks"]) if len(t["notebooks"]) <= 6
                else f"the whole series: {len(t['notebooks'])} notebooks, from {t['notebooks'][0]} to {t['notebooks'][-1]}")
        rows.append(f"| {cmd} | {what} | {_minutes(t['seconds'])} on {t['device']} ({t['profile'] or '?'} profile), "
                    f"{how}: [`{t['where']}`]({repo_url(t['where'] + '/state.json')}) |")
    return "\n".join(rows)


# --- pages -----------------------------------------------------------------------------------------

def blocks(run) -> list[tuple[str, str, object]]:
    """(start marker, end marker, builder of its text) of every generated block."""
    return [(README_START, README_END, lambda: readme_block(run)),
            (CLAIMS_START, CLAIMS_END, lambda: claims_block(run)),
            (SMALL_START, SMALL_END, lambda: small_gpu_block(reference_runs())),
            (FIRST_START, FIRST_END, first_look_block),
            (GLANCE_START, GLANCE_END, lambda: glance_block(run)),
            (COMMANDS_START, COMMANDS_END, lambda: commands_block(run)),
            (RETIRED_START, RETIRED_END, lambda: retired_block(run))]


def _between(text: str, start: str, end: str, body: str) -> str:
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    return pat.sub(lambda _: start + "\n" + body + "\n" + end, text)


def render_page(text: str, run) -> str:
    """``text`` (README.md or docs/results.md) with every generated block it marks rebuilt from ``run``.
    A ValueError names a marker without its pair, or says that the page marks no block at all."""
    found = 0
    for start, end, build in blocks(run):
        if (start in text) != (end in text):
            raise ValueError(f"markers {start} ... {end}: one is missing")
        if start in text:
            text = _between(text, start, end, build())
            found += 1
    if not found:
        raise ValueError("markers not found: no generated block (" +
                         ", ".join(s for s, _, _ in blocks(run)) + ")")
    return text


def update_page(page: str | Path, run) -> bool:
    """Rebuild a page's generated blocks from ``run`` (``render_page``); True when the file changed."""
    p = Path(page)
    text = p.read_text(encoding="utf-8")
    try:
        new = render_page(text, run)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    if new != text:
        results.write_atomic(p, new)
        return True
    return False

