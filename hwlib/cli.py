"""Command line: ``hwlib reproduce``, ``hwlib first-look``, ``hwlib env``, ``hwlib table``, ``hwlib readme``.

``reproduce`` executes the numbered notebooks in their run order (``run_order``) through papermill,
each in its own process with a time limit, into ``outputs/<run>/executed/``. It goes on past a failing notebook, records
each notebook's outcome in ``outputs/<run>/state.json`` (so a rerun skips what is done, unless
``--force``), rebuilds tables, figures and ``summary.json`` from whatever results exist, then
reports the failures and exits non-zero if there were any. ``99_*`` notebooks derive everything
from the others' results and therefore always run.

A run folder takes one ``reproduce`` at a time, holds one machine and one profile, and stays under
``outputs/``; a signal (SIGINT, SIGTERM, SIGHUP) or an error ends the running notebook's whole
process tree and records it as ``interrupted`` (``hwlib/runs.py``; docs/integrity.md lists the
promises and their tests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

from . import query, results, runs, series
from .paths import REPO_ROOT, RunNameError, compile_cache_env, is_reference, outputs_root, run_dir, run_name
from .series import NOTEBOOKS_DIR


class CliError(Exception):
    pass


class Interrupted(BaseException):
    """A signal asked ``reproduce`` to stop (SIGINT, SIGTERM, SIGHUP). A BaseException, so that no
    ``except Exception`` on the way out swallows it before the notebook's process tree is ended."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


_STOP = {"fired": None, "shield": 0, "deferred": False}


@contextlib.contextmanager
def stop_signals_raise():
    """While inside, SIGINT, SIGTERM and SIGHUP raise ``Interrupted``: once (a second signal during
    the clean-up is ignored), and never inside ``shielded()`` (there it is raised on leaving)."""
    _STOP.update(fired=None, shield=0, deferred=False)

    def handler(signum, frame):
        if _STOP["fired"] is None:
            _STOP["fired"] = signum
            if _STOP["shield"]:
                _STOP["deferred"] = True
            else:
                raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def shielded():
    """Clean-up that a signal must not cut short (ending a process tree): the signal waits."""
    _STOP["shield"] += 1
    try:
        yield
    finally:
        _STOP["shield"] -= 1
    if not _STOP["shield"] and _STOP["deferred"]:
        _STOP["deferred"] = False
        raise Interrupted(_STOP["fired"])


MAX_SECONDS = 30 * 24 * 3600   # beyond this a limit is a typo; the kernel's timers overflow long before inf


