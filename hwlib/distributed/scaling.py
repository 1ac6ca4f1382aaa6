"""Weak and strong scaling: the world sizes a machine can run, the launches that measure them, and
the rows, figures and prose made of their records.

Efficiency at K processes compares with one process running the ladder's step alone (strategy
``single``, K = 1) under the same scaling:

    weak   (per-GPU batch fixed):  efficiency = throughput_K / (K x throughput_1)
    strong (global batch fixed):   efficiency = throughput_K / (K x throughput_1)

the same formula; under weak scaling throughput_1 runs the per-GPU batch, under strong scaling the
global one (at K = 1 the two coincide). 1.0 is perfect scaling; a strategy at K = 1 shows what its
wrapper costs on one GPU.

``rows``, ``bandwidth_rows``, the figures and ``what_we_saw`` are pure functions of the records they
are handed (the edge reads them through ``hwlib.query``).
"""

from __future__ import annotations

import math

from .launch import LaunchError, RankFailed, launch
from .request import SCALINGS, Request, Unsplittable, batches, replace
from .strategies import STRATEGIES

CANDIDATE_WORLD_SIZES = (1, 2, 4, 8)
CPU_MAX_WORLD = 2   # gloo on a CPU checks the code path; more processes would only share the same cores

# The targets for GPT-2 small (full profile, strong scaling at a global batch of 16 x 1024), best
# strategy at that K.
TARGETS = {("weak", 2): 0.97, ("strong", 2): 0.85, ("weak", 4): 0.95, ("strong", 4): 0.75}

SPLIT_METRICS = ("compute_ms", "comm_ms", "exposed_comm_ms", "overlapped_comm_ms", "idle_ms", "step_ms")


def world_sizes(device_kind: str, gpus: int, candidates=CANDIDATE_WORLD_SIZES) -> list[dict]:
    """Each candidate K with ``status`` 'run' or 'skipped' and the reason."""
    out = []
    for k in candidates:
        if device_kind == "cuda":
            ok = k <= gpus
            why = None if ok else f"needs {k} GPUs; {gpus} present"
        else:
            ok = k <= CPU_MAX_WORLD
            why = None if ok else f"on a CPU (gloo) the smoke run stops at {CPU_MAX_WORLD} processes"
        out.append({"world_size": k, "status": "run" if ok else "skipped", "reason": why})
    return out


def reference_curves(rows: list[dict]) -> dict:
    """{workload: {global batch: check losses}} of the one-process runs among launch rows."""
    ref: dict = {}
    for r in rows:
        if r["strategy"] == "single" and r["world_size"] == 1 and r["status"] == "ok":
            ref.setdefault(r["workload"], {})[r["global_batch"]] = r["check_losses"]
    return ref


