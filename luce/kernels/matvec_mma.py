"""Q4_K and Q6_K products with 1-32 activation rows on tensor cores: y[t] = W x[t], and the
gated form silu(W_gate x[t]) * (W_up x[t]). Speculative decoding verifies a tree of up to
~32 tokens in one forward, and each of those tokens should cost close to nothing beyond
the one weight read.

Why this layout: a small-M product is bound by streaming W (each weight serves only M
rows), so what matters is the instructions a weight and the bytes in flight. Each warp
owns 16 output rows (an mma tile; two tiles share the x fragments where the grid is large
enough) and walks a share of the 256-column blocks:

- lane 4g + c reads 16 bytes at a time of rows g and g + 8 (Q4_K: the block's header and
  the quant chunks c and 4 + c; Q6_K: ql, ql + 32 and qh at 64n + 16m with n, m the bits
  of c) and turns each 32-bit word into two mma steps' A fragments: a low nibble goes under
  the f16 exponent of 1024 (1024 + q exactly), a high one under that of 64 where it stands
  (64 + q), one LOP3 each; the offset is subtracted (exact) and one f16x2 FMA applies the
  sub-block's scale and min. The weights enter as f16 (w = s q + o rounded
  once), as in the prefill matmul;
- K is permuted inside every mma step: the four columns a lane holds for a row are the
  four bytes of one quant word (bytes 0, 2 in one f16x2 half pair, 1, 3 in the other), so
  a step's 16 columns are not consecutive. x is rewritten once a call (x_frags) in exactly
  that order as f16, so a lane's B fragments for two steps are one 16-byte load and a
  warp's 32 lanes read 512 contiguous bytes;
- f32 accumulation in the mma; a block's warps add their partial tiles in shared memory
  in warp order.

Measured on the H200 (d80fd0b, `python -m luce.bench.kernels_matvec_mma`; docs/benchmarks.md,
seventh session): the gated Qwen3-8B FFN (2 x 12288 x 4096 Q4_K) 26.5 us for 1-8 rows, 40.2
for 23 (the small-M matmul it replaces: 78.2), Q6_K 4096 x 12288 40.8 at 23 (65.6); one row
is as fast as matvec_fast for those and slower for 1024-row outputs, so decode keeps
matvec_fast. Found with Nsight Compute: with x row-major, each warp load touched 32 cache
lines and L1 was 91% busy at 23 rows. Tried and slower: Q4_K blocks staged through shared
memory by cp.async; next-block loads issued into spare registers were sunk by ptxas.

Determinism across widths: the K split (warps a block) depends only on W's shape, and an
mma computes each column of B the same way whatever the other columns hold, so a token's
outputs are the same bits whether it comes alone or among 23 (decode and verification
agree exactly where both take this kernel).
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import cuda

from ._reduce import block_sum
from .f16_range import F16_SAFE, FIXUP_THREADS, new_flags, row_fixup_scale, unit_flags, unit_scales
from .dequant import SIM, T, as_qtype, weight_u16
from .device import device
from .matvec import silu
from .matvec_fast import k4_scales, ld16, pieces
from .mma import SCRATCH, and_or, bits, f32x2_to_f16x2, hfma2, hsub2, mma_f16, or32, prmt, shl32
from .vector_load import f16_bits_to_f32, ldg_f32x4, ldg_u16_u32x4, ldw_u16_u32, ldw_u16_u32x4
from .pdl import grid_dependency_sync, ready as pdl_ready
from .split_merge import arrive

__all__ = ["MMA_TYPES", "MAX_ROWS", "frag_u16", "frags_fixup", "frags_targets", "matvec_mma", "matvec_mma_norm",
           "matvec_mma_pair", "plan", "rms_norm_frags", "third_align", "x_frags"]

MMA_TYPES = frozenset({T.Q4_K, T.Q6_K})
MAX_ROWS = 32  # rows of x: four B fragments of 8
QK = 256  # columns a block of both types
BLOCK_U16 = {T.Q4_K: 72, T.Q6_K: 105}  # 144 and 210 bytes
U = np.uint32
ONES = U(0x64006400)  # f16x2 (1024, 1024)
ONES32 = U(0x64206420)  # f16x2 (1056, 1056): 1024 + Q6_K's offset of 32
LOW4 = U(0x000F000F)
HIGH4 = U(0x00F000F0)
M64 = U(0x54005400)  # f16x2 (64, 64)
FULL = U(0xFFFFFFFF)
LOW2 = U(0x00030003)
GRID_WARPS = 2048  # warps a launch aims for (~16 an H200 SM): the K split is chosen from it
# experiment switches (in the kernel cache's stamp): one tile a warp for the plain forms up
# to 24 rows (LUCE_MMA_TILES=1), and the blocks an SM ptxas must fit for plain one-tile forms
PLAIN_TILES = int(os.environ.get("LUCE_MMA_TILES", "0") or 0)
PLAIN_BLOCKS = int(os.environ.get("LUCE_MMA_PLAIN_BLOCKS", "1") or 1)
# blocks an SM for the pair form with a third weight (q, k and v): 2 as the pair's, where
# ptxas spills 476 bytes (sm_90; the pair 300), or 1 (no spills, half the warps)
TRIO_BLOCKS = int(os.environ.get("LUCE_MMA_TRIO_BLOCKS", "2") or 2)
# Measured and removed (H200, thirty-first session): the next K block prefetched into L1
# each trip (LUCE_MMA_PREFETCH: the 23-node verification forward 5.25 -> 5.41 ms).


@device(inline=True)
def _q4(v, hi, s2, o2):
    """An f16x2 A word: the low (hi=0) or high nibbles of bytes 0 and 2 of v, times s2 plus
    o2. A low nibble under the f16 exponent of 1024 reads 1024 + q; a high one, where it
    stands (bits 4-7), under the exponent of 64 (ulp 1/16) reads 64 + q: one LOP3 each, and
    the subtraction is exact."""
    if hi:
        return hfma2(hsub2(and_or(v, HIGH4, M64), M64), s2, o2)
    return hfma2(hsub2(and_or(v, LOW4, ONES), ONES), s2, o2)


@device(inline=True)
def _q6(lw, hw, qq, odd, s2):
    """An f16x2 A word of Q6_K's quarter qq: the low (qq < 2) or high nibbles of bytes 0, 2
    (odd=1: 1, 3) of the ql word lw, with bits 2qq, 2qq + 1 of the same bytes of the qh
    word hw above them, less 32, times s2."""
    sh = 8 * odd
    q = or32(bits(lw, 4 * (qq >> 1) + sh, LOW4), shl32(bits(hw, 2 * qq + sh, LOW2), 4))
    return hfma2(hsub2(or32(q, ONES), ONES32), s2, U(0))


@device(inline=True)
def _ld16_scales(w, byte):
    """16 bytes of w (flat uint16) at a 2-byte aligned byte offset from 4-byte loads, none
    past the 16 bytes' last aligned word: Q6_K's scales, the last 18 bytes of a block but
    2, where ld16's second aligned piece would read past the last block of the tensor."""
    u = byte >> 1
    if (byte & 2) == 0:
        return ldw_u16_u32(w, u), ldw_u16_u32(w, u + 2), ldw_u16_u32(w, u + 4), ldw_u16_u32(w, u + 6)
    a = ldw_u16_u32(w, u - 1)
    b = ldw_u16_u32(w, u + 1)
    c = ldw_u16_u32(w, u + 3)
    d = ldw_u16_u32(w, u + 5)
    e = ldw_u16_u32(w, u + 7)
    return prmt(a, b, 0x5432), prmt(b, c, 0x5432), prmt(c, d, 0x5432), prmt(d, e, 0x5432)


