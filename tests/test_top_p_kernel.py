"""The sort-free top-p sampler (kernels/14_decode_top_p_triton.py) against the sorting reference,
``decode.sample_top_p``, token for token, row by row: bf16 logits at several temperatures and top_p,
sampled and greedy rows (noise of ones), float32 and fp16 logits (two-level and one-level keys),
peaked rows (a nucleus of 1-3 tokens), many tied logits (greedy takes the first maximum; a top-p
boundary inside a tied group keeps its first tokens in vocabulary order, as a stable sort does),
the kept set against the sorted reference's, one row pair at the real vocabulary (151,936), the
histograms left zeroed for the next call, the bad-input errors, and the kernels through Triton's
sm_90 compiler. The kernels run compiled on CUDA where a GPU is visible, else interpreted on CPU
tensors (conftest.py sets TRITON_INTERPRET=1 before triton is first imported): the interpreter
costs ~1 ms per reduction, so the blocks are large and the calls few.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hwlib.workloads.polychromic import decode

FILE = "14_decode_top_p_triton.py"
B, V = 3, 3001          # odd: three chunks of 1,024 tokens, the last one short


def blocks(dev: str, block: int) -> dict:
    """The interpreter's large blocks (few reductions: ~1 ms each) on a CPU; on a GPU the sampler's
    own bin block and a token block of at most 2,048 (a 32,768-bin tile takes minutes to compile)."""
    return dict(block=block, bin_block=32768) if dev == "cpu" else dict(block=min(block, 2048), bin_block=1024)


@pytest.fixture(scope="module")
def K(triton_device):
    from hwlib.ops.sources import load_python_kernel
    return load_python_kernel(FILE)


def stable_reference(logits, noise, temperature, top_p):
    """``decode.sample_top_p`` with a stable sort (tied probabilities in vocabulary order, as
    fused_decode's sorted sampler has them), and its kept mask [B, V]."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sp, idx = probs.sort(dim=-1, descending=True, stable=True)
    drop = (sp.cumsum(-1) - sp) >= top_p
    kept = torch.zeros_like(probs).scatter_(-1, idx, sp.masked_fill(drop, 0.0))
    mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, idx, ~drop)
    return (kept / noise).argmax(dim=-1), mask


def kernel_kept(K, sampler, logits):
    """The kept mask the sampler's threshold (L*, k) describes: keys above L*, and the first k
    tokens at L* in vocabulary order."""
    key, k = sampler.threshold()
    keys = K.order_keys(logits.cpu())
    at = keys == key.cpu()[:, None]
    rank = at.long().cumsum(-1) - 1
    return (keys > key.cpu()[:, None]) | (at & (rank < k.cpu()[:, None]))


def draw(K, sampler, logits, noise, temperature, top_p):
    dev = sampler.device
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the interpreter's numpy: exp overflow in masked lanes
        sampler(logits.to(dev), noise.to(dev), temperature, top_p, out)
    return out.cpu()


def noise_rows(g, b, v, greedy_rows=(0,)):
    e = torch.empty(b, v).exponential_(generator=g)
    e[list(greedy_rows)] = 1.0                # noise of ones: greedy
    return e


def check_tokens(K, sampler, logits, noise, temperature, top_p, unstable_too=True, kept_slack=0.0):
    got = draw(K, sampler, logits, noise, temperature, top_p)
    want, mask = stable_reference(logits, noise, temperature, top_p)
    assert torch.equal(got, want), (temperature, top_p, got, want)
    if unstable_too:   # decode's own sampler (its sort is unstable: ties may order differently)
        assert torch.equal(got, decode.sample_top_p(logits, noise, temperature, top_p)), (temperature, top_p)
    kept = kernel_kept(K, sampler, logits)
    if top_p < 1 and not kept_slack:
        assert torch.equal(kept, mask), (temperature, top_p)
    elif top_p < 1:   # the sets differ only at the boundary: by less than kept_slack of mass
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        assert float((probs * (kept ^ mask)).sum(-1).max()) < kept_slack, (temperature, top_p)
    else:   # every token; the reference's float32 cumsum may reach 1 early and drop ~1e-7 of tail mass
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        assert kept.all() and float((probs * ~mask).sum(-1).max()) < 1e-5
    return got, mask


