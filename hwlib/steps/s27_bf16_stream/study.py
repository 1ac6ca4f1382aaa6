"""Step 27's study: GPT-2's residual stream in bf16.

The fused residual LayerNorm (``hwlib.steps.s21_fused_layernorm.op``) is the same op with a narrower
stream; its correctness and its kernels alone are step 21's study's (``stream=torch.bfloat16``). What
is this step's own: the forward kernel's source, where the sum is rounded into the stream's dtype and
normalised as rounded, and the loss curves past the 10-step check, trained as step 26's study trains
the FP8 head's (``hwlib.steps.s26_fp8_head.study.long_curves``) and bounded the same way (``LONG_TOL``).
"""

from __future__ import annotations

from ...ops.sources import read_kernel_source
from ..s21_fused_layernorm import op as fused_layernorm_op
from ..s26_fp8_head import study as fp8_head_study
from . import STEP

PREV = "26_fp8_head"
LONG_TOL = fp8_head_study.LONG_TOL


def kernel_source() -> str:
    """The forward kernel (``_add_ln_fwd_kernel``), read from its file (no Triton import needed)."""
    src = read_kernel_source(fused_layernorm_op.KERNEL_FILE)
    start = src.index("@triton.jit")
    return src[start: src.index("\n@triton.jit", start + 1)].rstrip()


def long_prose(rows: list[dict], band: float | None) -> str:
    """The long curves of ``PREV`` and ``STEP`` (``fp8_head_study.long_rows(curves, base=PREV)``) in words,
    beside the bf16 steps' band from step 26's long curves where there is one (``report.recipe.recorded_band``)."""
    if not rows:
        return "The long curves run on a GPU with FP8 matmuls, in the full or mid profile."
    end, key = "final loss (mean of last tenth)", f"vs {PREV.split('_', 1)[0]}"
    by = {r["step"]: r for r in rows}
    text = f"After {rows[0]['steps']} steps, " + ", ".join(f"{r['step']} ended at {r[end]:.3f}" for r in rows) + ". "
    mine = by.get(STEP.name)
    if mine is None:
        return text + f"{STEP.name} did not run here (its row in the ladder says why)."
    text += f"The bf16 stream ended {mine[key]:+.1%} from step {PREV.split('_', 1)[0]} (the bound: {LONG_TOL:.0%})"
    if band is not None:
        text += (f"; notebook 26's two bf16 steps, the same math with different roundings, ended {band:.1%} apart "
                 f"over as many steps, and this move is " + ("within" if abs(mine[key]) <= band else "beyond")
                 + " that spread")
    return text + "."
