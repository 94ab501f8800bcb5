"""Attention of many queries at once (prefill chunks, tree and chain verification) on
tensor cores, over the paged f16 KV pool.

Why: the FMA-tiled kernel of attention.py spent 562 us a layer on a 512-token causal
prefill of the Qwen3-8B shape and 662 us on a 23-node tree over 8K keys (H200, d70f71e),
15x the one-query decode kernel, where the arithmetic needs a few microseconds on tensor
cores. This is the flash-attention-2 structure with `mma.sync` m16n8k16 (f16 in, f32 sums):

- a block is (split of the keys, kv head, tile of 16 x WARPS query rows); query row r is
  query r // G, q head r % G of the kv head (G = the GQA group), so the rows of a group
  share every K/V tile the block loads;
- each warp keeps its 16 rows of Q (scaled) as mma A fragments for the whole kernel (in
  registers; a tree over a long context in shared memory, see Q_SHARED), and per 16 keys
  of a 64-key page: S = Q K^T (f32, in scalars), the mask (only on pages that hold new
  keys or under a sliding window), the online softmax (row max and sums
  over the four lanes of a row), then O += P V with P re-packed from the S registers as A
  fragments (no trip through shared memory) and V read by `ldmatrix.trans`;
- Q and P enter the mma as f16 hi + lo pairs (two mma each): one f16 rounding moves a score
  by ~1e-3 and a weight by 5e-4, enough for a verified token to differ from the decoded one
  at a near-tie (a DDTree run on SmolLM2 diverged from plain greedy on the H200, 654e268);
  with the pairs the kernel meets the f32 kernels' tolerances. The softmax state is
  float32 throughout (a Python -inf once made it float64: a DFMA exp per score);
- the softmax is in base 2 (log2 e folded into Q's scale, one ex2.approx a weight where
  expf took ~10 instructions and a branch), and a row's sums are rescaled only when its
  max moved. The kernel is a latency chain (one block of 6 warps an SM at 254 registers;
  Nsight Compute: 0.29 eligible warps a scheduler, an instruction every 6.2 cycles a
  warp), so fewer instructions a 16-key step is time: a 23-node tree over 8K keys 74.5 ->
  63.3 us (H200, f346945); with Q in shared memory two blocks an SM share the latency
  (over 8K keys 59.5 -> 51.8 us, eb76d54);
- K and V are copied by the whole block with cp.async (16 bytes a copy, no registers)
  into padded shared rows (ldmatrix reads 8 rows at once: a stride of dim/2 + 4 words puts
  them in distinct banks), in two stages of half a page: the next half's copies run while
  this one is computed (63.3 -> 58.9 us for that tree; 8K decode 22.7 -> 21.1).
Splits leave (O, m, l) for attention's combine kernel exactly as the other kernels do.

In the CUDA simulator the mma, ldmatrix and the lane reductions are emulated
(luce.kernels.mma), so the same code is tested there on small shapes.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import cuda
from numba import types as nb_types

from ._reduce import ceil_div
from .device import device, with_shared
from .mma import (SCRATCH, SHARED16, cp_async16, cp_async_commit, cp_async_wait, cp_async_wait_prior, ex2,
                  f32x2_to_f16x2, lds4, ldsm_x4, ldsm_x4_trans, mma_f16, quad_max, quad_sum, sts4)
from .paging import BLOCK
from .vector_load import SIM, f16_bits_to_f32
from .pdl import grid_dependency_sync, ready as pdl_ready

KEYS = BLOCK  # keys a tile: one page of the pool
MAX_WARPS = 8
# warps (x16 query rows) a block when the rows need several tiles (a prefill);
# LUCE_ATTN_TILE_WARPS (up to MAX_WARPS) for measuring others
TILE_WARPS = min(MAX_WARPS, max(1, int(os.environ.get("LUCE_ATTN_TILE_WARPS", "4"))))
# Blocks a grid aims at: one wave on the H200's 132 SMs, which hold one block each (255
# registers a thread). A 23-node tree of the Qwen3-8B shape (8 kv heads: 17 splits, against
# 33 for two waves) took 22.0 us against 25.0 over 640 keys in an 8K-sized grid, and
# 78.3 against 79.2 over 8K keys (8 splits: 111 us).
TARGET_BLOCKS = 132
# Decode (one query) through this kernel over long contexts: its score and value passes
# are ~30 mma a 16-key step where attention.py's one-query kernel spends ~1,700
# instructions (sm_90 SASS), so a long context is bound by K/V bytes rather than issue; but
# its splits need the combine kernel (~4.5 us even when few splits saw keys), so short
# contexts stay on the one-query kernel, which merges its own. H200, Qwen3-8B shape
# (630ea2b, `python -m luce.bench.kernels_attention decode,...`): over 8K keys 25.6 us (528 blocks,
# combine 7.5 of it) against 30.5; over 640 keys in an 8K grid 15.7 against 12.0: they
# cross near 3.9K keys. LUCE_DECODE_ATTN: auto (this kernel from DECODE_LONG_KEYS keys
# on: the CUDA backend captures a decode graph for each side, where
# attention.long_context_differs), mma or row (always).
DECODE = os.environ.get("LUCE_DECODE_ATTN", "auto").strip().lower()
if DECODE not in ("auto", "mma", "row"):
    raise ValueError(f"LUCE_DECODE_ATTN={DECODE}: auto, mma or row")
DECODE_LONG_KEYS = 4096
# A decode block is one warp (one 16-row tile: the GQA group's rows, the rest zeros), so it
# aims at many more blocks than a tree's tiles: 264 / 528 / 792 / 1056 took 35.6 / 25.6 /
# 27.3 / 33.5 us over 8K keys (H200, same run).
DECODE_TARGET_BLOCKS = int(os.environ.get("LUCE_DECODE_MMA_BLOCKS", "528") or 528)


def decode_on_mma(long: bool) -> bool:
    """Whether one-query decode takes this kernel: long says the context has at least
    DECODE_LONG_KEYS keys (what LUCE_DECODE_ATTN=auto decides by)."""
    return DECODE == "mma" or (DECODE == "auto" and long)


def applies(n_q: int, dim: int, q8: bool, long: bool = False) -> bool:
    """Several queries (or one, where decode_on_mma(long)) over an f16 pool with head dims
    of 32, 64 or 128 (mma's k of 16, two k steps an ldmatrix; larger dims would not keep Q,
    S and O in registers)."""
    return (n_q > 1 or decode_on_mma(long)) and not q8 and dim % 32 == 0 and dim <= 128


def plan(n_q: int, n_heads: int, n_kv_heads: int, n_keys: int, max_splits: int | None, target_blocks=None,
         dim: int = 128, long: bool = False) -> dict:
    """Warps a block, query tiles and key splits. Up to 128 rows (a verification tree of
    32 nodes at GQA 4) stay in one tile, so every K/V byte is read once per kv head.
    qsh: the tile keeps Q in shared memory (Q_SHARED: a tree in one tile of 2+ warps over a
    long context, DECODE_LONG_KEYS+ keys, where that fits two or more blocks an SM: not 8
    warps of head dim 128, 197 registers a thread).
    The splits aim at TARGET_BLOCKS blocks (with qsh, times TREE_WAVES)."""
    rows = n_q * (n_heads // n_kv_heads)
    warps = ceil_div(rows, 16)
    warps = warps if warps <= MAX_WARPS else TILE_WARPS
    if SIM:
        warps = min(warps, 2)  # every simulated thread is an OS thread
    n_tiles = ceil_div(rows, 16 * warps)
    n_pages = max(1, ceil_div(n_keys, KEYS))
    qsh = Q_SHARED and long and n_q > 1 and warps > 1 and n_tiles == 1 and blocks_per_sm(dim, warps, True) > 1
    target = target_blocks or (DECODE_TARGET_BLOCKS if n_q == 1 else
                               TARGET_BLOCKS * (min(TREE_WAVES, blocks_per_sm(dim, warps, True)) if qsh else 1))
    ns = max(1, min(n_pages, ceil_div(target, n_kv_heads * n_tiles), 512))
    if max_splits is not None:
        ns = max(1, min(ns, max_splits))
    return dict(warps=warps, n_tiles=n_tiles, n_splits=ns, qsh=qsh)


@device(inline=True)
def tile_pages(r0, rows, n_rows, G, n_ctx, n_keys, causal, window, q_pos, split, n_splits):
    """The keys a tile of query rows r0..r0+rows-1 may see and its split's share of their
    pages: (key_end, min_qpos, first page, end page). Causal rows stop at their own token;
    a window starts after (smallest query position of the tile) - window, and committed
    pages wholly before that can be skipped (their positions are non-decreasing). A tile
    past the queries present (a graph-sized grid) gets no pages."""
    last_row = min(r0 + rows, n_rows) - 1
    key_end = n_keys
    if causal:
        key_end = min(n_keys, n_ctx + last_row // G + 1)
    min_qpos = 2147483647
    if window > 0:
        for i in range(r0 // G, last_row // G + 1):
            min_qpos = min(min_qpos, q_pos[i])
    n_pages = (key_end + KEYS - 1) // KEYS
    pps = (n_pages + n_splits - 1) // n_splits
    p_lo = split * pps
    p_hi = min(p_lo + pps, n_pages)
    if r0 >= n_rows:
        p_hi = p_lo
    return key_end, min_qpos, p_lo, p_hi


@device(inline=True)
def mark_empty_split(part_ml, split, hkv, G, r0, rows, n_rows, t, nt):
    """(m, l) = (-inf, 0) for query rows r0..r0+rows-1 (those present) of a split that saw
    no key: all the combine reads of it. Threads t of nt share the rows."""
    for r in range(t, rows, nt):
        row = r0 + r
        if row < n_rows:
            part_ml[split, row // G, hkv * G + row % G, 0] = -math.inf
            part_ml[split, row // G, hkv * G + row % G, 1] = 0.0


@device(inline=True)
def _split(x0, x1):
    """(x0, x1) as an f16x2 word and the f16x2 word of what its rounding lost."""
    hi = f32x2_to_f16x2(x0, x1)
    lo = f32x2_to_f16x2(x0 - f16_bits_to_f32(hi & np.uint32(0xFFFF)), x1 - f16_bits_to_f32(hi >> np.uint32(16)))
    return hi, lo


@device(inline=True)
def _q_pair(q, row, n_rows, qi, hq, col, scale):
    """Query row `row` (query qi, head hq)'s scaled elements col, col + 1 as _split words
    (zeros past the rows)."""
    x0 = np.float32(0.0)
    x1 = np.float32(0.0)
    if row < n_rows:
        x0 = q[qi, hq, col] * scale
        x1 = q[qi, hq, col + 1] * scale
    return _split(x0, x1)


@device(inline=True)
def seen(sv, j, row, n_rows, n_ctx, key_end, qi, causal, bits, window, qpos, kv_pos):
    """Score sv of (row, key j), or -inf where the row (of query qi) may not see the key:
    past the keys present, a new key after the query (causal) or not its ancestor (tree),
    or outside the sliding window."""
    ok = row < n_rows and j < key_end
    if ok and j >= n_ctx:
        mi = j - n_ctx
        if causal:
            ok = mi <= qi
        else:
            ok = (bits >> np.uint64(mi)) & np.uint64(1) != np.uint64(0)
    if ok and window > 0:
        ok = kv_pos[j] > qpos - window
    return sv if ok else np.float32(-math.inf)


@device(inline=True)
def _p(sv, m_safe):
    """A score's weight in base 2: 0 for a masked (-inf) score, m_safe being the row max, or
    0 while the row has seen no key (-inf - -inf would be NaN)."""
    return ex2(sv - m_safe)


@device(inline=True)
def _write_row(o, c0, row, n_rows, G, hkv, split, c4, m, ll, direct, out, part_o, part_ml, DN):
    """A row's outputs: accumulator columns c0, c0 + 1 of each 8-wide block (dims 8d + 2 c4,
    +1), normalized (direct) or as a split's partial with its (m, l)."""
    if row < n_rows:
        qi = row // G
        hq = hkv * G + row % G
        for d in range(DN):
            col = d * 8 + 2 * c4
            if direct:
                out[qi, hq, col] = o[d, c0] / ll
                out[qi, hq, col + 1] = o[d, c0 + 1] / ll
            else:
                part_o[split, qi, hq, col] = o[d, c0]
                part_o[split, qi, hq, col + 1] = o[d, c0 + 1]
        if not direct and c4 == 0:
            part_ml[split, qi, hq, 0] = m * LN2  # the combine's natural-log units
            part_ml[split, qi, hq, 1] = ll


