"""Step 31_bucketed_graphs: see ``buckets.py`` for the row-count buckets and the padding rows, ``apply.py``
for the padding as the model sees it, ``graphs.py`` for the training step replayed as one CUDA graph per
bucket, and ``predict.py`` for what it removes."""

from ..step import Step
from . import apply as _apply, predict as _predict


def _trainer(session):
    # Imported when a session asks for it: the graph runner is a runner, outside the core notebooks import.
    from .graphs import make_trainer
    return make_trainer(session)


STEP = Step("31_bucketed_graphs", "the NLI encoder's packed step padded to a few row counts, each replayed as "
            "one CUDA graph (forward, backward and AdamW)",
            tolerance=1e-2, after="11_sequence_packing", gpu_only=True,
            why_tolerance="the same compiled kernels and fused AdamW, replayed from a hand-captured graph; padding "
                          "rows add exact zeros to the gradients' sums (longer reductions, other order), under bf16",
            workloads=("encoder_nli",), beyond_recipe=True,
            why_na={"gpt": "its batch is one fixed shape: step 09's graphs already replay it whole",
                    "resnet_bk": "its batch is one fixed shape: step 09's graphs already replay it whole",
                    "vit_bdh": "every image is 65 tokens: one fixed shape, no packing",
                    "vit_bdh_linear": "every image is 65 tokens: one fixed shape, no packing"},
            apply=_apply.apply, trainer=_trainer, predict=_predict.predict, folder="s31_bucketed_graphs")