@pytest.fixture(scope="module")
def bf16_sampler(K, triton_device):
    return K.TopPSampler(B, V, triton_device, torch.bfloat16, **blocks(triton_device, 1024))


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.5), (0.9, 0.9), (1.3, 1.0), (0.9, 0.95)])
def test_bf16_tokens_and_kept_set_match_the_sorted_reference(K, bf16_sampler, temperature, top_p):
    g = torch.Generator().manual_seed(int(temperature * 10) * 100 + int(top_p * 100))
    logits = (torch.randn(B, V, generator=g) * 3).to(torch.bfloat16)
    noise = noise_rows(g, B, V)
    got, mask = check_tokens(K, bf16_sampler, logits, noise, temperature, top_p)
    assert int(got[0]) == int(logits[0].float().argmax())          # row 0 greedy
    if top_p < 1:
        assert (mask.sum(-1) < V).all()                              # the threshold did cut


def test_float32_and_fp16_logits(K, triton_device):
    g = torch.Generator().manual_seed(7)
    s = K.TopPSampler(B, 1001, triton_device, torch.float32, **blocks(triton_device, 512))
    for temperature, top_p in ((0.7, 0.9), (1.3, 0.5)):
        logits = torch.randn(B, 1001, generator=g) * 2.5
        check_tokens(K, s, logits, noise_rows(g, B, 1001), temperature, top_p)
    h = K.TopPSampler(2, 1001, triton_device, torch.float16, **blocks(triton_device, 512))
    logits = (torch.randn(2, 1001, generator=g) * 3).to(torch.float16)
    check_tokens(K, h, logits, noise_rows(g, 2, 1001), 0.9, 0.9)


def test_a_peaked_nucleus_of_one_to_three_tokens(K, bf16_sampler):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, V, generator=g)
    logits[0, 2999] = 30                      # one token holds nearly all the mass
    logits[1, [5, 1500]] = 20                 # two tied ones, each about half
    logits[2, [0, 1023, 1024]] = 20           # three, a third each, across a chunk edge
    logits = logits.to(torch.bfloat16)
    for seed in (1, 2):
        noise = noise_rows(torch.Generator().manual_seed(seed), B, V, greedy_rows=())
        got, mask = check_tokens(K, bf16_sampler, logits, noise, 0.9, 0.9)
        assert mask.sum(-1).tolist() == [1, 2, 3]
        assert int(got[0]) == 2999 and int(got[1]) in (5, 1500) and int(got[2]) in (0, 1023, 1024)


def test_tied_logits_greedy_takes_the_first_maximum_and_a_cut_group_its_first_tokens(K, bf16_sampler):
    g = torch.Generator().manual_seed(13)
    # seven distinct values: groups of ~430 tied tokens spread over every chunk
    logits = torch.randint(-3, 4, (B, V), generator=g).to(torch.bfloat16)
    ones = torch.ones(B, V)
    got = draw(K, bf16_sampler, logits, ones, 0.9, 0.9)
    first_max = (logits == logits.max(-1, keepdim=True).values).float().argmax(-1)
    assert torch.equal(got, first_max) and torch.equal(got, decode.sample_top_p(logits, ones, 0.9, 0.9))
    for top_p in (0.3, 0.8):                  # the boundary lands inside a tied group
        noise = noise_rows(g, B, V, greedy_rows=())
        _, mask = check_tokens(K, bf16_sampler, logits, noise, 1.0, top_p, unstable_too=False)
        key, k = (t.cpu() for t in bf16_sampler.threshold())     # the logits here are CPU tensors
        at = K.order_keys(logits) == key[:, None]
        assert ((k > 0) & (k < at.sum(-1))).all()                   # cut inside the group, every row
        # the same number kept as the unstable reference (which tied tokens may differ)
        probs = torch.softmax(logits.float(), -1)
        sp = probs.sort(-1, descending=True).values
        assert torch.equal(mask.sum(-1), ((sp.cumsum(-1) - sp) < top_p).sum(-1))


def test_the_real_vocabulary(K, triton_device):
    g = torch.Generator().manual_seed(17)
    v = 151936
    s = K.TopPSampler(2, v, triton_device, torch.bfloat16, **blocks(triton_device, 16384))
    logits = (torch.randn(2, v, generator=g) * 2.5).to(torch.bfloat16)
    # torch's CPU float32 softmax sums Z ~8.5e-6 high at this V (its probabilities sum to 1 + 8.7e-6;
    # the kernel's Z is within ~1e-7), which moves the reference's boundary by about a token here
    check_tokens(K, s, logits, noise_rows(g, 2, v), 0.9, 0.9, kept_slack=3e-5)


