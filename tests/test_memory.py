import dataclasses
import os

import pytest
import torch

from hwlib.memory import (ResilientStep, accumulate, load_checkpoint, plan_micro_batches, save_checkpoint,
                          search_batch, split_batch)
from hwlib.memory.checkpoint import CheckpointError
from hwlib.memory.offload import OffloadedAdamW
from hwlib.memory.tracker import MemoryTracker
from hwlib.steps import Settings, settings_for
from hwlib.ladder.session import Session, make_optimizer
from hwlib.workloads import get_workload
from hwlib.workloads import gpt as gpt_mod
from hwlib.workloads.checkpointing import parse_checkpointing
from hwlib.workloads.gpt import GPTWorkload

WL = get_workload("gpt")
CPU = torch.device("cpu")


# --- exact accumulation -------------------------------------------------------------------------

def test_plan_is_exact_for_any_target():
    assert plan_micro_batches(128, 13) == [13] * 9 + [11]
    assert plan_micro_batches(128, 128) == [128] and plan_micro_batches(5, 8) == [5]
    for t in range(1, 60):
        for m in range(1, 20):
            p = plan_micro_batches(t, m)
            assert sum(p) == t and max(p) <= m and all(x == p[0] for x in p[:-1])


@pytest.mark.parametrize("target,err,match", [(0, ValueError, "at least one sample"),
                                              (12.5, TypeError, "whole number"), (True, TypeError, "whole number"),
                                              ("64", TypeError, "whole number")])
def test_bad_targets_are_clear_errors(target, err, match):
    with pytest.raises(err, match=match):
        plan_micro_batches(target, 4)


def _model_and_batch(n=8, seed=0):
    cfg = WL.config("smoke")
    model = WL.build(cfg, Settings(), seed=seed).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab, (n, 17), generator=g)
    return model, (x, torch.roll(x, -1, 1))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _fb(model):
    def fb(mb, w):
        loss = model(*mb)
        (loss * w).backward()
        return loss.detach()
    return fb


def test_accumulated_gradient_equals_large_batch_gradient():
    model, batch = _model_and_batch(n=11)
    model(*batch).backward()
    full = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = accumulate(_fb(model), batch, plan_micro_batches(11, 4))   # 4 + 4 + 3, the last one smaller
    for a, b in zip(_grads(model), full):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
    model.zero_grad(set_to_none=True)
    assert loss.item() == pytest.approx(model(*batch).item(), rel=1e-12)


def test_split_batch_checks_sizes():
    x = torch.arange(10)
    assert [t.tolist() for t in split_batch(x, [4, 6])] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="add up to 9"):
        split_batch((x, x), [4, 5])
    with pytest.raises(ValueError, match="disagree"):
        split_batch((x, x[:5]), [5, 5])


def test_loss_that_is_not_a_scalar_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(GPTWorkload, "loss", lambda self, model, batch: model(batch[0]))  # logits, no loss
    sess = Session("gpt", WL.config("smoke"), Settings(), CPU)
    with pytest.raises(TypeError, match="loss must be a scalar tensor"):
        sess.step(0)


# --- OOM-resilient step -------------------------------------------------------------------------

def test_resilient_step_splits_on_oom_and_keeps_every_sample():
    model, batch = _model_and_batch(n=8)
    model(*batch).backward()
    full = _grads(model)
    model.zero_grad(set_to_none=True)
    seen, steps = [], []

    def fb(mb, w):
        seen.append(mb[0].shape[0])
        if mb[0].shape[0] > 2:   # a simulated device that fits 2 samples
            model(*mb).backward()  # a partial gradient is left behind, as a real OOM in backward would
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return _fb(model)(mb, w)

    rs = ResilientStep(fb, lambda: steps.append([p.grad.clone() for p in model.parameters()]),
                       lambda: model.zero_grad(set_to_none=True), CPU, micro_batch=8)
    rs(batch, step=0)
    assert [(e.micro_before, e.micro_after) for e in rs.events] == [(8, 4), (4, 2)]
    assert rs.history == [{"step": 0, "samples": 8, "micro_batch": 2, "micro_batches": 4}]
    assert len(steps) == 1   # one optimizer step, after the successful attempt only
    for a, b in zip(steps[0], full):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
    assert seen[-4:] == [2, 2, 2, 2]


def test_oom_at_micro_batch_one_gives_up_clearly():
    def fb(mb, w):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    rs = ResilientStep(fb, lambda: None, lambda: None, CPU, micro_batch=4)
    with pytest.raises(MemoryError, match="even at micro-batch 1"):
        rs((torch.zeros(4, 3),), step=7)
    assert [e.micro_after for e in rs.events] == [2, 1]


