import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hwlib.data import tokens as data
from hwlib.device import ChoiceError
from hwlib.steps import Settings
from hwlib.workloads import get_workload
from hwlib.workloads.gpt import GPT, GPTConfig

WL = get_workload("gpt")
CFG = WL.config("smoke")


def test_full_profile_is_gpt2_small():
    c = WL.config("full")
    assert (c.n_layer, c.d_model, c.n_head, c.context, c.vocab, c.batch) == (12, 768, 12, 1024, 50257, 16)
    assert WL.items_per_step(c) == 16384
    m = GPT(c)
    n = sum(p.numel() for p in m.parameters())
    assert 124e6 < n < 125e6   # tied embeddings: 124.4M


def test_bad_config_and_names():
    with pytest.raises(ChoiceError, match="'gpt3'"):
        get_workload("gpt3")
    with pytest.raises(ChoiceError, match="'huge'"):
        WL.config("huge")
    with pytest.raises(ChoiceError, match="'layers'"):
        WL.config("smoke", layers=3)
    with pytest.raises(ValueError, match="batch"):
        WL.config("smoke", batch=0)
    with pytest.raises(ValueError, match="divisible"):
        WL.config("smoke", n_head=5)


@pytest.mark.parametrize("workload", ["gpt", "resnet_bk"])
@pytest.mark.parametrize("field,value", [("lr", float("nan")), ("lr", -1), ("lr", 0), ("lr", "0.1"), ("lr", True),
                                         ("weight_decay", float("inf")), ("weight_decay", -0.1),
                                         ("weight_decay", "0")])
def test_optimizer_hyperparameters_are_validated(workload, field, value):
    wl = get_workload(workload)
    with pytest.raises(ValueError, match=rf"Config\.{field} must be a finite (positive|non-negative) number"):
        wl.config("smoke", **{field: value})
    assert wl.config("smoke", **{field: 0.5}).__getattribute__(field) == 0.5


def test_resnet_bk_z_imag_is_validated():
    wl = get_workload("resnet_bk")
    for bad in (0.0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="BKConfig.z_imag must be a finite positive number"):
            wl.config("smoke", z_imag=bad)


