"""BK-Core in Triton: G_i = [(T - zI)^-1]_ii for a batch of tridiagonal T, and its exact gradient.

Loaded from this folder by ``hwlib.ops.sources`` (imported by path, not as a package module).
The math, with d_i = a_i - z and k_j = b_j c_j (see ``hwlib/ops/bk_reference.py`` for the
derivation):

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

import functools

import torch
import triton
import triton.language as tl

DEFAULT_BLOCK = 32      # sequences per program of the two-pass kernels: 8192 / 32 = 256 programs for 132 SMs


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


def _warps(block: int) -> int:
    # one lane per thread: more warps than BLOCK / 32 would only hold copies of the same lanes
    return max(1, min(4, block // 32))


def _z_tensor(z, like: torch.Tensor) -> torch.Tensor:
    z = complex(z)
    return _z_on(z.real, z.imag, like.dtype, like.device)


@functools.lru_cache(maxsize=64)
def _z_on(zr: float, zi: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # z in the inputs' dtype (a float64 z for float64 inputs: Triton takes Python floats as fp32),
    # made once per value and device: a host-to-device copy is not allowed while a CUDA graph is
    # being captured, and the op runs inside the training step's graph (made on its warm-up run).
    # Read only by the kernels.
    return torch.tensor([zr, zi], dtype=dtype, device=device)


def _check(a, b, c):
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2:
        raise ValueError("bk_forward: a must be [B, N], b and c [B, N-1]")
    B, N = a.shape
    if b.shape != (B, N - 1) or c.shape != (B, N - 1):
        raise ValueError(f"bk_forward: b {tuple(b.shape)} and c {tuple(c.shape)} must be {(B, N - 1)}")
    if a.dtype not in (torch.float32, torch.float64) or b.dtype != a.dtype or c.dtype != a.dtype:
        raise TypeError(f"bk_forward: a, b, c must share float32 or float64, got {a.dtype}, {b.dtype}, {c.dtype}")
    return B, N


def _output(a: torch.Tensor, B: int, N: int, out: torch.Tensor | None, name: str) -> torch.Tensor:
    """G's output: ``out`` checked (complex of ``a``'s precision, [B, N], any strides) or a new one."""
    cd = torch.complex64 if a.dtype == torch.float32 else torch.complex128
    if out is None:
        return torch.empty((B, N), dtype=cd, device=a.device)
    if out.shape != (B, N) or out.dtype != cd:
        raise ValueError(f"{name}: out must be {cd} of shape {(B, N)}")
    return out


def bk_forward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z, out: torch.Tensor | None = None,
               block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """G [B, N] complex for a [B, N], b, c [B, N-1] (any strides: pass ``x_nb.t()`` for the
    interleaved layout). ``out``: a complex [B, N] tensor, any strides (e.g. ``out_nb.t()``)."""
    B, N = _check(a, b, c)
    out = _output(a, B, N, out, "bk_forward")
    if B == 0 or N == 0:
        return out
    o = torch.view_as_real(out)
    # N = 1 leaves b, c empty: any pointer will do, the masks keep them unread
    b_, c_ = (b, c) if N > 1 else (a, a)
    _bk_forward_kernel[(triton.cdiv(B, block),)](
        a, b_, c_, _z_tensor(z, a), o, B, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), o.stride(0), o.stride(1), BLOCK=block, num_warps=_warps(block))
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
        b.stride(0), b.stride(1), c.stride(0), c.stride(1), w.stride(0), w.stride(1), BLOCK=block,
        num_warps=_warps(block))
    return da, db, dc


# --- chunked forward: B * P lanes instead of B -----------------------------------------------------
#
# The sweeps above give one lane per sequence and a dependent chain of ~3N reciprocals per lane:
# at B = 8192 an H100 idles on latency. The chunked forward splits each sequence into P chunks of
# L positions (lane = (sequence, chunk)) and joins the chunks exactly through Moebius maps:
#
#   gL_i = 1 / (d_i - k_{i-1} gL_{i-1}) is the projective action g = p / q of
#   M_i = [[0, 1], [-k_{i-1}, d_i]] on (p, q); gR_i = 1 / (d_i - k_i gR_{i+1}) likewise with k_i.
#
# One kernel, one program = BS sequences x PP chunks (PP = next power of 2 >= cdiv(N, L)):
#   phase 1  each lane gets its chunk's a, b, c once, in registers (see "Access pattern"), and composes the
#            chunk's left map E_p = M_{pL+L-1} ... M_{pL} and right map F_p = M'_{pL} ... M'_{pL+L-1},
#            rescaling the 2x2 complex product by its largest |re|, |im| every 4 steps (projective:
#            any scale is exact, nothing over- or underflows).
#   phase 2  tl.associative_scan over the chunk axis (combine = matrix product, rescaled):
#            prefix products give gL at the end of every chunk, suffix products (reverse=True) gR
#            at the start of every chunk; they go through a 4-float-per-chunk workspace and a
#            barrier to the neighbours (one 16-byte vector per chunk each way): gL entering chunk p
#            from the left, gR from the right.
#            The maps act on the start column (0, 1), exact: the first step has k_{-1} = 0 (and
#            k_{N-1} = 0 on the right). (Not tl.gather for the shift: its warp-local layout
#            propagated back into phase 1 and replicated the work 8x at 255 registers.)
#   phase 3  from those boundary values the chunk runs the stable continued fractions of the
#            two-pass kernel out of registers: left to right keeping sL_i (registers), right to left
#            G_i = 1 / (d_i - sL_i - k_i gR_{i+1}) written once.
# Bytes per element (float32 in, complex64 out): 12 read (a, b, c, once; plus b, c at one position
# per chunk, 8 / L, from cache) + 8 written = 20, the minimum; plus the boundary workspace, 16 B
# written and 16 read per chunk (1 B per element at the default L = 32, within one program: L2
# traffic, at most 0.5 B per element reaching DRAM). No second pass over the inputs.
# FLOPs per element: ~3 complex reciprocals and ~4 complex multiply-adds as before plus 2 complex
# 2x2 map steps (~24) and the scans (O(1) per chunk): about 70 real FLOPs per element.
# Accuracy: gL / gR inside a chunk are the same recursions as bk_forward; only the boundary values
# come through the map products (rounding ~ L + log P matrix products, damped by the contraction).
# Access pattern: each input is read as one [BS, PP, L] tile (with unit position strides, which a
# GPU launch specializes as constexprs: consecutive threads on consecutive positions, 16-byte vectors
# where the rows are aligned) and handed to the lanes by _columns, even / odd halvings (reshape,
# split) that leave it to the compiler how the tile reaches one thread per chunk. G leaves as one
# contiguous [BS, PP, 2 L] tile (re, im interleaved), which the compiler stores coalesced in 16-byte
# vectors after a conversion through shared memory. Stored as [BS, PP, L, 2] instead (what this
# replaced), the pair dimension was the only contiguous one the compiler could see: it kept the
# arithmetic's one-thread-per-chunk layout for the store, so each 8-byte store of a warp touched
# 32 sectors (4.1x the sectors the CUDA kernel writes to L2 for the same bytes; L2 71-78% busy,
# DRAM 27-30%; ncu, H100, Triton 3.6), and the forward took 0.39-0.42 ms at B = 8192, N = 2048
# (27-28% of copy bandwidth) against 0.22-0.29 ms with the coalesced store (bench on one H100,
# interleaved, L = 16). A lane reading its own L positions column by column (lanes L elements
# apart), before that, took 0.67 ms.
# Chunks of 32 positions on 2-warp programs (64 lanes: one sequence of 2048 a program) are the
# default: a lane's fully unrolled code holds 142 instructions per position against 200 at L = 16
# (the scans and map rescalings shared by twice the positions; SASS, Triton 3.6), at 167 registers
# (6 programs of 64 threads per SM). WHOLE (N = PP L, the chunks whole) drops the tail masks of the map steps.
# What still separates it from the CUDA kernel: occupancy (12 warps per SM against 28; the tile and
# the chunk's sL values live in registers, where the CUDA kernel keeps the tile in shared memory,
# staged by hand through rows whose 16-byte vectors are permuted against bank conflicts) and the
# scan, which the compiler runs as a generic associative_scan over 8-float maps, rescaled at every
# combine.

CHUNK = 32              # positions per lane, a power of 2 (registers: ~5 L floats per lane)
MAX_CHUNKS = 256        # chunks per sequence (lanes per program); longer N gets longer chunks
CHUNK_LANES = 64        # lanes per program for short N (several sequences per program)


@triton.jit
def _mscale(m0, m1, m2, m3, m4, m5, m6, m7):
    # divide a complex 2x2 (8 floats) by its largest |component|: projectively the same map
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(m0), tl.abs(m1)), tl.maximum(tl.abs(m2), tl.abs(m3))),
                   tl.maximum(tl.maximum(tl.abs(m4), tl.abs(m5)), tl.maximum(tl.abs(m6), tl.abs(m7))))
    s = tl.where(m > 0, 1.0 / tl.where(m > 0, m, 1.0), 1.0)
    return m0 * s, m1 * s, m2 * s, m3 * s, m4 * s, m5 * s, m6 * s, m7 * s


@triton.jit
def _mstep(m, k, dr, di, valid, MASKED: tl.constexpr):
    # [[0, 1], [-k, d]] @ m; m = (r00, i00, r01, i01, r10, i10, r11, i11). MASKED: only on valid
    # lanes (positions past N leave m as it is); unmasked when every chunk is whole (PP L = N)
    n10r = dr * m[4] - di * m[5] - k * m[0]
    n10i = dr * m[5] + di * m[4] - k * m[1]
    n11r = dr * m[6] - di * m[7] - k * m[2]
    n11i = dr * m[7] + di * m[6] - k * m[3]
    if MASKED:
        return (tl.where(valid, m[4], m[0]), tl.where(valid, m[5], m[1]),
                tl.where(valid, m[6], m[2]), tl.where(valid, m[7], m[3]),
                tl.where(valid, n10r, m[4]), tl.where(valid, n10i, m[5]),
                tl.where(valid, n11r, m[6]), tl.where(valid, n11i, m[7]))
    return m[4], m[5], m[6], m[7], n10r, n10i, n11r, n11i


@triton.jit
def _mcombine(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    # scan combine: a holds the maps applied first (earlier chunks on the left; on the right, with
    # reverse=True, the later chunks), so the product is b @ a, rescaled
    c00r, c00i = _cmul(b0, b1, a0, a1)
    t_r, t_i = _cmul(b2, b3, a4, a5)
    c01r, c01i = _cmul(b0, b1, a2, a3)
    u_r, u_i = _cmul(b2, b3, a6, a7)
    c10r, c10i = _cmul(b4, b5, a0, a1)
    v_r, v_i = _cmul(b6, b7, a4, a5)
    c11r, c11i = _cmul(b4, b5, a2, a3)
    w_r, w_i = _cmul(b6, b7, a6, a7)
    return _mscale(c00r + t_r, c00i + t_i, c01r + u_r, c01i + u_i,
                   c10r + v_r, c10i + v_i, c11r + w_r, c11i + w_i)


@triton.jit
def _mratio(m):
    # the map applied to (0, 1): g = m01 / m11
    s = 1.0 / (m[6] * m[6] + m[7] * m[7])
    return (m[2] * m[6] + m[3] * m[7]) * s, (m[3] * m[6] - m[2] * m[7]) * s


@triton.constexpr_function
def _bitrev(j, bits):
    """j's ``bits`` low bits in reverse order (at compile time)."""
    return int(format(j, f"0{bits}b")[::-1], 2) if bits else 0


