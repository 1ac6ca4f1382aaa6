"""AdamW with its moments in pinned CPU memory, updated on the GPU bucket by bucket.

What it frees: the two fp32 moments, 8 bytes per parameter (1.0 GB for GPT-2 small), less the
GPU staging it keeps: two buckets of moments (2 x 2 x 4 x ``bucket_params`` bytes).

What it costs: every step moves the moments over the host link twice, 8 bytes per parameter in
each direction (host->device before the update, device->host after). The copies run on their own
CUDA streams, double-buffered: bucket k+1's moments stream in and bucket k-1's stream out while
bucket k is updated, so the cost approaches max(H2D, D2H) time rather than their sum plus compute.

The update is torch's AdamW formula (decoupled weight decay), op for op as its single-tensor
implementation computes it, so parameters match the on-device optimizer up to kernel rounding.
On a CPU device the same code runs with plain copies (for tests).
"""

from __future__ import annotations

import math

import torch

from .checks import finite_number, positive_int


BUCKET_PARAMS = 8 << 20   # 8M parameters: 32 MB of each moment per bucket


def _check_hyper(where: str, g: dict) -> dict:
    """lr, betas, eps and weight_decay of one group, checked as torch.optim.AdamW bounds them;
    ``where`` ('' for the constructor's arguments) prefixes the name in an error."""
    name = (lambda k: f"{where}[{k!r}]") if where else (lambda k: k)
    out = {"lr": finite_number(name("lr"), g["lr"], low=0.0),
           "eps": finite_number(name("eps"), g["eps"], low=0.0),
           "weight_decay": finite_number(name("weight_decay"), g["weight_decay"], low=0.0)}
    betas = g["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{name('betas')} must be a pair (beta1, beta2), got {betas!r}")
    out["betas"] = tuple(finite_number(f"{name('betas')}[{i}]", b, low=0.0, high=1.0, high_open=True)
                         for i, b in enumerate(betas))
    return out


def _param_groups(param_groups, defaults: dict) -> list[dict]:
    """The groups as dicts of trainable parameters on one device, each with checked hyper-parameters."""
    if isinstance(param_groups, torch.Tensor):
        raise TypeError("param_groups must be an iterable of parameters or of dicts with 'params', "
                        "got a single tensor: pass [tensor] or model.parameters()")
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out, seen = [], set()
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param_groups[{i}] must be a dict with 'params' (or pass parameters only), got {g!r:.80}")
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param_groups[{i}]['params'] holds a {type(p).__name__!r} object, not a tensor")
            if id(p) in seen:
                raise ValueError(f"param_groups[{i}]: a parameter appears in more than one group")
            seen.add(id(p))
        unknown = sorted(set(g) - {"params", *defaults})
        if unknown:
            raise ValueError(f"param_groups[{i}]: unknown option {unknown[0]!r}; use {', '.join(defaults)}")
        hyper = _check_hyper(f"param_groups[{i}]" if set(g) - {"params"} else "", {**defaults, **g})
        out.append({"params": [p for p in params if p.requires_grad], **hyper})
    params = [p for g in out for p in g["params"]]
    if not params:
        raise ValueError("OffloadedAdamW: no parameters that require gradients")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"OffloadedAdamW: parameters on several devices ({', '.join(devices)}); it updates one device")
    return out


def _buckets(param_groups: list[dict], bucket_params: int) -> list[tuple[int, list]]:
    """A bucket is a list of (parameter, start, end) segments of its flattened data: a large
    parameter (GPT-2's 38.6M-entry embedding) spans several buckets, so the GPU staging stays at
    two buckets. Buckets never straddle groups (one set of hyper-parameters per bucket)."""
    buckets = []
    for gi, g in enumerate(param_groups):
        cur, n = [], 0
        for p in g["params"]:
            start = 0
            while start < p.numel():
                take = min(p.numel() - start, bucket_params - n)
                cur.append((p, start, start + take))
                n += take
                start += take
                if n == bucket_params:
                    buckets.append((gi, cur))
                    cur, n = [], 0
        if cur:
            buckets.append((gi, cur))
    return buckets


