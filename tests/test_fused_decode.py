"""The fused decode ladder (issue 47) on a CPU: the bytes a decode step moves counted by hand for a
tiny config; every rung's greedy tokens and logits against Hugging Face's own forward (float32, LoRA
nonzero and changed after the decoder was built, so the merged weights must follow); the two Triton
kernels (interpreted) against float64 references at odd sizes; bad input. Tiny sizes: seconds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from hwlib.device import ChoiceError  # noqa: E402
from hwlib.workloads.polychromic import build, decode, fused_decode as fd  # noqa: E402
from hwlib.workloads.polychromic.config import PolyConfig, config  # noqa: E402

TINY = PolyConfig(vocab=10, hidden=4, intermediate=6, layers=1, heads=2, kv_heads=1, head_dim=2,
                  tie_embeddings=True, dtype="fp32", prompt_len=2, new_tokens=4)


def test_step_bytes_of_a_tiny_config_counted_by_hand():
    b = fd.step_bytes(TINY, rows=3, length=5)
    # block: q,k,v 4x(4+2+2) + o 4x4 + gate,up,down 3x4x6 + two norms 2x4 + q/k norms 2x2 = 132 parameters;
    # + final norm 4 + head 10x4 (tied: the whole table) + 3 embedding rows x 4; float32
    assert b["weights"] == 4 * (132 + 4 + 40 + 12) == 752
    assert b["kv_read"] == 3 * 1 * 2 * 2 * 4 * 5 == 240       # rows, layers, K and V, kv width, bytes, length
    assert b["kv_write"] == 48
    assert b["activations"] == 4 * (1 * 2 * 3 * 4 + 2 * 3 * 10) == 336   # residual in/out per layer, logits w+r
    assert b["total"] == 752 + 240 + 48 + 336
    # a generation's decode steps attend L+1 .. L+T-1 positions: the mean is L + T/2
    m = fd.generation_step_bytes(TINY, 3, prompt_len=2, new_tokens=4)
    assert m["kv_read"] == pytest.approx(48 * (2 + 4 / 2))
    assert m["weights"] == b["weights"]
    bw = fd.bandwidth(2e9, 1.0, copy_gbps=4000.0)
    assert bw["gbps"] == pytest.approx(2000.0) and bw["share_of_copy"] == pytest.approx(0.5)
    assert bw["floor_ms"] == pytest.approx(0.5)
    assert fd.bandwidth(2e9, 1.0, None)["share_of_copy"] is None


def test_step_weight_bytes_agree_with_the_built_model():
    cfg = config("smoke")
    m = build.build_lm(cfg, "cpu", 0)
    rows = 5
    assert fd.step_bytes(cfg, rows, 1)["weights"] == build.weight_bytes(m) + 4 * rows * cfg.hidden
    untied = config("smoke", tie_embeddings=False)
    m = build.build_lm(untied, "cpu", 0)
    assert fd.step_bytes(untied, rows, 1)["weights"] == build.weight_bytes(m) + 4 * rows * cfg.hidden


@pytest.mark.parametrize("kw,says", [(dict(rows=0, length=1), "rows"), (dict(rows=2, length=0), "length"),
                                     (dict(rows=2.0, length=3), "rows")])
def test_step_bytes_refuses_bad_sizes(kw, says):
    with pytest.raises(ValueError, match=says):
        fd.step_bytes(TINY, **kw)
    with pytest.raises(ValueError, match="new_tokens"):
        fd.generation_step_bytes(TINY, 2, 2, 1)
    with pytest.raises(ValueError, match="ms"):
        fd.bandwidth(1.0, 0.0, None)


@pytest.fixture(scope="module")
def lm():
    # one layer: the interpreted Triton kernels cost about 50 ms a program on a CPU
    cfg = config("smoke", layers=1, prompts=1, replies=2, new_tokens=3)
    pm = build.add_lora(build.build_lm(cfg, "cpu", 0), cfg, 0)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.tok_vocab, (cfg.prompts, cfg.prompt_len), generator=g)
    return cfg, pm, prompts


def _lora_b(pm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def _full_logits(pm, prompts, replies, cfg):
    """Logits of the model's own uncached forward over prompt + reply, at the positions that
    produced each reply token: [P, T, V] for each prompt's first reply."""
    rows = prompts.repeat_interleave(cfg.replies, 0)
    seq = torch.cat([rows, replies.reshape(rows.shape[0], -1)], 1)
    with torch.no_grad():
        full = pm.get_base_model()(input_ids=seq, use_cache=False).logits
    L = prompts.shape[1]
    return full[::cfg.replies, L - 1:L - 1 + replies.shape[-1]]