@triton.jit
def _columns(x, LOG2L: tl.constexpr):
    # x [BS, PP, L] -> (x[:, :, 0], ..., x[:, :, L - 1]), L = 2^LOG2L: halved into even and odd
    # positions LOG2L times (reshape [.., W] -> [.., W / 2, 2], split), which moves a lane's L values
    # into one thread's registers whatever layout the load had
    parts = (x,)
    for lev in tl.static_range(LOG2L):
        nxt = ()
        for t in tl.static_range(1 << lev):
            p = parts[t]
            if lev < LOG2L - 1:
                p = tl.reshape(p, [p.shape[0], p.shape[1], p.shape[2] // 2, 2])
            e, o = tl.split(p)
            nxt = nxt + (e, o)
        parts = nxt
    cols = ()
    for j in tl.static_range(1 << LOG2L):
        cols = cols + (parts[_bitrev(j, LOG2L)],)        # where the halving put column j
    return cols


@triton.jit
def _quad(v):
    # [BS, PP, 4] -> v0, v1, v2, v3
    even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 2, 2]))
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0, v1, v2, v3


@triton.jit
def _tile(cols, LOG2L: tl.constexpr):
    # the inverse of _columns: L tensors [BS, PP] -> [BS, PP, L] (joins of even and odd halves)
    parts = ()
    for t in tl.static_range(1 << LOG2L):
        parts = parts + (cols[_bitrev(t, LOG2L)],)       # bit reversal is its own inverse
    for lev in tl.static_range(LOG2L):
        nxt = ()
        for u in tl.static_range(1 << (LOG2L - 1 - lev)):
            p = tl.join(parts[2 * u], parts[2 * u + 1])
            if lev > 0:
                p = tl.reshape(p, [p.shape[0], p.shape[1], p.shape[2] * 2])
            nxt = nxt + (p,)
        parts = nxt
    return parts[0]


