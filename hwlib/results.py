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

The stamp that every record of a process shares (``STAMP_FIELDS``: device, library versions, where
the code came from) is most of a record's bytes. ``append`` writes it once per call, as a line
``{"stamp": <id>, ...}`` (the id a hash of its content) before the records, which carry the id in
``"stamp"`` instead; the reader (``hwlib.query.read_records``) puts the fields back, so every
record reads whole. Lines written before, with the stamp inside each record, read as they are.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import os
import re
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

from .paths import PACKAGE_DIR, run_dir

try:
    import fcntl
except ImportError:  # Windows: appends are still single writes
    fcntl = None

KEY = ("notebook", "workload", "step", "metric")


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _checkout_root() -> Path | None:
    """The git work tree whose own ``hwlib/`` is the code running here, else None.

    Asked of the package's folder, never of the working folder: an installed copy (Colab, a wheel)
    run inside some other repository must not record that repository's commit as its own."""
    root = PACKAGE_DIR.parent
    if not (root / "pyproject.toml").is_file():
        return None
    top = _git(root, "rev-parse", "--show-toplevel")
    return root if top and Path(top).resolve() == root.resolve() else None


def _installed_distribution():
    """The ``hwlib-*.dist-info`` that pip wrote beside this very package (``--target``, site-packages),
    else None. Found by place, not by name: another hwlib on ``sys.path`` (an editable install of a
    clone) would otherwise describe code that is not the code running."""
    import importlib.metadata as md
    found = sorted(PACKAGE_DIR.parent.glob("hwlib-*.dist-info"))
    if not found:
        return None
    from . import __version__
    dists = [md.Distribution.at(p) for p in found]
    return next((d for d in dists if d.version == __version__), dists[0])


@functools.lru_cache(maxsize=1)
def code_source() -> dict:
    """Where the running hwlib came from, stamped into every record beside ``git_commit``.

    ``kind``: ``checkout`` (a git clone: ``commit`` is its HEAD, ``dirty`` whether tracked files
    differ from it); ``git`` (pip installed it from a git URL, as the notebooks' Colab cell does:
    ``url``, the ``ref`` asked for and the ``commit`` pip built, from PEP 610's ``direct_url.json``);
    ``archive`` (a wheel or sdist file) or ``directory`` (a local folder), whose commit is unknown
    (``code_digest`` still names the code); ``unknown`` without any of these facts. ``version`` is
    the distribution's (or, in a checkout, the package's) version."""
    from . import __version__
    root = _checkout_root()
    if root is not None:
        head = _git(root, "rev-parse", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        return {"kind": "checkout", "version": __version__, "url": None, "ref": None, "commit": head,
                "dirty": bool(dirty) if dirty is not None else None}
    dist = _installed_distribution()
    out = {"kind": "unknown", "version": dist.version if dist else __version__, "url": None, "ref": None,
           "commit": None}
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null") if dist else None
    except (OSError, ValueError):   # a damaged file: the version is still known
        direct = None
    if isinstance(direct, dict):
        vcs = direct.get("vcs_info")
        out["url"] = direct.get("url")
        if isinstance(vcs, dict):
            out.update(kind=vcs.get("vcs") or "vcs", ref=vcs.get("requested_revision"), commit=vcs.get("commit_id"))
        else:
            out["kind"] = "archive" if "archive_info" in direct else "directory" if "dir_info" in direct else "unknown"
    return out


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit of the code that runs (12 hex digits): a checkout's HEAD, with ``-dirty`` when
    tracked files differ from it; for a copy pip installed from git, the commit it was built from;
    None where that is unknown (``code_digest`` still names the code)."""
    src = code_source()
    if not src.get("commit"):
        return None
    return src["commit"][:12] + ("-dirty" if src.get("dirty") else "")


def code_digest(root: Path | None = None) -> str | None:
    """sha256 (12 hex digits) over the paths and bytes of every file under ``hwlib/`` and of the kernel
    sources (a clone's ``kernels/``, which an installed copy holds as ``hwlib/kernels/``: counted under
    that name in both, so a clone and the wheel built from it give one digest).

    It names the code that produced a record even where ``git_commit`` cannot: a copy of the tree
    without its history, or a checkout whose git metadata is stale. Caches are left out."""
    root = Path(root) if root is not None else PACKAGE_DIR.parent
    return _code_digest(str(root.resolve()))


@functools.lru_cache(maxsize=4)   # the code does not change under a running process's feet
def _code_digest(root: str) -> str | None:
    import hashlib
    files = {}
    for d, as_ in (("hwlib", "hwlib"), ("kernels", "hwlib/kernels")):
        base = Path(root) / d
        if not base.is_dir():
            continue
        for f in base.rglob("*"):
            if not f.is_file() or "__pycache__" in f.parts or f.suffix in (".pyc", ".so", ".o"):
                continue
            files[f"{as_}/{f.relative_to(base).as_posix()}"] = f
    h, n = hashlib.sha256(), 0
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel].read_bytes() + b"\0")
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


def _requirement_names() -> list[str]:
    """The distributions hwlib asks for (dependencies and extras), from the installed metadata
    beside the package, else from the checkout's pyproject.toml."""
    dist = _installed_distribution()
    if dist is not None:
        reqs = dist.requires or []
    else:
        try:
            import tomllib
            project = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())["project"]
        except (ImportError, OSError, KeyError, ValueError):   # Python 3.10 has no tomllib
            return []
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
    names = {re.split(r"[<>=!~ \[;@(]", r.strip(), maxsplit=1)[0].lower() for r in reqs}
    return sorted(n for n in names if n and n != "hwlib")


