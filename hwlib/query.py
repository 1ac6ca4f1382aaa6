"""The one reader of results: records, ceilings, saved curves and run state, read back robustly.

Everything that reads a run (tables, figures, the README, claims, the audit, notebooks, the CLI,
dashboards) reads it through here. Nothing below the edge reads results back: runners are handed
what they compare with.

Damaged files never crash a reader: a line of ``results.jsonl`` that is not UTF-8, not JSON, not an
object, lacks ``metric`` or carries a value that is neither a number, a string nor null is skipped;
a damaged JSON file reads as absent. Each damaged file gets one warning naming it and its lines.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import threading
import warnings
from pathlib import Path

from .paths import REPO_ROOT, read_dir
from .results import NAME_KEYS, STAMP_FIELDS, record_key, safe_name, stamp_id

RESULTS_FILE = "results.jsonl"


def reference_runs() -> list[str]:
    """Every committed reference run (``reference/<machine>``, a folder with records), in name order."""
    base = REPO_ROOT / "outputs" / "reference"
    return sorted(f"reference/{d.name}" for d in base.iterdir() if (d / RESULTS_FILE).is_file()) \
        if base.is_dir() else []


TEXT_KEYS = ("unit", "status", "reason", "profile", "time", "git_commit", "code_digest", "measurement", "against")
DICT_KEYS = ("params", "telemetry", "device", "versions", "code_source")
BIG = 2.0 ** 1000   # beyond this an int is no measurement (and float() of a 401-digit int overflows)


def _finite(v) -> bool:
    """A JSON number a reader can do arithmetic on: not a bool, not NaN/inf, not absurdly large."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return -BIG < v < BIG if isinstance(v, int) else math.isfinite(v) and abs(v) < BIG


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, bool)) or _finite(v)


def _valid(rec) -> str | None:
    """Why a parsed line is not a record, else None: the one schema of a record, checked wherever
    records are read (``read_records``)."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    if not isinstance(rec.get("metric"), str) or not rec["metric"]:
        return "no 'metric'"
    v = rec.get("value")
    if not (v is None or isinstance(v, str) or _finite(v)):
        return f"value {_short(v)} is not a number, a string or null" + (
            " (not finite, or too large)" if isinstance(v, (int, float)) and not isinstance(v, bool) else "")
    for k in ("p20", "p80"):
        if not (rec.get(k) is None or isinstance(rec[k], str) or _finite(rec[k])):
            return f"{k} {_short(rec[k])} is not a finite number, a string or null"
    for k in NAME_KEYS:
        if rec.get(k) is not None and not safe_name(rec[k]):
            return f"{k} {_short(rec[k])} is not a name (letters, digits, _ . + -; it becomes a file name)"
    for k in TEXT_KEYS:
        if rec.get(k) is not None and not isinstance(rec[k], str):
            return f"{k} {_short(rec[k])} is not a string"
    for k in DICT_KEYS:
        if rec.get(k) is not None and not isinstance(rec[k], dict):
            return f"{k} {_short(rec[k])} is not an object"
    dev = rec.get("device")
    if isinstance(dev, dict) and not (dev.get("name") is None or isinstance(dev["name"], str)):
        return f"device name {_short(dev['name'])} is not a string"
    f = rec.get("fields")
    if f is not None:
        if not isinstance(f, dict):
            return f"fields {_short(f)} is not an object"
        for k, x in f.items():
            if not (_scalar(x) or isinstance(x, list) and all(_scalar(y) for y in x)):
                return f"field {k!r} = {_short(x)} is not a finite number, a string, a bool or null"
    if "stamp" in rec and not isinstance(rec["stamp"], str):
        return f"stamp {_short(rec['stamp'])} is not a stamp id"
    return None


def _short(v) -> str:
    t = repr(v)
    return t if len(t) <= 40 else t[:37] + "..."


def _stamp_problem(rec: dict) -> str | None:
    """Why a stamp line cannot stand for the records that name it, else None: its fields must be
    objects and its id the hash of their content (``results.stamp_id``), so that a duplicated or
    edited stamp line cannot relabel the records after it."""
    if not isinstance(rec["stamp"], str) or not all(isinstance(rec.get(k), dict) for k in STAMP_FIELDS):
        return "a stamp line without its fields"
    dev = rec["device"]
    if not (dev.get("name") is None or isinstance(dev["name"], str)):
        return f"a stamp line whose device name {_short(dev['name'])} is not a string"
    if stamp_id({k: rec[k] for k in STAMP_FIELDS}) != rec["stamp"]:
        return f"a stamp line whose id {_short(rec['stamp'])} is not the hash of its content (edited or forged)"
    return None


def read_records(path: str | Path) -> list[dict]:
    """Every valid record of a ``results.jsonl``, in file order, each with its stamp put back from the
    stamp line it names (``results.pack``); bad lines skipped with one warning."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:   # a directory, a file without read permission
        warnings.warn(f"{path}: cannot be read ({e.strerror or type(e).__name__}); no records read", stacklevel=3)
        return []
    recs, why = _parse(path, raw)
    if why:
        warnings.warn(why, stacklevel=3)
    return recs