def test_every_rung_decodes_the_models_own_greedy_tokens_and_follows_lora(lm, triton_device):
    if triton_device == "cuda":   # seen in make test-gpu on an H100: "Pointer argument cannot be accessed (cpu tensor?)"
        pytest.skip("decodes CPU tensors through interpreted Triton; where Triton compiles it takes CUDA tensors only")
    cfg, pm, prompts = lm
    _lora_b(pm, 1)
    B = cfg.prompts * cfg.replies
    decs = {r: fd.FusedDecoder(pm, cfg, B, cfg.prompt_len + cfg.new_tokens, "cpu", rung=r) for r in fd.ALL_RUNGS}
    _lora_b(pm, 2)                      # after the decoders copied their weights: each call must merge again
    ref = decode.generate_batched(pm, prompts, cfg, greedy=True)
    for r, dec in decs.items():
        assert not dec.use_graph
        kept: list = []
        got = dec(prompts, greedy=True, keep_logits=kept)
        assert torch.equal(got, ref), r
        lo = fd.greedy_logits_rows(kept, cfg.prompts, cfg.replies)
        want = _full_logits(pm, prompts, got, cfg)
        assert lo.shape == want.shape
        assert float((lo - want).abs().max()) <= 1e-5 * float(want.abs().max()), r
    torch.manual_seed(0)
    s = decs["graph"](prompts)
    assert s.shape == ref.shape and int(s.min()) >= 0 and int(s.max()) < cfg.vocab


