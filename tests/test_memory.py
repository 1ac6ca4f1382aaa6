import copy
import dataclasses
import os
import random

import numpy as np
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


# The H100 reference run of notebook 13 (outputs/reference/h100): each search's trials from batch 1
# (reserved peak GiB, None = out of memory), the peak at the profile's batch 16 that the technique
# study measured before, and the batch found. Budget 70.51 GiB: capacity 78.34 GiB less 10%.
H100_CAPACITY = 78.34
H100_SEARCHES = {
    "bf16": ({1: 2.673828125, 2: 3.533203125, 4: 5.33203125, 8: 9.533203125, 16: 16.123046875,
              32: 30.51171875, 64: 59.345703125, 128: None, 76: 70.150390625}, 16.12109375, 76, 8),
    "checkpointing": ({1: 2.439453125, 2: 3.123046875, 4: 3.181640625, 8: 3.298828125, 16: 3.630859375,
                       32: 4.39453125, 64: 6.484375, 128: 11.154296875, 256: 20.48828125, 512: 38.865234375,
                       1024: 75.642578125, 950: 70.193359375}, 7.126953125, 950, 16),
    "checkpointing + offload": ({1: 1.521484375, 2: 2.146484375, 4: 2.322265625, 8: 2.478515625,
                                 16: 2.830078125, 32: 3.572265625, 64: 5.46875, 128: 10.099609375,
                                 256: 19.47265625, 512: 38.240234375, 1024: 75.759765625, 952: 70.486328125},
                                7.244140625, 952, 16),
}


@pytest.mark.parametrize("name", list(H100_SEARCHES))
def test_a_start_from_the_measured_peak_finds_what_a_start_from_1_found(name):
    """The informed start skips the small batches and nothing else: same trials from it on, same line,
    same batch, same prediction as the reference's search from 1."""
    from hwlib.memory.finder import budget_of, informed_start
    peaks, peak16, found, expected_start = H100_SEARCHES[name]
    lookup = lambda b: peaks[b]          # a batch the reference never ran is a KeyError: the test fails
    whole = search_batch(lookup, H100_CAPACITY, margin=0.1, max_batch=1024)
    assert [t["batch"] for t in whole.trials] == list(peaks) and whole.batch == found and whole.start == 1
    start = informed_start(budget_of(H100_CAPACITY, 0.1), 16, peak16)
    assert start == expected_start
    part = search_batch(lookup, H100_CAPACITY, margin=0.1, start=start, max_batch=1024)
    assert (part.batch, part.fit, part.predicted_peak_gib, part.measured_peak_gib) == \
        (whole.batch, whole.fit, whole.predicted_peak_gib, whole.measured_peak_gib)
    assert part.trials == [t for t in whole.trials if t["batch"] >= start] and part.start == start


def test_a_start_too_high_runs_the_smaller_batches_the_line_needs():
    """Batches 8, 16 and 32 fit the 36 GiB budget, 64 does not: whatever the start, the line goes
    through those three; the batches below them are never run."""
    peak = lambda b: None if b > 100 else 2.0 + 0.5 * b + 0.001 * b * b   # not quite straight
    whole = search_batch(peak, capacity_gib=40.0, margin=0.1)
    assert [t["batch"] for t in whole.trials][:7] == [1, 2, 4, 8, 16, 32, 64] and not whole.trials[6]["fits"]
    for start in (16, 32, 64, 128, 1024):
        calls = []
        r = search_batch(lambda b: calls.append(b) or peak(b), capacity_gib=40.0, margin=0.1, start=start)
        assert (r.batch, r.fit, r.predicted_peak_gib) == (whole.batch, whole.fit, whole.predicted_peak_gib), start
        assert not {1, 2, 4} & set(calls), (start, calls)
    assert [t["batch"] for t in search_batch(peak, 40.0, start=64).trials][:4] == [64, 32, 16, 8]
    assert [t["batch"] for t in search_batch(peak, 40.0, start=128).trials][:5] == [128, 64, 32, 16, 8]
    with pytest.raises(MemoryError, match="batch 1 does not fit"):
        search_batch(lambda b: None, capacity_gib=10.0, start=16)


