"""Attention over a KV cache: decode, causal prefill and tree verification are one
operation that differs only in the mask among the new tokens."""
from __future__ import annotations

import numpy as np


def attention_ref(q: np.ndarray, k_ctx: np.ndarray, v_ctx: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                  new_mask: np.ndarray, *, q_pos: np.ndarray | None = None, ctx_pos: np.ndarray | None = None,
                  window: int | None = None) -> np.ndarray:
    """Grouped-query attention of N new queries.

    q: [N, Hq, D]; k_ctx, v_ctx: [C, Hkv, D] committed rows (seen by every query);
    k_new, v_new: [N, Hkv, D]; new_mask[i, j]: query i sees new key j (a chain is
    lower-triangular, a tree is the ancestor-or-self relation). With `window`, a query
    at position p only sees keys at positions > p - window (q_pos, ctx_pos needed).
    Returns [N, Hq, D].
    """
    n, hq, d = q.shape
    hkv = k_new.shape[1]
    group = hq // hkv
    k = np.concatenate([k_ctx, k_new], axis=0)  # [C+N, Hkv, D]
    v = np.concatenate([v_ctx, v_new], axis=0)
    c = k_ctx.shape[0]
    allowed = np.concatenate([np.ones((n, c), dtype=bool), np.asarray(new_mask, dtype=bool)], axis=1)
    if window is not None:
        key_pos = np.concatenate([ctx_pos, q_pos])
        allowed &= key_pos[None, :] > (q_pos[:, None] - window)
    qg = q.reshape(n, hkv, group, d).astype(np.float32)
    scores = np.einsum("nhgd,khd->hgnk", qg, k.astype(np.float32)) / np.sqrt(d)
    scores = np.where(allowed[None, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("hgnk,khd->nhgd", p, v.astype(np.float32))
    return out.reshape(n, hq, d)


def causal_mask(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


def tree_mask(parents: np.ndarray) -> np.ndarray:
    """Ancestor-or-self mask from parent indices (-1 for children of the committed
    context); parents must precede their children."""
    n = len(parents)
    # each row as an int's bits (a row per numpy op was ~30 us of host time a tree, which
    # the GPU waits through before a verification)
    rows = []
    for i, p in enumerate(np.asarray(parents).tolist()):
        if p >= 0:
            if p >= i:
                raise ValueError("a node's parent must come before it")
            rows.append(rows[p] | 1 << i)
        else:
            rows.append(1 << i)
    if n <= 64:
        bits = np.array(rows, dtype=np.uint64)
        return (bits[:, None] >> np.arange(n, dtype=np.uint64)[None, :] & np.uint64(1)).astype(bool)
    return np.array([[r >> j & 1 for j in range(n)] for r in rows], dtype=bool).reshape(n, n)


def tree_mask_bits(mask: np.ndarray) -> np.ndarray:
    """An N x N ancestor mask (N <= 64) as uint64 [N]: bit j of row i = mask[i, j]."""
    m = np.asarray(mask, dtype=bool)
    n = m.shape[0]
    if n > 64:
        raise ValueError("bitmask rows hold at most 64 new tokens")
    weights = np.left_shift(np.uint64(1), np.arange(n, dtype=np.uint64))
    return (m.astype(np.uint64) * weights[None, :]).sum(axis=1, dtype=np.uint64)


# ------------------------------------------------------------------------------ CUDA
#
# One kernel for decode, tree verification and causal prefill, over the paged KV pool of
# luce.kernels.paging (the new tokens' K/V are written into the pool first, so every key
# is read the same way). The cases differ only in which new keys a query sees:
#   tree/decode: bit j of mask[i] (N <= 64);  prefill: causal (j <= i).
# Flash-decoding: grid (split, kv head, query tile); the splits share the pages a tile
# must read at run time (meta gives the length: a graph sized for the whole context still
# spreads a short one over every split), each walks its 64-token pages with an online
# softmax and leaves (acc, m, l) per row; the one-query (decode) kernel merges the splits in
# the last block of a tile to finish (luce.kernels.split_merge), the others in a combine
# kernel after them. One split writes the normalized output directly.
# A query tile is QT rows of (query, head in the GQA group): all q heads sharing a kv
# head are served by one read of each K/V tile.
import functools  # noqa: E402
from typing import NamedTuple  # noqa: E402
import math  # noqa: E402

from numba import cuda  # noqa: E402

from ._reduce import (WARP_RED_SLOTS, block_threads, ceil_div, warp_allmax, warp_allsum)  # noqa: E402
from . import attention_mma  # noqa: E402
from .split_merge import merge_counters, split_sums, used_splits  # noqa: E402
from .device import device  # noqa: E402
from .vector_load import f16_bits_to_f32  # noqa: E402
from .paging import BLOCK  # noqa: E402
from .pdl import grid_dependency_sync, ready as pdl_ready  # noqa: E402

_SMEM = 48 * 1024  # static shared memory a block may use without an opt-in attribute


def _qt_cap(dim: int) -> int:
    """Largest power-of-two query tile whose Q tile (QT*(D+1) f32), scores (QT*65 f32) and
    row state fit beside one K/V tile (64*(D+2) f16) and the softmax partials (<= 2 KB):
    64 / 32 / 8 rows at D = 64/128/256."""
    room = (_SMEM - 2048 - BLOCK * (dim + 2) * 2) // ((dim + 1) * 4 + (BLOCK + 1) * 4 + 16)
    return min(64, 1 << (room.bit_length() - 1))


_TARGET_BLOCKS = 264  # two waves over the H200's 132 SMs


def _split2(total: int, cap: int) -> tuple[int, int]:
    """total = a * b with b = min(total, cap) (powers of two): a thread's micro-tile."""
    b = min(total, cap)
    return total // b, b


@device
def _q8_f16_tile(src32, dsc_src, slot, layer, hkv, kv, j0, key_end, t, nt, dim4, zero_past_end):
    """A page's q8_0 K or V rows dequantized into the f16 tile kv; rows past the last key
    are left alone, or zeroed (zero_past_end: V, where unwritten pool memory may hold NaN
    and 0 * NaN would leak into the output)."""
    for e in range(t, BLOCK * dim4, nt):
        kk = e // dim4
        w = e % dim4
        if j0 + kk < key_end:
            word = src32[slot, layer, hkv, kk, w]
            dsc = np.float32(dsc_src[slot, layer, hkv, kk, w // 8])
            for c in range(4):
                b = np.int32((word >> np.uint32(8 * c)) & np.uint32(255))
                kv[kk, 4 * w + c] = np.float16(dsc * np.float32(b - 256 if b > 127 else b))
        elif zero_past_end:
            for c in range(4):
                kv[kk, 4 * w + c] = np.float16(0.0)


@functools.lru_cache(maxsize=None)
def _attn_kernel(dim: int, qt: int, nt: int, q8: bool = False):
    # Register micro-tiles: each thread computes TR x TK scores and owns TR2 x TD output
    # elements, so every value it reads from shared memory feeds several FMAs (one score
    # or output element per thread costs two shared loads per FMA: shared-memory bound).
    TR, TK = _split2(qt * BLOCK // nt, 4 if qt * BLOCK // nt < 32 else 8)
    KT = BLOCK // TK  # threads along keys; rows of a thread are strided by qt // TR
    RS = qt // TR
    TR2, TD = _split2(qt * dim // nt, 8)
    DT = dim // TD  # threads along dims
    RS2 = qt // TR2
    assert TR * TK * nt == qt * BLOCK and TR2 * TD * nt == qt * dim and KT * RS == nt and DT * RS2 == nt
    dim2 = dim // 2  # the pool travels as uint32 pairs of f16: 4-byte loads, not 2
    dim4 = dim // 4  # q8_0 pools: uint32 quads of int8, a scale per 8 words
    # Rows padded by one word so that threads reading different rows at one column hit
    # different banks.
    kv_words = dim2 + 1
    qs_w = dim + 1  # shared array shapes must be plain constants, not expressions
    sc_w = BLOCK + 1
    n_acc = TR2 * TD
    n_s = TR * TK
    # Softmax bookkeeping: G threads per row, each over every G-th key of the tile.
    G = max(1, nt // qt)
    RPI = nt // G  # rows one pass of the block covers
    red_shape = (qt, G)
    # f16 pools: a thread's words of a K (V) tile, all loaded into registers before any is
    # stored, so that LD loads per thread are in flight at once; V is prefetched with K
    # (its latency hides behind the scores) when the registers allow.
    LD = BLOCK * dim2 // nt
    pre_v = LD <= 32
    LDV = LD if pre_v else 1

    @cuda.jit
    def kernel(q, k32, v32, kd, vd, table, layer, meta, kv_pos, q_pos, mask, causal, window, scale,
               direct, out, part_o, part_ml):
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        split = cuda.blockIdx.x
        hkv = cuda.blockIdx.y
        tile = cuda.blockIdx.z
        t = cuda.threadIdx.x
        n_ctx = meta[0]
        n_new = meta[1]
        n_keys = n_ctx + n_new
        group = q.shape[1] // k32.shape[2]
        n_rows = n_new * group
        r0 = tile * qt

        qs = cuda.shared.array((qt, qs_w), np.float32)
        kv32 = cuda.shared.array((BLOCK, kv_words), np.uint32)
        kv = kv32.view(np.float16)
        sc = cuda.shared.array((qt, sc_w), np.float32)
        # running max / sum of each row, double-buffered: tile n reads [par] and writes
        # [1 - par], so nobody needs a barrier between reading the old and writing the new
        m_s = cuda.shared.array((2, qt), np.float32)
        l_s = cuda.shared.array((2, qt), np.float32)
        red_m = cuda.shared.array(red_shape, np.float32)
        red_l = cuda.shared.array(red_shape, np.float32)
        acc = cuda.local.array(n_acc, np.float32)
        s_reg = cuda.local.array(n_s, np.float32)
        q_reg = cuda.local.array(TR, np.float32)
        k_reg = cuda.local.array(TK, np.float32)
        p_reg = cuda.local.array(TR2, np.float32)
        k_words = cuda.local.array(LD, np.uint32)
        v_words = cuda.local.array(LDV, np.uint32)
        for e in range(TR2 * TD):
            acc[e] = 0.0
        tk = t % KT
        tr = t // KT
        td = t % DT
        tr2 = t // DT
        g = t % G
        par = 0

        for e in range(t, qt * dim, nt):
            r = e // dim
            d = e % dim
            row = r0 + r
            if row < n_rows:
                qs[r, d] = q[row // group, hkv * group + row % group, d] * scale
            else:
                qs[r, d] = 0.0
        for r in range(t, qt, nt):
            m_s[0, r] = -math.inf
            l_s[0, r] = 0.0

        key_end, min_qpos, p_lo, p_hi = attention_mma.tile_pages(r0, qt, n_rows, group, n_ctx, n_keys, causal,
                                                                 window, q_pos, split, cuda.gridDim.x)
        cuda.syncthreads()

        for page in range(p_lo, p_hi):
            j0 = page * BLOCK
            if window > 0 and j0 + BLOCK <= n_ctx and kv_pos[j0 + BLOCK - 1] <= min_qpos - window:
                continue  # uniform over the block: no barrier is skipped by only some threads
            slot = table[page]
            if q8:
                # dequantized into the same f16 tile, so the rest of the kernel is shared
                # (rows past the last key are never scored; skipping them spares the
                # arithmetic on unwritten scales)
                _q8_f16_tile(k32, kd, slot, layer, hkv, kv, j0, key_end, t, nt, dim4, False)
            else:
                for c in range(LD):
                    e = t + c * nt
                    kk = e // dim2
                    # rows past the last key: never scored, zeroed so no NaN is ever formed
                    k_words[c] = k32[slot, layer, hkv, kk, e % dim2] if j0 + kk < key_end else np.uint32(0)
                if pre_v:
                    for c in range(LD):
                        e = t + c * nt
                        kk = e // dim2
                        v_words[c] = v32[slot, layer, hkv, kk, e % dim2] if j0 + kk < key_end else np.uint32(0)
                for c in range(LD):
                    e = t + c * nt
                    kv32[e // dim2, e % dim2] = k_words[c]
            cuda.syncthreads()

            for e in range(TR * TK):
                s_reg[e] = 0.0
            for d in range(dim):
                for a in range(TR):
                    q_reg[a] = qs[tr + a * RS, d]
                for b in range(TK):
                    k_reg[b] = np.float32(kv[tk + b * KT, d])
                for a in range(TR):
                    for b in range(TK):
                        s_reg[a * TK + b] += q_reg[a] * k_reg[b]
            for a in range(TR):
                r = tr + a * RS
                row = r0 + r
                i = row // group
                for b in range(TK):
                    kk = tk + b * KT
                    j = j0 + kk
                    ok = row < n_rows and j < key_end
                    if ok and j >= n_ctx:
                        if causal:
                            ok = j - n_ctx <= i
                        else:
                            ok = ((mask[i] >> np.uint64(j - n_ctx)) & np.uint64(1)) != np.uint64(0)
                    if ok and window > 0:
                        ok = kv_pos[j] > q_pos[i] - window
                    sc[r, kk] = s_reg[a * TK + b] if ok else np.float32(-math.inf)
            cuda.syncthreads()

            for r in range(t // G, qt, RPI):
                pm = np.float32(-math.inf)
                for kk in range(g, BLOCK, G):
                    pm = max(pm, sc[r, kk])
                red_m[r, g] = pm

            # V replaces K in the tile buffer (K is no longer read) after the partial maxima.
            # Rows past the last key are zeroed: unwritten pool memory may hold NaN, and
            # 0 * NaN would leak into the output.
            if q8:
                _q8_f16_tile(v32, vd, slot, layer, hkv, kv, j0, key_end, t, nt, dim4, True)
            elif pre_v:
                for c in range(LD):
                    e = t + c * nt
                    kv32[e // dim2, e % dim2] = v_words[c]
            else:
                for c in range(LD):
                    e = t + c * nt
                    kk = e // dim2
                    k_words[c] = v32[slot, layer, hkv, kk, e % dim2] if j0 + kk < key_end else np.uint32(0)
                for c in range(LD):
                    e = t + c * nt
                    kv32[e // dim2, e % dim2] = k_words[c]
            cuda.syncthreads()

            for r in range(t // G, qt, RPI):
                m_old = m_s[par, r]
                mx = m_old
                for x in range(G):
                    mx = max(mx, red_m[r, x])
                ps = np.float32(0.0)
                if mx == -math.inf:
                    for kk in range(g, BLOCK, G):
                        sc[r, kk] = 0.0
                else:
                    for kk in range(g, BLOCK, G):
                        pk = math.exp(sc[r, kk] - mx)
                        sc[r, kk] = pk
                        ps += pk
                red_l[r, g] = ps
                if g == 0:
                    m_s[1 - par, r] = mx
            cuda.syncthreads()

            for a in range(TR2):
                r = tr2 + a * RS2
                mn = m_s[1 - par, r]
                al = np.float32(1.0) if mn == -math.inf else math.exp(m_s[par, r] - mn)
                for b in range(TD):
                    acc[a * TD + b] *= al
            for r in range(t, qt, nt):
                mn = m_s[1 - par, r]
                al = np.float32(1.0) if mn == -math.inf else math.exp(m_s[par, r] - mn)
                ls = np.float32(0.0)
                for x in range(G):
                    ls += red_l[r, x]
                l_s[1 - par, r] = l_s[par, r] * al + ls
            for kk in range(BLOCK):
                for a in range(TR2):
                    p_reg[a] = sc[tr2 + a * RS2, kk]
                for b in range(TD):
                    vb = np.float32(kv[kk, td + b * DT])
                    for a in range(TR2):
                        acc[a * TD + b] += p_reg[a] * vb
            cuda.syncthreads()
            par = 1 - par

        for a in range(TR2):
            r = tr2 + a * RS2
            row = r0 + r
            if row < n_rows:
                i = row // group
                hq = hkv * group + row % group
                for b in range(TD):
                    d = td + b * DT
                    if direct:
                        out[i, hq, d] = acc[a * TD + b] / l_s[par, r]
                    else:
                        part_o[split, i, hq, d] = acc[a * TD + b]
        if not direct:
            for r in range(t, min(qt, n_rows - r0), nt):
                row = r0 + r
                part_ml[split, row // group, hkv * group + row % group, 0] = m_s[par, r]
                part_ml[split, row // group, hkv * group + row % group, 1] = l_s[par, r]

    return pdl_ready(kernel)


# ------------------------------------------------------------------ decode: one query
#
# The tiled kernel above serves one query (decode) with a 4-row tile and four barriers a
# page: on the H200 that cost ~38 us a layer at any context length, latency of a chain
# with little work to hide behind. Here a warp walks its keys a chunk of CH at a time,
# 32 / CH lanes a key (CH = 32: a key a lane):
#   copies: the chunk's K and V rows go to the warp's shared buffer by cp.async (with
#     DECODE_BUFS = (2,), to one of two while the previous chunk is computed from the
#     other: measured slower, it halves the warps an SM holds) (no registers: a K row
#     read into registers with 16-byte loads was, in the sm_90 code, 16 loads issued one
#     after another, each waited out before the next: ptxas sank them to their uses. That
#     was most of the kernel's time: 43 us over 8K tokens on the H200 at cf144b4, ~4
#     chunks a warp; copies into one buffer, waited out a chunk at a time: 31.5 us at
#     58f5dc3). Rows past the last key are zero-filled, so the value pass needs no guard
#     against what unwritten rows hold;
#   scores: the lanes of a key dot interleaved 16-byte pieces of its row (shared loads;
#     rows padded by 16 bytes a lane of the key, so that the 8 lanes of a load phase hit
#     different banks) with the GQA group's queries, then add their sums (shuffles);
#   softmax: the chunk's max and sum across the warp (shuffles; shared memory in the
#     simulator);
#   values: lanes own dim/32 output dims each and walk the chunk's keys with FMAs (p = 0
#     for unseen keys: their rows are written ones or zeros).
# A block holds W warps that take consecutive runs of chunks and merge their (m, l, acc)
# through shared memory at the end, so a long context spreads over W times more warps
# with the same number of splits for the combine kernel to add up. Every warp runs the
# same number of loop trips (a warp without a chunk walks an empty one), so the per-warp
# barriers can be the block's in the simulator. Splits leave (acc, m, l) for
# the combine kernel exactly as the tiled kernel does.
# The tensor-core kernel (attention_mma with one warp a block: 16 query rows, 4 of them the
# GQA group's) was slower for decode on the H200: 19.9 us against 17.6 over 640 keys in an
# 8K-sized grid, 40.2 us over 8K keys (128 splits: its combine alone 13.3 us).
# Keys a warp's step. Short contexts leave most SMs a warp or none, so what a decode takes
# there is one warp's chain of dependent instructions a chunk: ~7K at 32 keys (8B shape:
# 17.6 us over 640 keys in an 8K-sized grid, 12.7 of them this kernel, H200 at 9bf838f).
# Fewer keys a chunk and more lanes a key shorten the chain and spread the same keys over
# more warps. H200, 8B shape, combine included (178a25c): over 640 keys in an 8K grid 17.6
# us at 32 keys a step, 14.1 at 16, 14.5 at 8; over 8K keys 36.2 / 33.6 / 36.8. Still a
# latency chain at 16 (Nsight Compute: ~4.5K instructions a warp, 0.49 eligible warps a
# scheduler, 10% achieved occupancy).
DECODE_CHUNK = 16
# Keys a step for blocks of 8+ query rows (q heads a kv head x queries): see decode_chunk
DECODE_CHUNK_WIDE = 8
# Warps over a long context (~12 an H200 SM: one wave at 3 blocks of 4 warps an SM). H200,
# 8B shape, the kernel merging its own splits (f4d4220): over 8K keys 41.9 / 33.4 / 30.7 /
# 31.5 us at 512 / 1024 / 1536 / 2048 (16 / 32 / 48 / 64 splits); over 640 keys in an
# 8K-sized grid 12.6 / 13.4 / 13.9 / 15.2 us (more splits, more empty blocks and partials
# to merge). 1536 trades 0.5 us a layer at short context for 2.7 at 8K.
DECODE_TARGET_WARPS = 1536
DECODE_MAX_WARPS = 4  # warps a block
# K/V buffers a warp, in order of preference. Two (the next chunk copied while one is
# computed) halve the warps an SM holds; on the H200 (8B shape, 8K keys, 64 splits) one
# buffer and two warps a block took 31.6 us at 4653f47 and 30.9 at ca39022, two buffers
# and one warp 38.4 and 36.6.
DECODE_BUFS = (1,)
# Splits a trip of the decode kernel's merge (split_merge.merge_per_trip's choice when None)
DECODE_MERGE_PER_TRIP = None


def decode_self_merges(rows: int, warps: int) -> bool:
    """Whether the decode kernel's last block merges the splits itself: where it has a warp
    for each of its query rows. With fewer (the 32B shape: 8 q heads a kv head, 2 warps a
    block) its warps merged the rows one after another, each a chain of L2 round trips
    (H200, Qwen3-32B shape, 8a327d6's `luce bench` breakdown: 47.6 us a layer over 640
    keys, against 16 for the 8B shape; 32B decode at 8K 71.9% of short). The combine
    kernel spreads the merge over a block a q head: e4f96d8, 27.0 us over 640 keys in
    bench_attention, and 8K decode at 85.9% of short."""
    return rows <= warps


def decode_per_trip(dim: int, rows: int) -> int:
    from .split_merge import merge_per_trip
    return DECODE_MERGE_PER_TRIP or merge_per_trip(dim, rows)


def _decode_smem(dim: int, rows: int, warps: int, bufs: int, ch: int) -> int:
    """Shared bytes of the decode kernel: the queries, and per warp `bufs` buffers of K rows
    (padded) and V rows, the chunk's probabilities and the merge's accumulators and (m, l)."""
    per_warp = bufs * (ch * (dim + 8 * (32 // ch)) * 2 + ch * dim * 2) + ch * rows * 4 + rows * dim * 4 + rows * 8
    # (rows + 2) query rows: the fused variant (rope=True) keeps the new k and v rows there too
    return (rows + 2) * dim * 4 + warps * (per_warp + 4 * WARP_RED_SLOTS)


def decode_chunk(dim: int, rows: int = 1) -> int:
    """Keys a warp's step: DECODE_CHUNK (DECODE_CHUNK_WIDE for blocks of 8+ query rows), or
    more where a key's lanes would outnumber its 16-byte pieces. H200, Qwen3-32B shape (8 q heads a kv
    head), e4f96d8's bench_attention: 8 keys a step fit 4 warps a block in shared memory
    (16: 2), and took decode attention over 640 keys in an 8K grid 26.97 -> 20.68 us,
    over 8K 66.9 -> 60.8 (not yet run end to end); the 8B shape (4 rows) is slower at 8
    (31.6 -> 36.1 us over 8K)."""
    ch = DECODE_CHUNK_WIDE if rows >= 8 else DECODE_CHUNK
    return max(ch, 32 // max(1, dim // 8))


def decode_shape(dim: int, rows: int) -> tuple[int, int, int]:
    """(warps a block, buffers a warp, keys a chunk) of the decode kernel: the first buffer
    count of DECODE_BUFS with the most warps whose buffers fit in static shared memory;
    (0, 0, 0) when nothing fits."""
    ch = decode_chunk(dim, rows)
    for bufs in DECODE_BUFS:
        w = DECODE_MAX_WARPS
        while w and _decode_smem(dim, rows, w, bufs, ch) > _SMEM:
            w //= 2
        if w:
            return w, bufs, ch
    return 0, 0, 0


def decode_plan(n_kv_heads: int, n_keys: int, warps: int, chunk: int) -> int:
    """Splits (blocks along the keys) of the decode kernel for a grid sized for n_keys keys:
    about a chunk a warp up to DECODE_TARGET_WARPS warps in all."""
    chunks = max(1, ceil_div(n_keys, chunk))
    want = min(chunks, ceil_div(DECODE_TARGET_WARPS, n_kv_heads))
    return max(1, min(ceil_div(want, warps), COMBINE_MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _decode_kernel(dim: int, group: int, qt: int, warps: int, bufs: int, chunk: int, per_trip: int | None = None,
                   self_merge: bool = True, xq_planes: int = 0, rope: bool = False):
    """The kernel for `qt` queries a block (decode: 1; tree or chain verification: a tile of
    the new tokens, each with its own mask over the new keys and its own window), `warps`
    warps a block, `bufs` (1 or 2) K/V buffers a warp, `chunk` keys a warp's step,
    `per_trip` splits a trip of its merge (None: decode_per_trip); self_merge False: the
    splits' partials are left for the combine kernel (decode_self_merges); xq_planes > 0:
    where it writes the output (one split, or its merge) it also writes the output's
    quantize_x form in that many planes (xq_b / xq_f: the next product's int8 x, so that
    it needs no launch of its own). rope (one query: decode): q and the new token's k
    arrive as the projections left them; the kernel does qk_rope's work (per-head RMSNorm,
    rotation) on them itself and stores the new k and v rows into the pool, so decode has
    no qk_rope launch (see paged_attention_cuda's `rope`)."""
    from ._reduce import warp_barrier, warp_groupsum
    from .quantize_x import int8_block_store
    from .mma import SHARED16, cp_async16, cp_async_commit, cp_async_wait, cp_async_wait_prior, lds2, lds4
    from .split_merge import arrive, merge_rows
    from .mma import f32x2_to_f16x2
    from .rope import rotate
    merge = merge_rows(dim, per_trip or decode_per_trip(dim, qt * group), xq_planes)
    ROPE = rope
    assert not ROPE or qt == 1, qt
    SELF_MERGE = self_merge
    XQ = xq_planes
    CH = chunk
    LPK = 32 // CH  # lanes a key in the score pass
    G = group
    QT = qt
    W = warps
    R = QT * G  # query rows of a block: row r is query r // G, q head r % G of the kv head
    R2 = R + 2  # rows of qs: with ROPE, row R holds the new k (normed and rotated), R + 1 its v
    DL = dim // 32  # output dims a lane owns in the value pass
    DW = max(1, DL // 2)  # their uint32 words (dim 32: a lane owns one half of a word)
    # head dims of an odd number of lane dims past one (96: Phi-3, 160): the value pass
    # reads them a half at a time (word loads covered 2 of a lane's 3 dims: wrong outputs)
    ODD_DL = DL > 1 and DL % 2 == 1
    NACC = R * DL  # array shapes must be plain constants, not expressions
    NT = W * 32
    QPT = (dim + NT - 1) // NT  # query dims a thread loads a row
    QREGS = R * QPT
    PIECES = dim // 8  # 16-byte pieces of a row
    PPL = PIECES // LPK  # pieces a lane of a key
    RW = dim // 2  # uint32 words of a V row
    KROW = RW + 4 * LPK  # of a K row in shared memory: 16 bytes of padding a lane of a key
    assert 32 % CH == 0 and PIECES % LPK == 0, (dim, CH)
    KWORDS = CH * KROW
    VWORDS = CH * RW
    U = np.uint32
    U64 = np.uint64
    NB = bufs
    PSN = W * CH * R
    KSH, VSH = NB * W * KWORDS, NB * W * VWORDS  # array shapes must be plain constants

    RED = W * max(1, WARP_RED_SLOTS)
    assert NB in (1, 2) and _decode_smem(dim, R, W, NB, CH) <= _SMEM, (dim, R, W, NB, CH)

    # A lane's copies of a chunk: where a row's pieces divide a warp, the same piece of
    # every RSTEP-th row, so the addresses are a per-lane base plus constants (the generic
    # loop's signed // and % of a 64-bit index were ~25 instructions a copy in the SASS).
    # With 32-bit shared addresses (mma._smem_addr): 164 -> 128 registers (sm_90, head dim
    # 128, 4 q heads a kv head); H200 at 30706f5: decode attention over 640 keys unchanged
    # (14.1 us a layer in the decode graph), over 8K keys 30.3 us (30.7 at f4d4220)
    LANE_PIECES = 32 % PIECES == 0 and (CH * PIECES) % 32 == 0
    RSTEP = 32 // PIECES if LANE_PIECES else 1
    NCOPY = CH * PIECES // 32 if LANE_PIECES else 1
    assert BLOCK & (BLOCK - 1) == 0  # a page and its row by shifts (j0 >= 0)
    BSH = BLOCK.bit_length() - 1
    PSH = PIECES.bit_length() - 1

    @device(inline=True)
    def _decode_copy(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, c, n_chunks, n_keys, wid, lane, buf):
        """Start the copies of chunk c's K and V rows into buffer `buf` of warp `wid`; rows
        past the last key (all of them past the last chunk) are zero-filled."""
        live = c < n_chunks
        j0 = c * CH if live else 0
        key_end = n_keys if live else 0
        # the chunk's keys are consecutive rows of one page (CH divides BLOCK); j0 >= 0
        cbase = (((table[j0 >> BSH] * n_layers + layer) * n_kvh + hkv) * BLOCK + (j0 & (BLOCK - 1))) * dim
        kb = (wid * NB + buf) * KWORDS
        vb = (wid * NB + buf) * VWORDS
        if LANE_PIECES:
            piece = lane & (PIECES - 1)
            row0 = lane >> PSH
            left = key_end - j0 - row0  # rows of this lane's copies that are keys: row < left
            for k in range(NCOPY):
                row = k * RSTEP
                nb = 16 if row < left else 0
                e = (row0 + row) * PIECES + piece
                cp_async16(ksh, kb + (row0 + row) * KROW + 4 * piece, kf, cbase + 8 * e, nb)
                cp_async16(vsh, vb + 4 * e, vf, cbase + 8 * e, nb)
        else:
            for e in range(lane, CH * PIECES, 32):
                row = e // PIECES
                nb = 16 if j0 + row < key_end else 0
                cp_async16(ksh, kb + row * KROW + 4 * (e % PIECES), kf, cbase + 8 * e, nb)
                cp_async16(vsh, vb + 4 * e, vf, cbase + 8 * e, nb)

    @device(inline=True)
    def _rope_rows(qs, q, k_new, v_new, hkv, q_w, k_w, has_norm, eps, inv_freq, rope_dim, style, pos, scale, red,
                   tid, wid, lane, r1):
        """qs = the block's G query rows, (row R) the kv head's new k and (R + 1) its v: q
        and k as qk_rope leaves them (RMSNorm over the head where has_norm, then the
        rotation of the first rope_dim dims at position pos), the query rows also times
        scale. A warp a row. r1: R + 1, read at run time so that the loops stay loops."""
        for e in range(tid, (r1 + 1) * dim, W * 32):
            r = e // dim
            d = e % dim
            if r < R:
                qs[r, d] = q[0, hkv * G + r, d]
            elif r == R:
                qs[r, d] = k_new[0, hkv, d]
            else:
                qs[r, d] = v_new[0, hkv, d]
        cuda.syncthreads()
        half = rope_dim // 2
        for rb in range(0, r1, W):  # the same trips in every warp (the simulator's barriers)
            rr = rb + wid
            row = min(rr, R)
            live = rr < r1
            if has_norm:
                ss = np.float32(0.0)
                for d in range(lane, dim, 32):
                    x = qs[row, d]
                    ss += x * x
                inv = np.float32(1.0) / math.sqrt(warp_allsum(ss, red, wid, lane) / np.float32(dim) + eps)
                if live:
                    if row < R:
                        for d in range(lane, dim, 32):
                            qs[row, d] *= inv * q_w[d]
                    else:
                        for d in range(lane, dim, 32):
                            qs[row, d] *= inv * k_w[d]
            warp_barrier()
            sc = scale if row < R else np.float32(1.0)
            if live:
                for t in range(lane, half, 32):
                    ia = 2 * t if style == 0 else t
                    ib = ia + 1 if style == 0 else t + half
                    a, b = rotate(qs[row, ia], qs[row, ib], pos, inv_freq[t])
                    qs[row, ia] = a * sc
                    qs[row, ib] = b * sc
                for d in range(rope_dim + lane, dim, 32):  # past the rotary dims: only the scale
                    qs[row, d] *= sc
            warp_barrier()
        cuda.syncthreads()  # the pool's store reads row R across the block's warps

    @device(inline=True)
    def _store_new_row(kf, vf, qs, table, layer, n_layers, n_kvh, hkv, j, kv_pos, pos, tid):
        """Block-wide: the new token's k and v rows (qs rows R, R + 1) into pool row j as
        f16, and its position into kv_pos."""
        base = (((table[j >> BSH] * n_layers + layer) * n_kvh + hkv) * BLOCK + (j & (BLOCK - 1))) * dim
        for i in range(tid, RW, W * 32):
            kw = f32x2_to_f16x2(qs[R, 2 * i], qs[R, 2 * i + 1])
            vw = f32x2_to_f16x2(qs[R + 1, 2 * i], qs[R + 1, 2 * i + 1])
            kf[base + 2 * i] = np.uint16(kw & U(0xFFFF))
            kf[base + 2 * i + 1] = np.uint16(kw >> U(16))
            vf[base + 2 * i] = np.uint16(vw & U(0xFFFF))
            vf[base + 2 * i + 1] = np.uint16(vw >> U(16))
        if tid == 0:
            kv_pos[j] = pos

    @device(inline=True)
    def _f16(x):
        """x rounded to f16, as the pool holds it."""
        return f16_bits_to_f32(f32x2_to_f16x2(x, np.float32(0.0)) & U(0xFFFF))

    @cuda.jit
    def kernel(q, kf, vf, table, layer, n_layers, meta, kv_pos, q_pos, mask_bits, causal, window, scale, direct,
               out, part_o, part_ml, counter, xq_b, xq_f, k_new, v_new, q_w, k_w, has_norm, eps, inv_freq, rope_dim,
               style):
        grid_dependency_sync()  # luce.kernels.pdl: nothing unless LUCE_PDL
        split = cuda.blockIdx.x
        hkv = cuda.blockIdx.y
        q0 = cuda.blockIdx.z * QT
        tid = cuda.threadIdx.x
        wid = tid // 32
        lane = tid % 32
        n_kvh = cuda.gridDim.y
        # the queries first: they depend on nothing below, so their loads are in flight
        # while meta, the block table and the first K/V copies are (their stall was ~10%
        # of the launch's samples behind those, H200, Nsight Compute, 640 keys). Rows past
        # the last query load the last one: computed, never stored.
        qv = cuda.local.array(QREGS, np.float32)
        if not ROPE:
            for r in range(R):
                qi = min(q0 + r // G, q.shape[0] - 1)
                for k in range(QPT):
                    qv[r * QPT + k] = q[qi, hkv * G + r % G, min(tid + k * NT, dim - 1)]
        n_past = meta[0]
        n_q = meta[1]
        # the keys the chunks walk: with ROPE the new one is not in the pool yet (split 0
        # writes it) and is folded in after them from qs instead
        n_keys = n_past if ROPE else n_past + n_q
        qs = cuda.shared.array((R2, dim), np.float32)
        ksh = cuda.shared.array(KSH, np.uint32, alignment=SHARED16)
        vsh = cuda.shared.array(VSH, np.uint32, alignment=SHARED16)
        ps = cuda.shared.array(PSN, np.float32, alignment=SHARED16)
        mo = cuda.shared.array((W, R, dim), np.float32)
        mml = cuda.shared.array((W, R, 2), np.float32)
        red = cuda.shared.array(RED, np.float32)
        ibuf = cuda.shared.array(1, np.int32)
        n_chunks = (n_keys + CH - 1) // CH
        cps = (n_chunks + cuda.gridDim.x * W - 1) // (cuda.gridDim.x * W)
        c_lo = (split * W + wid) * cps
        # trips of every warp of the block: its first warp's live chunks (the most any of
        # its warps has)
        trips = max(0, min(cps, n_chunks - split * W * cps))
        # splits with a chunk (split 0 always: with ROPE it holds the new key). Where this
        # block merges its tile, the others neither write nor count: the merge waits on and
        # reads only these, and one of them writes the output directly. A graph's grid is
        # sized for the whole context, so at short contexts most splits are empty (640 keys
        # in an 8K grid: 10 of 48)
        used = max(1, (n_chunks + W * cps - 1) // (W * cps)) if cps > 0 else 1
        if SELF_MERGE and used == 1:
            direct = 1
        if trips == 0 and not (ROPE and split == 0):
            # past the last chunk: for the combine kernel, only the merge's l = 0. The same
            # for the whole block, so no barrier is skipped alone.
            if not SELF_MERGE:
                attention_mma.mark_empty_split(part_ml, split, hkv, G, q0 * G, R, n_q * G, tid, W * 32)
            return
        else:
            # the first chunk's copies run while the queries load
            _decode_copy(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, c_lo, n_chunks, n_keys, wid, lane, 0)
            s = cuda.local.array(R, np.float32)
            m = cuda.local.array(R, np.float32)
            lsum = cuda.local.array(R, np.float32)
            acc = cuda.local.array(NACC, np.float32)
            pk = cuda.local.array(R, np.float32)
            vw = cuda.local.array(DW, np.uint32)
            # a row at a time (r // G and r % G are constants): rows past the last query are
            # computed, never stored
            if ROPE:
                pos = q_pos[0]
                _rope_rows(qs, q, k_new, v_new, hkv, q_w, k_w, has_norm, eps, inv_freq, rope_dim, style, pos, scale,
                           red, tid, wid, lane, n_q * G + 1)
                if split == 0:  # the pool's row, for later steps (this launch's chunks never read it)
                    _store_new_row(kf, vf, qs, table, layer, n_layers, n_kvh, hkv, n_past, kv_pos, pos, tid)
            else:
                for r in range(R):
                    for k in range(QPT):
                        if tid + k * NT < dim:
                            qs[r, tid + k * NT] = qv[r * QPT + k] * scale
            rbits = cuda.local.array(R, np.uint64)  # each row's tree-mask word and query position
            rpos = cuda.local.array(R, np.int32)
            for r in range(R):
                m[r] = -math.inf
                lsum[r] = 0.0
                qc = min(q0 + r // G, n_q - 1)
                rbits[r] = U64(0) if causal else U64(mask_bits[qc])
                rpos[r] = q_pos[qc] if window > 0 else 0
            for e in range(NACC):
                acc[e] = 0.0
            pb = wid * CH * R
            cuda.syncthreads()
            cp_async_commit()
            for it in range(trips):
                c = c_lo + it
                live = c < n_chunks
                j0 = c * CH if live else 0
                key_end = n_keys if live else 0  # an empty chunk: no key is present
                if NB == 1:
                    if it > 0:
                        _decode_copy(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, c, n_chunks, n_keys, wid,
                                     lane, 0)
                        cp_async_commit()
                    cp_async_wait()
                else:  # double buffering: the next chunk's copies run while this one is computed
                    if it + 1 < trips:
                        _decode_copy(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, c + 1, n_chunks, n_keys, wid,
                                     lane, (it + 1) & 1)
                    cp_async_commit()
                    cp_async_wait_prior()
                warp_barrier()
                b = it & 1 if NB == 2 else 0
                kb = (wid * NB + b) * KWORDS
                vb = (wid * NB + b) * VWORDS
                for r in range(R):
                    s[r] = 0.0
                key = lane // LPK
                part = lane % LPK
                for i in range(PPL):
                    pc = i * LPK + part  # a key's lanes read adjacent pieces: one bank row
                    w0, w1, w2, w3 = lds4(ksh, kb + key * KROW + 4 * pc)
                    for h in range(8):
                        word = w0 if h < 2 else (w1 if h < 4 else (w2 if h < 6 else w3))
                        kx = f16_bits_to_f32(U(word >> U(16 * (h & 1))) & U(0xFFFF))
                        for r in range(R):
                            s[r] += qs[r, 8 * pc + h] * kx
                if LPK > 1:
                    for r in range(R):
                        s[r] = warp_groupsum(s[r], LPK, red, wid, lane)
                # which rows see key j: all committed keys (inside the window), and of the new
                # ones the query's ancestors and itself (tree) or its predecessors (chain)
                j = j0 + key
                for r in range(R):
                    qi = q0 + r // G
                    s[r] = attention_mma.seen(s[r], j, qi, n_q, n_past, key_end, qi, causal, rbits[r], window, rpos[r],
                                              kv_pos)
                for r in range(R):
                    cm = max(m[r], warp_allmax(s[r], red, wid, lane))
                    p = np.float32(0.0) if s[r] == -math.inf else math.exp(s[r] - cm)
                    al = np.float32(1.0) if cm == -math.inf else math.exp(m[r] - cm)
                    m[r] = cm
                    # a key's p counted once: by the first of its lanes
                    lsum[r] = lsum[r] * al + warp_allsum(p if part == 0 else np.float32(0.0), red, wid, lane)
                    for d in range(DL):
                        acc[r * DL + d] *= al
                    if part == 0:
                        ps[pb + key * R + r] = p
                warp_barrier()
                # shared loads of 8 or 16 bytes with no index arithmetic beyond a base and an
                # offset: numba's indexing costs ~24 integer instructions a key here
                for k in range(CH):
                    if R % 4 == 0:
                        for r4 in range(R // 4):
                            pk[4 * r4], pk[4 * r4 + 1], pk[4 * r4 + 2], pk[4 * r4 + 3] = lds4(ps, pb + k * R + 4 * r4)
                    else:
                        for r in range(R):
                            pk[r] = ps[pb + k * R + r]
                    if ODD_DL:  # a lane's dims start mid-word on odd lanes: a half at a time
                        for i in range(DL):
                            dd = lane * DL + i
                            vx = f16_bits_to_f32(U(vsh[vb + k * RW + (dd >> 1)] >> U(16 * (dd & 1))) & U(0xFFFF))
                            for r in range(R):
                                acc[r * DL + i] += pk[r] * vx
                        continue
                    if DW == 4:
                        vw[0], vw[1], vw[2], vw[3] = lds4(vsh, vb + k * RW + lane * 4)
                    elif DW == 2:
                        vw[0], vw[1] = lds2(vsh, vb + k * RW + lane * 2)
                    elif DL == 1:  # head dim 32: a lane owns one half of a word
                        vw[0] = vsh[vb + k * RW + (lane >> 1)] >> U(16 * (lane & 1))
                    else:  # 1 or 3 words (head dim 64, 192)
                        for wd in range(DW):
                            vw[wd] = vsh[vb + k * RW + lane * DW + wd]
                    for wd in range(DW):
                        for hh in range(min(2, DL)):
                            vx = f16_bits_to_f32(U(vw[wd] >> U(16 * hh)) & U(0xFFFF))
                            for r in range(R):
                                acc[r * DL + wd * 2 + hh] += pk[r] * vx
                warp_barrier()  # later copies overwrite these buffers
            if ROPE:
                # the new key, from qs (f16-rounded, as the pool holds it), into the state of
                # warp 0 of split 0; every warp reduces (the simulator's barriers)
                mine = split == 0 and wid == 0
                for r in range(R):
                    sp = np.float32(0.0)
                    for i in range(DL):
                        sp += qs[r, lane * DL + i] * _f16(qs[R, lane * DL + i])
                    sv = warp_allsum(sp, red, wid, lane)
                    if mine:
                        cm = max(m[r], sv)
                        p = math.exp(sv - cm)
                        al = math.exp(m[r] - cm)  # 0 where the warp saw no key (m = -inf)
                        m[r] = cm
                        lsum[r] = lsum[r] * al + p
                        for i in range(DL):
                            acc[r * DL + i] = acc[r * DL + i] * al + p * _f16(qs[R + 1, lane * DL + i])
            # merge the block's warps: each leaves (m, l, acc) in shared memory, then a warp
            # a row adds them, a lane the dims lane + 32 d (a thread an output element with
            # each row's weights recomputed took ~900 instructions a warp: Nsight Compute)
            for r in range(R):
                for d in range(DL):
                    mo[wid, r, lane * DL + d] = acc[r * DL + d]
                if lane == 0:
                    mml[wid, r, 0] = m[r]
                    mml[wid, r, 1] = lsum[r]
            cuda.syncthreads()
            o = cuda.local.array(DL, np.float32)
            for rb in range(0, R, W):  # the same trips in every warp (int8_block_store's reductions)
                r = min(rb + wid, R - 1)
                qi = q0 + r // G
                hq = hkv * G + r % G
                ok = rb + wid < R and qi < n_q
                big = np.float32(-math.inf)
                for w in range(W):
                    if mml[w, r, 1] > 0:  # a warp that saw no key: l = 0 and m = -inf
                        big = max(big, mml[w, r, 0])
                ll = np.float32(0.0)
                for d in range(DL):
                    o[d] = 0.0
                for w in range(W):
                    lw = mml[w, r, 1]
                    if lw > 0:
                        f = math.exp(mml[w, r, 0] - big)
                        ll += lw * f
                        for d in range(DL):
                            o[d] += mo[w, r, lane + 32 * d] * f
                if ok:
                    if direct:
                        for d in range(DL):
                            out[qi, hq, lane + 32 * d] = o[d] / ll
                    else:
                        for d in range(DL):
                            part_o[split, qi, hq, lane + 32 * d] = o[d]
                        if lane == 0:
                            part_ml[split, qi, hq, 0] = big
                            part_ml[split, qi, hq, 1] = ll
                # lanes hold 32 consecutive columns of a row for each d: one int8 block
                # (direct is the same for the whole block, so all its lanes take part)
                if XQ and direct:
                    for d in range(DL):
                        int8_block_store(o[d] / ll if ok else np.float32(0.0), ok,
                                         ((qi * n_kvh * G + hq) * dim + 32 * d) >> 5, lane, wid, red, xq_b, xq_f, XQ)
        # the tile's last block to finish merges the splits (luce.kernels.split_merge)
        if SELF_MERGE and not direct and arrive(counter, cuda.blockIdx.z * n_kvh + hkv, used, ibuf, tid):
            merge(part_o, part_ml, used, out, hkv, G, q0 * G, R, n_q * G, red, tid, W * 32, xq_b, xq_f)

    return pdl_ready(kernel)


# Queries up to which attention takes the one-query kernel's structure in tiles of
# row_tile(group) queries (trees and chains of verification). 1: decode only. Wider forms
# are correct (GPU test at 8K) but slower: H200, 23-node tree over 8K at d70f71e, 693 us
# against 662 us for the tiled kernel, and 188 us for attention_mma (654e268; 82 us at
# cf144b4), which is what several queries over an f16 pool take now (the row kernel at
# 58f5dc3: 941 us).
ROW_KERNEL_MAX_QUERIES = 1
# query rows (queries x GQA group) a block of the row kernel holds: at 16 the sm_90 code
# kept ~450 bytes of accumulators in local memory, at 8 none (112-158 registers)
ROW_TILE_ROWS = 8


def row_tile(n_q: int, group: int) -> int:
    """Queries a block of the row kernel takes."""
    return 1 if n_q == 1 else max(1, ROW_TILE_ROWS // group)


def _row_kernel_applies(n_q: int, dim: int, q8: bool, group: int = 1, long: bool = False) -> bool:
    if n_q == 1 and attention_mma.applies(n_q, dim, q8, long):
        return False  # long-context decode on tensor cores (attention_mma.decode_on_mma)
    return (n_q <= ROW_KERNEL_MAX_QUERIES and not q8 and dim % 32 == 0
            and decode_shape(dim, row_tile(n_q, group) * group)[0] > 0)


COMBINE_MAX_SPLITS = 512  # splits any plan makes (the combine reads them all for their (m, l))


COMBINE_WARPS = 4  # warps a combine block (one block per query and q head), each over every 4th split
# ... and up to this many where there are more splits than 8 a warp: a warp's splits are a
# chain of L2 round trips, two a trip (decode on the tensor-core kernel: ~100 splits)
COMBINE_MAX_WARPS = 16
# splits a combine warp reads a trip (consecutive ones), their loads in flight together
COMBINE_PER_TRIP = 4


def combine_warps(n_splits: int) -> int:
    """Warps of a combine block over n_splits splits: COMBINE_WARPS, doubled while a warp
    would have more than 8 splits, up to COMBINE_MAX_WARPS."""
    w = COMBINE_WARPS
    while w < COMBINE_MAX_WARPS and n_splits > 8 * w:
        w *= 2
    return w


@functools.lru_cache(maxsize=None)
def _combine(dim: int, xq_planes: int = 0, warps: int = COMBINE_WARPS, frags: bool = False):
    """The split combine for head dim `dim`: one block of `warps` warps (combine_warps) per
    (query, q head). Every warp reads all the splits' (m, l) itself (a few loads a lane,
    no barrier) for the common max and the last split that saw a key, then adds up its
    share of the splits' accumulators, dim/32 of them a lane in registers,
    COMBINE_PER_TRIP consecutive splits a trip with every load of the trip in flight
    together (two a trip, each split's accumulators loaded only once its weight was known,
    made a trip two round trips: see below); one barrier merges the warps. Splits that saw
    no key (l == 0) get weight 0 and their accumulators, read or not, are not used.
    The kernel before this one (a block per row, four threads a dim, three block
    reductions) took 4.7 us after a 640-key decode and 17 us after a 23-node tree in an
    8K-sized grid (H200, 311dab6); this one 4.9 and 6.6 (33 splits; 6.2 over 17), and 9.8
    us after a decode over 8K keys (64 splits used: each warp's 8 trips wait out their
    loads; the whole 8K decode went 31.8 -> 36.2 us in `bench_attention`, while end-to-end
    decode at 8K stayed at 209-210 tok/s). More splits a trip is the next thing to time.
    xq_planes > 0: it also stores out's quantize_x form (as _decode_kernel's). frags: and
    out's rows (queries x q heads x dim) as luce.kernels.matvec_mma fragments of both weight
    layouts (f4, f6; zeros from the last query to the fragments' multiple of 8 rows), which
    the o projection reads: its conversion launch saved (verification widths)."""
    from .quantize_x import int8_block_store
    from .matvec_mma import frag_u16
    from .mma import f32x2_to_f16x2
    FR = frags
    XQ = xq_planes
    DL = ceil_div(dim, 32)  # dims a lane owns (lanes past the last dim idle)
    W = warps
    PT = COMBINE_PER_TRIP
    add_splits = split_sums(dim, PT)
    RED = max(1, W * WARP_RED_SLOTS)
    OW = DL * 32  # array shapes must be plain constants, not expressions

    @cuda.jit
    def combine(part_o, part_ml, n_splits, meta, out, xq_b, xq_f, f4, f6):
        grid_dependency_sync()  # luce.kernels.pdl: nothing unless LUCE_PDL
        i = cuda.blockIdx.x
        hq = cuda.blockIdx.y
        t = cuda.threadIdx.x
        wid = t // 32
        lane = t % 32
        nw = cuda.blockDim.x // 32
        rows8 = (cuda.gridDim.x + 7) // 8 * 8
        if FR:
            # zeros in the fragments' rows past the queries: the last query's blocks write
            # the padding rows (to the multiple of 8) of their head's columns; rows past
            # meta[1] (never the case in a verification forward) their own
            first = i if i >= meta[1] else i + 1
            last = rows8 if i == cuda.gridDim.x - 1 else i + 1
            for r in range(first, last):
                for c in range(t, dim, cuda.blockDim.x):
                    f4[frag_u16(1, hq * dim + c, r, rows8)] = np.uint16(0)
                    f6[frag_u16(0, hq * dim + c, r, rows8)] = np.uint16(0)
        if i >= meta[1]:  # the same for the whole block: no thread skips a barrier alone
            return
        red = cuda.shared.array(RED, np.float32)
        osh = cuda.shared.array((W, OW), np.float32)
        lsh = cuda.shared.array(W, np.float32)
        big, n_used = used_splits(part_ml, n_splits, i, hq, True, red, wid, lane)
        acc = cuda.local.array(DL, np.float32)
        for d in range(DL):
            acc[d] = 0.0
        # COMBINE_PER_TRIP consecutive splits a trip: warp w's are w PT.., then + W PT
        den = add_splits(part_o, part_ml, i, hq, big, n_used, wid * PT, nw * PT, acc, lane)
        for d in range(DL):
            osh[wid, lane + 32 * d] = acc[d]
        if lane == 0:
            lsh[wid] = den
        cuda.syncthreads()
        for c in range(t, dim, cuda.blockDim.x):  # whole warps a trip (dim a multiple of 32 with XQ)
            o = np.float32(0.0)
            ll = np.float32(0.0)
            for w in range(nw):
                o += osh[w, c]
                ll += lsh[w]
            out[i, hq, c] = o / ll
            if FR:  # a convex sum of f16 values: in f16's range
                h16 = np.uint16(f32x2_to_f16x2(o / ll, np.float32(0.0)) & np.uint32(0xFFFF))
                f4[frag_u16(1, hq * dim + c, i, rows8)] = h16
                f6[frag_u16(0, hq * dim + c, i, rows8)] = h16
            if XQ:
                int8_block_store(o / ll, True, ((i * out.shape[1] + hq) * dim + c) >> 5, lane, wid, red, xq_b, xq_f, XQ)

    return pdl_ready(combine)


def combine_splits(part_o, part_ml, n_splits: int, meta, out, stream=0, xq_out=None, xq_planes: int = 1,
                   frags_out=None):
    """Merge the splits' (O, m, l) partials into out [N, Hq, D] (rows past meta[1] untouched);
    and into xq_out (uint16) out's quantize_x form in xq_planes planes, when given; and into
    frags_out (the Q4_K and Q6_K layouts' uint16 buffers, matvec_mma.frags_targets for N
    rows of Hq D) out's matvec_mma fragments, when given."""
    n_q, n_heads, dim = out.shape
    xq_b, xq_f, planes = _xq_views(out, xq_out, xq_planes)
    w = combine_warps(n_splits)  # the simulator: one warp
    if frags_out is not None and (n_heads * dim) % 256:
        raise ValueError(f"combine_splits: fragments of rows of {n_heads * dim} (a multiple of 256)")
    f4, f6 = frags_out if frags_out is not None else (out.reshape(out.size).view(np.uint16),) * 2
    _combine(dim, planes, w, frags_out is not None)[(n_q, n_heads), block_threads(32 * w), stream](
        part_o, part_ml, n_splits, meta, out, xq_b, xq_f, f4, f6)


def _xq_views(out, xq_out, planes: int):
    """(bytes, float32) views of xq_out for the kernels' int8 epilogue and its planes; with
    no xq_out, views of out (typed alike, never written) and 0."""
    if xq_out is None:
        flat = out.reshape(out.size)
        return flat.view(np.uint8), flat, 0
    from .quantize_x import xq_size
    n_q, n_heads, dim = out.shape
    if dim % 32 or xq_out.dtype != np.uint16 or xq_out.size != xq_size(n_heads * dim, n_q, planes):
        raise ValueError(f"attention: xq_out must be uint16 [{xq_size(n_heads * dim, n_q, planes)}] (quantize_x of "
                         f"{n_q} rows of {n_heads} x {dim}, head dim a multiple of 32), got {xq_out.dtype} "
                         f"[{xq_out.size}]")
    flat = xq_out.reshape(xq_out.size)
    return flat.view(np.uint8), flat.view(np.float32), planes


class RopeArgs(NamedTuple):
    """What the decode kernel needs to do qk_rope's work itself (paged_attention_cuda's
    rope): the new token's k and v [1, Hkv, D] as the projections left them (float32), the
    norm weights (float32 [D]; has_norm 0: none, never read), eps, the device inv_freq
    table (luce.kernels.rope.inv_freq_table), rope_dim and the style id (0 adjacent pairs,
    1 halves)."""
    k: object
    v: object
    q_norm: object
    k_norm: object
    has_norm: int
    eps: float
    inv_freq: object
    rope_dim: int
    style: int


def rope_args(k, v, q_norm, k_norm, eps: float, rope_dim: int, base: float, style: str,
              freq_scale: float = 1.0) -> RopeArgs:
    """RopeArgs from qk_rope_cuda's arguments (norm weights both or neither)."""
    from .qk_rope import _no_norm
    from .rope import _STYLE_ID, inv_freq_table
    if (q_norm is None) != (k_norm is None):
        raise ValueError("attention rope: give both q_norm and k_norm or neither")
    has = q_norm is not None
    w = _no_norm()
    return RopeArgs(k, v, q_norm if has else w, k_norm if has else w, int(has), float(eps),
                    inv_freq_table(rope_dim, base, freq_scale), int(rope_dim), _STYLE_ID[style])


def rope_fuses(n_q: int, n_heads: int, n_kv_heads: int, head_dim: int, n_keys: int, q8: bool = False,
               long: bool = False) -> bool:
    """Whether paged_attention_cuda takes `rope` for this launch: one query (decode) on the
    one-query kernel over an f16 pool."""
    return n_q == 1 and not q8 and attention_plan(n_q, n_heads, n_kv_heads, head_dim, n_keys,
                                                  long=long).get("kind") == "row"


_NO_ROPE: dict = {}


def _no_rope(q) -> RopeArgs:
    """RopeArgs of the right types that the kernel without rope never reads."""
    r = _NO_ROPE.get("r")
    if r is None:
        from .qk_rope import _no_norm
        from .rope import inv_freq_table
        w = _no_norm()
        r = _NO_ROPE["r"] = (w, inv_freq_table(2, 1e4))
    return RopeArgs(q, q, r[0], r[0], 0, 1e-6, r[1], 0, 0)


def long_context_differs(n_q: int, n_heads: int, n_kv_heads: int, head_dim: int, n_keys: int,
                         q8: bool = False) -> bool:
    """Whether n_q queries over a long context (attention_plan's long) take another kernel
    or plan than over a short one: only then does a backend need a graph of each kind."""
    return (attention_plan(n_q, n_heads, n_kv_heads, head_dim, n_keys, q8=q8, long=True)
            != attention_plan(n_q, n_heads, n_kv_heads, head_dim, n_keys, q8=q8, long=False))


def attention_plan(n_q: int, n_heads: int, n_kv_heads: int, head_dim: int, n_keys: int,
                   max_splits: int | None = None, q8: bool = False, long: bool = False) -> dict:
    """Launch geometry for n_q queries over up to n_keys keys (for a captured graph: the
    whole context). pages_per_split is what each split reads at n_keys; the kernel
    re-divides the pages actually present among the n_splits at run time. long: the
    context holds at least attention_mma.DECODE_LONG_KEYS keys now (decode's choice of
    kernel, attention_mma.decode_on_mma; a tree's Q in shared memory, attention_mma.plan)."""
    if head_dim % 16 or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim}: need a multiple of 16 in [16, 256]")
    group = n_heads // n_kv_heads
    row_kernel = _row_kernel_applies(n_q, head_dim, q8, group, long)
    if not row_kernel and attention_mma.applies(n_q, head_dim, q8, long):
        p = attention_mma.plan(n_q, n_heads, n_kv_heads, n_keys, max_splits, dim=head_dim, long=long)
        return dict(kind="mma", qt=None, nt=32 * p["warps"], warps=p["warps"], n_tiles=p["n_tiles"],
                    n_splits=p["n_splits"], pages_per_split=None, half=n_q * group <= 8, qsh=p["qsh"])
    if row_kernel:
        qt = row_tile(n_q, group)
        n_tiles = ceil_div(n_q, qt)
        warps, bufs, chunk = decode_shape(head_dim, qt * group)
        ns = decode_plan(n_kv_heads * n_tiles, n_keys, warps, chunk)
        if max_splits is not None:
            ns = max(1, min(ns, max_splits))
        return dict(kind="row", qt=qt, nt=32 * warps, warps=warps, bufs=bufs, chunk=chunk, n_tiles=n_tiles,
                    n_splits=ns, pages_per_split=None, per_trip=decode_per_trip(head_dim, qt * group),
                    self_merge=decode_self_merges(qt * group, warps))
    nt = block_threads(128)
    rows = n_q * group
    # at least one score and one output element per thread
    qt = max(2, nt // head_dim, min(_qt_cap(head_dim), 1 << max(0, rows - 1).bit_length()))
    n_tiles = ceil_div(rows, qt)
    n_pages = max(1, ceil_div(n_keys, BLOCK))
    n_splits = max(1, min(n_pages, ceil_div(_TARGET_BLOCKS, n_kv_heads * n_tiles), COMBINE_MAX_SPLITS))
    if max_splits is not None:
        n_splits = min(n_splits, max_splits)
    pps = ceil_div(n_pages, n_splits)
    n_splits = ceil_div(n_pages, pps)
    return dict(qt=qt, nt=nt, n_tiles=n_tiles, n_splits=n_splits, pages_per_split=pps)


def combines(plan: dict) -> bool:
    """Whether attention under `plan` (attention_plan's) ends in the combine launch."""
    if plan["n_splits"] <= 1:
        return False
    return plan.get("kind") != "row" or not plan["self_merge"]


def paged_attention_cuda(q, k_pool, v_pool, table, layer: int, meta, kv_pos, q_pos, mask_bits=None, *,
                         window: int = 0, n_keys: int, out=None, scratch=None, max_splits: int | None = None,
                         k_scale=None, v_scale=None, xq_out=None, xq_planes: int = 1, rope=None, long: bool = False,
                         frags_out=None, stream=0):
    """Attention of N new queries over the paged pool (luce.kernels.paging layout).

    q: device f32 [N, Hq, D] (roped); meta: device int32, meta[0] = C committed rows,
    meta[1] = N (the new rows C..C+N-1 already written to the pool); kv_pos: device int32
    position of every logical row; q_pos: device int32 [N]; mask_bits: device uint64 [N]
    (tree_mask_bits) or None for causal (prefill/chain of any length); window: sliding
    window (0: none). n_keys >= C + N sizes the split grid. Returns out f32 [N, Hq, D];
    the same result as attention_ref. q8_0 pools: k_pool/v_pool int8 with k_scale/v_scale
    (luce.kernels.paging), dequantized to f16 as each tile is loaded. xq_out: device
    uint16, where out's quantize_x form (rows of Hq x D, xq_planes planes) goes as well:
    from the decode kernel's or its combine's epilogue, else by a quantize_x launch.
    rope (decode over an f16 pool, where attention_plan gives the one-query kernel: see
    rope_fuses): a RopeArgs; q and its k are then as the projections left them, and the
    kernel does qk_rope's work and write_kv_cuda's (k, v rows and position into the pool).
    long: the context holds at least attention_mma.DECODE_LONG_KEYS keys (attention_plan).
    frags_out: out's matvec_mma fragments too, from the combine (see combine_splits), where
    the plan has one (combines(plan)); elsewhere a ValueError.
    """
    n_q, n_heads, dim = q.shape
    n_kvh = k_pool.shape[2]
    q8 = k_scale is not None
    plan = attention_plan(n_q, n_heads, n_kvh, dim, n_keys, max_splits, q8=q8, long=long)
    if frags_out is not None and not combines(plan):
        raise ValueError("paged_attention_cuda: frags_out where the plan has no combine launch")
    if rope is not None and not (n_q == 1 and not q8 and plan.get("kind") == "row"):
        raise ValueError(f"attention: rope fuses into one-query decode over an f16 pool only (queries {n_q}, "
                         f"q8_0 pool {q8}, kernel {plan.get('kind', 'tile')})")
    if out is None:
        out = cuda.device_array((n_q, n_heads, dim), dtype=np.float32, stream=stream)
    ns = plan["n_splits"]
    direct = 1 if ns == 1 else 0
    if direct:
        # never touched, but typed like the split scratch so one compiled kernel serves both
        part_o = part_ml = out.reshape((1,) + tuple(out.shape))
    else:
        if scratch is None:
            scratch = (cuda.device_array((ns, n_q, n_heads, dim), np.float32, stream=stream),
                       cuda.device_array((ns, n_q, n_heads, 2), np.float32, stream=stream))
        part_o, part_ml = scratch
    scale = np.float32(1.0 / math.sqrt(dim))
    causal = 1 if mask_bits is None else 0
    if mask_bits is None:
        mask_bits = kv_pos  # never read when causal (numba needs an array here)
    flat = lambda pool: pool.reshape(pool.size).view(np.uint16)  # noqa: E731 - 16-byte row loads
    if plan.get("kind") == "row":  # merges its own splits (luce.kernels.split_merge)
        xq_b, xq_f, planes = _xq_views(out, xq_out, xq_planes)
        in_kernel = direct or plan["self_merge"]  # else the combine writes the output (and its int8 form)
        kernel = _decode_kernel(dim, n_heads // n_kvh, plan["qt"], plan["warps"], plan["bufs"], plan["chunk"],
                                plan["per_trip"], plan["self_merge"], planes if in_kernel else 0, rope is not None)
        ra = rope if rope is not None else _no_rope(q)
        kernel[(ns, n_kvh, plan["n_tiles"]), plan["nt"], stream](
            q, flat(k_pool), flat(v_pool), table, layer, k_pool.shape[1], meta, kv_pos, q_pos, mask_bits, causal,
            window, scale, direct, out, part_o, part_ml, merge_counters(n_kvh * plan["n_tiles"], stream), xq_b, xq_f,
            ra.k, ra.v, ra.q_norm, ra.k_norm, ra.has_norm, np.float32(ra.eps), ra.inv_freq, ra.rope_dim, ra.style)
        if not in_kernel:
            combine_splits(part_o, part_ml, ns, meta, out, stream, xq_out, xq_planes, frags_out)
        return out
    if plan.get("kind") == "mma":
        attention_mma.launch(dim, plan["warps"], plan["half"], plan["qsh"], (ns, n_kvh, plan["n_tiles"]), stream,
                             q, flat(k_pool), flat(v_pool), table, layer, k_pool.shape[1], meta, kv_pos, q_pos,
                             mask_bits, causal, window, scale, direct, out, part_o, part_ml)
    else:
        k32, v32 = k_pool.view(np.uint32), v_pool.view(np.uint32)
        kd, vd = (k_scale, v_scale) if q8 else (k32, v32)  # f16 pools: never read
        _attn_kernel(dim, plan["qt"], plan["nt"], q8)[(ns, n_kvh, plan["n_tiles"]), plan["nt"], stream](
            q, k32, v32, kd, vd, table, layer, meta, kv_pos, q_pos, mask_bits, causal, window, scale, direct,
            out, part_o, part_ml)
    if not direct:
        combine_splits(part_o, part_ml, ns, meta, out, stream, xq_out, xq_planes, frags_out)
    elif xq_out is not None:
        from .quantize_x import quantize_x
        quantize_x(out, out=xq_out, stream=stream, planes=xq_planes)
    return out


def attention_cache_cuda(cache, layer: int, q, q_pos, mask_bits=None, window: int | None = None, out=None,
                         max_splits: int | None = None, *, scratch=None, n_keys: int | None = None, xq_out=None,
                         xq_planes: int = 1):
    """paged_attention_cuda over a device PagedKVCache after its write() of this layer
    (f16 or q8_0 pools). n_keys: the grid's context (default: the current one; pass
    cache.n_ctx for a captured graph), scratch as attention_plan sizes it (for the
    cache's current length: `long`); xq_out, xq_planes: as paged_attention_cuda's."""
    return paged_attention_cuda(q, cache.k_pool, cache.v_pool, cache.table_d, layer, cache.meta, cache.pos_d, q_pos,
                                mask_bits, window=window or 0,
                                n_keys=cache.n_past + cache.n_pending if n_keys is None else n_keys, out=out,
                                scratch=scratch, max_splits=max_splits, k_scale=cache.k_scale,
                                v_scale=cache.v_scale, xq_out=xq_out, xq_planes=xq_planes,
                                long=cache.n_past >= attention_mma.DECODE_LONG_KEYS, stream=cache.stream)


_MASK_MEMO: dict = {}  # one forward's mask serves every layer: upload it once


def attention_op_cuda(kv, layer: int, q, k, v, positions, mask, window, *, mask_bits=None, out=None, scratch=None,
                      n_keys: int | None = None):
    """`ops.attention` of luce.models.transformer on the device (the NumpyOps signature):
    writes this layer's new K/V into the PagedKVCache `kv` (device=True, reserve()d; f16
    or q8_0), then attends. mask: host bool N x N (None or lower-triangular: causal, any
    N; else a tree, N <= 64) unless mask_bits (device uint64 [N]) is given; positions:
    host ints or device int32 [N]; out, scratch, n_keys: see attention_cache_cuda."""
    n = q.shape[0]
    if isinstance(positions, (np.ndarray, list, tuple)):
        positions = cuda.to_device(np.asarray(positions, dtype=np.int32), stream=kv.stream)
    kv.write(layer, k, v, positions)
    bits = mask_bits
    if bits is None and mask is not None:
        m = np.asarray(mask, dtype=bool)
        if not np.array_equal(m, np.tril(np.ones((n, n), dtype=bool))):
            key = m.tobytes() + bytes([n])
            bits = _MASK_MEMO.get(key)
            if bits is None:
                _MASK_MEMO.clear()
                bits = _MASK_MEMO[key] = cuda.to_device(tree_mask_bits(m), stream=kv.stream)
    return attention_cache_cuda(kv, layer, q, positions, bits, window, out=out, scratch=scratch, n_keys=n_keys)
