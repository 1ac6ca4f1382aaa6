"""Step 28: matmuls without cuBLAS's workspace (hwlib.blas), its step, and notebook 28's study."""

from __future__ import annotations

import os

import pytest
import torch

from hwlib import blas, steps
from hwlib.ladder.session import Session
from hwlib.steps import chain, get_step, previous, settings_for, uses_fp8
from hwlib.steps.s28_gemm_workspace import study as S

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
    assert settings_for(st.name) == settings_for("25_bias_column")   # no knob: only its context
    assert st.apply is None and st.context is not None
    assert not uses_fp8(st.name) and st.beyond_recipe and st.tolerance == 1e-2
    p = steps.predict("gpt", st.name, "full", {"copy_gbps": 3000.0})
    assert p.kind == "none" and p.saved_ms is None


@pytest.mark.parametrize("free", [True, False])
def test_a_session_runs_its_steps_with_its_setting(free):
    sess = Session.__new__(Session)   # only what precision() reads
    sess.step_name, sess.skip = ("28_gemm_workspace" if free else "25_bias_column"), ()
    sess.settings = settings_for(sess.step_name)
    with sess.precision():
        assert blas.workspace_free() is free
        assert blas.lt_workspace_bytes() == (0 if free else blas.LT_WORKSPACE_BYTES)
    assert not blas.workspace_free()


def _row(name, ws, us, lo, hi, memsets, lib="torch (cuBLAS)", follows=True):
    return {"kernel": name, "library": lib, "follows the setting": follows, "workspace": ws, "M": 16384, "d": 768,
            "memsets per call": memsets, "cuda kernel": "k", "ms": us / 1e3, "p20": lo / 1e3, "p80": hi / 1e3}


def test_pairs_and_prose_are_built_from_the_rows():
    rows = [_row("a", "32 MiB", 100.0, 99.0, 101.0, 1.0), _row("a", "none", 95.0, 94.5, 95.5, 0.0),
            _row("c", "32 MiB", 40.0, 39.0, 41.0, 1.0), _row("c", "none", 40.5, 39.5, 41.5, 0.0),
            _row("b", "32 MiB", 50.0, 49.0, 51.0, 1.0, "hwlib (cuBLASLt)", follows=False),
            _row("b", "none", 58.0, 57.5, 58.5, 1.0, "hwlib (cuBLASLt)", follows=False)]
    ps = S.pairs(rows)
    assert [(p["matmul"], pytest.approx(p["saved us"]), p["beyond spread"]) for p in ps] == [
        ("a", 5.0, True), ("c", -0.5, False), ("b", -8.0, True)]
    text = S.prose(rows, n_layer=12)
    assert "3 matmuls of a block: 3 brought a memset per call" in text and "of the 2 the step runs without it, 2 lost" in text
    assert "Kept with their workspace, as in the step: b." in text
    # the kept matmul's own timings stay out of the words and the total
    assert "a 100.0 -> 95.0 us; c 40.0 -> 40.5 us (within the spread)." in text and "b 50.0" not in text
    assert "Together 4.5 us a block saved, 0.054 ms over 12 blocks" in text
    lost = S.prose([_row("a", "32 MiB", 10.0, 9.9, 10.1, 1.0), _row("a", "none", 11.0, 10.9, 11.1, 0.0)], 2)
    assert "Together 1.0 us a block lost, 0.002 ms over 2 blocks" in lost
    assert "not timed alone" in S.prose([], 12)


def test_matmul_records_carry_milliseconds_and_the_memset_count():
    recs = S.matmul_records([_row("a", "none", 95.0, 94.5, 95.5, 0.0)], profile="full", device="cpu")
    by = {r["metric"]: r for r in recs}
    assert by["kernel_ms"]["value"] == pytest.approx(0.095) and by["kernel_ms"]["unit"] == "ms"
    assert by["kernel_ms"]["p20"] == pytest.approx(0.0945) and by["kernel_ms"]["p80"] == pytest.approx(0.0955)
    assert by["memsets_per_call"]["value"] == 0.0
    assert by["kernel_ms"]["fields"] == {"study": "gemm_workspace", "kernel": "a", "workspace": "none", "M": 16384,
                                         "d": 768}
    assert by["kernel_ms"]["params"] == {"cuda kernel": "k"}
    assert by["memsets_per_call"]["fields"] == by["kernel_ms"]["fields"]


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


def test_matmul_rows_needs_a_gpu_positive_counts_and_the_workspace_in_force():
    with pytest.raises(ValueError, match="captures CUDA graphs"):
        S.matmul_rows(64, 16, "cpu")
    if GPU:
        with pytest.raises(ValueError, match="calls and iters"):
            S.matmul_rows(64, 16, "cuda", calls=0)
        with blas.no_workspace(), pytest.raises(RuntimeError, match="inside hwlib.blas.no_workspace"):
            S.matmul_rows(64, 16, "cuda")


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (cuBLAS)")
def test_without_the_workspace_torch_matmuls_bring_no_memset():
    rows = S.matmul_rows(4096, 768, "cuda", iters=3, calls=2)
    assert {r["workspace"] for r in rows} == set(S.WORKSPACES)
    torch_rows = [r for r in rows if r["library"].startswith("torch")]
    for r in rows:
        assert r["ms"] > 0 and r["p20"] <= r["ms"] <= r["p80"]
    assert all(r["memsets per call"] == 0 for r in torch_rows if r["workspace"] == "none"), torch_rows
    assert not blas.workspace_free()
    # Hopper's nvjet kernels clear their counters with a memset where cuBLAS picks them (seen on an H100);
    # on an H200 cuBLAS picked kernels without one even with the workspace: then there is nothing to remove
    if not any(r["memsets per call"] > 0 for r in torch_rows if r["workspace"] != "none"):
        pytest.skip(f"{torch.cuda.get_device_name()}: no torch matmul brings a memset even with the workspace, "
                    f"so none is removed without it (checked above: none without)")


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
