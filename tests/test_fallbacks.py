"""hwlib.ops.fallbacks: hwlib's custom ops declared to inductor before a compile, so that inductor
never takes its implicit-fallback path (which formats every input's IR into a string first), with
the layout constraint that path would have given them."""

import logging

import pytest
import torch
from torch._inductor import exc as inductor_exc
from torch._inductor import lowering as L

from hwlib.ladder.session import compile_model
from hwlib.ops import fallbacks
from hwlib.steps.s17_fused_lm_head import op as linear_ce  # noqa: F401  (registers its op)
from hwlib.steps.s21_fused_layernorm import op as A

OPS = (torch.ops.hwlib.add_layer_norm.default, torch.ops.hwlib.add_layer_norm_backward.default,
       torch.ops.hwlib.linear_cross_entropy.default)


@pytest.fixture
def undeclared():
    """hwlib's ops unknown to inductor, as in a fresh process; what inductor knew of them is put back
    afterwards. Caches are off: a cached graph is not lowered again, and every compile here must lower."""
    tables = (L.lowerings, L._maybe_layout_constraints)
    saved = [{op: t[op] for op in OPS if op in t} for t in tables]
    realized = {op for op in OPS if op in L.needs_realized_inputs}

    def forget():
        for t in tables:
            for op in OPS:
                t.pop(op, None)
        for op in OPS:
            L.needs_realized_inputs.discard(op)

    forget()
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield forget
    finally:
        forget()
        for t, kept in zip(tables, saved):
            t.update(kept)
        L.needs_realized_inputs.update(realized)
        torch._dynamo.reset()


def _fused_ln(x, r, w, b):
    s, y = A.add_layer_norm((x * 2).sin() + 1, r.cos(), w, b, backend="torch")   # inputs inductor must compute
    return s.sum() + y.sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(19, 24, generator=g), torch.randn(19, 24, generator=g)
    return x, r, torch.ones(24), torch.zeros(24)


def test_every_hwlib_op_is_registered():
    assert set(OPS) <= set(fallbacks.registered())


def test_declare_makes_the_ops_known_with_the_implicit_paths_layout_constraint(undeclared):
    # what inductor's own implicit fallback decides for the op ...
    compiled = torch.compile(_fused_ln, fullgraph=True)
    compiled(*_inputs())
    implicit = {op: L.maybe_layout_constraints(op) for op in OPS[:1]}
    assert OPS[0] in L.lowerings
    # ... and what declare gives it, from a fresh state again
    undeclared()
    torch._dynamo.reset()
    declared = fallbacks.declare()
    assert set(OPS) <= set(declared)
    assert all(op in L.lowerings for op in OPS)
    assert {op: L.maybe_layout_constraints(op) for op in OPS[:1]} == implicit
    assert fallbacks.declare() == []       # declared once


def test_a_declared_op_never_has_its_inputs_formatted(undeclared, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(inductor_exc.OperatorIssue, "operator_str",
                        staticmethod(lambda *a, **k: calls.append(a[0]) or ""))
    # the implicit-fallback line logged (torch 2.11 formats it even unlogged; later versions lazily)
    caplog.set_level(logging.INFO, logger="torch._inductor.graph")
    # undeclared, the compile formats the op's inputs (the test can fail) ...
    torch.compile(_fused_ln, fullgraph=True)(*_inputs())
    assert OPS[0] in calls
    undeclared()
    torch._dynamo.reset()
    calls.clear()
    # ... declared, it does not, and computes what eager does
    fallbacks.declare()
    got = torch.compile(_fused_ln, fullgraph=True)(*_inputs())
    assert calls == []
    torch.testing.assert_close(got, _fused_ln(*_inputs()), rtol=1e-5, atol=1e-5)


def test_compile_model_declares_first(undeclared):
    compile_model(torch.nn.Linear(3, 3))
    assert all(op in L.lowerings for op in OPS)


def test_register_refuses_what_is_not_one_of_hwlibs_ops():
    with pytest.raises(TypeError, match="op must be"):
        fallbacks.register(lambda x: x)
    with pytest.raises(ValueError, match="namespace hwlib"):
        fallbacks.register(torch.ops.aten.add.Tensor)
    assert torch.ops.aten.add.Tensor not in fallbacks.registered()


def test_a_torch_without_tag_layout_constraints_keeps_its_own_path(undeclared, monkeypatch):
    monkeypatch.delattr(L, "tag_to_layout_constraint")
    assert fallbacks.declare() == []
    assert not any(op in L.lowerings for op in OPS)