def package_versions() -> dict:
    """The installed version of every distribution hwlib asks for (absent ones left out): what a
    constraints file needs to install the same environment again (``hwlib.release``)."""
    import importlib.metadata as md
    out = {}
    for name in _requirement_names():
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    from .device import versions
    return {**versions(), "packages": package_versions()}


# Names that become parts of file names (``<workload>_ladder.md``, ``curves/<workload>/<step>.json``,
# ``executed/<notebook>.log``): a letter or digit first, then letters, digits, ``_ . + -``; no ``/``,
# no ``..`` of their own, short enough for any file system. Checked where a record is made and
# wherever records are read (``hwlib.query``).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}")
NAME_KEYS = ("notebook", "workload", "step")


def safe_name(v) -> bool:
    """Whether ``v`` may become part of a file name (``NAME_RE``)."""
    return isinstance(v, str) and NAME_RE.fullmatch(v) is not None


def make_record(*, notebook: str, workload: str | None, step: str | None, metric: str, value, unit: str,
                p20=None, p80=None, status: str = "ok", reason: str | None = None, profile: str | None = None,
                params: dict | None = None, device: str | dict = "auto", fields: dict | None = None,
                extra: dict | None = None, telemetry: dict | None = None) -> dict:
    """One measurement's record, stamped here and nowhere else with the device, library versions
    (``packages``: every distribution hwlib asks for), git commit, code digest, where the code came
    from (``code_source``: a checkout, or the distribution pip installed and its commit) and time.

    ``device`` is the device the measurement ran on ('cuda', 'cpu', 'auto', or the facts as a dict);
    ``fields`` are the measurement's own x-values (batch, N, backend, variant, world_size...): they
    are record fields, never parts of the metric's name, and they are part of its key.
    ``telemetry``: the summary of the timed window (``hwlib.telemetry.summarize``), so that a slow
    or noisy row can be explained; not part of the key."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: choose one of {', '.join(STATUSES)}")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric must be a non-empty string, got {metric!r}")
    for key, name in zip(NAME_KEYS, (notebook, workload, step)):
        # a name the readers would skip as damaged is refused here, while the run can still say so
        if name is not None and not safe_name(name):
            raise ValueError(f"{key} {name!r} is not a name: letters, digits and _ . + - only (it becomes "
                             f"part of a file name), starting with a letter or digit, at most 100 characters")
    dev = ({k: device.get(k) for k in DEVICE_FIELDS} if isinstance(device, dict)
           else dict(_device_stamp(str(device))))
    rec = {"notebook": notebook, "workload": workload, "step": step, "metric": metric, "value": value,
           "p20": p20, "p80": p80, "unit": unit, "status": status, "reason": reason, "profile": profile,
           "params": params or {}, "fields": dict(fields or {}), "device": dev, "versions": _versions(),
           "git_commit": git_commit(), "code_digest": code_digest(), "code_source": code_source(),
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


STAMP_FIELDS = ("device", "versions", "code_source")   # the same for every record one process writes


def stamp_id(stamp: dict) -> str:
    """The id of a stamp: a hash of its content, so equal stamps share one id in any file."""
    return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]


def pack(records: list[dict], seen: set | None = None) -> list[dict]:
    """The lines that store ``records``: each distinct stamp once, as ``{"stamp": id, **fields}``,
    before the first record that carries its id in place of the fields (``seen``: ids already
    written, updated; None: a new set). A record without the whole stamp stays as it is."""
    out, seen = [], set() if seen is None else seen
    for r in records:
        if not all(isinstance(r.get(k), dict) for k in STAMP_FIELDS) or "stamp" in r:
            out.append(r)
            continue
        st = {k: r[k] for k in STAMP_FIELDS}
        sid = stamp_id(st)
        if sid not in seen:
            out.append({"stamp": sid, **st})
            seen.add(sid)
        out.append({**{k: v for k, v in r.items() if k not in STAMP_FIELDS}, "stamp": sid})
    return out


def _write_all(fd: int, payload: bytes, path: Path) -> None:
    """Write all of ``payload`` or raise: ``os.write`` may write less than asked (a full disk, a quota,
    a signal), and a caller must never believe records are on disk that are not. What a short write
    left is cut off again, so that the file ends where it ended before (no torn line, no half record)."""
    start = os.fstat(fd).st_size
    done, lines = 0, payload.count(b"\n")
    try:
        while done < len(payload):
            n = os.write(fd, payload[done:])
            if n <= 0:
                raise OSError(f"{path}: wrote {done} of {len(payload)} bytes, then the file system took no more")
            done += n
    except OSError as e:
        try:
            os.ftruncate(fd, start)   # under the lock: no other writer's bytes come after ours
        except OSError:
            pass
        raise OSError(e.errno, f"{path}: the records could not be written ({e.strerror or e}); "
                               f"none of this call's {lines} line(s) is kept: "
                               f"free space (or fix the folder's permissions) and measure again") from e


def append(records: list[dict] | dict, run: str | os.PathLike | None = None) -> Path:
    """Append records to ``<run>/results.jsonl`` atomically (one write per call, repeated until every
    byte is written), their stamp written once per call (``pack``). Either every record of the call is
    on disk when it returns, or it raises ``OSError`` and none is (a short write is cut off again)."""
    if isinstance(records, dict):
        records = [records]
    path = run_dir(run) / "results.jsonl"
    payload = "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in pack(records)).encode()
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
        _write_all(fd, payload, path)
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