@device(inline=True)
def _prev_scale(invs, t):
    """matvec_mma_norm's prescale of row t: the 1 / rms that the last norm of this residual
    stream left in invs (rms_norm_frags or matvec_mma_norm), 1 where there is none yet."""
    sp = invs[t]
    return sp if sp > np.float32(0.0) and sp < np.float32(3e38) else np.float32(1.0)


@device(inline=True)
def _i8(word, byte):
    """Signed byte `byte` of word as float32."""
    return np.float32(np.int32(shl32(word, 24 - 8 * byte)) >> 24)


@device
def frag_col(q4, c, s):
    """First of the four consecutive columns (within a 256-column block) that lane group c
    multiplies in mma step s (0..15) of a block."""
    if q4:  # chunk 4 (s >> 3) + c of qs: its low nibbles in steps of even s, high in odd
        return 64 * (2 * (s >> 3) + (c >> 1)) + 32 * (s & 1) + 16 * (c & 1) + 4 * ((s >> 1) & 3)
    # Q6_K: ql bytes 64n + 16m + 4a (n, m = bits of c), step 4a + quarter
    return 128 * (c >> 1) + 32 * (s & 3) + 16 * (c & 1) + 4 * (s >> 2)


# x enters as f16: rows past its range are flagged here and rewritten scaled by
# _frags_fixup (luce.kernels.f16_range).


