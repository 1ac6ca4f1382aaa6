"""Which parts of a model recompute their activations in backward: one parser for every workload."""

from __future__ import annotations


HEAD_CHUNK = 2048  # tokens per chunk of the checkpointed output head: ~1 GB of logits and their grads at V=50257


def parse_checkpointing(spec: str, n_layer: int) -> tuple[frozenset[int], bool]:
    """What to checkpoint: blocks ("none", "all", "every_K" or indices "0,2,4"), plus "head" for
    the output projection and loss, computed in chunks of ``HEAD_CHUNK`` tokens. "all,head" does both."""
    parts = [t.strip() for t in str(spec).strip().lower().split(",") if t.strip()]
    head = "head" in parts
    rest = [t for t in parts if t != "head"]
    if not rest or rest == ["none"]:
        return frozenset(), head
    if rest == ["all"]:
        return frozenset(range(n_layer)), head
    if len(rest) == 1 and rest[0].startswith("every_") and rest[0][6:].isdigit() and int(rest[0][6:]) > 0:
        return frozenset(range(0, n_layer, int(rest[0][6:]))), head
    try:
        idx = frozenset(int(t) for t in rest)
    except ValueError:
        raise ValueError(f"checkpointing {spec!r}: use 'none', 'all', 'every_K' or block indices like '0,2,4', "
                         f"optionally with ',head'") from None
    bad = sorted(i for i in idx if not 0 <= i < n_layer)
    if bad:
        raise ValueError(f"checkpointing {spec!r}: block {bad[0]} does not exist (the model has {n_layer} blocks)")
    return idx, head
