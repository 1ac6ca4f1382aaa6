"""Step 31: the NLI encoder's packed batch padded to row-count buckets, its step replayed as a CUDA graph
per bucket. On a CPU the graphs are n/a: what is tested here is the part that changes the shapes the
math runs on (the padding rows change no loss and no gradient) and the bucket choice."""

import pytest
import torch

from hwlib.ladder.session import Session, build_model
from hwlib.steps import Precondition, chain, get_step, not_applicable, settings_for
from hwlib.steps.s31_bucketed_graphs import buckets as B
from hwlib.steps.s31_bucketed_graphs.graphs import BucketedGraphs
from hwlib.workloads import get_workload

STEP = "31_bucketed_graphs"


def _batch(cfg, i=0):
    wl = get_workload("encoder_nli")
    batches = wl.batches(cfg, torch.device("cpu"), 0, None, settings_for("11_sequence_packing"))
    try:
        return batches(i)
    finally:
        getattr(batches, "close", lambda: None)()


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = get_workload("encoder_nli").loss(model, batch)
    loss.backward()
    return loss.detach().double(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / max(a.norm(), b.norm(), torch.tensor(1e-300, dtype=torch.float64))).item()


@pytest.mark.parametrize("extra", [1, 3])
def test_padding_rows_change_no_loss_and_no_gradient_in_fp32(extra):
    cfg = get_workload("encoder_nli").config("smoke")
    model = build_model("encoder_nli", "11_sequence_packing", cfg, seed=5)
    with torch.no_grad():   # biases and gains away from 0 and 1: a padding row's bias gradient would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batch = _batch(cfg)
    R = batch[0].shape[0]
    padded = B.pad_rows(batch, R + extra)
    assert padded[0].shape == (R + extra, cfg.pack_len)
    assert (padded[2][R:] == -1).all() and (padded[0][R:] == 0).all() and (padded[1][R:] == 0).all()
    assert padded[3] is batch[3] and padded[4] is batch[4]
    (l0, g0), (l1, g1) = _loss_and_grads(model, batch), _loss_and_grads(model, padded)
    assert torch.isfinite(l1) and _rel(l0, l1) <= 1e-6, (l0, l1)
    worst = max((_rel(g0[n], g1[n]), n) for n in g0)
    assert worst[0] <= 1e-5, worst
    assert all(g1[n].abs().sum() > 0 for n in ("wte.weight", "blocks.0.attn.qkv.weight", "ln_emb.bias"))


def test_the_step_pads_through_its_model_and_keeps_step_11s_loss_and_gradients():
    cfg = get_workload("encoder_nli").config("smoke")
    before = build_model("encoder_nli", "11_sequence_packing", cfg, seed=3)
    after = build_model("encoder_nli", STEP, cfg, seed=3)
    assert after.row_buckets == B.default_buckets(cfg) and not hasattr(before, "row_buckets")
    assert [s.name for s in chain(STEP)][-2:] == ["11_sequence_packing", STEP]
    batch = _batch(cfg)
    small = tuple(t[:1] if i < 3 else t for i, t in enumerate(batch))   # 1 row: below every bucket
    keep = batch[3] < cfg.pack_len
    small = (*small[:3], batch[3][keep], batch[4][keep])
    seen = []
    h = after.register_forward_pre_hook(lambda m, a, k: seen.append(a[0].shape[0]), with_kwargs=True)
    (l0, g0), (l1, g1) = _loss_and_grads(before, small), _loss_and_grads(after, small)
    h.remove()
    assert seen == [after.row_buckets[0]] and after.row_buckets[0] > 1   # the model ran on padded rows
    assert _rel(l0, l1) <= 1e-6
    assert max(_rel(g0[n], g1[n]) for n in g0) <= 1e-5


def test_the_eager_bucketed_step_trains_as_step_11():
    """The session's step through BucketedGraphs without graphs (a CPU): three steps, the same losses and
    weights as step 11's session, the bucket's padding included."""
    cfg = get_workload("encoder_nli").config("smoke", n_layer=1)
    s = settings_for("11_sequence_packing")
    import dataclasses
    s = dataclasses.replace(s, compile=False, cuda_graphs=False, autocast=None, loader="simple")
    ref = Session("encoder_nli", cfg, s, torch.device("cpu"), seed=1, step="11_sequence_packing")
    ours = Session("encoder_nli", cfg, s, torch.device("cpu"), seed=1, step=STEP)
    assert ours.trainer is None   # no graphs on a CPU: the session steps as before
    runner = BucketedGraphs(ours.model, ours.model, ours.opt, ours.wl.loss, ours.autocast, (4, 6),
                            torch.device("cpu"))
    for i in range(3):
        a, b = ref.step(i), runner.step(ours.batches(i))
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item()), (i, a, b)
    for (n, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), n
    ref.close()
    ours.close()


