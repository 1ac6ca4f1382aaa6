"""The fused LM head + cross-entropy: loss and gradients (h and W) against float64 on fresh random
inputs of odd sizes, for the torch backend and the Triton kernel (compiled on CUDA where a GPU is
visible, else interpreted on CPU tensors: conftest.py sets TRITON_INTERPRET=1 before triton is first
imported); at least as accurate as the unfused bf16 path; the bad-input paths; the op under
torch.compile; GPT with the fused head against GPT without; the kernel through Triton's sm_90
compiler. Inputs are drawn per case from a seed derived from the case; HWLIB_TEST_SEED=<int> draws
fresh ones.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from hwlib.device import ChoiceError, Unavailable
from hwlib.steps.s17_fused_lm_head import ce_rows_cuda as C
from hwlib.steps.s17_fused_lm_head import op as L
from hwlib.steps.s17_fused_lm_head.op import (fused_linear_cross_entropy, linear_cross_entropy_reference,
                                            unfused_linear_cross_entropy)


def _gen(*key) -> torch.Generator:
    seed = int(os.environ.get("HWLIB_TEST_SEED", "0")) + zlib.crc32(repr(key).encode())
    return torch.Generator().manual_seed(seed)


def make(n, d, vp, v, dtype=torch.float64, ignored=2, key=(), device="cpu"):
    """h [n, d], W [vp, d] with logits of order 1, targets in [0, v) with ``ignored`` of them -100."""
    g = _gen(n, d, vp, v, str(dtype), *key)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(vp, d, generator=g, dtype=torch.float64) / d ** 0.5 * 2
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.randperm(n, generator=g)[:ignored]] = -100
    return h.to(device, dtype), w.to(device, dtype), t.to(device)


def run(h, w, t, **kw):
    """Loss and the gradients of h and W through the op (or ``fn=``), from fresh leaves."""
    fn = kw.pop("fn", fused_linear_cross_entropy)
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(hh, ww, t, **kw)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


def ref(h, w, t, vocab, ignore_index=-100):
    return run(h.double().cpu(), w.double().cpu(), t.cpu(), fn=linear_cross_entropy_reference, vocab=vocab,
               ignore_index=ignore_index)


def rel(x, r) -> float:
    x, r = x.double().cpu(), r.double().cpu()          # r may be another GPU run, not the float64 reference
    return float((x - r).abs().max() / r.abs().max().clamp_min(1e-300))


def assert_close(got, want, tol):
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        assert rel(a, b) < tol, f"{name}: relative error {rel(a, b):.2e} >= {tol:.0e}"


# --- against float64 ---------------------------------------------------------------------------

# (N, D, V_pad, V, chunk): nothing a multiple of anything, one row, one class, ragged last chunks
SIZES = [(37, 19, 77, 70, 10), (1, 3, 5, 5, None), (23, 7, 1, 1, 4), (50, 33, 130, 127, 17)]


@pytest.mark.parametrize("n, d, vp, v, chunk", SIZES, ids=str)
def test_torch_backend_matches_float64(n, d, vp, v, chunk):
    h, w, t = make(n, d, vp, v, ignored=min(2, n - 1))
    got = run(h, w, t, vocab=v, chunk=chunk, backend="torch")
    assert_close(got, ref(h, w, t, v), 1e-12)
    assert got[2][v:].abs().max() == 0 if vp > v else True     # padded rows: no class, no gradient


def test_triton_kernel_tiles_against_float64(triton_device):
    """The row pass alone, several vocabulary tiles per row (online rescaling across tiles), padded
    columns, ignored and valid rows: loss per row and the gradient written over the logits."""
    kern = L._kernel()
    g = _gen("kernel")
    C, vp, v = 9, 77, 70
    z64 = torch.randn(C, vp, generator=g, dtype=torch.float64) * 4
    z64[0, 60:] += 120      # a later tile far above the first: exp overflows fp32 unless rescaled online
    z64[1, :8] += 120       # and the first far above the rest
    t = torch.randint(0, v, (C,), generator=g)
    t[3] = -100
    z = z64.float().to(triton_device)
    loss = torch.empty(C, device=triton_device)
    scale = torch.full((1,), 0.125, device=triton_device)
    kern.ce_rows_(z, t.to(triton_device), loss, scale, v, -100, write_grad=True, block_v=16, num_warps=1)
    x = z64.float().double()[:, :v]
    lse = torch.logsumexp(x, 1)
    valid = t != -100
    want_loss = torch.where(valid, lse - x.gather(1, t.clamp_min(0)[:, None])[:, 0], torch.zeros(()))
    want = torch.exp(x - lse[:, None])
    want[valid.nonzero()[:, 0], t[valid]] -= 1
    want = want * 0.125 * valid[:, None]
    assert (loss.cpu().double() - want_loss).abs().max() < 1e-5
    assert (z.cpu()[:, :v].double() - want).abs().max() < 1e-6
    assert z.cpu()[:, v:].abs().max() == 0


@pytest.mark.parametrize("n, d, vp, v, chunk", [(37, 19, 77, 70, 10), (5, 4, 3, 2, None)], ids=str)
def test_triton_backend_matches_float64(triton_device, n, d, vp, v, chunk):
    h, w, t = make(n, d, vp, v, dtype=torch.float32, key=("triton",), device=triton_device)
    got = run(h, w, t, vocab=v, chunk=chunk, backend="triton")
    assert_close(got, ref(h, w, t, v), 2e-5)
    assert_close(got, run(h, w, t, vocab=v, chunk=chunk, backend="torch"), 2e-5)


def test_triton_16bit_logits_match_the_torch_backend(triton_device):
    """16-bit logits through the kernel (fp16: the interpreter has no bf16; the kernel's loads and
    stores are the same code for both): the same loss and gradients as the torch row pass."""
    h, w, t = make(37, 19, 77, 70, dtype=torch.float16, key=("fp16",), device=triton_device)
    got = run(h, w, t, vocab=70, chunk=10, backend="triton")
    assert got[1].dtype == got[2].dtype == torch.float16
    assert_close(got, run(h, w, t, vocab=70, chunk=10, backend="torch"), 1e-3)
    assert_close(got, ref(h, w, t, 70), 3e-3)


def test_at_least_as_accurate_as_the_unfused_bf16_path():
    """Both under bf16 autocast from fp32 leaves, both against float64 on the same inputs."""
    n, d, vp, v = 96, 40, 192, 181
    h, w, t = make(n, d, vp, v, dtype=torch.float32, key=("bf16",))
    want = ref(h, w, t, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = run(h, w, t, vocab=v, chunk=40)
        unfused = run(h, w, t, fn=unfused_linear_cross_entropy, vocab=v)
    assert fused[1].dtype == fused[2].dtype == torch.float32
    for i, name in enumerate(("loss", "dh", "dW")):
        ef, eu = rel(fused[i], want[i]), rel(unfused[i], want[i])
        assert ef <= 1.1 * eu + 1e-6, f"{name}: fused error {ef:.2e} > unfused {eu:.2e}"
        assert ef < 2e-2, f"{name}: fused error {ef:.2e}"     # and bf16-sized, not merely no worse


# --- ignore_index, non-contiguous inputs, compile --------------------------------------------------

def test_ignore_index_all_ignored_and_in_range():
    h, w, t = make(12, 5, 9, 9, ignored=0)
    # an ignore_index that is also a class: its targets drop out, the mean is over the rest
    got = run(h, w, t, ignore_index=3, backend="torch")
    assert_close(got, ref(h, w, t, 9, ignore_index=3), 1e-12)
    loss, gh, gw = run(h, w, torch.full_like(t, -100), backend="torch")
    assert torch.isnan(loss) and torch.isnan(torch.nn.functional.cross_entropy(h @ w.t(), torch.full_like(t, -100)))
    assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_non_contiguous_inputs_give_the_same_result():
    h, w, t = make(24, 6, 11, 10)
    hs = h.t().contiguous().t()                       # same values, column-major
    w2 = torch.stack([w, w], 2)[..., 0]               # strided columns
    t2 = torch.stack([t, t], 1)[:, 0]                 # strided targets
    assert not (hs.is_contiguous() or w2.is_contiguous() or t2.is_contiguous())
    assert_close(run(hs, w2, t2, vocab=10, chunk=7), ref(h, w, t, 10), 1e-12)
    h3 = h.reshape(4, 6, 6).transpose(0, 1)           # [..., D] rows in any layout
    got = run(h3, w, t.reshape(4, 6).t(), vocab=10)
    want = ref(h3.reshape(-1, 6), w, t.reshape(4, 6).t().reshape(-1), 10)
    assert_close(got[:1], want[:1], 1e-12)


def test_compiled_fullgraph_with_autocast_and_nan_for_bad_targets():
    """One graph (no breaks) under torch.compile with bf16 autocast; the eager path's ValueError
    for a bad target becomes a NaN loss inside the compiled graph (no host look there); the op's fake
    outputs have the real ones' shapes, dtypes and strides (what inductor's compiled code would assert)."""
    from fakes import hwlib_fakes_checked
    h, w, t = make(16, 8, 13, 12, dtype=torch.float32, key=("compile",))
    # aot_eager, not inductor (tests/fakes.py says why)
    fn = torch.compile(lambda h, w, t: fused_linear_cross_entropy(h, w, t, vocab=12), fullgraph=True,
                       backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(h, w, t, fn=fn)
        with hwlib_fakes_checked():
            eager = run(h, w, t, vocab=12)
        bad = t.clone()
        bad[1] = 12
        nan_loss, nan_gh, _ = run(h, w, bad, fn=fn)
    assert_close(got, eager, 1e-6)
    assert torch.isnan(nan_loss) and torch.isnan(nan_gh).any()


def test_opcheck_schema_fake_and_autograd():
    h, w, t = make(9, 4, 7, 6, dtype=torch.float32, key=("opcheck",))
    torch.library.opcheck(torch.ops.hwlib.linear_cross_entropy.default,
                          (h.requires_grad_(), w.requires_grad_(), t, 6, -100, 4, "torch", True, torch.bfloat16))
    torch.library.opcheck(torch.ops.hwlib.linear_cross_entropy.default,
                          (h.detach(), w.detach(), t, 6, -100, 4, "torch", False, torch.float32))


@pytest.mark.parametrize("mode", L._MM_MODES)
def test_each_cuda_product_mode_calls_torch_as_it_exists(mode):
    """The three ways dW and dh are formed on CUDA (which one runs depends on the torch release),
    each on meta tensors: the calls exist with these arguments, and give fp32 [rows, cols]."""
    a = torch.empty(64, 48, dtype=torch.bfloat16, device="meta")
    b = torch.empty(48, 32, dtype=torch.bfloat16, device="meta")
    out = torch.empty(64, 32, dtype=torch.float32, device="meta")
    if mode == "addmm_fp32":
        try:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        except TypeError as e:   # the meta path decomposes addmm with out_dtype wrongly in some releases (2.11)
            pytest.skip(f"torch {torch.__version__}'s meta addmm(out_dtype=) fails ({e}); CUDA probes it for real")
    for accumulate in (False, True):
        L._mm(out, a, b, accumulate=accumulate, mode=mode)
        L._mm(out, a.t().contiguous().t(), b, accumulate=accumulate, mode=mode)   # a column-major operand, as dz^T
    assert out.dtype == torch.float32 and out.shape == (64, 32)


def test_no_grad_computes_the_loss_only():
    h, w, t = make(10, 4, 6, 6)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h.requires_grad_(), w, t)
    assert abs(float(loss) - float(linear_cross_entropy_reference(h.detach(), w, t))) < 1e-12
    assert not loss.requires_grad


# --- bad input: a clear error naming the argument, before any work ------------------------------------

def _bad_cases():
    h, w, t = make(6, 4, 5, 5)
    return [
        ("h", dict(h=h.numpy())),
        ("h must be [..., D]", dict(h=h[0])),
        ("h must be floating", dict(h=h.long())),
        ("weight must be [V, D]", dict(weight=w[0])),
        ("the widths must match", dict(weight=w[:, :3])),
        ("targets must be integer", dict(targets=t.double())),
        ("targets has shape", dict(targets=t[:5])),
        ("h has no rows", dict(h=h[:0], targets=t[:0])),
        ("vocab = 6 exceeds", dict(vocab=6)),
        ("vocab must be >= 1", dict(vocab=0)),
        ("vocab must be an int", dict(vocab=2.5)),
        ("chunk must be >= 1", dict(chunk=0)),
        ("ignore_index must be an int", dict(ignore_index=None)),
        ("targets: 5 at flat index 2", dict(targets=t.clone().index_fill_(0, torch.tensor([2]), 5))),
        ("targets: -3 at flat index 0", dict(targets=t.clone().index_fill_(0, torch.tensor([0]), -3))),
        ("outside autocast they must match", dict(weight=w.float())),
    ], (h, w, t)


@pytest.mark.parametrize("says", [c[0] for c in _bad_cases()[0]])
def test_bad_input_names_the_argument(says):
    cases, (h, w, t) = _bad_cases()
    kw = dict(next(c[1] for c in cases if c[0] == says))
    args = dict(h=h, weight=w, targets=t)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("(", r"\(").replace(".", r"\.")):
        fused_linear_cross_entropy(args["h"], args["weight"], args["targets"], **kw)


def test_bad_backend_and_unavailable_triton():
    h, w, t = make(4, 3, 5, 5)
    with pytest.raises(ChoiceError):
        fused_linear_cross_entropy(h, w, t, backend="cudnn")
    assert L.select_backend("auto", "cpu") == "torch"


def test_the_cuda_row_pass_says_where_it_cannot_run():
    with pytest.raises(Unavailable, match="CUDA tensors only"):
        L.select_backend("cuda", "cpu")
    with pytest.raises(Unavailable, match="backend 'cuda'"):
        fused_linear_cross_entropy(*make(4, 3, 5, 5), backend="cuda")
    fit = C.fit_problem
    assert fit(torch.bfloat16, 50304, 227 * 1024) is None and fit(torch.float16, 8, 272) is None
    assert "bf16 or fp16" in fit(torch.float32, 64, 1 << 20)
    assert "multiple of 8" in fit(torch.bfloat16, 50257, 1 << 20)
    assert "exceeds the 232448 bytes" in fit(torch.bfloat16, 116_104, 232_448)
    assert fit(torch.bfloat16, 116_096, 232_448) is None          # 232,192 + 256 bytes: just fits


# --- the CUDA row pass ----------------------------------------------------------------------------

needs_cuda_rows = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA row pass needs a CUDA GPU")


def _chunk(n, vp, v, dtype, key, bad=False):
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((n, vp, v, key)).encode()))
    z = (torch.randn(n, vp, device="cuda", generator=g) * 3).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::5] = -100
    if bad:
        t[1] = v + 1                           # not a class, not ignore_index
    scale = (1.0 / (t != -100).sum().clamp_min(1).float()).reshape(1)
    return z, t, scale


def _reference_rows(z, t, scale, v):
    """Loss and gradient of a chunk of logits in float64 (rows with a bad target left out)."""
    x = z.double()[:, :v]
    lse = torch.logsumexp(x, 1)
    keep = t != -100
    safe = torch.where(keep & (t < v), t, 0)
    loss = torch.where(keep, lse - x.gather(1, safe[:, None])[:, 0], torch.zeros_like(lse))
    g = torch.softmax(x, 1)
    g.scatter_add_(1, safe[:, None], -(keep & (t < v)).double()[:, None])
    grad = torch.zeros_like(z, dtype=torch.float64)
    grad[:, :v] = g * scale.double() * keep[:, None]
    return loss, grad


@needs_cuda_rows
@pytest.mark.parametrize("n, vp, v, dtype", [(4096, 50304, 50257, torch.bfloat16), (37, 8, 1, torch.bfloat16),
                                             (129, 4104, 4097, torch.float16), (300, 1000, 999, torch.bfloat16)],
                         ids=str)
def test_cuda_row_pass_matches_float64_and_the_triton_pass(n, vp, v, dtype):
    """Fresh logits at odd widths (padding columns, one class, several thousand): loss and gradient
    against float64, no worse than the Triton pass's (which reads the row twice), ignored rows zero."""
    z, t, scale = _chunk(n, vp, v, dtype, "match")
    want_loss, want_grad = _reference_rows(z, t, scale, v)
    got = {}
    for name, fn in (("cuda", C.ce_rows_), ("triton", L._kernel().ce_rows_)):
        zz, loss = z.clone(), torch.full((n,), float("nan"), device="cuda")
        fn(zz, t, loss, scale, v, -100, write_grad=True)
        got[name] = (loss, zz)
    err = {k: ((l.double() - want_loss).abs().max().item(), (g.double() - want_grad).abs().max().item())
           for k, (l, g) in got.items()}
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for i in range(2):
        assert err["cuda"][i] <= 1.5 * err["triton"][i] + unit * (1e-4 if i == 0 else scale.item()), err
    loss, g = got["cuda"]
    ign = t == -100
    assert (loss[ign] == 0).all() and (g[ign] == 0).all()
    assert (g[:, v:] == 0).all()                                       # padding: exact zeros


