"""What step 30 removes from ResNet-BK's step: the logits' bytes outside the head's GEMMs, counted as step
17's op counts them (``hwlib.steps.s17_fused_lm_head.op.traffic_bytes``)."""

from __future__ import annotations

from ..s17_fused_lm_head.op import traffic_bytes
from ...shapes import padded


def removed_bytes(tokens: int, vocab: int, vocab_padded: int, elem: int = 2) -> dict[str, float]:
    """The softmax work's bytes over the [tokens, V] logits: the unfused head at its fewest passes (the
    logits read twice, the gradient written once) against the fused op's CUDA row pass (each row read once
    into shared memory, its gradient written over it), and their difference. The GEMMs' own logits traffic
    is the same chunk by chunk in both, and overlaps their FLOPs."""
    t = traffic_bytes(tokens, vocab, vocab_padded, elem)
    return {"unfused, fewest passes": t["row_pass"], "fused, one read a row": t["row_pass_one_read"],
            "removed": t["row_pass"] - t["row_pass_one_read"]}


def predict(ctx):
    from ..ladder import settings_for      # the ladder imports this module while it is built
    c = ctx.cfg
    vp = padded(c.vocab, settings_for(ctx.step).vocab_multiple)
    # The logits are in autocast's 16-bit dtype at this step (ctx.elem), as the fused op keeps each chunk's.
    removed = removed_bytes(c.batch * c.context, c.vocab, vp, ctx.elem)["removed"]
    return ctx.bytes_prediction("the logits read once a row instead of twice (the fused op's CUDA row pass), "
                                "against the unfused head at its fewest passes; what compile's unfused loss moves "
                                "past those passes is won too and is not counted", removed)
