"""Step 27_bf16_stream: see ``apply.py`` for what it swaps in, ``predict.py`` for what it removes
and ``study.py`` for its kernel's source and its long curves."""

from ..step import Step
from . import apply as _apply, predict as _predict

BF16_STREAM_TOLERANCE = (
    "The residual stream is rounded to bf16's 8 significant bits after each of its 25 adds (a relative error of "
    "at most 2^-9 each, independent from element to element), where the recipe keeps it in fp32; the branches "
    "already read it through a bf16 LayerNorm output, and every matmul, LayerNorm statistic and gradient sum is "
    "as before. The bound is the one the FP8 steps are held to, 1e-2, a third of bf16 autocast's own (step 03: "
    "3e-2); notebook 27 measures the move on every run (curve_move) and, as notebook 26 does for the FP8 head, "
    "trains it 300 steps beside the steps before it and bounds its end against step 26's "
    "(hwlib.steps.s26_fp8_head.study.LONG_TOL)")

STEP = Step("27_bf16_stream", "the residual stream in bf16 (the sum of each residual add rounded once; LayerNorm "
    "statistics and every matmul as before)", tolerance=1e-2, gpu_only=True,
    why_tolerance=BF16_STREAM_TOLERANCE,
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the stream is built into GPT's fused blocks",
            **{w: "the fused residual LayerNorm this step builds on is built into GPT's blocks only"
               for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s27_bf16_stream",
    floor_caveat=("its residual stream is bf16, where the LayerNorm / elementwise floor counts the recipe's "
                 "fp32 stream (4 d bytes a token for each of its terms): that category can run further below "
                 "its floor"))