# K/V copies in two stages of half a page, the next half's copies running while this one
# is computed (2), or a page at a time, computed once copied (1): LUCE_ATTN_STAGES. H200,
# Qwen3-8B heads (ffc278b, graph-replayed by luce.bench.kernels_attention.time_launch): a
# 23-node tree over 8K keys 58.9 against 63.3 us, over 640 keys in an 8K grid 21.0 against
# 21.1; decode over 8K 21.1 against 22.7. The shared memory is the same (two half pages).
STAGES_DEFAULT = int(os.environ.get("LUCE_ATTN_STAGES", "2"))
LN2 = np.float32(math.log(2.0))
LOG2E = np.float32(1.0 / math.log(2.0))


# Q's fragments in shared memory instead of registers (LUCE_ATTN_Q_SHARED=0: registers),
# for a verification tree in one tile of more than one warp (plan): a lane reads its k
# step's hi and lo words with two 16-byte loads, so the kernel fits Q_SHARED_REGS
# registers and two or more blocks an SM (sm_90 ptxas 13, head dim 128, 6 warps: 251
# registers with Q in registers, one block an SM; 168 registers and 8 bytes of spill
# stores at two blocks, `launch_bounds=(192, 2)`). The K/V stages and Q then
# pass numba's 48 KB of static shared memory: both live in the dynamic shared memory
# that launch() sizes and opts the kernel into. Only over long contexts (DECODE_LONG_KEYS+
# keys: the CUDA backend captures a graph for each side), where two blocks an SM pay;
# H200, Qwen3-8B shape, a 23-node tree: 51.8 us against 59.5 over 8K keys, but 30.2
# against 21.0 over 640 keys in an 8K grid (one page a block: latency, and twice the
# splits to combine); verifying 23 nodes at 512 tokens of context 5.78 ms against 5.45.
# Prefill's many tiles keep Q in registers (512 queries over 8K keys: 872 us against 526).
# Q in shared memory without the second block an SM was slower too (the tree over 8K keys
# with one wave of splits: 67.8 us), so a tile that still fits one block an SM (sm_90
# ptxas, head dim 128, 8 warps: 197 registers) keeps Q in registers (253, no spills).
Q_SHARED = os.environ.get("LUCE_ATTN_Q_SHARED", "1") not in ("", "0")
# waves of one-block-an-SM blocks a tree with Q in shared memory splits its keys for
TREE_WAVES = int(os.environ.get("LUCE_ATTN_TREE_WAVES", "2") or 2)
Q_SHARED_REGS = 168  # registers a thread the launch bounds aim at (a warp's are allocated 8 at a time)
SMEM_PER_SM = 227 * 1024  # shared memory an H100/H200 SM gives its blocks (the opt-in maximum)


