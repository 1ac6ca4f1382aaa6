"""Roofline predictions: what a ladder step removes in FLOPs or bytes, and the time that should save
at the run's measured ceilings (``hwlib.ceilings``), before the step is measured.

A prediction is made of counts and ceilings only; nothing here times or reads results. The
measured times it needs (the step before, for a bound) are handed in by the caller.

* ``estimate``: the change removes (or adds) a counted number of FLOPs or bytes; the time is that
  count over the matmul ceiling of the step's precision, or over the measured copy bandwidth.
* ``bound``: the change removes overhead the roofline does not count (kernel launches, fusion of
  memory-bound ops): at most the time the step before spent above its floor can go.
* ``none``: the change removes nothing a roofline counts (the row says what it removes instead).

The floor of a step is its model FLOPs at the matmul ceiling of its precision (bf16 under autocast,
TF32 with TF32 on, else fp32): no schedule can run the model's FLOPs faster on this device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .steps import get_step, not_applicable, previous, settings_for
from .workloads import get_workload

# Passes of the unfused attention over its [B, H, T, T] score matrix in one forward: the QK^T
# matmul writes it, each elementwise op between (scale, mask, softmax) reads and writes it, and
# the AV matmul reads it. Backward runs the same ops' gradients: counted as twice the forward,
# the rule the FLOP counts use. Fused attention keeps the tile in registers: zero passes.
ELEMENTWISE_IN_ATTENTION = {"gpt": 3, "encoder_nli": 3, "vit_bdh": 2}
BACKWARD_FACTOR = 2
# vit_bdh's patch convolution: 3 x 32 x 32 images in, 8 x 8 patches of D channels out.
VIT_IMAGE_ELEMS, VIT_PATCHES = 3 * 32 * 32, 64


@dataclass
class Prediction:
    workload: str
    step: str
    kind: str                          # "estimate", "bound" or "none"
    basis: str                         # what is counted, in words
    flops_removed: float | None = None # per training step; negative: added
    bytes_removed: float | None = None
    saved_ms: float | None = None      # at the measured ceilings; for a bound, the most it can save
    floor_ms: float | None = None      # this step's model FLOPs at its precision's ceiling
    missing: str | None = None         # why saved_ms is None

    def to_row(self) -> dict:
        return {"workload": self.workload, "kind": self.kind, "GFLOP removed": _g(self.flops_removed),
                "MB removed": None if self.bytes_removed is None else self.bytes_removed / 1e6,
                "predicted saving (ms)": self.saved_ms, "floor (ms)": self.floor_ms,
                "basis": self.basis + (f" ({self.missing})" if self.missing else "")}


def _g(flops):
    return None if flops is None else flops / 1e9


def precision_of(step: str) -> str:
    """The matmul precision a step runs its fp32 model in: 'bf16', 'tf32' or 'fp32'."""
    s = settings_for(step)
    return "bf16" if s.autocast else "tf32" if s.tf32 else "fp32"


def matmul_ceiling(ceilings: dict | None, precision: str) -> float | None:
    """TFLOP/s of the measured matmul ceiling of ``precision``; without TF32 (a CPU) fp32 stands in."""
    mm = (ceilings or {}).get("matmul_tflops") or {}
    return mm.get(precision) or (mm.get("fp32") if precision == "tf32" else None)


def flops_ms(flops: float, ceilings: dict | None, precision: str) -> float | None:
    peak = matmul_ceiling(ceilings, precision)
    return flops / (peak * 1e12) * 1e3 if peak else None


def bytes_ms(nbytes: float, ceilings: dict | None) -> float | None:
    gbps = (ceilings or {}).get("copy_gbps")
    return nbytes / (gbps * 1e9) * 1e3 if gbps else None


def floor_ms(workload: str, step: str, profile: str, ceilings: dict | None) -> float | None:
    """The step's model FLOPs at the matmul ceiling of its precision (the speed-of-light floor)."""
    wl = get_workload(workload)
    return flops_ms(wl.flops_per_step(wl.config(profile)), ceilings, precision_of(step))


def attention_score_bytes(workload: str, cfg, elem_bytes: int) -> float | None:
    """Bytes the unfused attention moves through its score matrices in one training step."""
    ops = ELEMENTWISE_IN_ATTENTION.get(workload)
    if ops is None:
        return None
    tokens = getattr(cfg, "context", None) or VIT_PATCHES + 1
    scores = cfg.batch * cfg.n_head * tokens * tokens * cfg.n_layer
    passes = (2 + 2 * ops) * (1 + BACKWARD_FACTOR)
    return float(scores * passes * elem_bytes)


def parameter_count(workload: str, profile: str) -> int:
    """Parameters of the workload's model, built on the meta device (no memory, no init cost)."""
    wl = get_workload(workload)
    with torch.device("meta"):
        model = wl.build(wl.config(profile), settings_for("01_baseline_fp32"), 0)
    return sum(p.numel() for p in model.parameters())