@triton.jit
def _bk_forward_chunked_kernel(a_ptr, b_ptr, c_ptr, z_ptr, out_ptr, ws_ptr, B, N,
                               sab, san, sbb, sbn, scb, scn, sob, son,
                               LOG2L: tl.constexpr, BS: tl.constexpr, PP: tl.constexpr,
                               OUT_PACKED: tl.constexpr, WHOLE: tl.constexpr):
    # OUT_PACKED: son == 2 (G's rows contiguous), stated at compile time so that G leaves as one
    # contiguous [BS, PP, 2 L] tile per program, which the compiler stores coalesced (through shared
    # memory) in 16-byte vectors; WHOLE: N = PP L (every chunk whole: the map steps need no mask)
    L: tl.constexpr = 1 << LOG2L
    dt = a_ptr.dtype.element_ty
    seq = (tl.program_id(0) * BS + tl.arange(0, BS)).to(tl.int64)[:, None]       # [BS, 1]
    chunk = tl.arange(0, PP)[None, :]                                              # [1, PP]
    live = seq < B
    san, sbn, scn, son = tl.cast(san, tl.int64), tl.cast(sbn, tl.int64), tl.cast(scn, tl.int64), tl.cast(son, tl.int64)
    zr = tl.load(z_ptr)
    zi = tl.load(z_ptr + 1)
    a_row, b_row, c_row, o_row = a_ptr + seq * sab, b_ptr + seq * sbb, c_ptr + seq * scb, out_ptr + seq * sob
    start = chunk.to(tl.int64) * L                                                 # [1, PP]
    zero = tl.zeros([BS, PP], dtype=dt)
    one = zero + 1.0

    # phase 1: the chunk into registers (one [BS, PP, L] load per input, consecutive threads on
    # consecutive positions where the layout allows), its left and right maps
    pos3 = start[:, :, None] + tl.arange(0, L)[None, None, :]                     # [1, PP, L]
    live3 = live[:, :, None]
    has_k3 = live3 & (pos3 < N - 1)
    av = _columns(tl.load(a_row[:, :, None] + pos3 * san, mask=live3 & (pos3 < N), other=0.0), LOG2L)
    kv = _columns(tl.load(b_row[:, :, None] + pos3 * sbn, mask=has_k3, other=0.0)
                  * tl.load(c_row[:, :, None] + pos3 * scn, mask=has_k3, other=0.0), LOG2L)
    has_prev = live & (start > 0) & (start < N)
    kprev = (tl.load(b_row + (start - 1) * sbn, mask=has_prev, other=0.0)
             * tl.load(c_row + (start - 1) * scn, mask=has_prev, other=0.0))
    ml = (one, zero, zero, zero, zero, zero, one, zero)
    mr = (one, zero, zero, zero, zero, zero, one, zero)
    for j in tl.static_range(L):
        kl = kprev if j == 0 else kv[j - 1]
        ml = _mstep(ml, kl, av[j] - zr, zero - zi, start + j < N, not WHOLE)
        mr = _mstep(mr, kv[L - 1 - j], av[L - 1 - j] - zr, zero - zi, start + (L - 1 - j) < N, not WHOLE)
        if j % 4 == 3 or j == L - 1:
            ml = _mscale(*ml)
            mr = _mscale(*mr)

    # phase 2: prefix products (left) and suffix products (right) over the chunks of each sequence;
    # the values leaving each chunk go through a small workspace to the neighbouring chunks
    ml = tl.associative_scan(ml, 1, _mcombine)
    mr = tl.associative_scan(mr, 1, _mcombine, reverse=True)
    glr, gli = _mratio(ml)                       # gL at the last position of each chunk
    grr, gri = _mratio(mr)                       # gR at the first position of each chunk
    # (glr, gli, grr, gri) of a chunk as one 16-byte vector: one store and one load per lane
    q = tl.arange(0, 4)[None, None, :]
    w = ws_ptr + ((tl.program_id(0) * BS + tl.arange(0, BS))[:, None] * (4 * PP) + chunk * 4)[:, :, None] + q
    tl.store(w, tl.reshape(tl.join(tl.join(glr, grr), tl.join(gli, gri)), [BS, PP, 4]))
    tl.debug_barrier()
    first = chunk == 0
    last = chunk == PP - 1
    # from the chunk on the left, gL at its last position (q = 0, 1); from the right, gR at its
    # first (q = 2, 3): the vector at w + 4 (q - 2) holds both where they are needed
    nb = tl.load(w + 4 * (q // 2 * 2 - 1), mask=tl.where(q < 2, (~first)[:, :, None], (~last)[:, :, None]), other=0.0)
    gl_r, gl_i, gr_r, gr_i = _quad(nb)   # (flat: Triton 3.6 cannot hash nested unpacking)
    slr = kprev * gl_r                                         # sL at the chunk's first position
    sli = kprev * gl_i

    # phase 3: the chunk's own sweeps from its boundary values, out of registers; G leaves as one
    # [BS, PP, L, 2] store (re, im interleaved as complex is)
    slv = ()
    for j in tl.static_range(L):
        slv = slv + ((slr, sli),)
        g_r, g_i = _crcp(av[j] - zr - slr, -zi - sli)
        slr, sli = kv[j] * g_r, kv[j] * g_i
    gre = ()
    gim = ()
    for j in tl.static_range(L - 1, -1, -1):
        srr, sri = kv[j] * gr_r, kv[j] * gr_i
        dr = av[j] - zr
        g_r, g_i = _crcp(dr - slv[j][0] - srr, -zi - slv[j][1] - sri)
        gre = (g_r,) + gre
        gim = (g_i,) + gim
        gr_r, gr_i = _crcp(dr - srr, -zi - sri)
    g = tl.join(_tile(gre, LOG2L), _tile(gim, LOG2L))                            # [BS, PP, L, 2]
    if OUT_PACKED:
        f2 = tl.arange(0, 2 * L)[None, None, :]
        tl.store(o_row[:, :, None] + start[:, :, None] * 2 + f2, tl.reshape(g, [BS, PP, 2 * L]),
                 mask=live3 & (start[:, :, None] * 2 + f2 < 2 * N))
    else:
        ri = tl.arange(0, 2)[None, None, None, :]
        o_off = pos3[:, :, :, None] * son + ri
        tl.store(o_row[:, :, None, None] + o_off, g, mask=(live3 & (pos3 < N))[:, :, :, None])


def chunk_plan(N: int, chunk: int = CHUNK, lanes: int = CHUNK_LANES):
    """(L, PP, BS, num_warps) for the chunked forward at length N: chunks of ``chunk`` positions (a
    power of 2; longer, the next power of 2, when N needs more than MAX_CHUNKS of them), PP = next
    power of 2 of the chunk count, BS sequences per program so that a program has at least
    ``lanes`` lanes."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"bk_forward_chunked: chunk must be a power of 2, got {chunk}")
    L = triton.next_power_of_2(max(int(chunk), triton.cdiv(N, MAX_CHUNKS)))
    pp = triton.next_power_of_2(triton.cdiv(N, L))
    bs = max(1, lanes // pp)
    return L, pp, bs, max(1, min(8, bs * pp // 32))


def bk_forward_chunked(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, z, chunk: int = CHUNK,
                       out: torch.Tensor | None = None, lanes: int = CHUNK_LANES) -> torch.Tensor:
    """Same result as ``bk_forward`` (G [B, N] complex, any input / ``out`` strides), with one lane
    per (sequence, chunk of ``chunk`` positions, a power of 2): 20 bytes per element for float32
    (see above)."""
    B, N = _check(a, b, c)
    L, pp, bs, warps = chunk_plan(N, chunk, lanes)
    out = _output(a, B, N, out, "bk_forward_chunked")
    if B == 0 or N == 0:
        return out
    o = torch.view_as_real(out)
    b_, c_ = (b, c) if N > 1 else (a, a)
    grid = triton.cdiv(B, bs)
    ws = torch.empty((grid * bs * pp * 4,), dtype=a.dtype, device=a.device)
    _bk_forward_chunked_kernel[(grid,)](
        a, b_, c_, _z_tensor(z, a), o, ws, B, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), o.stride(0), o.stride(1), LOG2L=L.bit_length() - 1, BS=bs, PP=pp,
        OUT_PACKED=o.stride(1) == 2, WHOLE=pp * L == N, num_warps=warps)
    return out
