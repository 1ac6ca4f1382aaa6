"""Cross-entropy of one chunk of logits rows, and its gradient written over the logits, in Triton.

Loaded from this folder by ``hwlib.ops.sources`` (imported by path, not as a package module); the
Python face (the chunk loop, the GEMMs on cuBLAS, the autograd op, the float64 reference) is
``hwlib/steps/s17_fused_lm_head/op.py``.

The fused LM head computes, for the rows n of a chunk of hidden states h [C, D] and the head weight
W [V_pad, D] (only the first V rows are classes; the rest pad the GEMM to full tiles):

    z_n    = h_n W^T                                        (cuBLAS, bf16 in, fp32 accumulate, bf16 out)
    lse_n  = log sum_{v < V} exp(z_nv)                      (this kernel, fp32, online over tiles of z_n)
    loss_n = lse_n - z_{n, t_n}                             (0 where t_n = ignore_index)
    dz_nv  = (exp(z_nv - lse_n) - [v = t_n]) * s            for v < V;  0 for V <= v < V_pad
    s      = 1 / #{n : t_n != ignore_index}  (the mean's weight; 0 on ignored rows)

and writes dz over z in place, so the caller's next GEMMs (dh = dz W, dW += dz^T h) read it and no
second [C, V_pad] buffer exists. One program owns one row and walks it in tiles of BLOCK_V columns
twice: pass 1 keeps the running maximum m and the running sum s of exp(z - m) (Milakov and
Gimelshein 2018, "Online normalizer calculation for softmax"), pass 2 writes the gradient.

Per row, 2-byte logits, V_pad columns (GPT-2: V = 50257, V_pad = 50304):

    bytes  read 2 V (pass 1) + 2 V (pass 2) + one target logit; write 2 V_pad (gradient) + 4 (loss)
           ~6 V: 302 kB per row, 4.9 GB for 16,384 rows (loads run to V_pad, 0.1% more, so that
           they are 16-byte vectors). Pass 2 re-reads a 100 kB row that the same program read
           moments before: with a few hundred rows in flight it can come from L2.
    FLOPs  ~5 per column (max, subtract, exp, add in pass 1; subtract, exp, subtract, scale in pass 2);
           the exponentials (2 per column) are special-function work, ~1.6e9 for 16,384 rows

An unfused path moves the logits at least as often: the GEMM writes them, the forward's
log-softmax reads them, the backward reads them again and writes the gradient (more where the
compiler does not fuse the slice of the padded columns or the fp32 casts), and all of it stays
allocated from forward to backward. The chunk loop keeps one chunk of C rows alive.

Rows with a target outside [0, V) that is not ignore_index get a NaN loss and a NaN gradient: on the
device the kernel cannot raise, and a NaN makes the loss visibly wrong instead of silently reading
outside the row (the Python face raises a ValueError first wherever it can look at the targets).

Float32, bfloat16 or float16 logits (the interpreter, TRITON_INTERPRET=1 on CPU tensors, has no
bfloat16: tests run float32 and float16 there). Accumulation is fp32 for every input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# H100, bf16 logits, V_pad = 50304: 512 threads per row, 16 columns each per tile. Notebook 17 sweeps
# the alternatives (CONFIGS) and records them: 8192 x 16 warps was the fastest in two reference runs
# on 4,096 rows (0.440 ms against 0.466 for 4096 x 16; 0.432 against 0.461 at 23e9da7). This pass is
# what 'auto' runs where the CUDA row pass (17_ce_rows.cu, which reads each row once) cannot.
DEFAULT_BLOCK_V, DEFAULT_WARPS = 8192, 16
CONFIGS = ((2048, 8), (4096, 8), (4096, 16), (8192, 16), (8192, 32))


@triton.jit
def _ce_rows_kernel(z_ptr, stride_row, t_ptr, loss_ptr, scale_ptr, lse_ptr, V, V_pad, ignore_index,
                    WRITE_GRAD: tl.constexpr, STORE_LSE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_row
    t = tl.load(t_ptr + row)
    ignored = t == ignore_index
    bad = ((t < 0) | (t >= V)) & (t != ignore_index)
    cols = tl.arange(0, BLOCK_V)

    # pass 1: running max and sum of exp over the V real columns (padding is -inf: no class). Loads
    # are masked at V_pad, a multiple of 16 that Triton sees as one, so they vectorise (16 bytes a
    # thread); masked at an odd V they would go 2 bytes at a time. The padding is set apart after.
    x = tl.load(z_row + cols, mask=cols < V_pad, other=0.0).to(tl.float32)
    # The exponentials are taken against mo, the running max where it is finite and 0 where it is still -inf:
    # a tile of -inf logits (classes ruled out) would otherwise give exp(-inf - -inf) = NaN for a row that
    # torch's cross_entropy scores. One scalar select a tile. A NaN logit reaches s through its own exp.
    x = tl.where(cols < V, x, float("-inf"))
    m = tl.max(x, axis=0)
    mo = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - mo), axis=0)
    for start in range(BLOCK_V, V, BLOCK_V):
        c = start + cols
        x = tl.load(z_row + c, mask=c < V_pad, other=0.0).to(tl.float32)
        x = tl.where(c < V, x, float("-inf"))
        m = tl.maximum(m, tl.max(x, axis=0))
        mo_new = tl.where(m == float("-inf"), 0.0, m)
        s = s * tl.exp(mo - mo_new) + tl.sum(tl.exp(x - mo_new), axis=0)
        mo = mo_new
    lse = m + tl.log(s)
    if STORE_LSE:
        tl.store(lse_ptr + row, lse)

    t_safe = tl.where(ignored | bad, 0, t)          # never read outside the row
    z_t = tl.load(z_row + t_safe).to(tl.float32)
    loss = tl.where(ignored, 0.0, lse - z_t)
    loss = tl.where(bad, float("nan"), loss)
    tl.store(loss_ptr + row, loss)

    if WRITE_GRAD:
        scale = tl.load(scale_ptr).to(tl.float32)
        scale = tl.where(ignored, 0.0, scale)
        scale = tl.where(bad, float("nan"), scale)
        # pass 2: the gradient over the whole padded row (the padded columns get exact zeros, since
        # the GEMMs after this read all V_pad columns)
        for start in range(0, V_pad, BLOCK_V):
            c = start + cols
            x = tl.load(z_row + c, mask=c < V_pad, other=0.0).to(tl.float32)
            x = tl.where(c < V, x, float("-inf"))
            g = (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * scale
            tl.store(z_row + c, g.to(z_ptr.dtype.element_ty), mask=c < V_pad)


def ce_rows_(z: torch.Tensor, targets: torch.Tensor, loss_out: torch.Tensor, scale: torch.Tensor, vocab: int,
             ignore_index: int, write_grad: bool = True, block_v: int | None = None,
             num_warps: int | None = None, lse_out: torch.Tensor | None = None) -> None:
    """Per-row cross-entropy of ``z`` [C, V_pad] (row stride any, columns contiguous) against
    ``targets`` [C] (int64) into ``loss_out`` [C] (float32); with ``write_grad``, the gradient of
    ``scale * sum(loss)`` written over ``z`` (``scale``: a 1-element float32 tensor on the device,
    read there, so no host sync). Only the first ``vocab`` columns are classes. ``lse_out`` [C]
    (float32), when given, gets each row's log-sum-exp (the FP8 head's gradient pass reads it)."""
    C, V_pad = z.shape
    if z.stride(1) != 1:
        raise ValueError(f"z: columns must be contiguous (stride 1), got strides {z.stride()}")
    if not (1 <= vocab <= V_pad):
        raise ValueError(f"vocab must be in [1, {V_pad}] (the logits' width), got {vocab}")
    if C == 0:
        return
    block_v = block_v or min(DEFAULT_BLOCK_V, triton.next_power_of_2(V_pad))
    _ce_rows_kernel[(C,)](z, z.stride(0), targets, loss_out, scale, loss_out if lse_out is None else lse_out, vocab,
                          V_pad, ignore_index, WRITE_GRAD=write_grad, STORE_LSE=lse_out is not None,
                          BLOCK_V=block_v, num_warps=num_warps or DEFAULT_WARPS)
