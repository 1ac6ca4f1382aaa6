"""Step 22_gelu_epilogue: see ``op.py`` for its op, ``apply.py`` for what it swaps in,
``predict.py`` for what it removes and ``study.py`` for its kernels alone."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("22_gelu_epilogue", "the MLP's bias + GELU and the GELU's derivative inside its matmuls (cuBLASLt epilogues)", tolerance=1e-2, after="21_fused_layernorm",
    why_tolerance="the same matmuls in bf16 with fp32 accumulation; the bias, the GELU and its derivative are "
                  "applied to the fp32 accumulators, where the unfused path rounds the matmul's output to bf16 "
                  "first: other rounding under bf16",
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the GELU epilogue is measured on GPT-2",
            "encoder_nli": "its MLP uses the erf GELU, which cuBLASLt's tanh-form epilogue does not compute",
            **{w: "the GELU epilogue is built into GPT's blocks only" for w in ("vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s22_gelu_epilogue", kernels=("22_gelu_epilogue.cpp",),
    floor_caveat=("its MLP's bias + GELU and the GELU's derivative run in the matmuls' "
                 "epilogues (cuBLASLt): their time counts as GEMMs, while the LayerNorm / elementwise floor still "
                 "counts their passes (one pass per op), so that category can run below its floor"))
