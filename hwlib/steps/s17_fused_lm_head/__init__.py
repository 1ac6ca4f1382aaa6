"""Step 17_fused_lm_head: see ``op.py`` for its op (its CUDA row pass in ``ce_rows_cuda.py``),
``apply.py`` for what it swaps in, ``predict.py`` for what it removes and ``study.py`` for its kernels alone."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("17_fused_lm_head", "LM head + cross-entropy fused, logits never materialised", tolerance=1e-2,
    why_tolerance="same function from the same bf16 logits; the log-sum-exp runs online over vocabulary "
                  "tiles in fp32, and dh, dW are summed in fp32 and rounded once (unfused: to bf16): "
                  "other rounding under bf16",
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its fused head is step 30, built on its BK-Core step (12)",
            **{w: "its head has no large vocabulary: the logits are a few classes wide"
               for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s17_fused_lm_head", kernels=("17_linear_ce_triton.py", "17_ce_rows.cu"))
