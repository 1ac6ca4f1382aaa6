"""The generation workload (notebook 14): the diversity score's implementations against the float64
reference (Triton interpreted on CPU), bad input, the sampler, the ladder's ways on a tiny model
(same greedy tokens, same trainer losses), the seed's gradient-free bonus and the policy-gradient
form against a float64 reference, and the records read back by the summary and the claims.
Tiny sizes throughout: seconds on a CPU."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

from hwlib import results  # noqa: E402
from hwlib.data import text as textdata  # noqa: E402
from hwlib.ops import diversity as dv  # noqa: E402
from hwlib.studies import generation as G  # noqa: E402
from hwlib.workloads import polychromic as pc  # noqa: E402

TRITON = dv.triton_available("cpu") is None or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def unit(P, N, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(P, N, D, generator=g, dtype=torch.float64), dim=-1).to(dtype)


# --- the score ------------------------------------------------------------------------------------

@pytest.mark.parametrize("P,N,D", [(1, 2, 1), (3, 3, 384), (5, 7, 33), (2, 8, 129), (67, 4, 17)])
def test_every_score_implementation_matches_the_float64_pairwise_definition(P, N, D):
    e = unit(P, N, D, seed=P * 100 + N)
    ref = dv.reference_score(e)
    # the reference itself against the Gram matrix in float64
    e64 = e.double()
    gram = e64 @ e64.transpose(1, 2)
    want = (N * N - gram.sum((1, 2))) / (N * (N - 1))    # sum_{i != j} (1 - e_i . e_j) / (N (N - 1))
    assert torch.allclose(ref, want, atol=1e-12)
    impls = ["pairwise", "closed"] + (["triton"] if TRITON else [])
    for impl in impls:
        got = dv.diversity_score(e.to(DEV), impl).double().cpu()
        assert (got - ref).abs().max() <= 1e-6, impl
    assert max(abs(a - b) for a, b in zip(dv.seed_scores(e), ref.tolist())) <= 1e-6


@pytest.mark.skipif(not TRITON, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_triton_kernel_reads_strided_input_and_partial_blocks():
    big = unit(70, 6, 40, seed=3)
    e = big[:, ::2]                        # non-contiguous in N: 3 replies
    assert not e.is_contiguous()
    got = dv.triton_score(e.to(DEV)).double().cpu()
    assert (got - dv.reference_score(e)).abs().max() <= 1e-6
    bp, bn, bd = dv._kernel().block_sizes(3, 40)
    assert (bn, bd) == (4, 64) and 70 % bp          # the last program's block is partial


def test_the_score_sees_identical_and_orthogonal_replies():
    same = unit(1, 1, 8).expand(1, 4, 8).contiguous()
    orth = torch.eye(4)[None]
    assert float(dv.diversity_score(same)) == pytest.approx(0.0, abs=1e-6)
    assert float(dv.diversity_score(orth)) == pytest.approx(1.0, abs=1e-6)


def test_bad_embeddings_get_an_error_naming_the_problem():
    with pytest.raises(ValueError, match="N must be >= 2"):
        dv.diversity_score(unit(2, 1, 8))
    with pytest.raises(ValueError, match="P = 0"):
        dv.diversity_score(torch.zeros(0, 3, 8))
    with pytest.raises(ValueError, match="not unit length.*normalize=True"):
        dv.diversity_score(2 * unit(2, 3, 8))
    with pytest.raises(ValueError, match="shape"):
        dv.diversity_score(unit(2, 3, 8)[0])
    bad = unit(2, 3, 8)
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        dv.diversity_score(bad)
    e = unit(3, 3, 8)
    assert torch.allclose(dv.diversity_score(5 * e, normalize=True), dv.diversity_score(e), atol=1e-6)
    with pytest.raises(Exception, match="impl"):
        dv.diversity_score(e, "cuda")


# --- config, prompts, sampling --------------------------------------------------------------------

@pytest.mark.parametrize("kw,says", [({"replies": 1}, "replies"), ({"prompts": 0}, "prompts"),
                                     ({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                     ({"prompt_len": 250, "new_tokens": 8}, "prompt_len")])
def test_bad_config_names_the_argument(kw, says):
    with pytest.raises(ValueError, match=says):
        pc.config("smoke", **kw)


def test_sampler_greedy_and_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    assert torch.equal(pc.sample_top_p(logits, torch.ones(4, 50), 0.9, 0.9), logits.argmax(-1))
    # top_p = 1: the exponential race draws from softmax(logits / T)
    row = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 20000
    noise = torch.empty(n, 5).exponential_(generator=g)
    draws = pc.sample_top_p(row.expand(n, 5), noise, 0.7, 1.0)
    freq = torch.bincount(draws, minlength=5).double() / n
    want = torch.softmax(row[0].double() / 0.7, 0)
    assert (freq - want).abs().max() < 0.015
    # top_p = 0.5: only the nucleus is ever drawn (here the top token holds more than half the mass)
    draws = pc.sample_top_p(row.expand(n, 5), noise, 0.7, 0.5)
    assert set(draws.tolist()) == {0}


# --- the workload on a tiny model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tr():
    tok = textdata.train_tokenizer(256, n_lines=2000, cache=False)
    cfg = pc.config("smoke", new_tokens=3, prompts=2, replies=3)
    return pc.Trainer(cfg, DEV, 0, tokenizer=tok)


def test_every_way_gives_the_same_greedy_tokens_and_valid_samples(tr):
    rows = G.greedy_rows(tr, list(G.RUNGS), 3)
    assert [r["status"] for r in rows] == ["ok"] * len(G.RUNGS)
    assert all(r["identical"] and r["agreement"] == 1.0 for r in rows), rows
    # float32: the cached, batched and static ways compute the seed's logits to rounding
    assert all(r["max_rel_logit_diff"] <= 1e-5 for r in rows if r["step"] != "14d_static_own"), rows
    from hwlib.workloads.polychromic.fused_decode import FusedDecoder
    for way in pc.WAYS:
        loop = FusedDecoder(tr.lm, tr.cfg, 6, tr.cfg.prompt_len + 3, DEV, rung="graph") if way == "fused" else None
        r = tr.generate(way, loop=loop)
        assert r.shape == (2, 3, 3) and int(r.min()) >= 0 and int(r.max()) < tr.cfg.vocab
    with pytest.raises(ValueError, match="loop: way 'fused' needs"):
        tr.generate("fused")


def test_the_seed_way_runs_without_the_kv_cache_and_eval_mode_with_it(tr):
    seen = []
    base = tr.lm.get_base_model().model
    h = base.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        L = tr.cfg.prompt_len
        for way, want in (("seed", [L, L + 1, L + 2]), ("eval_cache", [L, 1, 1])):
            seen.clear()
            pc.decode.generate(way, tr.lm, tr.prompts[:1], tr.cfg, greedy=True, new_tokens=3)
            assert seen[:3] == want, (way, seen)      # uncached: the whole sequence again per token
    finally:
        h.remove()
    assert tr.lm.training                              # the trainer's mode is restored


def test_train_mode_context_check_counts_what_each_forward_sees(tr):
    c = G.train_mode_context_check(tr, 3)
    L = tr.cfg.prompt_len
    assert c["uncached_tokens_per_decode_forward"] == pytest.approx(L + 1.5)    # L + 1, L + 2
    assert c["hf_tokens_per_decode_forward"] in (1, pytest.approx(L + 1.5))     # depends on the transformers version
    assert 0.0 <= c["greedy_agreement_hf_vs_uncached"] <= 1.0


@pytest.mark.gpu   # the trainer runs on the GPU there: its inputs must be made on its device
def test_bad_prompts_and_empty_replies_are_refused(tr):
    with pytest.raises(ValueError, match="prompts"):
        tr.generate("batched", prompts=tr.prompts[:0])
    long = torch.zeros(1, tr.cfg.max_positions, dtype=torch.long, device=tr.device)
    with pytest.raises(ValueError, match="longer than the context"):
        tr.generate("seed", prompts=long)
    with pytest.raises(ValueError, match="replies"):
        tr.round_trip(torch.zeros(2, 3, 4, dtype=torch.long, device=tr.device))      # all padding
    ids, mask = tr.round_trip(torch.full((1, 2, 4), 40, dtype=torch.long, device=tr.device))
    e = tr.encode(ids, mask)
    assert torch.allclose(torch.linalg.vector_norm(e, dim=-1).cpu(), torch.ones(2), atol=1e-5)


def test_the_ladder_leaves_the_trainer_losses_unchanged(tr, monkeypatch):
    a = G.measure_rung(tr, "14a_seed_way", 1)
    d = G.measure_rung(tr, "14d_static_own", 1, base_losses=a["losses"])
    e = G.measure_rung(tr, G.fused_step("graph"), 1, base_losses=a["losses"])    # the decode ladder's decoder
    assert a["status"] == d["status"] == e["status"] == "ok", e.get("reason")
    assert len(a["losses"]) == tr.cfg.every and d["quality_loss_max_rel_diff"] == e["quality_loss_max_rel_diff"] == 0.0
    assert e["step"] == "14e_fused_graph" and e["way"] == "fused"
    # Rung 14f: every trainer step of its prefix and cycle goes through the compiled LM, built once with the
    # CPU's compile backend, and the trainer is left eager. torch.compile is stood in for here: dynamo's
    # trace of this LoRA model costs 20-30 s of CPU (the H200 runs in outputs/reference/h200-cycle compile it
    # for real), and the decoder is rung graph's (top_p's Triton kernels interpreted cost 100 s).
    built, calls = [], []

    def compile_stand_in(model, backend):
        built.append((model, backend))
        return lambda **kw: calls.append(kw["input_ids"].shape) or model(**kw)
    monkeypatch.setattr(torch, "compile", compile_stand_in)
    monkeypatch.setenv("HWLIB_CPU_COMPILE_BACKEND", "aot_eager")
    tr._compiled_lm = None
    f = G.measure_rung(tr, G.COMPILED_TRAIN, 1, base_losses=a["losses"], decoder="graph")
    assert f["status"] == "ok", f.get("reason")
    assert built == [(tr.lm.get_base_model(), "aot_eager")]
    c = tr.cfg    # the untimed first step, the prefix's every - 1 steps and the cycle's last step
    assert len(calls) == (1 + c.every) * c.accum and set(calls) == {(c.batch, c.seq_len)}
    assert f["quality_loss_max_rel_diff"] == 0.0 and f["quality_tol"] == G.COMPILED_TRAIN_TOL
    assert tr._compiled is None and tr._compiled_lm is not None
    n = len(calls)
    tr.train_step(0)
    assert len(calls) == n          # eager again
    from hwlib.studies import trainer_cycle
    for r in (a, d, e, f):
        r["model_size"] = "smoke"
    lines = trainer_cycle.table([a, d, e, f]).splitlines()
    assert len(lines) == 6 and "14e_fused_graph" in lines[4] and lines[2].split("|")[5].strip() == "1.0x"
    assert all(line.rstrip().endswith("| yes |") for line in lines[2:5]) and "<= 0.01) |" in lines[5]
    # its records keep every metric (the cycle's shares too), and the pages read them back per size
    recs = G.rung_records([a, e, f], notebook="trainer_cycle", profile="full", device="cpu", params={},
                          fields={"model_size": "smoke"})
    assert {r["metric"] for r in recs if r["step"] == a["step"]} == set(G.RUNG_METRICS)
    results.append(recs, "cycle-run")
    from hwlib.report import pages, tables
    rows = tables.cycle_rows("cycle-run")
    assert [r["rung"] for r in rows] == ["14a_seed_way", "14e_fused_graph", "14f_compiled_train"]
    assert rows[0]["x"] is None and rows[2]["x"] == pytest.approx(e["ms_per_cycle"] / f["ms_per_cycle"])
    assert "| smoke | 14f_compiled_train |" in "\n".join(tables.cycle_lines(["cycle-run"]))
    line = pages.cycle_glance_line(["cycle-run"])
    slow = max((a, e, f), key=lambda r: r["ms_per_cycle"])
    assert f"smoke {slow['ms_per_cycle'] / 1e3:.1f} s per cycle at {slow['step']}" in line
    assert pages.cycle_glance_line(["no-such-run"]) is None
    f["quality_loss_max_rel_diff"] = 0.02       # past its tolerance: said, not hidden
    assert trainer_cycle.table([f]).splitlines()[2].endswith("| NO (2.0e-02 > 0.01) |")
    for r in (a, d):
        assert sum(r[f"share_{p}"] for p in pc.PHASES) == pytest.approx(1.0)
        assert r["share_generation_of_overhead"] + r["share_diversity_of_overhead"] == pytest.approx(1.0)
        assert r["gen_tokens_per_s"] > 0 and r["decode_share_of_copy"] is None    # no ceiling given
    recs = G.rung_records([a, d], notebook="14_generation_diversity", profile="smoke", device="cpu", params={})
    results.append(recs)
    from hwlib.report import tables
    steps = tables.summary()["generation"]["steps"]
    assert [s["step"] for s in steps] == ["14a_seed_way", "14d_static_own"]
    assert steps[0]["share_generation"] == pytest.approx(a["share_generation"])


def test_a_cycle_from_the_prefix_trains_as_a_whole_cycle_from_the_start(tr):
    pre = G.prefix(tr)
    assert len(pre["losses"]) == tr.cfg.every - 1 and pre["seconds"] > 0
    whole = []   # the cycle the old way: every step from the start, the bonus before the last
    tr.reset()
    for k in range(tr.cfg.every - 1):
        whole.append(float(tr.train_step(k)))
    state = [p.detach().clone() for p in tr.params]
    assert whole == pre["losses"]
    c1, c2 = G.cycle(tr, "batched", pre), G.cycle(tr, "batched", pre)
    assert c1["losses"][:-1] == c2["losses"][:-1] == pre["losses"]
    assert c1["losses"][-1] == c2["losses"][-1]            # the restore is exact, and leaves the snapshot as it was
    assert all(torch.equal(a, b) for a, b in zip(pre["state"]["params"], state))
    assert c1["seconds"]["training"] > pre["seconds"] and c1["seconds"]["generation"] > 0
    # the step after the bonus moves the weights from the snapshot: restore must undo it
    assert not all(torch.equal(p, q) for p, q in zip(tr.params, state))
    tr.restore(pre["state"])
    assert all(torch.equal(p, q) for p, q in zip(tr.params, state))


def test_the_seed_bonus_has_no_gradient_and_the_policy_gradient_has_one(tr):
    g0 = pc.seed_objective_grads(tr, 0.0, 0.7)
    g3 = pc.seed_objective_grads(tr, 0.3, 0.7)
    assert all(torch.equal(a, b) for a, b in zip(g0, g3))
    assert sum(float(g.abs().sum()) for g in g0) > 0
    chk = G.pg_check(DEV, tokenizer=tr.tok)
    assert chk["grad_norm"] > 0 and chk["rel_err"] < 1e-4, chk
    assert chk["grad_norm"] == pytest.approx(chk["ref_norm"], rel=1e-4)


def test_a_bad_rung_is_refused_by_name():
    with pytest.raises(ValueError, match="rung"):
        G.fused_step("warp")
    with pytest.raises(ValueError, match="step"):
        G.measure_rung(None, "14z_nothing", 1)
    with pytest.raises(ValueError, match="decoder: only 14f_compiled_train"):
        G.measure_rung(None, "14c_batched", 1, decoder="graph")
    with pytest.raises(ValueError, match="rung"):
        G.measure_rung(None, G.COMPILED_TRAIN, 1, decoder="warp")
    from hwlib.studies import trainer_cycle
    assert trainer_cycle._rung("top_p") == "14e_fused_top_p" and trainer_cycle._rung("14c_batched") == "14c_batched"
    with pytest.raises(SystemExit):
        trainer_cycle.main(["--out", "/nonexistent/x", "--rungs", "warp"])
    with pytest.raises(SystemExit):
        trainer_cycle.main(["--out", "/nonexistent/x", "--cycles", "top_p=0"])


def test_rewards_and_advantages():
    e = unit(3, 4, 16, seed=5)
    r = pc.rewards(e)
    e64 = e.double()
    want = torch.tensor([[sum(1 - float(e64[p, i] @ e64[p, j]) for j in range(4) if j != i) / 3
                          for i in range(4)] for p in range(3)], dtype=r.dtype)
    assert torch.allclose(r, want, atol=1e-6)
    assert torch.allclose(r.mean(1), dv.closed_form_score(e), atol=1e-6)    # the baseline is D_p
    assert torch.allclose(pc.advantages(e).sum(1), torch.zeros(3), atol=1e-6)


# --- the claims read the records ------------------------------------------------------------------

def test_seed_001_claims_read_the_generation_records(tmp_path):
    from hwlib.seeds import verdicts
    gpu = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}

    def rec(step, metric, value, **fields):
        return results.make_record(notebook="14_generation_diversity", workload=G.WORKLOAD, step=step, metric=metric, value=value,
                                   unit="x", device=gpu, fields=fields, p20=value, p80=value)
    run = tmp_path / "gen"
    results.append([rec("14a_seed_way", "share_generation_of_overhead", 0.93),
                    rec("14a_seed_way", "share_diversity_of_overhead", 0.07),
                    rec("14a_seed_way", "ms_per_cycle", 60000.0), rec("14d_static_own", "ms_per_cycle", 3000.0),
                    rec("14c_batched", "ms_per_cycle", 4000.0, attn="eager"),
                    rec("14c_batched", "ms_per_cycle", 3500.0, attn="sdpa"),
                    rec(None, "score_ms", 0.2, impl="seed_loop", N=3, P=4),
                    rec(None, "score_ms", 0.01, impl="triton", N=3, P=4),
                    rec(None, "score_ms", 0.02, impl="closed", N=3, P=4)], run)
    rows = {r["claim"]: r for r in verdicts.evaluate(run) if r["seed"] == "001"}
    assert len(rows) == 5
    assert rows["Generating N=3 replies one by one is most of the overhead"]["measured"] == pytest.approx(0.93)
    assert rows["Diversity scoring is the next largest cost"]["measured"] == pytest.approx(0.07)
    fa = rows["FlashAttention-2 (tier 1)"]
    assert fa["measured"] == pytest.approx(4000 / 3500) and fa["verdict"] == "partly"
    tri = rows["Triton pairwise-distance kernel (tier 2)"]
    assert tri["measured"] == pytest.approx(20.0) and tri["verdict"] == "holds"
    assert "closed form" in tri["note"]
    cuda = rows["Raw CUDA kernels (tier 3): training 12 h -> 3-4 h"]
    assert cuda["measured"] == pytest.approx(20.0) and cuda["to"] == "14d_static_own"
    assert not math.isnan(cuda["measured"])


def test_a_divergence_counts_as_a_tie_only_where_the_top_two_logits_are_within_the_noise():
    from hwlib.studies.generation import divergence_ties
    same = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])          # reply 0 parts at position 2
    base = torch.zeros(2, 4, 5)
    base[0, 2, 1], base[0, 2, 3] = 2.0, 1.99                      # a near-tie at the divergence
    other = base.clone()
    other[0, 0, 0] += 0.05                                        # numerics: 0.05 where contexts were shared
    r = divergence_ties(same, other, base)
    assert r == {"divergences": 1, "divergences_at_ties": 1, "logit_noise": pytest.approx(0.05)}
    base[0, 2, 3] = 1.0                                           # a clear margin: a real difference
    assert divergence_ties(same, other, base)["divergences_at_ties"] == 0
    assert divergence_ties(same, None, base)["divergences_at_ties"] is None
    base[0, 2, 3] = 1.99
    assert divergence_ties(same, None, base, noise=0.05)["divergences_at_ties"] == 1   # borrowed noise
    assert divergence_ties(same, None, base, noise=0.001)["divergences_at_ties"] == 0
    assert divergence_ties(torch.ones(2, 4, dtype=torch.long), other, base)["divergences"] == 0


def test_the_warm_up_meets_every_shape_the_timed_generations_meet(tr, monkeypatch):
    seen = []
    real = pc.decode.generate_per_reply

    def spy(pm, prompts, cfg, **kw):
        seen.append(("per_reply", prompts.shape[0], cfg.replies, kw.get("new_tokens")))
        return real(pm, prompts, cfg, **kw)
    monkeypatch.setattr(pc.decode, "generate_per_reply", spy)
    G.warm_up(tr, "seed")
    assert seen == [("per_reply", 1, 1, None)]      # one reply of one prompt, at the full length
    calls = []
    monkeypatch.setattr(tr, "generate", lambda way, **kw: calls.append((way, kw)))
    G.warm_up(tr, "batched")
    assert calls == [("batched", {"loop": None})]      # the bonus's whole generation


def test_the_attention_arms_alternate_and_each_has_a_spread(tr, monkeypatch):
    base = tr.lm.get_base_model()
    was = base.config._attn_implementation
    order = []
    real = G.cycle

    def spy(t, way, pre):
        order.append(base.config._attn_implementation)
        return real(t, way, pre)
    monkeypatch.setattr(G, "cycle", spy)
    rows = G.attention_rows(tr, "14c_batched", pairs=2)
    assert order == ["eager", "sdpa", "eager", "sdpa"]
    assert base.config._attn_implementation == was
    assert [r["attn"] for r in rows] == ["eager", "sdpa"]
    for r in rows:
        assert r["status"] == "ok" and r["cycles"] == 2
        assert r["ms_p20"] <= r["ms_per_cycle"] <= r["ms_p80"]
    recs = G.rung_records(rows, notebook="14_generation_diversity", profile="smoke", device="cpu", params={})
    assert [(x["fields"], x["metric"]) for x in recs] == [({"attn": "eager"}, "ms_per_cycle"),
                                                          ({"attn": "sdpa"}, "ms_per_cycle")]
    with pytest.raises(ValueError, match="pairs"):
        G.attention_rows(tr, "14c_batched", pairs=0)
