"""hwlib's custom ops declared to inductor as fallback kernels before anything is compiled.

Inductor lowers a custom op it has no lowering for by creating an "implicit fallback" the first time
a graph calls it, and before that torch (2.11 at least: ``GraphLowering.call_function``) builds a
log line of the op's inputs as inductor IR, eagerly, whether or not the line is logged. An input fed
by the residual stream, such as ``add_layer_norm``'s in GPT's forward, prints as the IR of everything
before it: on an H100 (torch 2.11) building that string kept the compile of GPT-2 with the fused
LayerNorm busy for over 5 minutes of one CPU core without reaching the first step. An op declared
here is already in inductor's lowerings, so that path is never taken; it gets the layout constraint
the implicit path would give it (its tags, else inductor's default for custom ops), so that the
compiled code is the same.

Op modules ``register`` their ops when they define them; whatever calls ``torch.compile`` on code
that may reach them calls ``declare`` first (``hwlib.ladder.session``, the distributed strategies).
Importing inductor's lowering module takes a few seconds, so nothing is declared at import time.
"""

from __future__ import annotations

import torch

_OPS: list[torch._ops.OpOverload] = []


def register(op) -> None:
    """Remember one of hwlib's custom ops (a ``torch.library.custom_op`` or its OpOverload) for ``declare``."""
    overload = getattr(op, "_opoverload", op)
    if not isinstance(overload, torch._ops.OpOverload):
        raise TypeError(f"op must be a custom op or an OpOverload, got {type(op).__name__}")
    if overload.namespace != "hwlib":
        # inductor's implicit path decides other ops' layouts by other rules (aten's: contiguous in backward)
        raise ValueError(f"op must be one of hwlib's custom ops (namespace hwlib), got {overload}")
    if overload not in _OPS:
        _OPS.append(overload)


def registered() -> tuple:
    return tuple(_OPS)


def declare() -> list:
    """Declare every registered op not yet known to inductor as a fallback kernel; returns those
    declared now (an op already lowered, by an earlier call or an earlier compile, is left as it is;
    on a torch without tag-based layout constraints, none)."""
    from torch._inductor import lowering as L
    try:
        from torch._library.utils import get_layout_constraint_tag
        to_constraint = L.tag_to_layout_constraint
    except (ImportError, AttributeError):
        # an older torch decides a custom op's layout per call: its own implicit path stays
        return []
    done = []
    for op in _OPS:
        if op in L.lowerings:
            continue
        constraint = to_constraint(get_layout_constraint_tag(op, with_default=True))
        L.make_fallback(op, layout_constraint=constraint)
        done.append(op)
    return done
