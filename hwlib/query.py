"""The one reader of results: records, ceilings, saved curves and run state, read back robustly.

Everything that reads a run (tables, figures, the README, claims, the audit, notebooks, the CLI,
dashboards) reads it through here. Nothing below the edge reads results back: runners are handed
what they compare with.

Damaged files never crash a reader: a line of ``results.jsonl`` that is not UTF-8, not JSON, not an
object, lacks ``metric`` or carries a value that is neither a number, a string nor null is skipped;
a damaged JSON file reads as absent. Each damaged file gets one warning naming it and its lines.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

from .paths import REPO_ROOT, read_dir
from .results import STAMP_FIELDS, record_key
from .steps import LADDER, STEP_NAMES, chain

RESULTS_FILE = "results.jsonl"


def reference_runs() -> list[str]:
    """Every committed reference run (``reference/<machine>``, a folder with records), in name order."""
    base = REPO_ROOT / "outputs" / "reference"
    return sorted(f"reference/{d.name}" for d in base.iterdir() if (d / RESULTS_FILE).is_file()) \
        if base.is_dir() else []


def _valid(rec) -> str | None:
    """Why a parsed line is not a record, else None."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    if not isinstance(rec.get("metric"), str) or not rec["metric"]:
        return "no 'metric'"
    v = rec.get("value")
    if v is not None and not isinstance(v, (int, float, str)) or isinstance(v, bool):
        return f"value {v!r} is not a number, a string or null"
    return None


def read_records(path: str | Path) -> list[dict]:
    """Every valid record of a ``results.jsonl``, in file order, each with its stamp put back from the
    stamp line it names (``results.pack``); bad lines skipped with one warning."""
    path = Path(path)
    if not path.exists():
        return []
    recs, bad, kept, stamps = [], [], [], {}
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append((n, "not UTF-8"))
            continue
        except json.JSONDecodeError:
            # Only the last line of a file can be torn by a killed writer (appends are single writes).
            bad.append((n, "torn (no newline: a writer was interrupted)" if n == len(lines) else "not JSON"))
            continue
        if isinstance(rec, dict) and "stamp" in rec and "metric" not in rec:   # a stamp line (results.pack)
            if isinstance(rec["stamp"], str) and all(isinstance(rec.get(k), dict) for k in STAMP_FIELDS):
                stamps[rec["stamp"]] = {k: rec[k] for k in STAMP_FIELDS}
            else:
                bad.append((n, "a stamp line without its fields"))
            continue
        why = _valid(rec)
        if why:
            bad.append((n, why))
            continue
        if "stamp" in rec:
            st = stamps.get(rec.pop("stamp"))
            if st is None:   # kept: its value stands, only where it ran is unknown
                kept.append(n)
            else:
                rec.update(copy.deepcopy(st))
        recs.append(rec)
    if bad or kept:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        lost = (f"; {len(kept)} record(s) kept without device and versions, their stamp line missing "
                f"(line {', '.join(map(str, kept[:5]))}{', ...' if len(kept) > 5 else ''})") if kept else ""
        warnings.warn(f"{path}: skipped {len(bad)} damaged line(s){': ' + shown if bad else ''}{lost}", stacklevel=3)
    return recs


def load(run=None, *, latest_only: bool = True) -> list[dict]:
    """Records of a run; with ``latest_only`` a re-measured key (``results.record_key``: notebook,
    workload, step, metric and the measurement's fields) keeps only its newest record."""
    recs = read_records(read_dir(run) / RESULTS_FILE)
    if not latest_only:
        return recs
    latest: dict = {}
    for r in recs:
        latest[record_key(r)] = r
    return list(latest.values())


def select(records: list[dict], **match) -> list[dict]:
    """Records whose top-level keys, or ``fields`` entries, equal every ``match`` value."""
    def ok(r):
        f = r.get("fields") or {}
        return all((f[k] if k in f else r.get(k)) == v for k, v in match.items())
    return [r for r in records if ok(r)]


def read_json(path: str | Path, default=None):
    """A JSON file's content; ``default`` when it is missing or damaged (one warning when damaged)."""
    path = Path(path)
    if not path.exists():
        return default
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        warnings.warn(f"{path}: damaged ({type(e).__name__}: {e}); treated as absent", stacklevel=2)
        return default


def ceilings(run=None) -> dict | None:
    """This run's measured ceilings (``ceilings.json``), or None when not measured or damaged."""
    c = read_json(read_dir(run) / "ceilings.json")
    if c is not None and not (isinstance(c, dict) and isinstance(c.get("matmul_tflops"), dict)):
        warnings.warn(f"{read_dir(run) / 'ceilings.json'}: not a ceilings object; treated as absent",
                      stacklevel=2)
        return None
    return c


