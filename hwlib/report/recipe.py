"""GPT-2 past the standard recipe: the fastest step after the recipe's last step (09, CUDA graphs)
against it, with and without FP8, beside the targets the steps past the recipe were built for.

Derived from ladder rows (``query.ladder_rows``, with the spreads across processes of notebook 19 where
``report.tables.ladder_rows_with_noise`` marked them): nothing here is measured or typed. A ratio
closer to its target than the two steps' spread across processes is said to be within noise of it:
another run could land on the other side.
"""

from __future__ import annotations

from ..steps import LADDER, settings_for

WORKLOAD = "gpt"
RECIPE_STEP = "09_cuda_graphs"
# (what counts, target over the recipe's tokens/s). Same math: bf16 throughout, every loss curve
# within its step's tolerance of the step before; FP8 inside its own stated tolerance.
TARGETS = (("fastest step past the recipe without FP8", False, 1.15),
           ("fastest FP8 step", True, 1.25))


def _past_recipe() -> list[str]:
    names = [s.name for s in LADDER]
    return names[names.index(RECIPE_STEP) + 1:]


def target_rows(rows: list[dict]) -> list[dict]:
    """One row per target: the fastest qualifying step (status ok) and its tokens/s over the recipe
    step's, ``met`` True / False, or None where the recipe step or every qualifying step is unmeasured."""
    by_step = {r["step"]: r for r in rows}
    recipe = by_step.get(RECIPE_STEP)
    base = recipe["throughput"] if recipe and recipe["status"] == "ok" else None
    out = []
    for what, fp8, target in TARGETS:
        cands = [by_step[s] for s in _past_recipe() if s in by_step and settings_for(s).fp8 == fp8
                 and by_step[s]["status"] == "ok" and by_step[s]["throughput"]]
        best = max(cands, key=lambda r: r["throughput"]) if cands else None
        ratio = best["throughput"] / base if best and base else None
        spreads = [r.get("process_spread") for r in (recipe, best) if r and r.get("process_spread")]
        noise = max(spreads) - 1 if len(spreads) == 2 else None
        out.append({"target": f"{what} >= {target:.2f}x {RECIPE_STEP}", "step": best["step"] if best else None,
                    "x_vs_recipe": ratio, "target_x": target, "met": None if ratio is None else ratio >= target,
                    "within_noise_of_target": (None if ratio is None or noise is None
                                               else abs(ratio / target - 1) < noise)})
    return out


def sentence(rows: list[dict]) -> str:
    """The targets in one paragraph, for the README and notebook 99; empty when the recipe step is
    not in the rows."""
    if not any(r["step"] == RECIPE_STEP for r in rows):
        return ""
    parts = []
    for t in target_rows(rows):
        what = t["target"].split(" >= ")[0]
        if t["x_vs_recipe"] is None:
            parts.append(f"the {what}: none measured (target {t['target_x']:.2f}x)")
            continue
        verdict = "met" if t["met"] else "not met"
        if t["within_noise_of_target"]:
            verdict += ", closer to it than the two steps' spread across processes"
        parts.append(f"the {what}, {t['step']}, {t['x_vs_recipe']:.3f}x (target {t['target_x']:.2f}x: {verdict})")
    return f"Past the recipe (tokens/s over those of {RECIPE_STEP}): " + "; ".join(parts) + "."