def measure(req: Request, ks: list[int], *, strategies_at_one=(), separate_launches: bool = True,
            timeout_s: float = 540.0, comm_sizes_mb: tuple = (), echo: bool = True) -> list[dict]:
    """Launch the job for each K in ``ks``: K = 1 runs ``single`` (and the strategies listed in
    ``strategies_at_one`` too: a wrapper's own cost on one GPU, and the K = 1 point of its own
    scaling), each larger K runs the strategies. With ``separate_launches`` every (strategy,
    workload) gets a torchrun launch, a fresh set of processes, of its own: a failing job then costs
    only its own rows, and no job starts in a process that earlier jobs compiled, allocated and
    profiled in (Vision-BDH jobs that ran after others in one process turned their loss to NaN at
    step 2 twice, under DDP at K = 2 and under ZeRO at K = 1; the DDP job alone in its process did
    not). Otherwise one launch per K runs them all.
    The one-process curves travel to the later launches for the same-math check. A failed launch is
    reported in its outcome row (its measurements are recorded as failed) and the others go on.
    Returns one outcome row per launch: K, strategies, workloads, status, seconds, error and the
    launch's rows (``launch.LaunchResult.rows``)."""
    from tqdm.auto import tqdm
    plan = launch_plan(req, ks, strategies_at_one, separate_launches)
    outcomes, ref = [], {w: dict(d) for w, d in req.reference.items()}
    for k, strats, wls in tqdm(plan, desc="torchrun launches", unit="launch"):
        first = plan_first(plan, k)
        r = replace(req, strategies=tuple(strats), workloads=tuple(wls), reference=ref,
                    comm_sizes_mb=comm_sizes_mb if (k > 1 and (strats, wls) == first) else ())
        row = {"world_size": k, "strategies": ",".join(strats), "workloads": ",".join(wls), "status": "ok",
               "seconds": None, "error": None, "rows": []}
        bad = unsplittable(r, k)
        if bad:   # e.g. mid's GPT global batch of 4 at K = 8: that point cannot exist, the rest still runs
            outcomes.append({**row, "status": "skipped", "error": "; ".join(bad.values())})
            keep = tuple(sc for sc in r.scalings if sc not in bad)
            if not keep:
                continue
            r = replace(r, scalings=keep)
        try:
            res = launch(r, k, timeout_s=timeout_s, echo=echo)
            row.update(seconds=res.seconds, rows=res.rows)
            for w, d in reference_curves(res.rows).items():
                ref.setdefault(w, {}).update(d)
        except RankFailed as e:
            row.update(status="failed", seconds=e.seconds, error=str(e), rank=e.rank, detail=e.detail)
        except LaunchError as e:
            row.update(status="failed", error=str(e))
        outcomes.append(row)
    return outcomes


def unsplittable(req: Request, world: int) -> dict[str, str]:
    """The scalings of ``req`` whose global batch of one of its workloads does not split over
    ``world`` processes, each with the reason."""
    out: dict[str, str] = {}
    for w in req.workloads:
        for sc in req.scalings:
            try:
                batches(req, w, sc, world)
            except Unsplittable as e:
                out.setdefault(sc, str(e))
    return out


def launch_plan(req: Request, ks: list[int], strategies_at_one=(), separate_launches: bool = True) -> list[tuple]:
    """The launches ``measure`` makes, in order: (K, strategies, workloads) each."""
    plan = []
    for k in ks:
        strats = [s for s in req.strategies if s != "single"]
        if k == 1:
            # The baseline first (every efficiency needs it), then the wrappers on one GPU.
            groups = [["single"], *[[s] for s in strategies_at_one if s != "single"]] if separate_launches else \
                [["single"] + [s for s in strategies_at_one if s != "single"]]
        else:
            groups = [[s] for s in strats] if separate_launches else [strats]
        for g in groups:
            if g:
                plan += [(k, g, [w]) for w in req.workloads] if separate_launches else [(k, g, list(req.workloads))]
    return plan


def plan_first(plan: list, k: int) -> tuple:
    """(strategies, workloads) of the first launch at world size ``k`` (it also measures the
    all-reduce bandwidth)."""
    return next((g, w) for kk, g, w in plan if kk == k)


# --- rows from records ----------------------------------------------------------------------------------

def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _key(r: dict) -> tuple:
    f = r.get("fields") or {}
    return (r.get("workload"), f.get("world_size"), f.get("strategy"), f.get("scaling"), f.get("per_gpu_batch"),
            f.get("global_batch"), f.get("options"), r.get("step"))


def label(r: dict) -> str:
    """A scaling row's strategy with the options it changed from torch's defaults (two DDP rows of
    one K may differ only there)."""
    opts = r.get("options") or {}
    if isinstance(opts, str):
        return f"{r['strategy']} ({opts})"
    return r["strategy"] + (f" ({', '.join(f'{k}={v}' for k, v in sorted(opts.items()))})" if opts else "")


