"""Which of the lab's optimizations a live training set-up uses, and what each bought in a reference run.

``audit(model, optimizer, loader=None)`` reads only what the objects show: parameter dtypes, the
global TF32 flags, whether the model is a ``torch.compile`` module and in which mode, the
optimizer's ``fused``/``foreach`` defaults, the memory format of convolution weights, how attention
modules compute attention, embedding sizes, and the DataLoader's settings. What lives in the
training loop instead (``torch.autocast`` around the forward, ``non_blocking`` copies, padding in
the batches) is reported as ``unknown`` with the reason, never guessed. Nothing is run.

Each row carries the gain the lab measured for that optimization in a reference run, on the
workload closest to the model's structure (convolutions and attention: ``vit_bdh``; a causal LM:
``gpt``; a bidirectional encoder with a classification head: ``encoder_nli``; BK-Core layers:
``resnet_bk``). The report says how the workload was chosen, and which one stood in when the
closest is not in the run.
"""

from __future__ import annotations

import html
import inspect
import sys
import types
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..paths import REPO_ROOT
from ..steps import STEP_NAMES, get_step
from . import lookup

STATUSES = ("on", "off", "n/a", "unknown")
# Where the closest workload is not in the run, the next of these that is stands in.
_STAND_INS = {"vit_bdh": ("vit_bdh", "vit_bdh_linear", "encoder_nli", "gpt"),
              "vit_bdh_linear": ("vit_bdh_linear", "vit_bdh", "encoder_nli", "gpt"),
              "encoder_nli": ("encoder_nli", "gpt", "vit_bdh"),
              "gpt": ("gpt", "encoder_nli", "resnet_bk"),
              "resnet_bk": ("resnet_bk", "gpt")}


@dataclass
class AuditRow:
    optimization: str
    step: str | None          # the lab's step (or study) that measures it
    status: str               # on, off, n/a, unknown
    evidence: str             # what was read off the objects
    gain: float | None = None  # speed ratio over the step before, or the fraction of peak memory cut
    gain_text: str = ""       # the gain with its step, workload and GPU, or why there is none


@dataclass
class AuditReport:
    rows: list[AuditRow]
    workload: str | None        # the reference workload the gains come from
    workload_reason: str
    run: str
    gpu: str | None
    model: str = ""
    notes: list[str] = field(default_factory=list)

    def row(self, optimization: str) -> AuditRow:
        for r in self.rows:
            if r.optimization == optimization:
                return r
        raise KeyError(f"no row {optimization!r}; rows: {[r.optimization for r in self.rows]}")

    def status(self) -> dict[str, str]:
        return {r.optimization: r.status for r in self.rows}

    def header(self) -> str:
        gains = (f"Gains: reference run `{self.run}` on {self.gpu or 'an unnamed device'}, workload "
                 f"**{self.workload}** ({self.workload_reason})." if self.workload else
                 f"Gains: none ({self.workload_reason}).")
        return " ".join([f"Audit of {self.model}.", gains, *self.notes])

    def markdown(self) -> str:
        def cell(v):
            return "-" if v in (None, "") else str(v).replace("|", "\\|").replace("\n", " ")
        lines = [self.header(), "", "| optimization | lab step | status | evidence | measured gain (reference) |",
                 "|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {cell(r.optimization)} | {cell(r.step)} | {cell(r.status)} | {cell(r.evidence)} | "
                         f"{cell(r.gain_text)} |")
        return "\n".join(lines) + "\n"

    def _repr_html_(self) -> str:
        colour = {"on": "#2e7d32", "off": "#c62828", "n/a": "#757575", "unknown": "#ef6c00"}
        e = html.escape
        body = "".join(
            f"<tr><td>{e(r.optimization)}</td><td>{e(r.step or '-')}</td>"
            f"<td style='color:{colour.get(r.status, '#000')};font-weight:bold'>{e(r.status)}</td>"
            f"<td style='text-align:left'>{e(r.evidence)}</td>"
            f"<td style='text-align:left'>{e(r.gain_text or '-')}</td></tr>"
            for r in self.rows)
        return (f"<p>{e(self.header())}</p><table><thead><tr><th>optimization</th><th>lab step</th><th>status</th>"
                f"<th>evidence</th><th>measured gain (reference)</th></tr></thead><tbody>{body}</tbody></table>")

    def __str__(self) -> str:
        return self.markdown()


