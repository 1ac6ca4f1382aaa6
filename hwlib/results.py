"""One record per measurement, with provenance; append-only, never half-written.

A run lives in ``outputs/<run>/``. ``results.jsonl`` gets one JSON object per line, each line
written by a single ``write`` on an ``O_APPEND`` descriptor under an exclusive lock, then fsynced:
concurrent writers cannot interleave, and a crash can at worst leave a last line without its
newline, which the reader (``hwlib.query``) reports and skips. Whole files (JSON, tables) are
written to a temporary file and renamed over the target, so readers see the old or the new file,
never a mix.

A record that is measured again (a notebook re-run) supersedes the earlier one with the same key
(``record_key``: notebook, workload, step, metric and the measurement's fields) when read; the file
itself keeps both.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

from .paths import PACKAGE_DIR, REPO_ROOT, run_dir

try:
    import fcntl
except ImportError:  # Windows: appends are still single writes
    fcntl = None

KEY = ("notebook", "workload", "step", "metric")


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None




def code_digest(root: Path | None = None) -> str | None:
    """sha256 (12 hex digits) over the paths and bytes of every file under ``hwlib/`` (kernel sources
    included: they ship inside the package).

    It names the code that produced a record even where ``git_commit`` cannot: a copy of the tree
    without its history, or a checkout whose git metadata is stale. Caches are left out."""
    root = Path(root) if root is not None else PACKAGE_DIR.parent
    return _code_digest(str(root.resolve()))


@functools.lru_cache(maxsize=4)   # the code does not change under a running process's feet
def _code_digest(root: str) -> str | None:
    import hashlib
    h, n = hashlib.sha256(), 0
    for d in ("hwlib",):
        base = Path(root) / d
        if not base.is_dir():
            continue
        for f in sorted(base.rglob("*")):
            if not f.is_file() or "__pycache__" in f.parts or f.suffix in (".pyc", ".so", ".o"):
                continue
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
            n += 1
    return h.hexdigest()[:12] if n else None


def _clean(x):
    """JSON has no NaN/inf: store them as strings so a non-finite value is never silently a number."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


DEVICE_FIELDS = ("kind", "name", "capability", "total_mem_gib", "sm_count")
STATUSES = ("ok", "skipped", "n/a", "failed", "nonfinite")


@functools.lru_cache(maxsize=8)
def _device_stamp(device: str) -> dict:
    from .device import info   # same layer; late only so that `import hwlib.results` stays light
    return {k: v for k, v in info(device).to_dict().items() if k in DEVICE_FIELDS}


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    from .device import versions
    return versions()


def make_record(*, notebook: str, workload: str | None, step: str | None, metric: str, value, unit: str,
                p20=None, p80=None, status: str = "ok", reason: str | None = None, profile: str | None = None,
                params: dict | None = None, device: str | dict = "auto", fields: dict | None = None,
                extra: dict | None = None, telemetry: dict | None = None) -> dict:
    """One measurement's record, stamped here and nowhere else with the device, library versions,
    git commit, code digest and time.

    ``device`` is the device the measurement ran on ('cuda', 'cpu', 'auto', or the facts as a dict);
    ``fields`` are the measurement's own x-values (batch, N, backend, variant, world_size...): they
    are record fields, never parts of the metric's name, and they are part of its key.
    ``telemetry``: the summary of the timed window (``hwlib.telemetry.summarize``), so that a slow
    or noisy row can be explained; not part of the key."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: choose one of {', '.join(STATUSES)}")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric must be a non-empty string, got {metric!r}")
    dev = ({k: device.get(k) for k in DEVICE_FIELDS} if isinstance(device, dict)
           else dict(_device_stamp(str(device))))
    rec = {"notebook": notebook, "workload": workload, "step": step, "metric": metric, "value": value,
           "p20": p20, "p80": p80, "unit": unit, "status": status, "reason": reason, "profile": profile,
           "params": params or {}, "fields": dict(fields or {}), "device": dev, "versions": _versions(),
           "git_commit": git_commit(), "code_digest": code_digest(),
           "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if telemetry is not None:
        if not isinstance(telemetry, dict):
            raise TypeError(f"telemetry must be a summary dict (hwlib.telemetry.summarize), got {type(telemetry).__name__}")
        rec["telemetry"] = telemetry
    if extra:
        clash = set(extra) & set(rec)
        if clash:
            raise ValueError(f"extra fields {sorted(clash)} would overwrite the record's own")
        rec.update(extra)
    return _clean(rec)


def record_key(r: dict) -> tuple:
    """What a record measures: a newer record with the same key supersedes an older one."""
    fields = r.get("fields") or {}
    return tuple(r.get(k) for k in KEY) + (tuple(sorted((k, str(v)) for k, v in fields.items())),)


def append(records: list[dict] | dict, run: str | os.PathLike | None = None) -> Path:
    """Append records to ``<run>/results.jsonl`` atomically (one write per call)."""
    if isinstance(records, dict):
        records = [records]
    path = run_dir(run) / "results.jsonl"
    payload = "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if fcntl:
            fcntl.flock(fd, fcntl.LOCK_EX)
        # A previous writer killed mid-line leaves no trailing newline: start on a fresh line so
        # that the torn line stays torn (and skipped) instead of swallowing this record.
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    payload = b"\n" + payload
        os.write(fd, payload)
        os.fsync(fd)
    finally:
        if fcntl:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return path


def _umask() -> int:
    try:   # read, not set: setting it to read it back would race other threads creating files
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write a whole file so that readers see the old or the new content, never a mix. The file
    keeps its mode (a new one gets the usual mode under the umask, not the temporary file's 600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        perm = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        perm = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, perm)
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | os.PathLike, obj) -> Path:
    return write_atomic(path, json.dumps(_clean(obj), indent=1, sort_keys=False, allow_nan=False) + "\n")
