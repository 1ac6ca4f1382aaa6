"""The seed systems' claims beside what this lab measured for the same change.

``CLAIMS`` holds one entry per claim of the five seed write-ups (the checklists of
``notes/seed-systems.md``): the claim in our words (the write-ups are not quoted), the figure it
states, what it compares, and how to read the same change off a run's results:

- ``Ladder``: two steps of a workload's cumulative ladder (throughput ratio, or the cut in peak
  memory), ``"prev"`` meaning the nearest earlier step that was measured, ``"last"`` the last one;
- ``Technique``: two techniques of the memory study (notebook 13), same base step and batch;
- ``Records``: two records of a study (ceilings of notebook 00, kernel timings of notebook 12);
- ``Value``: one record (the N where the seed's recursion breaks, OOM events survived, data wait);
- ``NotHere``: what the lab cannot measure yet, and why.

``evaluate(run)`` derives every number from the run's records and gives each claim a verdict:

=================  ===========================================================================
``holds``          the measured gain reaches the claim's lower bound (or the cost stays within
                   the claimed cost)
``partly``         a real gain (beyond the p20-p80 spread of the two timings), below the claim
``fails``          no gain, or a loss, or a cost above the one claimed
``premise fails``  the claimed change did not run, or does not do what the claim says; the
                   measured column then shows what the change does when it does run
``not measured``   the run lacks the step, or the lab lacks the hardware or workload; the note
                   says which
=================  ===========================================================================

A run made on a CPU (the smoke profile) yields no verdict on a GPU claim: its ratios are shown,
its verdicts are ``not measured``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import query
from ..paths import REPO_ROOT, outputs_root
from ..query import ladder_rows

VERDICTS = ("holds", "partly", "fails", "premise fails", "not measured")


@dataclass(frozen=True)
class Seed:
    id: str
    title: str
    file: str
    workloads: tuple[str, ...]   # the lab workloads closest to the seed, nearest first


SEEDS: dict[str, Seed] = {s.id: s for s in (
    Seed("000", "ResNet-BK: BK-Core kernels, mixed precision, AMP, DDP, memory tools", "000_4030881d20da7627.txt",
         ("resnet_bk",)),
    Seed("001", "Polychromic trainer: diversity kernel, batched generation, Triton and CUDA tiers",
         "001_a0ac3651fedc567c.txt", ("gpt",)),
    Seed("002", "Hardware optimization guide: per-GPU settings, precision, checkpointing, loaders",
         "002_8cd1eeae9de685c3.txt", ("encoder_nli", "gpt")),
    Seed("003", "DeBERTa NLI trainer: status report of enabled and missing optimizations", "003_777fd2229bec0f35.txt",
         ("encoder_nli", "gpt")),
    Seed("004", "Vision-BDH: model and training-loop optimizations, original vs optimized", "004_e657c1063f539a46.txt",
         ("vit_bdh",)),
)}


# --- how a claim is measured ------------------------------------------------------------------------

@dataclass(frozen=True)
class Ladder:
    """``after`` against ``before`` on a workload's ladder. ``quantity``: ``speed`` (throughput
    ratio) or ``memory_cut`` (1 - peak after / peak before)."""
    before: str
    after: str
    quantity: str = "speed"
    workloads: tuple[str, ...] | None = None   # None: the seed's


@dataclass(frozen=True)
class Technique:
    """Two techniques of the memory study (notebook 13) on the same base step and batch.
    ``quantity``: ``speed`` (time before / after), ``slowdown`` (time after / before) or
    ``memory_cut`` (1 - peak allocated after / before)."""
    before: str
    after: str
    quantity: str = "speed"
    workloads: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Records:
    """Two records of a study, by (step, metric) under one workload name. ``after_steps`` may name
    several candidates: the best of them is taken. ``lower_is_better`` for times."""
    workload: str | None
    before: tuple[str | None, str]
    after_steps: tuple[str | None, ...]
    after_metric: str
    lower_is_better: bool = True


@dataclass(frozen=True)
class Value:
    """One record's value. ``quantity``: ``first_failing_n`` (premise check against the seed's N),
    ``survived`` (events a run came through), ``share`` (a fraction), ``relative`` (an error)."""
    step: str | None
    metric: str
    quantity: str
    workloads: tuple[str | None, ...] | None = None


@dataclass(frozen=True)
class NotHere:
    reason: str


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


_ACC_PREMISE = ("accumulation runs the same samples as more, smaller passes: it adds launches and removes no work; "
                "a gain from it is a gain from something else")

CLAIMS: tuple[Claim, ...] = (
    # --- 000 ResNet-BK ---------------------------------------------------------------------------------
    Claim("000", "Fused CUDA kernels for the theta/phi recursions beat the PyTorch implementation", "5x", 5.0,
          "BK-Core forward+backward, B=8192, N=2048: fastest custom kernel vs the Python loop over N",
          Records("bk_core", ("torch_loop", "forward+backward_ms_B8192_N2048"), ("triton", "cuda"),
                  "forward+backward_ms_B8192_N2048"),
          note="the lab's kernels: the seed's ran one thread per block and wrote back only the first 256 entries",
          also=(("vs the vectorised torch scan", Records("bk_core", ("torch", "forward+backward_ms_B8192_N2048"),
                                                          ("triton", "cuda"), "forward+backward_ms_B8192_N2048")),)),
    Claim("000", "Custom kernels speed up training", "3x", 3.0,
          "ResNet-BK training step: BK-Core through the fastest custom kernel (12) vs torch (07)",
          Ladder("07_nice_shapes", "12_bk_core")),
    Claim("000", "BK kernel compared with cuSPARSE's tridiagonal solver", "1.5x faster than cuSPARSE", 1.5,
          "one float32 gtsv2StridedBatch solve (1 right-hand side) vs the fastest custom forward, B=8192, N=2048",
          Records("bk_core", ("cuSPARSE gtsv2StridedBatch (1 RHS)", "solve_ms_B8192_N2048"), ("triton", "cuda"),
                  "forward_ms_B8192_N2048"),
          premise="the seed's cuSPARSE time was 1.5x its own, an estimate never run; gtsv2 solves T x = r, and "
                  "diag(T^-1) would need N right-hand sides, so one solve is a lower bound, not a competitor"),
    Claim("000", "Mixed-precision BK-Core ('FP16' recursions, 'FP32' division) keeps max error < 1e-4 at 2x",
          "2x, error < 1e-4 at N = 128", 128,
          "the seed's theta/phi recursion in complex64 against a float64 dense inverse",
          Value(None, "theta_phi_first_failing_N_complex64", "first_failing_n", ("bk_core",)),
          premise="'FP16' was complex64 and 'FP32' complex128; the determinant recursion overflows "
                  "(|theta_n| grows ~2.07^n), so its error check cannot pass at the seed's own length",
          also=(("complex128",
                 Value(None, "theta_phi_first_failing_N_complex128", "first_failing_n", ("bk_core",))),)),
    Claim("000", "AMP training is faster than fp32", "2x", 2.0,
          "bf16 autocast (03) vs fp32 eager with TF32 off (01)", Ladder("01_baseline_fp32", "03_bf16_autocast")),
    Claim("000", "AMP training halves memory", "-50% memory", 0.5,
          "peak memory, bf16 autocast (03) vs fp32 (01)", Ladder("01_baseline_fp32", "03_bf16_autocast", "memory_cut")),
    Claim("000", "Tensor-core padding (dimensions to multiples of 8)", "1.5x", 1.5,
          "vocabulary padded to a multiple of 64 (07) vs unpadded, compiled", Ladder("prev", "07_nice_shapes"),
          also=(("eager, vocabulary 50257 -> 50304",
                 Records("gpt", (None, "eager_ms_per_step_vocab_multiple_1"), (None,),
                         "eager_ms_per_step_vocab_multiple_64")),)),
    Claim("000", "DDP training scales over 2-4 GPUs", "scaling efficiency tested", None,
          "DDP over torchrun, throughput per GPU",
          NotHere("needs 2-4 GPUs: the multi-GPU notebook (15) is not part of this run")),
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
          Value("memory: resilient", "oom_events", "survived", ("resnet_bk", "gpt")),
          note="hwlib keeps the batch and splits it into micro-batches; halving the batch, as the seed did, "
               "changes the training"),
    Claim("000", "Hardware co-design, combined", "10x wall-clock", 10.0,
          "the whole ResNet-BK ladder: fp32 eager (01) to its last step",
          Ladder("01_baseline_fp32", "last")),
    Claim("000", "Hardware utilization dashboard", "-", None, "-",
          NotHere("a tool, not a performance figure")),

    # --- 001 polychromic trainer -----------------------------------------------------------------------
    Claim("001", "Generating N=3 replies one by one is most of the overhead", "~70% of overhead", None,
          "share of step time in generation", NotHere(
              "needs a generation workload (batched generation with the KV cache vs one generate call per reply "
              "in train mode), which hwlib does not have yet")),
    Claim("001", "Diversity scoring is the next largest cost", "~20% of overhead", None,
          "share of step time in the diversity score", NotHere(
              "needs the generation workload; the score has a closed form, one pass over [P, N, 384]")),
    Claim("001", "FlashAttention-2 (tier 1)", "1.5-2x", 1.5, "the whole trainer, generation included",
          NotHere("the figure is for a trainer whose time is mostly generation: needs the generation workload"),
          also=(("training-step fused attention (04)", Ladder("prev", "04_sdpa_attention", workloads=("gpt",))),)),
    Claim("001", "Triton pairwise-distance kernel (tier 2)", "2-3x", 2.0, "diversity score, kernel vs torch",
          NotHere("needs the diversity study of the generation workload; at N = 3..8 replies the closed form "
                  "leaves too little work for a kernel to pay")),
    Claim("001", "Raw CUDA kernels (tier 3): training 12 h -> 3-4 h", "3-4x", 3.0, "the whole trainer",
          NotHere("a wall-clock figure of the whole trainer: needs the generation workload")),

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
          Records(None, (None, "matmul_tflops_fp32"), (None,), "matmul_tflops_tf32", lower_is_better=False),
          also=(("whole training step (02 vs 01)", Ladder("01_baseline_fp32", "02_tf32")),)),
    Claim("002", "torch.compile", "10-30%", 1.10, "torch.compile (06) vs eager (05)",
          Ladder("prev", "06_torch_compile")),
    Claim("002", "DataLoader: one worker per 3 GB of VRAM", "sizing rule", None, "-",
          NotHere("a sizing rule with no speed figure; notebook 08 measures the data-wait share a loader leaves")),
    Claim("002", "Its DataLoader benchmark measures the loader", "ms per batch", None,
          "share of step time spent waiting for data (notebook 08)",
          Value("08_dataloader", "data_wait_share", "share", ("encoder_nli", "vit_bdh")),
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
          Ladder("prev", "05_fused_optimizer")),
    Claim("003", "cuDNN benchmark mode", "1.05-1.15x", 1.05, "-",
          NotHere("no step toggles cudnn.benchmark; it tunes convolution algorithms, and the encoder has none")),
    Claim("003", "Persistent workers", "1.02-1.05x", 1.02,
          "tuned loader (08: workers, pinned memory, persistent workers, prefetch, non_blocking) vs the step before",
          Ladder("prev", "08_dataloader", workloads=("encoder_nli",)),
          note="step 08 changes the loader settings together"),
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
          Value("memory: bf16", "finder_peak_error", "relative", ("encoder_nli", "gpt")),
          premise="it ran forward and backward without an optimizer step, so the optimizer's memory was never counted"),
    Claim("003", "Dynamic gradient accumulation reaches the target batch", "effective batch 128", None,
          "accumulation steps from a physical batch of 23", NotHere("a formula, not a measurement"),
          premise=f"floor division: 128 // 23 = {128 // 23} steps, {128 // 23 * 23} samples, not 128"),
    Claim("003", "OOM-resilient training", "graceful on OOM", None,
          "a batch twice the largest that fits, through hwlib's OOM-resilient step",
          Value("memory: resilient", "oom_events", "survived", ("encoder_nli", "gpt")),
          note="the seed pruned the trial; hwlib keeps training with smaller micro-batches, same batch"),
    Claim("003", "Sequence packing or length bucketing", "higher throughput", None,
          "packed sequences, padding removed (11) vs padded to 512",
          Ladder("prev", "11_sequence_packing", workloads=("encoder_nli",))),
    Claim("003", "Combined optimizations vs fp32", "5-6x", 5.0,
          "the seed's set (bf16, TF32, SDPA, fused AdamW; compile off): 01 to 05",
          Ladder("01_baseline_fp32", "05_fused_optimizer")),

    # --- 004 Vision-BDH ----------------------------------------------------------------------------------
    Claim("004", "Cached RoPE tables", "1.10-1.15x", 1.10, "-", NotHere("no step isolates RoPE caching")),
    Claim("004", "Flash attention through SDPA", "2.5x", 2.5,
          "measured instead: SDPA on the softmax form (04) vs manual softmax attention",
          Ladder("prev", "04_sdpa_attention"),
          premise="its optimized run turned softmax attention off, so the SDPA path never ran and the model "
                  "changed; flash cannot take Q/K of width 1024 (> 256)"),
    Claim("004", "Per-head nn.Linear weight layout", "1.05-1.10x", 1.05, "-",
          NotHere("a layout change inside the seed's model with no step of its own here")),
    Claim("004", "Gradient accumulation (64 -> 128 x 2)", "1.3x", 1.3,
          "measured instead: the same batch as 4 exact micro-batches vs one pass (bf16)",
          Technique("bf16", "bf16 + accumulation x4", "speed", ("vit_bdh", "gpt")),
          premise=_ACC_PREMISE + "; its 1.3x came with a larger physical batch (64 -> 128)"),
    Claim("004", "torch.compile max-autotune instead of aot_eager", "1.2x", 1.2,
          "torch.compile, inductor default mode (06) vs eager (05)", Ladder("prev", "06_torch_compile"),
          note="the seed's baseline compiled with aot_eager (no code generation), which inflates its gain"),
    Claim("004", "Fused AdamW", "1.1x", 1.1, "AdamW(fused=True), set_to_none (05) vs the step before",
          Ladder("prev", "05_fused_optimizer")),
    Claim("004", "More DataLoader workers and prefetch", "1.2x", 1.2,
          "tuned loader (08) vs loading in the training process", Ladder("prev", "08_dataloader"),
          also=(("data-wait share before", Value("07_nice_shapes", "data_wait_share", "share")),
                ("after", Value("08_dataloader", "data_wait_share", "share")))),
    Claim("004", "channels_last memory format", "1.1x", 1.1, "channels_last patch convolution (10) vs NCHW",
          Ladder("prev", "10_channels_last")),
    Claim("004", "non_blocking host-to-device copies", "1.1x", 1.1, "-",
          NotHere("step 08 changes non_blocking together with workers and pinned memory: see the DataLoader row")),
    Claim("004", "cudnn.benchmark without determinism", "1.10-1.20x", 1.10, "-",
          NotHere("no step toggles cudnn.benchmark")),
    Claim("004", "zero_grad(set_to_none=True)", "1.02-1.05x", 1.02, "-",
          NotHere("part of step 05, not measured apart: see the fused AdamW row")),
    Claim("004", "All optimizations together", "2.5-3x", 2.5, "the vit_bdh ladder: fp32 eager (01) to its last step",
          Ladder("01_baseline_fp32", "last"),
          note="the seed's baseline already compiled (aot_eager) and used 2 workers; the lab's starts at fp32 eager"),
)


# --- reading a run ----------------------------------------------------------------------------------

@dataclass
class _Measured:
    value: float | None = None
    workload: str | None = None
    gpu: str | None = None
    kind: str | None = None          # device kind of the records: "cuda", "cpu"
    frm: str | None = None
    to: str | None = None
    noise: float = 0.0               # the wider relative p20-p80 half-spread of the two timings
    reason: str | None = None        # why there is no value
    notes: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _spread(ms, p20, p80) -> float:
    ms, p20, p80 = _num(ms), _num(p20), _num(p80)
    if not ms or p20 is None or p80 is None:
        return 0.0
    return max(0.0, (p80 - p20) / ms / 2)


class _Run:
    def __init__(self, records: list[dict]):
        self.records = records
        self.index: dict = {}
        for r in sorted(records, key=lambda r: r.get("time") or ""):
            self.index[(r.get("workload"), r.get("step"), r.get("metric"))] = r
        names = [(r.get("device") or {}).get("name") for r in records if (r.get("device") or {}).get("name")]
        self.gpu = max(set(names), key=names.count) if names else None
        kinds = [(r.get("device") or {}).get("kind") for r in records if (r.get("device") or {}).get("kind")]
        self.kind = max(set(kinds), key=kinds.count) if kinds else None
        self._ladders: dict = {}

    def ladder(self, workload: str) -> list[dict]:
        if workload not in self._ladders:
            self._ladders[workload] = ladder_rows(self.records, workload)
        return self._ladders[workload]

    def device_of(self, rec: dict | None) -> tuple[str | None, str | None]:
        d = (rec or {}).get("device") or {}
        return d.get("name") or self.gpu, d.get("kind") or self.kind

    def get(self, workload, step, metric) -> dict | None:
        return self.index.get((workload, step, metric))


def _ladder_pair(run: _Run, w: str, lk: Ladder):
    rows = run.ladder(w)
    if not rows:
        return f"{w} is not in this run"
    by = {r["step"]: r for r in rows}
    if lk.after == "last":
        ok = [r for r in rows if r["throughput"]]
        if not ok:
            return f"no step of {w} was measured"
        after = ok[-1]
    else:
        after = by.get(lk.after)
        if after is None:
            return f"{lk.after} of {w} is not in this run"
        if after["status"] != "ok" or not after["throughput"]:
            return f"{lk.after} is {after['status']} for {w}" + (f": {after['reason']}" if after.get("reason") else "")
    if lk.before == "prev":
        earlier = [r for r in rows[: rows.index(after)] if r["throughput"]]
        if not earlier:
            return f"no step of {w} before {after['step']} was measured"
        before = earlier[-1]
    else:
        before = by.get(lk.before)
        if before is None or not before["throughput"]:
            return f"{lk.before} of {w} is not measured in this run"
    if before is after:
        return f"{w} has a single measured step"
    return before, after


def _measure_ladder(run: _Run, lk: Ladder, prefs: tuple) -> _Measured:
    first_reason = None
    for i, w in enumerate(prefs):
        pair = _ladder_pair(run, w, lk)
        if isinstance(pair, str):
            first_reason = first_reason or pair
            continue
        before, after = pair
        m = _Measured(workload=w, frm=before["step"], to=after["step"])
        m.gpu = after.get("device") or run.gpu
        rec = run.get(w, after["step"], "ms_per_step")
        m.kind = run.device_of(rec)[1]
        if lk.quantity == "speed":
            m.value = after["throughput"] / before["throughput"]
            m.noise = max(_spread(before["ms_per_step"], before["ms_p20"], before["ms_p80"]),
                          _spread(after["ms_per_step"], after["ms_p20"], after["ms_p80"]))
        elif lk.quantity == "memory_cut":
            if not before["peak_mem_gib"] or after["peak_mem_gib"] is None:
                first_reason = first_reason or f"no peak memory recorded for {w}"
                continue
            m.value = 1.0 - after["peak_mem_gib"] / before["peak_mem_gib"]
        else:
            raise ValueError(f"Ladder quantity {lk.quantity!r}: use 'speed' or 'memory_cut'")
        if "math changed" in (before["status"], after["status"]):
            m.reason = f"the math changed at {after['step']} beyond its tolerance: the ratio is not the same change"
        if after.get("sdpa_backend") and "04_sdpa" in after["step"]:
            m.notes.append(f"SDPA backend that ran: {after['sdpa_backend']}")
        if i:
            m.notes.append(f"nearest measured workload ({first_reason})")
        return m
    return _Measured(reason=first_reason or "no workload to measure on")


def _measure_technique(run: _Run, lk: Technique, prefs: tuple) -> _Measured:
    first_reason = None
    for i, w in enumerate(prefs):
        metric = "peak_alloc_gib" if lk.quantity == "memory_cut" else "ms_per_step"
        a = run.get(w, f"memory: {lk.before}", metric)
        b = run.get(w, f"memory: {lk.after}", metric)
        va, vb = _num((a or {}).get("value")), _num((b or {}).get("value"))
        if not va or vb is None or (a or {}).get("status", "ok") != "ok" or (b or {}).get("status", "ok") != "ok":
            missing = lk.after if vb is None else lk.before
            first_reason = first_reason or f"memory study '{missing}' of {w} is not in this run"
            continue
        gpu, kind = run.device_of(b)
        m = _Measured(workload=w, gpu=gpu, kind=kind, frm=lk.before, to=lk.after)
        if lk.quantity == "speed":
            m.value = va / vb
        elif lk.quantity == "slowdown":
            m.value = vb / va
        elif lk.quantity == "memory_cut":
            m.value = 1.0 - vb / va
        else:
            raise ValueError(f"Technique quantity {lk.quantity!r}: use 'speed', 'slowdown' or 'memory_cut'")
        if lk.quantity != "memory_cut":
            m.noise = max(_spread(va, a.get("p20"), a.get("p80")), _spread(vb, b.get("p20"), b.get("p80")))
        if i:
            m.notes.append(f"nearest measured workload ({first_reason})")
        return m
    return _Measured(reason=first_reason or "no workload to measure on")


def _measure_records(run: _Run, lk: Records) -> _Measured:
    a = run.get(lk.workload, lk.before[0], lk.before[1])
    va = _num((a or {}).get("value"))
    if va is None or not va:
        return _Measured(reason=f"{lk.before[1]}{f' ({lk.before[0]})' if lk.before[0] else ''} is not in this run")
    cands = []
    for s in lk.after_steps:
        b = run.get(lk.workload, s, lk.after_metric)
        vb = _num((b or {}).get("value"))
        if vb:
            cands.append((vb, s, b))
    if not cands:
        return _Measured(reason=f"{lk.after_metric} ({', '.join(str(s) for s in lk.after_steps)}) is not in this run")
    vb, s, b = (min if lk.lower_is_better else max)(cands, key=lambda c: c[0])
    gpu, kind = run.device_of(b)
    m = _Measured(workload=lk.workload, gpu=gpu, kind=kind, frm=lk.before[0] or lk.before[1], to=s or lk.after_metric)
    m.value = va / vb if lk.lower_is_better else vb / va
    m.noise = max(_spread(va, a.get("p20"), a.get("p80")), _spread(vb, b.get("p20"), b.get("p80")))
    if len(lk.after_steps) > 1:
        m.notes.append(f"fastest of {', '.join(lk.after_steps)}: {s}")
    return m


def _measure_value(run: _Run, lk: Value, prefs: tuple) -> _Measured:
    for w in prefs:
        r = run.get(w, lk.step, lk.metric)
        v = _num((r or {}).get("value"))
        if v is None:
            continue
        gpu, kind = run.device_of(r)
        m = _Measured(value=v, workload=w, gpu=gpu, kind=kind, to=lk.step or lk.metric)
        m.extra = dict(r.get("params") or {})
        return m
    where = f"{lk.step}: " if lk.step else ""
    return _Measured(reason=f"{where}{lk.metric} is not in this run")


def _measure(run: _Run, lk, seed: Seed) -> _Measured:
    if isinstance(lk, NotHere):
        return _Measured(reason=lk.reason)
    if isinstance(lk, Ladder):
        return _measure_ladder(run, lk, lk.workloads or seed.workloads)
    if isinstance(lk, Technique):
        return _measure_technique(run, lk, lk.workloads or seed.workloads)
    if isinstance(lk, Records):
        return _measure_records(run, lk)
    if isinstance(lk, Value):
        return _measure_value(run, lk, lk.workloads or seed.workloads)
    raise TypeError(f"unknown measurement {type(lk).__name__}")


def measure(lookup, run=None, workloads: tuple[str, ...] = ()) -> dict:
    """One lookup (``Ladder``, ``Technique``, ``Records``, ``Value``) against a run (name, folder or
    list of records), trying ``workloads`` in order where the lookup names none. Returns value,
    text, workload, gpu, kind, from, to, reason (why there is no value) and notes."""
    r = _Run(load_records(run))
    m = _measure(r, lookup, Seed("", "", "", tuple(workloads)))
    return {"value": m.value, "text": fmt_measured(_quantity(lookup), m.value), "workload": m.workload,
            "gpu": m.gpu, "kind": m.kind, "from": m.frm, "to": m.to, "reason": m.reason, "notes": list(m.notes)}


def gpu_of(records: list[dict]) -> str | None:
    """The device most of a run's records were measured on."""
    return _Run(records).gpu


