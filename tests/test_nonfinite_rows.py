"""The row kernels of the fused LM head against torch where a row holds non-finite logits: a NaN anywhere
in a row makes its loss NaN (never a finite log-sum-exp that left the NaN out), and -inf logits (a class
ruled out) are classes of probability 0, as torch's cross_entropy treats them, wherever they fall in the
row (docs/integrity.md, "Finite garbage"). The Triton pass runs compiled on a GPU, interpreted on a CPU
(conftest.py); the CUDA row pass only on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from hwlib.steps.s17_fused_lm_head import op as L

V, V_PAD = 40, 48     # two 16-column tiles and a half at block_v = 16; five 8-column vectors and padding


def _rows():
    """Logits [6, V_PAD] in fp32 and their targets: row 0 NaN in columns 0-7 (one 16-byte bf16 vector, a
    whole first half tile) away from its target; row 1 -inf over the whole first tile, finite after it; row
    2 one +inf; row 3 -inf over a later tile; row 4 plain; row 5 -inf in columns 8-15 only."""
    z = torch.randn(6, V_PAD, generator=torch.Generator().manual_seed(5)) * 3
    z[0, 0:8] = float("nan")
    z[1, 0:16] = float("-inf")
    z[2, 3] = float("inf")
    z[3, 16:32] = float("-inf")
    z[5, 8:16] = float("-inf")
    t = torch.tensor([20, 20, 20, 5, 7, 30])
    return z, t


def _want(z, t, scale):
    """torch's cross_entropy in float64: the loss per row and the gradient of scale * sum(loss)."""
    x = z[:, :V].double().cpu().requires_grad_()
    loss = F.cross_entropy(x, t.cpu(), reduction="none")
    (loss.sum() * scale).backward()
    return loss.detach(), x.grad


def _check(loss, zz, z, t, scale):
    want_loss, want_grad = _want(z, t, scale)
    loss, grad = loss.double().cpu(), zz[:, :V].double().cpu()
    assert torch.equal(torch.isnan(loss), torch.isnan(want_loss)), (loss, want_loss)
    fin = ~torch.isnan(want_loss)
    assert torch.allclose(loss[fin], want_loss[fin], rtol=1e-2, atol=1e-2), (loss, want_loss)
    assert torch.isnan(grad[~fin]).any(dim=1).all()                 # a NaN row's gradient is not finite garbage
    assert torch.allclose(grad[fin], want_grad[fin], atol=1e-2), (grad[fin] - want_grad[fin]).abs().amax(1)
    assert (zz[fin.to(zz.device), V:] == 0).all()                   # padding: exact zeros


def test_the_triton_row_pass_propagates_nan_and_takes_minus_inf_as_probability_zero(triton_device):
    z, t = _rows()
    zz, loss = z.clone().to(triton_device), torch.empty(6, device=triton_device)
    scale = torch.full((1,), 0.5, device=triton_device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the interpreter's numpy warns of inf - inf
        L._kernel().ce_rows_(zz, t.to(triton_device), loss, scale, V, -100, write_grad=True, block_v=16, num_warps=1)
    _check(loss, zz, z, t, 0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA row pass needs a CUDA GPU")
def test_the_cuda_row_pass_propagates_nan_and_takes_minus_inf_as_probability_zero():
    """The CUDA pass's per-vector maximum (fmaxf) drops NaN: a vector of 8 NaN logits looked like padding and
    was skipped, and the row's loss was the log-sum-exp of the other columns, finite."""
    from hwlib.steps.s17_fused_lm_head import ce_rows_cuda as C
    z, t = _rows()
    z = z.to(torch.bfloat16)
    zz, loss = z.cuda(), torch.empty(6, device="cuda")
    C.ce_rows_(zz, t.cuda(), loss, torch.full((1,), 0.5, device="cuda"), V, -100, write_grad=True)
    _check(loss, zz, z.float(), t, 0.5)
