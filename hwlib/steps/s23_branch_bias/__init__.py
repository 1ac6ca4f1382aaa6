"""Step 23_branch_bias: see ``apply.py`` for what it swaps in and ``predict.py`` for what it removes."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("23_branch_bias", "each branch's output bias added, and its gradient summed, in the fused residual LayerNorm", tolerance=1e-2, after="22_gelu_epilogue",
    why_tolerance="the same sums: the output projections' biases are added to the fp32 stream after their "
                  "matmuls' bf16 rounding instead of to the fp32 accumulators before it, and their gradients "
                  "are summed in fp32 in another order: other rounding under bf16",
    workloads=("gpt",), beyond_recipe=True,
    why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the branch biases are moved in GPT-2's blocks",
            "encoder_nli": "post-LayerNorm blocks: the fused residual LayerNorm this step builds on is GPT's",
            **{w: "the fused residual LayerNorm this step builds on is built into GPT's blocks only"
               for w in ("vit_bdh", "vit_bdh_linear")}},
    apply=_apply.apply, predict=_predict.predict, folder="s23_branch_bias")