def saved_curve(workload: str, step: str, key: dict, run=None) -> list[float] | None:
    """This run's saved check losses of ``step``, when made with ``key`` (config, seed, device, K:
    ``ladder.record.curve_key``); else None. A damaged curve file reads as absent."""
    saved = read_json(read_dir(run) / "curves" / workload / f"{step}.json")
    if not isinstance(saved, dict) or {k: saved.get(k) for k in key} != key:
        return None
    losses = saved.get("losses")
    if not isinstance(losses, list) or not all(isinstance(v, (int, float)) for v in losses):
        return None
    return [float(v) for v in losses]


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def workloads_in(records: list[dict]) -> list[str]:
    """Workloads with ladder rows, in order of first appearance."""
    seen = []
    for r in records:
        w = r.get("workload")
        if w and r.get("step") in STEP_NAMES and not r.get("fields") and w not in seen:
            seen.append(w)
    return seen


def ladder_rows(records: list[dict], workload: str) -> list[dict]:
    """One dict per measured ladder step of ``workload``, in ladder order, with speed-ups against
    the first measured step and the one before. Records with fields (variants, studies) are not
    ladder rows."""
    by_step: dict[str, dict] = {}
    for r in records:
        if r.get("workload") != workload or r.get("step") not in STEP_NAMES or r.get("fields"):
            continue
        by_step.setdefault(r["step"], {})[r["metric"]] = r
    rows = []
    base = None
    measured: dict[str, float] = {}   # step -> throughput, for "x vs prev" along each step's chain
    for st in LADDER:
        m = by_step.get(st.name)
        if not m or "ms_per_step" not in m:
            # every ladder measurement records its step time (n/a and skipped ones too); a step with other
            # records only (notebook 16's breakdown of a step the ladder has not run) is not a ladder row
            continue
        ms = m["ms_per_step"]
        if ms.get("measurement"):   # only metrics of the same measurement as the newest step time
            m = {k: v for k, v in m.items() if v.get("measurement") in (None, ms["measurement"])}
        status = ms.get("status", "ok")
        if status == "ok" and ms.get("contended"):   # timed beside another GPU process: never a clean ok
            status = "contended"
        check = m.get("same_math_max_rel")
        if check and check.get("status") == "failed":
            status = "math changed"
        row = {"step": st.name, "change": st.title, "status": status, "reason": ms.get("reason"),
               "ms_per_step": _num(ms.get("value")), "ms_p20": _num(ms.get("p20")), "ms_p80": _num(ms.get("p80"))}
        for k in ("model_tflops", "mfu", "peak_mem_gib", "final_loss", "compile_s"):
            row[k] = _num(m.get(k, {}).get("value"))
        row["mfu_reason"] = m.get("mfu", {}).get("reason")
        # "fraction of measured fp32 matmul" -> "fp32": the ceiling the step's MFU was taken against
        row["mfu_ceiling"] = (m.get("mfu", {}).get("unit") or "").replace("fraction of measured ", "").replace(
            " matmul", "") or None
        thr = next((v for k, v in m.items() if k.endswith("_per_s")), {})
        row["unit"] = (thr.get("unit") or "items/s")
        row["throughput"] = _num(thr.get("value"))
        row["same_math_max_rel"] = _num(check.get("value")) if check else None
        row["same_math_tol"] = check.get("unit", "").replace("relative, tolerance ", "") if check else None
        sdpa = m.get("sdpa_backend", {}).get("value")
        row["sdpa_backend"] = None if sdpa in (None, "none found") else sdpa   # no attention in the model
        row["op_backends"] = m.get("op_backends", {}).get("value")   # None: no hwlib op, or recorded before
        row["profile"] = ms.get("profile")
        row["device"] = (ms.get("device") or {}).get("name")
        row["measured_at"], row["code_digest"] = ms.get("time"), ms.get("code_digest")
        # A step whose math changed keeps its measured speed-up; its status says not to trust it.
        if row["throughput"]:
            base = base or row["throughput"]
            prev = next((s.name for s in reversed(chain(st.name)[:-1]) if s.name in measured), None)
            row["speedup_vs_baseline"] = row["throughput"] / base
            row["speedup_vs_prev"] = row["throughput"] / measured[prev] if prev else None
            row["prev_step"] = prev
            measured[st.name] = row["throughput"]
        else:
            row["speedup_vs_baseline"] = row["speedup_vs_prev"] = row["prev_step"] = None
        rows.append(row)
    return rows


def state(run=None) -> dict:
    """The run's ``state.json`` (notebook -> status and seconds), entries without a numeric
    ``seconds`` or a status left out; {} when missing or damaged."""
    path = read_dir(run) / "state.json"
    s = read_json(path, {})
    if not isinstance(s, dict):
        warnings.warn(f"{path}: not a JSON object; treated as empty", stacklevel=2)
        return {}
    out = {}
    for k, v in s.items():
        if k.startswith("_"):
            out[k] = v
        elif isinstance(v, dict) and isinstance(v.get("status"), str) and _num(v.get("seconds")) is not None:
            out[k] = v
        else:
            warnings.warn(f"{path}: entry {k!r} lacks a status or numeric seconds; left out", stacklevel=2)
    return out
