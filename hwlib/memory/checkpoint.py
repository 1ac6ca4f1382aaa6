"""Checkpoint and resume of a training run: model, optimizer, scaler, RNG states, data position.

File format: an 8-byte magic, the payload's length and SHA-256, then a ``torch.save`` payload that
holds only tensors and plain data (dicts, lists, tuples, strings, numbers, None): the RNG states of
NumPy and Python are stored as a tensor and lists of ints. It is read back with
``torch.load(weights_only=True)``, whose unpickler builds nothing else, so a file cannot run code
when it is loaded, whoever wrote it.

Loading checks the whole file against the session before it changes anything: a truncated or
damaged file (length, checksum), one that holds other objects, one from another workload, data seed,
config, model shape, optimizer (AdamW, fused AdamW, offloaded AdamW), loss scaling, or with RNG
states or a data position this run cannot take is refused naming the first mismatch, and the
session is left as it was. The file is written to a temporary name and renamed over the target, so
a run killed while saving leaves the previous checkpoint intact. Batches are indexed by step, so
the data position is the index of the next step and resuming replays exactly the batches an
uninterrupted run would see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import pickle
import random
import struct
from pathlib import Path

import numpy as np
import torch

from ..results import write_atomic
from .checks import finite_number
from .offload import OffloadedAdamW

MAGIC = b"HWLCKPT2"
OLD_MAGICS = (b"HWLCKPT1",)   # stored NumPy objects, which only a code-running unpickler reads
_HEADER = struct.Struct("<8sQ32s")
KEYS = ("workload", "seed", "config", "optimizer_kind", "model", "optimizer", "scaler", "rng", "next_step", "losses")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message says why."""


def _live(sess):
    if getattr(sess, "model", None) is None or getattr(sess, "opt", None) is None:
        raise TypeError(f"sess must be an open hwlib.ladder.Session (its model and optimizer), got "
                        f"{type(sess).__name__}{' (closed)' if hasattr(sess, 'wl') else ''}")
    return sess


def _path(path) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"path must be a non-empty str or path, got {path!r}")
    return Path(path)


def optimizer_kind(opt) -> str:
    """What shape an optimizer's state has: its class, and for torch's AdamW whether it is fused
    (loading a state also loads its ``fused`` flag, which would silently switch implementation)."""
    if isinstance(opt, OffloadedAdamW):
        return "OffloadedAdamW"
    return type(opt).__name__ + (" (fused)" if opt.param_groups and opt.param_groups[0].get("fused") else "")


def _rng_state(cuda: bool) -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if cuda else None,
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": {"version": int(version), "state": list(state), "gauss_next": gauss_next}}


def _numpy_state(d: dict) -> tuple:
    return (d["kind"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached_gaussian"])


def _python_state(d: dict) -> tuple:
    return (d["version"], tuple(d["state"]), d["gauss_next"])


def save_checkpoint(path: str | os.PathLike, sess, next_step: int, losses: list[float] | None = None) -> Path:
    """Write ``sess``'s whole training state and the data position ``next_step`` to ``path``, atomically."""
    path, sess = _path(path), _live(sess)
    if isinstance(next_step, bool) or not isinstance(next_step, int) or next_step < 0:
        raise ValueError(f"next_step must be the index of the next step to run, an int >= 0, got {next_step!r}")
    losses = [] if losses is None else list(losses)
    for i, v in enumerate(losses):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"losses[{i}] must be a number (call .item() on a tensor), got {type(v).__name__}")
    if len(losses) > next_step:
        raise ValueError(f"losses holds {len(losses)} values but only {next_step} steps ran (next_step)")
    state = {
        "workload": sess.wl.name, "seed": sess.seed, "config": dataclasses.asdict(sess.cfg),
        "optimizer_kind": optimizer_kind(sess.opt), "model": dict(sess.model.state_dict()),
        "optimizer": sess.opt.state_dict(), "scaler": sess.scaler.state_dict() if sess.scaler is not None else None,
        "rng": _rng_state(sess.device.type == "cuda"), "next_step": next_step, "losses": [float(v) for v in losses],
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return write_atomic(path, _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload)


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:160]


def _read(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file)")
    raw = path.read_bytes()
    if raw[:8] in OLD_MAGICS:
        raise CheckpointError(f"checkpoint {str(path)!r} has an older format that stored objects only a "
                              "code-running loader reads; it is not loaded: start the run again to write a new one")
    if len(raw) < _HEADER.size or raw[:8] != MAGIC:
        raise CheckpointError(f"checkpoint {str(path)!r} is not an hwlib checkpoint (no header)")
    _, n, digest = _HEADER.unpack(raw[:_HEADER.size])
    payload = raw[_HEADER.size:]
    if len(payload) != n:
        raise CheckpointError(f"checkpoint {str(path)!r} is truncated: {len(payload)} of {n} payload bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: checksum mismatch")
    try:
        st = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} holds something other than tensors and plain data; "
                              f"refused unread ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(st, dict) or sorted(st) != sorted(KEYS):
        got = sorted(st) if isinstance(st, dict) else type(st).__name__
        raise CheckpointError(f"checkpoint {str(path)!r}: its contents are not a checkpoint's ({', '.join(KEYS)}), got {got}")
    return st


