"""Command line: ``hwlib reproduce``, ``hwlib env``, ``hwlib table``, ``hwlib readme``.

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
from .paths import REPO_ROOT, RunNameError, compile_cache_env, is_reference, run_dir, run_name
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


def parameter_sets(items: list[str] | None, nbs: list[Path]) -> dict[str, dict]:
    """``--set NN.name=value`` options as {notebook stem: {name: value}}: the value read as YAML
    (numbers, lists, strings), the notebook one of those selected, the name one of its parameters."""
    import papermill
    import yaml
    out: dict[str, dict] = {}
    for item in items or []:
        key, eq, raw = item.partition("=")
        nb_id, dot, name = key.strip().partition(".")
        if not (eq and dot and nb_id and name):
            raise CliError(f"--set {item!r}: give NOTEBOOK.PARAMETER=VALUE, e.g. --set 19.noise_budget_s=100")
        hit = [p for p in nbs if p.stem == nb_id or p.stem.split("_", 1)[0] == nb_id.zfill(2)]
        if not hit:
            raise CliError(f"--set {item!r}: notebook {nb_id!r} is not among those this command runs "
                           f"({', '.join(p.stem for p in nbs)})")
        if name in OWN_PARAMETERS:
            raise CliError(f"--set {item!r}: reproduce sets {name!r} itself; use --{name}")
        names = papermill.inspect_notebook(str(hit[0]))   # its parameters cell's names
        if name not in names:
            raise CliError(f"--set {item!r}: {hit[0].stem} has no parameter {name!r}; its parameters: "
                           f"{', '.join(sorted(names)) or 'none'}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise CliError(f"--set {item!r}: the value is not YAML ({e.__class__.__name__})") from None
        out.setdefault(hit[0].stem, {})[name] = value
    return out


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


def _written(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def _run_one(nb: Path, run: Path, env: dict, args, profile: str, device: str,
             workloads: list[str] | None = None, params: dict | None = None) -> tuple[str, str]:
    executed = run / "executed"
    log = executed / f"{nb.stem}.log"
    stacks = executed / f"{nb.stem}.stacks"
    stacks.unlink(missing_ok=True)   # an earlier attempt's dump is not this one's
    env = {**env, **runs.stacks_env(stacks, args.timeout, args.cell_timeout)}
    cmd = [sys.executable, "-m", "papermill", str(nb), str(executed / nb.name), "-k", "python3",
           "--cwd", str(nb.parent), "-p", "profile", profile, "-p", "device", device,
           "--execution-timeout", str(math.ceil(args.cell_timeout)), "--no-progress-bar", "--log-output"]
    if workloads:
        cmd += ["-y", json.dumps({"workloads": workloads})]   # JSON is YAML: a list parameter
    if params:
        cmd += ["-y", json.dumps(params)]
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        watch = runs.TreeWatch(run, nb.stem, proc.pid)
        deadline = time.monotonic() + args.timeout
        try:
            while True:
                watch.poll()
                try:
                    rc = proc.wait(timeout=0.2)
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
    if rc == 0:
        return "ok", ""
    tail = log.read_text(errors="replace").strip().splitlines()[-6:]
    return "failed", " | ".join(t.strip() for t in tail)[-400:] + _stacks_note(stacks)


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
                    if left[1]:
                        print(f"hwlib reproduce: ended processes {left[1]} left running by a killed run of "
                              f"{left[0]} in {run}", file=sys.stderr)
                    # Even one that was done before: the killed rerun may have replaced some of its records.
                    runs.update_state(run, **{left[0]: _entry("interrupted", 0.0, "its run was killed")})
                runs.update_state(run, _profile=profile, _profile_reason=why, _device=device_name)
                print(f"hwlib reproduce: {len(nbs)} notebooks, profile={profile} ({why}), device={dev.type}, "
                      f"run={run}", flush=True)
                return _series(args, nbs, run, profile, dev.type, workloads, params)
        except Interrupted as e:
            print(f"hwlib reproduce: stopped by {e}; the running notebook's processes were ended and it "
                  f"is recorded as interrupted; run the same command again to resume", file=sys.stderr)
            return 128 + e.signum


def _entry(status: str, seconds: float, reason: str, params: dict | None = None) -> dict:
    e = {"status": status, "seconds": round(seconds, 1), "reason": reason,
         "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if params:   # a notebook run with other than its own defaults says so
        e["parameters"] = params
    return e


def _series(args, nbs: list[Path], run: Path, profile: str, device: str, workloads, params: dict) -> int:
    """Run the notebooks in order (under the run lock), then rebuild the run's tables."""
    from tqdm.auto import tqdm
    (run / "executed").mkdir(exist_ok=True)
    env = dict(os.environ, HWLIB_RUN=str(run), HWLIB_PROFILE=profile, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    for k, v in compile_cache_env(run, results.code_digest()).items():   # one compile cache for the run's notebooks
        env.setdefault(k, v)
    t_all = time.perf_counter()
    bar = tqdm(nbs, unit="nb", dynamic_ncols=True, disable=args.quiet)
    for nb in bar:
        before = query.state(run).get(nb.stem)
        if before and before["status"] == "ok" and not args.force and not nb.stem.startswith("99"):
            bar.write(f"  {nb.stem:<24} done earlier ({before['seconds']:.0f} s), skipped; --force reruns")
            continue
        bar.set_postfix_str(nb.stem)
        # the state says what the notebook ran with where it was not its own: --set, and --workloads
        # (fewer workloads take less time; the time table must not read that as the notebook's own)
        ran_with = {**(params.get(nb.stem) or {}), **({"workloads": workloads} if workloads else {})}
        t0 = time.perf_counter()
        try:
            status, why = _run_one(nb, run, env, args, profile, device, workloads, params.get(nb.stem))
        except BaseException as e:   # the tree is ended by now; the notebook must not read as done
            runs.update_state(run, **{nb.stem: _entry("interrupted", time.perf_counter() - t0,
                                                      f"{type(e).__name__}: {e}", ran_with)})
            raise
        secs = time.perf_counter() - t0
        runs.update_state(run, **{nb.stem: _entry(status, secs, why, ran_with)})
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
    state = runs.update_state(run, _last_seconds=round(total, 1))
    failed = [nb.stem for nb in nbs if state.get(nb.stem, {}).get("status") != "ok"]
    print(f"hwlib reproduce: {total:.0f} s in all")
    if failed:
        print(f"hwlib reproduce: {len(failed)} notebook(s) failed: {', '.join(failed)} "
              f"(logs in {run / 'executed'}/<name>.log)", file=sys.stderr)
        return 1
    return 0


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
    from .report.tables import README_END, README_START, render_readme
    name, run = existing_run(args, "reference/h100")
    readme = Path(args.readme)
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read {readme}: {e.strerror}") from None
    if README_START not in text or README_END not in text:
        raise CliError(f"{readme}: markers {README_START} ... {README_END} not found; put them around the "
                       f"reference section")
    # The new text is made in memory: --check compares and never writes.
    try:
        new = render_readme(text, run)
    except ValueError as e:
        raise CliError(f"{readme}: {e}") from None
    if args.check:
        if new != text:
            print(f"{readme.name}'s generated tables are out of date with {run}: run `make readme`", file=sys.stderr)
            return 1
        print(f"{readme.name}'s generated tables match", run)
        return 0
    if new != text:
        results.write_atomic(readme, new)   # keeps the file's mode
    print(f"{readme.name} updated" if new != text else f"{readme.name} already up to date")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hwlib", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run_help = "run name under outputs/ (default: $HWLIB_RUN, else latest)"
    r = sub.add_parser("reproduce", help="run the notebook series through papermill")
    r.add_argument("--run", help=run_help)
    r.add_argument("--only", help="comma-separated notebook numbers or names, e.g. 00,01,99")
    r.add_argument("--profile", help="auto (full, mid or smoke: the largest that fits the GPU's memory), full, "
                                     "mid or smoke (default: $HWLIB_PROFILE, else auto)")
    r.add_argument("--device", default="auto", help="auto, cuda or cpu")
    r.add_argument("--force", action="store_true", help="rerun notebooks already done in this run")
    r.add_argument("--overwrite-reference", action="store_true",
                   help="allow measuring into an existing committed reference run (outputs/reference/...)")
    r.add_argument("--workloads", help="comma-separated workloads for the notebooks' `workloads` parameter "
                                         "(default: each notebook's own list)")
    r.add_argument("--set", action="append", metavar="NN.NAME=VALUE",
                   help="a notebook parameter for this run, e.g. --set 19.noise_budget_s=100 (YAML value; "
                        "repeatable; recorded in state.json)")
    r.add_argument("--timeout", type=positive_seconds, default=900.0, help="seconds per notebook (default 900)")
    r.add_argument("--cell-timeout", type=positive_seconds, default=600.0, help="seconds per cell (default 600)")
    r.add_argument("--notebooks", default=str(NOTEBOOKS_DIR), help=argparse.SUPPRESS)
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(fn=reproduce)
    e = sub.add_parser("env", help="print the environment report and recommended settings")
    e.add_argument("--device", default="auto")
    e.set_defaults(fn=env_cmd)
    t = sub.add_parser("table", help="print a run's tables")
    t.add_argument("--run", help=run_help)
    t.set_defaults(fn=table_cmd)
    m = sub.add_parser("readme", help="regenerate README.md's reference table from a reference run")
    m.add_argument("--run", default="reference/h100")
    m.add_argument("--check", action="store_true", help="exit 1 if the README's table is out of date")
    m.add_argument("--readme", default=str(REPO_ROOT / "README.md"), help=argparse.SUPPRESS)
    m.set_defaults(fn=readme_cmd)
    return ap


def _warn(message, category, filename, lineno, file=None, line=None):
    print(f"hwlib: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .device import ChoiceError, Unavailable
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = _warn   # a damaged file is one line naming it, not a traceback-like dump
        try:
            return args.fn(args)
        except (CliError, ChoiceError, Unavailable, RunNameError, runs.RunBusy) as e:
            print(f"hwlib {args.cmd}: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
