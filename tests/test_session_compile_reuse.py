"""A CPU process keeps a compiled model's dynamo cache for the next Session of the same model
(hwlib.ladder.session._kept_compile), and resets it before any other model compiles."""

import dataclasses

import torch
from torch._dynamo.utils import counters

from hwlib.ladder import session
from hwlib.steps import settings_for
from hwlib.workloads import get_workload

CFG = {"n_layer": 1, "batch": 2, "context": 16}


def _traced_graphs(settings) -> int:
    """Graphs dynamo traced for one Session's first two steps."""
    before = counters["stats"]["unique_graphs"]
    cfg = get_workload("gpt").config("smoke", **CFG)
    s = session.Session("gpt", cfg, settings, torch.device("cpu"), 0, step=None)
    try:
        with s.precision():
            s.step(0)
            s.step(1)
    finally:
        s.close()
    return counters["stats"]["unique_graphs"] - before


def test_the_same_model_reuses_its_graphs_and_another_resets_them(monkeypatch):
    # eager: dynamo traces and caches graphs as under any backend, without compiling them
    monkeypatch.setenv(session.CPU_COMPILE_BACKEND_ENV, "eager")
    monkeypatch.setattr(session, "_kept_compile", None)
    torch._dynamo.reset()
    compiled = settings_for("06_torch_compile")
    assert _traced_graphs(compiled) >= 1
    # the loader never enters the model: the same graphs serve resident batches (notebook 08)
    assert _traced_graphs(dataclasses.replace(compiled, loader="resident")) == 0
    other = dataclasses.replace(compiled, attention="manual" if compiled.attention == "sdpa" else "sdpa")
    reset = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda real=torch._dynamo.reset: (reset.append(1), real())[1])
    assert _traced_graphs(other) >= 1 and reset == [1]
    torch._dynamo.reset()
