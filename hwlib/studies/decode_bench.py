"""The decode ladder past notebook 14's rung d, measured in one process (issue 47): for each model
size, the Qwen3-shaped LM with LoRA (random weights), the P N = 12 rows of the bonus, and each rung
of ``fused_decode.RUNGS`` checked (greedy tokens against Hugging Face's batched ``generate``, with
notebook 14's rounding-tie rule) and timed; then the lab's earlier best, ``decode.OwnDecodeLoop``
(rung 14d_static_own), timed the way notebook 14 times it. Writes rows (JSON) and records
(``hwlib.results``) as it goes, so that a run cut short keeps what it measured.

    python -m hwlib.studies.decode_bench --sizes qwen3_0.6b qwen3_8b --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .. import bench, ceilings
from ..results import pack
from ..workloads.polychromic import build, decode, fused_decode
from ..workloads.polychromic.config import config
from . import generation

# What its records name as the place that made them (a notebook's records name the notebook).
STUDY = "decode_bench"


def log(msg: str) -> None:
    """A progress line with the time of day (the GPU studies' logs)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure_copy(dev: torch.device, out: Path | None = None) -> float:
    """The copy ceiling in GB/s, measured here (``ceilings.copy_gbps``: 2 GiB ``dst.copy_(src)``), logged
    and, with ``out``, written to ``out/copy.json`` with its timing."""
    ceil = ceilings.copy_gbps(dev)
    copy = 2 * ceilings.SIZES[dev.type]["copy_bytes"] / (ceil.median_ms / 1e3) / 1e9
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log(f"{name}: copy {copy:,.0f} GB/s (measured here, 2 GiB dst.copy_(src))")
    if out is not None:
        (Path(out) / "copy.json").write_text(json.dumps({"device": name, "copy_gbps": copy, "timing": ceil.to_dict()}))
    return copy


def write_rows(out: Path, stem: str, rows: list, records: list) -> None:
    """A study's rows so far for one model size (``<stem>_<size>.json``, the size of ``rows[0]``) and every
    record so far (``results.jsonl``) under ``out``: rewritten after each rung, so that a run cut short
    keeps what it measured."""
    size = rows[0]["model_size"].replace(".", "_")
    (out / f"{stem}_{size}.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / "results.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in pack(records)))


def read_rows(out: Path, stem: str) -> list[dict]:
    """Every ``<stem>_*.json`` under ``out`` as ``write_rows`` wrote them, the smaller model first."""
    rows = []
    for f in sorted(Path(out).glob(f"{stem}_*.json"), key=lambda f: ("8b" in f.name, f.name)):
        rows += json.loads(f.read_text())
    return rows


def run_size(model_size: str, dev: torch.device, copy_gbps: float, *, reps: int, check_tokens: int,
             baseline: bool, variants: bool, out: Path, records: list, seed: int = 0,
             overrides: dict | None = None, profile: tuple = (),
             rungs: tuple = fused_decode.RUNGS) -> list[dict]:
    """The LM of ``model_size`` built (random weights, LoRA), its prompts drawn, then ``ladder``."""
    cfg = config(model_size, **(overrides or {}))
    t0 = time.perf_counter()
    pm = build.add_lora(build.build_lm(cfg, dev, seed), cfg, seed)
    bench.synchronize(dev)
    mem = torch.cuda.memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    log(f"{model_size}: built in {time.perf_counter() - t0:.1f} s, {mem:.1f} GiB")
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.tok_vocab, (cfg.prompts, cfg.prompt_len), generator=g).to(dev)
    rows = ladder(pm, cfg, prompts, dev, copy_gbps, model_size=model_size, reps=reps, check_tokens=check_tokens,
                  baseline=baseline, variants=variants, out=out, records=records, seed=seed, profile=profile,
                  rungs=rungs)
    del pm
    _free(dev)
    return rows