def _first_mismatch(a: dict, b: dict) -> str | None:
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<missing>") != b.get(k, "<missing>"):
            return f"{k}: checkpoint {a.get(k, '<missing>')}, this run {b.get(k, '<missing>')}"
    return None


def _nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def _tensor_mismatch(theirs, ours: dict) -> str | None:
    """First key, shape or dtype of ``theirs`` (a dict of tensors) that differs from ``ours``, or a
    weight with NaN or infinity where this run's has none (a mask buffer may hold -inf on purpose)."""
    if not isinstance(theirs, dict):
        return f"its weights are a {type(theirs).__name__}, not a dict of tensors"
    for k in sorted(set(theirs) | set(ours)):
        if k not in ours:
            return f"{k!r} is not in this run's model"
        a, b = theirs.get(k), ours[k]
        if not isinstance(a, torch.Tensor):
            return f"{k!r} is missing" if k not in theirs else f"{k!r} is not a tensor"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{k!r} is {tuple(a.shape)} {a.dtype}, this run {tuple(b.shape)} {b.dtype}"
        if _nonfinite(a) and (bool(torch.isnan(a).any()) or not _nonfinite(b)):
            return f"{k!r} holds NaN or infinite values (saved from a run that had diverged?)"
    return None


def _same_option(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a.cpu().to(b.dtype), b.cpu())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_option(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _adamw_state_mismatch(idx, s: dict, param: torch.Tensor, amsgrad: bool) -> str | None:
    """Why one parameter's AdamW state cannot be resumed from, else None: exactly its keys, a scalar
    float step of at least 1 (state exists only after a step), moments of the parameter's shape and
    dtype, finite, the second moments not negative."""
    want = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
    where = f"optimizer state: parameter {idx}"
    if not isinstance(s, dict) or set(s) != want or not all(isinstance(v, torch.Tensor) for v in s.values()):
        got = sorted(s) if isinstance(s, dict) else type(s).__name__
        return f"{where}'s state is not AdamW's ({', '.join(sorted(want))} tensors{', amsgrad' if amsgrad else ''}), got {got}"
    step = s["step"]
    if step.shape != () or not step.is_floating_point():
        return f"{where}'s step is {tuple(step.shape)} {step.dtype}, not a float scalar"
    n = float(step)
    if not (math.isfinite(n) and n >= 1 and n == int(n)):
        return f"{where}'s step is {n!r}: a resumed state has taken a whole number of steps, at least 1"
    for k in sorted(want - {"step"}):
        t = s[k]
        if t.shape != param.shape or t.dtype != param.dtype:
            return f"{where}'s {k} is {tuple(t.shape)} {t.dtype}, the parameter {tuple(param.shape)} {param.dtype}"
        if _nonfinite(t):
            return f"{where}'s {k} holds NaN or infinite values"
        if k != "exp_avg" and bool((t < 0).any()):
            return f"{where}'s {k} holds negative values (a second moment cannot)"
    return None


def _torch_optimizer_mismatch(sd, opt) -> str | None:
    """First part of a torch optimizer state ``sd`` that ``opt`` could not load as it stands."""
    ours = opt.state_dict()
    if not isinstance(sd, dict) or set(sd) != {"state", "param_groups"}:
        return "optimizer state: not a torch optimizer state (state, param_groups)"
    groups = sd["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(ours["param_groups"]):
        return f"optimizer state: {len(groups) if isinstance(groups, list) else groups!r} parameter groups, this run {len(ours['param_groups'])}"
    params = {}
    for i, (g, h) in enumerate(zip(groups, ours["param_groups"])):
        if not isinstance(g, dict) or set(g) != set(h) or g["params"] != h["params"]:
            return f"optimizer state: parameter group {i} holds other parameters or options than this run's"
        try:
            for k in ("lr", "eps", "weight_decay"):
                finite_number(f"param_groups[{i}][{k!r}]", g[k], low=0.0)
            for b in g["betas"]:
                finite_number(f"param_groups[{i}]['betas']", b, low=0.0, high=1.0, high_open=True)
        except (TypeError, ValueError) as e:
            return f"optimizer state: {e}"
        # every option as this run's (maximize, amsgrad, foreach, capturable, ... and lr, betas, eps,
        # weight_decay: no scheduler changes them): resuming must continue this run's optimizer exactly
        other = next((k for k in sorted(h) if k != "params" and not _same_option(g[k], h[k])), None)
        if other is not None:
            return f"optimizer state: parameter group {i}'s {other} is {g[other]!r}, this run's {h[other]!r}"
        params.update(zip(h["params"], opt.param_groups[i]["params"]))
    if not isinstance(sd["state"], dict):
        return "optimizer state: its per-parameter state is not a dict"
    amsgrad = {idx: bool(g.get("amsgrad")) for g in ours["param_groups"] for idx in g["params"]}
    for idx, s in sd["state"].items():
        if idx not in params:
            return f"optimizer state: parameter {idx!r} does not exist in this run"
        mis = _adamw_state_mismatch(idx, s, params[idx], amsgrad[idx])
        if mis:
            return mis
    return None


def _optimizer_mismatch(st: dict, sess) -> str | None:
    kind = optimizer_kind(sess.opt)
    if st["optimizer_kind"] != kind:
        return f"optimizer: checkpoint {st['optimizer_kind']!r}, this run {kind!r} (Settings.offload_optimizer, fused_adamw)"
    if isinstance(sess.opt, OffloadedAdamW):
        try:
            sess.opt.check_state_dict(st["optimizer"])
        except ValueError as e:
            return str(e)
        sd = st["optimizer"]
        for key in ("m", "v"):
            bad = next((i for i, t in enumerate(sd[key]) if _nonfinite(t) or key == "v" and bool((t < 0).any())), None)
            if bad is not None:
                return f"optimizer state: {key}[{bad}] holds NaN, infinite{' or negative' if key == 'v' else ''} values"
        other = next((i for i, (h, g) in enumerate(zip(sd["hyper"], sess.opt.param_groups))
                      if not all(_same_option(h[k], g.get(k)) for k in h)), None)
        if other is not None:
            return f"optimizer state: hyper[{other}] {sd['hyper'][other]!r} is not this run's options"
        return None
    return _torch_optimizer_mismatch(st["optimizer"], sess.opt)


def _scaler_mismatch(theirs, scaler) -> str | None:
    if (theirs is None) != (scaler is None):
        return (f"loss scaling: checkpoint {'without' if theirs is None else 'with'} a GradScaler, this run "
                f"{'without' if scaler is None else 'with'} one (Settings.autocast 'fp16')")
    if scaler is None:
        return None
    ours = scaler.state_dict()
    if not isinstance(theirs, dict) or set(theirs) != set(ours) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in theirs.values()):
        return f"loss scaling: the GradScaler state is not this run's ({', '.join(sorted(ours))} numbers)"
    try:
        finite_number("scale", theirs.get("scale", 1.0), low=0.0, low_open=True)
    except ValueError as e:
        return f"loss scaling: {e}"
    other = next((k for k in sorted(ours) if k not in ("scale", "_growth_tracker") and theirs[k] != ours[k]), None)
    if other is not None:
        return f"loss scaling: {other} is {theirs[other]!r}, this run's {ours[other]!r}"
    tracker = theirs.get("_growth_tracker", 0)
    if not isinstance(tracker, int) or tracker < 0:
        return f"loss scaling: _growth_tracker {tracker!r} is not an int >= 0"
    return None


def _rng_mismatch(rng, device: torch.device) -> str | None:
    """Each state is set on a fresh generator first: one the library refuses is found here, not
    halfway through restoring the session."""
    if not isinstance(rng, dict) or set(rng) != {"torch", "cuda", "numpy", "python"}:
        return "RNG states: not torch, cuda, numpy and python"
    try:
        torch.Generator().set_state(rng["torch"])
        np.random.RandomState().set_state(_numpy_state(rng["numpy"]))
        random.Random().setstate(_python_state(rng["python"]))
    except Exception as e:   # noqa: BLE001 - whatever a library raises on a fresh generator, the state is refused
        return f"RNG states: {type(e).__name__}: {_first_line(e)}"
    cuda = rng["cuda"]
    if cuda is not None and device.type == "cuda":
        if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
            return "RNG states: cuda is not a list of byte tensors"
        if len(cuda) > torch.cuda.device_count() or any(t.shape != torch.cuda.get_rng_state(i).shape
                                                          for i, t in enumerate(cuda)):
            return f"RNG states: {len(cuda)} CUDA generator states do not fit this machine's {torch.cuda.device_count()} GPUs"
    return None


def _position_mismatch(st: dict) -> str | None:
    n, losses = st["next_step"], st["losses"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return f"data position: next_step {n!r} is not an int >= 0"
    if not isinstance(losses, list) or len(losses) > n or not all(
            isinstance(v, float) for v in losses):
        return f"data position: losses must be at most next_step ({n}) floats"
    return None


def _validate(st: dict, sess, path: Path) -> None:
    where = f"checkpoint {str(path)!r}"
    if st["workload"] != sess.wl.name:
        raise CheckpointError(f"{where} is of workload {st['workload']!r}, this run is {sess.wl.name!r}")
    if st["seed"] != sess.seed:
        raise CheckpointError(f"{where} trained on other data: data seed {st['seed']}, this run {sess.seed}")
    if not isinstance(st["config"], dict):
        raise CheckpointError(f"{where}: its config is not a dict")
    mis = _first_mismatch(st["config"], dataclasses.asdict(sess.cfg))
    if mis:
        raise CheckpointError(f"{where} is from another config: {mis}")
    mis = _tensor_mismatch(st["model"], sess.model.state_dict())
    if mis:
        raise CheckpointError(f"{where} is from another model: {mis}")
    for mis in (_optimizer_mismatch(st, sess), _scaler_mismatch(st["scaler"], sess.scaler),
                _rng_mismatch(st["rng"], sess.device), _position_mismatch(st)):
        if mis:
            raise CheckpointError(f"{where} does not fit this run: {mis}")


def load_checkpoint(path: str | os.PathLike, sess) -> tuple[int, list[float]]:
    """Restore ``sess`` (built with the same workload, seed, config and optimizer) from ``path``.
    Returns (the next step to run, the losses recorded so far). The whole file is checked first:
    on refusal (CheckpointError) nothing in the session or the RNGs has changed."""
    path, sess = _path(path), _live(sess)
    st = _read(path)
    _validate(st, sess, path)
    sess.model.load_state_dict(st["model"])
    sess.opt.load_state_dict(st["optimizer"])
    if sess.scaler is not None:
        sess.scaler.load_state_dict(st["scaler"])
    rng = st["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and sess.device.type == "cuda":
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(_numpy_state(rng["numpy"]))
    random.setstate(_python_state(rng["python"]))
    return st["next_step"], list(st["losses"])
