import pickle

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hwlib.data import images
from hwlib.ladder import run as train
from hwlib.device import ChoiceError
from hwlib.data.loader import LoaderBatches
from hwlib.profiles import Plan
from hwlib.steps import Settings, not_applicable, get_step
from hwlib.workloads import get_workload
from hwlib.workloads.vit_bdh import TOKENS, VisionBDH, VitBDHConfig

WL = get_workload("vit_bdh")
LIN = get_workload("vit_bdh_linear")
CFG = WL.config("smoke")
CPU = torch.device("cpu")


def test_config_validation_names_the_field():
    with pytest.raises(ChoiceError, match="'huge'"):
        WL.config("huge")
    with pytest.raises(ChoiceError, match="'layers'"):
        WL.config("smoke", layers=3)
    for field, bad in (("batch", 0), ("n_head", 1.5), ("d_model", True), ("n_neuron", -2)):
        with pytest.raises(ValueError, match=f"VitBDHConfig.{field} must be a positive integer"):
            WL.config("smoke", **{field: bad})
    with pytest.raises(ValueError, match="n_neuron .* must be even"):
        WL.config("smoke", n_neuron=63)
    with pytest.raises(ValueError, match="VitBDHConfig.lr"):
        WL.config("smoke", lr=0.0)
    with pytest.raises(ValueError, match="VitBDHConfig.weight_decay"):
        WL.config("smoke", weight_decay=float("nan"))
    for field, bad in (("lr", -1), ("lr", "0.1"), ("lr", float("inf")), ("weight_decay", float("inf"))):
        with pytest.raises(ValueError, match=f"VitBDHConfig.{field} must be a finite"):
            WL.config("smoke", **{field: bad})
    with pytest.raises(ValueError, match="data_images .* at least one batch"):
        WL.config("smoke", data_images=8)
    with pytest.raises(ValueError, match=r"images must be \[B, 3, 32, 32\]"):
        WL.build(CFG, Settings(), 0)(torch.zeros(2, 3, 28, 28))


def test_full_profile_is_the_seed_model():
    c = WL.config("full")
    assert (c.d_model, c.n_head, c.n_neuron, c.n_layer, c.batch) == (192, 6, 1024, 6, 256)
    assert WL.items_per_step(c) == 256 and WL.unit == "samples" and TOKENS == 65
    n = sum(p.numel() for p in VisionBDH(c).parameters())
    # 3 x (192 x 6144) shared matrices + conv 9,408 + CLS 192 + positions 12,480 + head 1,930
    assert n == 3_562_954


@pytest.mark.parametrize("wl", [WL, LIN], ids=["softmax", "linear"])
def test_flops_formula_matches_counted_flops(wl):
    m = wl.build(CFG, Settings(), seed=0)
    x = torch.randn(CFG.batch, 3, 32, 32)
    y = torch.randint(0, 10, (CFG.batch,))
    with FlopCounterMode(display=False) as fc:
        wl.loss(m, (x, y)).backward()
    assert fc.get_total_flops() == pytest.approx(wl.flops_per_step(CFG), rel=1e-9)


def test_same_seed_same_weights_whatever_the_global_rng():
    torch.manual_seed(1)
    a = WL.build(CFG, Settings(), seed=3)
    torch.manual_seed(2)
    b = LIN.build(CFG, Settings(attention="sdpa"), seed=3)
    c = WL.build(CFG, Settings(), seed=4)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["encoder"], c.state_dict()["encoder"])


def test_sdpa_matches_manual_attention():
    m = WL.build(CFG, Settings(), seed=1).double()
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    manual = WL.loss(m, (x, y))
    gm = torch.autograd.grad(manual, m.encoder)[0]
    m.set_attention("sdpa")
    sdpa = WL.loss(m, (x, y))
    assert torch.allclose(manual, sdpa, rtol=1e-10, atol=0)
    assert torch.allclose(gm, torch.autograd.grad(sdpa, m.encoder)[0], rtol=1e-8, atol=1e-14)
    # the linear form is a different model, not a different kernel
    assert not torch.allclose(manual, LIN.loss(LIN.build(CFG, Settings(), seed=1).double(), (x, y)))


def test_attention_is_bidirectional_and_uses_every_patch():
    m = WL.build(CFG, Settings(), seed=0)
    x = torch.randn(1, 3, 32, 32)
    x2 = x.clone()
    x2[..., 28:, 28:] += 1.0      # the last patch only: the CLS logits must still change
    assert not torch.allclose(m(x), m(x2))


