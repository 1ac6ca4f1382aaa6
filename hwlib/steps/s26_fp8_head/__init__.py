"""Step 26_fp8_head: see ``op.py`` for its op, ``apply.py`` for what it swaps in,
``predict.py`` for what it removes and ``study.py`` for its kernels alone."""

from ..step import Step
from . import apply as _apply, predict as _predict

FP8_HEAD_TOLERANCE = (
    "FP8 rounds the head's operands to 3 mantissa bits (h and W, e4m3, one scale each) and the probabilities "
    "off the targets in its gradient to 2 (e5m2, a static scale); each row's target entry, p_t - 1, is added in "
    "fp32. The logits move a few percent of their size, the errors independent across a dot product's terms, "
    "and the loss is a mean over every token, so the curve moves far less than any one logit. The bound is the "
    "FP8 MLP's (step 18), 1e-2, which bf16 itself (step 03: 3e-2) would fail; what the head moves is measured by "
    "notebook 26 (curve_move) on every run. The 10 steps cannot see a gradient error that only steers "
    "training (a head that rounded p_t - 1 into e5m2 passed them and then fell far behind), so notebook 26 also "
    "trains steps 09, 25 and 26 for 300 steps and bounds the FP8 step's end against step 25's "
    "(hwlib.steps.s26_fp8_head.study.LONG_TOL)")

STEP = Step("26_fp8_head", "the fused LM head's three matmuls in FP8 (e4m3 forward; the gradient's probabilities in e5m2, "
    "in both layouts, its target entries in fp32)", tolerance=1e-2, gpu_only=True, after="25_bias_column",
    why_tolerance=FP8_HEAD_TOLERANCE,
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the FP8 head is built on GPT-2's fused head",
            **{w: "its head has no large vocabulary: the logits are a few classes wide"
               for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s26_fp8_head", kernels=("26_ce_grad_fp8_triton.py", "26_ce_target_fp8_triton.py", "26_fp8_cast_triton.py"), fp8=True,
    floor_caveat=("its LM head's three matmuls run in FP8, above the 16-bit matmul ceiling the GEMM floor is "
                 "counted at: for this step that floor is an upper bound; its casts and the gradient pass that "
                 "writes the FP8 gradient count as LM head / cross-entropy"))
