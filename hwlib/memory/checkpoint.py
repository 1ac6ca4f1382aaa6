"""Checkpoint and resume of a training run: model, optimizer, scaler, RNG states, data position.

File format: an 8-byte magic, the payload's length and SHA-256, then the ``torch.save`` payload.
A truncated or damaged file is refused with what is wrong (length or checksum) before torch reads
it; a file from another workload, config or model shape is refused naming the first mismatch. The
file is written to a temporary name and renamed over the target, so a run killed while saving
leaves the previous checkpoint intact. Batches are indexed by step, so the data position is the
index of the next step and resuming replays exactly the batches an uninterrupted run would see.

Files are loaded with ``weights_only=False`` (RNG states are not tensors): load only checkpoints
you wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import random
import struct
from pathlib import Path

import numpy as np
import torch

from ..results import write_atomic

MAGIC = b"HWLCKPT1"
_HEADER = struct.Struct("<8sQ32s")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message says why."""


def _signature(model: torch.nn.Module) -> dict:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def save_checkpoint(path: str | Path, sess, next_step: int, losses: list[float] | None = None) -> Path:
    cuda = sess.device.type == "cuda"
    state = {
        "workload": sess.wl.name, "seed": sess.seed, "config": dataclasses.asdict(sess.cfg), "settings": dataclasses.asdict(sess.settings),
        "signature": _signature(sess.model), "model": sess.model.state_dict(), "optimizer": sess.opt.state_dict(),
        "scaler": sess.scaler.state_dict() if sess.scaler is not None else None,
        "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if cuda else None,
                "numpy": np.random.get_state(), "python": random.getstate()},
        "next_step": int(next_step), "losses": list(losses or []),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return write_atomic(path, _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload)


def _read(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    raw = path.read_bytes()
    if len(raw) < _HEADER.size or raw[:8] != MAGIC:
        raise CheckpointError(f"checkpoint {str(path)!r} is not an hwlib checkpoint (no header)")
    _, n, digest = _HEADER.unpack(raw[:_HEADER.size])
    payload = raw[_HEADER.size:]
    if len(payload) != n:
        raise CheckpointError(f"checkpoint {str(path)!r} is truncated: {len(payload)} of {n} payload bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: checksum mismatch")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def _first_mismatch(a: dict, b: dict) -> str | None:
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<missing>") != b.get(k, "<missing>"):
            return f"{k}: checkpoint {a.get(k, '<missing>')}, this run {b.get(k, '<missing>')}"
    return None


def load_checkpoint(path: str | Path, sess) -> tuple[int, list[float]]:
    """Restore ``sess`` (built with the same workload and config) from ``path``.
    Returns (the next step to run, the losses recorded so far). Nothing is changed on refusal."""
    path = Path(path)
    st = _read(path)
    if st["workload"] != sess.wl.name:
        raise CheckpointError(f"checkpoint {str(path)!r} is of workload {st['workload']!r}, this run is {sess.wl.name!r}")
    if st["seed"] != sess.seed:
        raise CheckpointError(f"checkpoint {str(path)!r} trained on other data: data seed {st['seed']}, "
                              f"this run {sess.seed}")
    for what, theirs, ours in (("config", st["config"], dataclasses.asdict(sess.cfg)),
                               ("model", st["signature"], _signature(sess.model))):
        mis = _first_mismatch(theirs, ours)
        if mis:
            raise CheckpointError(f"checkpoint {str(path)!r} is from another {what}: {mis}")
    sess.model.load_state_dict(st["model"])
    sess.opt.load_state_dict(st["optimizer"])
    if sess.scaler is not None and st["scaler"] is not None:
        sess.scaler.load_state_dict(st["scaler"])
    rng = st["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and sess.device.type == "cuda":
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return st["next_step"], st["losses"]