@needs_cuda_rows
def test_cuda_row_pass_bad_targets_give_nan_and_loss_only():
    z, t, scale = _chunk(64, 520, 513, torch.bfloat16, "bad", bad=True)
    zz, loss = z.clone(), torch.empty(64, device="cuda")
    C.ce_rows_(zz, t, loss, scale, 513, -100, write_grad=True)
    assert torch.isnan(loss[1]) and torch.isnan(zz[1].float()).all()
    assert torch.isfinite(loss[2:]).all()
    z2, loss2 = z.clone(), torch.empty(64, device="cuda")
    C.ce_rows_(z2, t, loss2, scale, 513, -100, write_grad=False)   # the loss only: the logits stay as they were
    assert torch.equal(z2, z) and torch.equal(loss2[2:], loss[2:])


@needs_cuda_rows
def test_cuda_row_pass_refuses_what_it_cannot_read_with_the_reason():
    z, t, scale = _chunk(8, 72, 70, torch.bfloat16, "refuse")
    loss = torch.empty(8, device="cuda")
    with pytest.raises(ValueError, match="16-byte boundaries"):
        C.ce_rows_(torch.empty(8, 73, device="cuda", dtype=torch.bfloat16)[:, 1:], t, loss, scale, 70, -100)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        C.ce_rows_(z.float(), t, loss, scale, 70, -100)
    with pytest.raises(ValueError, match="vocab"):
        C.ce_rows_(z, t, loss, scale, 73, -100)


