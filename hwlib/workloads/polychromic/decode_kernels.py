"""Triton kernels of the fused decode step (``fused_decode``), one decode token per row:

``qk_norm_rope_cache``  Qwen3's per-head RMSNorm of q and k, RoPE on both, and the new k and v
                        written into the static cache at the current position: one launch where
                        eager PyTorch needs about fifteen (two norms, rotate-half, four products,
                        two sums, two cache copies). Reads the fused QKV matmul's output once.
``decode_attention``    attention of one query token per row over the cache up to the current
                        length (read from the device, so one CUDA graph serves every position):
                        each program takes one (row, KV head) and all the query heads of its GQA
                        group, so each cached K and V element is read once per step, and nothing
                        past the current length is read (SDPA over a static cache reads all of it,
                        masked).

Imported only when a fused rung runs: Triton chooses its interpreter (``TRITON_INTERPRET=1``, CPU
tensors) at its first import. Rounding follows Hugging Face's eager bf16 code: every value that
code stores in the model dtype is rounded to it here too (``_round``), so the kernels differ from
it only where an accumulation order does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, ref_ptr):
    # to the storage dtype of ref_ptr and back: what an eager op that writes a tensor does
    return x.to(ref_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _qk_norm_rope_cache_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr,
                               v_cache_ptr, eps, stride_qkv_b, stride_cache_b, stride_cache_h, stride_cache_s,
                               H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)                  # 0..H-1: q heads, then HKV k heads, then HKV v heads
    half = tl.arange(0, D // 2)
    pos = tl.load(pos_ptr)
    row = qkv_ptr + b * stride_qkv_b + head * D
    x1 = tl.load(row + half).to(tl.float32)
    x2 = tl.load(row + D // 2 + half).to(tl.float32)
    if head >= H + HKV:                      # v: straight into the cache
        dst = v_cache_ptr + b * stride_cache_b + (head - H - HKV) * stride_cache_h + pos * stride_cache_s
        tl.store(dst + half, x1.to(v_cache_ptr.dtype.element_ty))
        tl.store(dst + D // 2 + half, x2.to(v_cache_ptr.dtype.element_ty))
    else:
        is_q = head < H
        var = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D
        r = 1.0 / tl.sqrt(var + eps)
        w_ptr = qn_ptr if is_q else kn_ptr
        w1 = tl.load(w_ptr + half).to(tl.float32)
        w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
        n1 = _round(w1 * _round(x1 * r, qkv_ptr), qkv_ptr)
        n2 = _round(w2 * _round(x2 * r, qkv_ptr), qkv_ptr)
        c1 = tl.load(cos_ptr + pos * D + half).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * D + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * D + half).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * D + D // 2 + half).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded as eager does
        o1 = _round(n1 * c1, qkv_ptr) + _round(-n2 * s1, qkv_ptr)
        o2 = _round(n2 * c2, qkv_ptr) + _round(n1 * s2, qkv_ptr)
        if is_q:
            dst = q_out_ptr + (b * H + head) * D
            tl.store(dst + half, o1.to(q_out_ptr.dtype.element_ty))
            tl.store(dst + D // 2 + half, o2.to(q_out_ptr.dtype.element_ty))
        else:
            dst = k_cache_ptr + b * stride_cache_b + (head - H) * stride_cache_h + pos * stride_cache_s
            tl.store(dst + half, o1.to(k_cache_ptr.dtype.element_ty))
            tl.store(dst + D // 2 + half, o2.to(k_cache_ptr.dtype.element_ty))


def qk_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, pos: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, eps: float, heads: int, kv_heads: int) -> None:
    """``qkv`` [B, (H + 2 HKV) D] (q, k, v heads in a row); ``cos``/``sin`` [S, D]; ``pos`` a [1]
    int64 device tensor; writes q [B, H, D] into ``q_out`` and k, v into ``k_cache``/``v_cache``
    [B, HKV, S, D] at ``pos``. No checks: the decoder built every buffer."""
    B = qkv.shape[0]
    D = cos.shape[-1]
    _qk_norm_rope_cache_kernel[(B, heads + 2 * kv_heads)](
        qkv, q_norm, k_norm, cos, sin, pos, q_out, k_cache, v_cache, eps, qkv.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), H=heads, HKV=kv_heads, D=D, num_warps=1)


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, scale, stride_cache_b, stride_cache_h,
                             stride_cache_s, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                             G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    length = tl.load(pos_ptr) + 1           # the cache holds positions 0..pos, the new token's included
    qrow = (b * H + kvh * G + g)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + qrow, mask=(g < G)[:, None], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    base = b * stride_cache_b + kvh * stride_cache_h
    for start in range(0, length, BLOCK_N):
        idx = start + n
        ok = idx < length
        off = base + idx[:, None] * stride_cache_s + d[None, :]
        k = tl.load(k_ptr + off, mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale      # [BLOCK_G, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    o = acc / l[:, None]
    tl.store(out_ptr + qrow, o.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     out: torch.Tensor, scale: float, block_n: int = 64) -> None:
    """``q`` [B, H, D] (one token per row), caches [B, HKV, S, D] filled up to ``pos`` (a [1] int64
    device tensor) inclusive; writes softmax(q k^T * scale) v over positions 0..pos into ``out``
    [B, H, D]. The query heads of a GQA group share their K and V loads."""
    B, H, D = q.shape
    HKV = k_cache.shape[1]
    G = H // HKV
    _decode_attention_kernel[(B, HKV)](
        q, k_cache, v_cache, pos, out, scale, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=H, HKV=HKV, D=D, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        # float32 (the CPU tests) in IEEE float32, as torch's attention; bf16 inputs take the tensor cores
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
