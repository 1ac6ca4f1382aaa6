"""The seed's trainer cycle end to end at each model size and rung (issue 47): ``every`` trainer steps
(LoRA, gradient checkpointing), the last with the diversity bonus (generation, the text round trip,
encoding, the score), timed phase by phase as notebook 14 times them (``generation.measure_rung``),
for notebook 14's rungs a-d and for the decode ladder's decoder (``fused_decode.FusedDecoder``) at
the rungs asked, as rung "14e_fused_<rung>", and last with the training step compiled as well
(rung "14f_compiled_train"). Every rung trains from the same state and must give the same trainer
losses (``generation.QUALITY_TOL``): a rung changes how replies are generated, never the training;
14f changes the training's rounding and is held to the loss-curve tolerance of the ladder's compiled
steps (``generation.COMPILED_TRAIN_TOL``).

Notebook 14 runs the 0.6B model; this runs any size in one process, the 8B one (the seed's own size)
included, whose uncached seed way alone takes minutes a cycle. Writes rows (JSON), records
(``hwlib.results``) and ``cycle_table.md`` after each rung, so that a run cut short keeps what it
measured.

    python -m hwlib.studies.trainer_cycle --sizes qwen3_8b --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .. import bench
from ..workloads import polychromic as pc
from ..workloads.polychromic import fused_decode
from . import generation
from .decode_bench import log, measure_copy, read_rows, write_rows

STUDY = "trainer_cycle"
DEFAULT_RUNGS = (*generation.RUNGS, generation.fused_step("top_p"), generation.COMPILED_TRAIN)


def run_size(model_size: str, dev: torch.device, copy_gbps: float | None, rungs: tuple, cycles: dict,
             out: Path | None, records: list, seed: int = 0, overrides: dict | None = None,
             profile_train: bool = False) -> list[dict]:
    """The trainer of ``model_size`` (random weights, LoRA), the steps before the bonus timed once
    (``generation.prefix``), then ``generation.measure_rung`` for each rung of ``rungs`` with
    ``cycles[rung]`` cycles (default 3). Rows, one per rung; the first ok rung's losses are the others'
    reference."""
    cfg = pc.config(model_size, **(overrides or {}))
    build_s, tr = bench.wall_s(lambda: pc.Trainer(cfg, dev, seed), dev)
    mem = torch.cuda.memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    log(f"{model_size}: trainer built in {build_s:.1f} s, {mem:.1f} GiB")
    params = {"config": cfg.params(), "model_size": model_size, "seed": seed, "copy_gbps": copy_gbps}
    if profile_train:
        prof = train_step_profile(tr)
        log(f"{model_size}: trainer step {prof['wall_ms_per_step']:.1f} ms wall, device busy "
             f"{prof['device_busy_ms_per_step']:.1f} ms; by device time:\n" + "\n".join(
                 f"  {r['device_ms_per_step']:9.2f} ms  {r['calls_per_step']:7.0f}x  host {r['host_ms_per_step']:8.2f} ms  "
                 f"{r['op']}" for r in prof["by_device"]) + "\nby host time:\n" + "\n".join(
                 f"  {r['host_ms_per_step']:9.2f} ms  {r['calls_per_step']:7.0f}x  {r['op']}" for r in prof["by_host"]))
        if out is not None:
            (out / f"train_profile_{model_size.replace('.', '_')}.json").write_text(json.dumps(prof, indent=1))
        tr.reset()
    if not rungs:
        return []
    pre = generation.prefix(tr)
    log(f"{model_size}: {len(pre['losses'])} trainer steps before the bonus, {pre['seconds']:.2f} s")
    rows, base = [], None
    for step in rungs:
        r = generation.measure_rung(tr, step, cycles.get(step, 3), pre=pre, copy_gbps=copy_gbps, base_losses=base)
        r["model_size"] = model_size
        if base is None and r["status"] == "ok":
            base = r["losses"]
        rows.append(r)
        log(f"{model_size} {step}: " + json.dumps({k: r.get(k) for k in (
            "status", "ms_per_cycle", "ms_p20", "ms_p80", "gen_tokens_per_s", "decode_ms_per_step",
            "decode_share_of_copy", "share_generation", "share_training", "warmup_s",
            "quality_loss_max_rel_diff", "reason")}, default=str))
        records.extend(generation.rung_records([r], notebook=STUDY, profile="full", device=dev.type, params=params,
                                               fields={"model_size": model_size}))
        if out is not None:
            _flush(out, rows, records)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def train_step_profile(tr, steps: int = 2, top: int = 25) -> dict:
    """Where one trainer step's time goes: ``steps`` steps after one untimed, under torch.profiler
    (host and device), the ops with the most device time and with the most host time, per step."""
    from torch.profiler import ProfilerActivity, profile
    tr.train_step(0)
    bench.synchronize(tr.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for k in range(steps):
            tr.train_step(k)
        bench.synchronize(tr.device)
    wall = (time.perf_counter() - t0) / steps
    ev = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    rows = lambda key: [{"op": e.key[:100], "calls_per_step": e.count / steps,
                         "device_ms_per_step": getattr(e, dev_key, 0) / 1e3 / steps,
                         "host_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
                        for e in sorted(ev, key=key, reverse=True)[:top]]
    busy = sum(getattr(e, dev_key, 0) for e in ev) / 1e3 / steps
    return {"wall_ms_per_step": 1e3 * wall, "device_busy_ms_per_step": busy,
            "by_device": rows(lambda e: getattr(e, dev_key, 0)), "by_host": rows(lambda e: e.self_cpu_time_total)}


def _flush(out: Path, rows: list, records: list) -> None:
    write_rows(out, "cycle_rows", rows, records)
    write_table(out)


def table(rows: list[dict]) -> str:
    """The cycles as a Markdown table, one line per (model size, rung), from the rows as written: the
    cycle's time (p20-p80 across cycles), its speed-up over the rung before and over the seed's way
    (where the seed's way ran for that size), and the share of each phase."""
    cols = ["model", "rung", "s per cycle (p20-p80)", "x vs rung before", "x vs seed's way", "tokens/s",
            "decode ms/step", "of copy", *(f"{p} share" for p in pc.PHASES), "losses equal"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    prev: dict = {}
    first: dict = {}
    for r in rows:
        size = r.get("model_size")
        if r.get("status") != "ok":
            lines.append(f"| {size} | {r.get('step')} | {r.get('status')}: {str(r.get('reason'))[:80]} |"
                         + " |" * (len(cols) - 3))
            continue
        s = r["ms_per_cycle"] / 1e3
        if r["step"] == "14a_seed_way":
            first[size] = s
        before, seed = prev.get(size), first.get(size)
        prev[size] = s
        share = r.get("decode_share_of_copy")
        diff, tol = r["quality_loss_max_rel_diff"], r.get("quality_tol")
        same = "yes" if diff <= (generation.QUALITY_TOL if tol is None else tol) else "NO"
        if tol is not None:      # a rung that changes the training: its difference against its tolerance
            same += f" ({diff:.1e} <= {tol:g})" if same == "yes" else f" ({diff:.1e} > {tol:g})"
        lines.append(
            f"| {size} | {r['step']} | {s:.3f} ({r['ms_p20'] / 1e3:.3f}-{r['ms_p80'] / 1e3:.3f}) | "
            f"{'' if before is None else f'{before / s:.2f}x'} | {'' if seed is None else f'{seed / s:.1f}x'} | "
            f"{r['gen_tokens_per_s']:,.0f} | {r['decode_ms_per_step']:.2f} | {'' if share is None else f'{share:.1%}'} | "
            + " | ".join(f"{r[f'share_{p}']:.1%}" for p in pc.PHASES) + f" | {same} |")
    return "\n".join(lines) + "\n"


def write_table(out: Path) -> Path:
    """``cycle_table.md`` from every ``cycle_rows_*.json`` under ``out`` (smallest model first)."""
    path = Path(out) / "cycle_table.md"
    path.write_text(table(read_rows(out, "cycle_rows")))
    return path


def _rung(name: str) -> str:
    """A command-line rung: a notebook 14 rung, or a fused rung by its name alone ("top_p")."""
    if name in generation.RUNGS or name == generation.COMPILED_TRAIN or name.startswith(generation.FUSED + "_"):
        generation._row(name, 1)      # a clear error for an unknown one
        return name
    try:
        return generation.fused_step(name)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rungs: {name!r} is neither a notebook 14 rung "
                                         f"({', '.join(generation.RUNGS)}) nor a fused rung "
                                         f"({', '.join(fused_decode.ALL_RUNGS)})") from None


def _cycles(text: str) -> tuple[str, int]:
    name, _, n = text.rpartition("=")
    if not name or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"--cycles: {text!r} is not RUNG=N with N a positive integer")
    return _rung(name), int(n)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["qwen3_8b"], choices=("qwen3_0.6b", "qwen3_8b"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--rungs", nargs="*", type=_rung, default=list(DEFAULT_RUNGS),
                    help="notebook 14 rungs (14a_seed_way ...) and fused rungs by name (graph ... top_p), in order; "
                         "none with --profile-train: the profile alone")
    ap.add_argument("--cycles", nargs="*", type=_cycles, default=[],
                    help="RUNG=N cycles for a rung (default 3; the uncached per-reply rungs 1)")
    ap.add_argument("--profile-train", action="store_true",
                    help="first list where one trainer step's time goes (torch.profiler), per size")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the smoke-sized trainer eagerly (a dry run)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("trainer_cycle: no CUDA GPU visible (pass --device cpu for a dry run)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    copy = measure_copy(dev, out) if dev.type == "cuda" else None
    cycles = {"14a_seed_way": 1, "14b_eval_kv_cache": 1, **dict(a.cycles)}
    records: list = []
    for size in a.sizes:
        run_size("smoke" if dev.type == "cpu" else size, dev, copy, tuple(a.rungs), cycles, out, records,
                 profile_train=a.profile_train)
    log("done")


if __name__ == "__main__":
    main()