# --- batch-size finder --------------------------------------------------------------------------

def test_finder_predicts_and_measures_a_linear_peak():
    calls = []

    def try_batch(b):
        calls.append(b)
        return None if b > 100 else 2.0 + 0.5 * b
    r = search_batch(try_batch, capacity_gib=40.0, margin=0.1)
    assert r.budget_gib == pytest.approx(36.0)
    assert r.batch == 68 and r.measured_peak_gib == pytest.approx(36.0)
    assert r.predicted_peak_gib == pytest.approx(r.measured_peak_gib)
    assert calls == [1, 2, 4, 8, 16, 32, 64, 128, 68]


def test_finder_steps_down_when_the_prediction_overshoots():
    peak = lambda b: 1.0 + 0.2 * b + 0.01 * b * b   # convex: the line through small batches is too hopeful
    r = search_batch(peak, capacity_gib=20.0, margin=0.2)
    assert peak(r.batch) <= 16.0 and r.measured_peak_gib == pytest.approx(peak(r.batch))
    assert all(t["fits"] == (t["peak_gib"] <= 16.0) for t in r.trials)


def test_finder_errors():
    with pytest.raises(MemoryError, match="batch 1 does not fit"):
        search_batch(lambda b: None, capacity_gib=10.0)
    with pytest.raises(ValueError, match="margin"):
        search_batch(lambda b: 1.0, capacity_gib=10.0, margin=1.5)
    with pytest.raises(TypeError, match="whole number"):
        search_batch(lambda b: 1.0, capacity_gib=10.0, start=0.5)


def test_expandable_segments_keeps_other_allocator_options(monkeypatch):
    from hwlib.memory import allocator
    monkeypatch.setenv(allocator.ENV, "max_split_size_mb:256,expandable_segments:False")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert allocator.settings() == "max_split_size_mb:256,expandable_segments:False"
    out = allocator.use_expandable_segments()
    assert os.environ[allocator.ENV] == "max_split_size_mb:256,expandable_segments:True"
    assert calls == ["expandable_segments:True"]
    assert out == "max_split_size_mb:256,expandable_segments:True" == allocator.settings()
    monkeypatch.setenv(allocator.ENV, "expandable_segments")
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF.*key:value"):
        allocator.settings()


# --- offloaded optimizer ------------------------------------------------------------------------

