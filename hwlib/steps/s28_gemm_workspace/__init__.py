"""Step 28_gemm_workspace: see ``apply.py`` for the context it runs in,
``predict.py`` for what it removes and ``study.py`` for its kernels alone."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("28_gemm_workspace", "torch's matmuls and hwlib's plain cuBLASLt matmul without cuBLAS's workspace: no memset "
    "before them in the CUDA graph", tolerance=1e-2, after="25_bias_column",
    why_tolerance="the same matmuls in bf16 with fp32 accumulation, in the same tiles; without a workspace "
                  "cuBLAS picks another tile scheduler, which can add a product's partial sums in another "
                  "order: other rounding under bf16",
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); this step builds on GPT-2's fused blocks",
            **{w: "this step builds on the fused residual LayerNorm, which is built into GPT's blocks only"
               for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}},
    context=_apply.context, predict=_predict.predict, folder="s28_gemm_workspace")