def test_histograms_are_left_zeroed_for_the_next_call(K, triton_device):
    g = torch.Generator().manual_seed(19)
    s = K.TopPSampler(2, 700, triton_device, torch.float32, **blocks(triton_device, 512))
    logits = torch.randn(2, 700, generator=g)
    noise = noise_rows(g, 2, 700)
    first = draw(K, s, logits, noise, 0.9, 0.9)
    assert int(s.hist.abs().sum()) == 0 and int(s.mass1.abs().sum()) == 0 and int(s.hist2.abs().sum()) == 0
    assert bool((s.minlow == 65535).all())
    assert torch.equal(draw(K, s, logits, noise, 0.9, 0.9), first)


def test_bad_input_is_refused_naming_the_argument(K):
    s = K.TopPSampler(2, 50, "cpu", torch.bfloat16)
    x = torch.zeros(2, 50, dtype=torch.bfloat16)
    e, out = torch.ones(2, 50), torch.empty(2, dtype=torch.int64)
    for args, name in (((x.float(), e, 1.0, 0.9, out), "logits"),
                       ((x[:, :49], e[:, :49], 1.0, 0.9, out), "logits"),
                       ((x, e[:, :49], 1.0, 0.9, out), "noise"),
                       ((x, e.double(), 1.0, 0.9, out), "noise"),
                       ((x, e, 0.0, 0.9, out), "temperature"),
                       ((x, e, 1.0, 0.0, out), "top_p"),
                       ((x, e, 1.0, 1.5, out), "top_p"),
                       ((x, e, 1.0, 0.9, out.int()), "out")):
        with pytest.raises(ValueError, match=name):
            s(*args)
    with pytest.raises(ValueError, match="dtype"):
        K.TopPSampler(2, 50, "cpu", torch.float64)
    with pytest.raises(ValueError, match="logits"):       # one row without its batch dimension
        s(x[0], e[0], 1.0, 0.9, out)


TRITON_SM90 = r"""
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hwlib.ops.sources import load_python_kernel
mod = load_python_kernel("14_decode_top_p_triton.py")
PTR = {"e_ptr": "*fp32", "pm_ptr": "*fp32", "ps_ptr": "*fp32", "cplast_ptr": "*fp32", "best_s_ptr": "*fp32",
       "bnd_s_ptr": "*fp32", "cmass_ptr": "*fp64", "prev_mb_ptr": "*fp64", "mb_out_ptr": "*fp64",
       "mass_ptr": "*i64", "zero64_ptr": "*i64", "prev_key_ptr": "*i64", "key_out_ptr": "*i64",
       "k_out_ptr": "*i64", "key_ptr": "*i64", "k_ptr": "*i64", "bkey_ptr": "*i64", "out_ptr": "*i64"}
# the decode step's shape: B = 12, V = 151,936, the default blocks (75 chunks of 2,048, 64 of 1,024 bins)
BASE = {"BLOCK": 2048, "ACCURATE": True, "NCH_P2": 128, "BIN_BLOCK": 1024, "NBC_P2": 64, "BISECT": 19, "ZB": 1024}
runs = [(mod._stats_hist_kernel, 1, {}), (mod._bin_mass_kernel, 1, {"MODE": 0, "LEVEL2": False}),
        (mod._boundary_kernel, 1, {"MODE": 0, "LEVEL2": False}), (mod._draw_chunk_kernel, 1, {}),
        (mod._draw_row_kernel, 1, {}),
        # float32's own kernels and paths (the rest share their code with the ones above)
        (mod._mass1_kernel, 0, {}), (mod._hist2_kernel, 0, {}), (mod._boundary_kernel, 0, {"MODE": 1, "LEVEL2": True})]
for k, kind, extra in runs:
    consts = {a: v for a, v in {**BASE, **extra, "KIND": kind}.items() if a in k.arg_names}
    sig = {a: "constexpr" if a in consts else ("*i16" if kind else "*i32") if a == "x_ptr"
           else PTR.get(a, "*i32") if a.endswith("_ptr") else "fp32" if a in ("temp", "top_p") else "i32"
           for a in k.arg_names}
    c = compile(ASTSource(fn=k, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4})
    assert c.asm.get("cubin"), k.fn.__name__
print("compiled")
"""


def test_kernels_compile_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter skips Triton's compiler (and libdevice's expf, which only a compile uses):
    every kernel of the bf16 path and float32's own, through TTIR -> PTX -> cubin for sm_90."""
    compile_for_sm90(TRITON_SM90)
