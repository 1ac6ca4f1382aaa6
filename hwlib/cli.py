"""Command line: ``hwlib reproduce``, ``hwlib env``, ``hwlib table``, ``hwlib readme``.

``reproduce`` executes the numbered notebooks in order through papermill, each in its own process
with a time limit, into ``outputs/<run>/executed/``. It goes on past a failing notebook, records
each notebook's outcome in ``outputs/<run>/state.json`` (so a rerun skips what is done, unless
``--force``), rebuilds tables, figures and ``summary.json`` from whatever results exist, then
reports the failures and exits non-zero if there were any. ``99_*`` notebooks derive everything
from the others' results and therefore always run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import query, results
from .paths import REPO_ROOT, run_dir

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"


class CliError(Exception):
    pass


def list_notebooks(folder: Path) -> list[Path]:
    nbs = sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb"))
    if not nbs:
        raise CliError(f"no numbered notebooks (NN_name.ipynb) in {folder}")
    return nbs


def select(nbs: list[Path], only: str | None) -> list[Path]:
    if not only:
        return nbs
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    out = []
    for w in wanted:
        hit = [p for p in nbs if p.stem == w or p.stem.split("_", 1)[0] == w.zfill(2) or p.name == w]
        if not hit:
            raise CliError(f"--only: unknown notebook {w!r}; choose from: {', '.join(p.stem for p in nbs)}")
        out += [h for h in hit if h not in out]
    return sorted(out)


def _run_one(nb: Path, out_nb: Path, log: Path, env: dict, timeout: float, cell_timeout: float,
             profile: str, device: str, workloads: list[str] | None = None) -> tuple[str, str]:
    cmd = [sys.executable, "-m", "papermill", str(nb), str(out_nb), "-k", "python3", "--cwd", str(nb.parent),
           "-p", "profile", profile, "-p", "device", device, "--execution-timeout", str(int(cell_timeout)),
           "--no-progress-bar", "--log-output"]
    if workloads:
        cmd += ["-y", json.dumps({"workloads": workloads})]   # JSON is YAML: a list parameter
    with open(log, "w") as lf:
        # Own process group: on timeout the kernel dies with papermill, not left behind holding the GPU.
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", f"exceeded the per-notebook limit of {timeout:.0f} s"
    if rc == 0:
        return "ok", ""
    tail = log.read_text(errors="replace").strip().splitlines()[-6:]
    return "failed", " | ".join(t.strip() for t in tail)[-400:]


def reproduce(args) -> int:
    from tqdm.auto import tqdm

    from .device import resolve_device
    from .profiles import resolve_profile
    dev = resolve_device(args.device)
    profile = resolve_profile(args.profile, dev)
    folder = Path(args.notebooks).resolve()
    nbs = select(list_notebooks(folder), args.only)
    workloads = None
    if getattr(args, "workloads", None):
        from .workloads import get_workload
        workloads = list(dict.fromkeys(get_workload(w).name for w in args.workloads.split(",") if w.strip()))
        if not workloads:
            raise CliError(f"--workloads {args.workloads!r} names no workload")
    run = run_dir(args.run)
    executed = run / "executed"
    executed.mkdir(exist_ok=True)
    state_path = run / "state.json"
    state = query.read_json(state_path, {}) or {}
    if state.get("_profile") not in (None, profile):
        raise CliError(f"run {run} was made with profile {state['_profile']!r}, not {profile!r}: "
                       f"use another --run or --force")
    state["_profile"] = profile
    env = dict(os.environ, HWLIB_RUN=str(run), HWLIB_PROFILE=profile, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    print(f"hwlib reproduce: {len(nbs)} notebooks, profile={profile}, device={dev.type}, run={run}", flush=True)
    t_all = time.perf_counter()
    bar = tqdm(nbs, unit="nb", dynamic_ncols=True, disable=args.quiet)
    for nb in bar:
        done = state.get(nb.stem, {}).get("status") == "ok"
        if done and not args.force and not nb.stem.startswith("99"):
            bar.write(f"  {nb.stem:<24} done earlier ({state[nb.stem]['seconds']:.0f} s), skipped; --force reruns")
            continue
        bar.set_postfix_str(nb.stem)
        t0 = time.perf_counter()
        status, why = _run_one(nb, executed / nb.name, executed / f"{nb.stem}.log", env, args.timeout,
                               args.cell_timeout, profile, dev.type, workloads)
        secs = time.perf_counter() - t0
        state[nb.stem] = {"status": status, "seconds": round(secs, 1), "reason": why,
                          "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        results.write_json(state_path, state)
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
    state["_last_seconds"] = round(total, 1)
    results.write_json(state_path, state)
    failed = [nb.stem for nb in nbs if state.get(nb.stem, {}).get("status") != "ok"]
    print(f"hwlib reproduce: {total:.0f} s in all")
    if failed:
        print(f"hwlib reproduce: {len(failed)} notebook(s) failed: {', '.join(failed)} "
              f"(logs in {executed}/<name>.log)", file=sys.stderr)
        return 1
    return 0


def env_cmd(args) -> int:
    from .device import format_env_report, info, recommended_settings
    print(format_env_report(args.device))
    print()
    for r in recommended_settings(info(args.device)):
        print(f"  {r['setting']:<38} {r['value']:<28} {r['why']}")
    return 0


def table_cmd(args) -> int:
    from .query import ladder_rows, workloads_in
    from .report.tables import markdown_table, what_we_saw
    run = run_dir(args.run)
    recs = query.load(run)
    if not recs:
        raise CliError(f"run {run} has no results.jsonl records; run `hwlib reproduce --run {args.run}` first")
    for w in workloads_in(recs):
        rows = ladder_rows(recs, w)
        print(f"## {w}\n\n{markdown_table(rows)}\n{what_we_saw(rows, w)}\n")
    return 0


def readme_cmd(args) -> int:
    from .report.tables import update_readme
    run = run_dir(args.run)
    if not (run / "results.jsonl").exists():
        raise CliError(f"{run} holds no results.jsonl")
    readme = REPO_ROOT / "README.md"
    if args.check:
        before = readme.read_text()
        changed = update_readme(readme, run)
        if changed:
            readme.write_text(before)
            print(f"README.md's reference table is out of date with {run}: run `make readme`", file=sys.stderr)
            return 1
        print("README.md's reference table matches", run)
        return 0
    print("README.md updated" if update_readme(readme, run) else "README.md already up to date")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hwlib", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reproduce", help="run the notebook series through papermill")
    r.add_argument("--run", default="latest", help="run name under outputs/ (default: latest)")
    r.add_argument("--only", help="comma-separated notebook numbers or names, e.g. 00,01,99")
    r.add_argument("--profile", default="auto", help="auto (full on a GPU, smoke on CPU), full or smoke")
    r.add_argument("--device", default="auto", help="auto, cuda or cpu")
    r.add_argument("--force", action="store_true", help="rerun notebooks already done in this run")
    r.add_argument("--workloads", help="comma-separated workloads for the notebooks' `workloads` parameter "
                                         "(default: each notebook's own list)")
    r.add_argument("--timeout", type=float, default=900, help="seconds per notebook (default 900)")
    r.add_argument("--cell-timeout", type=float, default=600, help="seconds per cell (default 600)")
    r.add_argument("--notebooks", default=str(NOTEBOOKS_DIR), help=argparse.SUPPRESS)
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(fn=reproduce)
    e = sub.add_parser("env", help="print the environment report and recommended settings")
    e.add_argument("--device", default="auto")
    e.set_defaults(fn=env_cmd)
    t = sub.add_parser("table", help="print a run's tables")
    t.add_argument("--run", default="latest")
    t.set_defaults(fn=table_cmd)
    m = sub.add_parser("readme", help="regenerate README.md's reference table from a reference run")
    m.add_argument("--run", default="reference/h100")
    m.add_argument("--check", action="store_true", help="exit 1 if the README's table is out of date")
    m.set_defaults(fn=readme_cmd)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .device import ChoiceError, Unavailable
    try:
        return args.fn(args)
    except (CliError, ChoiceError, Unavailable) as e:
        print(f"hwlib {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
