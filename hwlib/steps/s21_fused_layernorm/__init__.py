"""Step 21_fused_layernorm: see ``op.py`` for its op, ``apply.py`` for what it swaps in,
``predict.py`` for what it removes and ``study.py`` for its kernels alone."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("21_fused_layernorm", "residual add + LayerNorm fused, one Triton kernel each way", tolerance=1e-2,
    after="17_fused_lm_head",
    why_tolerance="the same sums in fp32, in one pass per direction: the LayerNorm's mean and variance, its "
                  "backward's row sums and the gain and bias sums are reduced in another order, and the outputs "
                  "are rounded into bf16 at the points where the unfused path rounds them: other rounding under bf16",
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the fused LayerNorm is measured on GPT-2's blocks",
            "encoder_nli": "post-LayerNorm blocks (a LayerNorm after each sum): the fused op is built for GPT's "
                           "pre-LayerNorm blocks",
            **{w: "the fused residual LayerNorm is built into GPT's blocks only"
               for w in ("vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s21_fused_layernorm", kernels=("21_add_layernorm_triton.py",))