def ladder(pm, cfg, prompts: torch.Tensor, dev: torch.device, copy_gbps: float | None, *, model_size: str,
           reps: int, check_tokens: int, baseline: bool = True, variants: bool = False, out: Path | None = None,
           records: list | None = None, seed: int = 0, profile: tuple = (), rungs: tuple = fused_decode.RUNGS) -> list[dict]:
    """Every fused rung in ``rungs`` (and, with ``variants``, rung rope_cache under other SDPA
    backends; with ``baseline``, ``decode.OwnDecodeLoop``) for the LM ``pm`` and its P prompts: greedy
    check against Hugging Face's batched greedy ``generate`` of ``check_tokens`` tokens, then the
    timing (``generation.fused_rung_row``). Rows, one per rung; records appended to ``records`` and
    both written under ``out`` after each rung (None: neither)."""
    records = [] if records is None else records
    P, N, L, T = cfg.prompts, cfg.replies, cfg.prompt_len, cfg.new_tokens
    B = P * N
    lg: list = []
    ref = decode.generate_batched(pm, prompts, cfg, greedy=True, new_tokens=check_tokens, logits=lg).cpu()
    ref_logits = torch.stack(lg)
    params = {"config": cfg.params(), "model_size": model_size, "seed": seed, "copy_gbps": copy_gbps,
              "reference": "14c_batched greedy (Hugging Face generate, eager)"}
    rows, prev = [], None
    plan = [(r, None) for r in rungs]
    if variants and "rope_cache" in rungs:     # the SDPA backends at the rung before the decode kernel
        i = plan.index(("rope_cache", None))
        plan[i + 1:i + 1] = [("rope_cache", "cudnn"), ("rope_cache", "math")]
    for rung, backend in plan:
        name = rung if backend is None else f"{rung}[{backend}]"
        row = {"rung": name, "batch": B, "model_size": model_size, "change": fused_decode.CHANGES[rung], "status": "ok"}
        try:
            dec = fused_decode.FusedDecoder(pm, cfg, B, L + T, dev, rung=rung, sdpa_backend=backend)
            chk, toks = generation.decode_check(dec, prompts, ref, ref_logits, check_tokens, prev)
            row.update(chk)
            row.update(generation.fused_rung_row(dec, prompts, T, reps, copy_gbps))
            if backend is None:
                prev = toks
            if profile and rung in profile:
                row["kernels"] = kernel_table(dec, prompts, T)
                log(f"{model_size} {name} kernels per decode step:\n" + "\n".join(
                    f"  {k['us_per_step']:8.1f} us  {k['calls_per_step']:6.1f}x  {k['name'][:110]}" for k in row["kernels"]))
            del dec
        except Exception as e:       # a rung that cannot run is a row with its reason
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:400]}")
        _free(dev)
        for k in ("agreement", "agreement_vs_prev", "divergences", "divergences_at_ties"):
            row[f"greedy_{k}"] = row.get(k)
        rows.append(row)
        log(f"{model_size} {name}: " + json.dumps({k: row.get(k) for k in (
            "status", "decode_ms_per_step", "decode_gbps", "decode_share_of_copy", "decode_floor_ms", "agreement",
            "agreement_vs_prev", "divergences", "divergences_at_ties", "first_call_s", "reason")}))
        records.extend(generation.decode_records([row], notebook=STUDY, model_size=model_size, device=dev.type, params=params))
        if out is not None:
            _flush(out, rows, records)
    if baseline:
        row = {"rung": "14d_static_own", "batch": B, "model_size": model_size, "status": "ok",
               "change": generation.RUNGS["14d_static_own"][1]}
        try:
            loop = decode.OwnDecodeLoop(pm, cfg, B, L + T, dev)
            first, gb = bench.wall_s(lambda: loop(prompts, greedy=True, new_tokens=T), dev)
            gb = gb[..., :check_tokens].cpu()
            same = (gb == ref).long().cumprod(-1)
            row.update(first_call_s=first, agreement=float(same.float().mean()),
                       **generation.divergence_ties(same[:, 0], None, ref_logits,
                                           noise=max((r.get("logit_noise") or 0.0) for r in rows) or None))
            full = generation.time_decoder(lambda: loop(prompts, new_tokens=T), T, reps, dev)
            one = generation.time_decoder(lambda: loop(prompts, new_tokens=1), 1, reps, dev)
            ms = 1e3 * (full["gen_s"] - one["gen_s"]) / (T - 1)
            nbytes = fused_decode.generation_step_bytes(cfg, B, L, T)
            row.update(decode_ms_per_step=ms, gen_s=full["gen_s"], gen_tokens_per_s=B * T / full["gen_s"],
                       bytes_per_step=nbytes["total"], bytes_parts=nbytes,
                       **{f"decode_{k}": v for k, v in fused_decode.bandwidth(nbytes["total"], ms, copy_gbps).items()},
                       timing="(median generation of T tokens - median of 1 token) / (T - 1), wall clock")
            del loop
        except Exception as e:
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:400]}")
        for k in ("agreement", "divergences", "divergences_at_ties"):
            row[f"greedy_{k}"] = row.get(k)
        rows.append(row)
        log(f"{model_size} 14d_static_own: " + json.dumps({k: row.get(k) for k in (
            "status", "decode_ms_per_step", "decode_gbps", "decode_share_of_copy", "agreement", "divergences",
            "divergences_at_ties", "first_call_s", "reason")}))
        records.extend(generation.decode_records([row], notebook=STUDY, model_size=model_size, device=dev.type, params=params))
        if out is not None:
            _flush(out, rows, records)
    return rows