def test_offloaded_adamw_matches_torch_adamw():
    cfg = WL.config("smoke")
    a = WL.build(cfg, Settings(), seed=0)
    b = WL.build(cfg, Settings(), seed=0)
    ref = torch.optim.AdamW([{"params": [p for p in a.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in a.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    off = OffloadedAdamW([{"params": [p for p in b.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                          {"params": [p for p in b.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                         lr=3e-3, betas=(0.9, 0.95), eps=1e-8, bucket_params=5000)
    assert len(off.buckets) > 4 and max(off.sizes) == 5000   # parameters larger than a bucket are split
    assert sum(off.sizes) == sum(p.numel() for p in b.parameters())
    x = torch.randint(0, cfg.vocab, (4, 16))
    for _ in range(5):
        for m, o in ((a, ref), (b, off)):
            m(x, torch.roll(x, -1, 1)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    assert off.state_bytes_on_host == 8 * sum(p.numel() for p in b.parameters())


# --- checkpoint and resume ----------------------------------------------------------------------

def _train(sess, start, stop):
    return [sess.step(i).item() for i in range(start, stop)]


@pytest.mark.parametrize("settings", [settings_for("05_fused_optimizer"), Settings(offload_optimizer=True)],
                         ids=["bf16-sdpa-fused", "offload"])
def test_resume_gives_the_same_losses_bit_for_bit(tmp_path, settings):
    cfg = WL.config("smoke")
    straight = _train(Session("gpt", cfg, settings, CPU, seed=0), 0, 6)
    first = Session("gpt", cfg, settings, CPU, seed=0)
    losses = _train(first, 0, 3)
    save_checkpoint(tmp_path / "run.ckpt", first, next_step=3, losses=losses)
    del first                                                      # the run is killed between steps
    resumed = Session("gpt", cfg, settings, CPU, seed=0)
    _train(resumed, 0, 2)          # a different model and optimizer state: the checkpoint must win
    nxt, losses = load_checkpoint(tmp_path / "run.ckpt", resumed)
    assert nxt == 3
    assert losses + _train(resumed, nxt, 6) == straight


def test_truncated_damaged_or_foreign_checkpoints_are_refused(tmp_path):
    cfg = WL.config("smoke")
    sess = Session("gpt", cfg, Settings(), CPU)
    path = save_checkpoint(tmp_path / "a.ckpt", sess, next_step=1)
    good = path.read_bytes()
    (tmp_path / "t.ckpt").write_bytes(good[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "t.ckpt", sess)
    bad = bytearray(good)
    bad[-10] ^= 0xFF
    (tmp_path / "d.ckpt").write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(tmp_path / "d.ckpt", sess)
    other = Session("gpt", WL.config("smoke", d_model=32), Settings(), CPU)
    before = [p.clone() for p in other.model.parameters()]
    with pytest.raises(CheckpointError, match="another config: d_model: checkpoint 64, this run 32"):
        load_checkpoint(path, other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.model.parameters()))   # nothing changed
    with pytest.raises(CheckpointError, match="data seed 0, this run 5"):
        load_checkpoint(path, Session("gpt", cfg, Settings(), CPU, seed=5))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "none.ckpt", sess)
    assert path.read_bytes() == good


def test_a_save_killed_midway_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    sess = Session("gpt", WL.config("smoke"), Settings(), CPU)
    path = save_checkpoint(tmp_path / "ckpt" / "a.ckpt", sess, next_step=1)
    good = path.read_bytes()
    sess.step(0)

    def killed(*a, **k):
        raise KeyboardInterrupt("killed while saving")
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, sess, next_step=2)
    monkeypatch.undo()
    assert path.read_bytes() == good and [p.name for p in path.parent.iterdir()] == ["a.ckpt"]
    assert load_checkpoint(path, sess)[0] == 1


# --- activation checkpointing and the tracker ---------------------------------------------------

@pytest.mark.parametrize("spec", ["all", "0", "all,head", "head"])
def test_activation_checkpointing_is_the_same_function(spec, monkeypatch):
    monkeypatch.setattr(gpt_mod, "HEAD_CHUNK", 7)   # several chunks, the last one short
    cfg = WL.config("smoke")
    a = WL.build(cfg, Settings(), seed=0).double()
    b = WL.build(cfg, Settings(checkpointing=spec), seed=0).double()
    assert (b.checkpointed, b.checkpoint_head) == parse_checkpointing(spec, cfg.n_layer)
    x = torch.randint(0, cfg.vocab, (2, 20))
    la, lb = a(x, x), b(x, x)
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb, rtol=1e-12, atol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def test_checkpointing_spec():
    assert parse_checkpointing("none", 4) == (set(), False) and parse_checkpointing("every_2", 4) == ({0, 2}, False)
    assert parse_checkpointing("1,3", 4) == ({1, 3}, False) and parse_checkpointing("all", 3) == ({0, 1, 2}, False)
    assert parse_checkpointing("all,head", 2) == ({0, 1}, True) and parse_checkpointing("head", 2) == (set(), True)
    with pytest.raises(ValueError, match="block 7 does not exist"):
        parse_checkpointing("0,7", 4)
    with pytest.raises(ValueError, match="'odd'"):
        parse_checkpointing("odd", 4)


def test_tracker_phases_with_injected_stats():
    state = {"allocated": 0, "reserved": 0, "peak_allocated": 0, "peak_reserved": 0}

    def alloc(n):
        state["allocated"] += n
        state["peak_allocated"] = max(state["peak_allocated"], state["allocated"])
        state["reserved"] = state["peak_reserved"] = max(state["reserved"], state["allocated"])

    def reset():
        state["peak_allocated"], state["peak_reserved"] = state["allocated"], state["reserved"]

    tr = MemoryTracker(CPU, stats=lambda: dict(state), reset=reset)
    G = 2**30
    with tr.phase("forward"):
        alloc(3 * G)
    with tr.phase("backward"):
        alloc(2 * G)
        alloc(-4 * G)
    s = tr.summary()
    assert s["forward"]["peak_allocated_gib"] == 3 and s["backward"]["peak_allocated_gib"] == 5
    assert s["backward"]["allocated_after_gib"] == 1 and tr.peak_allocated_gib == 5


def test_tracker_on_cpu_reports_unavailable():
    tr = MemoryTracker(CPU)
    with tr.phase("forward"):
        pass
    assert not tr.available and tr.summary()["forward"]["peak_allocated_gib"] is None
