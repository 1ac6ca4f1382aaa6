"""Step 24_qkv_grad: see ``op.py`` for its op, ``apply.py`` for what it swaps in,
``predict.py`` for what it removes and ``study.py`` for its kernels alone."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("24_qkv_grad", "the QKV projection and the attention as one op: dq, dk, dv packed into the projection's "
    "gradient with its bias gradient summed in the same pass", tolerance=1e-2, after="23_branch_bias",
    why_tolerance="the same matmuls and the same fused attention kernel (cuDNN's, called directly); the QKV "
                  "bias gradient is summed in fp32 in another order: other rounding under bf16",
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "no attention: its token mixing is the BK-Core",
            "encoder_nli": "its attention is masked per sequence (packed, step 11): the op runs causal attention",
            **{w: "the op is built into GPT's causal attention only" for w in ("vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s24_qkv_grad", kernels=("24_qkv_grad_triton.py",))
