"""BK-Core in Triton: G_i = [(T - zI)^-1]_ii for a batch of tridiagonal T, and its exact gradient.

Loaded from this folder by ``hwlib.ops._load`` (``kernels/`` is not a package). The math, with
d_i = a_i - z and k_j = b_j c_j (see ``hwlib/ops/bk_reference.py`` for the derivation):

    sL_i = k_{i-1} gL_{i-1},  gL_i = 1 / (d_i - sL_i)           left to right
    sR_i = k_i gR_{i+1},      gR_i = 1 / (d_i - sR_i)           right to left
    G_i  = 1 / (d_i - sL_i - sR_i)

Layout: one program owns BLOCK sequences and walks their positions in lock-step, one lane per
sequence, so the running state (sL, or gR and its tangent) stays in registers. Every tensor is
passed with (sequence, position) strides. Stored as [N, B] (the caller passes ``x_nb.t()``) the
BLOCK loads of one position are contiguous: coalesced. Stored row-major [B, N] (what
``resolvent_diagonal`` passes) each lane reads its own row and the 32-byte sectors are reused from
L1 over the next positions; the notebook measures both.

Forward, fused in two passes (the output buffer holds sL between them, so no workspace):
    pass 1 (left to right):  read a, b, c; write sL_i into out[i]
    pass 2 (right to left):  read a, b, c, sL_i; write G_i over it
    bytes per element, float32 in / complex64 out: 12 + 8 + 12 + 8 + 8 = 48
    (minimal: 12 read + 8 written = 20; the extra 28 are the second read of the inputs and the
    round trip of sL, the price of not keeping a whole sequence on chip)
    FLOPs per element: ~3 complex reciprocals (|w|^2, one division, two multiplies each) plus
    ~4 complex multiply-adds: about 40 real FLOPs.

Backward, the forward-mode tangent of the same recursions (v = conj(grad out)):
    gL_i' = gL_i^2 (v_i + tL_i), tL_i = k_{i-1} gL_{i-1}';  gR_i' = gR_i^2 (v_i + tR_i), tR_i = k_i gR_{i+1}'
    G_i' = G_i^2 (v_i + tL_i + tR_i); da_i = -Re G_i'
    P_i = G_i' gR_{i+1} + G_i gR_{i+1}';  db_i = c_i Re P_i;  dc_i = b_i Re P_i
    pass 1: read a, b, c, grad (20 B), write sL, tL to a [N, 4, B] workspace (16 B)
    pass 2: read a, b, c, grad, sL, tL (36 B), write da, db, dc (12 B): 84 bytes per element
    (minimal 32), about 90 FLOPs per element.

Float32 or float64 (z arrives as a 2-element tensor of the input dtype so float64 keeps its
precision: a Python float argument would be passed as fp32). Runs on CPU tensors under
TRITON_INTERPRET=1 (set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_BLOCK = 128


@triton.jit
def _crcp(re, im):
    # 1 / (re + i im); fine for |w| within sqrt of the dtype's range (|a - z| < 1e19 in float32)
    s = 1.0 / (re * re + im * im)
    return re * s, -im * s


@triton.jit
def _cmul(ar, ai, br, bi):
    return ar * br - ai * bi, ar * bi + ai * br


@triton.jit
def _bk_forward_kernel(a_ptr, b_ptr, c_ptr, z_ptr, out_ptr, B, N,
                       sab, san, sbb, sbn, scb, scn, sob, son,
                       BLOCK: tl.constexpr):
    seq = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = seq < B
    # 64-bit position strides: i * stride overflows int32 for large interleaved [N, B] tensors
    san, sbn, scn, son = tl.cast(san, tl.int64), tl.cast(sbn, tl.int64), tl.cast(scn, tl.int64), tl.cast(son, tl.int64)
    zr = tl.load(z_ptr)
    zi = tl.load(z_ptr + 1)
    a_row, b_row, c_row = a_ptr + seq * sab, b_ptr + seq * sbb, c_ptr + seq * scb
    o_row = out_ptr + seq * sob          # out is the float view of complex: re at +0, im at +1
    sr = tl.zeros([BLOCK], dtype=a_ptr.dtype.element_ty)
    si = tl.zeros([BLOCK], dtype=a_ptr.dtype.element_ty)
    for i in range(0, N):
        a = tl.load(a_row + i * san, mask=live, other=0.0)
        has_k = seq < B * (i < N - 1)   # live and i has a right neighbour
        k = tl.load(b_row + i * sbn, mask=has_k, other=0.0) * tl.load(c_row + i * scn, mask=has_k, other=0.0)
        tl.store(o_row + i * son, sr, mask=live)
        tl.store(o_row + i * son + 1, si, mask=live)
        gr, gi = _crcp(a - zr - sr, -zi - si)
        sr, si = k * gr, k * gi
    # right to left: gR_{i+1} in registers, sL_i read back, G_i written over it
    gr = tl.zeros([BLOCK], dtype=a_ptr.dtype.element_ty)
    gi = tl.zeros([BLOCK], dtype=a_ptr.dtype.element_ty)
    for j in range(0, N):
        i = N - 1 - j
        a = tl.load(a_row + i * san, mask=live, other=0.0)
        has_k = seq < B * (i < N - 1)   # live and i has a right neighbour
        k = tl.load(b_row + i * sbn, mask=has_k, other=0.0) * tl.load(c_row + i * scn, mask=has_k, other=0.0)
        slr = tl.load(o_row + i * son, mask=live, other=0.0)
        sli = tl.load(o_row + i * son + 1, mask=live, other=0.0)
        srr, sri = k * gr, k * gi
        dr, di = a - zr, -zi
        g_r, g_i = _crcp(dr - slr - srr, di - sli - sri)
        tl.store(o_row + i * son, g_r, mask=live)
        tl.store(o_row + i * son + 1, g_i, mask=live)
        gr, gi = _crcp(dr - srr, di - sri)


@triton.jit
def _bk_backward_kernel(a_ptr, b_ptr, c_ptr, z_ptr, w_ptr, ga_ptr, gb_ptr, gc_ptr, ws_ptr, B, N,
                        sab, san, sbb, sbn, scb, scn, swb, swn,
                        BLOCK: tl.constexpr):
    # contiguous [B, N] / [B, N-1] gradients, workspace [N, 4, B] (coalesced across the batch)
    seq = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = seq < B
    san, sbn, scn, swn = tl.cast(san, tl.int64), tl.cast(sbn, tl.int64), tl.cast(scn, tl.int64), tl.cast(swn, tl.int64)
    B64 = tl.cast(B, tl.int64)
    zr = tl.load(z_ptr)
    zi = tl.load(z_ptr + 1)
    a_row, b_row, c_row, w_row = a_ptr + seq * sab, b_ptr + seq * sbb, c_ptr + seq * scb, w_ptr + seq * swb
    zero = tl.zeros([BLOCK], dtype=a_ptr.dtype.element_ty)
    slr, sli, tlr, tli = zero, zero, zero, zero
    for i in range(0, N):
        a = tl.load(a_row + i * san, mask=live, other=0.0)
        has_k = seq < B * (i < N - 1)   # live and i has a right neighbour
        k = tl.load(b_row + i * sbn, mask=has_k, other=0.0) * tl.load(c_row + i * scn, mask=has_k, other=0.0)
        vr = tl.load(w_row + i * swn, mask=live, other=0.0)
        vi = -tl.load(w_row + i * swn + 1, mask=live, other=0.0)
        ws = ws_ptr + i * 4 * B64 + seq
        tl.store(ws, slr, mask=live)
        tl.store(ws + B, sli, mask=live)
        tl.store(ws + 2 * B, tlr, mask=live)
        tl.store(ws + 3 * B, tli, mask=live)
        glr, gli = _crcp(a - zr - slr, -zi - sli)
        qr, qi = _cmul(glr, gli, glr, gli)
        dlr, dli = _cmul(qr, qi, vr + tlr, vi + tli)       # gL_i'
        slr, sli, tlr, tli = k * glr, k * gli, k * dlr, k * dli
    grr, gri, drr, dri = zero, zero, zero, zero             # gR_{i+1}, gR_{i+1}'
    for j in range(0, N):
        i = N - 1 - j
        a = tl.load(a_row + i * san, mask=live, other=0.0)
        has_k = seq < B * (i < N - 1)   # live and i has a right neighbour
        bv = tl.load(b_row + i * sbn, mask=has_k, other=0.0)
        cv = tl.load(c_row + i * scn, mask=has_k, other=0.0)
        k = bv * cv
        vr = tl.load(w_row + i * swn, mask=live, other=0.0)
        vi = -tl.load(w_row + i * swn + 1, mask=live, other=0.0)
        ws = ws_ptr + i * 4 * B64 + seq
        slr = tl.load(ws, mask=live, other=0.0)
        sli = tl.load(ws + B, mask=live, other=0.0)
        tlr = tl.load(ws + 2 * B, mask=live, other=0.0)
        tli = tl.load(ws + 3 * B, mask=live, other=0.0)
        srr, sri, trr, tri = k * grr, k * gri, k * drr, k * dri
        dr, di = a - zr, -zi
        g_r, g_i = _crcp(dr - slr - srr, di - sli - sri)
        qr, qi = _cmul(g_r, g_i, g_r, g_i)
        gpr, gpi = _cmul(qr, qi, vr + tlr + trr, vi + tli + tri)    # G_i'
        tl.store(ga_ptr + seq * N + i, -gpr, mask=live)
        p1r, _p1i = _cmul(gpr, gpi, grr, gri)
        p2r, _p2i = _cmul(g_r, g_i, drr, dri)
        p = p1r + p2r
        tl.store(gb_ptr + seq * (N - 1) + i, cv * p, mask=has_k)
        tl.store(gc_ptr + seq * (N - 1) + i, bv * p, mask=has_k)
        grr, gri = _crcp(dr - srr, di - sri)
        qr, qi = _cmul(grr, gri, grr, gri)
        drr, dri = _cmul(qr, qi, vr + trr, vi + tri)


def _z_tensor(z, like: torch.Tensor) -> torch.Tensor:
    z = complex(z)
    return torch.tensor([z.real, z.imag], dtype=like.dtype, device=like.device)


def _check(a, b, c):
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2:
        raise ValueError("bk_forward: a must be [B, N], b and c [B, N-1]")
    B, N = a.shape
    if b.shape != (B, N - 1) or c.shape != (B, N - 1):
        raise ValueError(f"bk_forward: b {tuple(b.shape)} and c {tuple(c.shape)} must be {(B, N - 1)}")
    if a.dtype not in (torch.float32, torch.float64) or b.dtype != a.dtype or c.dtype != a.dtype:
        raise TypeError(f"bk_forward: a, b, c must share float32 or float64, got {a.dtype}, {b.dtype}, {c.dtype}")
    return B, N


def bk_forward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z, out: torch.Tensor | None = None,
               block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """G [B, N] complex for a [B, N], b, c [B, N-1] (any strides: pass ``x_nb.t()`` for the
    interleaved layout). ``out``: a complex [B, N] tensor, any strides (e.g. ``out_nb.t()``)."""
    B, N = _check(a, b, c)
    cd = torch.complex64 if a.dtype == torch.float32 else torch.complex128
    if out is None:
        out = torch.empty((B, N), dtype=cd, device=a.device)
    if out.shape != (B, N) or out.dtype != cd:
        raise ValueError(f"bk_forward: out must be {cd} of shape {(B, N)}")
    if B == 0 or N == 0:
        return out
    o = torch.view_as_real(out)
    # N = 1 leaves b, c empty: any pointer will do, the masks keep them unread
    b_, c_ = (b, c) if N > 1 else (a, a)
    _bk_forward_kernel[(triton.cdiv(B, block),)](
        a, b_, c_, _z_tensor(z, a), o, B, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), o.stride(0), o.stride(1), BLOCK=block)
    return out


def bk_backward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z, grad: torch.Tensor,
                block: int = DEFAULT_BLOCK):
    """(da [B, N], db [B, N-1], dc [B, N-1]) for the incoming complex grad [B, N] (any strides)."""
    B, N = _check(a, b, c)
    da = torch.empty((B, N), dtype=a.dtype, device=a.device)
    db = torch.empty((B, max(N - 1, 0)), dtype=a.dtype, device=a.device)
    dc = torch.empty_like(db)
    if B == 0 or N == 0:
        return da, db, dc
    w = torch.view_as_real(grad.to(torch.complex64 if a.dtype == torch.float32 else torch.complex128))
    ws = torch.empty((N, 4, B), dtype=a.dtype, device=a.device)
    b_, c_, db_, dc_ = (b, c, db, dc) if N > 1 else (a, a, da, da)
    _bk_backward_kernel[(triton.cdiv(B, block),)](
        a, b_, c_, _z_tensor(z, a), w, da, db_, dc_, ws, B, N, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), c.stride(0), c.stride(1), w.stride(0), w.stride(1), BLOCK=block)
    return da, db, dc