def kernel_table(dec, prompts: torch.Tensor, T: int, top: int = 25) -> list[dict]:
    """The GPU kernels of one sampled generation's decode steps under torch.profiler, per decode step
    (time and launches), longest first: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    dec(prompts, new_tokens=T)
    step = dec._runner(True)
    steps = T - 1
    dec.pos.fill_(prompts.shape[1])      # the replays alone, over the last generation's positions again
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [{"name": e.key, "us_per_step": e.device_time_total / steps, "calls_per_step": e.count / steps}
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def _free(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _flush(out: Path, rows: list, records: list) -> None:
    write_rows(out, "decode_rows", rows, records)
    write_table(out)


def _cell(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    """The ladder as a Markdown table, one line per (model size, rung), from the rows as written."""
    head = ("| model | rung | ms/step (p20-p80) | x vs rung before | GB/s | of copy | floor ms | greedy agreement "
            "| divergences at ties |\n|" + " --- |" * 9)
    lines = [head]
    ok = [r.get("decode_ms_per_step") if r.get("status") == "ok" else None for r in rows]
    gains = fused_decode.speedups([(r.get("model_size"), str(r.get("rung")), ms) for r, ms in zip(rows, ok)])
    for r, ms, x in zip(rows, ok, gains):
        size = r.get("model_size")
        if ms is None:
            lines.append(f"| {size} | {r.get('rung')} | {r.get('status')}: {str(r.get('reason'))[:70]} | | | | | | |")
            continue
        gain = f"{x:.2f}x" if x else ""
        span = f" ({r['ms_p20']:.3f}-{r['ms_p80']:.3f})" if r.get("ms_p20") is not None else ""
        lines.append(f"| {size} | {r.get('rung')} | {ms:.3f}{span} | {gain} | {_cell(r.get('decode_gbps'), ',.0f')} "
                     f"| {_cell(r.get('decode_share_of_copy'), '.1%')} | {_cell(r.get('decode_floor_ms'), '.3f')} "
                     f"| {_cell(r.get('agreement'), '.2f')} | {r.get('divergences_at_ties')}/{r.get('divergences')} |")
    return "\n".join(lines) + "\n"


def write_table(out: Path) -> Path:
    """``decode_table.md`` from every ``decode_rows_*.json`` under ``out`` (smallest model first)."""
    path = Path(out) / "decode_table.md"
    path.write_text(table(read_rows(out, "decode_rows")))
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["qwen3_0.6b", "qwen3_8b"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--rungs", nargs="+", default=list(fused_decode.RUNGS), help="fused rungs to run, in order (default: the measured ones; "
                                                                   "fused_decode.ALL_RUNGS lists every rung)")
    ap.add_argument("--profile", nargs="*", default=[], help="rungs whose kernels to list (torch.profiler)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the same code eagerly (a dry run: its "
                                                        "times say nothing)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("decode_bench: no CUDA GPU visible (pass --device cpu for a dry run)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    copy = measure_copy(dev, out)
    records: list = []
    for size in a.sizes:
        run_size(size, dev, copy, reps=a.reps, check_tokens=a.check_tokens, baseline=not a.no_baseline,
                 variants=a.variants, out=out, records=records, rungs=tuple(a.rungs), profile=tuple(a.profile))
    log("done")


if __name__ == "__main__":
    main()