# --- what the objects show ------------------------------------------------------------------------

def _unwrap(model: nn.Module):
    """(the user's module, compile info or None, wrapper notes)."""
    notes, comp = [], None
    OptimizedModule = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    OptimizedModule = getattr(OptimizedModule, "OptimizedModule", ())
    for _ in range(4):
        if OptimizedModule and isinstance(model, OptimizedModule):
            comp = comp or _compile_info(getattr(model, "forward", None), model)
            model = model._orig_mod
        elif getattr(model, "_compiled_call_impl", None) is not None:
            comp = comp or _compile_info(model._compiled_call_impl, None)
            break
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            notes.append(f"wrapped in {type(model).__name__}")
            model = model.module
        else:
            break
    return model, comp, notes


def _compile_info(fn, wrapper) -> dict:
    info = {"backend": None, "mode": None, "cudagraphs": None}
    try:
        cfg = fn.get_compiler_config()
    except Exception:
        return info      # compiled, settings not readable
    if isinstance(cfg, dict):
        info["backend"] = "inductor"
        graphs, tune = bool(cfg.get("triton.cudagraphs")), bool(cfg.get("max_autotune"))
        info["cudagraphs"] = graphs
        info["mode"] = ("max-autotune" if tune and graphs else "max-autotune-no-cudagraphs" if tune
                        else "reduce-overhead" if graphs else "default")
    else:
        try:
            b = wrapper.dynamo_ctx.callback._torchdynamo_orig_backend._torchdynamo_orig_backend
            info["backend"] = getattr(b, "compiler_name", None) or type(b).__name__
        except Exception:
            info["backend"] = "a backend other than inductor"
        info["cudagraphs"] = False
    return info


def _compiled_children(model: nn.Module) -> list[str]:
    Opt = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "OptimizedModule", None)
    out = []
    for name, m in model.named_modules():
        if name and ((Opt and isinstance(m, Opt)) or getattr(m, "_compiled_call_impl", None) is not None):
            out.append(name)
    return out


def _dtypes(model: nn.Module) -> Counter:
    return Counter(str(p.dtype).replace("torch.", "") for p in model.parameters())


def _tf32_flags() -> tuple[bool, str]:
    b = torch.backends
    if hasattr(b.cuda.matmul, "fp32_precision"):    # torch >= 2.9: one API; the legacy flags must not be read
        def resolve(*vals):
            return next((v for v in vals if v and v != "none"), None)
        root = getattr(b, "fp32_precision", None)
        mm = resolve(b.cuda.matmul.fp32_precision, root) or "ieee"
        conv = resolve(b.cudnn.conv.fp32_precision, getattr(b.cudnn, "fp32_precision", None), root) or "default"
        return mm == "tf32", f"torch.backends.cuda.matmul.fp32_precision -> {mm!r}; cuDNN conv -> {conv!r}"
    mm, conv = b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32
    prec = torch.get_float32_matmul_precision()
    return bool(mm) or prec in ("high", "medium"), (f"torch.backends.cuda.matmul.allow_tf32={mm}, "
                                                    f"float32_matmul_precision={prec!r}; cudnn.allow_tf32={conv}")


def _parents(model: nn.Module) -> dict[str, nn.Module]:
    mods = dict(model.named_modules())
    return {n: mods.get(n.rpartition(".")[0]) for n in mods if n}


_SDPA_SETTING = {"sdpa": "on", "manual": "off", "linear": "n/a"}