def rows(records: list[dict], notebook: str | None = None) -> list[dict]:
    """One row per (workload, world size, strategy, scaling, batches, options) of the scaling records
    (those whose fields name a world size, a strategy and a scaling; only ``notebook``'s where one is given),
    with throughput, speed-up and efficiency against one process, the communication split and the
    same-math check; sorted by workload, scaling, K, strategy."""
    groups: dict = {}
    for r in records:
        f = r.get("fields") or {}
        if notebook is not None and r.get("notebook") != notebook:
            continue
        if not {"world_size", "strategy", "scaling"} <= set(f):
            continue
        groups.setdefault(_key(r), {})[r["metric"]] = r
    out = []
    for key, m in groups.items():
        ms = m.get("ms_per_step")
        if ms is None:
            continue
        if ms.get("measurement"):   # only the metrics of the newest measurement of this key
            m = {k: v for k, v in m.items() if v.get("measurement") in (None, ms["measurement"])}
        w, k, strat, sc, per, glob, opts, step = key
        thr = next((v for name, v in m.items() if name.endswith("_per_s")), {})
        status = ms.get("status", "ok")
        if status == "ok" and ms.get("contended"):
            status = "contended"
        check = m.get("same_math_max_rel")
        if check and check.get("status") == "failed":
            status = "math changed"
        row = {"workload": w, "world_size": k, "strategy": strat, "scaling": sc, "per_gpu_batch": per,
               "global_batch": glob, "options": opts, "step": step, "status": status,
               "reason": ms.get("reason"), "ms_per_step": _num(ms.get("value")), "ms_p20": _num(ms.get("p20")),
               "ms_p80": _num(ms.get("p80")), "throughput": _num(thr.get("value")),
               "unit": thr.get("unit") or "items/s", "device": (ms.get("device") or {}).get("name"),
               "profile": ms.get("profile"),
               "same_math_max_rel": _num((check or {}).get("value")),
               "same_math_tol": (check or {}).get("unit", "").replace("relative, tolerance ", "") or None}
        for name in ("model_tflops", "mfu", "peak_mem_gib", "compile_s", *SPLIT_METRICS):
            row[name] = _num(m.get(name, {}).get("value"))
        out.append(row)
    base = {(r["workload"], r["step"], r["scaling"], r["global_batch"]): r for r in out
            if r["world_size"] == 1 and r["strategy"] == "single" and not r["options"] and r["throughput"]}
    for r in out:
        b = base.get((r["workload"], r["step"], r["scaling"], r["global_batch"] // r["world_size"]
                      if r["scaling"] == "weak" else r["global_batch"]))
        r["per_gpu_throughput"] = r["throughput"] / r["world_size"] if r["throughput"] else None
        r["speedup"] = r["throughput"] / b["throughput"] if (b and r["throughput"]) else None
        r["efficiency"] = r["speedup"] / r["world_size"] if r["speedup"] else None
        r["exposed_share"] = (r["exposed_comm_ms"] / r["step_ms"]) if (r["exposed_comm_ms"] is not None
                                                                      and r["step_ms"]) else None
    order = {s: i for i, s in enumerate(STRATEGIES)}
    return sorted(out, key=lambda r: (r["workload"] or "", SCALINGS.index(r["scaling"]) if r["scaling"] in SCALINGS else 9,
                                      r["world_size"], order.get(r["strategy"], 9), r["options"] or ""))


def bandwidth_rows(records: list[dict], notebook: str | None = None) -> list[dict]:
    """The all-reduce bus bandwidth sweep (only ``notebook``'s where one is given): world size, bytes, GB/s
    (p20-p80) and the time."""
    out = []
    for r in records:
        f = r.get("fields") or {}
        if (notebook is None or r.get("notebook") == notebook) and r.get("metric") == "allreduce_busbw_gbps":
            out.append({"world_size": f.get("world_size"), "bytes": f.get("bytes"), "busbw_gbps": _num(r.get("value")),
                        "p20": _num(r.get("p20")), "p80": _num(r.get("p80")),
                        "ms": _num((r.get("params") or {}).get("ms")), "device": (r.get("device") or {}).get("name")})
    return sorted(out, key=lambda r: (r["world_size"] or 0, r["bytes"] or 0))


