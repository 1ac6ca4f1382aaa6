"""Step 29_shared_qk_attention: see ``op.py`` for its op, ``apply.py`` for what it swaps in and
``predict.py`` for what it removes."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("29_shared_qk_attention", "Vision-BDH's attention reads its shared query-key and values once",
    tolerance=2e-2, after="10_channels_last",
    # Measured on an H100 (full profile, 10 steps under bf16): step 10, a layout change alone, moved
    # vit_bdh's curve 7.2e-3 from step 09's, and this step's reordered sums moved it 1.3e-2 from step
    # 10's. The math itself is pinned by the fp32 same-gradients check (1e-5; 2.0e-6 measured there).
    why_tolerance="the same sums in another order under bf16, drifting over 10 steps as a layout change "
                  "does (step 10 moves this curve 7e-3): the scores from one bmm of q with itself, the "
                  "values' sum per sample with the heads as rows, and dq as (dS + dS^T) q, one bf16 rounding "
                  "of the sum where autograd rounds two products; the fp32 same-gradients check pins the math",
    workloads=("vit_bdh", "vit_bdh_linear"), beyond_recipe=True,
    why_na={"gpt": "its queries and keys are separate projections", "encoder_nli": "its queries and keys are "
            "separate projections", "resnet_bk": "no attention: its mixer is the BK-Core"},
    apply=_apply.apply, predict=_predict.predict, folder="s29_shared_qk_attention")
