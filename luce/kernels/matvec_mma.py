"""Q4_K and Q6_K matrix-vector products on tensor cores for 1-32 activation rows:
y[t] = W x[t].

Why: the FMA matvec (matvec_fast) spends ~4.6 instructions a weight and row and reaches
42-48% of copy bandwidth on the H200 with no single unit saturated; the small-M matmul
that verification widths take stages dequantized tiles in shared memory and reads each
weight at ~0.7 TB/s for 23 rows (8B gated FFN: 80 us against 27 us for one row,
ca39022). Here the weights go from global memory straight into `mma.sync` A fragments:

- a warp owns one or two tiles of 16 output rows (A's rows) and walks a share of the
  blocks along K; x^T is B (16 columns x 8 rows of x a fragment, NT fragments for up to
  8 NT rows), shared by the tiles;
- K is permuted inside every 16-column mma step so that lane 4r + c brings 4 consecutive
  columns for rows r and r + 8: one 32-bit word of quants a row (the low or high nibbles
  of 4 consecutive bytes; Q4_K: bytes 8c + 4a of a 32-byte chunk in step a), paired as
  bytes 0, 2 and 1, 3 (they already sit in the two f16 halves), and for x the same 4
  columns of row r of x, paired the same way. A and B use the same permutation, so the
  products are the same;
- a step's 16 columns lie in one 32-column sub-block, so the quants enter the mma as exact
  small integers (nibble | 0x6400 is 1024 + q in f16; minus 1024, exact) and the
  sub-block's scale and min are applied to the f32 result: y += d sc (sum q x) - dmin m
  (sum x), with the sums of x over each sub-block made once per call (x_sums);
- x enters as f16 hi + lo pairs (two mma), so the products keep ~22 bits of x: results
  agree with the f64 reference to ~3e-8 of sum |w| |x| (simulator);
- Q6_K the same way: a step is one of its 16-column sub-blocks, a lane's quants are one
  word of low nibbles and one of high bits (its 210-byte blocks are only 2-byte aligned,
  so words come from two 16-bit loads), q - 32 enters exactly, the int8 scale after;
- the warps of a block split K and add their partial tiles in shared memory.
Weight traffic is W once for all rows; instructions per weight and lane: ~1 for the
quants and, per 16-column step, one 16-byte x load and two mma per 8 rows of x.

Measured on the H200 (1576771, 9c10a00; docs/benchmarks.md, fifth session): correct (the
25 GPU tests pass at Qwen3-8B's FFN shapes) but slower than what the backend runs, so the
backend routes nothing to it by default (luce.backends.cuda.MATVEC_MMA_ROWS). Q4_K
4096 -> 12288: 32.6 us for 1-8 rows (matvec_fast: 15.3 us for one; the small-M matmul:
36.1 us for 8), 60.3 us for 23 rows (matmul 38.4 us); 12288 -> 4096: 60.5 us for one row.
Nsight Compute (one row, 12288 x 4096): 0.24 warp instructions a weight (12.0 M), issue
slots 48% busy with 2.6 warps a scheduler (124 registers: 25% occupancy), DRAM 23%: it is
bound by its instruction count and latency, not by memory. What it would take: far fewer
instructions a weight (the per-step quant unpacking and 64-bit address arithmetic) and more
bytes in flight a warp (a whole block's weight loads issued ahead of its mma steps).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .dequant import SIM, T, as_qtype, weight_u16
from .device import device
from .matvec_fast import F_MAGIC, MAGIC, fmm, k4_scales
from .mma import SCRATCH, f32x2_to_f16x2, hsub2, mma_f16
from .vector_load import f16_bits_to_f32, ldg_u16_u32x2, ldg_u16_u32x4

__all__ = ["MMA_TYPES", "MAX_ROWS", "matvec_mma", "x_halves"]

MMA_TYPES = frozenset({T.Q4_K, T.Q6_K})
MAX_ROWS = 32  # rows of x: four B fragments of 8
WARPS = 4  # a block's warps splitting K (plan() doubles it for short outputs)
QK = 256  # columns a Q4_K block
U = np.uint32
ONES = U(0x64006400)  # f16x2 (1024, 1024)
LOW4 = U(0x000F000F)


@device(inline=True)
def _quants(word, odd, high):
    """Two quants of `word` as an exact f16x2 A-fragment word: bytes 0 and 2 (odd=0) or 1
    and 3 (odd=1), their low nibbles as q or (high) their high nibbles as 16 q, which the
    sub-block's scale divides out again. Bytes 0 and 2 already sit in the two f16 halves,
    so a mask and an or make 1024 + q (1024 + 16 q), and subtracting 1024 leaves q (16 q)."""
    v = U(word >> U(8)) if odd else word
    v = U(v & (U(0x00F000F0) if high else LOW4)) | ONES
    return hsub2(v, ONES)


@device(inline=True)
def _pair_scales(h0, s0, s1, s2, j):
    """(d sc, dmin m) of sub-blocks 2j and 2j + 1 of a Q4_K block (header word h0 = d |
    dmin, scale words s0..s2; the bytes come from matvec_fast's k4_scales), the second
    scale over 16 (its quants enter as 16 q)."""
    d = f16_bits_to_f32(h0 & U(0xFFFF))
    dm = f16_bits_to_f32(h0 >> U(16))
    scl, sch, mnl, mnh = k4_scales(s0, s1, s2, j)  # sch, mnh: 256 times the byte
    return d * scl, d * sch * np.float32(1.0 / 4096), dm * mnl, dm * mnh * np.float32(1.0 / 256)


@device(inline=True)
def _u32_at(w, i):
    """A 32-bit word from two uint16 (Q6_K's 210-byte blocks are only 2-byte aligned)."""
    return U(w[i]) | U(U(w[i + 1]) << U(16))


@device(inline=True)
def _quants6(lw, hw, odd, g):
    """Two Q6_K quants as an exact f16x2 of q - 32: bytes 0 and 2 (odd=0) or 1 and 3 of the
    ql word lw (nibble g >> 1: the low 4 bits) and of the qh word hw (bits 2g, 2g + 1)."""
    if odd:
        lw = U(lw >> U(8))
        hw = U(hw >> U(8))
    nib = U(lw >> U(4 * (g >> 1))) & LOW4
    hb = U(U(U(hw >> U(2 * g)) & U(0x00030003)) << U(4))
    return hsub2(U(nib | hb | ONES), U(0x64206420))  # 1024 + q - (1024 + 32)


@functools.lru_cache(maxsize=None)
def _kernel(qtype, nt: int, tiles: int, warps: int):
    """The kernel for `qtype` weights, nt B fragments (8 nt rows of x), `tiles` 16-row tiles
    a warp (they share each x fragment) and `warps` warps a block splitting K."""
    NT = nt
    TL = tiles
    W = warps
    NACC = 4 * NT * TL
    SCR = (W, 32, SCRATCH) if SIM else (1,)
    RED = (W, 32, NACC)
    ROWS = 16 * TL
    R2 = 2 * TL  # weight rows a lane reads; array shapes must be plain constants

    @device(inline=True)
    def step(grp, k, xq, scr, wid, lane, cf, ab):
        """One 16-column mma step for every tile (A fragments in ab) and x fragment: x's
        columns 4 grp .. + 3 of this lane's rows, as (hi 02, hi 13, lo 02, lo 13) in one
        16-byte load, hi and lo each an mma into cf."""
        r = lane >> 2
        for f in range(NT):
            bh0, bh1, bl0, bl1 = ldg_u16_u32x4(xq, ((f * 8 + r) * (k >> 2) + grp) * 8)
            for tl in range(TL):
                e = 4 * (f * TL + tl)
                cf[e], cf[e + 1], cf[e + 2], cf[e + 3] = mma_f16(
                    scr, wid, lane, ab[tl, 0], ab[tl, 1], ab[tl, 2], ab[tl, 3], bh0, bh1,
                    cf[e], cf[e + 1], cf[e + 2], cf[e + 3])
                cf[e], cf[e + 1], cf[e + 2], cf[e + 3] = mma_f16(
                    scr, wid, lane, ab[tl, 0], ab[tl, 1], ab[tl, 2], ab[tl, 3], bl0, bl1,
                    cf[e], cf[e + 1], cf[e + 2], cf[e + 3])

    @device(inline=True)
    def sub_block4(hi, j, b, k, live, qw, sc, xq, xs, scr, wid, lane, cf, acc, ab):
        """Q4_K sub-block 2j + hi of block b: two steps, then the scales and mins on the
        f32 sums."""
        c = lane & 3
        for e in range(NACC):
            cf[e] = 0.0
        for a in range(2):
            for tl in range(TL):
                ab[tl, 0] = _quants(qw[2 * tl, a], 0, hi)
                ab[tl, 1] = _quants(qw[2 * tl + 1, a], 0, hi)
                ab[tl, 2] = _quants(qw[2 * tl, a], 1, hi)
                ab[tl, 3] = _quants(qw[2 * tl + 1, a], 1, hi)
            # the step's columns of this lane: b QK + 64j + 32hi + 8c + 4a .. + 3
            step((b * QK + 64 * j + 32 * hi + 8 * c + 4 * a) >> 2, k, xq, scr, wid, lane, cf, ab)
        # this lane's sums: rows r (e, e + 1) and r + 8 (e + 2, e + 3) of each tile, for
        # rows of x 8f + 2c and 8f + 2c + 1
        for f in range(NT):
            xs0 = live * xs[f * 8 + 2 * c, b * 8 + 2 * j + hi]
            xs1 = live * xs[f * 8 + 2 * c + 1, b * 8 + 2 * j + hi]
            for tl in range(TL):
                e = 4 * (f * TL + tl)
                ds0 = live * sc[2 * tl, hi]
                ds1 = live * sc[2 * tl + 1, hi]
                dm0 = sc[2 * tl, 2 + hi]
                dm1 = sc[2 * tl + 1, 2 + hi]
                acc[e] += ds0 * cf[e] - dm0 * xs0
                acc[e + 1] += ds0 * cf[e + 1] - dm0 * xs1
                acc[e + 2] += ds1 * cf[e + 2] - dm1 * xs0
                acc[e + 3] += ds1 * cf[e + 3] - dm1 * xs1

    @device(inline=True)
    def block_q4_k(w, rows, nb, b, k, live, xq, xs, scr, wid, lane, cf, acc, ab, hd, qw, sc):
        c = lane & 3
        for i in range(R2):
            hd[i, 0], hd[i, 1], hd[i, 2], hd[i, 3] = ldg_u16_u32x4(w, (rows[i] * nb + b) * 72)
        for j in range(4):
            # qs bytes 32j + 8c .. + 7 of each row: the low nibbles are sub-block 2j, the
            # high ones 2j + 1; word a holds the step-a columns of both
            for i in range(R2):
                qw[i, 0], qw[i, 1] = ldg_u16_u32x2(w, (rows[i] * nb + b) * 72 + 8 + 16 * j + 4 * c)
                sc[i, 0], sc[i, 1], sc[i, 2], sc[i, 3] = _pair_scales(hd[i, 0], hd[i, 1], hd[i, 2], hd[i, 3], j)
            sub_block4(0, j, b, k, live, qw, sc, xq, xs, scr, wid, lane, cf, acc, ab)
            sub_block4(1, j, b, k, live, qw, sc, xq, xs, scr, wid, lane, cf, acc, ab)

    @device(inline=True)
    def block_q6_k(w, rows, nb, b, k, live, xq, xs, scr, wid, lane, cf, acc, ab, hd, qw, sc):
        # Q6_K: ql[128] qh[64] scales[16] (int8) d. Column 128n + 32g + l: nibble g >> 1 of
        # ql byte 64n + 32(g & 1) + l, bits 2g of qh byte 32n + l; sub-block (16 columns)
        # 8n + 2g + l // 16. A step is one sub-block: lane c takes l = 16 half + 4c .. + 3.
        c = lane & 3
        for i in range(R2):
            sc[i, 0] = f16_bits_to_f32(U(w[(rows[i] * nb + b) * 105 + 104])) * live  # d
        for n in range(2):
            for half in range(2):
                for i in range(R2):
                    base = (rows[i] * nb + b) * 105
                    qw[i, 0] = _u32_at(w, base + 32 * n + 8 * half + 2 * c)  # ql, g even
                    qw[i, 1] = _u32_at(w, base + 32 * n + 16 + 8 * half + 2 * c)  # ql, g odd
                    qw[i, 2] = _u32_at(w, base + 64 + 16 * n + 8 * half + 2 * c)  # qh
                for g in range(4):
                    for e in range(NACC):
                        cf[e] = 0.0
                    for tl in range(TL):
                        ab[tl, 0] = _quants6(qw[2 * tl, g & 1], qw[2 * tl, 2], 0, g)
                        ab[tl, 1] = _quants6(qw[2 * tl + 1, g & 1], qw[2 * tl + 1, 2], 0, g)
                        ab[tl, 2] = _quants6(qw[2 * tl, g & 1], qw[2 * tl, 2], 1, g)
                        ab[tl, 3] = _quants6(qw[2 * tl + 1, g & 1], qw[2 * tl + 1, 2], 1, g)
                    step((b * QK + 128 * n + 32 * g + 16 * half + 4 * c) >> 2, k, xq, scr, wid, lane, cf, ab)
                    sb = 8 * n + 2 * g + half
                    for i in range(R2):  # the sub-block's int8 scale (byte ^ 0x80 is it + 128) times d
                        v = U(U(w[(rows[i] * nb + b) * 105 + 96 + (sb >> 1)]) >> U(8 * (sb & 1))) ^ U(0x80)
                        sc[i, 1] = sc[i, 0] * fmm(U(v | MAGIC), 0xFF, F_MAGIC + np.float32(128.0))
                    for f in range(NT):
                        for tl in range(TL):
                            e = 4 * (f * TL + tl)
                            acc[e] += sc[2 * tl, 1] * cf[e]
                            acc[e + 1] += sc[2 * tl, 1] * cf[e + 1]
                            acc[e + 2] += sc[2 * tl + 1, 1] * cf[e + 2]
                            acc[e + 3] += sc[2 * tl + 1, 1] * cf[e + 3]

    block = block_q4_k if qtype == T.Q4_K else block_q6_k
    # the launch bound keeps registers within what 32 W threads allow: without it, 16 warps
    # of the 23-row two-tile kernel asked for more and the launch failed (H200)
    jit = cuda.jit if SIM else cuda.jit(launch_bounds=32 * W)

    @jit
    def kernel(w, xq, xs, n_out, k, n_x, bias, res, has_bias, has_res, out):
        tid = cuda.threadIdx.x
        wid = tid // 32
        lane = tid % 32
        r = lane >> 2
        nb = k // QK
        scr = cuda.shared.array(SCR, np.uint32)
        red = cuda.shared.array(RED, np.float32)
        acc = cuda.local.array(NACC, np.float32)
        cf = cuda.local.array(NACC, np.float32)
        rows = cuda.local.array(R2, np.int64)  # this lane's weight rows: r, r + 8 of each tile
        hd = cuda.local.array((R2, 4), np.uint32)  # Q4_K: their blocks' headers (d | dmin, scales)
        qw = cuda.local.array((R2, 4), np.uint32)  # their quant words of the current chunk
        sc = cuda.local.array((R2, 4), np.float32)  # scales (and Q4_K's mins) of the chunk
        ab = cuda.local.array((TL, 4), np.uint32)  # A fragments of a step
        for e in range(NACC):
            acc[e] = 0.0
        for i in range(R2):  # rows past the end: computed, never stored
            rows[i] = min(cuda.blockIdx.x * ROWS + 16 * (i >> 1) + r + 8 * (i & 1), n_out - 1)
        trips = (nb + W - 1) // W  # the same for every warp (the simulator's mma has barriers)
        for it in range(trips):
            b = wid + it * W
            live = np.float32(1.0) if b < nb else np.float32(0.0)
            b = min(b, nb - 1)
            block(w, rows, nb, b, k, live, xq, xs, scr, wid, lane, cf, acc, ab, hd, qw, sc)
        for e in range(NACC):
            red[wid, lane, e] = acc[e]
        cuda.syncthreads()
        # the block's warps' partial sums, one output each a thread
        for o in range(tid, 32 * NACC, 32 * W):
            ln = o % 32
            e = o // 32
            v = red[0, ln, e]
            for ww in range(1, W):
                v += red[ww, ln, e]
            e4 = e % 4
            ft = e // 4
            t = (ft // TL) * 8 + 2 * (ln & 3) + (e4 & 1)
            n = cuda.blockIdx.x * ROWS + 16 * (ft % TL) + (ln >> 2) + 8 * (e4 >> 1)
            if t < n_x and n < n_out:
                if has_bias:
                    v += bias[n]
                if has_res:  # may be out itself (the residual stream, in place)
                    v += res[t, n]
                out[t, n] = v

    return kernel


@cuda.jit
def _halves_kernel(x, n_x, xq, xs):
    # one thread per (row of x, 32-column sub-block): each group of 4 columns as f16 words
    # (hi 02, hi 13, lo 02, lo 13) with lo = x - hi (the pairs the A fragments hold), and
    # the sub-block's f32 sum; rows from n_x up to the fragments' 8 are zeros
    g = cuda.grid(1)
    n_sub = xs.shape[1]
    if g >= xs.shape[0] * n_sub:
        return
    t = g // n_sub
    s = g - t * n_sub
    tot = np.float32(0.0)
    for q in range(8):
        col = s * 32 + 4 * q
        v = cuda.local.array(4, np.float32)
        for i in range(4):
            v[i] = x[t, col + i] if t < n_x else np.float32(0.0)
            tot += v[i]
        h02 = f32x2_to_f16x2(v[0], v[2])
        h13 = f32x2_to_f16x2(v[1], v[3])
        l02 = f32x2_to_f16x2(v[0] - f16_bits_to_f32(h02 & U(0xFFFF)), v[2] - f16_bits_to_f32(h02 >> U(16)))
        l13 = f32x2_to_f16x2(v[1] - f16_bits_to_f32(h13 & U(0xFFFF)), v[3] - f16_bits_to_f32(h13 >> U(16)))
        grp = col >> 2
        xq[t, grp, 0] = h02
        xq[t, grp, 1] = h13
        xq[t, grp, 2] = l02
        xq[t, grp, 3] = l13
    xs[t, s] = tot


_SCRATCH: dict = {}  # (rows8, K) -> (xq, xs): fixed addresses, so captured graphs stay valid


def x_halves(x_dev, stream=0):
    """(x as flat uint16: per row, per 4 columns the f16 words hi 02, hi 13, lo 02, lo 13;
    the sums of x over 32-column sub-blocks [rows8, K/32]) for the kernel, rows padded to a
    multiple of 8 with zeros. The buffers are kept per shape and reused by every call (one
    stream orders the calls)."""
    n_x, k = x_dev.shape
    rows8 = -(-n_x // 8) * 8
    if (rows8, k) not in _SCRATCH:
        _SCRATCH[(rows8, k)] = (cuda.device_array((rows8, k // 4, 4), np.uint32),
                                cuda.device_array((rows8, k // 32), np.float32))
    xq, xs = _SCRATCH[(rows8, k)]
    n = rows8 * (k // 32)
    threads = 32 if SIM else 128
    _halves_kernel[-(-n // threads), threads, stream](x_dev, n_x, xq, xs)
    return xq.reshape(xq.size).view(np.uint16), xs


def plan(n_x: int, n_out: int, k: int) -> tuple[int, int]:
    """(tiles a warp, warps a block): two tiles share each x fragment where the grid still
    fills the GPU (about 8 warps an SM) and registers allow (up to 24 rows of x: with 32,
    sm_90 code spills), else one; 8 warps split K for short outputs."""
    tiles = 2 if -(-n_out // 32) * WARPS >= 8 * 132 and n_x <= 24 else 1
    warps = WARPS if -(-n_out // (16 * tiles)) * WARPS >= 4 * 132 else 2 * WARPS
    return tiles, min(warps, max(1, k // QK))


def matvec_mma(w_dev, qtype, x_dev, n_out: int, out=None, bias=None, residual=None, stream=0, tiles=None,
               warps=None):
    """y [n_x, n_out] = x [n_x, K] @ W^T (+ bias) (+ residual) for a Q4_K weight (raw uint8
    rows) and 1..MAX_ROWS rows of x (float32, on the device); residual may be out itself.
    Same semantics as matvec_ref. tiles, warps: see plan (its choice by default)."""
    qtype = as_qtype(qtype)
    if qtype not in MMA_TYPES:
        raise ValueError(f"matvec_mma: {qtype.name} weights are not supported (Q4_K and Q6_K only)")
    n_x, k = x_dev.shape
    if not 1 <= n_x <= MAX_ROWS or k % QK:
        raise ValueError(f"matvec_mma: x of {n_x} rows x {k} (1..{MAX_ROWS} rows, K a multiple of {QK})")
    w16, _ = weight_u16(w_dev, qtype, k)
    xq, xs = x_halves(x_dev, stream)
    if out is None:
        out = cuda.device_array((n_x, n_out), np.float32, stream=stream)
    pt, pw = plan(n_x, n_out, k)
    tiles, warps = tiles or pt, warps or pw
    # absent epilogues: never read, but numba needs arrays of the right kinds
    b = bias if bias is not None else out.reshape(out.size)
    r = residual if residual is not None else out
    _kernel(qtype, -(-n_x // 8), tiles, warps)[-(-n_out // (16 * tiles)), 32 * warps, stream](
        w16, xq, xs, n_out, k, n_x, b, r, int(bias is not None), int(residual is not None), out)
    return out