@needs_cuda_rows
def test_the_op_with_the_cuda_row_pass_matches_the_triton_pass():
    """The whole op under bf16 autocast: auto picks the CUDA pass for bf16 logits, the Triton pass for
    fp32 ones (where 'cuda' itself is a ValueError), and both agree with float64 as closely."""
    h, w, t = make(300, 64, 1000, 999, dtype=torch.float32, key=("op",), device="cuda")
    assert L.select_backend("auto", "cuda", torch.bfloat16, 1000) == "cuda"
    assert L.select_backend("auto", "cuda", torch.float32, 1000) == "triton"
    with pytest.raises(ValueError, match="bf16 or fp16"):
        L.select_backend("cuda", "cuda", torch.float32, 1000)
    want = ref(h, w, t, 999)
    with torch.autocast("cuda", torch.bfloat16):
        cu = run(h, w, t, vocab=999, chunk=128, backend="cuda")
        tr = run(h, w, t, vocab=999, chunk=128, backend="triton")
    for a, b, r in zip(cu, tr, want):
        assert rel(a, r) <= 1.5 * rel(b, r) + 1e-6, (rel(a, r), rel(b, r))


def test_default_chunk_of_gpt2_small():
    # 16,384 tokens x 50,304 bf16 logits: four chunks of 4,096 rows (412 MB each, not 1.65 GB)
    assert L.chunk_rows(16384, 50304, 2) == 4096
    assert L.chunk_rows(100, 50304, 2) == 100 and L.chunk_rows(10, 7, 4, chunk=4) == 4   # 4 + 4 + 2 -> 4
    assert L.chunk_rows(9, 7, 4, chunk=4) == 3                                          # 3 + 3 + 3