def _quantity(lk) -> str:
    if isinstance(lk, (Ladder, Technique, Value)):
        return lk.quantity
    return "speed"


def fmt_measured(quantity: str, v: float | None) -> str:
    if v is None:
        return "-"
    if quantity == "speed":
        return f"{v:.2f}x"
    if quantity == "memory_cut":
        return f"{-v:+.0%} memory"
    if quantity == "slowdown":
        return f"{v - 1:+.0%} time"
    if quantity == "first_failing_n":
        return f"misses 1e-4 from N = {v:.0f}"
    if quantity == "survived":
        return f"{v:.0f} OOM event(s) survived"
    if quantity == "share":
        return f"{v:.1%} of step time"
    if quantity == "relative":
        return f"{v:.1%} off"
    return f"{v:g}"


def verdict(quantity: str, measured: float | None, bound: float | None, noise: float = 0.0) -> str:
    """The verdict of a measured value against a claim (premise checks aside).

    ``speed``: holds at or above ``bound``; partly when faster by more than the timings' spread
    (``noise``: the wider relative p20-p80 half-spread of the two) but below it; else fails.
    ``memory_cut``: holds at or above ``bound``, partly for any cut below it, else fails.
    ``slowdown`` (a claimed cost): holds at or below ``bound``, else fails. ``survived``: holds
    from one event on. Without a bound, any real gain holds."""
    if measured is None:
        return "not measured"
    if quantity == "speed":
        gained = measured > 1.0 + noise
        if bound is None:
            return "holds" if gained else "fails"
        return "holds" if measured >= bound else "partly" if gained else "fails"
    if quantity == "memory_cut":
        if bound is None:
            return "holds" if measured > 0 else "fails"
        return "holds" if measured >= bound else "partly" if measured > 0 else "fails"
    if quantity == "slowdown":
        return "holds" if bound is None or measured <= bound else "fails"
    if quantity == "survived":
        return "holds" if measured >= 1 else "fails"
    return "not measured"