def busbw_at(bw: list[dict], world: int, nbytes: float) -> float | None:
    """The measured bus bandwidth at ``world`` for the sweep size nearest ``nbytes`` (log scale)."""
    cands = [r for r in bw if r["world_size"] == world and r["busbw_gbps"] and r["bytes"]]
    if not cands:
        return None
    return min(cands, key=lambda r: abs(math.log(r["bytes"] / nbytes)))["busbw_gbps"]


def param_bytes(workload: str, profile: str, step: str | None = None, config: dict | None = None) -> int:
    """Bytes of the model's fp32 parameters (= its fp32 gradients) under ``step``'s settings."""
    from ..steps import settings_for
    from ..workloads import get_workload
    from .strategies import base_step
    wl = get_workload(workload)
    model = wl.build(wl.config(profile, **(config or {})), settings_for(step or base_step(workload)), 0)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def traffic_rows(strategies: list[str], ks: list[int], pbytes: dict) -> list[dict]:
    """What each strategy moves per rank and step (``comm.traffic_bytes``), per workload and K > 1."""
    from .comm import traffic_bytes
    return [{"workload": w, "world_size": k, "strategy": s, "parameters MiB": b / 2**20,
             "moved per rank per step, MiB": traffic_bytes(s, b, k) / 2**20}
            for w, b in pbytes.items() for k in ks if k > 1 for s in strategies]


def prediction_rows(rs: list[dict], bw: list[dict], pbytes: dict, at_bytes: float = 25 * 2**20) -> list[dict]:
    """Each measured row at K > 1: the communication time its traffic takes at the bus bandwidth
    measured at that K (the sweep point nearest ``at_bytes``, DDP's bucket size), beside the NCCL time
    the profiler saw and the part of it left exposed."""
    from .comm import predicted_ms
    out = []
    for r in rs:
        if r["world_size"] < 2 or r["workload"] not in pbytes or r["comm_ms"] is None:
            continue
        busbw = busbw_at(bw, r["world_size"], at_bytes)
        pred = predicted_ms(r["strategy"], pbytes[r["workload"]], r["world_size"], busbw)
        out.append({"workload": r["workload"], "world_size": r["world_size"], "strategy": r["strategy"],
                    "scaling": r["scaling"], "bus GB/s": busbw, "predicted comm ms": pred,
                    "measured comm ms": r["comm_ms"], "exposed ms": r["exposed_comm_ms"],
                    "measured / predicted": r["comm_ms"] / pred if pred else None})
    return out


def targets(rs: list[dict], workload: str = "gpt") -> list[dict]:
    """The issue's scaling targets for ``workload``, each against the best strategy at that K."""
    out = []
    for (sc, k), want in TARGETS.items():
        cands = [r for r in rs if r["workload"] == workload and r["scaling"] == sc and r["world_size"] == k
                 and r["efficiency"] is not None and r["strategy"] != "single" and r["status"] == "ok"]
        best = max(cands, key=lambda r: r["efficiency"]) if cands else None
        out.append({"workload": workload, "scaling": sc, "world_size": k, "target": want,
                    "measured": best["efficiency"] if best else None, "strategy": best["strategy"] if best else None,
                    "met": (best["efficiency"] >= want) if best else None})
    return out


# --- figures -----------------------------------------------------------------------------------------------