def _attention(model: nn.Module) -> list[tuple[str, str, str]]:
    """(module name, status, why) for each attention module found."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(impl, str):
        fused = ("sdpa", "flash_attention_2", "flash_attention_3")
        st = "off" if impl == "eager" else "on" if impl in fused else "unknown"
        return [("config", st, f"config._attn_implementation = {impl!r}")]
    parents = _parents(model)
    found = []
    for name, m in model.named_modules():
        att = getattr(m, "attention", None)
        if isinstance(att, str) and getattr(m, "form", None) == "linear":
            found.append((name, "n/a", "form='linear': no softmax for a fused kernel to fuse"))
        elif isinstance(att, str):
            found.append((name, _SDPA_SETTING.get(att, "unknown"), f"attention={att!r}"))
        elif isinstance(m, nn.MultiheadAttention):
            p = parents.get(name)
            if isinstance(p, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
                found.append((name, "on", f"nn.MultiheadAttention inside {type(p).__name__}, called with "
                                           "need_weights=False: the SDPA path"))
            else:
                found.append((name, "unknown", "nn.MultiheadAttention: SDPA only when called with need_weights=False"))
        elif "attention" in type(m).__name__.lower() and not any(
                c for c in m.children() if isinstance(c, nn.MultiheadAttention)):
            try:
                src = inspect.getsource(type(m).forward)
            except (OSError, TypeError):
                found.append((name, "unknown", f"{type(m).__name__}: forward source not readable"))
                continue
            sdpa, manual = "scaled_dot_product_attention" in src, "softmax" in src
            st = "on" if sdpa and not manual else "off" if manual and not sdpa else "unknown"
            why = {"on": "forward calls F.scaled_dot_product_attention",
                   "off": "forward computes softmax(Q K^T) V by hand",
                   "unknown": ("forward has both an SDPA and a manual path: which runs is decided at call time"
                               if sdpa else "forward shows neither SDPA nor a softmax")}[st]
            found.append((name, st, f"{type(m).__name__}: {why} (read from its source)"))
    named = [f[0] for f in found]
    # a wrapper whose own class name says attention, around attention modules found already, is not counted twice
    def inside(outer, inner):
        return inner != outer and (outer == "" or inner.startswith(outer + "."))
    return [f for f in found if not any(inside(f[0], o) for o in named)]


def _summarise(found: list[tuple[str, str, str]], none_found: str) -> tuple[str, str]:
    if not found:
        return "n/a", none_found
    sts = Counter(st for _, st, _ in found)
    ex = "; ".join(sorted({why for _, _, why in found}))
    n = len(found)
    if sts["off"]:
        return "off", f"{sts['off']} of {n} attention modules manual: {ex}"
    if sts["on"] == n:
        return "on", f"{n} attention module(s): {ex}"
    if sts["n/a"] == n:
        return "n/a", f"{n} linear-attention module(s): no softmax for a fused kernel to fuse"
    if sts["on"] and not sts["unknown"]:
        return "on", f"{sts['on']} of {n} fused, the rest linear: {ex}"
    return "unknown", ex


def _is_causal_lm(model: nn.Module, embeddings) -> tuple[bool, str]:
    cfg = getattr(model, "config", None)
    archs = getattr(cfg, "architectures", None) or []
    if any(str(a).endswith("ForCausalLM") for a in archs) or getattr(cfg, "is_decoder", False):
        return True, "config says causal LM"
    for name, m in model.named_modules():
        if "causal" in type(m).__name__.lower():
            return True, f"causal attention ({type(m).__name__})"
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
    emb_w = {id(e.weight) for _, e in embeddings}
    if any(id(m.weight) in emb_w for m in lin):
        return True, "an output projection shares the embedding's weight (tied)"
    return False, ""


def closest_workload(model: nn.Module) -> tuple[str, str]:
    """The lab workload nearest the model's structure, and why."""
    model, _, _ = _unwrap(model)
    mods = list(model.modules())
    convs = [m for m in mods if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    att = _attention(model)
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if any(type(m).__name__ == "BKMixer" for m in mods):
        return "resnet_bk", "BK-Core mixing layers"
    if convs and att:
        linear = all(st == "n/a" for _, st, _ in att)
        return ("vit_bdh_linear" if linear else "vit_bdh"), "convolutions and attention: a vision transformer"
    if embeddings:
        causal, why = _is_causal_lm(model, embeddings)
        if causal:
            return "gpt", f"token embeddings and {why}"
        lin = [m for m in mods if isinstance(m, nn.Linear)]
        if att and lin and lin[-1].out_features < 64:
            return "encoder_nli", (f"embeddings, attention without a causal mask, and a {lin[-1].out_features}-way "
                                   "classification head: a bidirectional encoder")
        vocab = max(e.num_embeddings for _, e in embeddings)
        if not any(m.out_features == vocab for m in lin):
            return "gpt", "token embeddings and no separate vocabulary-sized head: a tied-embedding LM"
        return "gpt", "token embeddings with a vocabulary-sized head"
    if convs:
        return "vit_bdh", "convolutions: the lab's only convolutional workload"
    if att:
        return "gpt", "attention without embeddings or convolutions: nearest is the transformer LM"
    return "gpt", "no structural match (no embeddings, attention or convolutions): gpt as a default"


# --- the rows ----------------------------------------------------------------------------------------

def _guard(fn, *a):
    try:
        return fn(*a)
    except Exception as e:   # an odd object must give an honest 'unknown', not a crash
        return "unknown", f"could not inspect: {type(e).__name__}: {e}"


def _row_precision(model):
    d = _dtypes(model)
    if not d:
        return "n/a", "the model has no parameters"
    listing = ", ".join(f"{k} x {v}" for k, v in d.most_common())
    low = {k for k in d if k in ("bfloat16", "float16")}
    if low and "float32" not in d:
        return "on", (f"parameters {listing}: pure low-precision weights (no fp32 master copy), a different recipe "
                      "from autocast")
    return "unknown", (f"parameters {listing}; autocast is a context around the forward, not a property of the "
                       "objects: not visible")


def _row_tf32(model):
    on, ev = _tf32_flags()
    d = _dtypes(model)
    if d and "float32" not in d:
        return "n/a", f"no fp32 parameters: TF32 only changes fp32 matmuls ({ev})"
    return ("on" if on else "off"), ev


def _row_sdpa(model):
    return _summarise(_attention(model), "no attention modules found")


def _row_fused(optimizer):
    from ..memory.offload import OffloadedAdamW
    if isinstance(optimizer, OffloadedAdamW):
        return "n/a", "hwlib OffloadedAdamW: moments on the host, updated bucket by bucket (see the offload row)"
    d = getattr(optimizer, "defaults", {}) or {}
    name = type(optimizer).__name__
    if "fused" not in d:
        return "n/a", f"{name} has no fused implementation"
    fused, foreach = d.get("fused"), d.get("foreach")
    tail = "; zero_grad(set_to_none=...) is a call-time choice (torch's default is True)"
    if fused:
        return "on", f"{name}(fused=True){tail}"
    how = ("torch picks the foreach multi-tensor path for CUDA parameters" if foreach is None
           else "foreach multi-tensor path" if foreach else "one kernel chain per parameter")
    return "off", f"{name}(fused={fused}, foreach={foreach}): {how}{tail}"


def _row_compile(comp, children):
    if comp is None:
        if children:
            return "on", f"compiled submodules: {', '.join(children[:3])}{' ...' if len(children) > 3 else ''}"
        return "off", "not a torch.compile module, and no compiled submodule"
    if comp["backend"] is None:
        return "on", "torch.compile module (its settings are not readable in this torch version)"
    if comp["backend"] != "inductor":
        return "off", f"compiled with backend {comp['backend']!r}: no code generation"
    return "on", f"torch.compile, inductor, mode={comp['mode']!r}"


def _row_shapes(model):
    embs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embs:
        return "n/a", "no nn.Embedding: nothing to pad"
    bad = [f"{n or 'model'}: {m.num_embeddings} x {m.embedding_dim}" for n, m in embs
           if m.num_embeddings % 64 or m.embedding_dim % 64]
    if bad:
        return "off", f"not multiples of 64: {'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}"
    return "on", "; ".join(f"{n or 'model'}: {m.num_embeddings} x {m.embedding_dim}" for n, m in embs[:3])


def _loader_rows(loader) -> dict[str, tuple[str, str]]:
    keys = ("DataLoader workers", "pinned memory", "persistent workers")
    if loader is None:
        return {k: ("unknown", "no loader given") for k in keys}
    if not isinstance(loader, torch.utils.data.DataLoader):
        return {k: ("unknown", f"not a torch DataLoader ({type(loader).__name__})") for k in keys}
    nw, pin = loader.num_workers, loader.pin_memory
    pers, pf = loader.persistent_workers, loader.prefetch_factor
    return {
        "DataLoader workers": (("on" if nw > 0 else "off"), f"num_workers={nw}, prefetch_factor={pf}"),
        "pinned memory": (("on" if pin else "off"),
                          f"pin_memory={pin}; non_blocking copies are call-time: not visible from the objects"),
        "persistent workers": (("n/a", "num_workers=0: no workers to keep") if nw == 0 else
                               (("on" if pers else "off"), f"persistent_workers={pers}")),
    }


def _row_graphs(comp):
    if comp is None or comp["backend"] is None:
        return ("unknown", "compile settings not readable") if comp else \
               ("off", "not compiled with mode='reduce-overhead' (graphs captured by hand are not visible)")
    if comp["cudagraphs"]:
        return "on", f"torch.compile mode={comp['mode']!r} replays CUDA graphs"
    return "off", f"compiled without CUDA graphs (mode={comp['mode']!r})" if comp["mode"] else \
        f"compiled with backend {comp['backend']!r}: no CUDA graphs"


def _row_channels_last(model):
    convs = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    if not convs:
        return "n/a", "no 2-d or 3-d convolution"
    fmt = lambda m: torch.channels_last if isinstance(m, nn.Conv2d) else torch.channels_last_3d  # noqa: E731
    cl = sum(1 for m in convs if m.weight.is_contiguous(memory_format=fmt(m)))
    ev = f"{cl} of {len(convs)} conv weights channels_last; the inputs' format is call-time"
    return ("on" if cl == len(convs) else "off"), ev


def _row_packing(model):
    has_seq = any(isinstance(m, nn.Embedding) for m in model.modules()) or bool(_attention(model))
    if not has_seq:
        return "n/a", "no sequence layers"
    return "unknown", "padding is a property of the batches: not visible from the objects"


def _row_checkpointing(model):
    flag = getattr(model, "is_gradient_checkpointing", None)
    if isinstance(flag, bool):
        return ("on" if flag else "off"), f"is_gradient_checkpointing={flag}"
    for name, m in model.named_modules():
        ck = getattr(m, "checkpointed", None)
        if isinstance(ck, (set, frozenset)):
            head = bool(getattr(m, "checkpoint_head", False))
            on = bool(ck) or head
            return ("on" if on else "off"), f"{name or 'model'}.checkpointed = {sorted(ck)}, head={head}"
        gc = getattr(m, "gradient_checkpointing", None)
        if isinstance(gc, bool) and gc:
            return "on", f"{name or 'model'}.gradient_checkpointing=True"
    return "unknown", "the model has no checkpointing flag; torch.utils.checkpoint calls live in forward code"


def _row_offload(model, optimizer):
    from ..memory.offload import OffloadedAdamW
    if isinstance(optimizer, OffloadedAdamW):
        return "on", "hwlib OffloadedAdamW: AdamW moments in pinned host memory"
    devs = {p.device.type for p in model.parameters()}
    state_devs = set()
    for st in list(getattr(optimizer, "state", {}).values())[:16]:
        if isinstance(st, dict):
            state_devs |= {v.device.type for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if "cuda" in devs and "cpu" in state_devs:
        return "on", "optimizer state tensors on the CPU, parameters on the GPU"
    return "off", ("optimizer states on the parameters' device" if state_devs else
                   "no optimizer state yet; states are created next to the parameters")


def _row_bk(model):
    mix = [m for m in model.modules() if type(m).__name__ == "BKMixer"]
    if not mix:
        return "n/a", "no BK-Core layer"
    backs = Counter(str(getattr(m, "backend", "?")) for m in mix)
    on = all(b in ("triton", "cuda", "auto") for b in backs)
    return ("on" if on else "off"), "BK-Core backends: " + ", ".join(f"{b} x {n}" for b, n in backs.items())


# (optimization, the lab step or study that measured it)
_PLAN = (
    ("TF32 matmuls", "02_tf32"),
    ("bf16 mixed precision", "03_bf16_autocast"),
    ("fused attention (SDPA)", "04_sdpa_attention"),
    ("fused AdamW", "05_fused_optimizer"),
    ("torch.compile", "06_torch_compile"),
    ("tensor-core friendly sizes", "07_nice_shapes"),
    ("DataLoader workers", "08_dataloader"),
    ("pinned memory", "08_dataloader"),
    ("persistent workers", "08_dataloader"),
    ("CUDA graphs", "09_cuda_graphs"),
    ("channels_last", "10_channels_last"),
    ("sequence packing", "11_sequence_packing"),
    ("BK-Core custom kernel", "12_bk_core"),
    ("activation checkpointing", "13_memory"),
    ("optimizer offload", "13_memory"),
)
_TECHNIQUE = {"activation checkpointing": "bf16 + checkpointing(blocks)", "optimizer offload": "bf16 + offload"}


def _gain(records, workload: str | None, closest: str, opt: str, step: str) -> tuple[float | None, str]:
    """The gain of ``opt`` in the reference records: on ``workload``, else on the next of the
    closest workload's stand-ins that measured it (named in the text)."""
    if workload is None:
        return None, "no reference results"
    # a step that applies to one workload alone (12, the BK-Core) is measured on that workload
    only = get_step(step).workloads if step in STEP_NAMES else None
    chain = (workload, *_STAND_INS.get(closest, ()), *(only if only and len(only) == 1 else ()))
    chain = tuple(dict.fromkeys(chain))
    if opt in _TECHNIQUE:
        t = _TECHNIQUE[opt]
        cut = lookup.measure(lookup.Technique("bf16", t, "memory_cut", chain), records)
        if cut["value"] is None:
            return None, cut["reason"] or "not measured"
        slow = lookup.measure(lookup.Technique("bf16", t, "slowdown", (cut["workload"],)), records)
        cost = f" at {slow['text']}" if slow["value"] is not None else ""
        return cut["value"], f"{cut['text']}{cost} (13_memory: '{t}' vs 'bf16', {cut['workload']}, {cut['gpu']})"
    m = lookup.measure(lookup.Ladder("prev", step, workloads=chain), records)
    if m["value"] is None:
        return None, m["reason"] or "not measured"
    return m["value"], f"{m['text']} ({m['to']} vs {m['from']}, {m['workload']}, {m['gpu']})"


def _reference(run):
    from pathlib import Path
    path = lookup.default_run() if run is None else run
    records = lookup.load_records(path)
    try:
        shown = str(Path(path).resolve().relative_to(REPO_ROOT))
    except (TypeError, ValueError):
        shown = str(path)
    return shown, records


def audit(model, optimizer, loader=None, *, run=None, workload: str | None = None) -> AuditReport:
    """Which of the lab's optimizations the objects show on, off, not applicable or unknown, each
    with the gain the lab measured for it in ``run`` (default: this GPU's reference run, else
    ``outputs/reference/h100``). ``workload`` overrides the structural choice of the reference
    workload. Inspects only: runs no forward, draws no batch."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"audit(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    from ..memory.offload import OffloadedAdamW
    if not isinstance(optimizer, (torch.optim.Optimizer, OffloadedAdamW)):
        raise TypeError(f"audit(optimizer=...): expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    try:
        inner, comp, notes = _unwrap(model)
    except Exception:
        inner, comp, notes = model, None, []
    children = _guard(_compiled_children, inner) if comp is None else []
    if isinstance(children, tuple):   # the guard's ('unknown', why)
        children = []

    run_name, records = _reference(run)
    if workload is not None:
        chosen, why = workload, "chosen by the caller"
    else:
        chosen, why = _guard(closest_workload, inner)
        if chosen == "unknown":
            chosen, why = "gpt", f"gpt as a default ({why})"
    from ..query import workloads_in
    measured = workloads_in(records)
    used = None
    if records:
        used = next((w for w in _STAND_INS.get(chosen, (chosen,)) if w in measured), None)
        if used is None and measured:
            used = measured[0]
        if used and used != chosen:
            why += f"; {chosen} is not in this run, so {used}'s gains stand in"
    else:
        why = f"no results at {run_name}"
    # Read once for the whole report: every row's gain looks up the same records (their device and
    # ladder rows, thousands of records each time when each row read them afresh)
    ref = lookup.RunRecords(records)
    gpu = ref.gpu if records else None

    try:
        mine = {id(p) for p in inner.parameters()}
        theirs = [p for g in getattr(optimizer, "param_groups", []) for p in g.get("params", [])]
        if theirs and not any(id(p) in mine for p in theirs):
            notes.append("The optimizer holds none of the model's parameters.")
    except Exception:
        pass
    try:
        n_params = sum(p.numel() for p in inner.parameters())
        devs = sorted({p.device.type for p in inner.parameters()})
        label = f"{type(inner).__name__} ({n_params:,} parameters on {', '.join(devs) or 'no device'})"
    except Exception as e:
        label = f"{type(inner).__name__} (parameters not readable: {type(e).__name__})"
    label += f", {notes[0]}" if notes and notes[0].startswith("wrapped") else ""
    notes = [n for n in notes if not n.startswith("wrapped")]

    loader_rows = _guard(_loader_rows, loader)
    if isinstance(loader_rows, tuple):     # the guard's ('unknown', why)
        loader_rows = {k: loader_rows for k in ("DataLoader workers", "pinned memory", "persistent workers")}
    inspect_row = {
        "TF32 matmuls": lambda: _row_tf32(inner),
        "bf16 mixed precision": lambda: _row_precision(inner),
        "fused attention (SDPA)": lambda: _row_sdpa(inner),
        "fused AdamW": lambda: _row_fused(optimizer),
        "torch.compile": lambda: _row_compile(comp, children),
        "tensor-core friendly sizes": lambda: _row_shapes(inner),
        "DataLoader workers": lambda: loader_rows["DataLoader workers"],
        "pinned memory": lambda: loader_rows["pinned memory"],
        "persistent workers": lambda: loader_rows["persistent workers"],
        "CUDA graphs": lambda: _row_graphs(comp),
        "channels_last": lambda: _row_channels_last(inner),
        "sequence packing": lambda: _row_packing(inner),
        "BK-Core custom kernel": lambda: _row_bk(inner),
        "activation checkpointing": lambda: _row_checkpointing(inner),
        "optimizer offload": lambda: _row_offload(inner, optimizer),
    }
    rows = []
    for opt, step in _PLAN:
        status, evidence = _guard(inspect_row[opt])
        gain, text = _guard(_gain, ref, used, chosen, opt, step) if used else (None, why)
        if not isinstance(gain, float):
            gain = None
        rows.append(AuditRow(opt, step, status, evidence, gain, text))
    return AuditReport(rows=rows, workload=used, workload_reason=why, run=run_name, gpu=gpu, model=label, notes=notes)


class _CallableModule(types.ModuleType):
    """``hwlib.audit(model, optimizer, loader)`` as well as ``hwlib.seeds.audit.audit(...)``."""

    def __call__(self, model, optimizer, loader=None, **kw):
        return audit(model, optimizer, loader, **kw)


sys.modules[__name__].__class__ = _CallableModule
