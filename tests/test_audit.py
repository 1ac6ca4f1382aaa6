import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hwlib.seeds.audit
from hwlib import paths, query, results
from hwlib.seeds import lookup
from hwlib.seeds.audit import audit, closest_workload
from hwlib.steps import Settings
from hwlib.precision import tf32_mode
from hwlib.workloads.gpt import GPT, GPTConfig

REF = paths.REPO_ROOT / "outputs" / "reference" / "h100"
_READ: dict = {}


@pytest.fixture(autouse=True)
def reference_read_once(monkeypatch):
    """Every audit reads its reference run's records (thousands of lines: half a second of CPU each
    time): here a results file is parsed once per version of it (path, size, time), and each caller
    gets its own list of those records."""
    real = lookup.load_records

    def load_records(run):
        if run is None or isinstance(run, list):
            return real(run)
        f = paths.read_dir(run) / query.RESULTS_FILE
        try:
            st = f.stat()
        except OSError:
            return real(run)
        key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _READ:
            _READ[key] = real(run)
        return list(_READ[key])
    monkeypatch.setattr(lookup, "load_records", load_records)


class Attention(nn.Module):
    def __init__(self, d, attention="sdpa"):
        super().__init__()
        self.qkv, self.attention = nn.Linear(d, 3 * d), attention

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v)


class ConvAttention(nn.Module):
    """A tiny vision transformer: patch convolution, one attention layer, a 10-way head."""

    def __init__(self, attention="sdpa"):
        super().__init__()
        self.patch = nn.Conv2d(3, 64, 4, 4)
        self.attn = Attention(64, attention)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.attn(self.patch(x).flatten(2).transpose(1, 2)).mean(1))


def loader(**kw):
    return DataLoader(TensorDataset(torch.randn(8, 3, 32, 32)), batch_size=4, **kw)


def test_toy_conv_attention_statuses():
    m = ConvAttention()
    rep = audit(m, torch.optim.AdamW(m.parameters(), fused=True), loader(num_workers=2, pin_memory=False), run=REF)
    assert rep.status() == {
        "TF32 matmuls": "off", "bf16 mixed precision": "unknown", "fused attention (SDPA)": "on",
        "fused AdamW": "on", "torch.compile": "off", "tensor-core friendly sizes": "n/a",
        "DataLoader workers": "on", "pinned memory": "off", "persistent workers": "off", "CUDA graphs": "off",
        "channels_last": "off", "sequence packing": "unknown", "BK-Core custom kernel": "n/a",
        "activation checkpointing": "unknown", "optimizer offload": "off"}
    assert "num_workers=2" in rep.row("DataLoader workers").evidence
    assert "not visible" in rep.row("bf16 mixed precision").evidence
    assert rep.workload == "vit_bdh" and "convolutions and attention" in rep.workload_reason


def _peak(recs, workload, technique):
    (r,) = query.select(recs, workload=workload, metric="peak_alloc_gib", technique=technique)
    return r["value"]


def test_gains_come_from_the_reference_run():
    if not (REF / "results.jsonl").exists():
        pytest.skip("no H100 reference run in this checkout")
    m = ConvAttention()
    rep = audit(m, torch.optim.AdamW(m.parameters(), fused=True), run=REF)
    steps = {s["step"]: s for s in json.loads((REF / "summary.json").read_text())["workloads"]["vit_bdh"]["steps"]}
    assert rep.workload == "vit_bdh"
    fused = rep.row("fused AdamW")
    assert fused.gain == pytest.approx(steps["05_fused_optimizer"]["throughput"]
                                       / steps["04_sdpa_attention"]["throughput"], rel=1e-9)
    assert "05_fused_optimizer vs 04_sdpa_attention" in fused.gain_text and "H100" in fused.gain_text
    recs = lookup.load_records(REF)
    assert rep.row("activation checkpointing").gain == pytest.approx(
        1 - _peak(recs, "vit_bdh", "bf16 + checkpointing(blocks)") / _peak(recs, "vit_bdh", "bf16"))
    graphs = rep.row("CUDA graphs")
    assert graphs.gain == pytest.approx(steps["09_cuda_graphs"]["throughput"] / steps["08_dataloader"]["throughput"],
                                        rel=1e-9)


def test_a_missing_workload_is_stood_in_for_and_said(tmp_path):
    if not (REF / "results.jsonl").exists():
        pytest.skip("no H100 reference run in this checkout")
    only_gpt = [r for r in lookup.load_records(REF) if r.get("workload") == "gpt"]
    results.append(only_gpt, tmp_path / "gpt_only")
    m = ConvAttention()
    rep = audit(m, torch.optim.AdamW(m.parameters(), fused=True), run=tmp_path / "gpt_only")
    assert rep.workload == "gpt" and "stand in" in rep.workload_reason    # vit_bdh is not in that run
    assert rep.row("channels_last").gain is None and "n/a for gpt" in rep.row("channels_last").gain_text


def test_channels_last_tf32_and_persistent_workers_read_as_on():
    m = ConvAttention().to(memory_format=torch.channels_last)
    with tf32_mode(True):
        rep = audit(m, torch.optim.AdamW(m.parameters()),
                    loader(num_workers=1, pin_memory=True, persistent_workers=True))
    s = rep.status()
    assert s["channels_last"] == "on" and s["TF32 matmuls"] == "on"
    assert s["pinned memory"] == "on" and s["persistent workers"] == "on"
    assert s["fused AdamW"] == "off" and "foreach" in rep.row("fused AdamW").evidence
    assert audit(m, torch.optim.AdamW(m.parameters())).status()["TF32 matmuls"] == "off"   # flags restored