def scaling_figure(rs: list[dict], workload: str):
    """Throughput against K for each strategy, weak and strong side by side, with the ideal line
    (K x one process) and each point's efficiency."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, sc in zip(axes, SCALINGS):
        mine = [r for r in rs if r["workload"] == workload and r["scaling"] == sc and r["throughput"]]
        unit = mine[0]["unit"] if mine else ""
        base = next((r for r in mine if r["strategy"] == "single" and r["world_size"] == 1), None)
        ks = sorted({r["world_size"] for r in mine})
        if base and ks:
            ax.plot(ks, [base["throughput"] * k for k in ks], "k--", lw=1, label="ideal: K x one process")
        for s in STRATEGIES:
            pts = sorted((r["world_size"], r["throughput"], r["efficiency"]) for r in mine if r["strategy"] == s)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=s)
            for k, t, e in pts:
                if e is not None and k > 1:
                    ax.annotate(f"{e:.0%}", (k, t), fontsize=8, xytext=(4, -10), textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks or [1], [str(k) for k in (ks or [1])])
        ax.set_xlabel("processes (GPUs)")
        ax.set_ylabel(unit)
        per = f"{mine[0]['per_gpu_batch']} per GPU" if (mine and sc == "weak") else (
            f"{mine[0]['global_batch']} in all" if mine else "")
        ax.set_title(f"{workload}, {sc} scaling ({per})", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def comm_figure(rs: list[dict], workload: str):
    """Per step, for each K and strategy: compute, exposed communication and idle time (stacked), the
    overlapped communication beside them (hatched)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, sc in zip(axes, SCALINGS):
        mine = [r for r in rs if r["workload"] == workload and r["scaling"] == sc and r["compute_ms"] is not None]
        labels = [f"K={r['world_size']}\n{label(r)}" for r in mine]
        x = range(len(mine))
        comp = [r["compute_ms"] for r in mine]
        exp = [r["exposed_comm_ms"] for r in mine]
        idle = [r["idle_ms"] for r in mine]
        ax.bar(x, comp, color="#4c72b0", label="compute")
        ax.bar(x, exp, bottom=comp, color="#c44e52", label="exposed communication")
        ax.bar(x, idle, bottom=[c + e for c, e in zip(comp, exp)], color="#bbbbbb", label="idle")
        ax.bar([i + 0.3 for i in x], [r["overlapped_comm_ms"] for r in mine], width=0.2, color="none",
               edgecolor="#c44e52", hatch="//", label="communication overlapped with compute")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("ms per step (profiled steps, rank 0)")
        ax.set_title(f"{workload}, {sc} scaling: where a step's time goes", fontsize=10)
        if mine:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# --- prose ---------------------------------------------------------------------------------------------------

RUNG_ORDER = ("single", "ddp", "graphed", "graphed_zero1", "fsdp2", "ddp_zero1")


def rung_rows(rs: list[dict], workload: str = "gpt") -> list[dict]:
    """The levers as a ladder: per scaling and K, each measured strategy (with its options) in
    ``RUNG_ORDER``, an option variant after its plain strategy, with its efficiency, the time its
    profiled step left communication exposed and the GPU idle, the same-math check, and its speed-up
    over the rung listed before it at that K."""
    out = []
    for sc in SCALINGS:
        for k in sorted({r["world_size"] for r in rs if r["workload"] == workload and r["scaling"] == sc}):
            at = [r for r in rs if r["workload"] == workload and r["scaling"] == sc and r["world_size"] == k
                  and r["throughput"]]
            at.sort(key=lambda r: (RUNG_ORDER.index(r["strategy"]) if r["strategy"] in RUNG_ORDER else 99,
                                   r["options"] or ""))
            prev = None
            for r in at:
                out.append({"scaling": sc, "world_size": k, "rung": label(r), "ms_per_step": r["ms_per_step"],
                            "efficiency": r["efficiency"], "exposed_comm_ms": r["exposed_comm_ms"],
                            "idle_ms": r["idle_ms"], "same_math_max_rel": r["same_math_max_rel"],
                            "vs_rung_before": (r["throughput"] / prev["throughput"]) if prev else None,
                            "status": r["status"]})
                prev = r
    return out


