"""The CUDA row pass of the fused LM head (``kernels/17_ce_rows.cu``): its torch binding and
Python face.

``ce_rows_`` has the signature of the Triton row pass (``linear_ce_triton.ce_rows_``), so the chunk
loop of ``hwlib.steps.s17_fused_lm_head.op`` calls either: per-row cross-entropy of a chunk of logits, and its
gradient written over the logits. The CUDA pass reads each row once (into shared memory) where the
Triton pass reads it twice; the formulas, bytes and FLOPs are in the ``.cu`` header.
``fit_problem`` says where it cannot take a chunk (dtype, width, alignment, shared memory); the
caller then uses the Triton pass.
"""

from __future__ import annotations

import functools

import torch

from hwlib.device import Unavailable, info, supports_cp_async

from hwlib.ops.sources import read_kernel_source

KERNEL_FILE = "17_ce_rows.cu"
# Two blocks an SM at GPT-2's width. Notebook 17 on an H100 (4,096 x 50,304 bf16 logits, at 23e9da7):
# 0.359 ms a chunk at 512 threads, 0.453 at 1024.
THREADS = 512
DTYPES = {torch.bfloat16: 0, torch.float16: 1}
STATIC_SMEM = 256      # the block reduction's two arrays of (at most 32) warp totals

BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "17_ce_rows.h"

void ce_rows(torch::Tensor z, torch::Tensor t, torch::Tensor loss, torch::Tensor scale, int64_t vocab,
             int64_t ignore_index, bool write_grad, int64_t threads) {
  TORCH_CHECK(z.is_cuda() && z.dim() == 2 && z.stride(1) == 1, "ce_rows (cuda): z must be a CUDA [C, V_pad] tensor with contiguous rows");
  TORCH_CHECK(z.scalar_type() == torch::kBFloat16 || z.scalar_type() == torch::kHalf, "ce_rows (cuda): z must be bf16 or fp16");
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous() && t.numel() == z.size(0), "ce_rows (cuda): t must be [C] int64");
  TORCH_CHECK(loss.scalar_type() == torch::kFloat && loss.is_contiguous() && loss.numel() == z.size(0), "ce_rows (cuda): loss must be [C] float32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.numel() == 1, "ce_rows (cuda): scale must be one float32");
  TORCH_CHECK(t.device() == z.device() && loss.device() == z.device() && scale.device() == z.device(), "ce_rows (cuda): one device");
  const c10::cuda::CUDAGuard guard(z.device());
  const int err = ce_rows_launch(z.data_ptr(), z.scalar_type() == torch::kBFloat16 ? 0 : 1, z.size(0), z.stride(0),
                                 reinterpret_cast<const long long*>(t.data_ptr<int64_t>()), loss.data_ptr<float>(), scale.data_ptr<float>(), (int)vocab,
                                 (int)z.size(1), ignore_index, write_grad ? 1 : 0, (int)threads,
                                 c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "ce_rows (cuda) launch failed: ", ce_rows_error_string(err));
}
"""
FUNCTIONS = ["ce_rows"]
_MODULE = None


def module():
    """The built extension, loaded once per process; Unavailable with the reason where it cannot build."""
    global _MODULE
    if _MODULE is None:
        from hwlib.ops import build
        _MODULE = build.load("17_ce_rows", BINDING, FUNCTIONS)
    return _MODULE


def kernel_source() -> str:
    return read_kernel_source(KERNEL_FILE)


@functools.lru_cache(maxsize=None)
def device_problem(device_type: str) -> str | None:
    """Why the CUDA row pass cannot run on this machine's ``device_type`` tensors; None when it can."""
    if device_type != "cuda":
        return f"the CUDA row pass runs CUDA tensors only, got {device_type} tensors"
    if torch.cuda.is_available() and not supports_cp_async(di := info("cuda")):
        return f"cp.async needs an Ampere (sm_80) or newer GPU; {di.name} is older"
    try:
        module()
    except Unavailable as e:
        return str(e)
    return None


def smem_limit(device: torch.device | str = "cuda") -> int:
    """The shared memory one block may opt into on ``device``, in bytes."""
    return torch.cuda.get_device_properties(torch.device(device)).shared_memory_per_block_optin


def fit_problem(dtype: torch.dtype, vocab_padded: int, smem: int) -> str | None:
    """Why the CUDA pass cannot take rows of ``vocab_padded`` logits in ``dtype`` with ``smem`` bytes of
    shared memory a block; None when it can."""
    if dtype not in DTYPES:
        return f"the CUDA row pass takes bf16 or fp16 logits, got {dtype}"
    if vocab_padded % 8:
        return f"rows must be whole 16-byte vectors: V_pad ({vocab_padded}) must be a multiple of 8"
    if vocab_padded * 2 + STATIC_SMEM > smem:
        return (f"a row of {vocab_padded} logits ({vocab_padded * 2} bytes, plus {STATIC_SMEM} for the block's "
                f"reduction) exceeds the {smem} bytes of shared memory a block may use")
    return None


def takes(z: torch.Tensor) -> bool:
    """Whether the kernel can read this chunk in place: 16-byte aligned rows (the caller's own buffer
    always is; a view into another may not be)."""
    return z.data_ptr() % 16 == 0 and z.stride(0) % 8 == 0 and z.stride(1) == 1


def ce_rows_(z: torch.Tensor, targets: torch.Tensor, loss_out: torch.Tensor, scale: torch.Tensor, vocab: int,
             ignore_index: int, write_grad: bool = True, threads: int = THREADS) -> None:
    """Per-row cross-entropy of ``z`` [C, V_pad] against ``targets`` [C] (int64) into ``loss_out`` [C]
    (float32); with ``write_grad``, the gradient of ``scale * sum(loss)`` over ``z``. As the Triton
    row pass, same arguments; ValueError where ``fit_problem`` or the alignment rules the chunk out."""
    C, V_pad = z.shape
    if not (1 <= vocab <= V_pad):
        raise ValueError(f"vocab must be in [1, {V_pad}] (the logits' width), got {vocab}")
    problem = fit_problem(z.dtype, V_pad, smem_limit(z.device))
    if problem is None and not takes(z):
        problem = f"z's rows must start on 16-byte boundaries (data_ptr {z.data_ptr()}, strides {z.stride()})"
    if problem:
        raise ValueError(problem)
    if C == 0:
        return
    module().ce_rows(z, targets, loss_out, scale, int(vocab), int(ignore_index), bool(write_grad), int(threads))