def test_informed_start():
    from hwlib.memory.finder import informed_start
    assert informed_start(64.0, 16, 16.0) == 8          # 64 samples fit: an eighth of them
    assert informed_start(64.0, 16, 16.0, headroom=4) == 16
    assert informed_start(63.9, 16, 16.0) == 4          # a power of two at most the eighth
    assert informed_start(1.0, 16, 16.0) == 1           # less than one sample: start at 1
    for kw, err, match in (({"budget_gib": float("nan")}, ValueError, "budget_gib"),
                           ({"peak_gib": 0.0}, ValueError, "peak_gib"), ({"batch": 0}, ValueError, "batch"),
                           ({"headroom": 0}, ValueError, "headroom")):
        with pytest.raises(err, match=match):
            informed_start(**{"budget_gib": 10.0, "batch": 4, "peak_gib": 1.0, **kw})


def test_run_steps_stops_after_a_step_over_the_budget():
    from hwlib.studies.batch_finder import run_steps
    ran = []
    assert run_steps(ran.append, 2, lambda: 5.0 * (len(ran)), budget_gib=6.0) == 2 and ran == [0, 1]
    ran.clear()
    assert run_steps(ran.append, 2, lambda: 7.0, budget_gib=6.0) == 1 and ran == [0]
    ran.clear()
    assert run_steps(ran.append, 3, lambda: 3.0 * len(ran), budget_gib=4.0) == 2 and ran == [0, 1]


@pytest.fixture
def fake_cuda_session(monkeypatch):
    """find_batch_size on a CPU: a 40 GiB device whose reserved peak after n steps of batch b is
    2 + 0.5 b + 0.25 (n - 1) GiB (the second step adds the optimizer states), and a Session that
    only steps that figure; a batch of ``state["oom_from"]`` or more runs out of memory building it."""
    from hwlib.studies import batch_finder
    state = {"peak": 0.0, "steps": {}, "closed": 0, "freed": 0, "oom_from": None}

    class FakeSession:
        def __init__(self, workload, cfg, settings, device):
            self.b = cfg.batch
            if state["oom_from"] and self.b >= state["oom_from"]:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            state["steps"][self.b] = 0

        def step(self, i):
            state["steps"][self.b] += 1
            state["peak"] = max(state["peak"], 2.0 + 0.5 * self.b + 0.25 * (state["steps"][self.b] - 1))

        def close(self):
            state["closed"] += 1

    gib = 2**30
    monkeypatch.setattr(batch_finder, "Session", FakeSession)
    monkeypatch.setattr(batch_finder, "usable_memory_gib", lambda device: 40.0)
    monkeypatch.setattr(batch_finder, "free", lambda device: state.update(freed=state["freed"] + 1))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 40 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=0.0))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["peak"] * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0.9 * state["peak"] * gib)
    return state


def test_find_batch_size_from_a_hint_and_stopping_early(fake_cuda_session):
    from hwlib.studies import batch_finder
    state, st = fake_cuda_session, settings_for("05_fused_optimizer")
    whole = batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke")
    # budget 36 GiB: 64 fits, 128 is over it after its first step (66 GiB) and runs no second one
    assert whole.batch == 67 and whole.start == 1 and state["steps"][128] == 1
    by_batch = {t["batch"]: t for t in whole.trials}
    assert by_batch[128]["steps"] == 1 and by_batch[128]["peak_is_lower_bound"] and not by_batch[128]["fits"]
    assert by_batch[128]["peak_gib"] == pytest.approx(66.0)
    assert all(t["steps"] == 2 and not t["peak_is_lower_bound"] for b, t in by_batch.items() if b != 128)
    assert state["closed"] == len(whole.trials) and state["freed"] == 0     # closing a session frees
    state["steps"].clear()
    hinted = batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke", hint=(8, 6.25))
    assert hinted.start == 4 and min(state["steps"]) == 4         # 36 * 8 / 6.25 / 8 = 5.8: from 4
    assert (hinted.batch, hinted.fit, hinted.predicted_peak_gib) == (whole.batch, whole.fit, whole.predicted_peak_gib)
    state["oom_from"] = 128                 # a session that never built: its trial frees what it left
    oom = batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke", start=32)
    assert oom.batch == 67 and {t["batch"]: t["steps"] for t in oom.trials}[128] is None
    assert state["freed"] == 1              # the session that never built: nothing to close
    with pytest.raises(ValueError, match="start must be a power of two"):
        batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke", start=12)
    with pytest.raises(ValueError, match="pass start \\(8\\) or hint, not both"):
        batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke", start=8, hint=(8, 6.25))
    with pytest.raises(TypeError, match="hint must be a \\(batch, reserved peak GiB\\) pair"):
        batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke", hint=6.25)
    with pytest.raises(ValueError, match="hint peak GiB"):
        batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke", hint=(8, 0.0))