def _rope_ref(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


def test_triton_kernels_match_float64_references_at_odd_sizes(triton_device):
    from hwlib.workloads.polychromic import decode_kernels as dk
    g = torch.Generator().manual_seed(3)
    B, H, HKV, D, S, pos = 2, 6, 2, 16, 80, 70      # GQA group of 3 (padded to 16), 71 positions: 2 blocks
    dev = triton_device
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)   # noqa: E731
    qkv, qn, kn = r(B, (H + 2 * HKV) * D), 1 + 0.1 * r(D), 1 + 0.1 * r(D)
    ang = r(S, D // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    kc, vc = r(B, HKV, S, D), r(B, HKV, S, D)
    p = torch.tensor([pos])
    f32 = lambda t: t.float().to(dev).contiguous()   # noqa: E731
    q_out, kc32, vc32 = torch.empty(B, H, D, device=dev), f32(kc), f32(vc)
    dk.qk_norm_rope_cache(f32(qkv), f32(qn), f32(kn), f32(cos), f32(sin), p.to(dev), q_out, kc32, vc32, 1e-6, H, HKV)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(B, H, D), k.view(B, HKV, D), v.view(B, HKV, D)
    norm = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)   # noqa: E731
    qr, kr = _rope_ref(norm(q, qn), cos[pos], sin[pos]), _rope_ref(norm(k, kn), cos[pos], sin[pos])
    assert (q_out.double().cpu() - qr).abs().max() < 1e-5
    kc[:, :, pos], vc[:, :, pos] = kr, v
    assert (kc32.double().cpu() - kc).abs().max() < 1e-5      # the rest of the cache untouched
    assert (vc32.double().cpu() - vc).abs().max() < 1e-6

    out = torch.empty(B, H, D, device=dev)
    scale = D ** -0.5
    dk.decode_attention(f32(qr), f32(kc), f32(vc), p.to(dev), out, scale)
    kg = kc[:, :, :pos + 1].repeat_interleave(H // HKV, 1)       # positions past pos never count
    vg = vc[:, :, :pos + 1].repeat_interleave(H // HKV, 1)
    att = torch.softmax(torch.einsum("bhd,bhsd->bhs", qr, kg) * scale, -1)
    want = torch.einsum("bhs,bhsd->bhd", att, vg)
    assert (out.double().cpu() - want).abs().max() < 1e-5


def test_matvec_kernel_matches_float64_in_every_form_at_odd_sizes(triton_device):
    from hwlib.ops.sources import load_python_kernel
    mv = load_python_kernel("14_decode_matvec_triton.py")
    g = torch.Generator().manual_seed(11)
    dev = triton_device
    # rows 3 and 13 of the 16 a tile holds, N and K off every tile size, K split unevenly
    for M, N, K, split in ((3, 100, 200, 3), (13, 70, 130, 2)):
        x = torch.randn(M, K, generator=g, dtype=torch.float64)
        w = torch.randn(N, K, generator=g, dtype=torch.float64) * K ** -0.5
        xf, wf = x.float().to(dev), w.float().to(dev)
        for form, sp in (("plain", 1), ("split", split), ("gated", 1)):
            out = torch.full(mv.out_shape(M, N, form, sp), float("nan"), device=dev)
            mv.matvec(xf, wf, out, form, split=sp, block_n=16, block_k=32, num_stages=2)
            got = (out.sum(0) if form == "split" else out).double().cpu()
            want = mv.reference(x, w, form)
            assert got.shape == want.shape, form
            assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max()), (form, M, N, K)
    x = torch.randn(17, 64)
    with pytest.raises(ValueError, match="x: 17 rows"):
        mv.matvec(x.to(dev), torch.randn(8, 64, device=dev), torch.empty(17, 8, device=dev))
    with pytest.raises(ValueError, match="out: shape"):
        mv.matvec(x[:4].to(dev), torch.randn(8, 64, device=dev), torch.empty(4, 8, device=dev), "gated")
    assert mv.config(1024, 2048, "split", 132)["split"] == 8 and mv.config(4096, 4096, "plain", 132)["split"] == 1


def test_bad_rung_backend_and_sizes_are_refused(lm):
    cfg, pm, prompts = lm
    with pytest.raises(ChoiceError):
        fd.FusedDecoder(pm, cfg, 2, 16, "cpu", rung="megakernel")
    with pytest.raises(ChoiceError):
        fd.FusedDecoder(pm, cfg, 2, 16, "cpu", rung="graph", sdpa_backend="fast")
    dec = fd.FusedDecoder(pm, cfg, 2, cfg.prompt_len + 2, "cpu", rung="concat")
    with pytest.raises(ValueError, match="do not fit"):
        dec(prompts, new_tokens=3)


def test_the_sorted_sampler_draws_what_the_reference_sampler_draws():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g).to(torch.bfloat16)     # bf16: many tied logits
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1                  # a tie at the top: the first wins
    for temp, top_p in ((0.9, 0.9), (1.0, 1.0), (0.5, 0.3)):
        noise = torch.empty(6, 300).exponential_(generator=g)
        assert torch.equal(fd.sample_top_p_sorted(logits, noise, temp, top_p), decode.sample_top_p(logits, noise, temp, top_p))
    ones = torch.ones(6, 300)
    got = fd.sample_top_p_sorted(logits, ones, 0.9, 0.9)
    assert torch.equal(got, logits.float().argmax(-1)) and int(got[0]) == 3


def test_the_fused_target_takes_the_best_rung_against_its_model_sizes_share():
    from hwlib.studies import generation as G
    rows = [{"rung": "graph", "batch": 12, "status": "ok", "decode_gbps": 1300.0, "decode_share_of_copy": 0.43},
            {"rung": "decode_attn", "batch": 12, "status": "ok", "decode_gbps": 2259.0, "decode_share_of_copy": 0.748},
            {"rung": "sampler", "batch": 12, "status": "failed", "decode_gbps": None}]
    (t,) = G.targets([], rows, "qwen3_8b")
    assert t["met"] is False and t["value"] == 0.748 and "decode_attn" in t["measured"] and "75%" in t["target"]
    (t,) = G.targets([], rows, "qwen3_0.6b")
    assert t["met"] is True and "50%" in t["target"]
    assert G.targets([], rows, "smoke") == [] and G.targets([], None, "qwen3_8b") == []


def test_each_rung_is_compared_with_the_one_it_builds_on():
    rows = [("m", "graph", 4.0), ("m", "rope_cache", 2.0), ("m", "rope_cache[math]", 4.0), ("m", "decode_attn", 1.6),
            ("m", "14d_static_own", 3.0), ("n", "graph", 10.0), ("m", "matvec", None), ("n", "matvec", 8.0),
            ("m", "top_p", 0.8)]
    # a variant against its rung; the earlier loop and a failed rung against nothing; a failed rung is skipped over
    assert fd.speedups(rows) == [None, 2.0, 0.5, 1.25, None, None, None, 1.25, 2.0]