def load_records(run) -> list[dict]:
    """Records of a run given by name, folder or as a list; a run that does not exist has none."""
    if isinstance(run, list):
        return run
    p = Path(run) if run is not None else None
    if p is not None and not p.is_absolute() and p.parts and p.parts[0] != "outputs":
        p = outputs_root() / p
    elif p is not None and not p.is_absolute():
        p = REPO_ROOT / p
    if p is not None and not (p / "results.jsonl").exists():
        return []      # and its folder is not created
    return query.load(p)


def evaluate(run=None) -> list[dict]:
    """One row per claim: seed, claim, claimed, measured, workload, gpu, verdict, note (and
    compares, from/to, measured_text, quantity). ``run``: a run name or folder as
    ``query.load`` takes it, or a list of records."""
    r = _Run(load_records(run))
    rows = []
    for c in CLAIMS:
        seed = SEEDS[c.seed]
        q = _quantity(c.measure)
        m = _measure(r, c.measure, seed)
        notes = [c.premise] if c.premise else []
        if c.premise:
            v = "premise fails"
        elif q == "first_failing_n":
            v = "premise fails" if m.value is not None and m.value <= c.bound else "not measured"
            if m.value is not None and v == "not measured":
                notes.append(f"the recursion holds to N = {m.value:.0f}; its speed is not measured")
        elif m.value is None or m.reason:
            v = "not measured"
        elif m.kind and m.kind != "cuda":
            v = "not measured"
            notes.append(f"measured on {m.kind} (smoke check): no verdict on a GPU claim")
        elif q == "survived" and m.extra.get("real_oom") is False:
            v = "not measured"
            notes.append("the OOM was simulated, not a real CUDA out-of-memory error")
        else:
            v = verdict(q, m.value, c.bound, m.noise)
            if v == "fails" and q == "speed" and 1.0 < m.value <= 1.0 + m.noise:
                notes.append(f"within the timings' p20-p80 spread (+/-{m.noise:.0%})")
        if m.reason:
            notes.append(m.reason)
        notes += m.notes
        if c.note:
            notes.append(c.note)
        for label, lk in c.also:
            am = _measure(r, lk, seed)
            if am.value is not None:
                where = f" on {am.workload}" if am.workload and am.workload != m.workload else ""
                notes.append(f"{label}{where}: {fmt_measured(_quantity(lk), am.value)}")
        rows.append({"seed": c.seed, "claim": c.claim, "claimed": c.claimed, "compares": c.compares,
                     "measured": m.value, "measured_text": fmt_measured(q, m.value), "quantity": q,
                     "workload": m.workload, "gpu": m.gpu if m.value is not None else None,
                     "from": m.frm, "to": m.to, "verdict": v, "note": "; ".join(n for n in notes if n)})
    return rows