def test_max_batches_start_from_the_study_peaks(fake_cuda_session, monkeypatch):
    from hwlib.studies import batch_finder
    recs = []    # a record names its device's properties: there is no CUDA device here to read them from
    monkeypatch.setattr(batch_finder.results, "make_record", lambda **kw: kw)
    monkeypatch.setattr(batch_finder.results, "append", lambda rec, run=None: recs.append(rec))
    rows = [{"technique": "bf16", "status": "ok", "micro_batches": 1, "peak_reserved_gib": 6.25},
            {"technique": "bf16 + accumulation x4", "status": "ok", "micro_batches": 4, "peak_reserved_gib": 3.0}]
    found = batch_finder.max_batches("gpt", "05_fused_optimizer", ["bf16", "bf16 + accumulation x4", "fp32 (TF32)"],
                                     "cuda", profile="smoke", measured=rows, notebook="13_memory")
    assert {n: f.start for n, f in found.items()} == {"bf16": 4, "bf16 + accumulation x4": 1, "fp32 (TF32)": 1}
    assert {f.batch for f in found.values()} == {67}
    assert [(r["metric"], r["fields"]["technique"], r["params"]["start"]) for r in recs] == [
        ("max_batch", "bf16", 4), ("max_batch", "bf16 + accumulation x4", 1), ("max_batch", "fp32 (TF32)", 1)]


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


# --- checkpoints: the whole file is checked first, and nothing in it runs code -------------------

def _payload_file(path, obj_bytes: bytes):
    """``obj_bytes`` behind a valid header: the right magic, length and checksum."""
    import hashlib
    from hwlib.memory import checkpoint as ck
    path.write_bytes(ck._HEADER.pack(ck.MAGIC, len(obj_bytes), hashlib.sha256(obj_bytes).digest()) + obj_bytes)
    return path


class _Payload:
    """A pickle that creates a file when it is unpickled by a loader that runs code."""
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _pickled(obj) -> bytes:
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_malicious_checkpoint_is_refused_without_running_its_code(tmp_path):
    # The payload is live: a code-running loader (weights_only=False) creates its marker.
    import io
    control = tmp_path / "control-marker"
    torch.load(io.BytesIO(_pickled({"x": _Payload(control)})), weights_only=False)
    assert control.exists()
    marker = tmp_path / "marker"
    evil = _payload_file(tmp_path / "evil.ckpt", _pickled({"workload": "gpt", "model": _Payload(marker)}))
    sess = Session("gpt", WL.config("smoke"), Settings(), CPU)
    before = [p.detach().clone() for p in sess.model.parameters()]
    with pytest.raises(CheckpointError, match="other than tensors and plain data"):
        load_checkpoint(evil, sess)
    assert not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(before, sess.model.parameters()))


def _session_state(sess):
    return ([p.detach().clone() for p in sess.model.parameters()], copy.deepcopy(sess.opt.state_dict()),
            torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy())