# --- GPT with the fused head ------------------------------------------------------------------------

def test_gpt_fused_head_matches_the_unfused_head():
    from conftest import gpt_with
    from hwlib.workloads.gpt import GPTConfig
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, context=8, vocab=50, batch=2)
    x = torch.randint(0, 50, (2, 8), generator=_gen("gpt"))
    y = torch.randint(0, 50, (2, 8), generator=_gen("gpt", 1))
    out = []
    for fused in (False, True):
        m = gpt_with(*(["17_fused_lm_head"] if fused else []), cfg=cfg, attention="manual", vocab_multiple=64).double()
        loss = m(x, y)
        loss.backward()
        out.append((loss.detach(), m.wte.weight.grad, m.blocks[0].attn.c_attn.weight.grad))
        assert m(x).shape == (2, 8, 50)                 # without targets: the logits, as before
    assert_close(out[1], out[0], 1e-12)


# --- the kernel through Triton's real compiler, for sm_90 -------------------------------------------

TRITON_SM90 = r"""
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hwlib.ops.sources import load_python_kernel
mod = load_python_kernel("17_linear_ce_triton.py")
k = mod._ce_rows_kernel
# as a GPU launch specializes GPT-2's head: pointers, the row stride and V_pad (50,304) divisible by 16
aligned = ("z_ptr", "t_ptr", "loss_ptr", "scale_ptr", "stride_row", "V_pad")
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(k.arg_names) if a in aligned}
for write in (True, False):
    consts = {"WRITE_GRAD": write, "BLOCK_V": mod.DEFAULT_BLOCK_V}
    sig = {a: "constexpr" if a in consts else {"z_ptr": "*bf16", "t_ptr": "*i64"}.get(a, "*fp32")
           if a.endswith("_ptr") else "i32" for a in k.arg_names}
    c = compile(ASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": mod.DEFAULT_WARPS})
    assert c.asm.get("cubin"), write
    assert "ld.local" not in c.asm["ptx"], ("local memory", write)
    # the logits stream in 16-byte loads: the one 2-byte load is the target's logit (a mask at the odd V
    # instead of V_pad would make every load of the logits a 2-byte one)
    ptx = c.asm["ptx"]
    assert "ld.global.v4" in ptx and ptx.count("ld.global.b16") + ptx.count("ld.global.u16") <= 1, \
        ("scalar loads of the logits", write)
print("compiled")
"""