class OffloadedAdamW:
    def __init__(self, param_groups, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, bucket_params: int = BUCKET_PARAMS):
        # A bucket of zero parameters never fills: checked first, or splitting would loop forever.
        bucket_params = positive_int("bucket_params", bucket_params, unit="parameter")
        defaults = _check_hyper("", {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.param_groups = _param_groups(param_groups, defaults)
        self.device = next(p for g in self.param_groups for p in g["params"]).device
        cuda = self.device.type == "cuda"
        self.buckets = _buckets(self.param_groups, bucket_params)
        self.sizes = [sum(b - a for _, a, b in segs) for _, segs in self.buckets]
        # Host copies of the moments, one flat buffer per bucket and moment.
        self.m_host = [torch.zeros(n, dtype=torch.float32, pin_memory=cuda) for n in self.sizes]
        self.v_host = [torch.zeros(n, dtype=torch.float32, pin_memory=cuda) for n in self.sizes]
        big = max(self.sizes)
        self.stage = [(torch.empty(big, device=self.device), torch.empty(big, device=self.device)) for _ in range(2)]
        self.step_count = 0
        if cuda:
            self.h2d, self.d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
            self.d2h_done = [None] * len(self.buckets)

    @property
    def state_bytes_on_host(self) -> int:
        return 8 * sum(self.sizes)

    @property
    def staging_bytes_on_device(self) -> int:
        return 2 * 2 * 4 * max(self.sizes)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def _views(self, slot: int, k: int):
        m, v = self.stage[slot]
        n = self.sizes[k]
        return m[:n], v[:n]

    def _load(self, k: int) -> None:
        m, v = self._views(k % 2, k)
        m.copy_(self.m_host[k], non_blocking=True)
        v.copy_(self.v_host[k], non_blocking=True)

    def _store(self, k: int) -> None:
        m, v = self._views(k % 2, k)
        self.m_host[k].copy_(m, non_blocking=True)
        self.v_host[k].copy_(v, non_blocking=True)

    @torch.no_grad()
    def _update(self, k: int) -> None:
        gi, ps = self.buckets[k]
        g = self.param_groups[gi]
        lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
        m, v = self._views(k % 2, k)
        bc1 = 1 - b1 ** self.step_count
        bc2_sqrt = math.sqrt(1 - b2 ** self.step_count)
        offs = 0
        for p, a, b in ps:
            n = b - a
            if p.grad is not None:
                grad = p.grad.reshape(-1)[a:b].float()
                pm, pv = m[offs:offs + n], v[offs:offs + n]
                flat = p.view(-1)[a:b]
                # torch.optim.AdamW, single-tensor path, in its order of operations
                flat.mul_(1 - lr * wd)
                pm.lerp_(grad, 1 - b1)
                pv.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (pv.sqrt() / bc2_sqrt).add_(eps)
                flat.addcdiv_(pm, denom, value=-lr / bc1)
            offs += n

    def step(self) -> None:
        self.step_count += 1
        nb = len(self.buckets)
        if self.device.type != "cuda":
            for k in range(nb):
                self._load(k)
                self._update(k)
                self._store(k)
            return
        main = torch.cuda.current_stream(self.device)
        prev_step_done = self.d2h_done[-1] if nb else None   # the d2h stream is in order: covers all
        loaded = [None] * nb

        def prefetch(k: int) -> None:
            # Slot k % 2 was last used by bucket k-2 (this step) or by the previous step's buckets;
            # its write-back (which itself waited for the update) must be done before we refill it.
            # The host buffers were last written by the previous step's write-backs.
            with torch.cuda.stream(self.h2d):
                dep = self.d2h_done[k - 2] if k >= 2 else prev_step_done
                if dep is not None:
                    self.h2d.wait_event(dep)
                self._load(k)
                loaded[k] = torch.cuda.Event()
                loaded[k].record(self.h2d)

        for k in range(min(2, nb)):
            prefetch(k)
        for k in range(nb):
            main.wait_event(loaded[k])
            self._update(k)
            updated = torch.cuda.Event()
            updated.record(main)
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(updated)
                self._store(k)
                self.d2h_done[k] = torch.cuda.Event()
                self.d2h_done[k].record(self.d2h)
            if k + 2 < nb:
                prefetch(k + 2)

    def state_dict(self) -> dict:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self.d2h)
            torch.cuda.synchronize(self.device)
        return {"step": self.step_count, "m": [t.clone() for t in self.m_host], "v": [t.clone() for t in self.v_host],
                "hyper": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def check_state_dict(self, sd) -> None:
        """Raise ValueError naming the first part of ``sd`` that this optimizer cannot take; change nothing."""
        if not isinstance(sd, dict) or set(sd) != {"step", "m", "v", "hyper"}:
            got = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"optimizer state: an OffloadedAdamW state has keys hyper, m, step, v; got {got}")
        if isinstance(sd["step"], bool) or not isinstance(sd["step"], int) or sd["step"] < 0:
            raise ValueError(f"optimizer state: step must be a non-negative int, got {sd['step']!r}")
        for key in ("m", "v"):
            ts = sd[key]
            if not isinstance(ts, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                                   and t.dim() == 1 for t in ts):
                raise ValueError(f"optimizer state: {key} must be a list of 1-d float32 tensors")
            if [t.numel() for t in ts] != self.sizes:
                raise ValueError(f"optimizer state: bucket sizes {[t.numel() for t in ts]} do not match "
                                 f"this model's {self.sizes}")
        if not isinstance(sd["hyper"], list) or len(sd["hyper"]) != len(self.param_groups):
            raise ValueError(f"optimizer state: hyper must hold one dict per parameter group "
                             f"({len(self.param_groups)}), got {sd['hyper']!r:.80}")
        for i, h in enumerate(sd["hyper"]):
            if not isinstance(h, dict) or set(h) != {"lr", "betas", "eps", "weight_decay"}:
                raise ValueError(f"optimizer state: hyper[{i}] must have lr, betas, eps and weight_decay, got {h!r:.80}")
            _check_hyper(f"optimizer state: hyper[{i}]", h)

    def load_state_dict(self, sd: dict) -> None:
        self.check_state_dict(sd)
        self.step_count = sd["step"]
        for dst, src in zip(self.m_host + self.v_host, sd["m"] + sd["v"]):
            dst.copy_(src)
        for g, h in zip(self.param_groups, sd["hyper"]):
            g.update(_check_hyper("", h))
