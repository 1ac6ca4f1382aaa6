"""What step 29 removes: the attention's second read of q as the key, its copies of x per head, and its
backward's separate dq and dk."""

from __future__ import annotations

from .op import traffic_bytes
from ...workloads.vit_bdh import TOKENS


def predict(ctx):
    c = ctx.cfg
    t = traffic_bytes(c.n_head, c.batch, TOKENS, c.n_neuron, c.d_model, ctx.elem)
    removed = c.n_layer * (t["sdpa (recipe)"] - t["shared q, shared x"])
    return ctx.bytes_prediction("q read once as query and key, x once per sample rather than per head, dq in "
                                "one bmm; at one pass per tensor: the recipe's memory-efficient kernel at a head "
                                "width of 1024 may cost more than its bytes, so more may be won", removed)
