"""A run folder's guards while ``hwlib reproduce`` measures into it: the run lock, ``state.json``
and the notebook's process tree.

- One ``reproduce`` per run folder: ``.lock`` is held with ``flock`` for the whole run and names
  its holder (pid, host). The kernel releases a dead holder's lock, so a lock left by a killed run
  is taken over without anyone deleting files; a live holder's lock is refused with its pid.
- ``state.json`` is read, changed and written back (atomically) only under that lock, so two
  runs can never drop each other's entries.
- papermill runs in its own session and starts the kernel in yet another one, so neither a
  process group nor Ctrl-C on the terminal reaches the whole tree. The tree is found by walking
  ``/proc`` from papermill down, written to ``.notebook.pids`` as it grows, and ended as a whole
  (frozen first, so that no child escapes by being re-parented, then killed). A run that finds
  that file from a killed run ends what is still alive of it before it measures anything:
  a leftover beside a measurement makes its timings wrong.
- The notebook's kernel dumps its stacks shortly before its time runs out (``stacks_env``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import warnings
from pathlib import Path

from . import query, results

try:
    import fcntl
except ImportError:  # no flock (Windows): runs are not locked there
    fcntl = None

LOCK_FILE = ".lock"
PIDS_FILE = ".notebook.pids"
HOST = socket.gethostname()


class RunBusy(RuntimeError):
    """Another ``reproduce`` holds the run folder, or a leftover of one lives on another host."""


# --- run lock ---------------------------------------------------------------------------------------

class RunLock:
    """``with RunLock(folder):`` one holder at a time; ``RunBusy`` names the holder otherwise."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunBusy(f"run folder {self.path.parent} is in use by another `hwlib reproduce` "
                              f"(pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
                              f"since {holder.get('started', '?')}): wait for it to finish, stop it "
                              f"(kill {holder.get('pid', '<pid>')}), or name another run with --run") from None
        # Ours now: whatever an earlier (dead) holder wrote is replaced.
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": HOST,
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)   # the file stays (unlinking a flocked file races a new holder)
            os.close(self.fd)          # closing releases the flock
            self.fd = None


def _read_holder(fd: int) -> dict:
    try:
        h = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
        return h if isinstance(h, dict) else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}


# --- state.json ---------------------------------------------------------------------------------------

def update_state(folder: Path, **entries) -> dict:
    """Read ``state.json`` (damaged entries dropped, with a warning), set ``entries``, write it back
    atomically. Callers hold the run lock. Returns the new state."""
    s = query.state(folder)
    s.update(entries)
    results.write_json(Path(folder) / "state.json", s)
    return s


# --- process trees --------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start time) of a live process, or None (gone or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw.rpartition(")")[2].split()   # the command name may hold spaces and parentheses
    if f[0] in ("Z", "X"):
        return None
    return f[0], int(f[1]), int(f[2]), int(f[19])


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st:
                kids.setdefault(st[1], []).append(int(d.name))
    return kids


def tree(root: int, kids: dict[int, list[int]] | None = None) -> list[int]:
    """``root`` and every live descendant of it, parents first."""
    if _stat(root) is None:
        return []
    kids, out, i = kids if kids is not None else _children(), [root], 0
    while i < len(out):
        out += [k for k in kids.get(out[i], []) if k not in out]
        i += 1
    return out


def alive(procs: list[tuple[int, int]]) -> list[int]:
    """The pids of ``(pid, start time)`` pairs that still run as the same process (not a reused pid)."""
    out = []
    for pid, start in procs:
        st = _stat(pid)
        if st and st[3] == start:
            out.append(pid)
    return out


