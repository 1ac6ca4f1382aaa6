"""Top-p (nucleus) sampling for the decode step without a sort: the token
``decode.sample_top_p`` draws, from a per-row histogram of order-preserving logit keys.

Loaded from this folder by ``hwlib.ops.sources.load_python_kernel`` (imported by path); the
reference is ``hwlib.workloads.polychromic.decode.sample_top_p``, which sorts B x V float32
probabilities (on an H100 the sort, softmax, cumsum and argmax take ~267 us of a 1,562 us step).

The rule (the reference's):  p = softmax(x / T) in float32; in descending order of p, token t is
kept when the mass before it, fl32(fl32(C_t) - p_t) with C_t the running sum through t, is below
fl32(top_p); the token is argmax over kept i of p_i / E_i (E ~ Exp(1): ``noise``; noise of ones is
greedy), the first index on ties.

Why a histogram suffices: p is monotone in the logit, so the kept set is every token whose logit
key is above a threshold key L*, plus the first k tokens (vocabulary order, as a stable sort puts
ties) whose key is exactly L*. A key is the logit's bits mapped to an unsigned integer of the same
order (negative floats: all bits flipped; others: the sign bit set). All tokens of one key share
one p, so a bin's mass is count x p(key): no per-token sum is needed.

    bf16 / fp16 logits (the decode step's): one level, 65,536 bins of 16-bit keys.
    float32 logits (CPU tests): two levels: 65,536 bins of the keys' top 16 bits (a count, the
        mass as an int64 fixed-point sum of p * 2^60, exact and order-independent, and the bin's
        smallest low half, whose p is the bin's last token's), then, inside the boundary bin only,
        65,536 bins of the low 16 bits (exact values again).

Launches per call (fixed; no host sync; every buffer in ``TopPSampler``, so a CUDA graph can
capture it):
    16-bit: 1 stats+histogram, 2 bin-chunk masses, 3 boundary, 4 draw per chunk (and re-zeroing
            the histogram for the next call), 5 draw per row                            = 5
    float32: 1, + fixed-point mass, 2, 3 (level 1), + level-2 histogram, 2, 3 (level 2), 4, 5 = 9
Kernel 1 computes each chunk's max and sum of exp(x/T - max); later kernels combine them into the
row's max m and Z (float32, as torch.softmax; its summation order differs, so p agrees to ~1e-7
relative, not bit for bit). p_i = exp(x_i / T - m) / Z with IEEE division (``div_rn``) and, when
compiled, libdevice's expf (the interpreter: numpy's exp). Masses are summed in float64 and rounded
to float32 where the reference rounds its cumsum: the boundary is the reference's as computed on
a CPU (torch's CPU cumsum accumulates float32 in double); on a GPU torch's float32 scan rounds
differently, so there the boundary can move by a token where a row's mass is within ~1e-6 of top_p.

Bytes per call at B = 12, V = 151,936, bf16 logits (s = 2), float32 noise:
    logits read twice (kernels 1 and 4): 2 B V s = 7.3 MB; noise once: 4 B V = 7.3 MB;
    histogram: B x 65,536 int32 = 3.1 MB written by atomics (kernel 1, ~B V increments), read
    (kernel 2), zeroed (kernel 4): ~9.4 MB; the rest (per-chunk partials) < 100 kB.
    ~24 MB: ~8 us at 3 TB/s, plus five launches; the atomics of kernel 1 land on a few hundred hot
    bins per row (bf16 logits take ~1-2 thousand distinct values), the likely cost to measure.

Runs on CPU tensors under TRITON_INTERPRET=1 (set before triton is imported).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

NBINS = 65536                 # 16-bit keys: one level for bf16/fp16, two for float32
FIX_SCALE = float(2 ** 60)    # level-1 float32 masses as int64 fixed point: p * 2^60 sums to < 2^63
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BITS_VIEW = {0: torch.int32, 1: torch.int16, 2: torch.int16}


# --- keys and probabilities -------------------------------------------------------------------------

@triton.jit
def _load_logits(x_ptr, offs, mask, KIND: tl.constexpr):
    """(value as float32, order key as int64 >= 0) of the logits at ``offs``; the logits arrive as
    their raw bits (int32 for float32, int16 for bf16/fp16), so no bf16 load is needed (the
    interpreter has none)."""
    raw = tl.load(x_ptr + offs, mask=mask, other=0)
    if KIND == 0:
        bits = raw.to(tl.int64) & 0xFFFFFFFF
        val = raw.to(tl.float32, bitcast=True)
        key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    else:
        bits = raw.to(tl.int64) & 0xFFFF
        if KIND == 1:
            val = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            val = raw.to(tl.float16, bitcast=True).to(tl.float32)
        key = tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
    return val, key


@triton.jit
def _key_value(key, KIND: tl.constexpr):
    """The logit (float32) whose order key is ``key`` (int64): the inverse of ``_load_logits``."""
    if KIND == 0:
        bits = tl.where(key >= 0x80000000, key ^ 0x80000000, key ^ 0xFFFFFFFF)
        val = bits.to(tl.int32).to(tl.float32, bitcast=True)     # int64 -> int32 keeps the low 32 bits
    else:
        bits = tl.where(key >= 0x8000, key ^ 0x8000, key ^ 0xFFFF)
        if KIND == 1:
            val = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            val = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return val


@triton.jit
def _prob(val, temp, m, z, ACCURATE: tl.constexpr):
    """p = exp(x / T - m) / Z in float32 with IEEE divisions, as torch.softmax(x.float() / T)."""
    y = tl.div_rn(val, tl.zeros_like(val) + temp)
    # tl.exp compiles to ex2.approx (a few ulp off torch's expf); libdevice's is expf itself but has
    # no interpreter version. (Inline, here and below: each nested jit call costs the interpreter ~1 ms.)
    if ACCURATE:
        e = libdevice.exp(y - m)
    else:
        e = tl.exp(y - m)
    return tl.div_rn(e, tl.zeros_like(val) + z)


@triton.jit
def _row_stats(pm_ptr, ps_ptr, row, NCH, NCH_P2: tl.constexpr, ACCURATE: tl.constexpr):
    """The row's max m and Z = sum exp(x / T - m) from kernel 1's per-chunk (max, sum); every
    kernel recomputes them the same way (deterministic: the same value everywhere)."""
    c = tl.arange(0, NCH_P2)
    ok = c < NCH
    cm = tl.load(pm_ptr + row * NCH + c, mask=ok, other=float("-inf"))
    cs = tl.load(ps_ptr + row * NCH + c, mask=ok, other=0.0)
    m = tl.max(cm, 0)
    if ACCURATE:
        f = libdevice.exp(cm - m)
    else:
        f = tl.exp(cm - m)
    z = tl.sum(tl.where(ok & (cs > 0), cs * f, 0.0), 0)
    return m, z


# --- kernel 1 (and the float32 passes over the logits) ---------------------------------------------

@triton.jit
def _stats_hist_kernel(x_ptr, stride_x, V, temp, pm_ptr, ps_ptr, hist_ptr, minlow_ptr, NCH,
                       KIND: tl.constexpr, BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    """Per chunk: max and sum exp(x / T - max) (kernel 1's partials), and each token's count in its
    row's histogram of the key's top 16 bits (float32 also: the bin's smallest low 16 bits)."""
    c, row = tl.program_id(0), tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    val, key = _load_logits(x_ptr + row.to(tl.int64) * stride_x, offs, ok, KIND)
    y = tl.where(ok, tl.div_rn(val, tl.zeros_like(val) + temp), float("-inf"))
    cm = tl.max(y, 0)
    if ACCURATE:
        f = libdevice.exp(y - cm)
    else:
        f = tl.exp(y - cm)
    cs = tl.sum(tl.where(ok & (y > float("-inf")), f, 0.0), 0)
    tl.store(pm_ptr + row * NCH + c, cm)
    tl.store(ps_ptr + row * NCH + c, cs)
    hist = hist_ptr + row.to(tl.int64) * 65536
    if KIND == 0:
        tl.atomic_add(hist + (key >> 16), 1, mask=ok)
        tl.atomic_min(minlow_ptr + row.to(tl.int64) * 65536 + (key >> 16), (key & 0xFFFF).to(tl.int32), mask=ok)
    else:
        tl.atomic_add(hist + key, 1, mask=ok)


@triton.jit
def _mass1_kernel(x_ptr, stride_x, V, temp, pm_ptr, ps_ptr, mass_ptr, NCH, NCH_P2: tl.constexpr,
                  BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    """float32 level 1: each token's p, as p * 2^60 in int64, into its top-16-bit bin (integer sums:
    exact and the same in any order)."""
    c, row = tl.program_id(0), tl.program_id(1)
    m, z = _row_stats(pm_ptr, ps_ptr, row, NCH, NCH_P2, ACCURATE)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    val, key = _load_logits(x_ptr + row.to(tl.int64) * stride_x, offs, ok, 0)
    p = _prob(val, temp, m, z, ACCURATE)
    fixed = (p.to(tl.float64) * 1152921504606846976.0).to(tl.int64)          # 2^60
    tl.atomic_add(mass_ptr + row.to(tl.int64) * 65536 + (key >> 16), fixed, mask=ok & (p > 0))


@triton.jit
def _hist2_kernel(x_ptr, stride_x, V, bkey_ptr, hist2_ptr, BLOCK: tl.constexpr):
    """float32 level 2: counts of the low 16 bits of the tokens inside the level-1 boundary bin."""
    c, row = tl.program_id(0), tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    _, key = _load_logits(x_ptr + row.to(tl.int64) * stride_x, offs, ok, 0)
    b1 = tl.load(bkey_ptr + row)
    tl.atomic_add(hist2_ptr + row.to(tl.int64) * 65536 + (key & 0xFFFF), 1, mask=ok & ((key >> 16) == b1))


# --- kernels 2 and 3: the threshold ----------------------------------------------------------------

@triton.jit
def _bin_values(hist_ptr, mass_ptr, minlow_ptr, row, bins, temp, m, z, prefix,
                MODE: tl.constexpr, KIND: tl.constexpr, ACCURATE: tl.constexpr):
    """(count, mass as float64, p of the bin's last token) of ``bins`` (a vector of bin numbers).
    MODE 0: each bin is one logit value, key = prefix * 65536 + bin (prefix 0 for 16-bit keys);
    MODE 1: float32 level 1, the mass from the fixed-point sums, the last token's value from the
    bin's smallest low half."""
    base = row.to(tl.int64) * 65536 + bins
    cnt = tl.load(hist_ptr + base)
    if MODE == 0:
        key = prefix * 65536 + bins.to(tl.int64)
        p = _prob(_key_value(key, KIND), temp, m, z, ACCURATE)
        p = tl.where(cnt > 0, p, 0.0)            # empty bins may be NaN bit patterns
        mass = cnt.to(tl.float64) * p.to(tl.float64)
    else:
        mass = tl.load(mass_ptr + base).to(tl.float64) * (1.0 / 1152921504606846976.0)
        low = tl.load(minlow_ptr + base)
        key = bins.to(tl.int64) * 65536 + low.to(tl.int64)
        p = tl.where(cnt > 0, _prob(_key_value(key, KIND), temp, m, z, ACCURATE), 0.0)
    return cnt, mass, p


@triton.jit
def _bin_mass_kernel(hist_ptr, mass_ptr, minlow_ptr, prev_key_ptr, pm_ptr, ps_ptr, cmass_ptr, cplast_ptr,
                     ccount_ptr, temp, NCH, NBC, NCH_P2: tl.constexpr, BIN_BLOCK: tl.constexpr,
                     MODE: tl.constexpr, LEVEL2: tl.constexpr, KIND: tl.constexpr, ACCURATE: tl.constexpr):
    """Per chunk of BIN_BLOCK bins: the mass, the number of tokens, and the p of the chunk's last
    (lowest) token, for kernel 3 to find the chunk where the kept set ends."""
    c, row = tl.program_id(0), tl.program_id(1)
    m, z = _row_stats(pm_ptr, ps_ptr, row, NCH, NCH_P2, ACCURATE)
    prefix = tl.load(prev_key_ptr + row) if LEVEL2 else 0
    bins = c * BIN_BLOCK + tl.arange(0, BIN_BLOCK)
    cnt, mass, p = _bin_values(hist_ptr, mass_ptr, minlow_ptr, row, bins, temp, m, z, prefix, MODE, KIND, ACCURATE)
    lowest = tl.min(tl.where(cnt > 0, bins, 1 << 20), 0)
    plast = tl.sum(tl.where(bins == lowest, p, 0.0), 0)
    tl.store(cmass_ptr + row * NBC + c, tl.sum(mass, 0))
    tl.store(cplast_ptr + row * NBC + c, plast)
    tl.store(ccount_ptr + row * NBC + c, tl.sum(cnt, 0))


@triton.jit
def _boundary_kernel(hist_ptr, mass_ptr, minlow_ptr, pm_ptr, ps_ptr, cmass_ptr, cplast_ptr, ccount_ptr,
                     prev_key_ptr, prev_mb_ptr, key_out_ptr, k_out_ptr, mb_out_ptr, temp, top_p, NCH, NBC,
                     NCH_P2: tl.constexpr, NBC_P2: tl.constexpr, BIN_BLOCK: tl.constexpr, MODE: tl.constexpr,
                     LEVEL2: tl.constexpr, KIND: tl.constexpr, BISECT: tl.constexpr, ACCURATE: tl.constexpr):
    """One program per row: the bin holding the first dropped token (descending key), the mass
    before it, and how many of its tokens are kept. Writes key -1 when every token is kept.
    Level 1 of float32 (MODE 1) stops at the bin; level 2 continues inside it (LEVEL2)."""
    row = tl.program_id(0)
    m, z = _row_stats(pm_ptr, ps_ptr, row, NCH, NCH_P2, ACCURATE)
    if LEVEL2:
        prefix = tl.load(prev_key_ptr + row)
        base = tl.load(prev_mb_ptr + row)
    else:
        prefix = 0
        base = 0.0
    cc = tl.arange(0, NBC_P2)
    okc = cc < NBC
    cmass = tl.load(cmass_ptr + row * NBC + cc, mask=okc, other=0.0)
    cplast = tl.load(cplast_ptr + row * NBC + cc, mask=okc, other=0.0)
    ccount = tl.load(ccount_ptr + row * NBC + cc, mask=okc, other=0)
    total = tl.sum(cmass, 0)
    above = base + (total - tl.cumsum(cmass, 0))            # mass of the chunks above each chunk
    cend = (above + cmass).to(tl.float32)
    # a chunk not wholly kept: its last token's mass before it reaches top_p (a down-set of chunks)
    cfail = okc & (ccount > 0) & ((cend - cplast) >= top_p)
    cstar = tl.max(tl.where(cfail, cc, -1), 0)
    # top_p = 1 keeps every token; the reference's cumsum may round up to 1 a few ulps early and drop
    # the last tokens (~1e-7 of mass), an artifact that p's last bits decide, not a rule to copy
    some = (cstar >= 0) & (top_p < 1.0)
    cs = tl.maximum(cstar, 0)
    above_cs = tl.sum(tl.where(cc == cs, above, 0.0), 0)
    bins = cs * BIN_BLOCK + tl.arange(0, BIN_BLOCK)
    cnt, mass, p = _bin_values(hist_ptr, mass_ptr, minlow_ptr, row, bins, temp, m, z, prefix, MODE, KIND, ACCURATE)
    mb = above_cs + (tl.sum(mass, 0) - tl.cumsum(mass, 0))   # mass before each bin
    bfail = (cnt > 0) & (((mb + mass).to(tl.float32) - p) >= top_p)
    bstar = tl.max(tl.where(bfail, bins, -1), 0)
    # the chunk test and this one sum in different orders: should they disagree by an ulp of
    # float64, take the chunk's last bin
    bstar = tl.where(bstar >= 0, bstar, tl.min(tl.where(cnt > 0, bins, 1 << 20), 0))
    mb_star = tl.sum(tl.where(bins == bstar, mb, 0.0), 0)
    if MODE == 0:
        c_star = tl.sum(tl.where(bins == bstar, cnt, 0), 0)
        p_star = tl.sum(tl.where(bins == bstar, p, 0.0), 0)
        # kept ranks of the bin: 0..k-1 (monotone rule); the last rank is dropped, find the first
        lo = c_star * 0
        hi = c_star - 1
        for _ in range(BISECT):
            go = lo < hi
            mid = (lo + hi) // 2
            # rank mid kept: the reference's fl32(fl32(C) - p) < fl32(top_p), C = mb + (mid + 1) p
            keep = ((mb_star + (mid + 1).to(tl.float64) * p_star.to(tl.float64)).to(tl.float32) - p_star) < top_p
            lo, hi = tl.where(go & keep, mid + 1, lo), tl.where(go & ~keep, mid, hi)
        k = lo
    else:
        k = 0
    key = prefix * 65536 + bstar.to(tl.int64)
    tl.store(key_out_ptr + row, tl.where(some, key, -1))
    tl.store(k_out_ptr + row, tl.where(some, k, 0).to(tl.int64))
    tl.store(mb_out_ptr + row, mb_star)


# --- kernels 4 and 5: the draw ---------------------------------------------------------------------

@triton.jit
def _draw_chunk_kernel(x_ptr, stride_x, e_ptr, stride_e, V, temp, pm_ptr, ps_ptr, key_ptr, best_s_ptr,
                       best_i_ptr, bnd_s_ptr, bnd_i_ptr, bnd_n_ptr, zero32_ptr, zero64_ptr, reset_ptr, zero2_ptr,
                       NCH, NCH_P2: tl.constexpr, BLOCK: tl.constexpr, ZB: tl.constexpr, KIND: tl.constexpr,
                       ACCURATE: tl.constexpr):
    """Per chunk: the best p / E among tokens above the threshold key, the best among tokens at it
    and their number; then this chunk's share of the histograms set back for the next call."""
    c, row = tl.program_id(0), tl.program_id(1)
    m, z = _row_stats(pm_ptr, ps_ptr, row, NCH, NCH_P2, ACCURATE)
    lkey = tl.load(key_ptr + row)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    val, key = _load_logits(x_ptr + row.to(tl.int64) * stride_x, offs, ok, KIND)
    e = tl.load(e_ptr + row.to(tl.int64) * stride_e + offs, mask=ok, other=1.0)
    s = tl.div_rn(_prob(val, temp, m, z, ACCURATE), e)
    up = ok & (key > lkey)
    at = ok & (key == lkey)
    sa = tl.max(tl.where(up, s, -1.0), 0)
    ia = tl.min(tl.where(up & (s == sa), offs, 2147483647), 0)
    sb = tl.max(tl.where(at, s, -1.0), 0)
    ib = tl.min(tl.where(at & (s == sb), offs, 2147483647), 0)
    i = row * NCH + c
    tl.store(best_s_ptr + i, sa)
    tl.store(best_i_ptr + i, ia)
    tl.store(bnd_s_ptr + i, sb)
    tl.store(bnd_i_ptr + i, ib)
    tl.store(bnd_n_ptr + i, tl.sum(at.to(tl.int32), 0))
    # the histograms are read only by kernels 2 and 3, done by now: zero this chunk's ZB bins
    zb = c * ZB + tl.arange(0, ZB)
    zok = zb < 65536
    h = row.to(tl.int64) * 65536 + zb
    tl.store(zero32_ptr + h, tl.zeros([ZB], tl.int32), mask=zok)
    if KIND == 0:
        tl.store(zero64_ptr + h, tl.zeros([ZB], tl.int64), mask=zok)
        tl.store(reset_ptr + h, tl.full([ZB], 65535, tl.int32), mask=zok)
        tl.store(zero2_ptr + h, tl.zeros([ZB], tl.int32), mask=zok)


@triton.jit
def _draw_row_kernel(x_ptr, stride_x, e_ptr, stride_e, V, temp, pm_ptr, ps_ptr, key_ptr, k_ptr, best_s_ptr,
                     best_i_ptr, bnd_s_ptr, bnd_i_ptr, bnd_n_ptr, out_ptr, NCH, NCH_P2: tl.constexpr,
                     BLOCK: tl.constexpr, KIND: tl.constexpr, ACCURATE: tl.constexpr):
    """One program per row: the winner over the chunks. Of the tokens at the threshold key only the
    first k in vocabulary order are kept: whole chunks of them take their chunk's best; the one
    chunk cut inside is re-read here."""
    row = tl.program_id(0)
    cc = tl.arange(0, NCH_P2)
    okc = cc < NCH
    i = row * NCH + cc
    sa = tl.load(best_s_ptr + i, mask=okc, other=-1.0)
    ia = tl.load(best_i_ptr + i, mask=okc, other=2147483647)
    sb = tl.load(bnd_s_ptr + i, mask=okc, other=-1.0)
    ib = tl.load(bnd_i_ptr + i, mask=okc, other=2147483647)
    n = tl.load(bnd_n_ptr + i, mask=okc, other=0)
    k = tl.load(k_ptr + row).to(tl.int32)
    before = tl.cumsum(n, 0) - n
    mk = tl.minimum(tl.maximum(k - before, 0), n)       # kept tokens at the threshold, per chunk
    whole = (n > 0) & (mk == n)
    # per chunk the better of the two: the higher score, then the lower index
    sb = tl.where(whole, sb, -1.0)
    take = (sb > sa) | ((sb == sa) & (ib < ia))
    s, idx = tl.where(take, sb, sa), tl.where(take, ib, ia)
    best = tl.max(s, 0)
    bi = tl.min(tl.where(s == best, idx, 2147483647), 0)
    # the chunk whose threshold tokens are cut (at most one)
    cut = (mk > 0) & (mk < n)
    has = tl.sum(cut.to(tl.int32), 0) > 0
    q = tl.sum(tl.where(cut, cc, 0), 0)
    mq = tl.sum(tl.where(cut, mk, 0), 0)
    m, z = _row_stats(pm_ptr, ps_ptr, row, NCH, NCH_P2, ACCURATE)
    lkey = tl.load(key_ptr + row)
    offs = q * BLOCK + tl.arange(0, BLOCK)
    ok = offs < tl.where(has, V, 0)          # nothing to read when no chunk is cut
    val, key = _load_logits(x_ptr + row.to(tl.int64) * stride_x, offs, ok, KIND)
    e = tl.load(e_ptr + row.to(tl.int64) * stride_e + offs, mask=ok, other=1.0)
    at = ok & (key == lkey)
    rank = tl.cumsum(at.to(tl.int32), 0) - 1
    kept = at & (rank < mq)
    sq = tl.div_rn(_prob(val, temp, m, z, ACCURATE), e)
    sc = tl.max(tl.where(kept, sq, -1.0), 0)
    ic = tl.min(tl.where(kept & (sq == sc), offs, 2147483647), 0)
    take = (sc > best) | ((sc == best) & (ic < bi))
    bi = tl.where(take, ic, bi)
    tl.store(out_ptr + row, bi.to(tl.int64))


# --- the Python entry ------------------------------------------------------------------------------

def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


class TopPSampler:
    """The workspace of one (batch, vocab, dtype) and its fixed launch sequence: create it once
    (outside a captured graph), then ``sampler(logits, noise, temperature, top_p, out)`` allocates
    nothing, synchronises nothing and launches 5 kernels (bf16/fp16 logits) or 9 (float32).

    ``block``: tokens per program of the passes over the logits; ``bin_block``: bins per program of
    the threshold search (a power of two dividing 65,536). Smaller blocks only for tests."""

    def __init__(self, batch: int, vocab: int, device, dtype: torch.dtype = torch.bfloat16, block: int = 2048,
                 bin_block: int = 1024):
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        if not isinstance(vocab, int) or not 1 <= vocab < 2 ** 31:
            raise ValueError(f"vocab must be a positive int below 2^31, got {vocab!r}")
        if dtype not in KINDS:
            raise ValueError(f"dtype must be one of {sorted(map(str, KINDS))}, got {dtype}")
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        if not 16 <= bin_block <= NBINS or bin_block & (bin_block - 1):
            raise ValueError(f"bin_block must be a power of two in [16, 65536], got {bin_block}")
        from hwlib.ops.sources import triton_interpreted
        self.batch, self.vocab, self.dtype, self.kind = batch, vocab, dtype, KINDS[dtype]
        # the device a tensor reports ("cuda" names cuda:<current>; tensors always say cuda:N)
        self.device = torch.empty(0, device=device).device
        self.block, self.bin_block = block, bin_block
        self.nch, self.nbc = triton.cdiv(vocab, block), NBINS // bin_block
        self.zb = _p2(triton.cdiv(NBINS, self.nch))        # bins each draw program zeroes
        self.accurate = not triton_interpreted()
        self.bisect = max(1, math.ceil(math.log2(vocab + 1)) + 1)
        B, dev = batch, self.device
        z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=dev)   # noqa: E731
        self.hist = z(B, NBINS, dt=torch.int32)
        two = self.kind == 0
        # float32 only; 16-bit logits get 1-element stand-ins (the kernels never touch them)
        self.mass1 = z(B, NBINS, dt=torch.int64) if two else z(1, dt=torch.int64)
        self.minlow = torch.full((B, NBINS) if two else (1,), 65535, dtype=torch.int32, device=dev)
        self.hist2 = z(B, NBINS, dt=torch.int32) if two else z(1, dt=torch.int32)
        self.part_m, self.part_s = z(B, self.nch), z(B, self.nch)
        self.cmass, self.cplast = z(B, self.nbc, dt=torch.float64), z(B, self.nbc)
        self.ccount = z(B, self.nbc, dt=torch.int32)
        self.key = [z(B, dt=torch.int64) for _ in range(2)]      # threshold key per level
        self.k = [z(B, dt=torch.int64) for _ in range(2)]        # kept tokens at the threshold key
        self.mb = [z(B, dt=torch.float64) for _ in range(2)]     # mass before the threshold bin
        self.best_s, self.bnd_s = z(B, self.nch), z(B, self.nch)
        self.best_i, self.bnd_i, self.bnd_n = (z(B, self.nch, dt=torch.int32) for _ in range(3))

    def check(self, logits, noise, temperature, top_p, out) -> None:
        """A ValueError naming the argument unless the call fits this workspace."""
        shape = (self.batch, self.vocab)
        if not isinstance(logits, torch.Tensor) or logits.dtype != self.dtype:
            raise ValueError(f"logits must be a {self.dtype} tensor (this sampler's dtype), got "
                             f"{getattr(logits, 'dtype', type(logits).__name__)}")
        if tuple(logits.shape) != shape or logits.stride(-1) != 1:
            raise ValueError(f"logits must be [{self.batch}, {self.vocab}] with unit stride along the vocabulary, "
                             f"got {tuple(logits.shape)} strides {logits.stride()}")
        if not isinstance(noise, torch.Tensor) or noise.dtype != torch.float32:
            raise ValueError(f"noise must be a float32 tensor, got {getattr(noise, 'dtype', type(noise).__name__)}")
        if tuple(noise.shape) != tuple(logits.shape) or noise.stride(-1) != 1:
            raise ValueError(f"noise must have the logits' shape {tuple(logits.shape)} with unit stride along the "
                             f"vocabulary, got {tuple(noise.shape)} strides {noise.stride()}")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or out.numel() != self.batch \
                or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous int64 tensor of {self.batch} elements, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        for name, t in (("logits", logits), ("noise", noise), ("out", out)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, this sampler's buffers on {self.device}")
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")

    def __call__(self, logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_p: float,
                 out: torch.Tensor) -> torch.Tensor:
        """Writes the next tokens [B] (int64) into ``out`` and returns it."""
        self.check(logits, noise, temperature, top_p, out)
        B, V, kind = self.batch, self.vocab, self.kind
        x = logits.view(_BITS_VIEW[kind])                 # raw bits: the keys come from them
        sx, se = x.stride(0), noise.stride(0)
        T, tp = float(temperature), float(top_p)
        cst = dict(NCH_P2=_p2(self.nch), KIND=kind, ACCURATE=self.accurate)
        grid_tok, grid_bin = (self.nch, B), (self.nbc, B)
        _stats_hist_kernel[grid_tok](x, sx, V, T, self.part_m, self.part_s, self.hist, self.minlow, self.nch,
                                     KIND=kind, BLOCK=self.block, ACCURATE=self.accurate)
        if kind == 0:
            _mass1_kernel[grid_tok](x, sx, V, T, self.part_m, self.part_s, self.mass1, self.nch,
                                    NCH_P2=cst["NCH_P2"], BLOCK=self.block, ACCURATE=self.accurate)
        levels = ((self.hist, 1, False), (self.hist2, 0, True)) if kind == 0 else ((self.hist, 0, False),)
        for lvl, (hist, mode, level2) in enumerate(levels):
            if level2:
                _hist2_kernel[grid_tok](x, sx, V, self.key[0], self.hist2, BLOCK=self.block)
            _bin_mass_kernel[grid_bin](hist, self.mass1, self.minlow, self.key[0], self.part_m, self.part_s,
                                       self.cmass, self.cplast, self.ccount, T, self.nch, self.nbc,
                                       BIN_BLOCK=self.bin_block, MODE=mode, LEVEL2=level2, **cst)
            _boundary_kernel[(B,)](hist, self.mass1, self.minlow, self.part_m, self.part_s, self.cmass,
                                   self.cplast, self.ccount, self.key[0], self.mb[0], self.key[lvl], self.k[lvl],
                                   self.mb[lvl], T, tp, self.nch, self.nbc, NBC_P2=_p2(self.nbc),
                                   BIN_BLOCK=self.bin_block, MODE=mode, LEVEL2=level2, BISECT=self.bisect, **cst)
        last = len(levels) - 1
        _draw_chunk_kernel[grid_tok](x, sx, noise, se, V, T, self.part_m, self.part_s, self.key[last], self.best_s,
                                     self.best_i, self.bnd_s, self.bnd_i, self.bnd_n, self.hist, self.mass1,
                                     self.minlow, self.hist2, self.nch, BLOCK=self.block, ZB=self.zb, **cst)
        _draw_row_kernel[(B,)](x, sx, noise, se, V, T, self.part_m, self.part_s, self.key[last], self.k[last],
                               self.best_s, self.best_i, self.bnd_s, self.bnd_i, self.bnd_n, out.view(-1), self.nch,
                               BLOCK=self.block, **cst)
        return out

    def threshold(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After a call: per row the threshold key L* (-1: every token kept) and the number k of
        tokens at L* kept (the first k in vocabulary order); every token with a key above L* is
        kept. Keys as ``order_keys`` gives them."""
        last = 1 if self.kind == 0 else 0
        return self.key[last].clone(), self.k[last].clone()


def order_keys(logits: torch.Tensor) -> torch.Tensor:
    """The int64 order key of each logit, as the kernels compute it (for tests and threshold
    checks): larger logit, larger key."""
    kind = KINDS[logits.dtype]
    if kind == 0:
        bits = logits.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    bits = logits.view(torch.int16).to(torch.int64) & 0xFFFF
    return torch.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)
