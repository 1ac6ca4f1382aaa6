"""The shared recipe, steps 01-12: each sets knobs of ``hwlib.settings.Settings``, with its
same-math tolerance and reason, where it applies, and what the roofline says it removes."""

from __future__ import annotations

from ..roofline import (VIT_IMAGE_ELEMS, VIT_PATCHES, Context, Prediction, attention_score_bytes, flops_ms,
                        parameter_count)
from ..shapes import padded
from .step import Step


# What each recipe step removes, at the run's ceilings (hwlib.roofline; the steps past the recipe
# keep theirs in their folders). Each takes a roofline.Context and returns a Prediction, or None for
# "nothing the roofline counts".

def _precision_change(c: Context) -> Prediction:
    a, b = flops_ms(c.flops, c.ceilings, c.before), flops_ms(c.flops, c.ceilings, c.precision)
    return Prediction(c.workload, c.step, "estimate", f"the same model FLOPs at the {c.precision} instead of the "
                      f"{c.before} matmul ceiling", flops_removed=0.0,
                      saved_ms=None if a is None or b is None else a - b)


def _fused_attention(c: Context) -> Prediction:
    nb = attention_score_bytes(c.workload, c.cfg, c.elem)
    if nb is None:
        return Prediction(c.workload, c.step, "none", "no softmax attention to fuse")
    return c.bytes_prediction("score-matrix round trips of the unfused attention (softmax's fp32 output under "
                              "autocast makes this a lower bound)", nb)


def _zero_fill(c: Context) -> Prediction:
    return c.bytes_prediction("the fp32 gradient zero-fill that set_to_none skips (fused AdamW moves the same "
                              "bytes in fewer launches, which the roofline does not count)",
                              4.0 * parameter_count(c.workload, c.profile))


def _overhead_bound(what: str):
    def bound(c: Context) -> Prediction:
        p = Prediction(c.workload, c.step, "bound", f"removes {what}: at most the time above the floor")
        if c.prev_ms is not None and c.prev_floor_ms is not None:
            p.saved_ms = max(0.0, c.prev_ms - c.prev_floor_ms)
        elif c.ceilings:
            p.missing = "the step before has no measured time in this run"
        return p
    return bound


def _padded_vocabulary(c: Context) -> Prediction | None:
    if not hasattr(c.cfg, "vocab"):
        return None
    extra = 3 * 2.0 * c.tokens * c.cfg.d_model * (padded(c.cfg.vocab, 64) - c.cfg.vocab)
    t = flops_ms(extra, c.ceilings, c.precision)
    return Prediction(c.workload, c.step, "estimate", "padded logits are extra work: at the floor the step gets "
                      "slower; any gain is full tiles, which the roofline does not see",
                      flops_removed=-extra, saved_ms=None if t is None else -t)


def _data_wait(c: Context) -> Prediction:
    return Prediction(c.workload, c.step, "none", "no FLOPs or device bytes: it can remove at most the data wait, "
                      "measured below")


def _reference(c: Context) -> Prediction:
    return Prediction(c.workload, c.step, "none", "the reference: nothing removed")


def _layout_copies(c: Context) -> Prediction | None:
    if not c.workload.startswith("vit_bdh"):
        return None
    out = VIT_PATCHES * c.cfg.d_model
    nb = float(c.cfg.batch * c.elem * (2 * (VIT_IMAGE_ELEMS + out) + 2 * out))
    return c.bytes_prediction("NCHW<->NHWC copies of the patch convolution's input and output (forward) and output "
                              "gradient (backward)", nb)


def _padding_flops(c: Context, n_batches: int = 20) -> Prediction | None:
    if c.workload != "encoder_nli":
        return None
    from ..workloads.encoder_nli import flops_formula, padding_stats
    cfg = c.cfg
    st = padding_stats(cfg, 0, n_batches=n_batches)
    rows = st["packed_tokens"] / (n_batches * cfg.pack_len)   # packed rows per batch, on average
    padded_f = flops_formula(cfg, cfg.batch * cfg.context, cfg.batch * cfg.context ** 2, cfg.batch)
    packed_f = flops_formula(cfg, rows * cfg.pack_len, rows * cfg.pack_len ** 2, cfg.batch)
    removed = padded_f - packed_f
    return Prediction(c.workload, c.step, "estimate", "matmul FLOPs on padding tokens "
                      f"(padded rows of {cfg.context} against packed rows of {cfg.pack_len}, over {n_batches} batches)",
                      flops_removed=removed, saved_ms=flops_ms(removed, c.ceilings, c.precision))