def end_tree(pids: list[int], timeout: float = 10.0) -> list[int]:
    """End ``pids``, their descendants and their process groups. Everything is stopped first, so
    that a child cannot slip away to init between a parent's death and the next walk; then killed.
    Returns the pids that were ended."""
    me = os.getpgid(0)
    seen: list[int] = []
    while True:                                  # freeze the whole tree, including late children
        kids = _children()
        new = [p for r in list(pids) + seen for p in tree(r, kids) if p not in seen and p != os.getpid()]
        if not new:
            break
        for p in dict.fromkeys(new):
            seen.append(p)
            _signal(p, signal.SIGSTOP)
    groups = {g for g in (_pgid(p) for p in seen) if g and g != me}
    for p in seen:
        _signal(p, signal.SIGKILL)
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    while any(_stat(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


# Where and when a notebook's kernel dumps its stacks (``hwlib.notebook.arm_stack_dump``): set by
# ``hwlib reproduce`` for each notebook it runs.
STACKS_FILE, STACKS_DEADLINE, STACKS_CELL_S = "HWLIB_STACKS_FILE", "HWLIB_STACKS_DEADLINE", "HWLIB_STACKS_CELL_S"


def stacks_env(path: Path, timeout_s: float, cell_timeout_s: float) -> dict[str, str]:
    """The environment that has a notebook started now dump its stacks into ``path`` shortly before its
    ``timeout_s`` or a cell's ``cell_timeout_s`` runs out."""
    return {STACKS_FILE: str(path), STACKS_DEADLINE: str(time.time() + timeout_s), STACKS_CELL_S: str(cell_timeout_s)}


class TreeWatch:
    """Keeps ``<folder>/.notebook.pids`` up to date with the tree under a notebook's papermill."""

    def __init__(self, folder: Path, notebook: str, root: int):
        self.path, self.notebook, self.root = Path(folder) / PIDS_FILE, notebook, root
        self.procs: dict[int, int] = {}   # pid -> start time: a pid reused later is not ours

    def _collect(self) -> bool:
        new = {p: st[3] for p in tree(self.root) if p not in self.procs and (st := _stat(p))}
        self.procs.update(new)
        return bool(new)

    def poll(self) -> None:
        if self._collect():
            results.write_json(self.path, {"host": HOST, "cli_pid": os.getpid(), "notebook": self.notebook,
                                           "procs": [[p, t] for p, t in self.procs.items()]})

    def end(self) -> list[int]:
        """End the whole tree: what was seen of it and what is under papermill now. Writes
        nothing before it kills: ending the tree must not depend on the disk."""
        self._collect()
        ended = end_tree(alive(list(self.procs.items())))
        self.clear()
        return ended

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def end_leftover(folder: Path) -> tuple[str, list[int]] | None:
    """End what still runs of a notebook tree left by a killed ``reproduce`` of this folder (the
    caller holds the run lock, so its owner is gone). Returns (notebook, pids ended) or None.
    A leftover on another host cannot be ended from here: ``RunBusy`` names it."""
    path = Path(folder) / PIDS_FILE
    info = query.read_json(path)
    if info is None:
        path.unlink(missing_ok=True)   # damaged: read_json warned
        return None
    procs = info.get("procs") if isinstance(info, dict) else None
    if not isinstance(procs, list) or not all(isinstance(p, list) and len(p) == 2 and
                                              all(isinstance(x, int) for x in p) for p in procs):
        import warnings
        warnings.warn(f"{path}: not a process list; removed", stacklevel=2)
        path.unlink()
        return None
    if info.get("host") != HOST:
        raise RunBusy(f"{path} lists notebook processes {[p for p, _ in procs]} of a run on host "
                      f"{info.get('host')!r}: end them there (kill -9 <pid>), then delete {path}")
    live = alive([tuple(p) for p in procs])
    ended = end_tree(live) if live else []
    path.unlink()
    return str(info.get("notebook") or "?"), ended


def compact_results(folder: Path) -> tuple[int, int]:
    """Rewrite ``folder/results.jsonl`` with each distinct stamp stored once (``results.pack``),
    records, damaged lines and order otherwise as they were; refused (ValueError) unless the new
    file reads back as exactly the same records. Returns the sizes before and after, in bytes."""
    path = Path(folder) / query.RESULTS_FILE
    raw = path.read_bytes()
    out, seen = [], set()
    for line in raw.split(b"\n"):
        try:
            rec = json.loads(line.decode("utf-8")) if line.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            rec = None
        if not isinstance(rec, dict) or "metric" not in rec or "stamp" in rec:
            out.append(line)      # blank, damaged, a stamp line or a record already packed: as it is
            continue
        out += [json.dumps(r, sort_keys=True, allow_nan=False).encode() for r in results.pack([rec], seen)]
    new = b"\n".join(out)
    tmp = path.with_name(path.name + ".compact")
    tmp.write_bytes(new)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the same damaged lines warn in both
            same = query.read_records(tmp) == query.read_records(path)
        if not same:
            raise ValueError(f"{path}: the compacted file would not read back as the same records; left as it was")
        results.write_atomic(path, new)
    finally:
        tmp.unlink(missing_ok=True)
    return len(raw), len(new)
