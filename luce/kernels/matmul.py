"""Prefill matrix product Y[M, N] = X[M, K] @ W[N, K]^T on raw GGUF weights.

One kernel body for every weight type. A thread block owns a BM x BN tile of Y and walks K
in steps of BK: each step its threads load (16-byte loads where the layout allows) an X tile
and the raw bytes of a W tile into registers, convert both to f16 and store them in shared
memory, and the warps multiply the shared tiles, with tensor cores
(`mma.sync.m16n8k16.row.col.f32.f16.f16.f32`, f32 accumulation) or with plain FMAs. The
loads of step s+1 are issued before the multiplication of step s so that their latency
hides behind it (register double-buffering; one shared buffer, two barriers a step).

A gated FFN (SwiGLU, GeGLU) is one launch of this kernel with W_up beside W (matmul's
w_up): the tile's rows interleave the two weights and the epilogue applies the activation.

The per-type part is two device functions over a unit of 8 consecutive weights of one row:
`load` fetches the raw words the unit needs and `decode` turns them into the unit's 8
unsigned byte values q and a scale pair (s, o) with w = s * q + o (F16 needs no decode).
Decoding to f16 uses the f16x2 magic-number trick: byte q placed under the f16 exponent
0x64 reads as 1024 + q, so one byte permute, one f16x2 subtract and one f16x2 FMA make two
weights; the subtract happens before the scale so that no large intermediate loses bits.

Measured on the H200 (GPU time, M=512, `python -m luce.bench.kernels_matmul`): Q4_K 174 /
179 / 164 TFLOP/s at K x N = 4096 x 12288 / 12288 x 4096 / 4096 x 4096, Q6_K ~124, Q4_0
~120, Q8_0 ~85 (its word loads are still 16-bit on odd blocks), F16 weights 187-212, the
FMA path ~19. With F16 weights close to Q4_K, the limit is the skeleton (one 8-warp block
per SM at ~170-220 registers, load/decode and mma phases separated by barriers), not the
decoding. Tile sweeps: BK=64 beats BK=32 (fewer barriers per flop), ldmatrix beats 32-bit
fragment loads, two shared buffers or two register-capped blocks per SM did not help.
Host cost of one matmul() call is ~400 us (two numba launches and argument marshalling):
more than the GPU time of a 4096 x 4096 product, so prefill wants CUDA graphs.

Small M (speculative verification: 8-64 rows) is a different regime: each weight byte
serves only M rows, so the product is bound by streaming W from HBM, not by the tensor
cores, and the 128 x 128 tile wastes most of its rows and launches N / 128 blocks for 132
SMs. pick_tile (what matmul uses when tile=None) then takes one of TILES_SMALL_M: a row tile
of 16, 32 or 64 rows that holds all of M (W is read once), 64-128 columns and 4-8 warps, at
~95-165 registers so that 2-5 blocks share an SM, and splits K (choose_splits) until the grid
fills the resident-block slots. Split-K blocks of one output tile leave their partial sums in
a workspace; the last to arrive (an atomic counter per tile) adds them in split order and
runs the epilogue, so one launch does it and the result does not depend on scheduling.
Expected on the H200 (not yet measured; `python -m luce.bench.kernels_matmul --small-m`):
M=16 near weight-streaming speed (Q4_K 4096 x 12288, 28 MB: ~10-15 us), against ~145 us for
the batched matvec; M=64 about twice that, where mma issue starts to count.

In the CUDA simulator (no inline asm, no warp-level instructions) the same code runs with
Python stand-ins; mma and ldmatrix are emulated through a per-warp shared scratch array, so
the tensor-core path's indexing can be checked there too (slowly: tiny shapes only).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .device import device
from .dequant import dequantize
from .f16_range import F16_SAFE, FIXUP_THREADS, new_flags, row_fixup_scale, unit_scales
from .mma import (SCRATCH, SHARED16, bits, f32x2_to_f16x2, hfma2, hsub2, ldsm_x4, mma_f16, or32, pack16, prmt, shl32,
                  sts4)
from .activation import gelu_tanh
from .matvec import silu
from .quant_types import as_qtype, block_elems, row_bytes
from .vector_load import SIM, f16_bits_to_f32, ldg_u16_u32, ldg_u16_u32x4, u32_bits_to_f32
from .pdl import grid_dependency_sync, ready as pdl_ready
from .split_merge import arrive

__all__ = ["MATMUL_TYPES", "TILE_GPU", "TILE_SIM", "TILES_SMALL_M", "auto_splits", "choose_splits", "matmul", "matmul_ref",
           "pick_tile", "to_f16"]

_dev = device  # plain Python in the simulator where it can be: see luce.kernels.device

_F16_1024 = np.uint32(0x64006400)  # f16x2 (1024, 1024)
_BYTE_64 = np.uint32(0x64646464)


@_dev
def deq8(b0, b1, s, o):
    """Eight weights s * q + o as four f16x2 words; q = the bytes of b0 then b1."""
    s2 = f32x2_to_f16x2(s, s)
    o2 = f32x2_to_f16x2(o, o)
    return (hfma2(hsub2(prmt(b0, _BYTE_64, 0x5140), _F16_1024), s2, o2),
            hfma2(hsub2(prmt(b0, _BYTE_64, 0x7362), _F16_1024), s2, o2),
            hfma2(hsub2(prmt(b1, _BYTE_64, 0x5140), _F16_1024), s2, o2),
            hfma2(hsub2(prmt(b1, _BYTE_64, 0x7362), _F16_1024), s2, o2))


@_dev
def h2f(h):
    return f16_bits_to_f32(h & 0xFFFF)


# ----------------------------------------------------------------------------------------
# Per-type units. A unit is 8 * J consecutive weights of one row (J = 4 for the block
# types: 32 weights share a scale and their bytes are contiguous, so one scale computation
# and a few wide loads serve them all). `load(w, rh, k, raw, i)` writes the raw words of
# weights k .. k + 8J - 1 of the row starting at uint16 index rh of w into raw[i, :];
# `decode(raw, i, k, j)` returns (b0, b1, s, o) for weights k + 8j .. k + 8j + 7, with s and
# o depending on k only, so that the compiler shares them between the J calls. Layouts
# follow ggml-quants.c; blocks are only 2-byte aligned in general (ldw picks the load).
# ----------------------------------------------------------------------------------------
@_dev
def ldw(w, h):
    """The 32-bit word at uint16 index h of w, for any parity of h."""
    if h & 1:
        return pack16(w[h], w[h + 1])
    return ldg_u16_u32(w, h)


@_dev
def ldw8(w, h, raw, i, o):
    """raw[i, o:o + 8] = the 8 words from uint16 index h of w, with aligned 32-bit loads
    either way: for odd h, 9 words from h - 1 and byte permutes (reads the 2 bytes on
    either side, so only for ranges inside a block)."""
    if h & 1:
        prev = ldg_u16_u32(w, h - 1)
        for q in range(8):
            nxt = ldg_u16_u32(w, h + 1 + 2 * q)
            raw[i, o + q] = prmt(prev, nxt, 0x5432)
            prev = nxt
    else:
        for q in range(8):
            raw[i, o + q] = ldg_u16_u32(w, h + 2 * q)


@_dev
def load_f16(w, rh, k, raw, i):  # rows of K halves; K % 8 == 0 keeps rows 16-byte aligned
    a, b, c, d = ldg_u16_u32x4(w, rh + k)
    raw[i, 0] = a
    raw[i, 1] = b
    raw[i, 2] = c
    raw[i, 3] = d


@_dev
def decode_none(raw, i, k, j):
    return np.uint32(0), np.uint32(0), np.float32(0.0), np.float32(0.0)


# Q8_0, 34 bytes: d (f16) qs[32] (int8). A unit is a block; bytes are biased by 128 to make
# them unsigned.
@_dev
def load_q8_0(w, rh, k, raw, i):
    bo = rh + 17 * (k >> 5)
    for q in range(8):
        raw[i, q] = ldw(w, bo + 1 + 2 * q)
    raw[i, 8] = w[bo]


@_dev
def decode_q8_0(raw, i, k, j):
    d = h2f(raw[i, 8])
    flip = np.uint32(0x80808080)
    return (bits(raw[i, 2 * j], 0, 0xFFFFFFFF) ^ flip, bits(raw[i, 2 * j + 1], 0, 0xFFFFFFFF) ^ flip,
            d, np.float32(-128.0) * d)


# Q4_0, 18 bytes: d (f16) qs[16]; weight l < 16 is the low nibble of qs[l], l >= 16 the
# high nibble of qs[l - 16]. A unit is a block.
@_dev
def load_q4_0(w, rh, k, raw, i):
    bo = rh + 9 * (k >> 5)
    for q in range(4):
        raw[i, q] = ldw(w, bo + 1 + 2 * q)
    raw[i, 4] = w[bo]


@_dev
def decode_q4_0(raw, i, k, j):
    d = h2f(raw[i, 4])
    q = 2 * (j & 1)
    sh = 4 * (j >> 1)
    return bits(raw[i, q], sh, 0x0F0F0F0F), bits(raw[i, q + 1], sh, 0x0F0F0F0F), d, np.float32(-8.0) * d


# Q4_K, 144 bytes: d dmin (f16) scales[12] qs[128]. Weight 64u + 32h + l is nibble h of
# qs[32u + l], in sub-block 2u + h with a 6-bit scale and min; a unit is a sub-block.
# 144 = 9 * 16 and rows are whole blocks, so blocks are 16-byte aligned: the header and the
# unit's 32 qs bytes are three vector loads.
@_dev
def load_q4_k(w, rh, k, raw, i):
    bo = rh + 72 * (k >> 8)
    a, b, c, d = ldg_u16_u32x4(w, bo)
    raw[i, 0] = a
    raw[i, 1] = b
    raw[i, 2] = c
    raw[i, 3] = d
    q = bo + 8 + 16 * ((k >> 6) & 3)
    for v in range(2):
        a, b, c, d = ldg_u16_u32x4(w, q + 8 * v)
        raw[i, 4 + 4 * v] = a
        raw[i, 5 + 4 * v] = b
        raw[i, 6 + 4 * v] = c
        raw[i, 7 + 4 * v] = d


@_dev
def decode_q4_k(raw, i, k, j):
    h = (k >> 5) & 1
    sb = ((k >> 6) & 3) * 2 + h  # sub-block 0..7
    sh = 8 * (sb & 3)
    if sb < 4:
        sc = bits(raw[i, 1], sh, 63)
        mn = bits(raw[i, 2], sh, 63)
    else:
        sc = or32(bits(raw[i, 3], sh, 15), shl32(bits(raw[i, 1], sh + 6, 3), 4))
        mn = or32(bits(raw[i, 3], sh + 4, 15), shl32(bits(raw[i, 2], sh + 6, 3), 4))
    d = h2f(raw[i, 0])
    dmin = h2f(bits(raw[i, 0], 16, 0xFFFF))
    return (bits(raw[i, 4 + 2 * j], 4 * h, 0x0F0F0F0F), bits(raw[i, 5 + 2 * j], 4 * h, 0x0F0F0F0F),
            d * np.float32(sc), -dmin * np.float32(mn))


# Q6_K, 210 bytes: ql[128] qh[64] scales[16] (int8) d (f16). Weight 128n + 32g + l:
# low 4 bits = nibble g >> 1 of ql[64n + 32(g & 1) + l], high 2 bits = bits 2g of
# qh[32n + l], scale index (128n + 32g + l) >> 4; q is biased by 32. A unit is one
# (n, g): 32 weights, two scales.
@_dev
def load_q6_k(w, rh, k, raw, i):
    bo = rh + 105 * (k >> 8)
    e = k & 255
    n = e >> 7
    g = (e >> 5) & 3
    ldw8(w, bo + 32 * n + 16 * (g & 1), raw, i, 0)
    ldw8(w, bo + 64 + 16 * n, raw, i, 8)
    raw[i, 16] = pack16(w[bo + 96 + (e >> 5)], w[bo + 104])  # scales (e >> 4), (e >> 4) + 1; d


@_dev
def decode_q6_k(raw, i, k, j):
    g = (k >> 5) & 3
    lo = 4 * (g >> 1)
    hs = 2 * g
    b0 = or32(bits(raw[i, 2 * j], lo, 0x0F0F0F0F), shl32(bits(raw[i, 8 + 2 * j], hs, 0x03030303), 4))
    b1 = or32(bits(raw[i, 2 * j + 1], lo, 0x0F0F0F0F), shl32(bits(raw[i, 9 + 2 * j], hs, 0x03030303), 4))
    sc = np.int32(bits(raw[i, 16], 8 * (j >> 1), 0xFF))
    sc = sc - ((sc & 0x80) << 1)
    s = h2f(bits(raw[i, 16], 16, 0xFFFF)) * np.float32(sc)
    return b0, b1, s, np.float32(-32.0) * s


class _Spec:
    def __init__(self, qk, j, nraw, load, decode, direct=False, align=2):
        self.qk, self.j, self.nraw, self.load, self.decode = qk, j, nraw, load, decode
        self.direct, self.align = direct, align


from gguf import GGMLQuantizationType as _T  # noqa: E402

_SPECS = {
    _T.F16: _Spec(8, 1, 4, load_f16, decode_none, direct=True, align=16),
    _T.Q8_0: _Spec(32, 4, 9, load_q8_0, decode_q8_0),
    _T.Q4_0: _Spec(32, 4, 5, load_q4_0, decode_q4_0),
    _T.Q4_K: _Spec(256, 4, 12, load_q4_k, decode_q4_k, align=16),
    _T.Q6_K: _Spec(256, 4, 17, load_q6_k, decode_q6_k),
}
MATMUL_TYPES = frozenset(_SPECS)

# (BM, BN, BK, WM, WN, fragment loads[, stages]): block tile, warp tile; "ldsm" = ldmatrix,
# "lds" = 32-bit shared loads; stages: shared buffers (1 or 2, see the kernel's loop). The
# simulator default is small enough for ~1e5 thread-iterations.
TILE_GPU = (128, 128, 64, 64, 32, "ldsm", 1)
TILE_SIM = (16, 32, 64, 16, 16, "lds", 2)

# Small M (speculative verification, 8-64 rows): (largest M, tile, resident blocks per SM).
# Each weight byte then serves only M rows, so the kernel has to stream W at HBM speed
# rather than feed tensor cores: BM takes all the rows (W is read once), BN is small and
# the K range is split (choose_splits) so that every SM holds several blocks, and the bytes
# in flight, which live in registers between a step's loads and its decode, add up to
# what Little's law asks (~3 TB/s x ~1 us: ~24 KB an SM). BK=128 with 4 warps keeps a
# thread at 2 W units: ~95-130 registers, 4-5 blocks an SM, ~20 KB of W in flight; BK=256
# held twice the bytes a thread but at 180-250 registers allowed only 2 blocks, and one
# block's barrier stall then idles half the SM. Blocks per SM: from ptxas -v (sm_90)
# register counts and the shared sizes; it only steers the split count.
TILES_SMALL_M = (
    (16, (16, 64, 128, 16, 16, "ldsm", 2), 4),    # Q4_K 93 registers, Q6_K 128
    (32, (32, 64, 128, 32, 16, "ldsm", 1), 3),    # 130-190
    (127, (64, 128, 64, 32, 32, "ldsm", 1), 2),   # ~126, 8 warps
)
MAX_SPLITS = 16  # beyond, the partial sums (splits x M x N x 8 bytes) cost more than the blocks win
_SMS: dict = {}


def _num_sms() -> int:
    if "n" not in _SMS:
        try:
            _SMS["n"] = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
        except Exception:  # simulator or no device yet: the H200's count
            _SMS["n"] = 132
    return _SMS["n"]


def _fit_bk(tile, qtype, k):
    """tile with BK halved until it divides k (down to the type's unit), so that small-M
    tiles also serve widths like 896 that are not multiples of 256."""
    bk, unit = tile[2], 8 * _SPECS[qtype].j
    while k % bk and bk // 2 >= max(unit, 16) and (bk // 2) % unit == 0:
        bk //= 2
    return tile[:2] + (bk,) + tile[3:]


def choose_splits(blocks: int, nk: int, per_sm: int, sms: int) -> int:
    """Split-K factor for a grid of `blocks` tiles with nk K steps each: the fewest splits
    that use >= 85% of the resident-block slots of the last wave (a partial last wave idles
    SMs for a whole block's time), else the best found; at least 2 K steps a split so that
    each block still overlaps one step's loads with the previous step's work."""
    cap = per_sm * sms
    best, best_eff = 1, 0.0
    for s in range(1, max(1, min(MAX_SPLITS, nk // 2)) + 1):
        b = blocks * s
        eff = b / (-(-b // cap) * cap)
        if eff >= 0.85:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def pick_tile(m: int, n: int, k: int, qtype, sim: bool = SIM):
    """(tile, splits) that matmul uses by default for an M x K @ (N x K)^T product: the
    big tile from 128 rows on, else the TILES_SMALL_M entry for m with the split-K factor
    of choose_splits; in the simulator TILE_SIM, unsplit."""
    qtype = as_qtype(qtype)
    if sim:
        return TILE_SIM, 1
    if m >= 128:
        # one block an SM: a product of few column tiles (k and v, 1024 rows, at 512 rows of
        # x: 32 blocks for 132 SMs) took a full block's time on a quarter of the GPU (the
        # Qwen3-8B prefill's q/k/v, three launches, 346 us a layer against 121 for o alone;
        # H200). Split K until the wave is full: 512-token prefill 8,627 -> 9,423 tok/s for
        # the 8B shape, 1,808 -> 2,202 for the 32B (its down and o also split; b2738c0).
        return TILE_GPU, auto_splits(TILE_GPU, m, n, k, 1)
    for m_max, tile, per_sm in TILES_SMALL_M:
        if m <= m_max:
            break
    tile = _fit_bk(tile, qtype, k)
    return tile, auto_splits(tile, m, n, k, per_sm)


def auto_splits(tile, m: int, n: int, k: int, per_sm: int) -> int:
    """choose_splits for `tile` on this product and device (per_sm: resident blocks an SM)."""
    blocks = -(-n // tile[1]) * -(-m // tile[0])
    return choose_splits(blocks, k // tile[2], per_sm, _num_sms())


def _build(qtype, tile, use_mma: bool, x_f16: bool, has_bias: bool, has_res: bool, min_blocks=None,
           split=False, scaled=False, gated=None):
    spec = _SPECS[qtype]
    BM, BN, BK, WM, WN, frag = tile[:6]
    STAGES = tile[6] if len(tile) > 6 else 1
    assert STAGES in (1, 2) and 4 * (BM + BN) * (BK // 2 + 4) * STAGES <= 48 * 1024
    assert BM % WM == 0 and BN % WN == 0 and WM % 16 == 0 and WN % 8 == 0 and BK % 16 == 0
    WGN = BN // WN
    NWARP = (BM // WM) * WGN
    NT = 32 * NWARP
    MT, NT8 = WM // 16, WN // 8
    LDSM = frag == "ldsm"
    assert not LDSM or NT8 % 2 == 0
    J = spec.j
    C8 = BK // 8                       # X units (8 elements) per tile row
    CW = BK // (8 * J)                 # W units per tile row
    assert CW * 8 * J == BK, "BK must be a multiple of the type's unit"
    XTOT, WTOT = BM * C8, BN * CW      # units per tile; threads take them round-robin
    XU, WU = -(-XTOT // NT), -(-WTOT // NT)
    XALL, WALL = XU * NT == XTOT, WU * NT == WTOT  # no guard needed when they divide evenly
    SA = BK // 2 + 4                   # words per shared row; +4 makes fragment loads conflict-free
    XR = 4 if x_f16 else 8             # raw X words per unit
    NRAW = spec.nraw
    DIRECT = spec.direct
    load_w, decode_w = spec.load, spec.decode
    OUTS = BM * BN // NT               # FMA path: outputs per thread
    TM = 1
    while TM * TM < OUTS:
        TM *= 2
    TN = OUTS // TM
    assert TM * TN == OUTS and BM % TM == 0 and BN % TN == 0
    FTN = BN // TN                     # FMA threads along N
    NACC = MT * NT8 * 4 if use_mma else OUTS  # accumulators per thread
    SPLIT = bool(split)
    SCR = (NWARP, 32, SCRATCH) if SIM else (1,)
    ASZ, BSZ = BM * SA, BN * SA        # words of one buffer of each tile
    ASH, BSH = ASZ * STAGES, BSZ * STAGES  # shared sizes must be compile-time constants
    HAS_BIAS, HAS_RES, XF16, MMA = has_bias, has_res, x_f16, use_mma
    SCALED = bool(scaled)  # x rows scaled into f16's range by to_f16: outputs times xs[m]
    # gated ("silu": SwiGLU, y = silu(X W_gate^T) * (X W_up^T); "gelu_tanh": GeGLU): the
    # tile's W rows alternate GP rows of W_gate and the same GP rows of W_up, so a thread
    # holds each output's gate and up sums (GP: an mma's 8 columns; on the FMA path a
    # thread's column stride) and the epilogue writes y. Why: gate and up as two launches
    # and an activation pass wrote and re-read both products (Qwen3-32B, 512 rows: 2 x 52
    # MB, then 52 MB out), and each launch of 800 blocks ended in a wave of 8 blocks on 132
    # SMs (one launch of 1600: 13 waves, not 14). H200: 0.91-0.94x the time (docs/benchmarks.md).
    GATED = bool(gated)
    GELU = gated == "gelu_tanh"
    assert gated in (None, "silu", "gelu_tanh"), gated
    GP = 8 if use_mma else FTN
    assert not GATED or (not has_bias and not has_res and BN % (2 * GP) == 0
                         and (NT8 % 2 == 0 and WN % 16 == 0 if use_mma else TN % 2 == 0))

    @_dev
    def load_tiles(x, w, w_up, M, K, rowh_w, m0, n0, k0, tid, xr, wr, N):
        for i in range(XU):
            u = tid + NT * i
            r = u // C8
            c = u - r * C8
            m = m0 + r
            if not XALL and u >= XTOT:
                pass
            elif m < M:
                if XF16:
                    a, b, cc, d = ldg_u16_u32x4(x, m * K + k0 + 8 * c)
                    xr[i, 0] = a
                    xr[i, 1] = b
                    xr[i, 2] = cc
                    xr[i, 3] = d
                else:
                    for hh in range(2):
                        a, b, cc, d = ldg_u16_u32x4(x, 2 * (m * K + k0 + 8 * c) + 8 * hh)
                        xr[i, 4 * hh] = a
                        xr[i, 4 * hh + 1] = b
                        xr[i, 4 * hh + 2] = cc
                        xr[i, 4 * hh + 3] = d
            else:
                for j in range(XR):
                    xr[i, j] = 0
        for i in range(WU):
            u = tid + NT * i
            r = u // CW
            c = u - r * CW
            n = n0 + r
            if not WALL and u >= WTOT:
                pass
            elif n < N:
                if GATED:  # tile row n: row (n // 2GP) GP + n % GP of W_gate, or of W_up
                    wrow = (n // (2 * GP)) * GP + n % GP
                    load_w(w_up if (n // GP) & 1 else w, wrow * rowh_w, k0 + 8 * J * c, wr, i)
                else:
                    load_w(w, n * rowh_w, k0 + 8 * J * c, wr, i)
            else:
                for j in range(NRAW):
                    wr[i, j] = 0

    @_dev
    def store_tiles(As, Bs, ao, bo, k0, tid, xr, wr):
        for i in range(XU):
            u = tid + NT * i
            r = u // C8
            c = u - r * C8
            o = ao + r * SA + 4 * c
            if not XALL and u >= XTOT:
                pass
            elif XF16:
                sts4(As, o, xr[i, 0], xr[i, 1], xr[i, 2], xr[i, 3])
            else:
                sts4(As, o, f32x2_to_f16x2(u32_bits_to_f32(xr[i, 0]), u32_bits_to_f32(xr[i, 1])),
                     f32x2_to_f16x2(u32_bits_to_f32(xr[i, 2]), u32_bits_to_f32(xr[i, 3])),
                     f32x2_to_f16x2(u32_bits_to_f32(xr[i, 4]), u32_bits_to_f32(xr[i, 5])),
                     f32x2_to_f16x2(u32_bits_to_f32(xr[i, 6]), u32_bits_to_f32(xr[i, 7])))
        for i in range(WU):
            u = tid + NT * i
            r = u // CW
            c = u - r * CW
            o = bo + r * SA + 4 * J * c
            if not WALL and u >= WTOT:
                pass
            elif DIRECT:
                sts4(Bs, o, wr[i, 0], wr[i, 1], wr[i, 2], wr[i, 3])
            else:
                for j in range(J):
                    b0, b1, s, off = decode_w(wr, i, k0 + 8 * J * c, j)
                    v0, v1, v2, v3 = deq8(b0, b1, s, off)
                    sts4(Bs, o + 4 * j, v0, v1, v2, v3)

    @_dev
    def mma_step(As, Bs, ao, bo, acc, af, bf, scr, wid, lane, wm, wn, g, t):
        for kk in range(BK // 16):
            kw = 8 * kk
            for i in range(MT):
                if LDSM:
                    a0, a1, a2, a3 = ldsm_x4(
                        As, ao + (wm + 16 * i + (lane & 15)) * SA + kw + 4 * (lane >> 4), scr, wid, lane)
                else:
                    ra = ao + (wm + 16 * i + g) * SA + kw + t
                    a0 = As[ra]
                    a1 = As[ra + 8 * SA]
                    a2 = As[ra + 4]
                    a3 = As[ra + 8 * SA + 4]
                af[i, 0] = a0
                af[i, 1] = a1
                af[i, 2] = a2
                af[i, 3] = a3
            if LDSM:
                for j in range(NT8 // 2):
                    b0, b1, b2, b3 = ldsm_x4(
                        Bs, bo + (wn + 16 * j + (lane & 7) + 8 * (lane >> 4)) * SA + kw + 4 * ((lane >> 3) & 1),
                        scr, wid, lane)
                    bf[2 * j, 0] = b0
                    bf[2 * j, 1] = b1
                    bf[2 * j + 1, 0] = b2
                    bf[2 * j + 1, 1] = b3
            else:
                for j in range(NT8):
                    rb = bo + (wn + 8 * j + g) * SA + kw + t
                    bf[j, 0] = Bs[rb]
                    bf[j, 1] = Bs[rb + 4]
            for i in range(MT):
                for j in range(NT8):
                    d0, d1, d2, d3 = mma_f16(scr, wid, lane, af[i, 0], af[i, 1], af[i, 2], af[i, 3],
                                             bf[j, 0], bf[j, 1],
                                             acc[4 * (i * NT8 + j)], acc[4 * (i * NT8 + j) + 1],
                                             acc[4 * (i * NT8 + j) + 2], acc[4 * (i * NT8 + j) + 3])
                    acc[4 * (i * NT8 + j)] = d0
                    acc[4 * (i * NT8 + j) + 1] = d1
                    acc[4 * (i * NT8 + j) + 2] = d2
                    acc[4 * (i * NT8 + j) + 3] = d3

    @_dev
    def fma_step(As, Bs, ao, bo, acc, af2, bf2, ty, tx):
        for kp in range(BK // 2):
            for i in range(TM):
                a = As[ao + (ty + i * (BM // TM)) * SA + kp]
                af2[i, 0] = h2f(a)
                af2[i, 1] = h2f(a >> 16)
            for j in range(TN):
                b = Bs[bo + (tx + j * FTN) * SA + kp]
                bf2[j, 0] = h2f(b)
                bf2[j, 1] = h2f(b >> 16)
            for i in range(TM):
                for j in range(TN):
                    acc[i * TN + j] += af2[i, 0] * bf2[j, 0] + af2[i, 1] * bf2[j, 1]

    @_dev
    def split_fixup(acc, ws, cnt, flag, nsplit, ks, tid):
        """Split-K: every block of a tile leaves its partial sums in ws; the last one to
        finish adds them all up (its own re-read too) in split order, so that results do not
        depend on which block came last. Returns True in the block that writes the tile."""
        tile_id = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
        base = tile_id * nsplit
        for e in range(NACC):  # thread-fastest layout: each store instruction is coalesced
            ws[((base + ks) * NACC + e) * NT + tid] = acc[e]
        if not arrive(cnt, tile_id, nsplit, flag, tid):  # luce.kernels.split_merge: it resets the count
            return False
        # Plain (L1-cached) loads are safe: no block of this launch has read these words
        # before, so no SM holds a stale copy. The constant-length loop innermost: it is
        # unrolled and acc stays in registers.
        for e in range(NACC):
            acc[e] = 0.0
        for s in range(nsplit):
            for e in range(NACC):
                acc[e] += ws[((base + s) * NACC + e) * NT + tid]
        return True

    @_dev
    def emit(y, bias, res, xs, M, N, m, n, v):
        if m < M and n < N:
            if SCALED:
                v *= xs[m]
            if HAS_BIAS:
                v += bias[n]
            if HAS_RES:
                v += res[m * N + n]
            y[m * N + n] = v

    @_dev
    def emit_gated(y, xs, M, NF, m, n, g, u):
        """y[m, n] = act(g) u (NF columns), g and u scaled as emit scales."""
        if m < M and n < NF:
            if SCALED:
                g *= xs[m]
                u *= xs[m]
            y[m * NF + n] = (gelu_tanh(g) if GELU else silu(g)) * u

    jit = cuda.jit(launch_bounds=(NT, min_blocks)) if min_blocks else cuda.jit

    @jit
    def kernel(x, w, w_up, y, bias, res, ws, cnt, xs, M, N, K, rowh_w, nsplit):
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        As = cuda.shared.array(ASH, np.uint32, alignment=SHARED16)  # 16-byte stores, ldmatrix
        Bs = cuda.shared.array(BSH, np.uint32, alignment=SHARED16)
        scr = cuda.shared.array(SCR, np.uint32)
        flag = cuda.shared.array(1, np.int32)
        xr = cuda.local.array((XU, XR), np.uint32)
        wr = cuda.local.array((WU, NRAW), np.uint32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        n0 = cuda.blockIdx.x * BN
        m0 = cuda.blockIdx.y * BM
        if SPLIT:
            # split ks takes K steps [s0, s1): balanced within one step
            ks = cuda.blockIdx.z
            s0 = (K // BK) * ks // nsplit
            nk = (K // BK) * (ks + 1) // nsplit - s0
            k0 = s0 * BK
        else:
            ks = 0
            nk = K // BK
            k0 = 0
        if MMA:
            acc = cuda.local.array(NACC, np.float32)
            for e in range(NACC):
                acc[e] = 0.0
            af = cuda.local.array((MT, 4), np.uint32)
            bf = cuda.local.array((NT8, 2), np.uint32)
            wm = (wid // WGN) * WM
            wn = (wid % WGN) * WN
            g = lane >> 2
            t = lane & 3
        else:
            acc = cuda.local.array(NACC, np.float32)
            for e in range(NACC):
                acc[e] = 0.0
            af2 = cuda.local.array((TM, 2), np.float32)
            bf2 = cuda.local.array((TN, 2), np.float32)
            ty = tid // FTN
            tx = tid - ty * FTN

        load_tiles(x, w, w_up, M, K, rowh_w, m0, n0, k0, tid, xr, wr, N)
        if STAGES == 2:
            store_tiles(As, Bs, 0, 0, k0, tid, xr, wr)
            cuda.syncthreads()
        for kt in range(nk):
            if STAGES == 2:
                # Step kt reads buffer kt & 1 and fills the other one, which every warp
                # finished reading before the previous barrier: one barrier a step, and
                # warps drift apart so that some multiply while others decode.
                ao = (kt & 1) * ASZ
                bo = (kt & 1) * BSZ
                if kt + 1 < nk:
                    load_tiles(x, w, w_up, M, K, rowh_w, m0, n0, k0 + (kt + 1) * BK, tid, xr, wr, N)
            else:
                ao = 0
                bo = 0
                store_tiles(As, Bs, 0, 0, k0 + kt * BK, tid, xr, wr)
                cuda.syncthreads()
                if kt + 1 < nk:
                    load_tiles(x, w, w_up, M, K, rowh_w, m0, n0, k0 + (kt + 1) * BK, tid, xr, wr, N)
            if MMA:
                mma_step(As, Bs, ao, bo, acc, af, bf, scr, wid, lane, wm, wn, g, t)
            else:
                fma_step(As, Bs, ao, bo, acc, af2, bf2, ty, tx)
            if STAGES == 2:
                if kt + 1 < nk:
                    store_tiles(As, Bs, ASZ - ao, BSZ - bo, k0 + (kt + 1) * BK, tid, xr, wr)
            cuda.syncthreads()

        if SPLIT:
            if not split_fixup(acc, ws, cnt, flag, nsplit, ks, tid):
                return

        if GATED:  # N counts tile rows: twice y's columns
            if MMA:
                for i in range(MT):
                    for j in range(0, NT8, 2):  # columns of block j are W_gate's, of j + 1 W_up's
                        m = m0 + wm + 16 * i + g
                        n = (n0 + wn + 8 * j) // 2 + 2 * t
                        e = 4 * (i * NT8 + j)
                        emit_gated(y, xs, M, N // 2, m, n, acc[e], acc[e + 4])
                        emit_gated(y, xs, M, N // 2, m, n + 1, acc[e + 1], acc[e + 5])
                        emit_gated(y, xs, M, N // 2, m + 8, n, acc[e + 2], acc[e + 6])
                        emit_gated(y, xs, M, N // 2, m + 8, n + 1, acc[e + 3], acc[e + 7])
            else:
                for i in range(TM):
                    for j in range(0, TN, 2):  # column tx + j FTN is W_gate's, + FTN W_up's
                        emit_gated(y, xs, M, N // 2, m0 + ty + i * (BM // TM), n0 // 2 + tx + (j // 2) * FTN,
                                   acc[i * TN + j], acc[i * TN + j + 1])
        elif MMA:
            for i in range(MT):
                for j in range(NT8):
                    m = m0 + wm + 16 * i + g
                    n = n0 + wn + 8 * j + 2 * t
                    e = 4 * (i * NT8 + j)
                    emit(y, bias, res, xs, M, N, m, n, acc[e])
                    emit(y, bias, res, xs, M, N, m, n + 1, acc[e + 1])
                    emit(y, bias, res, xs, M, N, m + 8, n, acc[e + 2])
                    emit(y, bias, res, xs, M, N, m + 8, n + 1, acc[e + 3])
        else:
            for i in range(TM):
                for j in range(TN):
                    emit(y, bias, res, xs, M, N, m0 + ty + i * (BM // TM), n0 + tx + j * FTN, acc[i * TN + j])

    return pdl_ready(kernel), NT


_KERNELS: dict = {}
_DUMMY: dict = {}


def _as_dev(a):
    if a is None:
        return None
    if SIM:
        return cuda.to_device(a) if isinstance(a, np.ndarray) else a
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    if not isinstance(a, DeviceNDArray) and cuda.is_cuda_array(a):
        return cuda.as_cuda_array(a)
    return a


def _flat(a):
    return a.reshape(a.size)


def _ptr(a) -> int:
    return 0 if SIM else int(a.__cuda_array_interface__["data"][0])


def get_kernel(qtype, tile=None, use_mma=None, x_f16=False, has_bias=False, has_res=False, min_blocks=None,
               split=False, scaled=False, gated=None):
    """The compiled-on-first-launch kernel for one configuration, and its block size.
    split: compile the split-K epilogue (partial sums through a workspace); gated: the
    gated form's activation, "silu" or "gelu_tanh" (matmul's w_up and act)."""
    qtype = as_qtype(qtype)
    if qtype not in _SPECS:
        raise NotImplementedError(f"matmul: {qtype.name} is not supported (have {sorted(t.name for t in _SPECS)})")
    tile = tuple(tile or (TILE_SIM if SIM else TILE_GPU))
    use_mma = (not SIM) if use_mma is None else bool(use_mma)
    key = (qtype, tile, use_mma, bool(x_f16), bool(has_bias), bool(has_res), min_blocks, bool(split), bool(scaled),
           gated)
    if key not in _KERNELS:
        _KERNELS[key] = _build(qtype, tile, use_mma, bool(x_f16), bool(has_bias), bool(has_res), min_blocks,
                               bool(split), bool(scaled), gated)
    return _KERNELS[key]


@pdl_ready
@cuda.jit
def _to_f16_kernel(x, out, n2, k, flags):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # a thread a pair of values; a row with a value past f16's range is flagged for the fixup
    i = cuda.grid(1)
    if i < n2:
        a = x[2 * i]
        b = x[2 * i + 1]
        out[i] = f32x2_to_f16x2(a, b)
        if max(abs(a), abs(b)) >= F16_SAFE:
            flags[2 * i // k] = 1


@pdl_ready
@cuda.jit
def _to_f16_fixup(x2, out, flags, scales):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # a block a row (luce.kernels.f16_range): its scale; a flagged row rewritten scaled
    t = cuda.blockIdx.x
    buf = cuda.shared.array(FIXUP_THREADS, np.float32)
    down = row_fixup_scale(x2, t, x2.shape[0], flags, scales, buf)
    if down != 0:  # the same for the whole block
        k = x2.shape[1]
        for c in range(cuda.threadIdx.x, k // 2, cuda.blockDim.x):
            out[t * (k // 2) + c] = f32x2_to_f16x2(x2[t, 2 * c] * down, x2[t, 2 * c + 1] * down)


_XBUF: dict = {}
# Buffers outgrown by a bigger call stay allocated: CUDA graphs recorded before (a verification
# width) keep their addresses, and freeing them would leave those graphs writing freed memory.
_RETIRED: list = []


def _grown(name: str, n: int, make):
    buf = _XBUF.get(name)
    if buf is None or buf.size < n:
        _RETIRED.append(buf)  # a captured graph may still point at it: never freed
        buf = _XBUF[name] = make(n)
    return buf


def to_f16(x, k: int, stream=0, guard=True):
    """float32 device array of rows of k -> (its f16 copy as a uint16 view, each row's scale
    as float32): rows past f16's range are scaled into it by a power of two, and a product
    over them must multiply row m's outputs by scale[m] (1 for every other row). Buffers
    kept between calls.

    One set of buffers per process, grown on demand and reused: a caller running matmuls on
    several streams at once must convert X itself. A fixed address also keeps CUDA graphs
    valid. guard=False: the caller knows every |x| < 2**15; no fixup launch, scales all 1."""
    n = x.size
    m_rows = n // k
    buf = _grown("x", max(n // 2, 1 << 16), lambda c: cuda.device_array(c, np.uint32))
    flags = _grown("flags", max(m_rows, 1024), new_flags)
    scales = _grown("scales", max(m_rows, 1024), lambda c: cuda.device_array(c, np.float32))
    n2 = n // 2
    _to_f16_kernel[-(-n2 // 256), 256, stream](_flat(x), buf, n2, k, flags)
    if not guard:
        return buf[:n2].view(np.uint16), unit_scales(m_rows)
    _to_f16_fixup[m_rows, 32 if SIM else FIXUP_THREADS, stream](_flat(x).reshape(m_rows, k), buf, flags, scales)
    return buf[:n2].view(np.uint16), scales


_SPLITBUF: dict = {}


def _split_buffers(ws_words: int, tiles: int):
    """Workspace for split-K partial sums and the per-tile arrival counters, kept between
    calls and grown on demand (so a CUDA graph captured after a first call of the same
    shape sees fixed addresses). The counters are zeroed once here; each launch leaves them
    at zero. As with to_f16, concurrent matmuls on several streams must not share them."""
    ws, cnt = _SPLITBUF.get("ws"), _SPLITBUF.get("cnt")
    if ws is None or ws.size < ws_words:
        _RETIRED.append(ws)
        ws = _SPLITBUF["ws"] = cuda.device_array(max(ws_words, 1 << 16), np.float32)
    if cnt is None or cnt.size < tiles:
        _RETIRED.append(cnt)
        cnt = _SPLITBUF["cnt"] = cuda.to_device(np.zeros(max(tiles, 1024), np.int32))
    return ws, cnt


def matmul(x_dev, w_raw_dev, qtype, n_out: int, k: int, out=None, bias=None, residual=None, stream=0,
           use_mma=None, tile=None, min_blocks=None, x_convert=None, splits=None, x_guard=True, w_up=None,
           act="silu"):
    """Y[M, n_out] = X[M, k] @ W^T (+ bias[n_out]) (+ residual[M, n_out]) on the device;
    with w_up (the same type and shape as W), the gated product Y = act(X W^T) * (X W_up^T)
    in one launch, act "silu" (SwiGLU) or "gelu_tanh" (GeGLU); no bias or residual then.

    x_dev: float32 or float16 device array of M * k elements (row-major); w_raw_dev: uint8
    device array of the GGUF bytes of W, n_out rows of row_bytes(qtype, k); out: float32
    device array of M * n_out elements (new if None; may be `residual` itself). use_mma:
    tensor cores (default on a GPU) or FMAs (default in the simulator). x_convert: turn a
    float32 X into f16 in a separate pass first (default: on the tensor-core path; see
    to_f16), which halves the X traffic that every column block repeats and the kernel's
    registers, and scales rows past f16's range into it (luce.kernels.f16_range; the
    in-kernel conversion does not). tile (BM, BN, BK, WM, WN, frag, stages) and splits
    (split-K factor): default pick_tile(M, n_out, k, qtype); a given tile runs unsplit
    unless splits says otherwise. x_guard=False: the caller knows every |x| < 2**15 (see
    to_f16).
    Returns out.
    """
    qtype = as_qtype(qtype)
    spec = _SPECS.get(qtype)
    if spec is None:
        raise NotImplementedError(f"matmul: {qtype.name} is not supported")
    x = _as_dev(x_dev)
    if x.dtype not in (np.float32, np.float16) or k <= 0 or x.size % k:
        raise ValueError(f"matmul: x must be float32/float16 with a multiple of k={k} elements")
    m_rows = x.size // k
    gated = w_up is not None
    n_tile = 2 * n_out if gated else n_out  # the kernel's tile rows: W_gate's and W_up's interleaved
    if tile is None:
        tile, auto = pick_tile(m_rows, n_tile, k, qtype)
        splits = auto if splits is None else splits
    tile = tuple(tile)
    splits = max(1, min(int(splits or 1), k // tile[2] or 1))
    BK = tile[2]
    if k % BK or k % block_elems(qtype):
        raise ValueError(f"matmul: k={k} must be a multiple of {BK} and of {qtype.name}'s block")
    rb = row_bytes(qtype, k)
    w = _as_dev(w_raw_dev)
    w_u = _as_dev(w_up) if gated else w
    for a in (w, w_u):
        if a.dtype != np.uint8 or a.size != n_out * rb:
            raise ValueError(f"matmul: W must be uint8 [{n_out}, {rb}] for {qtype.name}, got {a.dtype} {a.shape}")
    if _ptr(x) % 16 or _ptr(w) % spec.align or _ptr(w_u) % spec.align:
        raise ValueError("matmul: x must be 16-byte aligned and W aligned for its loads")
    if gated and (bias is not None or residual is not None):
        raise ValueError("matmul: the gated form (w_up) takes no bias or residual")
    if gated and act not in ("silu", "gelu_tanh"):
        raise ValueError(f"matmul: unknown activation {act!r} (silu, gelu_tanh)")
    if out is None:
        out = cuda.device_array((m_rows, n_out), np.float32, stream=stream)
    out = _as_dev(out)
    if out.dtype != np.float32 or out.size != m_rows * n_out:
        raise ValueError(f"matmul: out must be float32 with {m_rows * n_out} elements")
    bias, residual = _as_dev(bias), _as_dev(residual)
    if bias is not None and (bias.size != n_out or bias.dtype != np.float32):
        raise ValueError("matmul: bias must be float32 [n_out]")
    if residual is not None and (residual.size != m_rows * n_out or residual.dtype != np.float32):
        raise ValueError("matmul: residual must be float32 [M, n_out]")
    use_mma = (not SIM) if use_mma is None else bool(use_mma)
    x16 = x.dtype == np.float16
    xs = None  # row scales of a float32 X converted here (luce.kernels.f16_range)
    if not x16 and (use_mma if x_convert is None else x_convert):
        (x, xs), x16 = to_f16(x, k, stream, x_guard), True
    split = splits > 1
    kern, nt = get_kernel(qtype, tile, use_mma, x16, bias is not None, residual is not None, min_blocks, split,
                          xs is not None, act if gated else None)
    if "d" not in _DUMMY:
        _DUMMY["d"] = cuda.device_array(1, np.float32)
        _DUMMY["i"] = cuda.device_array(1, np.int32)
    dummy = _DUMMY["d"]
    BM, BN = tile[0], tile[1]
    if gated and n_out % (tile[1] // 2):
        raise ValueError(f"matmul: the gated form needs n_out a multiple of {tile[1] // 2} (the tile's half)")
    grid = (-(-n_tile // BN), -(-m_rows // BM))
    ws, cnt = dummy, _DUMMY["i"]
    if split:
        ws, cnt = _split_buffers(splits * grid[0] * grid[1] * BM * BN, grid[0] * grid[1])
        grid = grid + (splits,)
    kern[grid, nt, stream](_flat(x).view(np.uint16), _flat(w).view(np.uint16), _flat(w_u).view(np.uint16), _flat(out),
                           dummy if bias is None else _flat(bias), dummy if residual is None else _flat(residual),
                           ws, cnt, dummy if xs is None else xs, m_rows, n_tile, k, rb // 2, splits)
    return out


def matmul_ref(x, w_raw, qtype, shape, bias=None, residual=None) -> np.ndarray:
    """numpy reference: x [M, K] @ dequantize(w_raw, qtype, shape=(N, K)).T, float32 out
    (accumulated in float64)."""
    w = dequantize(w_raw, qtype, shape).astype(np.float64)
    y = np.asarray(x, np.float64).reshape(-1, shape[-1]) @ w.T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64).reshape(y.shape)
    return y.astype(np.float32)