def _parse(path: Path, raw: bytes) -> tuple[list[dict], str | None]:
    """``read_records`` of a file's bytes: the records, and what its warning says (None: nothing)."""
    recs, bad, kept, stamps = [], [], [], {}
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append((n, "not UTF-8"))
            continue
        except RecursionError:
            bad.append((n, "nested too deeply"))
            continue
        except json.JSONDecodeError:
            # Only the last line of a file can be torn by a killed writer (appends are single writes).
            bad.append((n, "torn (no newline: a writer was interrupted)" if n == len(lines) else "not JSON"))
            continue
        if isinstance(rec, dict) and "stamp" in rec and "metric" not in rec:   # a stamp line (results.pack)
            why = _stamp_problem(rec)
            if why:
                bad.append((n, why))
            else:
                # pickled once: each record gets its own copy at C speed (copy.deepcopy per record
                # took two thirds of reading a reference's 30,000 records)
                stamps[rec["stamp"]] = pickle.dumps({k: rec[k] for k in STAMP_FIELDS})
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
                rec.update(pickle.loads(st))
        recs.append(rec)
    if bad or kept:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        lost = (f"; {len(kept)} record(s) kept without device and versions, their stamp line missing "
                f"(line {', '.join(map(str, kept[:5]))}{', ...' if len(kept) > 5 else ''})") if kept else ""
        return recs, f"{path}: skipped {len(bad)} damaged line(s){': ' + shown if bad else ''}{lost}"
    return recs, None


# load's answers by the file's content: one report reads the same reference runs many times over
# (every README block reads every committed reference), and putting the stamps back costs more than
# the JSON. Keyed on a hash of the bytes, not on a file time, so that a file rewritten in place is
# never answered stale; each caller gets its own copy (unpickled), free to change it.
_LOADED: dict = {}
_LOADED_MAX = 32
_LOADED_LOCK = threading.Lock()


def load(run=None, *, latest_only: bool = True) -> list[dict]:
    """Records of a run; with ``latest_only`` a re-measured key (``results.record_key``: notebook,
    workload, step, metric and the measurement's fields) keeps only its newest record."""
    path = read_dir(run) / RESULTS_FILE
    try:
        raw = path.read_bytes()
    except OSError:   # absent, a directory, unreadable: read_records answers, and warns where it should
        return read_records(path)
    key = (str(path), latest_only, hashlib.blake2b(raw, digest_size=16).digest())
    hit = _LOADED.get(key)
    if hit is None:
        recs, why = _parse(path, raw)
        if latest_only:
            latest: dict = {}
            for r in recs:
                latest[record_key(r)] = r
            recs = list(latest.values())
        try:
            blob = pickle.dumps(recs, protocol=pickle.HIGHEST_PROTOCOL)
        except RecursionError:   # nested deeper than pickle goes (JSON's limit differs): not kept
            if why:
                warnings.warn(why, stacklevel=2)
            return recs
        hit = (blob, why)
        with _LOADED_LOCK:   # a dashboard reads from its own thread
            if len(_LOADED) >= _LOADED_MAX:
                _LOADED.pop(next(iter(_LOADED)))
            _LOADED[key] = hit
    blob, why = hit
    if why:
        warnings.warn(why, stacklevel=2)
    return pickle.loads(blob)


def select(records: list[dict], **match) -> list[dict]:
    """Records whose top-level keys, or ``fields`` entries, equal every ``match`` value."""
    # A plain loop: the claims and the audit call this thousands of times over a reference's
    # thousands of records, where a generator per record cost 3.6x the time
    items = tuple(match.items())
    out = []
    for r in records:
        f = r.get("fields") or {}
        for k, v in items:
            if not ((f[k] if k in f else r.get(k)) == v):
                break
        else:
            out.append(r)
    return out


def read_json(path: str | Path, default=None):
    """A JSON file's content; ``default`` when it is missing or damaged (one warning when damaged)."""
    path = Path(path)
    if not path.exists():
        return default
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        warnings.warn(f"{path}: damaged ({type(e).__name__}: {e}); treated as absent", stacklevel=2)
        return default
    except OSError as e:   # a directory, a file without read permission
        warnings.warn(f"{path}: cannot be read ({e.strerror or type(e).__name__}); treated as absent", stacklevel=2)
        return default