def _counted(workload: str, step: str, profile: str, ceilings: dict | None, elem: int) -> Prediction | None:
    """The steps whose change removes a number the roofline counts; None for the others."""
    wl = get_workload(workload)
    cfg = wl.config(profile)
    flops = wl.flops_per_step(cfg)
    before = precision_of(previous(step).name) if previous(step) else None
    if step in ("02_tf32", "03_bf16_autocast"):
        new = precision_of(step)
        a, b = flops_ms(flops, ceilings, before), flops_ms(flops, ceilings, new)
        return Prediction(workload, step, "estimate", f"the same model FLOPs at the {new} instead of the "
                          f"{before} matmul ceiling", flops_removed=0.0,
                          saved_ms=None if a is None or b is None else a - b)
    if step == "04_sdpa_attention":
        nb = attention_score_bytes(workload, cfg, elem)
        if nb is None:
            return Prediction(workload, step, "none", "no softmax attention to fuse")
        return Prediction(workload, step, "estimate", "score-matrix round trips of the unfused attention "
                          "(softmax's fp32 output under autocast makes this a lower bound)",
                          bytes_removed=nb, saved_ms=bytes_ms(nb, ceilings))
    if step == "05_fused_optimizer":
        nb = 4.0 * parameter_count(workload, profile)
        return Prediction(workload, step, "estimate", "the fp32 gradient zero-fill that set_to_none skips "
                          "(fused AdamW moves the same bytes in fewer launches, which the roofline does not count)",
                          bytes_removed=nb, saved_ms=bytes_ms(nb, ceilings))
    if step == "07_nice_shapes" and hasattr(cfg, "vocab"):
        from .shapes import padded
        extra = 3 * 2.0 * wl.items_per_step(cfg) * cfg.d_model * (padded(cfg.vocab, 64) - cfg.vocab)
        t = flops_ms(extra, ceilings, precision_of(step))
        return Prediction(workload, step, "estimate", "padded logits are extra work: at the floor the step "
                          "gets slower; any gain is full tiles, which the roofline does not see",
                          flops_removed=-extra, saved_ms=None if t is None else -t)
    if step == "10_channels_last" and workload.startswith("vit_bdh"):
        out = VIT_PATCHES * cfg.d_model
        nb = float(cfg.batch * elem * (2 * (VIT_IMAGE_ELEMS + out) + 2 * out))
        return Prediction(workload, step, "estimate", "NCHW<->NHWC copies of the patch convolution's input "
                          "and output (forward) and output gradient (backward)", bytes_removed=nb,
                          saved_ms=bytes_ms(nb, ceilings))
    if step == "11_sequence_packing" and workload == "encoder_nli":
        return _packing(cfg, ceilings, precision_of(step))
    if workload == "gpt" and step == "26_fp8_head":
        # The head's three GEMMs (2 N d V_pad FLOPs each) on FP8 tensor cores, whose peak on Hopper and Ada is
        # twice the 16-bit one: at the measured bf16 ceiling doubled. Bytes a logit are the same either way
        # (hwlib/ops/linear_ce_fp8.py: 10), and the casts of h and W are small, so only FLOPs move.
        from .shapes import padded
        head = 3 * 2.0 * wl.items_per_step(cfg) * cfg.d_model * padded(cfg.vocab, 64)
        t = flops_ms(head, ceilings, "bf16")
        return Prediction(workload, step, "estimate", "the LM head's three matmuls at twice the measured bf16 "
                          "matmul ceiling (FP8 tensor cores' peak rate over 16-bit's); the same bytes a logit",
                          flops_removed=0.0, saved_ms=None if t is None else t / 2)
    if workload == "gpt" and (fused := _gpt_fusion_bytes(step, wl.items_per_step(cfg), cfg)):
        basis, nb = fused
        return Prediction(workload, step, "estimate", basis, bytes_removed=nb, saved_ms=bytes_ms(nb, ceilings))
    return None


