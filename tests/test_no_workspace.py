"""Matmuls without cuBLAS's workspace (``hwlib.blas.no_workspace``): retired step 28's setting, which notebook
19's ``no_gemm_workspace`` toggle measures on step 25 (``tests/test_ablation.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from hwlib import blas

GPU = torch.cuda.is_available()


def test_no_workspace_sets_and_restores_the_sizes(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    assert not blas.workspace_free() and blas.lt_workspace_bytes() == blas.LT_WORKSPACE_BYTES
    with blas.no_workspace():
        assert blas.workspace_free() and blas.lt_workspace_bytes() == 0
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0" and os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"
        with blas.no_workspace():   # nested: the outer one still holds after the inner one ends
            pass
        assert blas.workspace_free() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"
    assert not blas.workspace_free() and blas.lt_workspace_bytes() == blas.LT_WORKSPACE_BYTES
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "CUBLASLT_WORKSPACE_SIZE" not in os.environ


def test_no_workspace_restores_after_an_error_and_is_inert_when_disabled(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        with blas.no_workspace():
            raise RuntimeError("boom")
    assert not blas.workspace_free() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with blas.no_workspace(False):
        assert not blas.workspace_free() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with blas.no_workspace("yes"):
            pass


def test_the_sizes_go_through_torchs_setters_where_it_has_them(monkeypatch):
    calls = []
    monkeypatch.setattr(blas, "_sizers", lambda: (lambda n: calls.append(("cublas", n)),
                                                  lambda n: calls.append(("cublaslt", n)),
                                                  lambda: calls.append(("reset",))))
    with pytest.raises(RuntimeError, match="boom"):
        with blas.no_workspace():
            assert calls == [("cublas", 0), ("cublaslt", 0)]
            with blas.no_workspace():   # nested: nothing set or reset twice
                pass
            assert calls == [("cublas", 0), ("cublaslt", 0)]
            raise RuntimeError("boom")
    assert calls == [("cublas", 0), ("cublaslt", 0), ("reset",)] and not blas.workspace_free()


@pytest.mark.skipif(GPU, reason="asks what happens without a GPU")
def test_no_setters_without_a_gpu_to_ask():
    assert blas._sizers() is None


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLAS)")
def test_a_workspace_first_made_without_a_size_is_not_used_after():
    """torch makes a stream's cuBLAS workspace at its first use: one first used inside no_workspace must not
    be handed to cuBLAS at the full size afterwards (it was empty: cuBLAS failed writing past it)."""
    a = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2304, 768, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2304, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with blas.no_workspace():
            inside = torch.nn.functional.linear(a, w, b)
        outside = torch.nn.functional.linear(a, w, b)
    torch.cuda.synchronize()
    assert torch.allclose(inside.float(), outside.float(), rtol=1e-2, atol=1e-1)


def test_the_gelu_epilogues_keep_their_workspace_and_the_plain_matmul_follows_the_setting():
    from hwlib.steps.s22_gelu_epilogue import op as G
    for free in (False, True):
        with blas.no_workspace(free):
            assert G.workspace_bytes("forward") == G.workspace_bytes("backward") == blas.LT_WORKSPACE_BYTES
            assert G.workspace_bytes("input_grad") == (0 if free else blas.LT_WORKSPACE_BYTES)
    with pytest.raises(ValueError, match="call must be one of"):
        G.workspace_bytes("dx")
