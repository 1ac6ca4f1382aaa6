"""Vision-BDH's sparse encoder and its Hebbian gate as matmuls whose epilogues do the elementwise work.
One Triton kernel, three epilogues.

Loaded from this folder by ``hwlib.ops.sources`` (imported by path, not as a package module); the
Python face (the autograd ops, the torch backend, the float64 reference) is
``hwlib/steps/s32_bdh_fused_gates/op.py``.

Each application of BDH's shared layer multiplies a [M, K] operand (M = B T tokens, K = D = 192) by a
per-head [K, N] matrix (N = 1024 neurons per head) and follows it with elementwise work on the
[H, M, N] result, the largest tensors of the step. Per head h, with acc = A_h B_h in fp32:

    ENCODE       s = ReLU(acc),  q = RoPE(s)                    A = x (shared by the heads), B = E_h
    GATE         u = ReLU(acc),  g = s * u                      A = a_h, B = E_v,h;  s read
    GATE_GRAD    dg = acc: dz = dg * s * [u > 0],  ds = dg * u  A = dy (shared), B = W_h^T;  s, u read

RoPE is BDH's: neuron pairs (2i, 2i + 1) are adjacent columns of one tile, rotated by their token's
phase, q_2i = s_2i cos - s_2i+1 sin and q_2i+1 = s_2i+1 cos + s_2i sin (cos and sin as the unfused
path rounds them, in the operands' dtype). Every result is computed in fp32 from the operands as the
unfused path rounds them (s and u rounded before they are used again) and rounded once when stored.

Bytes per layer application, Q = H M N elements of 2 bytes (204 MB at the full profile: H = 6,
M = 256 x 65, N = 1024), at one pass per tensor; the unfused path writes the matmul's result and
reads it back before its elementwise kernel:

    ENCODE     writes s, q                     2Q   (unfused: z out, z in, s out, q out: 4Q)
    GATE       reads s; writes u, g            3Q   (unfused: z2 out, z2 in, s in, u out, g out: 5Q)
    GATE_GRAD  reads s, u; writes dz, ds       4Q   (unfused: dg out, dg in, s in, u in, dz out, ds out: 6Q)

plus the operands A [M, K] and B [K, N] per head (under 1% of Q at K = 192). FLOPs: 2 H M N K each,
39 GFLOP at the full profile: at the H100's measured bf16 matmul ceiling a fraction of the bytes' time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ENCODE, GATE, GATE_GRAD = 0, 1, 2

# A [128, 64] x [64, 128] tile per step of K: at K = 192 three steps, and 2 x 32 KB of bf16 results
# per program stored once. Untimed against other tiles.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64


@triton.jit
def _gates_kernel(a_ptr, b_ptr, s_ptr, u_ptr, cos_ptr, sin_ptr, out1_ptr, out2_ptr,
                  M, N, K, T,
                  sah, sam, sak, sbh, sbk, sbn,
                  EPILOGUE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)       # the column tiles of one row tile run next to each other: A's rows stay in L2
    pid_m = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    a_rows = a_ptr + h * sah + rm.to(tl.int64)[:, None] * sam
    b_cols = b_ptr + h * sbh + rn.to(tl.int64)[None, :] * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :] * sak, mask=mmask[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(b_cols + kk[:, None] * sbk, mask=(kk < K)[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    # the [H, M, N] tensors of the epilogue are contiguous
    offs = h * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
    mask = mmask[:, None] & nmask[None, :]
    dt = out1_ptr.dtype.element_ty
    if EPILOGUE == 0:
        s = tl.maximum(acc, 0.0).to(dt)
        tl.store(out1_ptr + offs, s, mask=mask)
        t = (rm % T).to(tl.int64)[:, None] * N + rn[None, :]      # the token's row of the phase tables
        c = tl.load(cos_ptr + t, mask=mask, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + t, mask=mask, other=0.0).to(tl.float32)
        # pairs (2i, 2i + 1) are adjacent columns: split the tile into its even and odd columns
        ev, od = tl.split(tl.reshape(s.to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))
        ce, co = tl.split(tl.reshape(c, (BLOCK_M, BLOCK_N // 2, 2)))
        se, so = tl.split(tl.reshape(sn, (BLOCK_M, BLOCK_N // 2, 2)))
        q = tl.reshape(tl.join(ev * ce - od * se, od * co + ev * so), (BLOCK_M, BLOCK_N))
        tl.store(out2_ptr + offs, q.to(dt), mask=mask)
    elif EPILOGUE == 1:
        u = tl.maximum(acc, 0.0).to(dt)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out1_ptr + offs, u, mask=mask)
        tl.store(out2_ptr + offs, (s * u.to(tl.float32)).to(dt), mask=mask)
    else:
        dg = acc.to(dt).to(tl.float32)          # the unfused path rounds dg once, as the bmm's output
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out1_ptr + offs, tl.where(u > 0.0, dg * s, 0.0).to(dt), mask=mask)
        tl.store(out2_ptr + offs, (dg * u).to(dt), mask=mask)


def gates(epilogue: int, a: torch.Tensor, b: torch.Tensor, *, s=None, u=None, cos=None, sin=None,
          tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [H, M, N] results of ``a`` [M, K] (one operand for every head, stride 0 over the heads) or
    [H, M, K], times ``b`` [H, K, N] (any strides), with ``epilogue``'s elementwise work (module
    docstring). ``s`` and ``u`` [H, M, N] contiguous where the epilogue reads them; ``cos``/``sin``
    [tokens, N] for ENCODE, row m being token m % tokens. The results take ``a``'s dtype."""
    H, K, N = b.shape
    M = a.shape[-2]
    if a.dim() == 2:
        sah, sam, sak = 0, a.stride(0), a.stride(1)
    else:
        sah, sam, sak = a.stride()
    out1 = torch.empty((H, M, N), dtype=a.dtype, device=a.device)
    out2 = torch.empty_like(out1)
    dummy = out1
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M), H)
    _gates_kernel[grid](a, b, s if s is not None else dummy, u if u is not None else dummy,
                        cos if cos is not None else dummy, sin if sin is not None else dummy, out1, out2,
                        M, N, K, tokens, sah, sam, sak, *b.stride(),
                        # Triton's CPU interpreter multiplies 16-bit operands' bits as integers in tl.dot
                        # (3.9): there they are widened first, exactly, and multiplied in fp32
                        EPILOGUE=epilogue, IEEE=a.dtype == torch.float32 or a.device.type == "cpu",
                        UPCAST=a.device.type == "cpu" and a.dtype != torch.float32,
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=8, num_stages=3)
    return out1, out2