def test_checkpointing_is_the_same_function():
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    ref = WL.build(CFG, Settings(), seed=0)
    ck = WL.build(CFG, Settings(checkpointing="all,head"), seed=0)
    assert ck.checkpointed == frozenset({0, 1})
    la, lb = WL.loss(ref, (x, y)), WL.loss(ck, (x, y))
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7) for p, q in zip(ref.parameters(), ck.parameters()))
    with pytest.raises(ValueError, match="block 5 does not exist"):
        WL.build(CFG, Settings(checkpointing="5"), seed=0)


def test_compiles_as_one_graph():
    """No data-dependent Python control flow and no host syncs: torch.compile traces one graph
    (fullgraph=True fails on any break). aot_eager checks the capture quickly; inductor and
    CUDA graphs reuse the same graph."""
    m = LIN.build(CFG, Settings(checkpointing="0"), seed=0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    eager = LIN.loss(m, (x, y))
    compiled = LIN.loss(torch.compile(m, backend="aot_eager", fullgraph=True), (x, y))
    compiled.backward()
    assert torch.allclose(eager, compiled, rtol=1e-5) and m.encoder.grad is not None


def test_step_applicability():
    assert not_applicable(get_step("04"), "vit_bdh") is None and "linear" in not_applicable(get_step("04"), "vit_bdh_linear")
    assert not_applicable(get_step("10"), "vit_bdh") is None and not_applicable(get_step("10"), "vit_bdh_linear") is None


# --- data ----------------------------------------------------------------------------------------

def test_encoding_round_trips_and_the_cache_is_reused():
    imgs, labels = images.synthetic_images(40, seed=5)
    assert imgs.shape == (40, 32, 32, 3) and imgs.dtype == np.uint8 and set(labels) <= set(range(10))
    assert np.array_equal(imgs, images.synthetic_images(40, seed=5)[0])
    assert all(np.array_equal(images.decode(images.encode(im)), im) for im in imgs)
    ds = images.cached_synthetic_images(40, seed=5)
    path = images.data_dir() / "synthetic_images_n40_s5.npz"
    mtime = path.stat().st_mtime_ns
    assert ds.blob.size < imgs.size and np.array_equal(ds.raw(7), imgs[7])
    again = images.cached_synthetic_images(40, seed=5)
    assert path.stat().st_mtime_ns == mtime and np.array_equal(again.blob, ds.blob)


def test_synthetic_classes_differ_and_survive_a_flip():
    imgs, labels = images.synthetic_images(2000, seed=0)
    means = np.stack([imgs[labels == c].reshape(-1, 3).mean(0) for c in range(10)])
    d = np.linalg.norm(means[:, None] - means[None], axis=-1)
    assert d[~np.eye(10, dtype=bool)].min() > 5       # every pair of classes differs in colour
    # Orientation is part of the class and survives the horizontal flip: stripes along x (class 0)
    # or y (class 1) keep their axis; the diagonal ones (class 2) come in both signs, so a flip
    # maps the class onto itself.
    g = imgs.astype(float).mean(-1)
    var_x, var_y = g.mean(axis=1).var(axis=1), g.mean(axis=2).var(axis=1)   # per image
    assert var_x[labels == 0].mean() > 5 * var_y[labels == 0].mean()
    assert var_y[labels == 1].mean() > 5 * var_x[labels == 1].mean()
    diag = np.abs(g[:, 1:, 1:] - g[:, :-1, :-1]).mean((1, 2)) > np.abs(g[:, 1:, :-1] - g[:, :-1, 1:]).mean((1, 2))
    assert 0.35 < diag[labels == 2].mean() < 0.65


def test_samples_are_augmented_deterministically():
    ds = images.cached_synthetic_images(64, seed=0)
    x, y = ds.sample(3, 0)
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64 and y.dim() == 0
    assert x.min() >= -1 and x.max() <= 1
    assert torch.equal(x, ds.sample(3, 0)[0])
    assert any(not torch.equal(x, ds.sample(3, e)[0]) for e in range(1, 4))   # a new crop/flip per epoch
    # the crop of the zero-padded image, flipped or not, exactly as a reference computes it
    g = images.sample_generator(0, 3, 0)
    dy, dx = g.integers(0, 9, 2)
    ref = np.pad(ds.raw(3), ((4, 4), (4, 4), (0, 0)))[dy:dy + 32, dx:dx + 32]
    ref = ref[:, ::-1] if g.random() < 0.5 else ref
    assert np.allclose(x.numpy().transpose(1, 2, 0), ref / 127.5 - 1.0, atol=1e-6)


def test_loader_modes_give_identical_batches():
    ds = images.cached_synthetic_images(CFG.data_images, seed=0)
    want = [WL.batches(CFG, CPU, 0, settings=Settings(loader="simple"))(i) for i in range(3)]
    tuned = LoaderBatches(ds, CFG.batch, CPU, 0, mode="tuned", workers=2, collate=images.collate)
    resident = WL.batches(CFG, CPU, 0, settings=Settings(loader="resident"))
    resident.make_resident(3)
    try:
        for i in range(3):
            for got in (tuned(i), resident(i)):
                assert torch.equal(got[0], want[i][0]) and torch.equal(got[1], want[i][1])
    finally:
        tuned.close()
    assert want[0][0].shape == (CFG.batch, 3, 32, 32) and want[0][1].shape == (CFG.batch,)
    assert not torch.equal(want[0][0], want[1][0])


def test_channels_last_batches():
    plain = WL.batches(CFG, CPU, 0, settings=Settings())(0)[0]
    cl = WL.batches(CFG, CPU, 0, settings=Settings(channels_last=True))(0)[0]
    assert plain.is_contiguous() and not plain.is_contiguous(memory_format=torch.channels_last)
    assert cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(cl, plain)
    sess = train.Session("vit_bdh", CFG, Settings(channels_last=True), CPU, seed=0)
    try:
        assert sess.model.patch.weight.is_contiguous(memory_format=torch.channels_last)
        ref = WL.build(CFG, Settings(), 0)
        assert torch.allclose(WL.loss(sess.model, sess.batches(0)), WL.loss(ref, (plain, sess.batches(0)[1])),
                              rtol=1e-5)
    finally:
        sess.close()


@pytest.mark.parametrize("workload", ["vit_bdh", "vit_bdh_linear"])
def test_loss_falls_when_training(workload):
    r = train.run_step(workload, "01_baseline_fp32", profile="smoke", device="cpu",
                       plan=Plan(check=15, warmup=0, timed=0), check_only=True)
    assert r.status == "ok" and len(r.losses) == 15 and r.unit == "samples" and r.items_per_step == CFG.batch
    assert np.mean(r.losses[-3:]) < np.mean(r.losses[:3]) - 0.3, r.losses


# --- CIFAR-10 ------------------------------------------------------------------------------------

def _write_fake_cifar(root, n=4):
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for name in images.CIFAR_TRAIN + images.CIFAR_TEST:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        with open(root / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * n}, f, protocol=2)
        out[name] = (data, labels)
    return out