def ceilings(run=None) -> dict | None:
    """This run's measured ceilings (``ceilings.json``), or None when not measured or damaged. A
    ceiling that is not a positive, finite number (``hwlib.ceilings.check``) is left out with a
    warning naming it: an MFU or floor taken against it would be nonsense."""
    from .ceilings import check
    path = read_dir(run) / "ceilings.json"
    c = read_json(path)
    if c is None:
        return None
    if not (isinstance(c, dict) and isinstance(c.get("matmul_tflops"), dict)):
        warnings.warn(f"{path}: not a ceilings object; treated as absent", stacklevel=2)
        return None
    c, dropped = check(c)
    if dropped:
        warnings.warn(f"{path}: {'; '.join(dropped)}; left out (measure them again: notebook 00)", stacklevel=2)
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
    # here, not at the top: the steps import torch (seconds of CPU), and importing hwlib.cli, as every
    # ``hwlib`` command's process does, stays free of it until a command needs it
    from .steps import STEP_NAMES
    seen = []
    for r in records:
        w = r.get("workload")
        if w and r.get("step") in STEP_NAMES and not r.get("fields") and w not in seen:
            seen.append(w)
    return seen


def step_metrics(records: list[dict], workload: str, names) -> dict[str, dict[str, dict]]:
    """step -> metric -> the newest record of ``workload`` for each step in ``names``; records with fields
    (variants, studies) are not a step's own. Where the step time names its measurement, only metrics of
    that measurement are kept."""
    by_step: dict[str, dict] = {}
    for r in records:
        if r.get("workload") != workload or r.get("step") not in names or r.get("fields"):
            continue
        by_step.setdefault(r["step"], {})[r["metric"]] = r
    for name, m in by_step.items():
        meas = (m.get("ms_per_step") or {}).get("measurement")
        if meas:
            by_step[name] = {k: v for k, v in m.items() if v.get("measurement") in (None, meas)}
    return by_step


def ladder_rows(records: list[dict], workload: str) -> list[dict]:
    """One dict per measured ladder step of ``workload``, in ladder order, with speed-ups against
    the first measured step and the one before. Records with fields (variants, studies) are not
    ladder rows."""
    from .steps import LADDER, STEP_NAMES, chain   # torch: see workloads_in
    by_step = step_metrics(records, workload, STEP_NAMES)
    rows = []
    base = base_step = None   # the first measured step: 01 in a whole series, another in a partial run
    measured: dict[str, float] = {}   # step -> throughput, for "x vs prev" along each step's chain
    for st in LADDER:
        m = by_step.get(st.name)
        if not m or "ms_per_step" not in m:
            # every ladder measurement records its step time (n/a and skipped ones too); a step with other
            # records only (notebook 16's breakdown of a step the ladder has not run) is not a ladder row
            continue
        ms = m["ms_per_step"]
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
            base_step = base_step or st.name
            prev = next((s.name for s in reversed(chain(st.name)[:-1]) if s.name in measured), None)
            row["speedup_vs_baseline"] = row["throughput"] / base
            row["speedup_vs_prev"] = row["throughput"] / measured[prev] if prev else None
            row["prev_step"], row["base_step"] = prev, base_step
            measured[st.name] = row["throughput"]
        else:
            row["speedup_vs_baseline"] = row["speedup_vs_prev"] = row["prev_step"] = row["base_step"] = None
        rows.append(row)
    return rows


STATE_TEXT = ("_device", "_profile", "_profile_reason")   # the run's own entries and their types
STATE_NUMBERS = ("_last_seconds",)


def _state_problem(k, v) -> str | None:
    """Why a ``state.json`` entry cannot be used, else None: the one schema of a run's state."""
    if k in STATE_TEXT:
        return None if isinstance(v, str) else f"{_short(v)} is not a string"
    if k in STATE_NUMBERS:
        return None if _finite(v) and v >= 0 else f"{_short(v)} is not a number of seconds"
    if k.startswith("_"):
        return None if _scalar(v) else f"{_short(v)} is not a plain value"
    if not safe_name(k):
        return "is not a notebook name"
    if not isinstance(v, dict):
        return "is not an object"
    if not isinstance(v.get("status"), str):
        return "lacks a status"
    if not (_finite(v.get("seconds")) and v["seconds"] >= 0):
        return "lacks a status or numeric seconds"
    for key in ("reason", "finished"):
        if v.get(key) is not None and not isinstance(v[key], str):
            return f"has a {key} {_short(v[key])} that is not a string"
    if v.get("parameters") is not None and not isinstance(v["parameters"], dict):
        return f"has parameters {_short(v['parameters'])} that are not an object"
    return None


def state(run=None) -> dict:
    """The run's ``state.json`` (notebook -> status and seconds; ``_device``, ``_profile``...), each
    entry checked against the state's schema (``_state_problem``); entries that fail are left out with
    a warning naming them; {} when missing or damaged."""
    path = read_dir(run) / "state.json"
    s = read_json(path, {})
    if not isinstance(s, dict):
        warnings.warn(f"{path}: not a JSON object; treated as empty", stacklevel=2)
        return {}
    out = {}
    for k, v in s.items():
        why = _state_problem(k, v)
        if why:
            warnings.warn(f"{path}: entry {_short(k)} {why}; left out", stacklevel=2)
        else:
            out[k] = v
    return out
