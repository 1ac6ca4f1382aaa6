"""GPT-2 past the standard recipe: the fastest step past the recipe (``Step.beyond_recipe``) against
the recipe's last step (09, CUDA graphs), with and without FP8, beside the targets the steps past the
recipe were built for.

Derived from ladder rows (``query.ladder_rows``, with the spreads across processes of notebook 19 where
``report.tables.ladder_rows_with_noise`` marked them): nothing here is measured or typed. "Within
noise" is the ladder's rule (``noise.within_spread``): a ratio closer to its target than the larger
spread measured for either step, so that another run could land on the other side.
"""

from __future__ import annotations

from .. import noise
from ..steps import LADDER, get_step, previous, uses_fp8

WORKLOAD = "gpt"
RECIPE_STEP = "09_cuda_graphs"
# (what counts, FP8 or not, target over the recipe's tokens/s). A step counts when its status is ok
# and its loss curve was checked against the step before and stayed within its stated tolerance:
# bf16 math for the first, FP8 inside its own tolerance for the second.
TARGETS = (("fastest step past the recipe without FP8", False, 1.15),
           ("fastest FP8 step", True, 1.25))


def _counts(row: dict | None) -> bool:
    return bool(row and row["status"] == "ok" and row.get("throughput")
                and row.get("same_math_max_rel") is not None)


def target_rows(rows: list[dict]) -> list[dict]:
    """One row per target: the fastest qualifying step and its tokens/s over the recipe step's,
    ``met`` True / False, or None where the recipe step or every qualifying step is unmeasured
    (``recipe_status`` says how the recipe step stands: None when it has no row)."""
    by_step = {r["step"]: r for r in rows}
    recipe = by_step.get(RECIPE_STEP)
    base = recipe["throughput"] if recipe and recipe["status"] == "ok" and recipe.get("throughput") else None
    out = []
    for what, fp8, target in TARGETS:
        cands = [by_step[s.name] for s in LADDER if s.beyond_recipe and s.name in by_step
                 and uses_fp8(s.name) == fp8 and _counts(by_step[s.name])]
        best = max(cands, key=lambda r: r["throughput"]) if cands else None
        ratio = best["throughput"] / base if best and base else None
        spreads = [r.get("process_spread") for r in (recipe, best) if r]
        within = None if ratio is None else noise.within_spread(ratio / target, spreads)
        out.append({"what": what, "fp8": fp8, "target": f"{what} >= {target:.2f}x {RECIPE_STEP}",
                    "step": best["step"] if best else None, "x_vs_recipe": ratio, "target_x": target,
                    "met": None if ratio is None else ratio >= target, "within_noise_of_target": within,
                    "recipe_status": recipe["status"] if recipe else None})
    return out


def long_move(records: list[dict], step: str) -> dict | None:
    """How far ``step``'s loss ended from the step before it over notebook 26's long run (metric
    ``long_final_loss``, each step trained from the same seed for ``steps`` steps), beside the spread
    of the bf16 steps' ends that notebook 26 recorded for the same run length (``long_bf16_band``;
    None where it recorded none): from ``records`` (a run's, ``query.load``, the newest of each).
    None where ``step`` or the step before it has no long run."""
    long = {}
    for r in _usable(records):
        if r.get("metric") == "long_final_loss":
            long[(r["step"], (r.get("fields") or {}).get("steps"))] = r["value"]
    prev = previous(step)
    mine = [n for (s, n) in long if s == step]
    if prev is None or not mine:
        return None
    n = max(mine)
    if (prev.name, n) not in long:
        return None
    return {"step": step, "prev": prev.name, "steps": n, "vs_prev": long[(step, n)] / long[(prev.name, n)] - 1,
            "band": recorded_band(records, n)}


def _usable(records: list[dict]) -> list[dict]:
    """This workload's ok records with a numeric value, in the order given (a later one is newer)."""
    return [r for r in records if r.get("status") == "ok" and r.get("workload") == WORKLOAD
            and isinstance(r.get("value"), (int, float))]