def shared_words(dim: int, warps: int, qsh: bool = False) -> tuple[int, int]:
    """(words of the K/V stages, words of Q's fragments) of kernel(dim, warps, qsh=qsh)'s
    dynamic shared memory: two half-page stages of K and V rows, padded (see kernel), and
    with qsh per warp dim/16 k steps of hi and lo fragments, 128 words each."""
    kv = 2 * KEYS * (dim // 2 + 4)
    return kv, (warps * (dim // 16) * 256 if qsh else 0)


def blocks_per_sm(dim: int, warps: int, qsh: bool = False) -> int:
    """Blocks an SM the launch bounds ask for: with qsh as many as Q_SHARED_REGS registers
    and the shared memory allow, else one."""
    if not qsh:
        return 1
    words = sum(shared_words(dim, warps, qsh))
    return max(1, min(65536 // (32 * warps * Q_SHARED_REGS), SMEM_PER_SM // (4 * words + 1024)))


@functools.lru_cache(maxsize=None)
def kernel(dim: int, warps: int, half: bool = False, stages: int | None = None, qsh: bool = False):
    """half: a tile's rows are at most 8 (one warp; decode of a GQA group of up to 8), so
    every lane's second row (g + 8) is padding: its Q fragments are constant zeros and its
    accumulators are neither kept nor written, ~60 registers fewer. qsh: Q's fragments in
    shared memory (Q_SHARED). Launch it through launch(), which gives it its dynamic shared
    memory."""
    assert not half or warps == 1, warps
    assert not (qsh and half), "a half tile's Q is in registers"
    HALF = half
    QSH = qsh
    STAGES = stages or STAGES_DEFAULT
    assert STAGES in (1, 2), STAGES
    NT = 32 * warps
    ROWS = 16 * warps
    RS = dim // 2 + 4  # shared row stride in words: 16-byte padding against bank conflicts
    DK = dim // 16  # mma k steps over the head dim
    DN = dim // 8  # 8-wide output column blocks
    CH = KEYS // STAGES  # keys a chunk
    CPP = STAGES  # chunks a page
    STAGE_WORDS = 2 * CH * RS
    PIECES = CH * dim // 8  # 16-byte pieces of a chunk's K (V)
    PT = ceil_div(PIECES, NT)  # a thread's pieces of each chunk
    SCR = (warps, 32, SCRATCH) if SIM else (1,)
    KV_WORDS, Q_WORDS = shared_words(dim, warps, qsh)  # STAGES x (CH K rows, CH V rows); then Q
    assert KV_WORDS == 2 * KEYS * RS
    QW = (dim // 16) * 256  # a warp's Q words: per k step 128 hi words, then 128 lo, 4 a lane
    BOUNDS = (NT, blocks_per_sm(dim, warps, qsh)) if QSH else NT
    U0 = np.uint32(0)
    F0 = np.float32(0.0)
    NEG = np.float32(-math.inf)  # a Python float would make the softmax state float64 (DFMA exp)
    U64 = np.uint64

    @device(inline=True)
    def skipped(ci, window, n_ctx, kv_pos, min_qpos):
        """Whether chunk ci is wholly before the sliding window of every row of the tile."""
        j0 = ci * CH
        return window > 0 and j0 + CH <= n_ctx and kv_pos[j0 + CH - 1] <= min_qpos - window

    @device(inline=True)
    def load_chunk(ci, stage, kvs, kf, vf, table, layer, n_layers, n_kvh, hkv, key_end, t):
        """cp.async of chunk ci's K and V rows into `stage`: every copy in flight at once,
        none through registers; rows past the last key are zeros (NaN-free)."""
        j0 = ci * CH
        page = ci // CPP
        base = (((table[page] * n_layers + layer) * n_kvh + hkv) * KEYS + (ci % CPP) * CH) * dim  # uint16 index
        for c in range(PT):
            e = t + c * NT
            if e < PIECES:
                kk = e // (dim // 8)
                w4 = 4 * (e % (dim // 8))
                nb = 16 if j0 + kk < key_end else 0
                cp_async16(kvs, stage * STAGE_WORDS + kk * RS + w4, kf, base + kk * dim + 2 * w4, nb)
                cp_async16(kvs, stage * STAGE_WORDS + (CH + kk) * RS + w4, vf, base + kk * dim + 2 * w4, nb)

    @cuda.jit(**({} if SIM else dict(launch_bounds=BOUNDS)))  # the simulator takes no launch bounds
    def attn(q, kf, vf, table, layer, n_layers, meta, kv_pos, q_pos, mask, causal, window, scale, direct,
             out, part_o, part_ml):
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        split = cuda.blockIdx.x
        hkv = cuda.blockIdx.y
        # the last query tiles first: under a causal mask they see the most keys, and blocks
        # start in blockIdx order, so the long ones no longer trail the last wave (a prefill)
        r0 = (cuda.gridDim.z - 1 - cuda.blockIdx.z) * ROWS
        t = cuda.threadIdx.x
        wid = t // 32
        lane = t % 32
        g = lane >> 2
        c4 = lane & 3
        mt = lane >> 3  # the ldmatrix matrix whose row address this lane gives
        n_kvh = cuda.gridDim.y
        n_ctx = meta[0]
        n_new = meta[1]
        n_keys = n_ctx + n_new
        G = q.shape[1] // n_kvh
        n_rows = n_new * G

        key_end, min_qpos, p_lo, p_hi = tile_pages(r0, ROWS, n_rows, G, n_ctx, n_keys, causal, window, q_pos,
                                                   split, cuda.gridDim.x)
        if p_lo >= p_hi:
            # a split past the pages present (a graph's grid is sized for the whole context):
            # only the combine's l = 0, before any Q load. The same for the whole block, so no
            # barrier is skipped alone. At short context most blocks are such.
            if not direct:
                mark_empty_split(part_ml, split, hkv, G, r0, ROWS, n_rows, t, NT)
            return

        # dynamic (launch() sizes it): each stage K rows, then V rows; then Q's fragments
        kvs = cuda.shared.array(0, nb_types.uint32, alignment=SHARED16)  # (numpy's type trips the simulator)
        scr = cuda.shared.array(SCR, np.uint32)
        qh = cuda.local.array((DK, 4), np.uint32)
        ql = cuda.local.array((DK, 4), np.uint32)
        qb0 = KV_WORDS + wid * QW + 4 * lane  # this lane's Q words (QSH)
        o = cuda.local.array((DN, 4), np.float32)

        # this lane's two rows (g and g + 8 of the warp's 16): query, position, tree mask
        row_a = r0 + wid * 16 + g
        row_b = row_a + 8
        qa = min(row_a // G, n_new - 1)
        qb = min(row_b // G, n_new - 1)
        ha = hkv * G + row_a % G
        hb = hkv * G + row_b % G
        pos_a = q_pos[qa] if window > 0 else 0
        pos_b = q_pos[qb] if window > 0 else 0
        bits_a = U64(0)
        bits_b = U64(0)
        if not causal:
            bits_a = U64(mask[qa])
            bits_b = U64(mask[qb])
        # scores in base 2 (log2 e folded into Q's scale): the softmax's exponentials are
        # then one ex2 each; m (the row max) is kept in those units
        scale = scale * LOG2E
        # Q, scaled, as mma A fragments kept in registers for the whole kernel, each value
        # as f16 hi + lo: S = Qhi K + Qlo K keeps f32 accuracy (one f16 rounding of q moves a
        # score by ~1e-3, enough to flip a near-tie between a verified and a decoded token)
        for ks in range(DK):
            col = ks * 16 + 2 * c4
            qh[ks, 0], ql[ks, 0] = _q_pair(q, row_a, n_rows, qa, ha, col, scale)
            qh[ks, 2], ql[ks, 2] = _q_pair(q, row_a, n_rows, qa, ha, col + 8, scale)
            if HALF:
                qh[ks, 1] = ql[ks, 1] = qh[ks, 3] = ql[ks, 3] = np.uint32(0)
            else:
                qh[ks, 1], ql[ks, 1] = _q_pair(q, row_b, n_rows, qb, hb, col, scale)
                qh[ks, 3], ql[ks, 3] = _q_pair(q, row_b, n_rows, qb, hb, col + 8, scale)
            if QSH:  # each lane reads back only its own words: no barrier
                sts4(kvs, qb0 + ks * 256, qh[ks, 0], qh[ks, 1], qh[ks, 2], qh[ks, 3])
                sts4(kvs, qb0 + ks * 256 + 128, ql[ks, 0], ql[ks, 1], ql[ks, 2], ql[ks, 3])
        m_a = NEG
        m_b = NEG
        l_a = np.float32(0.0)
        l_b = np.float32(0.0)
        for d in range(DN):
            for c in range(4):
                o[d, c] = 0.0

        # the keys in chunks of CH (a page, or half a page with two stages: the next chunk's
        # copies run while this one is computed)
        c_lo = p_lo * CPP
        c_hi = p_hi * CPP
        if STAGES == 2:
            if not skipped(c_lo, window, n_ctx, kv_pos, min_qpos):
                load_chunk(c_lo, 0, kvs, kf, vf, table, layer, n_layers, n_kvh, hkv, key_end, t)
            cp_async_commit()
        for ci in range(c_lo, c_hi):
            j0 = ci * CH
            stage = 0
            if STAGES == 2:
                stage = (ci - c_lo) & 1
                if ci + 1 < c_hi and not skipped(ci + 1, window, n_ctx, kv_pos, min_qpos):
                    # into the other stage, whose last readers passed the barrier ending
                    # the previous chunk
                    load_chunk(ci + 1, 1 - stage, kvs, kf, vf, table, layer, n_layers, n_kvh, hkv, key_end, t)
                cp_async_commit()
                cp_async_wait_prior()  # this chunk's copies (this thread's) are done
            if skipped(ci, window, n_ctx, kv_pos, min_qpos):
                continue  # uniform over the block: no barrier is skipped by only some threads
            if STAGES == 1:
                load_chunk(ci, 0, kvs, kf, vf, table, layer, n_layers, n_kvh, hkv, key_end, t)
                cp_async_wait()
            cuda.syncthreads()
            kv0 = stage * STAGE_WORDS  # this chunk's K rows, then CH V rows
            masked = j0 + CH > n_ctx or window > 0  # chunks reaching the new keys, or under a window

            # 16 keys at a time: scores of two 8-key column blocks (sa: keys +0..7, sb: +8..15)
            # in scalars, so that nothing is indexed at run time (local arrays would spill)
            for kb in range(CH // 16):
                sa0 = sa1 = sa2 = sa3 = np.float32(0.0)
                sb0 = sb1 = sb2 = sb3 = np.float32(0.0)
                for k2 in range(DK // 2):  # one ldmatrix.x4: two k steps of an 8-key block
                    kaddr = kv0 + (kb * 16 + (lane & 7)) * RS + k2 * 16 + mt * 4
                    b0, b1, b2, b3 = ldsm_x4(kvs, kaddr, scr, wid, lane)
                    c0, c1, c2, c3 = ldsm_x4(kvs, kaddr + 8 * RS, scr, wid, lane)
                    for h in range(2):
                        ks = 2 * k2 + h
                        bl = b0 if h == 0 else b2
                        bh = b1 if h == 0 else b3
                        cl = c0 if h == 0 else c2
                        ch = c1 if h == 0 else c3
                        if QSH:
                            h0, h1, h2, h3 = lds4(kvs, qb0 + ks * 256)
                            l0, l1, l2, l3 = lds4(kvs, qb0 + ks * 256 + 128)
                        else:
                            h0, h1, h2, h3 = qh[ks, 0], qh[ks, 1], qh[ks, 2], qh[ks, 3]
                            l0, l1, l2, l3 = ql[ks, 0], ql[ks, 1], ql[ks, 2], ql[ks, 3]
                        sa0, sa1, sa2, sa3 = mma_f16(scr, wid, lane, h0, h1, h2, h3, bl, bh, sa0, sa1, sa2, sa3)
                        sa0, sa1, sa2, sa3 = mma_f16(scr, wid, lane, l0, l1, l2, l3, bl, bh, sa0, sa1, sa2, sa3)
                        sb0, sb1, sb2, sb3 = mma_f16(scr, wid, lane, h0, h1, h2, h3, cl, ch, sb0, sb1, sb2, sb3)
                        sb0, sb1, sb2, sb3 = mma_f16(scr, wid, lane, l0, l1, l2, l3, cl, ch, sb0, sb1, sb2, sb3)
                if masked:
                    ja = j0 + kb * 16 + 2 * c4
                    sa0 = seen(sa0, ja, row_a, n_rows, n_ctx, key_end, qa, causal, bits_a, window, pos_a, kv_pos)
                    sa1 = seen(sa1, ja + 1, row_a, n_rows, n_ctx, key_end, qa, causal, bits_a, window, pos_a,
                                kv_pos)
                    sa2 = seen(sa2, ja, row_b, n_rows, n_ctx, key_end, qb, causal, bits_b, window, pos_b, kv_pos)
                    sa3 = seen(sa3, ja + 1, row_b, n_rows, n_ctx, key_end, qb, causal, bits_b, window, pos_b,
                                kv_pos)
                    sb0 = seen(sb0, ja + 8, row_a, n_rows, n_ctx, key_end, qa, causal, bits_a, window, pos_a,
                                kv_pos)
                    sb1 = seen(sb1, ja + 9, row_a, n_rows, n_ctx, key_end, qa, causal, bits_a, window, pos_a,
                                kv_pos)
                    sb2 = seen(sb2, ja + 8, row_b, n_rows, n_ctx, key_end, qb, causal, bits_b, window, pos_b,
                                kv_pos)
                    sb3 = seen(sb3, ja + 9, row_b, n_rows, n_ctx, key_end, qb, causal, bits_b, window, pos_b,
                                kv_pos)

                # online softmax: row maxima over the row's four lanes
                mx_a = quad_max(max(max(m_a, max(sa0, sa1)), max(sb0, sb1)), scr, wid, lane)
                mx_b = NEG if HALF else quad_max(max(max(m_b, max(sa2, sa3)), max(sb2, sb3)), scr, wid, lane)
                al_a = np.float32(1.0) if mx_a == NEG else ex2(m_a - mx_a)
                al_b = np.float32(1.0) if mx_b == NEG else ex2(m_b - mx_b)
                m_a = mx_a
                m_b = mx_b
                # a row's sums are rescaled only when its max moved: over a long context
                # that is rare after the first pages, and the warp skips the 32 products
                # when none of its rows' did
                if al_a != np.float32(1.0):
                    for d in range(DN):
                        o[d, 0] *= al_a
                        o[d, 1] *= al_a
                if not HALF and al_b != np.float32(1.0):
                    for d in range(DN):
                        o[d, 2] *= al_b
                        o[d, 3] *= al_b
                ms_a = F0 if m_a == NEG else m_a
                ms_b = F0 if m_b == NEG else m_b
                sa0 = _p(sa0, ms_a)
                sa1 = _p(sa1, ms_a)
                sb0 = _p(sb0, ms_a)
                sb1 = _p(sb1, ms_a)
                if HALF:  # padding rows: zeros
                    sa2 = sa3 = sb2 = sb3 = F0
                else:
                    sa2 = _p(sa2, ms_b)
                    sa3 = _p(sa3, ms_b)
                    sb2 = _p(sb2, ms_b)
                    sb3 = _p(sb3, ms_b)
                l_a = l_a * al_a + (sa0 + sa1 + sb0 + sb1)
                l_b = l_b * al_b + (sa2 + sa3 + sb2 + sb3)

                # O += P V: P's A fragments are the score registers, repacked as f16 hi + lo
                ph0, pl0 = _split(sa0, sa1)
                ph1, pl1 = _split(sa2, sa3)
                ph2, pl2 = _split(sb0, sb1)
                ph3, pl3 = _split(sb2, sb3)
                vrow = kv0 + (CH + kb * 16 + (mt & 1) * 8 + (lane & 7)) * RS + (mt >> 1) * 4
                for d2 in range(DN // 2):
                    b0, b1, b2, b3 = ldsm_x4_trans(kvs, vrow + d2 * 8, scr, wid, lane)
                    for h in range(2):
                        d = 2 * d2 + h
                        bl = b0 if h == 0 else b2
                        bh = b1 if h == 0 else b3
                        if HALF:  # the second row's outputs are dropped: only the first row's kept
                            o[d, 0], o[d, 1], _, _ = mma_f16(scr, wid, lane, ph0, U0, ph2, U0, bl, bh, o[d, 0], o[d, 1],
                                                             F0, F0)
                            o[d, 0], o[d, 1], _, _ = mma_f16(scr, wid, lane, pl0, U0, pl2, U0, bl, bh, o[d, 0], o[d, 1],
                                                             F0, F0)
                        else:
                            o[d, 0], o[d, 1], o[d, 2], o[d, 3] = mma_f16(scr, wid, lane, ph0, ph1, ph2, ph3, bl, bh,
                                                                         o[d, 0], o[d, 1], o[d, 2], o[d, 3])
                            o[d, 0], o[d, 1], o[d, 2], o[d, 3] = mma_f16(scr, wid, lane, pl0, pl1, pl2, pl3, bl, bh,
                                                                         o[d, 0], o[d, 1], o[d, 2], o[d, 3])
            cuda.syncthreads()

        l_a = quad_sum(l_a, scr, wid, lane)
        if not HALF:
            l_b = quad_sum(l_b, scr, wid, lane)
        _write_row(o, 0, row_a, n_rows, G, hkv, split, c4, m_a, l_a, direct, out, part_o, part_ml, DN)
        if not HALF:
            _write_row(o, 2, row_b, n_rows, G, hkv, split, c4, m_b, l_b, direct, out, part_o, part_ml, DN)

    return pdl_ready(attn)


def launch(dim: int, warps: int, half: bool, qsh: bool, grid, stream, *args):
    """kernel(dim, warps, half, qsh=qsh) over `grid` with its dynamic shared memory (the
    K/V stages and, with qsh, Q's fragments), opted in where that passes 48 KB."""
    nbytes = 4 * sum(shared_words(dim, warps, qsh))
    with_shared(kernel(dim, warps, half, qsh=qsh), grid, 32 * warps, stream, nbytes)(*args)
