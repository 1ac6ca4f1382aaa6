"""A run folder's guards while ``hwlib reproduce`` measures into it: the run lock, ``state.json``
and the notebook's process tree.

- One ``reproduce`` per run folder: ``.lock`` is held with ``flock`` for the whole run and names
  its holder (pid, host). The kernel releases a dead holder's lock, so a lock left by a killed run
  is taken over without anyone deleting files; a live holder's lock is refused with its pid.
- ``state.json`` is read, changed and written back (atomically) only under that lock, so two
  runs can never drop each other's entries.
- papermill runs in its own session and starts the kernel in yet another one, so neither a
  process group nor Ctrl-C on the terminal reaches the whole tree. The tree is found from papermill
  down through psutil's process table, written to ``.notebook.pids`` as it grows, and ended as a whole
  (frozen first, so that no child escapes by being re-parented, then killed).
- Which processes are the lab's own is never taken from a file: every process of a notebook
  carries, in its environment, the run folder (``HWLIB_RUN``), a token made for that notebook's
  run (``HWLIB_RUN_TOKEN``) and the CLI that started it (``HWLIB_RUN_CLI``, pid and start time).
  A run ends only processes whose environment names its own folder and a CLI that is gone
  (``end_leftover``): a hand-written or copied ``.notebook.pids`` names nothing that gets killed.
  Before each notebook it looks for such orphans of any run on the machine (``orphans``): a
  leftover beside a measurement makes its timings wrong.
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

import psutil

from . import query, results
from .paths import STACKS_CELL_S, STACKS_DEADLINE, STACKS_FILE

try:
    import fcntl
except ImportError:  # no flock (Windows): runs are not locked there
    fcntl = None

TOKEN_VAR, CLI_VAR, RUN_VAR = "HWLIB_RUN_TOKEN", "HWLIB_RUN_CLI", "HWLIB_RUN"
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

def _stat(pid: int) -> tuple[str, int, int, float] | None:
    """(state, ppid, pgid, start time) of a live process, or None (gone or a zombie). The start time
    (seconds since the epoch, to the kernel's clock tick) tells a process from a later one given its pid."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            state = proc.status()
            if state in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return None
            return state, proc.ppid(), os.getpgid(pid), round(proc.create_time(), 2)
    except (psutil.Error, OSError):
        return None


def _children() -> dict[int, list[int]]:
    """{parent pid: its live children's pids} of every process on the machine, in one pass."""
    kids: dict[int, list[int]] = {}
    if os.path.isdir("/proc/self"):
        # Linux: one read of /proc/<pid>/stat each. The watch walks the table every second of a
        # notebook's run; through psutil a walk took 10.6 ms of CPU with 126 processes, this 1.8 ms.
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:   # gone since the listing
                continue
            fields = stat[stat.rfind(b")") + 2:].split(None, 2)   # after "pid (comm) ": state, ppid
            if len(fields) >= 2 and fields[0] not in (b"Z", b"X", b"x"):   # zombie or dead: not live
                kids.setdefault(int(fields[1]), []).append(int(name))
        return kids
    for proc in psutil.process_iter(["ppid", "status"]):
        info = proc.info
        if info["ppid"] is not None and info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            kids.setdefault(info["ppid"], []).append(proc.pid)
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


# Where and when a notebook's kernel dumps its stacks (``hwlib.stacks.arm_stack_dump``): set by
# ``hwlib reproduce`` for each notebook it runs.


def stacks_env(path: Path, timeout_s: float, cell_timeout_s: float) -> dict[str, str]:
    """The environment that has a notebook started now dump its stacks into ``path`` shortly before its
    ``timeout_s`` or a cell's ``cell_timeout_s`` runs out."""
    return {STACKS_FILE: str(path), STACKS_DEADLINE: str(time.time() + timeout_s), STACKS_CELL_S: str(cell_timeout_s)}


class TreeWatch:
    """Keeps ``<folder>/.notebook.pids`` up to date with the tree under a notebook's papermill."""

    def __init__(self, folder: Path, notebook: str, root: int, token: str | None = None):
        self.path, self.notebook, self.root, self.token = Path(folder) / PIDS_FILE, notebook, root, token
        self.procs: dict[int, int] = {}   # pid -> start time: a pid reused later is not ours

    def _collect(self) -> bool:
        new = {p: st[3] for p in tree(self.root) if p not in self.procs and (st := _stat(p))}
        self.procs.update(new)
        return bool(new)

    def poll(self) -> None:
        if self._collect():
            try:   # a record for the person reading the folder; what is ended never comes from it
                results.write_json(self.path, {"host": HOST, "cli_pid": os.getpid(), "notebook": self.notebook,
                                               "procs": [[p, t] for p, t in self.procs.items()]})
            except OSError:   # a full disk or a read-only folder must not stop the watch
                pass

    def end(self) -> list[int]:
        """End the whole tree: what was seen of it and what is under papermill now. Writes
        nothing before it kills: ending the tree must not depend on the disk."""
        self._collect()
        # and whatever carries this notebook run's token: a child that left the tree (re-parented
        # to init) before the watch saw it
        tokened = [p for p, _ in marked(self.token)] if self.token else []
        ended = end_tree(alive(list(self.procs.items())) + tokened)
        self.clear()
        return ended

    def clear(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass


def run_env(folder: Path) -> dict[str, str]:
    """The environment that marks a notebook's processes as this run's (``HWLIB_RUN``, a fresh
    ``HWLIB_RUN_TOKEN``, ``HWLIB_RUN_CLI``: this process's pid and start time)."""
    import uuid
    me = _stat(os.getpid())
    return {RUN_VAR: str(Path(folder).resolve()), TOKEN_VAR: uuid.uuid4().hex,
            CLI_VAR: f"{os.getpid()}:{me[3] if me else 0}"}


def _environ(pid: int) -> dict[str, str] | None:
    """The hwlib run variables of a process's environment (None: unreadable, gone, or another user's)."""
    try:
        env = psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return None
    return {k: v for k, v in env.items() if k in (RUN_VAR, TOKEN_VAR, CLI_VAR)}


def _cli_alive(value: str) -> bool:
    pid, _, start = value.partition(":")
    try:
        st = _stat(int(pid))
        return st is not None and st[3] == float(start)
    except ValueError:
        return False


def marked(token: str | None = None) -> list[tuple[int, dict]]:
    """(pid, run variables) of every live process on this machine that a ``hwlib reproduce`` started
    (its environment holds ``HWLIB_RUN_TOKEN``); with ``token``, only that notebook run's."""
    out = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        env = _environ(pid)
        if env and TOKEN_VAR in env and (token is None or env[TOKEN_VAR] == token) and _stat(pid):
            out.append((pid, env))
    return out


def orphans(exclude: Path | None = None) -> dict[str, list[int]]:
    """{run folder: pids} of notebook processes on this machine whose ``hwlib reproduce`` is gone
    (killed outright): they may still run on the GPU. ``exclude``: a folder left out."""
    skip = str(Path(exclude).resolve()) if exclude is not None else None
    out: dict[str, list[int]] = {}
    for pid, env in marked():
        if env.get(RUN_VAR) != skip and not _cli_alive(env.get(CLI_VAR, "")):
            out.setdefault(env.get(RUN_VAR, "?"), []).append(pid)
    return out


def end_leftover(folder: Path) -> tuple[str | None, list[int]] | None:
    """End what still runs of a notebook tree left by a killed ``reproduce`` of this folder (the
    caller holds the run lock, so its owner is gone). Returns (the notebook ``.notebook.pids`` names,
    if any, pids ended), or None when there was neither file nor process.

    What is ended is found by environment (``marked``: processes whose ``HWLIB_RUN`` is this very
    folder and whose CLI is gone), never by the pids the file lists: a hand-written file, or one
    copied along with a folder in use (``cp -r outputs/a outputs/b``), gets nothing killed. A
    leftover on another host cannot be ended from here: ``RunBusy`` names it."""
    from .results import safe_name
    path = Path(folder) / PIDS_FILE
    info = query.read_json(path) if path.exists() else None
    if path.exists() and not isinstance(info, dict):
        warnings.warn(f"{path}: not a process list; removed", stacklevel=2)
        info = None
    if isinstance(info, dict) and isinstance(info.get("host"), str) and info["host"] != HOST:
        raise RunBusy(f"{path} names notebook processes of a run on host {info['host']!r}: end them there "
                      f"(kill -9 <pid>), then delete {path}")
    live = orphans().get(str(Path(folder).resolve()), [])
    ended = end_tree(live) if live else []
    existed = path.exists()
    path.unlink(missing_ok=True)
    if not existed and not ended:
        return None
    nb = info.get("notebook") if isinstance(info, dict) else None
    return (nb if safe_name(nb) else None), ended


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
