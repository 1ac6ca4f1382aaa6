"""What step 26 saves: the LM head's three matmuls at FP8's rate."""

from __future__ import annotations

from ...roofline import Prediction, flops_ms
from ...shapes import padded


def predict(ctx):
    # The head's three GEMMs (2 N d V_pad FLOPs each) on FP8 tensor cores, whose peak on Hopper and Ada is
    # twice the 16-bit one: at the measured bf16 ceiling doubled. Bytes a logit are the same either way
    # (hwlib/steps/s26_fp8_head/op.py: 10), and the casts of h and W are small, so only FLOPs move.
    head = 3 * 2.0 * ctx.tokens * ctx.cfg.d_model * padded(ctx.cfg.vocab, 64)
    t = flops_ms(head, ctx.ceilings, "bf16")
    return Prediction(ctx.workload, ctx.step, "estimate", "the LM head's three matmuls at twice the measured bf16 "
                      "matmul ceiling (FP8 tensor cores' peak rate over 16-bit's); the same bytes a logit",
                      flops_removed=0.0, saved_ms=None if t is None else t / 2)