def _gpt_fusion_bytes(step: str, n: int, cfg) -> tuple[str, float] | None:
    """(what is counted, bytes removed a step) for GPT's steps past the recipe that remove memory
    traffic, at ``n`` tokens a step; None for the other steps."""
    L, d = cfg.n_layer, cfg.d_model
    if step == "21_fused_layernorm":
        # One pass per op (studies.breakdown.gpt_floors' count): the add reads the fp32 stream and the branch
        # and writes the sum (10 d bytes a token), the LayerNorm reads the sum again (4 d) and writes its output
        # (2 d); fused, the sum is normalised where it is made: 4 d bytes fewer per LayerNorm with an add before
        # it (2 L of them), forward, and backward counted as twice the forward.
        return ("the LayerNorms' re-read of each residual sum at one pass per op; inductor already fuses the "
                "forward add into the LayerNorm, so less may be left", 3.0 * n * 2 * L * 4 * d)
    if step == "22_gelu_epilogue":
        # hwlib/kernels/gelu_epilogue.cpp's count at one pass per op, per layer: the GELU's re-read of the
        # pre-activation (forward), the input gradient's write and re-read (backward).
        from .ops.gelu_mlp import bytes_removed
        per = bytes_removed(n, 4 * d)
        return ("the MLP's GELU passes over its [tokens, 4 d] activations at one pass per op; an epilogue that "
                "writes two outputs can slow its matmul, so less may be left",
                float(L * (per["forward"] + per["backward"])))
    if step == "23_branch_bias":
        # The output projections' bias gradients (two a layer) are each a column sum of a bf16 [tokens, d]
        # gradient, one read of it; in the LayerNorm's backward kernel they are sums of values already in
        # registers. The forward's bias add moves from the matmul's epilogue to the LayerNorm: no bytes.
        return ("the output projections' bias gradients' own passes over their [tokens, d] gradients",
                2.0 * L * n * d * 2)
    if step == "24_qkv_grad":
        # hwlib/kernels/qkv_grad_triton.py's count: the QKV bias gradient's reduction re-reads dq, dk, dv
        # (3 d bf16 values a token) after the packing copy; packed and summed in one pass, once per layer.
        from .ops.qkv_attention import traffic_bytes
        per = traffic_bytes(n, d)
        return "the QKV bias gradient's own read of dq, dk and dv", float(L * (per["unfused"] - per["fused"]))
    if step == "25_bias_column":
        # mlp_fc's bias gradient is a column sum of the bf16 [tokens, 4 d] dpre, one read of it a layer; through
        # the bias column it is one more column of a matmul that reads dpre anyway (its 16 extra columns of
        # output, 2% of that matmul's FLOPs, and the LayerNorm's 16 extra bf16 columns are not counted).
        return "mlp_fc's bias gradient's own read of its [tokens, 4 d] gradient", 2.0 * L * n * 4 * d
    if step == "27_bf16_stream":
        # The fused residual LayerNorms' bytes (hwlib/kernels/add_layernorm_triton.py's count) with a bf16
        # stream against an fp32 one, at each of the 2 L calls (one after every branch; block 0's first
        # LayerNorm has no add before it, the final one has): forward and backward once each. The embedding
        # sum's write and block 0's plain LayerNorm read, both narrower too, are not counted.
        from .ops.add_layernorm import traffic_bytes
        f32, b16 = traffic_bytes(n, d, stream_bytes=4), traffic_bytes(n, d, stream_bytes=2)
        return ("the fused residual LayerNorms' stream terms at 2 bytes instead of 4, and the branch gradient's "
                "copy that a stream of the branch's dtype no longer needs", 2.0 * L * sum(f32[k] - b16[k] for k in f32))
    return None


def _packing(cfg, ceilings: dict | None, precision: str, n_batches: int = 20) -> Prediction:
    from .workloads.encoder_nli import flops_formula, padding_stats
    st = padding_stats(cfg, 0, n_batches=n_batches)
    rows = st["packed_tokens"] / (n_batches * cfg.pack_len)   # packed rows per batch, on average
    padded = flops_formula(cfg, cfg.batch * cfg.context, cfg.batch * cfg.context ** 2, cfg.batch)
    packed = flops_formula(cfg, rows * cfg.pack_len, rows * cfg.pack_len ** 2, cfg.batch)
    removed = padded - packed
    return Prediction("encoder_nli", "11_sequence_packing", "estimate", "matmul FLOPs on padding tokens "
                      f"(padded rows of {cfg.context} against packed rows of {cfg.pack_len}, over {n_batches} batches)",
                      flops_removed=removed, saved_ms=flops_ms(removed, ceilings, precision))


def predict(workload: str, step: str, profile: str, ceilings: dict | None,
            prev_ms: float | None = None) -> Prediction:
    """What ``step`` should save for ``workload`` against the step before, at ``ceilings``.
    ``prev_ms``: the measured time of the step before (for the bound of overhead-only changes)."""
    st = get_step(step)
    why_na = not_applicable(st, workload)
    if why_na:
        return Prediction(workload, st.name, "n/a", why_na)
    floor = floor_ms(workload, st.name, profile, ceilings) if ceilings else None
    elem = 2 if settings_for(st.name).autocast else 4
    p = _counted(workload, st.name, profile, ceilings, elem)
    if p is None:
        if st.name in ("06_torch_compile", "09_cuda_graphs"):
            what = "fused memory-bound ops" if st.name.startswith("06") else "kernel launches"
            p = Prediction(workload, st.name, "bound", f"removes {what}: at most the time above the floor")
            prev_floor = floor_ms(workload, previous(st.name).name, profile, ceilings) if ceilings else None
            if prev_ms is not None and prev_floor is not None:
                p.saved_ms = max(0.0, prev_ms - prev_floor)
            elif ceilings:
                p.missing = "the step before has no measured time in this run"
        elif st.name == "08_dataloader":
            p = Prediction(workload, st.name, "none", "no FLOPs or device bytes: it can remove at most the "
                           "data wait, measured below")
        elif st.name == "01_baseline_fp32":
            p = Prediction(workload, st.name, "none", "the reference: nothing removed")
        else:
            p = Prediction(workload, st.name, "none", f"{st.title}: nothing the roofline counts")
    p.floor_ms = floor
    if not ceilings:
        p.saved_ms, p.missing = None, "needs notebook 00's ceilings in this run"
    return p
