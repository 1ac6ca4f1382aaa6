"""Step 25_bias_column: see ``apply.py`` for what it swaps in,
``predict.py`` for what it removes and ``study.py`` for its kernels alone."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("25_bias_column", "the MLP's first bias gradient out of its weight-gradient matmul, through a column of "
    "ones the LayerNorm writes beside its output", tolerance=1e-2, after="24_qkv_grad",
    why_tolerance="the same sums: mlp_fc's bias gradient is a column of a bf16 matmul with fp32 accumulation "
                  "instead of a column sum in fp32, in another order, rounded once into bf16 either way: other "
                  "rounding under bf16",
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the bias column is built into GPT's fused MLP",
            "encoder_nli": "its MLP uses the erf GELU, which the fused MLP this step builds on does not compute",
            **{w: "the fused MLP this step builds on is built into GPT's blocks only"
               for w in ("vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s25_bias_column", kernels=("22_gelu_epilogue.cpp",))