def test_hwlib_gpt_manual_attention_padded_vocab_and_compile_modes():
    g = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, context=64, vocab=500), attention="manual",
            vocab_multiple=64, checkpointing="all")
    assert closest_workload(g)[0] == "gpt"
    opt = torch.optim.AdamW(g.parameters())
    rep = audit(torch.compile(g, mode="reduce-overhead"), opt)
    s = rep.status()
    assert s["fused attention (SDPA)"] == "off" and "2 of 2" in rep.row("fused attention (SDPA)").evidence
    assert s["tensor-core friendly sizes"] == "on"        # 512 x 64 and 64 x 64
    assert s["torch.compile"] == "on" and s["CUDA graphs"] == "on"
    assert s["activation checkpointing"] == "on"
    assert s["DataLoader workers"] == "unknown" and s["channels_last"] == "n/a"
    rep = audit(torch.compile(g, backend="aot_eager"), opt)
    assert rep.status()["torch.compile"] == "off" and "aot_eager" in rep.row("torch.compile").evidence
    assert rep.status()["CUDA graphs"] == "off"
    g.set_attention("sdpa")
    assert audit(g, opt).status()["fused attention (SDPA)"] == "on"


def test_an_encoder_with_a_classification_head_is_matched_to_encoder_nli():
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 64)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, batch_first=True), 2)
            self.cls = nn.Linear(64, 3)
    e = Encoder()
    w, why = closest_workload(e)
    assert w == "encoder_nli" and "classification head" in why
    rep = audit(e, torch.optim.SGD(e.parameters(), lr=0.1))
    assert rep.status()["fused attention (SDPA)"] == "on"
    assert rep.status()["tensor-core friendly sizes"] == "off" and "1000" in rep.row("tensor-core friendly sizes").evidence


def test_bad_arguments_are_type_errors_naming_them():
    m = ConvAttention()
    with pytest.raises(TypeError, match="model"):
        audit("a model", torch.optim.AdamW(m.parameters()))
    with pytest.raises(TypeError, match="optimizer"):
        audit(m, {"lr": 1e-3})
    with pytest.raises(TypeError, match="optimizer"):
        hwlib.seeds.audit(m, None)                      # the module is callable too


def test_odd_objects_give_unknown_rows_not_crashes(tmp_path):
    class Odd(nn.Module):
        def named_modules(self, *a, **k):
            raise RuntimeError("no introspection here")
    rep = audit(Odd(), torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), loader=iter([1, 2]),
                run=tmp_path / "empty")
    assert rep.status()["channels_last"] == "unknown"
    assert "could not inspect" in rep.row("channels_last").evidence
    assert rep.status()["DataLoader workers"] == "unknown" and "not a torch DataLoader" in rep.row("pinned memory").evidence
    assert rep.workload is None and all(r.gain is None for r in rep.rows)
    assert "no results" in rep.workload_reason


def test_markdown_and_html_show_every_row():
    m = ConvAttention()
    rep = audit(m, torch.optim.AdamW(m.parameters(), fused=True), loader(num_workers=2))
    md, page = rep.markdown(), rep._repr_html_()
    assert md.count("\n| ") == len(rep.rows) + 1
    for r in rep.rows:
        assert f"| {r.optimization} |" in md and r.optimization in page
    assert "<table>" in page and "fused=True" in page


def test_the_structurally_closest_workload_is_used_when_the_run_has_it(tmp_path):
    run = tmp_path / "vit"
    for step, ms in (("04_sdpa_attention", 30.0), ("05_fused_optimizer", 24.0)):
        common = dict(notebook=step, workload="vit_bdh", step=step, profile="full",
                      device={"kind": "cuda", "name": "Test GPU"})
        results.append([results.make_record(metric="ms_per_step", value=ms, p20=ms, p80=ms, unit="ms", **common),
                        results.make_record(metric="samples_per_s", value=1e4 / ms, unit="samples/s", **common)], run)
    m = ConvAttention()
    rep = audit(m, torch.optim.AdamW(m.parameters(), fused=True), run=run)
    assert rep.workload == "vit_bdh" and "stand in" not in rep.workload_reason and rep.gpu == "Test GPU"
    assert rep.row("fused AdamW").gain == pytest.approx(1.25)
    assert "vit_bdh" in rep.row("fused AdamW").gain_text
    assert rep.row("torch.compile").gain is None


@pytest.mark.parametrize("module,cls,closest", [("vit_bdh", "VitBDHWorkload", "vit_bdh"),
                                                ("vit_bdh", "VitBDHLinearWorkload", "vit_bdh_linear"),
                                                ("encoder_nli", "EncoderNLIWorkload", "encoder_nli")])
def test_the_lab_workloads_are_recognised(module, cls, closest):
    mod = pytest.importorskip(f"hwlib.workloads.{module}")
    wl = getattr(mod, cls)()
    for attention in ("manual", "sdpa"):
        m = wl.build(wl.config("smoke"), Settings(attention=attention), 0)
        assert closest_workload(m)[0] == closest
        status = audit(m, torch.optim.AdamW(m.parameters())).status()["fused attention (SDPA)"]
        assert status == ("n/a" if closest == "vit_bdh_linear" else "on" if attention == "sdpa" else "off")
