"""Measured roofline ceilings: device copy bandwidth and matmul throughput per dtype.

* copy: ``dst.copy_(src)`` of a buffer far larger than L2; bytes = read + write = 2 x size.
* matmul: ``n x n @ n x n`` on random data (zeros run faster than real data), 2 n^3 FLOPs,
  fp32 with TF32 off, fp32 with TF32 on, bf16 and fp16 (the ceiling of a GPU without bf16, such
  as a T4, whose mixed-precision steps run in fp16).

Each run measures its own ceilings once, explicitly (notebook 00, or ``save``) and stores them in
``<run>/ceilings.json``; every other notebook reads them from there through ``hwlib.query``. A
notebook run alone without them reports MFU as n/a: ceilings are never measured as a side effect
(a 2 GiB copy and 8192^3 matmuls would otherwise run unasked). On CPU the sizes are small and the
numbers only prove that the code runs.
"""

from __future__ import annotations

import math

import torch

from . import bench, results
from .device import info, resolve_device, supports_bf16, supports_tf32
from .precision import tf32_mode
from .paths import run_dir

MATMUL_DTYPES = ("bf16", "fp16", "tf32", "fp32")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
# A CPU's ceilings only stand in for a GPU's (the smoke profile checks that code runs): n = 256, where
# 512 took 7 s per 16-bit dtype on a CPU without 16-bit matrix instructions, in every notebook 00 run.
SIZES = {"cuda": {"copy_bytes": 2 << 30, "matmul_n": 8192}, "cpu": {"copy_bytes": 64 << 20, "matmul_n": 256}}


def copy_gbps(device: torch.device, nbytes: int | None = None, iters: int = 20) -> bench.Timing:
    nbytes = nbytes or SIZES[device.type]["copy_bytes"]
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = bench.time_fn(lambda i: dst.copy_(src), device, warmup=3, iters=iters)
    del src, dst
    return t


def matmul_tflops(device: torch.device, dtype: str, n: int | None = None, iters: int = 20) -> bench.Timing:
    n = n or SIZES[device.type]["matmul_n"]
    torch_dtype = TORCH_DTYPES[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch_dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch_dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=torch_dtype)
    with tf32_mode(dtype == "tf32"):
        t = bench.time_fn(lambda i: torch.mm(a, b, out=out), device, warmup=3, iters=iters)
    del a, b, out
    return t


def measure(device: str | torch.device = "auto") -> dict:
    """All ceilings of this device, with the sizes and spreads they came from."""
    dev = resolve_device(device)
    di = info(dev)
    sz = SIZES[dev.type]
    ct = copy_gbps(dev)
    out = {"device": di.name, "kind": dev.type,
           "copy_gbps": 2 * sz["copy_bytes"] / (ct.median_ms / 1e3) / 1e9,
           "copy_timing": ct.to_dict(), "copy_bytes": sz["copy_bytes"], "matmul_n": sz["matmul_n"],
           "matmul_tflops": {}, "matmul_timing": {}, "skipped": {}}
    flops = 2.0 * sz["matmul_n"] ** 3
    for dtype in MATMUL_DTYPES:
        if dtype == "bf16" and not supports_bf16(di):
            out["skipped"][dtype] = f"{di.name} has no bf16 tensor cores"
            continue
        if dtype == "tf32" and not supports_tf32(di):
            out["skipped"][dtype] = "TF32 needs an sm_80+ GPU"
            continue
        t = matmul_tflops(dev, dtype)
        out["matmul_tflops"][dtype] = flops / (t.median_ms / 1e3) / 1e12
        out["matmul_timing"][dtype] = t.to_dict()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def save(ceilings: dict, run=None):
    """Store measured ceilings as ``<run>/ceilings.json``; returns the path."""
    return results.write_json(run_dir(run) / "ceilings.json", ceilings)


def share(value: float | None, ceiling: float | None) -> float | None:
    """value / ceiling, or None when either is missing."""
    if value is None or not usable(ceiling):
        return None
    return value / ceiling


def usable(v) -> bool:
    """Whether ``v`` can be a ceiling: a positive, finite number (not a bool, not a string)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def check(ceilings: dict) -> tuple[dict, list[str]]:
    """(``ceilings`` without the entries that cannot be ceilings, what was left out and why): the copy
    bandwidth and every matmul ceiling must be positive and finite (a negative, NaN, infinite or
    textual one gives a negative or absurd MFU and floor)."""
    out, dropped = dict(ceilings), []
    if out.get("copy_gbps") is not None and not usable(out["copy_gbps"]):
        dropped.append(f"copy_gbps={out['copy_gbps']!r} is not a positive, finite number")
        out["copy_gbps"] = None
    mm = out.get("matmul_tflops")
    if mm is not None and not isinstance(mm, dict):
        dropped.append(f"matmul_tflops={mm!r} is not an object of dtype -> TFLOP/s")
        mm = {}
    keep = {}
    for k, v in (mm or {}).items():
        if usable(v):
            keep[k] = v
        else:
            dropped.append(f"matmul_tflops[{k!r}]={v!r} is not a positive, finite number")
    out["matmul_tflops"] = keep
    return out, dropped
