"""The optimizations as composable settings, and the cumulative ladder.

Step k runs with the changes of steps 01..k. A step past the recipe may build on an earlier step
than the one listed before it (``Step.after``: a branch, such as a bf16 step that leaves the FP8
step out); it then runs with the changes of its own chain. Each step states the tolerance of its
"same math" check: the largest relative difference allowed between its loss curve and the previous
step's over the first K steps from the same seed and data. Exact-math changes get a tight bound that only
reordering of sums can use up; bf16 changes the arithmetic and gets a stated looser bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .data.loader import LOADER_MODES
from .device import (ChoiceError, DeviceInfo, Unavailable, fp8_missing, supports_bf16, supports_compile,
                     supports_tf32)


@dataclass(frozen=True)
class Settings:
    tf32: bool = False               # TF32 tensor-core matmuls for fp32 tensors
    autocast: str | None = None      # None, "bf16" or "fp16" (fp16 brings a GradScaler)
    attention: str = "manual"        # "manual" (matmul-softmax-matmul) or "sdpa"
    fused_adamw: bool = False        # AdamW(fused=True) and zero_grad(set_to_none=True)
    compile: bool = False            # torch.compile(model)
    vocab_multiple: int = 1          # pad the vocabulary to a multiple of this
    loader: str = "simple"           # "simple", "tuned" or "resident" (hwlib.data.loader)
    cuda_graphs: bool = False        # compiled with mode="reduce-overhead": the step's kernels replayed as CUDA graphs
    channels_last: bool = False      # NHWC memory format for convolutions and their inputs
    packing: bool = False            # sequences packed without padding, attention kept within each sequence
    bk_backend: str = "torch"        # BK-Core backend of the resnet_bk workload (hwlib.ops)
    fused_head: bool = False         # LM head + cross-entropy in one chunked op (hwlib.ops.linear_ce): no [tokens, V] logits
    fp8: bool = False                # FP8 matmuls (e4m3 forward, e5m2 gradients) in the MLP (hwlib.ops.fp8)
    fused_ln: bool = False           # residual add + LayerNorm as one op each way (hwlib.ops.add_layernorm)
    fused_mlp: bool = False          # the MLP's GELU in its matmuls' epilogues, cuBLASLt (hwlib.ops.gelu_mlp)
    branch_bias: bool = False        # each branch's output bias added, its gradient summed, in the fused LayerNorm after it
    fused_qkv: bool = False          # QKV projection + attention as one op: dq, dk, dv packed with the bias gradient (hwlib.ops.qkv_attention)
    fc_bias_column: bool = False     # mlp_fc's bias gradient from its weight-gradient matmul, through a column of ones ln_2 writes
    fp8_head: bool = False           # the fused LM head's three GEMMs in FP8 (hwlib.ops.linear_ce_fp8); needs fused_head
    bf16_stream: bool = False        # the residual stream in autocast's 16-bit dtype instead of fp32 (hwlib.ops.add_layernorm)
    gemm_workspace_free: bool = False  # torch's matmuls and hwlib's plain cuBLASLt one without cuBLAS's workspace: no memset before them (hwlib.blas)
    # Memory techniques (notebook 13), not ladder steps:
    checkpointing: str = "none"      # activation checkpointing: "none", "all" or block indices "0,2,4"
    offload_optimizer: bool = False  # AdamW moments in pinned CPU memory (hwlib.memory.offload)

    @property
    def uses_fp8(self) -> bool:
        """Whether any matmul runs in FP8 (the MLP's, step 18, or the LM head's, step 26)."""
        return self.fp8 or self.fp8_head

    def diff(self, other: "Settings") -> dict:
        """Fields where ``self`` differs from ``other``: {name: (other's, self's)}."""
        return {f.name: (getattr(other, f.name), getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)}


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    change: dict = field(default_factory=dict)
    tolerance: float = 0.0           # relative, max over K steps, vs the previous step
    gpu_only: bool = False
    why_tolerance: str = ""
    workloads: tuple[str, ...] | None = None   # None: every workload; else the ones it applies to
    why_na: dict = field(default_factory=dict)  # workload -> why the step does not apply to it
    same_arithmetic: bool = False   # the change leaves every operation as it was (only data delivery differs)
    beyond_recipe: bool = False     # past the standard recipe the seeds describe (notebooks 17+)
    after: str | None = None        # the step it builds on, where that is not the one listed before it


FP8_HEAD_TOLERANCE = (
    "FP8 rounds the head's operands to 3 mantissa bits (h and W, e4m3, one scale each) and the probabilities "
    "off the targets in its gradient to 2 (e5m2, a static scale); each row's target entry, p_t - 1, is added in "
    "fp32. The logits move a few percent of their size, the errors independent across a dot product's terms, "
    "and the loss is a mean over every token, so the curve moves far less than any one logit. The bound is the "
    "FP8 MLP's (step 18), 1e-2, which bf16 itself (step 03: 3e-2) would fail; what the head moves is measured by "
    "notebook 26 (curve_move) on every run. The 10 steps cannot see a gradient error that only steers "
    "training (a head that rounded p_t - 1 into e5m2 passed them and then fell far behind), so notebook 26 also "
    "trains steps 09, 25 and 26 for 300 steps and bounds the FP8 step's end against step 25's "
    "(hwlib.studies.fp8_head.LONG_TOL)")

BF16_STREAM_TOLERANCE = (
    "The residual stream is rounded to bf16's 8 significant bits after each of its 25 adds (a relative error of "
    "at most 2^-9 each, independent from element to element), where the recipe keeps it in fp32; the branches "
    "already read it through a bf16 LayerNorm output, and every matmul, LayerNorm statistic and gradient sum is "
    "as before. The bound is the one the FP8 steps are held to, 1e-2, a third of bf16 autocast's own (step 03: "
    "3e-2); notebook 27 measures the move on every run (curve_move) and, as notebook 26 does for the FP8 head, "
    "trains it 300 steps beside the steps before it and bounds its end against step 26's "
    "(hwlib.studies.fp8_head.LONG_TOL)")

LADDER: tuple[Step, ...] = (
    Step("01_baseline_fp32", "fp32 eager, TF32 off", {}, 0.0,
         why_tolerance="the reference every ratio is taken against"),
    Step("02_tf32", "TF32 matmuls", {"tf32": True}, 5e-3, gpu_only=True,
         why_tolerance="TF32 rounds matmul inputs to a 10-bit mantissa (rel. error ~1e-3 per product)"),
    Step("03_bf16_autocast", "bf16 autocast", {"autocast": "bf16"}, 3e-2,
         why_tolerance="bf16 keeps 8 mantissa bits: per-op error ~4e-3, grows over K optimizer steps"),
    Step("04_sdpa_attention", "fused attention (SDPA)", {"attention": "sdpa"}, 1e-2,
         why_tolerance="same math, other summation order and an online softmax, under bf16",
         workloads=("gpt", "encoder_nli", "vit_bdh"),
         why_na={"resnet_bk": "no attention: its token mixing is the BK-Core",
                 "vit_bdh_linear": "linear attention has no softmax for a fused kernel to fuse"}),
    Step("05_fused_optimizer", "fused AdamW, set_to_none", {"fused_adamw": True}, 1e-2,
         why_tolerance="same update formula in one kernel; rounding order differs"),
    Step("06_torch_compile", "torch.compile", {"compile": True}, 1e-2,
         why_tolerance="same graph, fused kernels keep intermediates in fp32 registers"),
    Step("07_nice_shapes", "vocabulary padded to a multiple of 64", {"vocab_multiple": 64}, 1e-2,
         why_tolerance="padded logits are sliced off before the loss: same function, other GEMM tiling",
         workloads=("gpt", "resnet_bk"),
         why_na={"encoder_nli": "its vocabulary is only looked up (the head has 3 classes): padding it changes no matmul",
                 **{w: "no vocabulary to pad: its widths are already multiples of 64, and 65 tokens cannot be "
                       "padded without masking" for w in ("vit_bdh", "vit_bdh_linear")}}),
    Step("08_dataloader", "loader workers, pinned memory, prefetch, non_blocking copies", {"loader": "tuned"}, 1e-2,
         why_tolerance="bit-identical batches; only run-to-run rounding of the compiled kernels differs",
         same_arithmetic=True,
         workloads=("vit_bdh", "vit_bdh_linear", "encoder_nli"),
         why_na={"gpt": "batches are slices of a pinned in-memory token tensor: nothing to decode or overlap",
                 "resnet_bk": "batches are slices of a pinned in-memory token tensor: nothing to decode or overlap"}),
    Step("09_cuda_graphs", "CUDA graphs (torch.compile mode='reduce-overhead')", {"cuda_graphs": True}, 1e-2,
         gpu_only=True, why_tolerance="the same compiled kernels, replayed from a graph"),
    Step("10_channels_last", "channels_last memory format", {"channels_last": True}, 1e-2,
         why_tolerance="same convolution, other layout and cuDNN algorithm",
         workloads=("vit_bdh", "vit_bdh_linear"),
         why_na={"gpt": "no convolution", "resnet_bk": "no convolution", "encoder_nli": "no convolution"}),
    Step("11_sequence_packing", "sequences packed, padding removed", {"packing": True}, 1e-2,
         why_tolerance="the same sequences and loss; attention stays within each sequence, sums reordered",
         workloads=("encoder_nli",),
         why_na={"gpt": "its token stream is packed from step 01: every row is a full window of concatenated "
                        "text, with no padding to remove",
                 "resnet_bk": "its token stream is packed from step 01 (no padding)",
                 "vit_bdh": "every image is 65 tokens: no padding",
                 "vit_bdh_linear": "every image is 65 tokens: no padding"}),
    Step("12_bk_core", "BK-Core through the fastest custom kernel", {"bk_backend": "auto"}, 1e-2,
         why_tolerance="same recursions in fp32 in one kernel, other rounding, under bf16 elsewhere",
         workloads=("resnet_bk",)),
    # Past the standard recipe: the lab's own steps, measured against step 09 in the same run.
    Step("17_fused_lm_head", "LM head + cross-entropy fused, logits never materialised", {"fused_head": True}, 1e-2,
         why_tolerance="same function from the same bf16 logits; the log-sum-exp runs online over vocabulary "
                       "tiles in fp32, and dh, dW are summed in fp32 and rounded once (unfused: to bf16): "
                       "other rounding under bf16",
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the fused head is measured on GPT-2",
                 **{w: "its head has no large vocabulary: the logits are a few classes wide"
                    for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}}),
    Step("18_fp8", "FP8 matmuls in the MLP (e4m3 forward, e5m2 gradients)", {"fp8": True}, 1e-2, gpu_only=True,
         why_tolerance="FP8 rounds the MLP matmuls' operands to 3 mantissa bits (e4m3; gradients 2, e5m2), per-tensor "
                       "scaled: each operand 16x coarser than bf16's, but the rounding errors are independent and "
                       "average over each dot product's terms (outputs move a few percent, tests/test_fp8.py) and the "
                       "loss is a mean over every token. Measured, H100 (outputs/reference/h100, notebook 18's "
                       "curve_move): the curve moved 1.1e-3 from step 17's and 1.6e-3 from step 09's over 10 steps; "
                       "the bound is 1e-2, six to nine times that move and the bound GPT-2's recipe steps 04-09 are held to "
                       "(its fused kernels), so a curve FP8 moved as far as bf16 itself (step 03: 3e-2) fails",
         workloads=("gpt",), beyond_recipe=True,
         why_na={w: "the FP8 step is built and measured for GPT-2's MLP only"
                 for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear", "resnet_bk")}),
    # Built on 17, not on 18: FP8 is a branch of its own, and this step stays in bf16 (the same math as 17).
    Step("21_fused_layernorm", "residual add + LayerNorm fused, one Triton kernel each way", {"fused_ln": True}, 1e-2,
         after="17_fused_lm_head",
         why_tolerance="the same sums in fp32, in one pass per direction: the LayerNorm's mean and variance, its "
                       "backward's row sums and the gain and bias sums are reduced in another order, and the outputs "
                       "are rounded into bf16 at the points where the unfused path rounds them: other rounding under bf16",
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the fused LayerNorm is measured on GPT-2's blocks",
                 "encoder_nli": "post-LayerNorm blocks (a LayerNorm after each sum): the fused op is built for GPT's "
                                "pre-LayerNorm blocks",
                 **{w: "the fused residual LayerNorm is built into GPT's blocks only"
                    for w in ("vit_bdh", "vit_bdh_linear")}}),
    Step("22_gelu_epilogue", "the MLP's bias + GELU and the GELU's derivative inside its matmuls (cuBLASLt epilogues)",
         {"fused_mlp": True}, 1e-2, after="21_fused_layernorm",
         why_tolerance="the same matmuls in bf16 with fp32 accumulation; the bias, the GELU and its derivative are "
                       "applied to the fp32 accumulators, where the unfused path rounds the matmul's output to bf16 "
                       "first: other rounding under bf16",
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the GELU epilogue is measured on GPT-2",
                 "encoder_nli": "its MLP uses the erf GELU, which cuBLASLt's tanh-form epilogue does not compute",
                 **{w: "the GELU epilogue is built into GPT's blocks only" for w in ("vit_bdh", "vit_bdh_linear")}}),
    Step("23_branch_bias", "each branch's output bias added, and its gradient summed, in the fused residual LayerNorm",
         {"branch_bias": True}, 1e-2, after="22_gelu_epilogue",
         why_tolerance="the same sums: the output projections' biases are added to the fp32 stream after their "
                       "matmuls' bf16 rounding instead of to the fp32 accumulators before it, and their gradients "
                       "are summed in fp32 in another order: other rounding under bf16",
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the branch biases are moved in GPT-2's blocks",
                 "encoder_nli": "post-LayerNorm blocks: the fused residual LayerNorm this step builds on is GPT's",
                 **{w: "the fused residual LayerNorm this step builds on is built into GPT's blocks only"
                    for w in ("vit_bdh", "vit_bdh_linear")}}),
    Step("24_qkv_grad", "the QKV projection and the attention as one op: dq, dk, dv packed into the projection's "
         "gradient with its bias gradient summed in the same pass",
         {"fused_qkv": True}, 1e-2, after="23_branch_bias",
         why_tolerance="the same matmuls and the same fused attention kernel (cuDNN's, called directly); the QKV "
                       "bias gradient is summed in fp32 in another order: other rounding under bf16",
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "no attention: its token mixing is the BK-Core",
                 "encoder_nli": "its attention is masked per sequence (packed, step 11): the op runs causal attention",
                 **{w: "the op is built into GPT's causal attention only" for w in ("vit_bdh", "vit_bdh_linear")}}),
    Step("25_bias_column", "the MLP's first bias gradient out of its weight-gradient matmul, through a column of "
         "ones the LayerNorm writes beside its output", {"fc_bias_column": True}, 1e-2, after="24_qkv_grad",
         why_tolerance="the same sums: mlp_fc's bias gradient is a column of a bf16 matmul with fp32 accumulation "
                       "instead of a column sum in fp32, in another order, rounded once into bf16 either way: other "
                       "rounding under bf16",
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the bias column is built into GPT's fused MLP",
                 "encoder_nli": "its MLP uses the erf GELU, which the fused MLP this step builds on does not compute",
                 **{w: "the fused MLP this step builds on is built into GPT's blocks only"
                    for w in ("vit_bdh", "vit_bdh_linear")}}),
    # Built on 25, the fastest bf16 step: the FP8 branch's second step, its head instead of its MLP.
    Step("26_fp8_head", "the fused LM head's three matmuls in FP8 (e4m3 forward; the gradient's probabilities in e5m2, "
         "in both layouts, its target entries in fp32)", {"fp8_head": True}, 1e-2, gpu_only=True, after="25_bias_column",
         why_tolerance=FP8_HEAD_TOLERANCE,
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the FP8 head is built on GPT-2's fused head",
                 **{w: "its head has no large vocabulary: the logits are a few classes wide"
                    for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}}),
    Step("27_bf16_stream", "the residual stream in bf16 (the sum of each residual add rounded once; LayerNorm "
         "statistics and every matmul as before)", {"bf16_stream": True}, 1e-2, gpu_only=True,
         why_tolerance=BF16_STREAM_TOLERANCE,
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); the stream is built into GPT's fused blocks",
                 **{w: "the fused residual LayerNorm this step builds on is built into GPT's blocks only"
                    for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}}),
    # Built on 25, the fastest bf16 step: the bf16 branch again, after the FP8 branch's two steps.
    Step("28_gemm_workspace", "torch's matmuls and hwlib's plain cuBLASLt matmul without cuBLAS's workspace: no memset "
         "before them in the CUDA graph",
         {"gemm_workspace_free": True}, 1e-2, after="25_bias_column",
         why_tolerance="the same matmuls in bf16 with fp32 accumulation, in the same tiles; without a workspace "
                       "cuBLAS picks another tile scheduler, which can add a product's partial sums in another "
                       "order: other rounding under bf16",
         workloads=("gpt",), beyond_recipe=True,
         why_na={"resnet_bk": "its step is the BK-Core's (notebook 12); this step builds on GPT-2's fused blocks",
                 **{w: "this step builds on the fused residual LayerNorm, which is built into GPT's blocks only"
                    for w in ("encoder_nli", "vit_bdh", "vit_bdh_linear")}}),
)
RECIPE_NAMES = tuple(s.name for s in LADDER if not s.beyond_recipe)

STEP_NAMES = tuple(s.name for s in LADDER)


def get_step(name: str) -> Step:
    for s in LADDER:
        if s.name == name or s.name.split("_", 1)[0] == name:
            return s
    raise ChoiceError("step", name, STEP_NAMES)


def previous(name: str) -> Step | None:
    """The step ``name`` builds on: its ``after``, else the one listed before it; None for the first."""
    step = get_step(name)
    if step.after is not None:
        return get_step(step.after)
    i = STEP_NAMES.index(step.name)
    return LADDER[i - 1] if i else None


def chain(name: str) -> list[Step]:
    """The steps ``name`` builds on, first step first, ending with ``name`` itself."""
    out, st = [], get_step(name)
    while st is not None:
        out.append(st)
        st = previous(st.name)
    return out[::-1]


def settings_for(name: str) -> Settings:
    """Cumulative settings of a step: every change of its chain, up to and including it."""
    kw: dict = {}
    for s in chain(name):
        kw.update(s.change)
    return Settings(**kw)


def unavailable(step: Step, di: DeviceInfo) -> str | None:
    """Why ``step`` cannot run as such on this device (a reason for a 'skipped' row), else None.

    Only the step's own change is judged: a later step on CPU still runs, with the earlier
    GPU-only changes inert there.
    """
    if step.gpu_only and di.kind != "cuda":
        return f"{step.name} is GPU-only ({step.title}); this device is {di.kind}"
    if "tf32" in step.change and di.kind == "cuda" and not supports_tf32(di):
        return f"TF32 needs sm_80 or newer; this GPU is sm_{di.capability[0]}{di.capability[1]}"
    if "compile" in step.change or "cuda_graphs" in step.change:
        ok, why = supports_compile(di)
        if not ok:
            return f"torch.compile unavailable: {why}"
    if Settings(**step.change).uses_fp8 and (why := fp8_missing(di)):
        return why
    return None


def not_applicable(step: Step, workload: str) -> str | None:
    """Why ``step`` does not apply to ``workload`` (an 'n/a' row), else None."""
    if step.workloads is not None and workload not in step.workloads:
        if workload in step.why_na:
            return step.why_na[workload]
        return f"{step.name} changes a layer that {workload} does not have (applies to {', '.join(step.workloads)})"
    return None


def resolve_autocast(settings: Settings, di: DeviceInfo) -> Settings:
    """bf16 before Ampere becomes fp16 with a GradScaler (the documented fallback)."""
    if settings.autocast == "bf16" and not supports_bf16(di):
        return dataclasses.replace(settings, autocast="fp16")
    if settings.autocast == "fp16" and di.kind != "cuda":
        raise Unavailable("fp16 autocast with a GradScaler is a CUDA recipe; on CPU use bf16")
    if settings.autocast not in (None, "bf16", "fp16"):
        raise ChoiceError("autocast", settings.autocast, (None, "bf16", "fp16"))
    if settings.attention not in ("manual", "sdpa"):
        raise ChoiceError("attention", settings.attention, ("manual", "sdpa"))

    if settings.loader not in LOADER_MODES:
        raise ChoiceError("loader", settings.loader, LOADER_MODES)
    return settings


def runs_here(di: DeviceInfo) -> list[dict]:
    """What each ladder step does on this device, for notebook 00: runs, runs changed (bf16 autocast
    as fp16 with a GradScaler before sm_80; mixed precision with no tensor cores to run it on before
    sm_70) or is skipped, with the reason. The rest of the series runs what it can around it."""
    rows = []
    for step in LADDER:
        why = unavailable(step, di)
        if why:
            rows.append({"step": step.name, "here": "skipped", "why": why})
            continue
        here, note = "runs", ""
        if step.change.get("autocast") and di.kind == "cuda":
            ran = resolve_autocast(settings_for(step.name), di).autocast   # the fallback the ladder takes
            if ran != step.change["autocast"]:
                here, note = f"runs as {ran} autocast + GradScaler", "no bf16 tensor cores before sm_80"
            if di.capability is not None and di.capability[0] < 7:
                here, note = here + ", no speed-up expected", "no tensor cores (fp16 or bf16) before sm_70"
        rows.append({"step": step.name, "here": here, "why": note})
    return rows


def describe(name: str) -> list[dict]:
    """The step's change against the step before, as rows for a table."""
    step = get_step(name)
    prev = previous(name)
    before = settings_for(prev.name) if prev else Settings()
    after = settings_for(step.name)
    return [{"setting": k, "before": a, "after": b} for k, (a, b) in after.diff(before).items()]