# --- tables -------------------------------------------------------------------------------------------

COLUMNS = (("claim", "claim"), ("claimed", "claimed"), ("measured here", "measured_text"),
           ("compares", "compares"), ("workload", "workload"), ("verdict", "verdict"), ("note", "note"))


def _cell(v) -> str:
    return "-" if v in (None, "") else str(v).replace("|", "\\|").replace("\n", " ")


def tables(rows: list[dict]) -> dict[str, str]:
    """One Markdown table per seed system, keyed by seed id ('000' ... '004'); every seed has a table."""
    out = {}
    for sid in SEEDS:
        mine = [r for r in rows if r["seed"] == sid]
        lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        for r in mine:
            lines.append("| " + " | ".join(_cell(r.get(k)) for _, k in COLUMNS) + " |")
        if not mine:
            lines.append("| " + " | ".join(["_no claims listed_"] + ["-"] * (len(COLUMNS) - 1)) + " |")
        out[sid] = "\n".join(lines) + "\n"
    return out


def summary_line(rows: list[dict]) -> str:
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS}
    gpus = sorted({r["gpu"] for r in rows if r.get("gpu")})
    parts = [f"{n} {v}" for v, n in counts.items() if n]
    return (f"Measured on {', '.join(gpus)}: " if gpus else "Nothing measured on a GPU yet: ") + ", ".join(parts) + "."


def markdown(rows: list[dict], level: int = 3) -> str:
    """Every seed's table under a heading, with a line counting the verdicts."""
    h = "#" * level
    out = []
    for sid, table in tables(rows).items():
        s = SEEDS[sid]
        mine = [r for r in rows if r["seed"] == sid]
        out += [f"{h} {sid} · {s.title}", "", f"Claims of `seeds/{s.file}`. " + summary_line(mine), "", table]
    return "\n".join(out)


def default_run() -> Path:
    """The reference run of this machine's GPU if there is one, else the H100 reference."""
    ref = REPO_ROOT / "outputs" / "reference"
    try:
        import torch
        if torch.cuda.is_available():
            from ..device import short_name
            mine = ref / short_name(torch.cuda.get_device_name())
            if (mine / "results.jsonl").exists():
                return mine
    except Exception:   # no usable CUDA: the H100 reference stands in
        pass
    return ref / "h100"
