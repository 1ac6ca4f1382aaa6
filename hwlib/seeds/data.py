"""The five seed write-ups and their claims, as data.

``CLAIMS`` holds one entry per claim of the five seed write-ups (the seeds' own checklists): the claim in our words (the write-ups are not quoted), the figure it
states, what it compares, and how the same change is read off a run's records (a lookup of
``hwlib.seeds.lookup``). ``hwlib.seeds.verdicts`` judges them; ``hwlib.report.claims`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .lookup import Ladder, NotHere, Records, Technique, Value


@dataclass(frozen=True)
class Seed:
    id: str
    title: str
    file: str
    workloads: tuple[str, ...]   # the lab workloads closest to the seed, nearest first
    source: str = ""             # the public write-up: repository, file (and commit) a reader can open


SEEDS: dict[str, Seed] = {s.id: s for s in (
    Seed("000", "ResNet-BK: BK-Core kernels, mixed precision, AMP, DDP, memory tools", "000_4030881d20da7627.txt",
         ("resnet_bk",), "neko-jpg/Project-ResNet-BK-An-O-N-Language-Model-Architecture, "
         "docs/implementation/STEP5_HARDWARE_CODESIGN_IMPLEMENTATION.md (commit 2465ec6)"),
    Seed("001", "Polychromic trainer: diversity kernel, batched generation, Triton and CUDA tiers",
         "001_a0ac3651fedc567c.txt", ("polychromic", "gpt"),
         "Sohailm25/reply-guyd, docs/implementation/CUDA_OPTIMIZATION_PLAN.md (commit 121b66d)"),
    Seed("002", "Hardware optimization guide: per-GPU settings, precision, checkpointing, loaders",
         "002_8cd1eeae9de685c3.txt", ("encoder_nli", "gpt"), "OscarTsao/LLM_Criteria_Gemma, HARDWARE_OPTIMIZATION.md"),
    Seed("003", "DeBERTa NLI trainer: status report of enabled and missing optimizations", "003_777fd2229bec0f35.txt",
         ("encoder_nli", "gpt"), "OscarTsao/Criteria_DataAug_HPO, docs/archive/HARDWARE_OPTIMIZATION_STATUS.md"),
    Seed("004", "Vision-BDH: model and training-loop optimizations, original vs optimized", "004_e657c1063f539a46.txt",
         ("vit_bdh",), "jinotter3/vision-bdh (a fork of takzen/vision-bdh), OPTIMIZATION_GUIDE.md"),
)}


@dataclass(frozen=True)
class Claim:
    seed: str
    claim: str                 # the claim, in our words
    claimed: str               # the figure as the seed states it
    bound: float | None        # gain: its lower bound (speed ratio, memory fraction); cost: its upper
                               # bound (time ratio); first_failing_n: the length the seed ran at
    compares: str              # the change, as measured here
    measure: object            # Ladder | Technique | Records | Value | NotHere
    premise: str | None = None  # why the claimed change did not run or does not do what it says
    note: str = ""
    also: tuple = ()           # (label, lookup) pairs whose numbers go into the note


# The BK-Core grid point the seed's kernel claims are measured at.
_BK_POINT = {"B": 8192, "N": 2048}



def _ablation(toggle: str, workloads: tuple[str, ...], mode: str = "in_process") -> Value:
    """The speed-up a toggle gives in notebook 19's interleaved A/B windows (time without / time
    with), in one process or with every window in a fresh one (``mode``); its record carries the
    bootstrap interval the verdict is judged on."""
    return Value("speedup", "speed", fields={"toggle": toggle, "mode": mode}, workloads=workloads)


_AB = "interleaved A/B windows in one process (notebook 19)"

_ACC_PREMISE = ("accumulation runs the same samples as more, smaller passes: it adds launches and removes no work; "
                "a gain from it is a gain from something else")

CLAIMS: tuple[Claim, ...] = (
    # --- 000 ResNet-BK ---------------------------------------------------------------------------------
    Claim("000", "Fused CUDA kernels for the theta/phi recursions beat the PyTorch implementation", "5x", 5.0,
          "BK-Core forward+backward, B=8192, N=2048: fastest custom kernel vs the Python loop over N",
          Records("bk_core", "forward+backward_ms", "backend", "torch_loop", ("triton", "cuda"), _BK_POINT),
          note="the lab's kernels: the seed's ran one thread per block and wrote back only the first 256 entries",
          also=(("vs the vectorised torch scan", Records("bk_core", "forward+backward_ms", "backend", "torch",
                                                          ("triton", "cuda"), _BK_POINT)),)),
    Claim("000", "Custom kernels speed up training", "3x", 3.0,
          "ResNet-BK training step: BK-Core through the fastest custom kernel (12) vs the vectorised torch "
          "scan, the step before (09); both compiled and replayed as CUDA graphs",
          Ladder("prev", "12_bk_core")),
    Claim("000", "BK kernel compared with cuSPARSE's tridiagonal solver", "1.5x faster than cuSPARSE", 1.5,
          "one float32 gtsv2StridedBatch solve (1 right-hand side) vs the fastest custom forward, B=8192, N=2048",
          Records("bk_core", "forward_ms", "backend", "cuSPARSE gtsv2StridedBatch (1 RHS)", ("triton", "cuda"),
                  _BK_POINT, before_metric="solve_ms"),
          premise="the seed's cuSPARSE time was 1.5x its own, an estimate never run; gtsv2 solves T x = r, and "
                  "diag(T^-1) would need N right-hand sides, so one solve is a lower bound, not a competitor"),
    Claim("000", "Mixed-precision BK-Core ('FP16' recursions, 'FP32' division) keeps max error < 1e-4 at 2x",
          "2x, error < 1e-4 at N = 128", 128,
          "the seed's theta/phi recursion in complex64 against a float64 dense inverse",
          Value("theta_phi_first_failing_N", "first_failing_n", fields={"dtype": "complex64"}, workloads=("bk_core",)),
          premise="'FP16' was complex64 and 'FP32' complex128; the determinant recursion overflows "
                  "(|theta_n| grows ~2.07^n), so its error check cannot pass at the seed's own length",
          also=(("complex128",
                 Value("theta_phi_first_failing_N", "first_failing_n", fields={"dtype": "complex128"},
                       workloads=("bk_core",))),)),
    Claim("000", "AMP training is faster than fp32", "2x", 2.0,
          "bf16 autocast (03) vs fp32 eager with TF32 off (01)", Ladder("01_baseline_fp32", "03_bf16_autocast")),
    Claim("000", "AMP training halves memory", "-50% memory", 0.5,
          "peak memory, bf16 autocast (03) vs fp32 (01)", Ladder("01_baseline_fp32", "03_bf16_autocast", "memory_cut")),
    Claim("000", "Tensor-core padding (dimensions to multiples of 8)", "1.5x", 1.5,
          "vocabulary padded to a multiple of 64 (07) vs unpadded, compiled", Ladder("prev", "07_nice_shapes"),
          also=(("eager, vocabulary 50257 -> 50304",
                 Records("gpt", "ms_per_step", "vocab_multiple", 1, (64,), {"variant": "eager"})),)),
    Claim("000", "DDP training scales over 2-4 GPUs", "scaling efficiency tested", None,
          "DDP over torchrun (notebook 15), weak scaling (batch per GPU fixed): throughput on 2-4 GPUs vs DDP on one",
          Records("gpt", "tokens_per_s", "world_size", 1, (2, 4), {"strategy": "ddp", "scaling": "weak"},
                  lower_is_better=False),
          note="from notebook 15's DDP runs on one and on 2-4 GPUs (a run with one GPU has no ratio); GPT-2 small, "
               "the lab's multi-GPU workload; efficiency = the ratio / the GPUs",
          also=(("strong scaling (global batch fixed)",
                 Records("gpt", "tokens_per_s", "world_size", 1, (2, 4), {"strategy": "ddp", "scaling": "strong"},
                         lower_is_better=False)),)),
    Claim("000", "Gradient accumulation fits a larger effective batch", "no OOM at a larger batch", None,
          "peak memory: the same batch as 4 exact micro-batches vs one pass (bf16)",
          Technique("bf16", "bf16 + accumulation x4", "memory_cut", ("resnet_bk", "gpt")),
          also=(("speed", Technique("bf16", "bf16 + accumulation x4", "speed", ("resnet_bk", "gpt"))),)),
    Claim("000", "Optimizer states offloaded to the CPU save memory", "variable", None,
          "peak memory: AdamW moments in pinned host memory vs on the GPU (bf16)",
          Technique("bf16", "bf16 + offload", "memory_cut", ("resnet_bk", "gpt")),
          also=(("speed", Technique("bf16", "bf16 + offload", "speed", ("resnet_bk", "gpt"))),)),
    Claim("000", "Batch halved on OOM, training goes on", "training completes without OOM", None,
          "a batch twice the largest that fits, through hwlib's OOM-resilient step",
          Value("oom_events", "survived", fields={"technique": "resilient"}, workloads=("resnet_bk", "gpt")),
          note="hwlib keeps the batch and splits it into micro-batches; halving the batch, as the seed did, "
               "changes the training"),
    Claim("000", "Hardware co-design, combined", "10x wall-clock", 10.0,
          "the whole ResNet-BK ladder: fp32 eager (01) to its last step",
          Ladder("01_baseline_fp32", "last")),
    Claim("000", "Hardware utilization dashboard", "-", None,
          "the live monitor's cost (notebook 98): gpt step 05 time without it over with it; 1.00x is no cost",
          Records("gpt", "ms_per_step", "monitor", "off", ("live",), {"step": "05_fused_optimizer"}),
          note="a tool, not a speed-up: hwlib.dashboard's monitor (NVML telemetry, step time and loss, live) "
               "measured for what it costs a step; within noise is no cost this run can resolve"),

    # --- 001 polychromic trainer -----------------------------------------------------------------------
    Claim("001", "Generating N=3 replies one by one is most of the overhead", "~70% of overhead", 0.7,
          "share of the bonus's overhead (cycle time minus training) in generation, the seed's way (14a)",
          Value("share_generation_of_overhead", "share", step="14a_seed_way", workloads=("polychromic",)),
          note="measured by the generation workload (notebook 14): one generate call per reply, train mode, "
               "checkpointing on, so no KV cache"),
    Claim("001", "Diversity scoring is the next largest cost", "~20% of overhead", 0.2,
          "share of the overhead in the text round trip, encoding and score, the seed's way (14a)",
          Value("share_diversity_of_overhead", "share", step="14a_seed_way", workloads=("polychromic",)),
          note="measured by the generation workload (notebook 14); the score itself has a closed form, one pass "
               "over [P, N, 384]"),
    Claim("001", "FlashAttention-2 (tier 1)", "1.5-2x", 1.5,
          "the trainer's 5-step cycle (generation included), eager attention vs SDPA, batched rung (14c)",
          Records("polychromic", "ms_per_cycle", "attn", "eager", ("sdpa",), {"step": "14c_batched"}),
          note="measured by the generation workload (notebook 14); flash-attn is not installed: SDPA, Hugging Face's "
               "default, runs flash kernels on an H100, so the seed's baseline already had them",
          also=(("training-step fused attention (04)", Ladder("prev", "04_sdpa_attention", workloads=("gpt",))),)),
    Claim("001", "Triton pairwise-distance kernel (tier 2)", "2-3x", 2.0,
          "diversity score at P = 4, N = 3: Triton kernel vs the seed's per-prompt matrix and .item()",
          Records("polychromic", "score_ms", "impl", "seed_loop", ("triton",), {"N": 3, "P": 4}),
          note="measured by the generation workload's score study (notebook 14); the kernel computes the closed "
               "form, a few kFLOP per prompt at N = 3",
          also=(("vs the closed form in torch", Records("polychromic", "score_ms", "impl", "closed", ("triton",),
                                                        {"N": 3, "P": 4})),)),
    Claim("001", "Raw CUDA kernels (tier 3): training 12 h -> 3-4 h", "3-4x", 3.0,
          "the trainer's 5-step cycle: the seed's way (14a) vs the static-cache rungs (14d), no custom kernel",
          Records("polychromic", "ms_per_cycle", "step", "14a_seed_way", ("14d_static_hf", "14d_static_own")),
          note="measured by the generation workload (notebook 14): the gain comes from the KV cache, batching and "
               "CUDA graphs, with no custom CUDA kernel"),

    # --- 002 hardware optimization guide ---------------------------------------------------------------
    Claim("002", "bf16 mixed precision trains faster", "2x", 2.0,
          "bf16 autocast (03) vs fp32 with TF32 on (02): the guide turns TF32 on by default",
          Ladder("02_tf32", "03_bf16_autocast"),
          also=(("vs IEEE fp32 (01)", Ladder("01_baseline_fp32", "03_bf16_autocast")),)),
    Claim("002", "bf16 mixed precision halves memory", "-50% memory", 0.5,
          "peak memory, bf16 autocast (03) vs fp32 (02)",
          Ladder("02_tf32", "03_bf16_autocast", "memory_cut")),
    Claim("002", "Gradient checkpointing costs time", "~30% slower", 1.30,
          "step time, every block checkpointed vs none (bf16)",
          Technique("bf16", "bf16 + checkpointing(blocks)", "slowdown"),
          also=(("blocks and output head", Technique("bf16", "bf16 + checkpointing(blocks, head)", "slowdown")),)),
    Claim("002", "Gradient checkpointing halves memory", "-50% memory", 0.5,
          "peak memory, every block checkpointed vs none (bf16)",
          Technique("bf16", "bf16 + checkpointing(blocks)", "memory_cut"),
          also=(("blocks and output head", Technique("bf16", "bf16 + checkpointing(blocks, head)", "memory_cut")),)),
    Claim("002", "TF32 speeds up fp32 matrix multiplications", "up to 8x", 8.0,
          "measured matmul ceiling, TF32 vs IEEE fp32 (notebook 00)",
          Records(None, "matmul_tflops", "dtype", "fp32", ("tf32",), lower_is_better=False),
          also=(("whole training step (02 vs 01)", Ladder("01_baseline_fp32", "02_tf32")),)),
    Claim("002", "torch.compile", "10-30%", 1.10, "torch.compile (06) vs eager (05)",
          Ladder("prev", "06_torch_compile")),
    Claim("002", "DataLoader: one worker per 3 GB of VRAM", "sizing rule", None,
          f"loader workers by the rule vs one per spare core (at most 8), at the best step: {_AB}",
          _ablation("workers_per_3gb", ("encoder_nli", "vit_bdh")),
          note="a sizing rule with no speed figure: it holds if its worker count is faster than the lab's default"),
    Claim("002", "Its DataLoader benchmark measures the loader", "ms per batch", None,
          "share of step time spent waiting for data (notebook 08)",
          Value("data_wait_share", "share", step="08_dataloader", workloads=("encoder_nli", "vit_bdh")),
          premise="its timer started after the batch was loaded and timed unsynchronized .to(device) calls: "
                  "the loader was never inside the timed region"),
    Claim("002", "All recommended settings together", "2-3x", 2.0, "the lab's ladder: fp32 eager (01) to its last step",
          Ladder("01_baseline_fp32", "last")),

    # --- 003 DeBERTa NLI status report ------------------------------------------------------------------
    Claim("003", "bf16 autocast vs fp32", "2x", 2.0, "bf16 autocast (03) vs IEEE fp32 (01)",
          Ladder("01_baseline_fp32", "03_bf16_autocast")),
    Claim("003", "bf16 autocast halves memory", "-50% memory", 0.5, "peak memory, 03 vs 01",
          Ladder("01_baseline_fp32", "03_bf16_autocast", "memory_cut")),
    Claim("003", "TF32 on top of bf16", "2.5x", 2.5, "measured instead: TF32 alone over IEEE fp32 (02 vs 01)",
          Ladder("01_baseline_fp32", "02_tf32"),
          premise="under bf16 autocast the matmuls run in bf16, not fp32: TF32 has nothing left to speed up"),
    Claim("003", "Fused AdamW", "1.05-1.10x", 1.05, "AdamW(fused=True), set_to_none (05) vs the step before",
          Ladder("prev", "05_fused_optimizer"),
          also=(("fused vs foreach alone, at the best step", _ablation("fused_adamw", ("encoder_nli", "gpt"))),)),
    Claim("003", "cuDNN benchmark mode", "1.05-1.15x", 1.05,
          f"torch.backends.cudnn.benchmark on vs off at the best step: {_AB}",
          _ablation("cudnn_benchmark", ("encoder_nli", "gpt")),
          note="it tunes convolution algorithms; the encoder (and GPT-2, its stand-in) has no convolution"),
    Claim("003", "Persistent workers", "1.02-1.05x", 1.02,
          f"persistent workers vs workers started again every epoch, the rest of the tuned loader kept: {_AB}",
          _ablation("persistent_workers", ("encoder_nli", "vit_bdh")),
          note="each timed window spans a whole epoch: a loader without persistent workers starts them again there",
          also=(("the whole tuned loader (08) vs the step before", Ladder("prev", "08_dataloader")),)),
    Claim("003", "torch.compile if enabled", "10-20%", 1.10, "torch.compile (06) vs eager (05)",
          Ladder("prev", "06_torch_compile")),
    Claim("003", "Gradient checkpointing saves activation memory", "40-60% memory", 0.4,
          "peak memory (activations and states), every block checkpointed vs none (bf16)",
          Technique("bf16", "bf16 + checkpointing(blocks)", "memory_cut"),
          note="the cut is of the whole peak, so it understates the cut in activations alone"),
    Claim("003", "Gradient checkpointing costs time", "10-30% slower", 1.30,
          "step time, every block checkpointed vs none",
          Technique("bf16", "bf16 + checkpointing(blocks)", "slowdown")),
    Claim("003", "Automatic batch-size finder (90% of the largest batch)", "batch 23 of 26", None,
          "hwlib's finder: predicted vs measured peak over 50 steps",
          Value("finder_peak_error", "relative", fields={"technique": "bf16"}, workloads=("encoder_nli", "gpt")),
          premise="it ran forward and backward without an optimizer step, so the optimizer's memory was never counted"),
    Claim("003", "Dynamic gradient accumulation reaches the target batch", "effective batch 128", None,
          "accumulation steps from a physical batch of 23", NotHere("a formula, not a measurement"),
          premise=f"floor division: 128 // 23 = {128 // 23} steps, {128 // 23 * 23} samples, not 128"),
    Claim("003", "OOM-resilient training", "graceful on OOM", None,
          "a batch twice the largest that fits, through hwlib's OOM-resilient step",
          Value("oom_events", "survived", fields={"technique": "resilient"}, workloads=("encoder_nli", "gpt")),
          note="the seed pruned the trial; hwlib keeps training with smaller micro-batches, same batch"),
    Claim("003", "Sequence packing or length bucketing", "higher throughput", None,
          "packed sequences, padding removed (11) vs padded to 512",
          Ladder("prev", "11_sequence_packing", workloads=("encoder_nli",))),
    Claim("003", "Combined optimizations vs fp32", "5-6x", 5.0,
          "the seed's set (bf16, TF32, SDPA, fused AdamW; compile off): 01 to 05",
          Ladder("01_baseline_fp32", "05_fused_optimizer")),

    # --- 004 Vision-BDH ----------------------------------------------------------------------------------
    Claim("004", "Cached RoPE tables", "1.10-1.15x", 1.10,
          f"RoPE cos/sin made once at build time vs computed in every layer application: {_AB}",
          _ablation("rope_cached", ("vit_bdh",))),
    Claim("004", "Flash attention through SDPA", "2.5x", 2.5,
          "measured instead: SDPA on the softmax form (04) vs manual softmax attention",
          Ladder("prev", "04_sdpa_attention"),
          premise="its optimized run turned softmax attention off, so the SDPA path never ran and the model "
                  "changed; flash cannot take Q/K of width 1024 (> 256)"),
    Claim("004", "Per-head nn.Linear weight layout", "1.05-1.10x", 1.05,
          f"per-head weights as one batched matmul over the head axis vs broadcasting matmuls: {_AB}",
          _ablation("head_layout", ("vit_bdh",)),
          note="the same parameters either way: the layout changes how the matmuls run, not the math"),
    Claim("004", "Gradient accumulation (64 -> 128 x 2)", "1.3x", 1.3,
          "measured instead: the same batch as 4 exact micro-batches vs one pass (bf16)",
          Technique("bf16", "bf16 + accumulation x4", "speed", ("vit_bdh", "gpt")),
          premise=_ACC_PREMISE + "; its 1.3x came with a larger physical batch (64 -> 128)"),
    Claim("004", "torch.compile max-autotune instead of aot_eager", "1.2x", 1.2,
          "torch.compile, inductor default mode (06) vs eager (05)", Ladder("prev", "06_torch_compile"),
          note="the seed's baseline compiled with aot_eager (no code generation), which inflates its gain"),
    Claim("004", "Fused AdamW", "1.1x", 1.1, "AdamW(fused=True), set_to_none (05) vs the step before",
          Ladder("prev", "05_fused_optimizer"),
          also=(("fused vs foreach alone, at the best step", _ablation("fused_adamw", ("vit_bdh",))),)),
    Claim("004", "More DataLoader workers and prefetch", "1.2x", 1.2,
          "tuned loader (08) vs loading in the training process", Ladder("prev", "08_dataloader"),
          also=(("data-wait share before", Value("data_wait_share", "share", step="07_nice_shapes")),
                ("after", Value("data_wait_share", "share", step="08_dataloader")))),
    Claim("004", "channels_last memory format", "1.1x", 1.1, "channels_last patch convolution (10) vs NCHW",
          Ladder("prev", "10_channels_last")),
    Claim("004", "non_blocking host-to-device copies", "1.1x", 1.1,
          f"non_blocking copies vs blocking ones, the rest of the tuned loader kept: {_AB}",
          _ablation("non_blocking", ("vit_bdh",))),
    Claim("004", "cudnn.benchmark without determinism", "1.10-1.20x", 1.10,
          "torch.backends.cudnn.benchmark on vs off, every window in a fresh process, eager step 05 (notebook 19): "
          "the flag picks a convolution's algorithm at its first call in a process, so switched inside one "
          "process after that, or under a compiled graph, it changes nothing",
          _ablation("cudnn_benchmark", ("vit_bdh",), mode="processes")),
    Claim("004", "zero_grad(set_to_none=True)", "1.02-1.05x", 1.02,
          f"zero_grad(set_to_none=True) vs zeroing the gradients in place, compiled without CUDA graphs: {_AB}",
          _ablation("zero_grad_set_to_none", ("vit_bdh",)),
          note="under CUDA graphs the gradients live in the graphs' memory pool and must be set to None"),
    Claim("004", "All optimizations together", "2.5-3x", 2.5, "the vit_bdh ladder: fp32 eager (01) to its last step",
          Ladder("01_baseline_fp32", "last"),
          note="the seed's baseline already compiled (aot_eager) and used 2 workers; the lab's starts at fp32 eager"),
)