def recorded_band(records: list[dict], steps: int) -> float | None:
    """The spread of the bf16 steps' ends over ``steps``-step curves as notebook 26 recorded it
    (``long_bf16_band``; the last of ``records`` that has one, the newest), or None where it recorded none."""
    bands = [r["value"] for r in _usable(records)
             if r.get("metric") == "long_bf16_band" and (r.get("fields") or {}).get("steps") == steps]
    return bands[-1] if bands else None


def sentence(rows: list[dict], records: list[dict] | None = None) -> str:
    """The targets in one paragraph, for the README and notebook 99; empty when the recipe step has
    no row. ``records`` (the run's) add the FP8 step's long run where its final loss left the band."""
    if not any(r["step"] == RECIPE_STEP for r in rows):
        return ""
    parts = []
    for t in target_rows(rows):
        if t["x_vs_recipe"] is None:
            why = (f"{RECIPE_STEP} is {t['recipe_status']}" if t["recipe_status"] != "ok"
                   else "none measured")
            parts.append(f"the {t['what']}: {why} (target {t['target_x']:.2f}x)")
            continue
        verdict = "met" if t["met"] else "not met"
        if t["within_noise_of_target"]:
            verdict += ", closer to it than the steps' spread across processes"
        part = f"the {t['what']}, {t['step']}, {t['x_vs_recipe']:.3f}x (target {t['target_x']:.2f}x: {verdict})"
        move = final_loss_move(rows, t["step"])
        if t["fp8"] and move and move["outside_band"]:
            part += (f", though its final loss ended {move['vs_prev']:+.2%} from {move['prev']}'s, outside the bf16 "
                     f"steps' band ({move['band']:.2%})")
            lm = long_move(records or [], t["step"])
            if lm:
                part += (f"; trained {lm['steps']} steps from the same seed, it ended {lm['vs_prev']:+.1%} from "
                         f"{lm['prev']}'s loss" + (f", where the bf16 steps' ends lie {lm['band']:.1%} apart"
                                                   if lm["band"] is not None else ""))
        parts.append(part)
    return f"Past the recipe (tokens/s over those of {RECIPE_STEP}): " + "; ".join(parts) + "."


def final_loss_move(rows: list[dict], step: str) -> dict | None:
    """How far ``step``'s final loss (after the last step of its measurement: check, warm-up and timed,
    the same data for every step) lies from that of the step it builds on, beside the band of the bf16
    steps' final losses (the recipe step and the steps past it without FP8). The same-math check bounds
    the first K steps only; this says whether a move grew over the longer run. None where ``step`` or the
    step before it has no final loss."""
    by = {r["step"]: r["final_loss"] for r in rows
          if r.get("status") == "ok" and isinstance(r.get("final_loss"), (int, float))}
    prev = previous(step)
    if step not in by or prev is None or prev.name not in by:
        return None
    bf16 = [v for s, v in by.items() if s == RECIPE_STEP or (get_step(s).beyond_recipe and not uses_fp8(s))]
    d = by[step] / by[prev.name] - 1
    lo, hi = (min(bf16), max(bf16)) if len(bf16) >= 2 else (None, None)
    band = hi / lo - 1 if lo else None
    return {"step": step, "prev": prev.name, "final_loss": by[step], "prev_final_loss": by[prev.name],
            "vs_prev": d, "bf16_steps": len(bf16), "band_low": lo, "band_high": hi, "band": band,
            "outside_band": band is not None and abs(d) > band}


def final_loss_words(rows: list[dict], step: str) -> str:
    """``final_loss_move`` in words, for a notebook."""
    m = final_loss_move(rows, step)
    if m is None:
        return f"No final loss of {step} and the step before it in this run to compare."
    text = (f"After the last step of its measurement, {step}'s loss was {m['final_loss']:.4f} against "
            f"{m['prev']}'s {m['prev_final_loss']:.4f} ({m['vs_prev']:+.2%}).")
    if m["band"] is None:
        return text
    text += (f" The {m['bf16_steps']} bf16 steps from {RECIPE_STEP} on ended between {m['band_low']:.4f} and "
             f"{m['band_high']:.4f} ({m['band']:.2%} apart).")
    if m["outside_band"]:
        return text + (" This step's final loss lies outside that band: over the longer run it moved further than "
                       "the bf16 steps differ among themselves, so its tolerance, checked over the first K steps, "
                       "does not bound it beyond them.")
    return text + " This step's final loss lies within that band."
