"""Q4_K matrix-vector products on tensor cores for 1-32 activation rows: y[t] = W x[t].

Why: the FMA matvec (matvec_fast) spends ~4.6 instructions a weight and row and reaches
42-48% of copy bandwidth on the H200 with no single unit saturated; the small-M matmul
that verification widths take stages dequantized tiles in shared memory and reads each
weight at ~0.7 TB/s for 23 rows (8B gated FFN: 80 us against 27 us for one row,
ca39022). Here the weights go from global memory straight into `mma.sync` A fragments:

- a warp owns 16 output rows (A's rows) and walks a share of the Q4_K blocks along K; x^T
  is B (16 columns x 8 rows of x a fragment, NT fragments for up to 8 NT rows);
- K is permuted inside every 16-column mma step so that lane 4r + c brings the 4
  consecutive columns 4c..4c+3 of the step, for rows r and r + 8: that is one 32-bit word
  of Q4_K quants a row (the low or high nibbles of 4 consecutive bytes), and for x the same
  4 columns of row r of x. A and B use the same permutation, so the products are the same;
- a step's 16 columns lie in one 32-column sub-block, so the quants enter the mma as exact
  small integers (nibble | 0x6400 is 1024 + q in f16; minus 1024, exact) and the
  sub-block's scale and min are applied to the f32 result: y += d sc (sum q x) - dmin m
  (sum x), with the sums of x over each sub-block made once per call (x_sums);
- x enters as f16 hi + lo pairs (two mma), so the products keep ~22 bits of x: results
  agree with the f32 reference to ~1e-6 of sum |w| |x|;
- the warps of a block split K and add their partial tiles in shared memory.
Weight traffic is W once for all rows; instructions per weight and lane: ~1 for the
quants and, per 16-column step, two 32-bit x loads and two mma per 8 rows of x.

Not yet routed by the CUDA backend and not yet timed on a GPU (written 2026-11-30 without
GPU time left): `luce bench --kernels` and the GPU tests decide whether it replaces the
matvec for decode and the small-M matmul for verification.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .dequant import SIM, T, as_qtype, weight_u16
from .device import device
from .mma import SCRATCH, f32x2_to_f16x2, hsub2, mma_f16, prmt
from .vector_load import f16_bits_to_f32, ldg_u16_u32

__all__ = ["MMA_TYPES", "MAX_ROWS", "matvec_mma", "x_halves"]

MMA_TYPES = frozenset({T.Q4_K})
MAX_ROWS = 32  # rows of x: four B fragments of 8
WARPS = 4  # a block: 16 output rows, K split four ways
QK = 256  # columns a Q4_K block
BLOCK_U16 = 72  # its 144 bytes as uint16
U = np.uint32
ONES = U(0x64006400)  # f16x2 (1024, 1024)
LOW4 = U(0x000F000F)


@device(inline=True)
def _quants(word, sel, high):
    """Two quants of `word` as an exact f16x2: bytes picked by prmt selector `sel` (0x4140:
    bytes 0 and 1, 0x4342: bytes 2 and 3), their low or (high) high nibbles."""
    p = prmt(word, U(0), U(sel))
    if high:
        p = U(p >> U(4))
    return hsub2(U(U(p & LOW4) | ONES), ONES)


@device(inline=True)
def _byte(s0, s1, s2, k):
    """Byte k (0..11) of the Q4_K scales, whose words are s0, s1, s2."""
    w = s0 if k < 4 else (s1 if k < 8 else s2)
    return U(w >> U(8 * (k & 3))) & U(0xFF)


@device(inline=True)
def _scale_min(h0, s0, s1, s2, i):
    """(d * scale, dmin * min) of sub-block i of a Q4_K block (header word h0 = d | dmin)."""
    if i < 4:
        sc = _byte(s0, s1, s2, i) & U(63)
        mn = _byte(s0, s1, s2, i + 4) & U(63)
    else:
        sc = (_byte(s0, s1, s2, i + 4) & U(0xF)) | ((_byte(s0, s1, s2, i - 4) >> U(6)) << U(4))
        mn = (_byte(s0, s1, s2, i + 4) >> U(4)) | ((_byte(s0, s1, s2, i) >> U(6)) << U(4))
    d = f16_bits_to_f32(h0 & U(0xFFFF))
    dm = f16_bits_to_f32(h0 >> U(16))
    return d * np.float32(sc), dm * np.float32(mn)


@functools.lru_cache(maxsize=None)
def _kernel(nt: int):
    """The kernel for nt B fragments (8 nt rows of x)."""
    NT = nt
    NACC = 4 * NT
    SCR = (WARPS, 32, SCRATCH) if SIM else (1,)
    RED = (WARPS, 32, NACC)

    @cuda.jit
    def kernel(w, xh, xl, xs, n_out, k, n_x, out):
        tile = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        wid = tid // 32
        lane = tid % 32
        r = lane >> 2
        c = lane & 3
        nb = k // QK
        scr = cuda.shared.array(SCR, np.uint32)
        red = cuda.shared.array(RED, np.float32)
        acc = cuda.local.array(NACC, np.float32)
        cf = cuda.local.array(NACC, np.float32)
        for e in range(NACC):
            acc[e] = 0.0
        n0 = min(tile * 16 + r, n_out - 1)  # rows past the end: computed, never stored
        n1 = min(tile * 16 + r + 8, n_out - 1)
        trips = (nb + WARPS - 1) // WARPS  # the same for every warp (the simulator's mma has barriers)
        for it in range(trips):
            b = wid + it * WARPS
            live = np.float32(1.0) if b < nb else np.float32(0.0)
            b = min(b, nb - 1)
            base0 = (n0 * nb + b) * BLOCK_U16
            base1 = (n1 * nb + b) * BLOCK_U16
            h0 = ldg_u16_u32(w, base0)
            h1 = ldg_u16_u32(w, base1)
            s00 = ldg_u16_u32(w, base0 + 2)
            s01 = ldg_u16_u32(w, base0 + 4)
            s02 = ldg_u16_u32(w, base0 + 6)
            s10 = ldg_u16_u32(w, base1 + 2)
            s11 = ldg_u16_u32(w, base1 + 4)
            s12 = ldg_u16_u32(w, base1 + 6)
            for j in range(4):
                # qs bytes 32j + 4c (first 16 columns of both sub-blocks) and 32j + 16 + 4c
                wa0 = ldg_u16_u32(w, base0 + 8 + 16 * j + 2 * c)
                wb0 = ldg_u16_u32(w, base0 + 16 + 16 * j + 2 * c)
                wa1 = ldg_u16_u32(w, base1 + 8 + 16 * j + 2 * c)
                wb1 = ldg_u16_u32(w, base1 + 16 + 16 * j + 2 * c)
                for hi in range(2):  # sub-block 2j + hi: the low, then the high nibbles
                    for e in range(NACC):
                        cf[e] = 0.0
                    for a in range(2):
                        q0 = wa0 if a == 0 else wb0
                        q1 = wa1 if a == 0 else wb1
                        a0 = _quants(q0, 0x4140, hi)
                        a2 = _quants(q0, 0x4342, hi)
                        a1 = _quants(q1, 0x4140, hi)
                        a3 = _quants(q1, 0x4342, hi)
                        col = b * QK + 64 * j + 32 * hi + 16 * a + 4 * c
                        for f in range(NT):
                            xi = (f * 8 + r) * k + col
                            bh0 = ldg_u16_u32(xh, xi)
                            bh1 = ldg_u16_u32(xh, xi + 2)
                            bl0 = ldg_u16_u32(xl, xi)
                            bl1 = ldg_u16_u32(xl, xi + 2)
                            e = 4 * f
                            cf[e], cf[e + 1], cf[e + 2], cf[e + 3] = mma_f16(
                                scr, wid, lane, a0, a1, a2, a3, bh0, bh1, cf[e], cf[e + 1], cf[e + 2], cf[e + 3])
                            cf[e], cf[e + 1], cf[e + 2], cf[e + 3] = mma_f16(
                                scr, wid, lane, a0, a1, a2, a3, bl0, bl1, cf[e], cf[e + 1], cf[e + 2], cf[e + 3])
                    # this lane's results: rows n0 (e, e + 1) and n1 (e + 2, e + 3) for rows of x
                    # 8f + 2c and 8f + 2c + 1
                    sb = b * 8 + 2 * j + hi
                    ds0, dm0 = _scale_min(h0, s00, s01, s02, 2 * j + hi)
                    ds1, dm1 = _scale_min(h1, s10, s11, s12, 2 * j + hi)
                    for f in range(NT):
                        e = 4 * f
                        xs0 = xs[f * 8 + 2 * c, sb]
                        xs1 = xs[f * 8 + 2 * c + 1, sb]
                        acc[e] += live * (ds0 * cf[e] - dm0 * xs0)
                        acc[e + 1] += live * (ds0 * cf[e + 1] - dm0 * xs1)
                        acc[e + 2] += live * (ds1 * cf[e + 2] - dm1 * xs0)
                        acc[e + 3] += live * (ds1 * cf[e + 3] - dm1 * xs1)
        for e in range(NACC):
            red[wid, lane, e] = acc[e]
        cuda.syncthreads()
        if wid == 0:
            for f in range(NT):
                for e4 in range(4):
                    e = 4 * f + e4
                    v = red[0, lane, e]
                    for ww in range(1, WARPS):
                        v += red[ww, lane, e]
                    t = f * 8 + 2 * c + (e4 & 1)
                    n = tile * 16 + r + 8 * (e4 >> 1)
                    if t < n_x and n < n_out:
                        out[t, n] = v

    return kernel


@cuda.jit
def _halves_kernel(x, n_x, xh, xl, xs):
    # one thread per (row of x, 32-column sub-block): f16 hi + lo of each element, and the
    # sub-block's f32 sum; rows from n_x up to the fragments' 8 are zeros
    g = cuda.grid(1)
    n_sub = xs.shape[1]
    if g >= xs.shape[0] * n_sub:
        return
    t = g // n_sub
    s = g - t * n_sub
    tot = np.float32(0.0)
    for i in range(32):
        col = s * 32 + i
        v = x[t, col] if t < n_x else np.float32(0.0)
        h = f32x2_to_f16x2(v, np.float32(0.0)) & U(0xFFFF)
        xh[t, col] = h
        xl[t, col] = f32x2_to_f16x2(v - f16_bits_to_f32(h), np.float32(0.0)) & U(0xFFFF)
        tot += v
    xs[t, s] = tot


def x_halves(x_dev, stream=0):
    """(x hi, x lo as flat uint16 views, x sums [rows8, K/32]) of x [n_x, K] for the kernel,
    rows padded to a multiple of 8."""
    n_x, k = x_dev.shape
    rows8 = -(-n_x // 8) * 8
    xh = cuda.device_array((rows8, k), np.uint16, stream=stream)
    xl = cuda.device_array((rows8, k), np.uint16, stream=stream)
    xs = cuda.device_array((rows8, k // 32), np.float32, stream=stream)
    n = rows8 * (k // 32)
    threads = 32 if SIM else 128
    _halves_kernel[-(-n // threads), threads, stream](x_dev, n_x, xh, xl, xs)
    return xh.reshape(xh.size), xl.reshape(xl.size), xs


def matvec_mma(w_dev, qtype, x_dev, n_out: int, out=None, stream=0):
    """y [n_x, n_out] = x [n_x, K] @ W^T for a Q4_K weight (raw uint8 rows) and 1..MAX_ROWS
    rows of x (float32, on the device). Same semantics as matvec_ref; not yet routed."""
    qtype = as_qtype(qtype)
    if qtype not in MMA_TYPES:
        raise ValueError(f"matvec_mma: {qtype.name} weights are not supported (Q4_K only)")
    n_x, k = x_dev.shape
    if not 1 <= n_x <= MAX_ROWS or k % QK:
        raise ValueError(f"matvec_mma: x of {n_x} rows x {k} (1..{MAX_ROWS} rows, K a multiple of {QK})")
    w16, _ = weight_u16(w_dev, qtype, k)
    xh, xl, xs = x_halves(x_dev, stream)
    if out is None:
        out = cuda.device_array((n_x, n_out), np.float32, stream=stream)
    nt = -(-n_x // 8)
    _kernel(nt)[-(-n_out // 16), 32 * WARPS, stream](w16, xh, xl, xs, n_out, k, n_x, out)
    return out