@device(inline=True)
def _item_col(q4, i):
    """The first of the four consecutive columns of item i (block, lane group, step) of a
    fragment row."""
    return (i // 64) * QK + frag_col(q4, (i // 16) % 4, i % 16)


@device(inline=True)
def frag_u16(q4, col, t, rows8):
    """Where column col of fragment row t goes, as an index into the fragments' uint16
    view: frag_col and _store_item inverted (word o holds columns 0 and 2 of a step's four,
    word o + 1 columns 1 and 3, the first of each in the low half)."""
    c = col % QK
    if q4:
        s = (((c >> 7) & 1) << 3) | (((c >> 2) & 3) << 1) | ((c >> 5) & 1)
        g = (((c >> 6) & 1) << 1) | ((c >> 4) & 1)
    else:
        s = (((c >> 2) & 3) << 2) | ((c >> 5) & 3)
        g = (((c >> 7) & 1) << 1) | ((c >> 4) & 1)
    o = ((((col // QK) * 8 + (s >> 1)) * rows8 + t) * 4 + g) * 4 + 2 * (s & 1)
    return 2 * (o + (c & 1)) + ((c >> 1) & 1)


@device(inline=True)
def _store_item(out, i, t, rows8, v0, v1, v2, v3):
    """Item i of fragment row t: two f16x2 words, columns (0, 2) and (1, 3) of the step's
    four. Layout: [block][step pair][row][lane group][4 words], so that the 32 lanes of a
    warp (8 rows x 4 lane groups) load one contiguous 512 bytes for a fragment's two steps
    (laid out row-major, a warp's loads touched 32 lines: L1 was 91% busy at 23 rows, H200)."""
    s = i % 16
    o = ((((i // 64) * 8 + (s >> 1)) * rows8 + t) * 4 + (i // 16) % 4) * 4 + 2 * (s & 1)
    out[o] = f32x2_to_f16x2(v0, v2)
    out[o + 1] = f32x2_to_f16x2(v1, v3)


@device(inline=True)
def _frag_item(x, t, n_x, q4, i, rows8, down, out):
    """Item i of fragment row t from x's row t times `down`; zeros for rows from n_x up to
    the fragments' 8. Returns the largest |x| it converted."""
    col = _item_col(q4, i)
    v0 = v1 = v2 = v3 = np.float32(0.0)
    if t < n_x:
        v0 = x[t, col]
        v1 = x[t, col + 1]
        v2 = x[t, col + 2]
        v3 = x[t, col + 3]
    _store_item(out, i, t, rows8, v0 * down, v1 * down, v2 * down, v3 * down)
    return max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))


@pdl_ready
@cuda.jit
def _frags_kernel(x, n_x, q4, out, flags):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # one thread an item of a row, unscaled; a row with a value past F16_SAFE is flagged
    i = cuda.grid(1)
    per_row = (x.shape[1] // QK) * 64
    rows8 = out.shape[0] // (2 * per_row)
    if i >= rows8 * per_row:
        return
    t = i // per_row
    if _frag_item(x, t, n_x, q4, i % per_row, rows8, np.float32(1.0), out) >= F16_SAFE:
        flags[t] = 1


@pdl_ready
@cuda.jit
def _frags_fixup(x, n_x, q4, out, flags, scales):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # a block a row: its scale; a flagged row rewritten scaled into f16's range
    t = cuda.blockIdx.x
    buf = cuda.shared.array(FIXUP_THREADS, np.float32)
    down = row_fixup_scale(x, t, n_x, flags, scales, buf)
    if down != 0:  # the same for the whole block
        for i in range(cuda.threadIdx.x, (x.shape[1] // QK) * 64, cuda.blockDim.x):
            _frag_item(x, t, n_x, q4, i, cuda.gridDim.x, down, out)


NORM_THREADS = 128  # rms_norm_frags: threads a block, one item of each layout a thread


@pdl_ready
@cuda.jit
def _norm_frags_kernel(x, xf, w, eps, n_x, h, frags4, frags6, inv_out):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # block (t, s): the RMSNorm of x's row t (every block of the row sums the whole row: a
    # re-read from L2) into h and, from the same values, the row's items s * blockDim ..
    # of both layouts (zeros past n_x). One block a row made 24 blocks for 23 rows, each
    # walking 4096 columns one load at a time: the o projection with its norm took ~7 us
    # more than the product alone (H200, a4aa1b1's breakdown of the 23-node verification)
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    bd = cuda.blockDim.x
    k = x.shape[1]
    buf = cuda.shared.array(FIXUP_THREADS, np.float32)
    live = t < n_x
    ss = np.float32(0.0)
    if live:
        k4 = k // 4
        for c in range(tid, k4, 2 * bd):  # two 16-byte loads in flight a thread
            a0, a1, a2, a3 = ldg_f32x4(xf, t * k + 4 * c)
            b0 = b1 = b2 = b3 = np.float32(0.0)
            if c + bd < k4:
                b0, b1, b2, b3 = ldg_f32x4(xf, t * k + 4 * (c + bd))
            ss += (a0 * a0 + a1 * a1) + (a2 * a2 + a3 * a3) + ((b0 * b0 + b1 * b1) + (b2 * b2 + b3 * b3))
    # as rms_norm's kernel: float32 throughout (sum / int would be a float64 divide)
    inv = np.float32(1.0) / math.sqrt(block_sum(ss, buf) / np.float32(k) + eps)
    rows8 = cuda.gridDim.x
    if cuda.blockIdx.y == 0 and tid == 0 and live:
        inv_out[t] = inv  # matvec_mma_norm's prescale, where a product's norm follows
    i = cuda.blockIdx.y * bd + tid
    if i < (k // QK) * 64:
        for q4 in range(2):
            col = _item_col(q4, i)
            v0 = v1 = v2 = v3 = np.float32(0.0)
            if live:
                a0, a1, a2, a3 = ldg_f32x4(xf, t * k + col)
                w0, w1, w2, w3 = ldg_f32x4(w, col)
                v0 = a0 * inv * w0
                v1 = a1 * inv * w1
                v2 = a2 * inv * w2
                v3 = a3 * inv * w3
                if q4:  # the Q4_K layout's items cover every column once
                    h[t, col] = v0
                    h[t, col + 1] = v1
                    h[t, col + 2] = v2
                    h[t, col + 3] = v3
            _store_item(frags4 if q4 else frags6, i, t, rows8, v0, v1, v2, v3)


def rms_norm_frags(x_dev, w, eps: float, h, stream=0):
    """h = RMSNorm(x) * w (x, h: float32 [n_x, K] on the device, x contiguous) and, in the
    same launch, x_frags of h for both weight layouts, made without the guard: the caller
    knows every |h| < 2**15 (|x_i| / rms(x) <= sqrt(K): max|w| sqrt(K) below it). Returns
    {qtype: (fragments, row scales)} for matvec_mma's `frags`. One launch where the norm and
    the products' two conversions took three (a verification forward's attention and FFN
    inputs)."""
    n_x, k = x_dev.shape
    if k % QK or not 1 <= n_x <= MAX_ROWS:
        raise ValueError(f"rms_norm_frags: x of {n_x} rows x {k} (1..{MAX_ROWS} rows, K a multiple of {QK})")
    rows8 = -(-n_x // 8) * 8
    frags = frags_targets(n_x, k, stream)
    threads = 32 if SIM else NORM_THREADS
    _norm_frags_kernel[(rows8, -(-(k // 4) // threads)), threads, stream](
        x_dev, x_dev.reshape(n_x * k), w, np.float32(eps), n_x, h, frags[T.Q4_K][0].view(np.uint32),
        frags[T.Q6_K][0].view(np.uint32), _norm_scratch(rows8, k, stream)[3])
    return frags


def frags_targets(n_x: int, k: int, stream=0) -> dict:
    """{qtype: (fragments, row scales)} of both weight layouts for an x of n_x rows x K that
    its producer writes as fragments itself, in range (every |x| < 2**15: scales 1): the
    buffers x_frags would use, for matvec_mma's `frags`. Layout: frag_u16; rows from n_x up
    to the fragments' multiple of 8 must be written as zeros."""
    rows8 = -(-n_x // 8) * 8
    return {qt: (_scratch(rows8, k, qt, stream)[0].view(np.uint16), unit_scales(rows8)) for qt in (T.Q4_K, T.Q6_K)}


# (rows8, K, layout, stream) -> (fragments, overflow flags, row scales): fixed addresses, so
# captured graphs stay valid; one per stream, so that two backends (a draft's and a
# target's) never share one in flight; one per layout, so that fragments made for one weight
# type stay valid while the other type's are made (q and k, then v)
_SCRATCH: dict = {}


def _scratch(rows8: int, k: int, qtype, stream, gated_out: bool | int = False):
    # gated_out: the set a gated launch writes its output's fragments into, never the one its
    # own x's conversion is in (n_out == K would have it overwrite them mid-launch); 2: the
    # set matvec_mma_norm writes into (a gated product of n_out == K reads it)
    key = (rows8, k, int(as_qtype(qtype) == T.Q4_K), id(stream), gated_out)
    if key not in _SCRATCH:
        _SCRATCH[key] = (cuda.device_array(rows8 * k // 2, np.uint32), new_flags(rows8),
                         cuda.device_array(rows8, np.float32))
    return _SCRATCH[key]


def frags_fixup(x_dev, qtype, stream=0, gated_out: bool = False):
    """x_frags's second half for fragments of x already written with their rows flagged: the
    flagged rows rewritten scaled, the row scales set. Returns (fragments, scales) as x_frags
    does. gated_out: the fragments matvec_mma's gated kernel wrote with frags_out."""
    n_x, k = x_dev.shape
    rows8 = -(-n_x // 8) * 8
    out, flags, scales = _scratch(rows8, k, qtype, stream, gated_out)
    _frags_fixup[rows8, 32 if SIM else FIXUP_THREADS, stream](x_dev, n_x, int(as_qtype(qtype) == T.Q4_K), out, flags,
                                                              scales)
    return out.view(np.uint16), scales


def x_frags(x_dev, qtype, stream=0, guard=True):
    """x [n_x, K] (float32, device) as the kernel's B fragments, a flat uint16 view (rows
    padded to a multiple of 8 with zeros; layout in _frag_item), and each row's scale
    (float32 [rows8]: what the row's products are multiplied by). The buffers are kept per
    shape and stream and reused by every call on it (the stream orders them). guard=False: the
    caller knows every |x| < 2**15 (an RMSNorm's output, attention over an f16 pool): no
    fixup launch, every scale 1."""
    n_x, k = x_dev.shape
    rows8 = -(-n_x // 8) * 8
    q4 = int(as_qtype(qtype) == T.Q4_K)
    out, flags, scales = _scratch(rows8, k, qtype, stream)
    n = out.shape[0] // 2
    threads = 32 if SIM else 256
    _frags_kernel[-(-n // threads), threads, stream](x_dev, n_x, q4, out, flags)
    if not guard:
        return out.view(np.uint16), unit_scales(rows8)
    return frags_fixup(x_dev, qtype, stream)


def _min_blocks(nt: int, warps: int, gated: bool, pair: bool, tiles: int = 2, third: bool = False) -> int:
    """Blocks an SM that ptxas must fit (launch_bounds' second figure): registers traded for
    resident warps where that was measured to pay, at up to 24 rows of x (nt <= 3). These
    products are weight-load latency chains, so more warps in flight hide more of it. At 23
    rows, Qwen3-8B shapes (H200, graph replay): the gated form 188 -> 168 registers, 2 -> 3
    blocks of 4 warps, 40.9 -> 35.5 us; the q+k pair 196 -> 128 registers (300 spill bytes),
    1 -> 2 blocks of 8 warps, 18.7 -> 16.3 us (at 8 / 16 rows 15.0 -> 11.7 / 17.8 -> 14.6).
    The plain forms got slower at 2 blocks (23 rows: down 33.5 -> 38.8 us, 164 spill bytes;
    o 12.1 -> 12.6; v 10.3 -> 10.9; 8 / 16 rows: down 29.0 -> 31.0 / 32.6 -> 35.2, o and v
    within 0.3): left at 1."""
    if nt > 3:
        return 1
    if gated:
        return max(1, 12 // warps)  # 12 warps an SM (168 registers) in whole blocks
    if pair:
        return min(TRIO_BLOCKS, -(-16 // warps)) if third else -(-16 // warps)
    return PLAIN_BLOCKS if tiles == 1 else 1


@functools.lru_cache(maxsize=None)
def _kernel(qtype, nt: int, tiles: int, warps: int, gated: bool = False, pair: bool = False, frags: bool = False,
            g8: bool = False, third=None, norm: bool = False):
    """The kernel for `qtype` weights, nt B fragments (8 nt rows of x), `tiles` 16-row tiles
    a warp sharing each x fragment (gated: tile 0 of W_gate, tile 1 the same rows of W_up)
    and `warps` warps a block splitting K; pair: output rows from n_a on are W_b's (w1),
    stored in out_b; frags (gated): the outputs also go, as f16, into fragments of both
    layouts for the next product (f4, f6: _scratch's gated_out buffers, not x_frags's; rows
    reaching F16_SAFE flagged in fl4, fl6 for the fixup). g8: Q6_K weights in
    luce.kernels.q6k_groups' layout (every piece one aligned load). third (pair): the type of
    a third weight w2 (GGUF layout) whose rows follow W_a's and W_b's (from n_ab on, a whole
    number of blocks), over its own fragments xq2 and scales xs2, into out_c: v beside q and k.
    norm (plain, with the residual): the outputs' RMSNorm left to the next product, as
    matvec_mma_norm describes (gw the norm's weight; nparts, ncount, nscale, ninv its
    partial sums, block counter, row scales and rows' 1 / rms, the prescale)."""
    NT, TL, W = nt, tiles, warps
    NORM = norm
    assert not norm or not (gated or pair or frags)
    THIRD = third is not None
    assert not THIRD or pair and not g8
    Q4_3 = third == T.Q4_K
    G8 = g8
    assert not g8 or qtype == T.Q6_K
    PAIR = pair
    FRAGS = frags
    ROWS8 = 8 * nt
    assert not (gated and pair) and (gated or not frags)
    NACC = 4 * NT * TL
    R2 = 2 * TL  # weight rows a lane reads; array shapes must be plain constants
    ROWS = 16 if gated else 16 * TL
    Q4 = qtype == T.Q4_K
    BU4, BU6 = BLOCK_U16[T.Q4_K], BLOCK_U16[T.Q6_K]
    NQ = 8 if Q4 and (not THIRD or Q4_3) else 12  # quant words a lane holds a row
    SCR = (W, 32, SCRATCH) if SIM else (1,)
    assert not gated or TL == 2
    # (threads, blocks an SM): with the thread count alone ptxas capped one form at 72
    # registers and spilled
    jit = cuda.jit if SIM else cuda.jit(launch_bounds=(32 * W, _min_blocks(NT, W, gated, pair, TL, THIRD)))

    @device(inline=True)
    def step(x4, lo, tl, a0, a1, a2, a3, acc, scr, wid, lane):
        """One mma step of tile tl for every x fragment: x4 holds two steps' B words."""
        for f in range(NT):
            e = 4 * (f * TL + tl)
            acc[e], acc[e + 1], acc[e + 2], acc[e + 3] = mma_f16(
                scr, wid, lane, a0, a1, a2, a3, x4[f, 2 * lo], x4[f, 2 * lo + 1],
                acc[e], acc[e + 1], acc[e + 2], acc[e + 3])

    @device(inline=True)
    def load_x(x4, xq, xb, nb, wpair):
        # words 4 wpair .. + 3 of this lane's 32 for the block, each x fragment
        for f in range(NT):
            x4[f, 0], x4[f, 1], x4[f, 2], x4[f, 3] = ldg_u16_u32x4(xq, xb + 256 * NT * wpair + 256 * f)

    @device(inline=True)
    def block_q4_k(w0, w1, rows, wsel, nb, b, live, xq, xb, scr, wid, lane, acc, qw, hd, sc, x4):
        c = lane & 3
        for i in range(R2):
            w = w1 if gated and i >= 2 or PAIR and wsel[i] else w0
            base = (rows[i] * nb + b) * BU4
            hd[i, 0], hd[i, 1], hd[i, 2], hd[i, 3] = ldw_u16_u32x4(w, base)
            qw[i, 0], qw[i, 1], qw[i, 2], qw[i, 3] = ldw_u16_u32x4(w, base + 8 + 8 * c)
            qw[i, 4], qw[i, 5], qw[i, 6], qw[i, 7] = ldw_u16_u32x4(w, base + 40 + 8 * c)
        for h in range(2):
            # chunk 4h + c: low nibbles are sub-block 2p, high ones 2p + 1
            p = 2 * h + (c >> 1)
            for i in range(R2):
                d = f16_bits_to_f32(hd[i, 0] & U(0xFFFF)) * live
                dm = f16_bits_to_f32(hd[i, 0] >> U(16)) * live
                scl, sch, mnl, mnh = k4_scales(hd[i, 1], hd[i, 2], hd[i, 3], p)  # sch, mnh: 256 x
                sc[i, 0] = f32x2_to_f16x2(d * scl, d * scl)
                sc[i, 1] = f32x2_to_f16x2(-dm * mnl, -dm * mnl)
                v = d * sch * np.float32(1.0 / 256)
                sc[i, 2] = f32x2_to_f16x2(v, v)
                v = -dm * mnh * np.float32(1.0 / 256)
                sc[i, 3] = f32x2_to_f16x2(v, v)
            for wd in range(4):
                load_x(x4, xq, xb, nb, 4 * h + wd)
                for hi in range(2):
                    for tl in range(TL):
                        i0 = 2 * tl
                        q0 = qw[i0, 4 * h + wd]
                        q1 = qw[i0 + 1, 4 * h + wd]
                        s0, o0 = sc[i0, 2 * hi], sc[i0, 2 * hi + 1]
                        s1, o1 = sc[i0 + 1, 2 * hi], sc[i0 + 1, 2 * hi + 1]
                        step(x4, hi, tl, _q4(q0, hi, s0, o0), _q4(q1, hi, s1, o1),
                             _q4(bits(q0, 8, FULL), hi, s0, o0), _q4(bits(q1, 8, FULL), hi, s1, o1), acc, scr, wid,
                             lane)

    @device(inline=True)
    def block_q6_k(w0, w1, rows, wsel, nb, b, live, xq, xb, scr, wid, lane, acc, qw, hd, sc, x4):
        # ql[128] qh[64] scales[16] d. Lane group c = 2n + m takes, of half n, ql bytes
        # 64n + 16m .. + 15 (quarters 0, 2), 64n + 32 + 16m .. (quarters 1, 3) and qh
        # 32n + 16m ..; their sub-blocks' scales are bytes 8n + 2qq + m
        c = lane & 3
        n = c >> 1
        m = c & 1
        for i in range(R2):
            w = w1 if gated and i >= 2 or PAIR and wsel[i] else w0
            if G8:  # the block's group of 8 (q6k_groups): ql, qh, scales and d each aligned
                gs = (rows[i] * nb + (b - (b & 7))) * BU6
                j = b & 7
                o = gs + 64 * j + 32 * n + 8 * m
                qw[i, 0], qw[i, 1], qw[i, 2], qw[i, 3] = ldw_u16_u32x4(w, o)
                qw[i, 4], qw[i, 5], qw[i, 6], qw[i, 7] = ldw_u16_u32x4(w, o + 16)
                o = gs + 512 + 32 * j + 16 * n + 8 * m
                qw[i, 8], qw[i, 9], qw[i, 10], qw[i, 11] = ldw_u16_u32x4(w, o)
                hd[i, 0], hd[i, 1], hd[i, 2], hd[i, 3] = ldw_u16_u32x4(w, gs + 768 + 8 * j)
                d = f16_bits_to_f32(U(w[gs + 832 + j])) * live
            else:
                # a 210-byte block is 2-byte aligned: each 16-byte quant piece from two aligned
                # 16-byte loads (the second mostly an L1 hit), matvec_fast's way (25.7 us for
                # 4096x12288 at one row), where five 4-byte loads took 32.7 at one row and 36.9 at
                # 23 (H200, 5fab17b; this form is measured only inside luce bench's runs)
                i0, i1, al = pieces((rows[i] * nb + b) * BU6)
                o = 32 * n + 8 * m
                qw[i, 0], qw[i, 1], qw[i, 2], qw[i, 3] = ld16(w, i0 + o, i1 + o, al)
                qw[i, 4], qw[i, 5], qw[i, 6], qw[i, 7] = ld16(w, i0 + o + 16, i1 + o + 16, al)
                o = 64 + 16 * n + 8 * m
                qw[i, 8], qw[i, 9], qw[i, 10], qw[i, 11] = ld16(w, i0 + o, i1 + o, al)
                hd[i, 0], hd[i, 1], hd[i, 2], hd[i, 3] = _ld16_scales(w, (rows[i] * nb + b) * 210 + 192)
                d = f16_bits_to_f32(U(w[(rows[i] * nb + b) * BU6 + 104])) * live
            # scale byte 8n + 2qq + m: word 2n + (qq >> 1), byte m + 2 (qq & 1); n differs
            # between lanes, and a register array indexed by it would live in local memory
            sw0 = hd[i, 2] if n else hd[i, 0]
            sw1 = hd[i, 3] if n else hd[i, 1]
            for qq in range(4):
                v = d * _i8(sw1 if qq >> 1 else sw0, m + 2 * (qq & 1))
                sc[i, qq] = f32x2_to_f16x2(v, v)
        for a in range(4):
            for half in range(2):  # quarters 2 half, 2 half + 1
                load_x(x4, xq, xb, nb, 2 * a + half)
                for lo in range(2):
                    qq = 2 * half + lo
                    for tl in range(TL):
                        i0 = 2 * tl
                        l0 = qw[i0, 4 * (qq & 1) + a]
                        l1 = qw[i0 + 1, 4 * (qq & 1) + a]
                        h0 = qw[i0, 8 + a]
                        h1 = qw[i0 + 1, 8 + a]
                        step(x4, lo, tl, _q6(l0, h0, qq, 0, sc[i0, qq]), _q6(l1, h1, qq, 0, sc[i0 + 1, qq]),
                             _q6(l0, h0, qq, 1, sc[i0, qq]), _q6(l1, h1, qq, 1, sc[i0 + 1, qq]), acc, scr, wid, lane)

    block = block_q4_k if Q4 else block_q6_k
    block3 = block_q4_k if Q4_3 else block_q6_k
    NSQ = ROWS8 * ROWS if NORM else 1
    SEG = max(1, (32 * W) // ROWS8)  # threads a row in the last block's sum
    NRED = ROWS8 * SEG + 2 * ROWS8 if NORM else 1
    TRIP = 8  # partials a thread loads at once in the last block's sum

    @device(inline=True)
    def _norm_tail(out, n_out, n_x, gw, f4, f6, fl4, nparts, ncount, nscale, ninv, eps, sqs, ibuf, nred, tid):
        """The block's sums of squares by row of x into nparts; the last block to finish adds
        them up (in block order, the same sums whatever the timing) into the row scales
        1 / rms, and rewrites a flagged row's fragments as the norm itself (scale 1)."""
        cuda.syncthreads()
        nblk = cuda.gridDim.x
        if tid < ROWS8:
            s = np.float32(0.0)
            for j in range(ROWS):
                s += sqs[tid * ROWS + j]
            nparts[tid * (nparts.shape[0] // ROWS8) + cuda.blockIdx.x] = s
        if not arrive(ncount, 0, nblk, ibuf, tid):
            return
        # row t's partials by SEG threads, each over every SEG-th block, then in thread order.
        # The loads of a trip are a constant count (unrolled, all in flight at once): a loop
        # of one load an add waited an L2 round trip each (13 a thread at the 8B shape), and
        # with the flags read one after another in the loop below, the 23-node forward took
        # 5.84 ms against 5.46 with rms_norm_frags (H100)
        per = nparts.shape[0] // ROWS8
        if tid < ROWS8 * SEG:
            t = tid // SEG
            s = np.float32(0.0)
            for base in range(tid % SEG, nblk, SEG * TRIP):
                for j in range(TRIP):
                    b = base + j * SEG
                    if b < nblk:
                        s += nparts[t * per + b]
            nred[tid] = s
        cuda.syncthreads()
        if tid < ROWS8:
            s = np.float32(0.0)
            for j in range(SEG):
                s += nred[tid * SEG + j]
            inv = np.float32(1.0) / math.sqrt(s / np.float32(n_out) + eps)
            sp = _prev_scale(ninv, tid)  # what this launch's fragments were written with
            flag = fl4[tid]
            nscale[tid] = inv / sp if tid < n_x and flag == 0 else np.float32(1.0)
            if tid < n_x:
                ninv[tid] = inv
            nred[ROWS8 * SEG + tid] = inv
            nred[ROWS8 * SEG + ROWS8 + tid] = np.float32(flag)
        cuda.syncthreads()
        for t in range(n_x):
            if nred[ROWS8 * SEG + ROWS8 + t] != 0:  # the same for the whole block
                inv = nred[ROWS8 * SEG + t]
                for col in range(tid, n_out, 32 * W):
                    h16 = np.uint16(f32x2_to_f16x2(out[t, col] * inv * gw[col], np.float32(0.0)) & U(0xFFFF))
                    f4[frag_u16(1, col, t, ROWS8)] = h16
                    f6[frag_u16(0, col, t, ROWS8)] = h16
        cuda.syncthreads()
        if tid < ROWS8:
            fl4[tid] = 0

    @jit
    def kernel(w0, w1, xq, xs, n_out, nb, n_x, bias, res, has_bias, has_res, out, n_a, bias_b, out_b, f4, f6, fl4,
               fl6, w2, xq2, xs2, n_ab, bias_c, out_c, gw, nparts, ncount, nscale, ninv, eps):
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        tid = cuda.threadIdx.x
        wid = tid // 32
        lane = tid % 32
        g = lane >> 2
        scr = cuda.shared.array(SCR, np.uint32)
        red = cuda.shared.array((W, 32, NACC), np.float32)
        sqs = cuda.shared.array(NSQ, np.float32)  # norm: v^2 of the block's outputs, by row of x
        ibuf = cuda.shared.array(1, np.int32)
        nred = cuda.shared.array(NRED, np.float32)
        acc = cuda.local.array(NACC, np.float32)
        rows = cuda.local.array(R2, np.int64)  # this lane's weight rows: g, g + 8 of each tile
        wsel = cuda.local.array(R2, np.int32)  # pair: 1 where the row is W_b's
        qw = cuda.local.array((R2, NQ), np.uint32)
        hd = cuda.local.array((R2, 4), np.uint32)
        sc = cuda.local.array((R2, 4), np.uint32)  # f16x2 scales (and Q4_K's mins)
        x4 = cuda.local.array((NT, 4), np.uint32)
        for e in range(NACC):
            acc[e] = 0.0
        # THIRD: the block's rows are all w2's or none (n_ab a multiple of ROWS)
        on3 = THIRD and cuda.blockIdx.x * ROWS >= n_ab
        for i in range(R2):  # rows past the end: computed, never stored
            tile = 0 if gated else i >> 1
            rows[i] = min(cuda.blockIdx.x * ROWS + 16 * tile + g + 8 * (i & 1), n_out - 1)
            wsel[i] = 0
            if on3:
                rows[i] -= n_ab
            elif PAIR and rows[i] >= n_a:
                wsel[i] = 1
                rows[i] -= n_a
        # this lane's x words (see _frags_kernel): row g of fragment 0, lane group c
        xb0 = 8 * (4 * g + (lane & 3))
        trips = (nb + W - 1) // W  # the same for every warp (the simulator's mma has barriers)
        for it in range(trips):
            b = wid + it * W
            live = np.float32(1.0) if b < nb else np.float32(0.0)
            b = min(b, nb - 1)
            if on3:
                block3(w2, w2, rows, wsel, nb, b, live, xq2, xb0 + 2048 * NT * b, scr, wid, lane, acc, qw, hd, sc, x4)
            else:
                block(w0, w1, rows, wsel, nb, b, live, xq, xb0 + 2048 * NT * b, scr, wid, lane, acc, qw, hd, sc, x4)
        for e in range(NACC):
            red[wid, lane, e] = acc[e]
        cuda.syncthreads()
        # the block's warps' partial sums in warp order, one output (gated: one pair) a thread
        per = NACC // 2 if gated else NACC
        for o in range(tid, 32 * per, 32 * W):
            ln = o % 32
            e = o // 32
            if gated:  # e over (fragment, row half) of tile 0; tile 1 is 4 further
                e = (e >> 2) * 8 + (e & 3)
            v = red[0, ln, e]
            for ww in range(1, W):
                v += red[ww, ln, e]
            e4 = e % 4
            ft = e // 4
            t = (ft // TL) * 8 + 2 * (ln & 3) + (e4 & 1)
            nn = cuda.blockIdx.x * ROWS + (0 if gated else 16 * (ft % TL)) + (ln >> 2) + 8 * (e4 >> 1)
            if t < n_x and nn < n_out:
                v *= xs2[t] if on3 else xs[t]  # the row's scale (1 unless x was scaled into f16's range)
                if gated:
                    u = red[0, ln, e + 4]
                    for ww in range(1, W):
                        u += red[ww, ln, e + 4]
                    v = silu(v) * (u * xs[t])
                if on3:
                    if has_bias:
                        v += bias_c[nn - n_ab]
                    out_c[t, nn - n_ab] = v
                elif PAIR and nn >= n_a:
                    if has_bias:
                        v += bias_b[nn - n_a]
                    out_b[t, nn - n_a] = v
                else:
                    if has_bias:
                        v += bias[nn]
                    if has_res:  # may be out itself (the residual stream, in place)
                        v += res[t, nn]
                    out[t, nn] = v
            if NORM and t < ROWS8:  # the squares for the norm's sums (zeros past n_x, n_out)
                sqs[t * ROWS + nn - cuda.blockIdx.x * ROWS] = v * v if t < n_x and nn < n_out else np.float32(0.0)
            if (FRAGS or NORM) and t < ROWS8 and nn < n_out:  # rows from n_x on: zeros, as x_frags makes them
                fv = np.float32(0.0)
                if t < n_x:  # the output, or (NORM) its row times the norm's weight and prescale
                    fv = v * gw[nn] * _prev_scale(ninv, t) if NORM else v
                h16 = np.uint16(f32x2_to_f16x2(fv, np.float32(0.0)) & U(0xFFFF))
                f4[frag_u16(1, nn, t, ROWS8)] = h16
                f6[frag_u16(0, nn, t, ROWS8)] = h16
                if abs(fv) >= F16_SAFE:
                    fl4[t] = 1
                    fl6[t] = 1
        if NORM:
            _norm_tail(out, n_out, n_x, gw, f4, f6, fl4, nparts, ncount, nscale, ninv, eps, sqs, ibuf, nred, tid)

    return pdl_ready(kernel)


def plan(n_x: int, n_out: int, k: int, gated: bool = False) -> tuple[int, int]:
    """(tiles a warp, warps a block). The warps split K and so set the order of the sums:
    they depend on W's shape only (about GRID_WARPS warps with one tile a warp, at most 8
    warps, at most a block each). Two tiles share each x fragment (half the x reads) while
    the grid keeps 1024 warps (~8 an SM) and up to 24 rows of x (registers): at 23 rows two
    tiles took Q6_K 4096x12288 from 40.8 to 36.4 us and Q4_K 4096x4096 from 12.9 to 12.3;
    1024-row outputs (256 warps with two) went from 7.9 / 9.9 to 11.0 / 15.4 (H200)."""
    nb = k // QK
    tiles16 = -(-n_out // 16)
    warps = 1
    while warps < 8 and warps < nb and tiles16 * warps < GRID_WARPS:
        warps *= 2
    if gated:
        return 2, warps
    tiles = 2 if n_x <= 24 and -(-n_out // 32) * warps >= 1024 else 1
    return (PLAIN_TILES or tiles), warps


def _check(qtype, x_dev, what):
    qtype = as_qtype(qtype)
    if qtype not in MMA_TYPES:
        raise ValueError(f"{what}: {qtype.name} weights are not supported (Q4_K and Q6_K only)")
    n_x, k = x_dev.shape
    if not 1 <= n_x <= MAX_ROWS or k % QK:
        raise ValueError(f"{what}: x of {n_x} rows x {k} (1..{MAX_ROWS} rows, K a multiple of {QK})")
    return qtype, n_x, k


def matvec_mma(w_dev, qtype, x_dev, n_out: int, out=None, bias=None, residual=None, stream=0, tiles=None,
               warps=None, w_up=None, frags=None, guard=True, frags_out=False, layout=None):
    """y [n_x, n_out] = x [n_x, K] @ W^T (+ bias) (+ residual) for a Q4_K or Q6_K weight (raw
    uint8 rows) and 1..MAX_ROWS rows of x (float32, on the device); residual may be out
    itself. With w_up (same type and shape): silu(x W^T) * (x W_up^T), no bias or residual.
    Same semantics as matvec_ref / swiglu_ref. tiles, warps: see plan (its choice by default).
    frags: x_frags(x_dev, qtype, stream) already made for this x (products of one x and
    weight type share one conversion); guard: see x_frags. frags_out (gated): the output's
    own fragments for both layouts are written too, all but frags_fixup(out, layout,
    gated_out=True) (a verification forward's down projection: one launch fewer). layout
    "g8": a Q6_K weight (not gated) in luce.kernels.q6k_groups' layout."""
    qtype, n_x, k = _check(qtype, x_dev, "matvec_mma")
    if layout not in (None, "g8") or layout and (qtype != T.Q6_K or w_up is not None or k % 2048):
        raise ValueError(f"matvec_mma: layout {layout!r}: None, or 'g8' for a Q6_K weight of 2048k columns, not gated")
    gated = w_up is not None
    if frags_out and (not gated or n_out % QK):
        raise ValueError("matvec_mma: frags_out needs the gated form and n_out a multiple of 256")
    w16, _ = weight_u16(w_dev, qtype, k)
    u16 = weight_u16(w_up, qtype, k)[0] if gated else w16
    xq, xs = frags if frags is not None else x_frags(x_dev, qtype, stream, guard)
    if out is None:
        out = cuda.device_array((n_x, n_out), np.float32, stream=stream)
    pt, pw = plan(n_x, n_out, k, gated)
    tiles, warps = (2 if gated else tiles or pt), warps or pw
    _launch(qtype, k, w16, u16, xq, xs, n_x, n_out, out, bias, residual, tiles, warps, gated, stream,
            frags_out=frags_out, g8=layout == "g8")
    return out


def matvec_mma_norm(w_dev, qtype, x_dev, residual, norm_w, eps: float, stream=0, frags=None, layout=None):
    """residual += x W^T (in place) and the RMSNorm of the result, h = RMSNorm(residual) *
    norm_w, left to the products that read h: returns {qtype: (fragments, row scales)} of
    both weight layouts for matvec_mma's `frags`, whose row scales are 1 / rms(residual's
    row) over the prescale the fragments were written with (the products multiply by them).
    The fragments hold residual * norm_w * the last 1 / rms of this stream (_norm_scratch;
    a row reaching f16's range anyway: h itself, scale 1); h is never written. The blocks
    add up their outputs' squares, and the last block to finish the scales: one launch where the product
    and rms_norm_frags took two (a verification forward's o and down projections).
    norm_w: float32 [n_out] on the device; n_out a multiple of 256. frags, layout: as
    matvec_mma."""
    qtype, n_x, k = _check(qtype, x_dev, "matvec_mma_norm")
    n_out = residual.shape[1]
    if n_out % QK or tuple(residual.shape) != (n_x, n_out) or norm_w.shape[0] != n_out:
        raise ValueError(f"matvec_mma_norm: residual {tuple(residual.shape)}, norm {tuple(norm_w.shape)}: "
                         f"[{n_x}, n_out] and [n_out], n_out a multiple of {QK}")
    if layout not in (None, "g8") or layout and (qtype != T.Q6_K or k % 2048):
        raise ValueError(f"matvec_mma_norm: layout {layout!r}: None, or 'g8' for a Q6_K weight of 2048k columns")
    w16, _ = weight_u16(w_dev, qtype, k)
    xq, xs = frags if frags is not None else x_frags(x_dev, qtype, stream)
    tiles, warps = plan(n_x, n_out, k)
    rows8 = -(-n_x // 8) * 8
    # buffers of their own (gated_out=2): a gated product reading them never writes them
    (f4, fl4, _), (f6, _, _) = (_scratch(rows8, n_out, qt, stream, 2) for qt in (T.Q4_K, T.Q6_K))
    parts, count, scales, invs = _norm_scratch(rows8, n_out, stream)
    _launch(qtype, k, w16, w16, xq, xs, n_x, n_out, residual, None, residual, tiles, warps, False, stream,
            g8=layout == "g8", norm=(norm_w, parts, count, scales, invs, np.float32(eps),
                                     f4.view(np.uint16), f6.view(np.uint16), fl4))
    return {T.Q4_K: (f4.view(np.uint16), scales), T.Q6_K: (f6.view(np.uint16), scales)}


# (rows8, K, stream) -> (partial sums, block counter, row scales, rows' 1 / rms) of matvec_mma_norm
_NORM_SCRATCH: dict = {}


def _norm_scratch(rows8: int, k: int, stream):
    """matvec_mma_norm's buffers for rows of K: partial sums (room for K / 16 blocks), the
    block counter, the row scales the products apply, and the rows' 1 / rms, the next
    launch's prescale (rms_norm_frags leaves its 1 / rms there too: the residual stream's
    rows change little from one norm to the next, so x w times the last 1 / rms stays in f16's range, where x w
    alone did not: a random-weight model's stream reaches past 2^15 and every row took the
    last block's slow rewrite, 5.4 -> 11.7 ms for the 8B shape's 23-node forward, H100)."""
    key = (rows8, k, id(stream))
    if key not in _NORM_SCRATCH:
        _NORM_SCRATCH[key] = (cuda.device_array(rows8 * (k // 16), np.float32), cuda.to_device(np.zeros(1, np.int32)),
                              cuda.device_array(rows8, np.float32), cuda.to_device(np.ones(rows8, np.float32)))
    return _NORM_SCRATCH[key]


def _launch(qtype, k, w0, w1, xq, xs, n_x, n_out, out, bias, residual, tiles, warps, gated, stream,
            n_a=None, out_b=None, bias_b=None, frags_out=False, g8=False, third=None, norm=None):
    """The kernel over n_out output rows; with out_b, rows from n_a on are w1's, into out_b;
    third (qtype, w2, xq2, xs2, n_ab, out_c, bias_c): rows from n_ab on are w2's, into out_c;
    norm (gw, parts, count, scales, invs, eps, f4, f6, flags): matvec_mma_norm's."""
    pair = out_b is not None
    # absent epilogues: never read, but numba needs arrays of the right kinds
    b = bias if bias is not None else out.reshape(out.size)
    r = residual if residual is not None else out
    bb = bias_b if bias_b is not None else b
    rows8 = -(-n_x // 8) * 8
    if frags_out:
        (f4, fl4, _), (f6, fl6, _) = (_scratch(rows8, n_out, qt, stream, True) for qt in (T.Q4_K, T.Q6_K))
        f4, f6 = f4.view(np.uint16), f6.view(np.uint16)
    else:
        f4 = f6 = w0
        fl4 = fl6 = unit_flags()
    rows = 16 if gated else 16 * tiles
    if third is not None:
        qt3, w2, xq2, xs2, n_ab, out_c, bias_c = third
        bias_c = bias_c if bias_c is not None else b
    else:
        qt3, w2, xq2, xs2, n_ab, out_c, bias_c = None, w0, xq, xs, n_out, out, b
    if norm is not None:
        gw, parts, count, scales, invs, eps, f4, f6, fl4 = norm
        fl6 = fl4
    else:
        gw, parts, count, scales, invs, eps = b, b, fl4, b, b, np.float32(0.0)
    _kernel(qtype, rows8 // 8, tiles, warps, gated, pair, frags_out, g8, qt3, norm is not None)[
        -(-n_out // rows), 32 * warps, stream](
        w0, w1, xq, xs, n_out, k // QK, n_x, b, r, int(bias is not None), int(residual is not None), out,
        n_a if pair else n_out, bb, out_b if pair else out, f4, f6, fl4, fl6, w2, xq2, xs2, n_ab, bias_c, out_c,
        gw, parts, count, scales, invs, eps)


def matvec_mma_pair(w_a, w_b, qtype, x_dev, n_a: int, n_b: int, out_a, out_b, bias_a=None, bias_b=None, stream=0,
                    frags=None, third=None):
    """matvec_mma of one x by two weights of one type and width in one launch: out_a = x W_a^T
    (+ bias_a), out_b = x W_b^T (+ bias_b), both biases or neither. Verification's q and k
    projections: the 1024-row k product alone is a small grid's latency (and a launch), here
    its blocks run beside q's. The K split is planned for n_a + n_b rows.

    third (w_c, qtype_c, n_c, out_c, bias_c, frags_c): a third weight of the same width, any
    MMA type, in the same launch (v, Q6_K in a Q4_K_M model, beside q and k), over x's
    fragments for its own type (frags_c, or made here); n_a + n_b must be a multiple of
    third_align(n_x, n_a + n_b, k). At 23 rows v alone was a 3.4 MB product taking ~8 us
    of latency (H100, `.gpujobs/sweep.py`, thirty-second session). Returns (out_a, out_b,
    out_c) then."""
    qtype, n_x, k = _check(qtype, x_dev, "matvec_mma_pair")
    if (bias_a is None) != (bias_b is None):
        raise ValueError("matvec_mma_pair: both biases or neither")
    xq, xs = frags if frags is not None else x_frags(x_dev, qtype, stream)
    tiles, warps = plan(n_x, n_a + n_b, k)
    t3 = None
    if third is not None:
        w_c, qt_c, n_c, out_c, bias_c, frags_c = third
        qt_c = as_qtype(qt_c)
        if qt_c not in MMA_TYPES or (bias_c is None) != (bias_a is None):
            raise ValueError(f"matvec_mma_pair: third weight {qt_c.name}, bias {bias_c is not None}: an MMA type, "
                             "biased as the pair")
        if (n_a + n_b) % third_align(n_x, n_a + n_b, k):
            raise ValueError(f"matvec_mma_pair: {n_a + n_b} rows before the third weight: not a multiple of "
                             f"{third_align(n_x, n_a + n_b, k)}")
        xq2, xs2 = frags_c if frags_c is not None else x_frags(x_dev, qt_c, stream)
        t3 = (qt_c, weight_u16(w_c, qt_c, k)[0], xq2, xs2, n_a + n_b, out_c, bias_c)
        n_c = int(n_c)
    else:
        n_c = 0
    _launch(qtype, k, weight_u16(w_a, qtype, k)[0], weight_u16(w_b, qtype, k)[0], xq, xs, n_x, n_a + n_b + n_c,
            out_a, bias_a, None, tiles, warps, False, stream, n_a, out_b, bias_b, third=t3)
    return (out_a, out_b) if third is None else (out_a, out_b, t3[5])


def third_align(n_x: int, n_ab: int, k: int) -> int:
    """Rows a block of matvec_mma_pair's launch over n_ab (+ a third weight's) rows: the
    third weight's rows must start at a multiple of it."""
    tiles, _ = plan(n_x, n_ab, k)
    return 16 * tiles