def what_we_saw(rs: list[dict], bw: list[dict] | None = None, skipped: list[dict] | None = None) -> str:
    """A paragraph per workload, built from the measured rows; nothing typed."""
    parts = []
    for w in dict.fromkeys(r["workload"] for r in rs):
        mine = [r for r in rs if r["workload"] == w]
        base = next((r for r in mine if r["strategy"] == "single" and r["world_size"] == 1 and r["throughput"]), None)
        if base is None:
            parts.append(f"{w}: no one-process run measured, so no efficiency.")
            continue
        unit = base["unit"].replace("/s", "")
        text = [f"On {base['device']} ({base['profile']} profile), {w} on top of {base['step']} ran "
                f"{base['throughput']:,.0f} {unit}/s in one process ({base['ms_per_step']:.2f} ms/step, "
                f"batch {base['global_batch']})."]
        for sc in SCALINGS:
            multi = [r for r in mine if r["scaling"] == sc and r["world_size"] > 1]
            if not multi:
                continue
            kmax = max(r["world_size"] for r in multi)
            at = [r for r in multi if r["world_size"] == kmax]
            ok = [r for r in at if r["efficiency"] is not None]
            if ok:
                best = max(ok, key=lambda r: r["efficiency"])
                text.append(f"{sc.capitalize()} scaling at {kmax} processes ({best['per_gpu_batch']} per GPU, "
                            f"{best['global_batch']} in all): " + "; ".join(
                                f"{label(r)} {r['throughput']:,.0f} {unit}/s, {r['efficiency']:.0%} efficiency"
                                for r in ok) + f" (best: {label(best)}).")
            bad = [r for r in at if r["status"] not in ("ok", "contended")]
            for r in bad:
                text.append(f"{r['strategy']} at K={kmax} ({sc}) is {r['status']}: {r['reason']}.")
            split = [r for r in at if None not in (r["exposed_comm_ms"], r["comm_ms"]) and r["step_ms"]]
            if split:
                worst = max(split, key=lambda r: r["exposed_comm_ms"])
                text.append(f"In the profiled steps, {worst['strategy']} left the most communication exposed: "
                            f"{worst['exposed_comm_ms']:.2f} ms of {worst['comm_ms']:.2f} ms per step "
                            f"({worst['exposed_share']:.1%} of its step).")
        one = [r for r in mine if r["world_size"] == 1 and r["strategy"] != "single" and r["speedup"]
               and r["scaling"] == mine[0]["scaling"]]   # at K = 1 one measurement stands for both scalings
        if one:
            text.append("On one GPU the wrappers alone cost: " + "; ".join(
                f"{r['strategy']} {r['speedup']:.2f}x the single process" for r in one) + ".")
        checks = [r for r in mine if r["same_math_max_rel"] is not None]
        if checks:
            worst = max(checks, key=lambda r: r["same_math_max_rel"])
            text.append(f"Against one process at the same global batch, the loss curves differed by at most "
                        f"{worst['same_math_max_rel']:.1e} ({worst['strategy']}, K={worst['world_size']}; tolerance "
                        f"{worst['same_math_tol']})" + (": same math." if all(r["status"] != "math changed" for r in checks)
                                                       else ": at least one strategy changed the math."))
        parts.append(" ".join(text))
    if bw:
        kmax = max(r["world_size"] for r in bw)
        top = max((r for r in bw if r["world_size"] == kmax), key=lambda r: r["bytes"])
        parts.append(f"The all-reduce bus bandwidth at {kmax} processes reached {top['busbw_gbps']:.1f} GB/s at "
                     f"{top['bytes'] / 2**20:.0f} MiB.")
    if skipped:
        parts.append("Not run: " + "; ".join(f"K={s['world_size']} ({s['reason']})" for s in skipped) + ".")
    return " ".join(parts)


__all__ = ["CANDIDATE_WORLD_SIZES", "TARGETS", "bandwidth_rows", "busbw_at", "comm_figure", "measure",
           "reference_curves", "rows", "rung_rows", "scaling_figure", "targets", "what_we_saw", "world_sizes"]
