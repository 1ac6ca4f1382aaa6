"""Step 32_bdh_fused_gates: see ``op.py`` for its ops, ``apply.py`` for what it swaps in and
``predict.py`` for what it removes."""

from ..step import Step
from . import apply as _apply, predict as _predict

STEP = Step("32_bdh_fused_gates", "Vision-BDH's encoder and gate with their elementwise work in the matmuls",
    tolerance=2e-2, after="29_shared_qk_attention",
    why_tolerance="the same products under bf16 with the matmuls' sums in another order (Triton's tiles "
                  "against cuBLAS's), drifting over 10 steps as step 29's reordering does (2e-2); every "
                  "elementwise result is rounded where the recipe rounds it, and the fp32 same-gradients "
                  "check pins the math",
    workloads=("vit_bdh", "vit_bdh_linear"), beyond_recipe=True,
    why_na={"gpt": "no sparse encoder or Hebbian gate", "encoder_nli": "no sparse encoder or Hebbian gate",
            "resnet_bk": "no sparse encoder or Hebbian gate"},
    apply=_apply.apply, predict=_predict.predict, folder="s32_bdh_fused_gates",
    kernels=("32_bdh_gates_triton.py",))