RECIPE: tuple[Step, ...] = (
    Step("01_baseline_fp32", "fp32 eager, TF32 off", {}, 0.0,
         why_tolerance="the reference every ratio is taken against", predict=_reference),
    Step("02_tf32", "TF32 matmuls", {"tf32": True}, 5e-3, gpu_only=True,
         why_tolerance="TF32 rounds matmul inputs to a 10-bit mantissa (rel. error ~1e-3 per product)", predict=_precision_change),
    Step("03_bf16_autocast", "bf16 autocast", {"autocast": "bf16"}, 3e-2,
         why_tolerance="bf16 keeps 8 mantissa bits: per-op error ~4e-3, grows over K optimizer steps", bound_from_tf32=True, predict=_precision_change),
    Step("04_sdpa_attention", "fused attention (SDPA)", {"attention": "sdpa"}, 1e-2,
         why_tolerance="same math, other summation order and an online softmax, under bf16",
         workloads=("gpt", "encoder_nli", "vit_bdh"),
         why_na={"resnet_bk": "no attention: its token mixing is the BK-Core",
                 "vit_bdh_linear": "linear attention has no softmax for a fused kernel to fuse"}, predict=_fused_attention),
    Step("05_fused_optimizer", "fused AdamW, set_to_none", {"fused_adamw": True}, 1e-2,
         why_tolerance="same update formula in one kernel; rounding order differs", predict=_zero_fill),
    Step("06_torch_compile", "torch.compile", {"compile": True}, 1e-2,
         why_tolerance="same graph, fused kernels keep intermediates in fp32 registers", predict=_overhead_bound("fused memory-bound ops")),
    Step("07_nice_shapes", "vocabulary padded to a multiple of 64", {"vocab_multiple": 64}, 1e-2,
         why_tolerance="padded logits are sliced off before the loss: same function, other GEMM tiling",
         workloads=("gpt", "resnet_bk"),
         why_na={"encoder_nli": "its vocabulary is only looked up (the head has 3 classes): padding it changes no matmul",
                 **{w: "no vocabulary to pad: its widths are already multiples of 64, and 65 tokens cannot be "
                       "padded without masking" for w in ("vit_bdh", "vit_bdh_linear")}}, predict=_padded_vocabulary),
    Step("08_dataloader", "loader workers, pinned memory, prefetch, non_blocking copies", {"loader": "tuned"}, 1e-2,
         why_tolerance="bit-identical batches; only run-to-run rounding of the compiled kernels differs",
         same_arithmetic=True,
         workloads=("vit_bdh", "vit_bdh_linear", "encoder_nli"),
         why_na={"gpt": "batches are slices of a pinned in-memory token tensor: nothing to decode or overlap",
                 "resnet_bk": "batches are slices of a pinned in-memory token tensor: nothing to decode or overlap"}, predict=_data_wait),
    Step("09_cuda_graphs", "CUDA graphs (torch.compile mode='reduce-overhead')", {"cuda_graphs": True}, 1e-2,
         gpu_only=True, why_tolerance="the same compiled kernels, replayed from a graph", predict=_overhead_bound("kernel launches")),
    Step("10_channels_last", "channels_last memory format", {"channels_last": True}, 1e-2,
         why_tolerance="same convolution, other layout and cuDNN algorithm",
         workloads=("vit_bdh", "vit_bdh_linear"),
         why_na={"gpt": "no convolution", "resnet_bk": "no convolution", "encoder_nli": "no convolution"}, predict=_layout_copies),
    Step("11_sequence_packing", "sequences packed, padding removed", {"packing": True}, 1e-2,
         why_tolerance="the same sequences and loss; attention stays within each sequence, sums reordered",
         workloads=("encoder_nli",),
         why_na={"gpt": "its token stream is packed from step 01: every row is a full window of concatenated "
                        "text, with no padding to remove",
                 "resnet_bk": "its token stream is packed from step 01 (no padding)",
                 "vit_bdh": "every image is 65 tokens: no padding",
                 "vit_bdh_linear": "every image is 65 tokens: no padding"}, predict=_padding_flops),
    Step("12_bk_core", "BK-Core through the fastest custom kernel", {"bk_backend": "auto"}, 1e-2,
         why_tolerance="same recursions in fp32 in one kernel, other rounding, under bf16 elsewhere",
         workloads=("resnet_bk",)),
)
