"""Ops and helpers that returned a finite number where none exists, or took nonsense arguments: each
case is now a clear error naming the argument, or the non-finite result torch gives
(docs/integrity.md, "Finite garbage")."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from hwlib import noise
from hwlib.steps.s21_fused_layernorm.op import add_layer_norm
from hwlib.ops.bk_core import resolvent_diagonal
from hwlib.steps.s18_fp8.op import fp8_linear


def test_add_layer_norm_of_overflowing_rows_is_nan_not_zero():
    """A row whose squares overflow fp32 had 1/sqrt(inf) = 0 as its scale: every y was the bias, a
    finite answer for a variance that was never computed. Torch's own layer_norm gives NaN at some
    widths and the exact answer at others; never a made-up finite row."""
    D = 8
    x = torch.randn(3, D, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    x[1] *= 3e19                                    # its squares overflow fp32
    w, b = torch.rand(D) + 0.5, torch.randn(D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s, y = add_layer_norm(x, torch.zeros_like(x), w, b, backend="torch")
    ref = F.layer_norm(x, (D,), w, b)
    assert torch.isnan(y[1]).all()
    assert torch.allclose(y[[0, 2]], ref[[0, 2]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 0.0, -1e-5])
def test_add_layer_norm_refuses_an_eps_that_is_not_positive_and_finite(eps):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="eps must be a positive number \\(and finite\\)"):
        add_layer_norm(x, x, torch.ones(8), torch.zeros(8), eps=eps, backend="torch")


def test_one_infinite_element_of_fp8_linear_stays_in_its_own_row():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 32, generator=g), torch.randn(16, 32, generator=g)
    x[3, 7] = float("inf")
    y = fp8_linear(x, w)
    assert torch.isfinite(y).all(dim=1).tolist() == [True, True, True, False, True]
    ref = x[[0, 1, 2, 4]] @ w.t()
    assert float((y[[0, 1, 2, 4]] - ref).norm() / ref.norm()) < 0.1   # FP8 rounding, not garbage


def test_fp8_linear_of_no_rows_is_an_empty_product():
    w, bias = torch.randn(16, 32), torch.randn(16)
    x = torch.randn(2, 0, 32, requires_grad=True)
    y = fp8_linear(x, w, bias)
    assert y.shape == (2, 0, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_bk_core_refuses_meta_tensors_naming_them():
    t = torch.empty(2, 6, device="meta")
    with pytest.raises(ValueError, match="meta tensors"):
        resolvent_diagonal(t, t[..., 1:], t[..., 1:], 0.3 + 1j)


@pytest.mark.parametrize("q", [-0.01, 1.01, float("nan"), "0.5", True])
def test_quantile_takes_q_in_0_1_only(q):
    with pytest.raises(ValueError, match="q must be a number in \\[0, 1\\]"):
        noise.quantile([1.0, 2.0, 3.0], q)
    assert noise.quantile([1.0, 2.0, 3.0], 0.5) == 2.0 and noise.quantile([4.0], 1) == 4.0
