"""Step 30_bk_fused_head: ResNet-BK's head through step 17's fused op (``apply.py`` swaps it in, ``predict.py``
counts what it removes); the op, its kernels and its study are step 17's (``hwlib.steps.s17_fused_lm_head``)."""

from ..step import Step
from ..s17_fused_lm_head import STEP as FUSED_HEAD
from . import apply as _apply, predict as _predict

STEP = Step("30_bk_fused_head", "ResNet-BK's LM head + cross-entropy fused, logits never materialised",
    tolerance=1e-2, after="12_bk_core",
    why_tolerance="step 17's op on ResNet-BK's head: the same function from the same bf16 logits; the "
                  "log-sum-exp runs online over vocabulary tiles in fp32, and dh, dW are summed in fp32 and "
                  "rounded once (unfused: to bf16): other rounding under bf16, as step 17's; the fp32 "
                  "same-gradients check pins the math",
    workloads=("resnet_bk",), beyond_recipe=True,
    why_na={"gpt": "its fused head is step 17",
            **{w: "its head has no large vocabulary: the logits are a few classes wide"
               for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s30_bk_fused_head", kernels=FUSED_HEAD.kernels)