def positive_seconds(text: str) -> float:
    """argparse type of --timeout and --cell-timeout: positive, finite seconds."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(v) or v <= 0 or v > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive, finite seconds, at most {MAX_SECONDS} "
                                         f"(30 days), e.g. 900")
    return v


def run_order(nbs: list[Path]) -> list[Path]:
    """``nbs`` in the order a run executes them (``hwlib.series.run_order``), bad metadata a CliError."""
    try:
        return series.run_order(nbs)
    except series.SeriesError as e:
        raise CliError(str(e)) from None


def list_notebooks(folder: Path) -> list[Path]:
    nbs = run_order(series.notebook_paths(folder))
    if not nbs:
        raise CliError(f"no numbered notebooks (NN_name.ipynb) in {folder}")
    return nbs


def select(nbs: list[Path], only: str | None) -> list[Path]:
    if only is None:
        return nbs
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    if not wanted:
        raise CliError(f"--only {only!r} names no notebook; give numbers or names, e.g. --only 00,01,99, "
                       f"or leave --only out to run every notebook")
    out = []
    for w in wanted:
        hit = [p for p in nbs if p.stem == w or p.stem.split("_", 1)[0] == w.zfill(2) or p.name == w]
        if not hit:
            raise CliError(f"--only: unknown notebook {w!r}; choose from: {', '.join(p.stem for p in nbs)}")
        out += [h for h in hit if h not in out]
    return [p for p in nbs if p in out]   # in the run order ``nbs`` already has


# Parameters reproduce passes itself (a run holds one profile, device and name): not for --set.
OWN_PARAMETERS = ("profile", "device", "run", "workloads")


MAX_PARAMETER_BYTES = 16 * 1024   # a setting, not data: a larger value belongs in a file the notebook reads


def _strict_loader():
    """A YAML reader that takes plain scalars as a reader of this command line would: integers in
    decimal without leading zeros, floats with or without a dot (``1e-08``), ``.nan``/``.inf``,
    ``true``/``false``, ``null``; everything else (``010``, ``12:30:00``, ``yes``, dates) a string."""
    import re
    import yaml

    class Strict(yaml.SafeLoader):
        pass
    Strict.yaml_implicit_resolvers = {}
    for tag, pattern, first in (
            ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
            ("int", r"^[-+]?(?:0|[1-9][0-9]*)$", "-+0123456789"),
            ("float", r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                      r"|\.(?:nan|NaN|NAN))$", "-+0123456789."),
            ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""])):
        Strict.add_implicit_resolver(f"tag:yaml.org,2002:{tag}", re.compile(pattern), list(first))
    return Strict


def _same(a, b) -> bool:
    """Equal values of equal types (True is not 1, 1 is not 1.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _ambiguous(strict, yaml11) -> bool:
    """Whether YAML 1.1 reads a scalar of a ``--set`` value as another value than ``_strict_loader`` does,
    other than text where the strict reading is a number (``1e-08``: a float, as meant)."""
    if isinstance(strict, list) and isinstance(yaml11, list) and len(strict) == len(yaml11):
        return any(_ambiguous(a, b) for a, b in zip(strict, yaml11))
    if isinstance(strict, dict) and isinstance(yaml11, dict) and list(strict) == list(yaml11):
        return any(_ambiguous(strict[k], yaml11[k]) for k in strict)
    if isinstance(strict, float) and isinstance(yaml11, float) and math.isnan(strict) and math.isnan(yaml11):
        return False
    if isinstance(strict, (int, float)) and not isinstance(strict, bool) and isinstance(yaml11, str):
        return False
    return not _same(strict, yaml11)


def _problem(v) -> str | None:
    """Why a parsed ``--set`` value cannot be passed and recorded exactly, else None."""
    if isinstance(v, float) and not math.isfinite(v):
        return (f"{v!r} is not a finite number: state.json records parameters as JSON, which holds no NaN or "
                f"infinity; give a finite number")
    if isinstance(v, dict):
        bad = next((k for k in v if not isinstance(k, str)), None)
        if bad is not None:
            return f"the key {bad!r} is not a string; quote it"
        return next((p for p in map(_problem, v.values()) if p), None)
    if isinstance(v, list):
        return next((p for p in map(_problem, v) if p), None)
    if v is None or isinstance(v, (str, bool, int, float)):
        return None
    return f"a {type(v).__name__} is not a notebook parameter; quote it to pass it as text"


def parse_value(item: str, raw: str):
    """The value of ``--set NN.name=<raw>``, read as YAML with plain scalars read strictly
    (``_strict_loader``). A value that YAML 1.1 (papermill's reader) would read otherwise (``010`` as
    8, ``12:30:00`` as 45000, ``yes`` as true, a date) is refused with the two readings, so that the
    notebook gets exactly what state.json records; so are values JSON cannot record and values over
    ``MAX_PARAMETER_BYTES``."""
    import yaml
    if len(raw.encode()) > MAX_PARAMETER_BYTES:
        raise CliError(f"--set {item[:60]!r}...: the value is {len(raw.encode())} bytes, over "
                       f"{MAX_PARAMETER_BYTES}: a parameter is a setting; put data in a file and pass its path")
    try:
        value = yaml.load(raw, Loader=_strict_loader())
    except yaml.YAMLError as e:
        raise CliError(f"--set {item!r}: the value is not YAML ({e.__class__.__name__})") from None
    try:
        yaml11 = yaml.safe_load(raw)
    except (yaml.YAMLError, ValueError):
        yaml11 = None
    if _ambiguous(value, yaml11):
        raise CliError(f"--set {item!r}: the value is ambiguous: read as {value!r} here but as {yaml11!r} by "
                       f"YAML 1.1; quote it for the text (e.g. --set '{item.partition('=')[0]}=\"{raw}\"') "
                       f"or write the number plainly (10, not 010)")
    why = _problem(value)
    if why:
        raise CliError(f"--set {item!r}: {why}")
    return value


def parameter_sets(items: list[str] | None, nbs: list[Path]) -> dict[str, dict]:
    """``--set NN.name=value`` options as {notebook stem: {name: value}}: the value read by
    ``parse_value``, the notebook one of those selected, the name one of its parameters."""
    out: dict[str, dict] = {}
    for item in items or []:
        key, eq, raw = item.partition("=")
        nb_id, dot, name = key.strip().partition(".")
        if not (eq and dot and nb_id and name):
            raise CliError(f"--set {item[:200]!r}: give NOTEBOOK.PARAMETER=VALUE, e.g. --set 19.noise_budget_s=100")
        hit = [p for p in nbs if p.stem == nb_id or p.stem.split("_", 1)[0] == nb_id.zfill(2)]
        if not hit:
            raise CliError(f"--set {item[:200]!r}: notebook {nb_id!r} is not among those this command runs "
                           f"({', '.join(p.stem for p in nbs)})")
        if name in OWN_PARAMETERS:
            raise CliError(f"--set {item[:200]!r}: reproduce sets {name!r} itself; use --{name}")
        # imported here, only for --set: papermill brings nbformat and jsonschema (seconds of CPU), which a
        # run without --set never needs in this process (each notebook's papermill runs in its own)
        import papermill
        names = papermill.inspect_notebook(str(hit[0]))   # its parameters cell's names
        if name not in names:
            raise CliError(f"--set {item[:200]!r}: {hit[0].stem} has no parameter {name!r}; its parameters: "
                           f"{', '.join(sorted(names)) or 'none'}")
        out.setdefault(hit[0].stem, {})[name] = parse_value(item, raw)
    return out


def parameters_file(path: Path, params: dict) -> Path:
    """Write ``params`` as the YAML file papermill reads (``-f``): YAML 1.1 as papermill reads it, checked
    to read back as exactly ``params`` (a float as a float, a string as a string), so that the
    notebook gets what state.json records. A file, not the command line: no length limit there."""
    import yaml
    text = yaml.safe_dump(params, default_flow_style=False, allow_unicode=True, sort_keys=True)
    back = yaml.safe_load(text)
    if not _same(back, params):
        raise CliError(f"parameters {params!r} would reach the notebook as {back!r}; quote the values")
    results.write_atomic(path, text)
    return path


def run_arg(args, default: str = "latest") -> str:
    """The run's name: ``--run``, else ``$HWLIB_RUN``, else ``default``; errors name which one."""
    env = os.environ.get("HWLIB_RUN")
    if args.run is not None:
        if not args.run.strip():
            raise CliError(f"--run {args.run!r}: an empty run name; name the run (e.g. --run latest), "
                           f"or leave --run out for {env or default!r}")
        return run_name(args.run, source="--run")
    if env is not None:
        if not env.strip():
            raise CliError(f"HWLIB_RUN={env!r}: an empty run name; set it to a run name, or unset it for {default!r}")
        return run_name(None)
    return default


def profile_arg(args, dev) -> tuple[str, str]:
    """(profile, where it came from and why). An explicit --profile wins over ``$HWLIB_PROFILE``, which
    wins over 'auto' (``hwlib.profiles.choose_profile``: what fits this GPU's memory); the notebooks
    then get the chosen one through both their parameter and the variable."""
    from .profiles import PROFILE_CHOICES, choose_profile
    env = os.environ.get("HWLIB_PROFILE")
    if args.profile is not None:
        value, source = args.profile, "--profile"
    elif env:
        value, source = env, "HWLIB_PROFILE"
    else:
        value, source = "auto", "default"
    p = value.strip().lower()
    if p not in PROFILE_CHOICES:
        raise CliError(f"{source}: unknown profile {value!r}; choose one of: {', '.join(PROFILE_CHOICES)}"
                       + (" (or unset HWLIB_PROFILE)" if source == "HWLIB_PROFILE" else ""))
    p, why = choose_profile(p, dev, source=source)
    if source == "--profile" and env and env.strip().lower() != p:
        why += f"; HWLIB_PROFILE={env!r} ignored"
    return p, why


def _workloads(args) -> list[str] | None:
    if args.workloads is None:
        return None
    from .workloads import get_workload
    workloads = list(dict.fromkeys(get_workload(w.strip()).name for w in args.workloads.split(",") if w.strip()))
    if not workloads:
        raise CliError(f"--workloads {args.workloads!r} names no workload; leave it out for each notebook's own list")
    return workloads


# A notebook's kernel dumps every thread's Python stack into executed/<name>.stacks shortly before
# the notebook or a cell of it runs out of time (``runs.stacks_env``; armed by ``notebook.setup``).
STACKS_WAIT_S = 5.0


def _stacks_note(path: Path, wait_s: float = 0.0) -> str:
    """The words for a failure's reason that say where its kernel's stacks are, if it wrote them
    (waiting up to ``wait_s`` for a dump due about now)."""
    end = time.monotonic() + wait_s
    while not _written(path) and time.monotonic() < end:
        time.sleep(0.1)
    return f"; its kernel's stacks: {path}" if _written(path) else ""


# Each notebook runs in a papermill process of its own. papermill reads notebooks through nbformat,
# which imports jsonschema, whose format checkers import rfc3987_syntax where it is installed (Jupyter's
# own dependencies bring it): that module builds an Earley parser of RFC 3987's grammar as it is imported,
# about 3.5 s of CPU in every notebook's papermill process (of about 5.5 s on a 2-core machine). No
# notebook schema checks an "iri" format, so papermill starts with that one module unimportable: jsonschema
# then leaves its two iri checkers out, and nothing else changes. The other optional modules only
# jsonschema's format checkers import go the same way (isoduration brings arrow: about 0.07 s of CPU more).
PAPERMILL_PRELUDE = ("import sys; sys.modules.update(dict.fromkeys(('rfc3987_syntax', 'isoduration', "
                     "'rfc3986_validator', 'rfc3339_validator', 'webcolors', 'uri_template', 'fqdn', "
                     "'jsonpointer'), None))")
PAPERMILL = PAPERMILL_PRELUDE + "; from papermill.cli import papermill; papermill(prog_name='papermill')"


def _written(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def kernel_port_taken(log: Path) -> bool:
    """Whether a notebook failed only because its kernel could not bind the port jupyter_client chose
    for it (the client picks free ports, then the kernel binds them: another process can take one in
    between, most often on a busy machine). The kernel died before its first reply, so no cell ran."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    return "Kernel died before replying to kernel_info" in text and "Address already in use" in text


def _run_one(nb: Path, run: Path, env: dict, args, profile: str, device: str,
             workloads: list[str] | None = None, params: dict | None = None) -> tuple[str, str]:
    executed = run / "executed"
    executed.mkdir(exist_ok=True)   # again for each notebook: deleting it mid-run costs one notebook at most
    log = executed / f"{nb.stem}.log"
    stacks = executed / f"{nb.stem}.stacks"
    stacks.unlink(missing_ok=True)   # an earlier attempt's dump is not this one's
    env = {**env, **runs.stacks_env(stacks, args.timeout, args.cell_timeout)}
    cmd = [sys.executable, "-c", PAPERMILL, str(nb), str(executed / nb.name), "-k", "python3",
           "--cwd", str(nb.parent), "-p", "profile", profile, "-p", "device", device,
           "--execution-timeout", str(math.ceil(args.cell_timeout)), "--no-progress-bar", "--log-output"]
    passed = {**({"workloads": workloads} if workloads else {}), **(params or {})}
    if passed:
        cmd += ["-f", str(parameters_file(executed / f"{nb.stem}.parameters.yaml", passed))]
    mark = runs.run_env(run)   # what marks this notebook's processes as this run's (runs.marked)
    env = {**env, **mark}
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        watch = runs.TreeWatch(run, nb.stem, proc.pid, mark[runs.TOKEN_VAR])
        start = time.monotonic()
        deadline = start + args.timeout
        try:
            while True:
                watch.poll()
                # The tree is walked often while the kernel starts, then once a second: each walk reads
                # every process of the machine (about 13 ms of CPU with 85 of them), and ending the tree
                # walks it again anyway. The wait itself returns as soon as papermill ends.
                try:
                    rc = proc.wait(timeout=0.2 if time.monotonic() - start < 5 else 1.0)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        return "timeout", (f"exceeded the per-notebook limit of {args.timeout:.0f} s"
                                           + _stacks_note(stacks, STACKS_WAIT_S))
        finally:
            # On a time limit, a signal or any error, and after a normal end too (a kernel that
            # outlived papermill): nothing of the notebook's tree may keep running.
            with shielded():
                watch.end()
                proc.wait()
            if stacks.exists() and (not _written(stacks) or proc.returncode == 0):
                stacks.unlink()   # armed, never dumped, or dumped by a cell that then finished in time
    _relative_paths(executed / nb.name)
    if rc == 0:
        return "ok", ""
    try:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
    except OSError as e:   # its log deleted or unreadable: the failure stands, without its last lines
        tail = [f"exit status {rc}; its log {log} cannot be read ({e.strerror})"]
    return "failed", " | ".join(t.strip() for t in tail)[-400:] + _stacks_note(stacks)


def _relative_paths(executed: Path) -> None:
    """papermill writes the absolute input and output paths of the measuring machine into the executed
    notebook's metadata: made relative to the checkout (or to the name alone) before it is kept."""
    try:
        nb = json.loads(executed.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return   # not written (the kernel died first) or damaged: nothing to rewrite
    meta = nb.get("metadata", {}).get("papermill") if isinstance(nb, dict) else None
    if not isinstance(meta, dict):
        return
    for k in ("input_path", "output_path"):
        if isinstance(meta.get(k), str) and os.path.isabs(meta[k]):
            p = Path(meta[k])
            meta[k] = os.path.relpath(p, REPO_ROOT) if REPO_ROOT in p.resolve().parents else p.name
    try:
        results.write_atomic(executed, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    except OSError:
        pass   # the notebook's outcome stands; its copy keeps the paths


def check_folder(run: Path, name: str, profile: str, device_name: str, args) -> None:
    """A run folder holds one machine and one profile; a committed reference is overwritten only on
    purpose."""
    state = query.state(run)
    if is_reference(name) and not args.overwrite_reference and (state or (run / "results.jsonl").exists()):
        raise CliError(f"--run {name!r} is a committed reference: its records, ceilings.json and summary.json "
                       f"would change; name a new run (--run NAME), or pass --overwrite-reference to "
                       f"re-measure it on purpose")
    made = state.get("_profile")
    if isinstance(made, str) and made != profile:
        raise CliError(f"run {name!r} was made with profile {made!r}, not {profile!r}: a run folder holds one "
                       f"profile; name a new run (--run NAME) or delete {run}")
    devices = {state.get("_device")} | {r["device"].get("name") for r in query.load(run)
                                         if isinstance(r.get("device"), dict)}
    others = sorted(d for d in devices - {device_name, None} if isinstance(d, str))
    if others:
        raise CliError(f"run {name!r} holds records of {', '.join(others)}, and this machine is {device_name}: "
                       f"a run folder holds one machine; name a new run (--run NAME)")


def reproduce(args) -> int:
    from .device import info, resolve_device
    dev = resolve_device(args.device)
    profile, why = profile_arg(args, dev)
    nbs = select(list_notebooks(Path(args.notebooks).resolve()), args.only)
    workloads = _workloads(args)
    params = parameter_sets(args.set, nbs)
    name = run_arg(args)
    run = run_dir(name)
    device_name = info(dev).name
    with stop_signals_raise():
        try:
            with runs.RunLock(run):
                check_folder(run, name, profile, device_name, args)
                left = runs.end_leftover(run)
                if left:
                    nb, ended = left
                    if ended:
                        print(f"hwlib reproduce: ended processes {ended} left running by a killed run of "
                              f"{nb or 'a notebook'} in {run}", file=sys.stderr)
                    if nb:   # even one that was done before: the killed rerun may have replaced some of its records
                        runs.update_state(run, **{nb: _entry("interrupted", 0.0, "its run was killed")})
                others = _orphans_note(run)
                if others:
                    raise CliError(others)
                runs.update_state(run, _profile=profile, _profile_reason=why, _device=device_name)
                print(f"hwlib reproduce: {len(nbs)} notebooks, profile={profile} ({why}), device={dev.type}, "
                      f"run={run}", flush=True)
                return _series(args, nbs, run, profile, dev.type, workloads, params)
        except Interrupted as e:
            print(f"hwlib reproduce: stopped by {e}; the running notebook's processes were ended and it "
                  f"is recorded as interrupted; run the same command again to resume", file=sys.stderr)
            return 128 + e.signum


def _orphans_note(run: Path) -> str | None:
    """Why nothing may be timed now: notebook processes of a killed ``hwlib reproduce`` of another run
    under the same outputs folder still live on this machine (``runs.orphans``), else None. Those of
    runs under another outputs folder (another checkout, or a test's scratch folder) are said on stderr
    once: they may be another person's, whose run a refusal here would not help."""
    found = runs.orphans(exclude=run)
    root = outputs_root()
    ours = {f: p for f, p in found.items() if root in Path(f).parents}
    elsewhere = {f: p for f, p in found.items() if f not in ours and f not in _SAID}
    if elsewhere:
        _SAID.update(elsewhere)
        what = "; ".join(f"pids {pids} of a run in {folder}" for folder, pids in elsewhere.items())
        print(f"hwlib reproduce: warning: processes of a killed `hwlib reproduce` under another outputs folder "
              f"still run on this machine ({what}); timings beside them may be wrong", file=sys.stderr)
    if not ours:
        return None
    what = "; ".join(f"pids {pids} of a run in {folder}" for folder, pids in ours.items())
    return (f"processes of a killed `hwlib reproduce` still run on this machine ({what}): timed beside them, "
            f"this run's numbers would be wrong; end them (kill -9 <pids>), or run `hwlib reproduce` on that "
            f"run again, which ends them first")


_SAID: set = set()   # leftovers under other outputs folders already warned about by this process


def _entry(status: str, seconds: float, reason: str, params: dict | None = None) -> dict:
    e = {"status": status, "seconds": round(seconds, 1), "reason": reason,
         "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if params:   # a notebook run with other than its own defaults says so
        e["parameters"] = params
    return e


def _series(args, nbs: list[Path], run: Path, profile: str, device: str, workloads, params: dict) -> int:
    """Run the notebooks in order (under the run lock), then rebuild the run's tables. One notebook's
    fault (its folder gone or read-only, a full disk, a leftover of another run beside it) is that
    notebook's ``failed`` row with the reason, and the series goes on."""
    from tqdm.auto import tqdm
    env = dict(os.environ, HWLIB_RUN=str(run), HWLIB_PROFILE=profile, PYTHONUNBUFFERED="1",
               HWLIB_OUTPUTS=str(outputs_root()))   # absolute: the kernel starts in notebooks/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    for k, v in compile_cache_env(run, results.code_digest()).items():   # one compile cache for the run's notebooks
        env.setdefault(k, v)
    t_all = time.perf_counter()
    outcome: dict[str, str] = {}   # what each notebook came to, also where state.json could not say it
    bar = tqdm(nbs, unit="nb", dynamic_ncols=True, disable=args.quiet)
    takes = {nb.stem: _takes_workloads(nb) for nb in nbs} if workloads else {}
    for nb in bar:
        # the state says what the notebook ran with where it was not its own: --set, and --workloads
        # (fewer workloads take less time; the time table must not read that as the notebook's own)
        mine = workloads if takes.get(nb.stem) else None
        ran_with = {**(params.get(nb.stem) or {}), **({"workloads": mine} if mine else {})}
        before = query.state(run).get(nb.stem)
        if before and before["status"] == "ok" and not args.force and not nb.stem.startswith("99"):
            if not params.get(nb.stem) or (before.get("parameters") or {}) == ran_with:
                bar.write(f"  {nb.stem:<24} done earlier ({before['seconds']:.0f} s), skipped; --force reruns")
                outcome[nb.stem] = "ok"
                continue
            bar.write(f"  {nb.stem:<24} done earlier with other parameters; run again with --set's")
        bar.set_postfix_str(nb.stem)
        t0 = time.perf_counter()
        try:
            busy = _orphans_note(run)
            status, why = ("failed", busy) if busy else _run_one(nb, run, env, args, profile, device, mine,
                                                                 params.get(nb.stem))
            if status == "failed" and not busy and kernel_port_taken(run / "executed" / f"{nb.stem}.log"):
                bar.write(f"  {nb.stem:<24} its kernel found its port taken at start (no cell ran): once more")
                status, why = _run_one(nb, run, env, args, profile, device, mine, params.get(nb.stem))
        except OSError as e:   # the run folder gone, read-only or full: this notebook's fault, not the series'
            status, why = "failed", f"{type(e).__name__}: {e}"
        except BaseException as e:   # the tree is ended by now; the notebook must not read as done
            _record(run, nb.stem, _entry("interrupted", time.perf_counter() - t0, f"{type(e).__name__}: {e}", ran_with))
            raise
        secs = time.perf_counter() - t0
        outcome[nb.stem] = status
        _record(run, nb.stem, _entry(status, secs, why, ran_with))
        bar.write(f"  {nb.stem:<24} {status:<8} {secs:7.1f} s" + (f"  {why}" if why else ""))
    bar.close()
    from .report.tables import write_all
    try:
        written = write_all(run)
        print(f"tables, figures and summary.json rebuilt: {len(written)} files under {run}")
    except Exception as e:  # the notebooks' outputs stay; say why the rebuild failed
        print(f"hwlib reproduce: rebuilding tables failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    total = time.perf_counter() - t_all
    _record(run, "_last_seconds", round(total, 1))
    failed = [nb.stem for nb in nbs if outcome.get(nb.stem) != "ok"]
    print(f"hwlib reproduce: {total:.0f} s in all")
    if failed:
        print(f"hwlib reproduce: {len(failed)} notebook(s) failed: {', '.join(failed)} "
              f"(logs in {run / 'executed'}/<name>.log)", file=sys.stderr)
        return 1
    return 0


def _takes_workloads(nb: Path) -> bool:
    """Whether ``--workloads`` reaches ``nb``: only a notebook whose parameters cell has ``workloads`` gets
    it (papermill would inject it into any other, and state.json would say that notebook ran with it)."""
    import papermill
    try:
        return "workloads" in papermill.inspect_notebook(str(nb))
    except Exception:   # a notebook papermill cannot inspect fails on its own run, with its own message
        return True


def _record(run: Path, key: str, value) -> None:
    """Set one ``state.json`` entry; a folder that cannot take it (read-only, full, gone) is said on
    stderr and the series goes on (the outcome is still reported at the end)."""
    try:
        runs.update_state(run, **{key: value})
    except OSError as e:
        print(f"hwlib reproduce: cannot record {key} in {run / 'state.json'} ({e.strerror or e}); "
              f"it will run again next time", file=sys.stderr)


def first_look(args) -> int:
    """``reproduce`` of the first look's notebooks (``report.first_look``: 00, 09, 25, 16, 99, GPT-2 only)
    into ``outputs/first-look`` (or --run), then its summary: the headline, where its figure and tables
    are, and the ratio to the committed reference of the same GPU and profile."""
    from .report import first_look as fl
    args.run = run_arg(args, "first-look")
    args.only, args.set, args.workloads = fl.ONLY, list(fl.SETS), fl.WORKLOAD
    rc = reproduce(args)
    run = run_dir(args.run, create=False)
    if (run / "results.jsonl").is_file():
        print(fl.summary_text(run), flush=True)
    return rc


def env_cmd(args) -> int:
    from .device import format_env_report, info, recommended_settings
    print(format_env_report(args.device))
    print()
    for r in recommended_settings(info(args.device)):
        print(f"  {r['setting']:<38} {r['value']:<28} {r['why']}")
    return 0


def existing_run(args, default: str = "latest") -> tuple[str, Path]:
    """A run that must already exist; reading one never creates its folder."""
    name = run_arg(args, default)
    run = run_dir(name, create=False)
    if not (run / "results.jsonl").is_file():
        what = "no results.jsonl records" if run.is_dir() else f"no results.jsonl records (no folder {run})"
        raise CliError(f"run {name!r} has {what}; run `hwlib reproduce --run {name}` first, or name "
                       f"another run with --run")
    return name, run


def table_cmd(args) -> int:
    from .query import workloads_in
    from .report.tables import ladder_rows_with_noise, markdown_table, what_we_saw
    name, run = existing_run(args)
    recs = query.load(run)
    if not recs:
        raise CliError(f"run {name!r} has no results.jsonl records that can be read ({run / 'results.jsonl'})")
    for w in workloads_in(recs):
        rows = ladder_rows_with_noise(recs, w)
        print(f"## {w}\n\n{markdown_table(rows)}\n{what_we_saw(rows, w)}\n")
    return 0


def readme_cmd(args) -> int:
    """Rebuild the generated blocks of README.md and docs/results.md (``report.pages``) from a reference
    run; with ``--readme`` or ``--results``, only the pages named. ``--check`` compares and never writes."""
    from .report.pages import RESULTS_PAGE, render_page
    name, run = existing_run(args, "reference/h100")
    given = [p for p in (args.readme, args.results) if p is not None]
    pages = [Path(p).resolve() for p in (given or [REPO_ROOT / "README.md", RESULTS_PAGE])]   # a link's target
    new = {}
    for page in pages:   # every page is made in memory before any is written
        try:
            text = page.read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"cannot read {page}: {e.strerror}") from None
        try:
            new[page] = (text, render_page(text, run))
        except ValueError as e:
            raise CliError(f"{page}: {e}; put the markers around the generated parts") from None
    stale = [p for p, (old, text) in new.items() if old != text]
    if args.check:
        for p in stale:
            print(f"{p.name}'s generated blocks are out of date with {run}: run `make readme`", file=sys.stderr)
        if not stale:
            print(f"{', '.join(p.name for p in pages)}: generated blocks match", run)
        return 1 if stale else 0
    for p in pages:
        old, text = new[p]
        if old != text:
            results.write_atomic(p, text)   # keeps the file's mode
        print(f"{p.name} updated" if old != text else f"{p.name} already up to date")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hwlib", description=__doc__.split("\n\n")[0])
    from . import __version__
    ap.add_argument("--version", action="version", version=f"hwlib {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run_help = "run name under outputs/ (default: $HWLIB_RUN, else latest)"
    r = sub.add_parser("reproduce", help="run the notebook series through papermill")
    f = sub.add_parser("first-look", help="five notebooks in minutes (00, 09, 25, 16, 99; GPT-2), then the headline "
                                          "and its ratio to the reference of the same GPU")
    for p, default in ((r, "latest"), (f, "first-look")):
        p.add_argument("--run", help=f"run name under outputs/ (default: $HWLIB_RUN, else {default})")
        p.add_argument("--profile", help="auto (full, mid or smoke: the largest that fits the GPU's memory), full, "
                                         "mid or smoke (default: $HWLIB_PROFILE, else auto)")
        p.add_argument("--device", default="auto", help="auto, cuda or cpu")
        p.add_argument("--force", action="store_true", help="rerun notebooks already done in this run")
        p.add_argument("--overwrite-reference", action="store_true",
                       help="allow measuring into an existing committed reference run (outputs/reference/...)")
        p.add_argument("--timeout", type=positive_seconds, default=900.0, help="seconds per notebook (default 900)")
        p.add_argument("--cell-timeout", type=positive_seconds, default=600.0, help="seconds per cell (default 600)")
        p.add_argument("--notebooks", default=str(NOTEBOOKS_DIR), help=argparse.SUPPRESS)
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--only", help="comma-separated notebook numbers or names, e.g. 00,01,99")
    r.add_argument("--workloads", help="comma-separated workloads for the notebooks' `workloads` parameter "
                                         "(default: each notebook's own list)")
    r.add_argument("--set", action="append", metavar="NN.NAME=VALUE",
                   help="a notebook parameter for this run, e.g. --set 19.noise_budget_s=100 (YAML value; "
                        "repeatable; recorded in state.json)")
    r.set_defaults(fn=reproduce)
    f.set_defaults(fn=first_look)
    e = sub.add_parser("env", help="print the environment report and recommended settings")
    e.add_argument("--device", default="auto")
    e.set_defaults(fn=env_cmd)
    t = sub.add_parser("table", help="print a run's tables")
    t.add_argument("--run", help=run_help)
    t.set_defaults(fn=table_cmd)
    m = sub.add_parser("readme", help="regenerate the generated parts of README.md and docs/results.md from a "
                                      "reference run")
    m.add_argument("--run", default="reference/h100")
    m.add_argument("--check", action="store_true", help="exit 1 if a generated part is out of date")
    m.add_argument("--readme", help=argparse.SUPPRESS)    # a page to rebuild instead of the two
    m.add_argument("--results", help=argparse.SUPPRESS)
    m.set_defaults(fn=readme_cmd)
    return ap


def _warn(message, category, filename, lineno, file=None, line=None):
    print(f"hwlib: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .device import ChoiceError, SettingError, Unavailable
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = _warn   # a damaged file is one line naming it, not a traceback-like dump
        try:
            return args.fn(args)
        except (CliError, ChoiceError, SettingError, Unavailable, RunNameError, runs.RunBusy) as e:
            print(f"hwlib {args.cmd}: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:   # before any notebook ran: the run folder cannot be made, locked or written
            where = f" ({e.filename})" if e.filename else ""
            print(f"hwlib {args.cmd}: error: {e.strerror or e}{where}: check that the folder exists, is writable "
                  f"and has space, or name another run with --run", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