def _same(a, b) -> bool:
    """Equal structure and values, every tensor element compared (a NaN equals a NaN in its place)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                and torch.equal(torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _unchanged(sess, state) -> bool:
    params, opt, trng, prng, nrng = state
    now = _session_state(sess)
    same_opt = _same(now[1], opt)
    return (all(torch.equal(a, b) for a, b in zip(params, now[0])) and same_opt and torch.equal(trng, now[2])
            and prng == now[3] and (nrng == now[4]).all())


@pytest.mark.parametrize("saved,loaded,match", [
    (Settings(offload_optimizer=True), Settings(), "optimizer: checkpoint 'OffloadedAdamW', this run 'AdamW'"),
    (Settings(), Settings(offload_optimizer=True), "optimizer: checkpoint 'AdamW', this run 'OffloadedAdamW'"),
    (Settings(), Settings(fused_adamw=True), r"this run 'AdamW \(fused\)'"),
], ids=["offloaded-into-adamw", "adamw-into-offloaded", "unfused-into-fused"])
def test_another_optimizer_is_refused_before_anything_changes(tmp_path, saved, loaded, match):
    cfg = WL.config("smoke")
    src = Session("gpt", cfg, saved, CPU)
    _train(src, 0, 2)
    path = save_checkpoint(tmp_path / "a.ckpt", src, next_step=2)
    dst = Session("gpt", cfg, loaded, CPU)
    _train(dst, 0, 1)                    # an optimizer state to keep
    torch.manual_seed(99)
    state = _session_state(dst)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, dst)
    assert _unchanged(dst, state)


def _rewrite(src, dst, change):
    """The checkpoint at ``src`` with ``change(state)`` applied, under a valid header again."""
    import io
    from hwlib.memory import checkpoint as ck
    raw = src.read_bytes()
    st = torch.load(io.BytesIO(raw[ck._HEADER.size:]), weights_only=True)
    change(st)
    return _payload_file(dst, _pickled(st))


def _opt_entry(st):
    return next(iter(st["optimizer"]["state"].values()))


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """One intact checkpoint after two steps, the source of every damaged one (it is only read)."""
    src = Session("gpt", WL.config("smoke"), Settings(), CPU)
    _train(src, 0, 2)
    return save_checkpoint(tmp_path_factory.mktemp("good") / "a.ckpt", src, next_step=2, losses=[5.0, 4.0])


@pytest.mark.parametrize("change,match", [
    (lambda st: _opt_entry(st).__setitem__("exp_avg", torch.zeros(3)), "exp_avg is \\(3,\\)"),
    (lambda st: st["optimizer"]["param_groups"][0].__setitem__("lr", float("nan")), "lr.*finite"),
    (lambda st: st["model"].__setitem__("wte.weight", torch.zeros(2, 2)), "another model: 'wte.weight' is \\(2, 2\\)"),
    (lambda st: st["model"].pop("ln_f.bias"), "'ln_f.bias' is missing"),
    (lambda st: st["model"].__setitem__("extra", torch.zeros(1)), "'extra' is not in this run's model"),
    (lambda st: st["rng"]["python"].__setitem__("version", 99), "RNG states"),
    (lambda st: st["rng"]["numpy"].__setitem__("keys", torch.zeros(5, dtype=torch.int64)), "RNG states"),
    (lambda st: st["rng"].__setitem__("torch", torch.zeros(7, dtype=torch.uint8)), "RNG states"),
    (lambda st: st.__setitem__("next_step", -1), "next_step -1"),
    (lambda st: st.__setitem__("losses", [1.0, 2.0, 3.0]), "at most next_step \\(2\\)"),
    (lambda st: st.__setitem__("scaler", {"scale": 1.0}), "loss scaling: checkpoint with a GradScaler"),
    (lambda st: st.pop("rng"), "contents are not a checkpoint's"),
    # a valid header over an optimizer this run never had, or state no step could have left
    (lambda st: st["optimizer"]["param_groups"][0].__setitem__("maximize", True), "maximize is True, this run's False"),
    (lambda st: st["optimizer"]["param_groups"][0].__setitem__("amsgrad", True), "amsgrad is True"),
    (lambda st: _opt_entry(st).__setitem__("exp_avg_sq", torch.full_like(_opt_entry(st)["exp_avg_sq"], float("nan"))),
     "exp_avg_sq holds NaN"),
    (lambda st: _opt_entry(st).__setitem__("exp_avg_sq", -_opt_entry(st)["exp_avg_sq"] - 1), "exp_avg_sq holds negative"),
    (lambda st: _opt_entry(st).__setitem__("step", torch.tensor(0.0)), "step is 0.0"),
    (lambda st: _opt_entry(st).__setitem__("step", torch.tensor([2.0, 2.0])), "step is \\(2,\\)"),
    (lambda st: _opt_entry(st).__setitem__("exp_avg", _opt_entry(st)["exp_avg"].to(torch.int64)), "exp_avg is .* torch.int64"),
    (lambda st: _opt_entry(st).__setitem__("max_exp_avg_sq", _opt_entry(st)["exp_avg_sq"].clone()), "not AdamW's"),
    (lambda st: st["model"]["wte.weight"].__setitem__((0, 0), float("nan")), "'wte.weight' holds NaN"),
], ids=["exp_avg-shape", "lr-nan", "weight-shape", "missing-weight", "extra-weight", "python-rng", "numpy-rng",
        "torch-rng", "negative-position", "losses-past-position", "scaler", "no-rng", "maximize", "amsgrad",
        "nan-moment", "negative-moment", "step-zero", "step-shape", "int-moment", "stray-state", "nan-weight"])
def test_a_damaged_part_is_refused_before_anything_changes(tmp_path, good_checkpoint, change, match):
    cfg = WL.config("smoke")
    good = good_checkpoint
    bad = _rewrite(good, tmp_path / "b.ckpt", change)
    dst = Session("gpt", cfg, Settings(), CPU)
    _train(dst, 0, 1)
    state = _session_state(dst)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(bad, dst)
    assert _unchanged(dst, state)
    assert load_checkpoint(good, dst) == (2, [5.0, 4.0])      # the intact file still loads


def test_an_old_format_checkpoint_is_refused_unread(tmp_path):
    from hwlib.memory import checkpoint as ck
    path = tmp_path / "old.ckpt"
    path.write_bytes(b"HWLCKPT1" + b"\0" * 40)
    with pytest.raises(CheckpointError, match="older format.*not loaded"):
        load_checkpoint(path, Session("gpt", WL.config("smoke"), Settings(), CPU))
    assert ck.MAGIC != b"HWLCKPT1"


def test_checkpoint_arguments_are_checked(tmp_path):
    sess = Session("gpt", WL.config("smoke"), Settings(), CPU)
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="next_step"):
            save_checkpoint(tmp_path / "a.ckpt", sess, next_step=bad)
    with pytest.raises(TypeError, match=r"losses\[0\] must be a number"):
        save_checkpoint(tmp_path / "a.ckpt", sess, next_step=1, losses=[torch.tensor(1.0)])
    with pytest.raises(ValueError, match="losses holds 2 values but only 1 steps ran"):
        save_checkpoint(tmp_path / "a.ckpt", sess, next_step=1, losses=[1.0, 2.0])
    for bad in (None, "", 3):
        with pytest.raises(TypeError, match="path must be"):
            save_checkpoint(bad, sess, next_step=0)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path, sess)                   # a folder, not a file
    path = save_checkpoint(tmp_path / "a.ckpt", sess, next_step=0)
    sess.close()
    with pytest.raises(TypeError, match="open hwlib.ladder.Session .*closed"):
        load_checkpoint(path, sess)
    with pytest.raises(TypeError, match="open hwlib.ladder.Session"):
        save_checkpoint(path, object(), next_step=0)
    assert not list(tmp_path.glob(".*.tmp"))


# --- offloaded AdamW: arguments and state ---------------------------------------------------------

def _no_hang(seconds=10):
    """Turn a hang into a failure (SIGALRM), so that a regression to an endless loop fails the test."""
    import signal

    def boom(*_):
        raise TimeoutError(f"did not return within {seconds} s")
    signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    return lambda: signal.alarm(0)


@pytest.mark.parametrize("kw,err,match", [
    ({"bucket_params": 0}, ValueError, "bucket_params must be at least one parameter"),
    ({"bucket_params": -5}, ValueError, "bucket_params"), ({"bucket_params": 2.5}, TypeError, "bucket_params"),
    ({"lr": -1}, ValueError, "lr must be a finite number >= 0, got -1"),
    ({"lr": float("nan")}, ValueError, "lr must be a finite"), ({"lr": "0.1"}, TypeError, "lr must be a number"),
    ({"eps": float("inf")}, ValueError, "eps"), ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"betas": (0.9, 1.0)}, ValueError, r"betas\[1\]"), ({"betas": 0.9}, TypeError, "betas must be a pair"),
])
def test_offloaded_adamw_arguments_are_checked(kw, err, match):
    params = [torch.nn.Parameter(torch.ones(4))]
    stop = _no_hang()
    try:
        with pytest.raises(err, match=match):
            OffloadedAdamW(params, **kw)
    finally:
        stop()


def test_offloaded_adamw_groups_and_state_are_checked():
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] must be a finite"):
        OffloadedAdamW([{"params": [p]}, {"params": [q], "lr": float("nan")}])
    with pytest.raises(ValueError, match="unknown option 'momentum'"):
        OffloadedAdamW([{"params": [p], "momentum": 0.9}])
    with pytest.raises(ValueError, match="more than one group"):
        OffloadedAdamW([{"params": [p]}, {"params": [p]}])
    with pytest.raises(TypeError, match="single tensor"):
        OffloadedAdamW(p)
    with pytest.raises(TypeError, match="'int' object, not a tensor"):
        OffloadedAdamW([1, 2])
    opt = OffloadedAdamW([p, q], bucket_params=5)
    good = opt.state_dict()
    for change, match in ((lambda sd: sd["m"].pop(), "bucket sizes"), (lambda sd: sd.__setitem__("step", -1), "step"),
                          (lambda sd: sd["hyper"][0].__setitem__("lr", -1.0), r"hyper\[0\]\['lr'\]"),
                          (lambda sd: sd.pop("v"), "keys")):
        sd = copy.deepcopy(good)
        change(sd)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
    assert opt.state_dict()["hyper"] == good["hyper"] and opt.step_count == 0


# --- the ladder runner with accumulation alone, and the memory tools' arguments ---------------------

def test_run_step_accumulates_with_micro_batch_alone():
    from hwlib.ladder.run import run_step
    from hwlib.profiles import Plan
    pl = Plan(check=3, warmup=0, timed=1)
    acc = run_step("gpt", "01_baseline_fp32", profile="smoke", device="cpu", plan=pl, micro_batch=3)
    one = run_step("gpt", "01_baseline_fp32", profile="smoke", device="cpu", plan=pl)
    assert acc.status == "ok" and acc.variant and not one.variant and acc.settings == one.settings
    # batch 8 as 3 + 3 + 2 exact micro-batches: the same curve up to fp32 rounding
    assert acc.losses == pytest.approx(one.losses, rel=1e-5) and len(acc.losses) == 4


@pytest.mark.parametrize("kw,err,match", [
    ({"capacity_gib": float("nan")}, ValueError, "capacity_gib"), ({"capacity_gib": -1.0}, ValueError, "capacity_gib"),
    ({"capacity_gib": "10"}, TypeError, "capacity_gib"), ({"margin": "0.1"}, TypeError, "margin"),
    ({"margin": float("nan")}, ValueError, "margin"), ({"start": 8, "max_batch": 4}, ValueError, "start \\(8\\)"),
    ({"start": 3}, ValueError, "start must be a power of two"), ({"start": 0}, ValueError, "start must be at least"),
    ({"start": "8"}, TypeError, "start must be a whole number"),
    ({"try_batch": None}, TypeError, "try_batch must be callable"),
    ({"try_batch": lambda b: float("nan")}, ValueError, r"try_batch\(1\)"),
    ({"try_batch": lambda b: "1"}, TypeError, r"try_batch\(1\)"),
    ({"try_batch": lambda b: -1.0}, ValueError, r"try_batch\(1\)"),
])
def test_search_batch_arguments_are_checked(kw, err, match):
    args = {"try_batch": lambda b: 1.0 + b, "capacity_gib": 10.0, **kw}
    with pytest.raises(err, match=match):
        search_batch(args.pop("try_batch"), **args)


def test_split_accumulate_and_resilient_step_arguments_are_checked():
    x = torch.arange(4)
    for batch, err, match in (((), TypeError, "non-empty tuple/list of tensors"), ([1, 2], TypeError, "of int"),
                              (torch.tensor(1.0), ValueError, "0-d tensor"), ("ab", TypeError, "got str")):
        with pytest.raises(err, match=match):
            split_batch(batch, [1])
    for sizes, err, match in (([6, -2], ValueError, r"sizes\[1\] must be at least one"),
                              ([4, 0], ValueError, r"sizes\[1\]"), ([2.0, 2.0], TypeError, r"sizes\[0\]"),
                              (4, TypeError, "sizes must be a non-empty list"), ([], TypeError, "sizes")):
        with pytest.raises(err, match=match):
            split_batch(x, sizes)
    with pytest.raises(TypeError, match="forward_backward must be callable"):
        accumulate(None, x, [4])
    ok = (lambda mb, w: torch.tensor(1.0), lambda: None, lambda: None)
    with pytest.raises(TypeError, match="optimizer_step must be callable"):
        ResilientStep(ok[0], None, ok[2], CPU, 2)
    with pytest.raises(TypeError, match="device must be"):
        ResilientStep(*ok, 0, 2)
    with pytest.raises(TypeError, match="micro_batch must be a whole number"):
        ResilientStep(*ok, CPU, 2.5)
    rs = ResilientStep(*ok, "cpu", 2)                   # a device name is taken
    assert rs.device == CPU
    with pytest.raises(ValueError, match="batch has no samples"):
        rs(torch.zeros(0, 3))
    with pytest.raises(TypeError, match="step must be an int or None"):
        rs(torch.zeros(2, 3), step="1")
    with pytest.raises(TypeError, match="open hwlib.ladder.Session"):
        ResilientStep.for_session(object(), 2)


def test_resilient_step_for_session_keeps_the_large_batch_gradient():
    cfg = WL.config("smoke", batch=8)
    ref = Session("gpt", cfg, Settings(), CPU)
    want = [ref.step(i).item() for i in range(2)]
    sess = Session("gpt", cfg, Settings(), CPU)
    rs = ResilientStep.for_session(sess, micro_batch=8)
    real = rs.forward_backward

    def fits_two(mb, w):
        if mb[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(mb, w)
    rs.forward_backward = fits_two
    got = [rs(sess.batches(i), step=i).item() for i in range(2)]
    assert [(e.micro_before, e.micro_after) for e in rs.events] == [(8, 4), (4, 2)]
    assert got == pytest.approx(want, rel=1e-5)


def test_tracker_and_allocator_arguments_are_checked(monkeypatch):
    from hwlib.memory import allocator
    from hwlib.memory.tracker import memory_figures
    assert MemoryTracker("cpu").device == CPU and memory_figures("cpu") == {}
    with pytest.raises(TypeError, match="device must be"):
        MemoryTracker(3)
    with pytest.raises(TypeError, match="stats must be callable"):
        MemoryTracker(CPU, stats={"allocated": 0})
    tr = MemoryTracker(CPU, stats=lambda: {"allocated": 0})
    with pytest.raises(ValueError, match="reserved, peak_allocated, peak_reserved missing"):
        with tr.phase("forward"):
            pass
    with pytest.raises(TypeError, match="phase name"):
        with MemoryTracker(CPU).phase(None):
            pass
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    for conf in (":True", "expandable_segments:", "expandable_segments"):
        monkeypatch.setenv(allocator.ENV, conf)
        with pytest.raises(ValueError, match="key:value; fix or unset PYTORCH_CUDA_ALLOC_CONF"):
            allocator.settings()


# --- the memory study's entry points -----------------------------------------------------------------

def test_study_arguments_are_checked_before_any_measurement(monkeypatch):
    from hwlib.device import ChoiceError
    from hwlib.studies import batch_finder, memory as study
    monkeypatch.setattr(study, "run_step", lambda *a, **k: pytest.fail("measured before the names were checked"))
    with pytest.raises(ChoiceError, match="'bf17'"):
        study.measure_techniques("gpt", "05_fused_optimizer", ["bf16", "bf17"], profile="smoke", device="cpu", notebook="13_memory")
    with pytest.raises(TypeError, match="names must be a list"):
        study.measure_techniques("gpt", "05_fused_optimizer", "bf16", profile="smoke", device="cpu", notebook="13_memory")
    with pytest.raises(TypeError, match="config must be a dict"):
        study.measure_techniques("gpt", "05_fused_optimizer", ["bf16"], profile="smoke", device="cpu", config=[1],
                                 notebook="13_memory")
    st = settings_for("05_fused_optimizer")
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        batch_finder.find_batch_size("gpt", st, "cpu", profile="smoke")
    with pytest.raises(TypeError, match="settings must be a hwlib.steps.Settings"):
        batch_finder.find_batch_size("gpt", {"tf32": True}, "cuda", profile="smoke")
    with pytest.raises(ValueError, match="'batch' is what find_batch_size searches"):
        batch_finder.find_batch_size("gpt", st, torch.device("cuda"), profile="smoke", config={"batch": 4})
    with pytest.raises(TypeError, match="config must be a dict"):
        batch_finder.find_batch_size("gpt", st, "cuda", profile="smoke", config=4)


def test_resilient_steps_record_their_events(isolated_run):
    from hwlib import query
    from hwlib.studies import memory as study
    rs, losses = study.resilient_steps("gpt", "05_fused_optimizer", 8, profile="smoke", device="cpu", steps=2,
                                       simulate_fits=2, notebook="13_memory")
    assert [e.micro_after for e in rs.events] == [4, 2] and all(h["samples"] == 8 for h in rs.history)
    assert len(losses) == 2 and all(np.isfinite(losses))
    (rec,) = query.select(query.load(isolated_run), metric="oom_events")
    assert rec["step"] == "05_fused_optimizer" and rec["fields"] == {"technique": "resilient"}
    assert rec["value"] == 2 and rec["params"]["final_micro_batch"] == 2 and not rec["params"]["real_oom"]


def test_memory_targets_follow_the_record_conventions(isolated_run):
    from hwlib import query
    from hwlib.studies import memory as study
    row = lambda name, ms, peak: {"technique": name, "status": "ok", "ms_per_step": ms, "peak_alloc_gib": peak,
                                  "time_vs_bf16": ms / 100.0, "speed_vs_bf16": 100.0 / ms}
    rows = [row("bf16", 100.0, 10.0), row("bf16 + checkpointing(blocks)", 130.0, 5.0),
            row("bf16 + checkpointing(head)", 150.0, 9.0), row("bf16 + offload", 120.0, 9.9)]
    ts = study.memory_targets("gpt", rows, profile="smoke", long_run={"error": 0.05, "steps": 50})
    met = {t["target"]: t["met"] for t in ts}
    assert met["bf16 + checkpointing(blocks): peak memory cut >= 40%"] and \
        met["bf16 + checkpointing(blocks): <= 35% extra step time"]
    assert not met["bf16 + checkpointing(head): peak memory cut >= 40%"]
    assert met["finder's batch: 50 steps, peak within 10% of prediction"]
    study.record_targets(ts, base_step="05_fused_optimizer", profile="smoke", device="cpu", notebook="13_memory")
    recs = query.select(query.load(isolated_run), metric="target")
    assert len(recs) == len(ts) and all(r["step"] == "05_fused_optimizer" and set(r["fields"]) == {"target"}
                                        for r in recs)
    cut = query.select(recs, target="bf16 + checkpointing(blocks): peak memory cut >= 40%")[0]
    assert cut["value"] == pytest.approx(0.5) and cut["status"] == "ok"
    assert query.select(recs, target="bf16 + checkpointing(head): peak memory cut >= 40%")[0]["status"] == "failed"
    with pytest.raises(ValueError, match="needs the peaks a GPU measures"):
        study.memory_targets("gpt", [dict(rows[0], peak_alloc_gib=None)], profile="smoke")
