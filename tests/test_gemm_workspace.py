"""Step 28: matmuls without cuBLAS's workspace (hwlib.blas), its step, and notebook 28's study."""

from __future__ import annotations

import os

import pytest
import torch

from hwlib import blas, roofline
from hwlib.ladder.session import Session
from hwlib.steps import chain, get_step, previous, settings_for
from hwlib.studies import gemm_workspace as S

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


def test_step_28_is_the_bf16_branch_on_step_25_with_only_the_workspace_changed():
    st = get_step("28_gemm_workspace")
    assert previous(st.name).name == "25_bias_column"
    assert not any(s.name.startswith(("26_", "27_", "18_")) for s in chain(st.name))
    before, after = settings_for("25_bias_column"), settings_for(st.name)
    assert after.diff(before) == {"gemm_workspace_free": (False, True)}
    assert not after.uses_fp8 and st.beyond_recipe and st.tolerance == 1e-2
    p = roofline.predict("gpt", st.name, "full", {"copy_gbps": 3000.0})
    assert p.kind == "none" and p.saved_ms is None


@pytest.mark.parametrize("free", [True, False])
def test_a_session_runs_its_steps_with_its_setting(free):
    sess = Session.__new__(Session)   # only what precision() reads
    sess.settings = settings_for("28_gemm_workspace" if free else "25_bias_column")
    with sess.precision():
        assert blas.workspace_free() is free
        assert blas.lt_workspace_bytes() == (0 if free else blas.LT_WORKSPACE_BYTES)
    assert not blas.workspace_free()


def _row(name, ws, us, lo, hi, memsets, lib="torch (cuBLAS)"):
    return {"matmul": name, "library": lib, "workspace": ws, "M": 16384, "d": 768, "memsets per call": memsets,
            "kernel": "k", "us": us, "p20": lo, "p80": hi}


def test_pairs_and_prose_are_built_from_the_rows():
    rows = [_row("a", "32 MiB", 100.0, 99.0, 101.0, 1.0), _row("a", "none", 95.0, 94.5, 95.5, 0.0),
            _row("b", "32 MiB", 50.0, 49.0, 51.0, 1.0, "hwlib (cuBLASLt)"),
            _row("b", "none", 50.5, 49.5, 51.5, 1.0, "hwlib (cuBLASLt)")]
    ps = S.pairs(rows)
    assert [(p["matmul"], p["saved us"], p["beyond spread"]) for p in ps] == [("a", 5.0, True), ("b", -0.5, False)]
    text = S.prose(rows, n_layer=12)
    assert "2 matmuls of a block: 2 brought a memset per call" in text and "1 of them none without it" in text
    assert "Still with a memset without the workspace: b." in text
    assert "a 100.0 -> 95.0 us; b 50.0 -> 50.5 us (within the spread)" in text
    assert "Together +4.5 us a block's matmuls, +0.054 ms over 12 blocks" in text
    assert "not timed alone" in S.prose([], 12)


def test_matmul_rows_needs_a_gpu_and_positive_counts():
    with pytest.raises(ValueError, match="captures CUDA graphs"):
        S.matmul_rows(64, 16, "cpu")
    if GPU:
        with pytest.raises(ValueError, match="calls and iters"):
            S.matmul_rows(64, 16, "cuda", calls=0)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLAS)")
def test_without_the_workspace_torch_matmuls_bring_no_memset():
    rows = S.matmul_rows(1024, 256, "cuda", iters=3, calls=2)
    assert {r["workspace"] for r in rows} == set(S.WORKSPACES)
    for r in rows:
        assert r["us"] > 0 and r["p20"] <= r["us"] <= r["p80"]
        if r["workspace"] == "none" and r["library"].startswith("torch"):
            assert r["memsets per call"] == 0, r
    assert not blas.workspace_free()


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
    from hwlib.ops import gelu_mlp as G
    for free in (False, True):
        with blas.no_workspace(free):
            assert G.workspace_bytes("forward") == G.workspace_bytes("backward") == blas.LT_WORKSPACE_BYTES
            assert G.workspace_bytes("input_grad") == (0 if free else blas.LT_WORKSPACE_BYTES)
    with pytest.raises(ValueError, match="call must be one of"):
        G.workspace_bytes("dx")