def test_cifar_loader_reads_the_python_format(tmp_path):
    written = _write_fake_cifar(tmp_path / "cifar-10-batches-py")
    train_set = images.cifar10(tmp_path, seed=0)           # the parent folder is found too
    assert len(train_set) == 20 and train_set.augment
    data, labels = written["data_batch_2"]
    # image 5 is data_batch_2's second: red plane first, row-major
    assert np.array_equal(train_set.raw(5)[:, :, 0], data[1, :1024].reshape(32, 32))
    assert np.array_equal(train_set.raw(5)[:, :, 2], data[1, 2048:].reshape(32, 32))
    assert train_set.labels[5] == labels[1]
    test_set = images.cifar10(tmp_path / "cifar-10-batches-py", split="test")
    assert len(test_set) == 4 and not test_set.augment
    x, y = test_set.sample(0, 0)
    want = torch.from_numpy(written["test_batch"][0][0].reshape(3, 32, 32) / 127.5 - 1.0).float()
    assert torch.allclose(x, want, atol=1e-6)
    # and the workload trains on it
    cfg = WL.config("smoke", batch=4)
    b = WL.batches(cfg, CPU, 0, source=str(tmp_path))(0)
    assert b[0].shape == (4, 3, 32, 32) and torch.isfinite(WL.loss(WL.build(cfg, Settings(), 0), b))


def test_cifar_loader_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        images.cifar10(tmp_path / "nope")
    root = tmp_path / "c"
    _write_fake_cifar(root)
    (root / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3.*is missing"):
        images.cifar10(root)
    (root / "data_batch_3").write_bytes(b"\x80\x02 this is not a pickle")
    with pytest.raises(ValueError, match="data_batch_3.*not a readable CIFAR pickle"):
        images.cifar10(root)
    (root / "data_batch_3").write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(ValueError, match=r"data_batch_3.*'data' must be uint8 \[n, 3072\]"):
        images.cifar10(root)
    (root / "data_batch_3").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 12]}))
    with pytest.raises(ValueError, match=r"data_batch_3.*labels must lie in 0..9"):
        images.cifar10(root)
    (root / "data_batch_3").write_bytes(pickle.dumps({b"labels": [0]}))
    with pytest.raises(ValueError, match="data_batch_3.*lacks 'data'"):
        images.cifar10(root)

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))
    (root / "data_batch_3").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match="data_batch_3.*refuses to import builtins.print"):
        images.cifar10(root)
    with pytest.raises(ValueError, match="is not a folder"):
        images.cifar10(root / "data_batch_1")