def test_kernel_compiles_for_sm90_without_a_gpu(compile_for_sm90):
    """The interpreter skips Triton's compiler: compile the real pipeline (TTIR -> PTX -> cubin) for
    sm_90 at the default launch configuration, bf16 logits, with and without the gradient write:
    no local memory, and vectorised loads of the logits."""
    compile_for_sm90(TRITON_SM90)


def test_auto_says_why_it_falls_back_from_the_cuda_row_pass(monkeypatch):
    """On CUDA tensors, a machine where the CUDA row pass cannot run (no toolchain, a failed build)
    gets a warning naming the reason; a call whose dtype the pass does not take falls back quietly."""
    import warnings
    monkeypatch.setattr(C, "device_problem", lambda device_type: "nvcc not found: install the CUDA toolkit")
    with pytest.warns(RuntimeWarning, match=r"fell back from 'cuda' to .*nvcc not found"):
        assert L.select_backend("auto", "cuda", torch.bfloat16, 64) in ("triton", "torch")
    monkeypatch.setattr(C, "device_problem", lambda device_type: None)
    monkeypatch.setattr(C, "smem_limit", lambda device="cuda": 1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert L.select_backend("auto", "cuda", torch.float32, 64) in ("triton", "torch")
        assert L.select_backend("auto", "cuda", torch.bfloat16, 64) == "cuda"


def test_cut_cross_entropy_is_asked_for_its_exact_variant_as_the_release_names_it():
    """Releases with a CCE_EXACT preset get it; 25.x (no such member: impl="cce_exact" raises
    NotImplementedError there) gets gradient filtering off instead; neither is a filtered CCE."""
    import enum
    import types

    from hwlib.steps.s17_fused_lm_head.study import cce_exact_options

    old = types.SimpleNamespace(LinearCrossEntropyImpl=enum.IntEnum("I", "CCE CCE_EXACT TORCH_COMPILE"))
    new = types.SimpleNamespace(LinearCrossEntropyImpl=enum.IntEnum("I", "CCE TORCH_COMPILE"))
    assert cce_exact_options(old) == {"impl": "cce_exact"}
    assert cce_exact_options(new) == {"filter_eps": None}
    assert cce_exact_options(types.SimpleNamespace()) == {"filter_eps": None}


def test_other_projects_kernels_are_rows_with_a_reason_off_cuda():
    from hwlib.steps.s17_fused_lm_head.study import OTHERS, implementations

    rows = {name: (fn, why) for name, fn, why in implementations(torch.device("cpu"), 50, OTHERS)}
    assert set(rows) == set(OTHERS)
    for name, (fn, why) in rows.items():
        assert fn is None and "CUDA" in why, (name, why)
    with pytest.raises(ValueError, match="impls"):
        implementations(torch.device("cpu"), 50, ["cce"])


def test_the_studys_check_runs_the_interpreted_row_pass_on_a_cpu_and_catches_a_wrong_one(triton_device, monkeypatch):
    """Notebook 17 checks ``study.odd_size_rows``: on a CPU its rows hold the Triton row pass, interpreted
    at small odd sizes (one tile; two, the second nearly all padding), beside the torch backend; a row
    pass that writes its gradient 0.1% too large fails them."""
    from hwlib.steps.s17_fused_lm_head import study
    if triton_device != "cpu":
        pytest.skip("on a GPU the study's auto backend is a compiled row pass itself")
    small = ((3, 5, 7, 7, 2),)
    rows = study.odd_size_rows("cpu", sizes=small, seed=0)
    assert [r["backend"] for r in rows] == ["torch"] + ["triton (interpreted)"] * len(study.INTERPRETED_SIZES)
    assert [(r["N"], r["D"], r["V_pad"], r["V"], r["chunk"]) for r in rows[1:]] == list(study.INTERPRETED_SIZES)
    assert all(r["within tolerance"] and r["padded rows of dW"] == 0 for r in rows), rows
    k = L._kernel()
    real = k.ce_rows_

    def gradient_a_little_large(z, *args, **kw):
        real(z, *args, **kw)
        z.mul_(1.001)
    monkeypatch.setattr(k, "ce_rows_", gradient_a_little_large)
    rows = study.odd_size_rows("cpu", sizes=small, seed=0, interpreted_sizes=small)
    assert [r["within tolerance"] for r in rows] == [True, False], rows