def test_bucket_choice():
    assert B.bucket_for(3, (3, 4)) == 3 and B.bucket_for(1, (3, 4)) == 3 and B.bucket_for(4, (2, 4, 8)) == 4
    assert B.bucket_for(9, (3, 4)) == 9   # past the largest: a graph of its own, no error
    # rare counts pad up; the largest count stays whatever its share
    assert B.choose_buckets({3: 604, 4: 21}) == (3, 4)
    assert B.choose_buckets({2: 5, 3: 218, 4: 27}) == (3, 4)
    assert B.choose_buckets({1: 8, 2: 1242}) == (2,)
    assert B.choose_buckets({2: 5, 3: 218, 4: 27}, min_share=0.0) == (2, 3, 4)
    # too many buckets: merged where that adds the fewest padding rows
    assert B.choose_buckets({1: 10, 2: 10, 5: 10, 6: 10}, max_buckets=2, min_share=0.0) == (2, 6)
    st = B.bucket_stats({3: 6, 4: 2}, (4,), 512)
    assert st["padding rows"] == 6 and st["rows run"] == 32 and st["padding share"] == 6 / 32 and st["graphs"] == 1
    assert B.powers_of_two({3: 1, 5: 1, 8: 1}) == (4, 8)


def test_the_bucket_set_is_measured_on_the_loaders_row_counts():
    cfg = get_workload("encoder_nli").config("smoke")
    counts = B.row_counts(cfg)
    wl = get_workload("encoder_nli")
    assert sum(counts.values()) == cfg.n_samples // cfg.batch
    from hwlib.workloads.encoder_nli import _packed_rows, dataset
    first = [r for _, r in _packed_rows(dataset(cfg, 0), cfg, 0, 20)]
    assert B.row_counts(cfg, n_batches=20) == {r: first.count(r) for r in sorted(set(first))}
    assert max(B.default_buckets(cfg)) == max(counts) and wl.name == "encoder_nli"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="rows must be a positive int"):
        B.bucket_for(0, (3, 4))
    with pytest.raises(ValueError, match="buckets must be a non-empty increasing sequence"):
        B.bucket_for(3, (4, 3))
    with pytest.raises(ValueError, match="buckets must be a non-empty increasing sequence"):
        B.bucket_for(3, ())
    with pytest.raises(ValueError, match="counts must be a non-empty"):
        B.choose_buckets({})
    with pytest.raises(ValueError, match="max_buckets must be a positive int"):
        B.choose_buckets({3: 1}, max_buckets=0)
    with pytest.raises(ValueError, match="min_share must be in"):
        B.choose_buckets({3: 1}, min_share=1.5)
    batch = (torch.zeros(3, 8, dtype=torch.long),) * 3 + (torch.zeros(2, dtype=torch.long),) * 2
    with pytest.raises(ValueError, match="rows must be an int of at least the batch's 3 packed rows"):
        B.pad_rows(batch, 2)
    with pytest.raises(ValueError, match=r"batch must be a packed NLI batch \(ids, pos, seq, cls, labels\), got 3"):
        B.pad_rows(batch[:3], 4)
    with pytest.raises(ValueError, match="n_batches must be a positive int"):
        B.row_counts(get_workload("encoder_nli").config("smoke"), n_batches=0)


def test_applies_to_the_nli_encoder_only_is_gpu_only_and_says_what_it_needs():
    st = get_step(STEP)
    assert st.gpu_only and st.after == "11_sequence_packing" and st.trainer is not None
    assert not not_applicable(st, "encoder_nli") and all(not_applicable(st, w) for w in ("gpt", "vit_bdh", "resnet_bk"))
    with pytest.raises(Precondition, match="needs the NLI encoder"):
        st.apply(torch.nn.Linear(2, 2))


def test_the_prediction_is_a_bound_less_the_padding():
    from hwlib.roofline import Context
    from hwlib.steps.s31_bucketed_graphs.predict import padding_flops, predict
    cfg = get_workload("encoder_nli").config("smoke")
    ceil = {"copy_gbps": 100.0, "matmul_tflops": {"bf16": 10.0, "tf32": 5.0, "fp32": 1.0}}
    ctx = Context(workload="encoder_nli", step=STEP, profile="smoke", cfg=cfg, ceilings=ceil, elem=2,
                  precision="bf16", before="bf16", prev_ms=5.0, prev_floor_ms=1.0)
    p = predict(ctx)
    extra = padding_flops(cfg)
    assert p.kind == "bound" and extra > 0 and p.flops_removed == -extra
    assert p.saved_ms == pytest.approx(4.0 - extra / 10e12 * 1e3)
    assert padding_flops(get_workload("encoder_nli").config("full")) == 0.0   # its buckets are its row counts