def test_gpt_and_resnet_bk_share_one_block():
    from hwlib.workloads.blocks import PreNormBlock
    gpt = WL.build(CFG, Settings(), seed=0)
    bk_wl = get_workload("resnet_bk")
    bk = bk_wl.build(bk_wl.config("smoke"), Settings(), seed=0)
    assert all(type(b) is PreNormBlock for b in list(gpt.blocks) + list(bk.blocks))
    # Parameter names (state-dict keys, init by name) are the ones checkpoints were written with.
    assert [n for n, _ in gpt.blocks[0].named_parameters()][:6] == [
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias"]
    assert [n for n, _ in bk.blocks[0].named_parameters()][2:6] == [
        "mix.to_potential.weight", "mix.to_potential.bias", "mix.from_features.weight", "mix.from_features.bias"]
    # The seed-0 smoke weights, bit for bit, as they were before the two blocks became one.
    assert _digest(gpt) == "19400ecb5c29f5cf" and _digest(bk) == "0c2eac3eb430ef4d"


def _digest(model) -> str:
    import hashlib
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def test_flops_formula_matches_counted_flops():
    """The analytic count (used for MFU) against torch's FLOP counter on forward + backward."""
    m = WL.build(CFG, Settings(), seed=0)
    x = torch.randint(0, CFG.vocab, (CFG.batch, CFG.context))
    with FlopCounterMode(display=False) as fc:
        m(x, x).backward()
    assert fc.get_total_flops() == pytest.approx(WL.flops_per_step(CFG), rel=0.01)


def test_same_seed_same_weights_and_padding_is_the_same_function():
    torch.manual_seed(123)  # the global RNG must not matter: init uses its own generator
    a = WL.build(CFG, Settings(), seed=0).double()
    torch.manual_seed(456)
    b = WL.build(CFG, Settings(vocab_multiple=64), seed=0).double()
    assert b.vocab_padded == 512 and a.vocab_padded == CFG.vocab
    assert torch.equal(a.wte.weight, b.wte.weight[: CFG.vocab]) and not b.wte.weight[CFG.vocab:].any()
    x = torch.randint(0, CFG.vocab, (3, 17))
    la, lb = a(x, x), b(x, x)
    assert torch.allclose(la, lb, rtol=1e-12, atol=0)
    la.backward()
    lb.backward()
    assert torch.allclose(a.wte.weight.grad, b.wte.weight.grad[: CFG.vocab], rtol=1e-10, atol=1e-14)
    assert not b.wte.weight.grad[CFG.vocab:].any()   # padded rows get no gradient


def test_sdpa_matches_manual_attention_in_float64():
    m = WL.build(CFG, Settings(), seed=1).double()
    x = torch.randint(0, CFG.vocab, (2, 33))
    manual = m(x)
    m.set_attention("sdpa")
    assert torch.allclose(manual, m(x), rtol=1e-10, atol=1e-12)


def test_causal_mask_is_real():
    m = WL.build(CFG, Settings(), seed=2)
    x = torch.randint(0, CFG.vocab, (1, 20))
    y = x.clone()
    y[0, 15:] = (y[0, 15:] + 1) % CFG.vocab
    assert torch.equal(m(x)[0, :15], m(y)[0, :15]) and not torch.equal(m(x)[0, 15:], m(y)[0, 15:])


def test_too_long_sequence_is_a_clear_error():
    m = WL.build(CFG, Settings(), seed=0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        m(torch.zeros(1, CFG.context + 1, dtype=torch.long))


def test_synthetic_stream_is_deterministic_and_learnable():
    a = data.synthetic_tokens(50_000, 300, seed=3)
    assert np.array_equal(a, data.synthetic_tokens(50_000, 300, seed=3))
    assert not np.array_equal(a, data.synthetic_tokens(50_000, 300, seed=4))
    assert a.min() >= 0 and a.max() < 300
    # entropy: bigram conditional < unigram < uniform -> there is structure to learn
    uni = np.bincount(a, minlength=300) / len(a)
    h_uni = -(uni[uni > 0] * np.log(uni[uni > 0])).sum()
    pair = np.bincount(a[:-1] * 300 + a[1:], minlength=300 * 300).reshape(300, 300)
    p = pair / pair.sum()
    cond = p / np.maximum(p.sum(1, keepdims=True), 1e-30)
    h_bi = -(p[p > 0] * np.log(cond[p > 0])).sum()
    assert h_bi < h_uni - 1.0 and h_uni < np.log(300) - 0.3


def test_cached_stream_is_reused(isolated_run):
    a = data.cached_synthetic_tokens(10_000, 500, seed=0)
    files = list(data.data_dir().glob("*.npy"))
    assert len(files) == 1 and a.dtype == np.uint16
    mtime = files[0].stat().st_mtime_ns
    assert np.array_equal(a, data.cached_synthetic_tokens(10_000, 500, seed=0))
    assert files[0].stat().st_mtime_ns == mtime


def test_text_file_loader_and_its_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        data.text_file_tokens(tmp_path / "nope.txt", 500)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty.txt.*empty"):
        data.text_file_tokens(tmp_path / "empty.txt", 500)
    (tmp_path / "bin.txt").write_bytes(b"ok \xff\xfe bad")
    with pytest.raises(ValueError, match="bin.txt.*not UTF-8"):
        data.text_file_tokens(tmp_path / "bin.txt", 500)
    with pytest.raises(ValueError, match="is not a regular file"):
        data.text_file_tokens(tmp_path, 500)
    (tmp_path / "t.txt").write_text("hello world")
    ids = data.text_file_tokens(tmp_path / "t.txt", 500)
    assert bytes(ids.astype(np.uint8)).decode() == "hello world"
    with pytest.raises(ValueError, match="vocab >= 256"):
        data.text_file_tokens(tmp_path / "t.txt", 100)


def test_token_batches_shift_and_repeat():
    toks = np.arange(1000, dtype=np.int64)
    b = data.TokenBatches(toks, batch=2, context=9, device=torch.device("cpu"))
    x, y = b(0)
    assert x.shape == (2, 9) and torch.equal(y, x + 1)
    assert torch.equal(b(0)[0], b(b.n_batches)[0])  # wraps around deterministically
    with pytest.raises(ValueError, match="shorter than one batch"):
        data.TokenBatches(toks[:15], batch=2, context=9, device=torch.device("cpu"))
