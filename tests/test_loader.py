import numpy as np
import pytest
import torch

from hwlib.device import ChoiceError
from hwlib.data.loader import LoaderBatches, sample_generator


class Noisy:
    """A dataset whose samples carry random augmentation drawn from the per-sample generator."""

    def __init__(self, n=37, seed=3):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def sample(self, index, epoch):
        g = sample_generator(self.seed, index, epoch)
        x = torch.from_numpy(g.standard_normal(5).astype(np.float32)) + index
        return x, torch.tensor(index)


def _take(mode, n=12, **kw):
    b = LoaderBatches(Noisy(), 8, torch.device("cpu"), seed=1, mode=mode, **kw)
    try:
        if mode == "resident":
            b.make_resident(n)
        return [b(i) for i in range(n)]
    finally:
        b.close()


def test_every_mode_gives_the_same_batches():
    simple = _take("simple")
    for other in (_take("tuned", workers=2), _take("tuned", workers=0), _take("resident")):
        for (xa, ya), (xb, yb) in zip(simple, other):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_order_covers_each_epoch_and_changes_between_epochs():
    batches = _take("simple", n=8)   # 37 samples, batch 8: 4 batches an epoch, the last 5 dropped
    ids = [b[1].tolist() for b in batches]
    first, second = sum(ids[:4], []), sum(ids[4:], [])
    assert len(set(first)) == 32 and len(set(second)) == 32
    assert first != second
    # augmentation depends on the epoch: the same index in two epochs gets a different draw
    common = sorted(set(first) & set(second))[0]
    xa = torch.cat([b[0] for b in batches[:4]])[torch.tensor(first) == common]
    xb = torch.cat([b[0] for b in batches[4:]])[torch.tensor(second) == common]
    assert not torch.equal(xa, xb)


def test_random_access_restarts_the_stream():
    b = LoaderBatches(Noisy(), 8, torch.device("cpu"), seed=1)
    seq = [b(i)[1] for i in range(5)]
    assert torch.equal(b(2)[1], seq[2]) and torch.equal(b(3)[1], seq[3])
    assert b.n_waits == 7 and b.wait_s > 0
    again = b(3)                                   # the batch just delivered: no new wait, same tensors
    assert b.n_waits == 7 and again[1] is b(3)[1]


def test_bad_arguments():
    with pytest.raises(ChoiceError, match="loader"):
        LoaderBatches(Noisy(), 8, "cpu", 0, mode="fast")
    with pytest.raises(ValueError, match="batch"):
        LoaderBatches(Noisy(), 0, "cpu", 0)
    with pytest.raises(ValueError, match="fewer than one batch"):
        LoaderBatches(Noisy(n=3), 8, "cpu", 0)
    with pytest.raises(ValueError, match="workers"):
        LoaderBatches(Noisy(), 8, "cpu", 0, workers=-1)
    r = LoaderBatches(Noisy(), 8, "cpu", 0, mode="resident")
    r.make_resident(2)
    with pytest.raises(IndexError, match="not resident"):
        r(2)


def test_throughput_reports_consistent_rates():
    from hwlib.data.loader import throughput
    like = LoaderBatches(Noisy(n=64), 8, torch.device("cpu"), seed=1)
    for w in (0, 2):
        t = throughput(like, workers=w, n_batches=6)
        assert t["mode"] == ("simple" if w == 0 else "tuned")
        assert t["batches_per_s"] > 0 and abs(t["samples_per_s"] - 8 * t["batches_per_s"]) < 1e-6 * t["samples_per_s"]
    with pytest.raises(ValueError, match="n_batches"):
        throughput(like, workers=0, n_batches=0)
