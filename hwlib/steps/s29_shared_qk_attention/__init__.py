"""Step 29_shared_qk_attention: see ``op.py`` for its op, ``apply.py`` for what it swaps in and
``predict.py`` for what it removes."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("29_shared_qk_attention", "Vision-BDH's attention reads its shared query-key and values once",
    tolerance=1e-2, after="10_channels_last",
    why_tolerance="the same sums in another order under bf16: the scores from one bmm of q with itself, the "
                  "values' sum per sample with the heads as rows, and dq as (dS + dS^T) q, one bf16 rounding of "
                  "the sum where autograd rounds two products",
    workloads=("vit_bdh", "vit_bdh_linear"), beyond_recipe=True,
    why_na={"gpt": "its queries and keys are separate projections", "encoder_nli": "its queries and keys are "
            "separate projections", "resnet_bk": "no attention: its mixer is the BK-Core"},
    apply=_apply.apply, predict=_predict.predict, folder="s29_shared_qk_attention")
