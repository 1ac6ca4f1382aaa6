"""Step 27: the residual stream in autocast's 16-bit dtype from the embeddings on (fp32 in the recipe):
each residual add's sum rounded once; LayerNorm statistics and every matmul as before."""

from __future__ import annotations

import torch.nn as nn

from ..s21_fused_layernorm.apply import fused_trunk


def apply(model: nn.Module) -> None:
    fused_trunk(model, "27_bf16_stream", "keeps the stream in 16 bits through the fused residual LayerNorms"
                ).low_precision_stream = True
