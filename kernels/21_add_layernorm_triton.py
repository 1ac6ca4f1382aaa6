"""Residual add + LayerNorm, forward and backward, one Triton kernel each way.

Loaded from this folder by ``hwlib.ops.sources`` (imported by path, not as a package module); the
Python face (the autograd op, the torch backend, the float64 reference) is
``hwlib/steps/s21_fused_layernorm/op.py``.

A pre-LayerNorm block adds a branch's output to the residual stream and normalises the sum for the
next branch. For rows n of the stream x [M, D] (fp32 under autocast) and the branch output r [M, D]
(the autocast dtype), with gain w and bias b [D]:

    s_n    = x_n + r_n                                   (fp32: the new residual stream)
    mu_n   = mean(s_n),   rstd_n = 1 / sqrt(var(s_n) + eps)   (biased variance, as nn.LayerNorm)
    y_n    = (s_n - mu_n) rstd_n w + b                   (rounded once into the output dtype)

Backward, from dy (the gradient of y) and ds_in (the gradient that reaches s along the residual
stream; zero where s has no other use), with s_hat = (s - mu) rstd and g = dy w:

    ds   = ds_in + rstd (g - mean(g) - s_hat mean(g s_hat))     -> dx = ds (fp32), dr = ds (r's dtype)
    dw   = sum_n dy_n s_hat_n,   db = sum_n dy_n                  (partial sums per program, then one sum of both)

With the bias column (``ones_column``), y is written PAD wider (``hwlib.steps.s21_fused_layernorm.op.BIAS_COLUMNS``):
y_n, then 1, then zeros. A
matmul of the next linear's output gradient with these rows gives that linear's bias gradient as one
more column of its weight gradient (``hwlib.steps.s22_gelu_epilogue.op``), instead of a column sum of its own. The
backward reads dy's first D columns (the column is a constant; its gradient is not needed).

With the branch's output bias c [D] passed in (``r_bias``: the branch's last matmul then runs without
its bias), s_n = x_n + (r_n + c) and dc = sum_n ds_n, a third partial sum of values the backward already
holds in registers: the bias gradient's own pass over the [M, D] gradient (2 D bytes a row) is gone, and
the bias is added to the fp32 sum instead of to the matmul's accumulator before its rounding to r's dtype.

Bytes per row (D wide; fp32 stream, 2-byte branch and output):

    forward   read x 4D + r 2D, write s 4D + y 2D, + 8 (mu, rstd)          = 12 D   (+ 2 PAD with the bias column)
    backward  read dy 2D + s 4D + ds_in 4D, write dx 4D + dr 2D, + 8       = 16 D
              (the gain once per program, dw/db partials once per program: not per row;
              so is the branch bias, in both directions)

28 D bytes a row for both, the least any implementation that keeps an fp32 residual stream and
recomputes s_hat from s moves: unfused, the add, the LayerNorm, its backward, the gradient's cast
and the dw/db reductions each read their inputs again. GPT-2 small (M = 16,384, D = 768): 151 MB
forward, 201 MB backward per call; 24 calls a step (two per block), 8.4 GB. FLOPs ~10 D a row: no
compute limit anywhere near.

With the stream in the branch's 16-bit dtype (``hwlib.steps.s21_fused_layernorm.op``'s bf16 stream), every stream
term halves and dr is dx itself, not written:

    forward   read x 2D + r 2D, write s 2D + y 2D, + 8                      =  8 D
    backward  read dy 2D + s 2D + ds_in 2D, write dx 2D, + 8                =  8 D

16 D a row for both, 4.8 GB a step for GPT-2 small.

Each program owns BLOCK_M whole rows (BLOCK_D >= D, the row in registers: one read of every
input). The backward programs are persistent (a grid of a few per SM, each striding over row
blocks) so that dw and db are summed in registers over many rows and written once per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# GPT-2 small (D = 768, BLOCK_D 1024) on an H100: 4 rows per program and 4 warps, 32 fp32 values of
# each input per thread, no spills (the sm_90 compile test checks it). Inside step 17 (torch.profiler)
# the forward took 50.9 us a call and the backward 75.8 us, against 51 and 68 us for their bytes at
# the copy ceiling. Wider rows keep a program near 4,096 values per input and a thread near 32:
# untimed beyond D = 768.
# The backward takes half the rows per program: a sweep on an H100 (GPT-2's shape with the branch bias and
# the bias column, rows per program 1-8 x warps 2-16 x programs per SM 2-16, each the median of 10 samples
# of 20 launches) timed 2 rows, 4 warps, 4 programs per SM at 76.8 us against 82.4 us at 4 rows; more
# warps per row were far slower (8 warps at 2 rows: 274 us). The forward's configurations all took
# 55.6-59.1 us: it keeps 4 rows. With a bf16 stream (step 27) the same sweep (rows 1-8 x warps 2-8, and
# 2-8 programs per SM backward; GPT-2's shape with the branch bias and the bias column) kept both defaults:
# the forward's was the fastest, 38.7 us, and the backward's took 46.7 us against the best's 46.1 (4 rows,
# 4 warps, 8 programs per SM).
DEFAULT_BLOCK_M, DEFAULT_WARPS = 4, 4
BACKWARD_BLOCK_M = 2
PROGRAMS_PER_SM = 4     # backward: persistent programs per multiprocessor


def launch_config(D: int, block_m: int = DEFAULT_BLOCK_M) -> tuple[int, int]:
    """(rows per program, warps) for rows of width ``D``, at most ``block_m`` rows (the forward's
    default; the backward passes ``BACKWARD_BLOCK_M``)."""
    block_d = _block_d(D)
    block_m = max(1, min(block_m, 4096 // block_d))
    return block_m, min(16, max(DEFAULT_WARPS, block_m * block_d // 1024))


@triton.jit
def _add_ln_fwd_kernel(x_ptr, r_ptr, rb_ptr, w_ptr, b_ptr, s_ptr, y_ptr, mean_ptr, rstd_ptr, M, D, eps,
                       HAS_RB: tl.constexpr, PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RB:   # the branch's own output bias, added here instead of in its matmul's epilogue
        r += tl.load(rb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    # The stream is stored in its own dtype and normalised as stored: with a 16-bit stream the backward,
    # which recomputes s_hat from the stored s, then differentiates the very function the forward computed.
    s = (x + r).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + offs, s, mask=mask)
    s = s.to(tl.float32)
    mean = tl.sum(s, axis=1) / D
    sc = tl.where(mask, s - mean[:, None], 0.0)
    var = tl.sum(sc * sc, axis=1) / D
    # A row whose squares overflow fp32 (values past ~1.8e19) has no variance to normalise by: 1/sqrt(inf)
    # would be 0 and make every y the bias. NaN instead, as the torch backend gives (a select on the row's
    # statistic, [BLOCK_M] values: nothing on the path of the row's elements).
    rstd = tl.where(var == float("inf"), float("nan"), 1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = sc * rstd[:, None] * w[None, :] + b[None, :]
    yrow = rows.to(tl.int64)[:, None] * (D + PAD)   # y's rows are D + PAD wide: the bias column after D
    tl.store(y_ptr + yrow + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if PAD > 0:   # the bias column: a one, then zeros to the end of the row
        pcols = tl.arange(0, PAD)
        ones = tl.where(pcols == 0, 1.0, 0.0)
        tl.store(y_ptr + yrow + D + pcols[None, :], (ones[None, :] + tl.zeros([BLOCK_M, PAD], tl.float32)).to(
            y_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _add_ln_bwd_kernel(dy_ptr, ds_ptr, s_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dr_ptr, part_ptr,
                       M, D, HAS_DS: tl.constexpr, HAS_RB: tl.constexpr, WRITE_DR: tl.constexpr, PAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    drb = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        # dy's rows are D + PAD wide (the bias column's gradient after D: the column is a constant, unread)
        dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * (D + PAD) + cols[None, :], mask=mask, other=0.0).to(
            tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        s_hat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(g * s_hat, axis=1) / D
        c2 = tl.sum(g, axis=1) / D
        dx = (g - s_hat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(ds_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WRITE_DR:   # r narrower than the stream; of the same dtype, dx is r's gradient as well
            tl.store(dr_ptr + offs, dx.to(dr_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * s_hat, axis=0)
        db += tl.sum(dy, axis=0)
        if HAS_RB:   # the branch bias's gradient: the column sums of ds, already in registers
            drb += tl.sum(dx, axis=0)
    # one [2, D] slab per program (dw, then db; [3, D] with the branch bias's), so that one reduction
    # over the programs sums them all
    NPART: tl.constexpr = 3 if HAS_RB else 2
    tl.store(part_ptr + pid * NPART * D + cols, dw, mask=cmask)
    tl.store(part_ptr + pid * NPART * D + D + cols, db, mask=cmask)
    if HAS_RB:
        tl.store(part_ptr + pid * NPART * D + 2 * D + cols, drb, mask=cmask)


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def add_ln_fwd(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float,
               s: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
               r_bias: torch.Tensor | None = None) -> None:
    """s = x + r (+ r_bias, broadcast over the rows) and y = LayerNorm(s) into the given buffers (x, r,
    s: contiguous [M, D]; y: contiguous [M, D], or [M, D + PAD] with the bias column written after D;
    mean, rstd: [M] float32; r_bias [D])."""
    M, D = x.shape
    if M == 0:
        return
    bm, nw = launch_config(D)
    _add_ln_fwd_kernel[(triton.cdiv(M, bm),)](x, r, r_bias if r_bias is not None else w, w, b, s, y, mean, rstd,
                                              M, D, eps, HAS_RB=r_bias is not None, PAD=y.shape[1] - D,
                                              BLOCK_M=bm, BLOCK_D=_block_d(D), num_warps=nw)


def add_ln_bwd(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, w: torch.Tensor, mean: torch.Tensor,
               rstd: torch.Tensor, dx: torch.Tensor, dr: torch.Tensor | None, programs: int,
               block_m: int | None = None, r_bias: bool = False) -> torch.Tensor:
    """dx (and dr, the same values in r's dtype; ``dr`` None: not written, where r has dx's dtype) into
    the given buffers (dy [M, D], or [M, D + PAD] from a y written with the bias column); returns the float32 partial
    sums of dw and db, [programs, 2, D], and with ``r_bias`` the branch bias's too, [programs, 3, D]
    (the caller sums them over the programs: one small reduction). ``block_m`` overrides
    ``launch_config``'s rows per program (tests: more programs than row blocks)."""
    M, D = s.shape
    part = torch.empty(programs, 3 if r_bias else 2, D, dtype=torch.float32, device=s.device)
    if M == 0:
        return part.zero_()
    bm, nw = launch_config(D, BACKWARD_BLOCK_M)
    bm = block_m or bm
    _add_ln_bwd_kernel[(programs,)](dy, ds if ds is not None else dy, s, w, mean, rstd, dx, dx if dr is None else dr,
                                    part, M, D, HAS_DS=ds is not None, HAS_RB=r_bias, WRITE_DR=dr is not None,
                                    PAD=dy.shape[1] - D, BLOCK_M=bm,
                                    BLOCK_D=_block_d(D),
                                    num_warps=nw)
    return part
