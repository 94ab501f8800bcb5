"""Attention of many queries at once (prefill chunks, tree and chain verification) on
tensor cores, over the paged f16 KV pool.

Why: the FMA-tiled kernel of attention.py spent 562 us a layer on a 512-token causal
prefill of the Qwen3-8B shape and 662 us on a 23-node tree over 8K keys (H200, d70f71e),
15x the one-query decode kernel, where the arithmetic needs a few microseconds on tensor
cores. This is the flash-attention-2 structure with `mma.sync` m16n8k16 (f16 in, f32 sums):

- a block is (split of the keys, kv head, tile of 16 x WARPS query rows); query row r is
  query r // G, q head r % G of the kv head (G = the GQA group), so the rows of a group
  share every K/V tile the block loads;
- each warp keeps its 16 rows of Q (scaled, f16) as mma A fragments in registers for the
  whole kernel, and per page of 64 keys: S = Q K^T (16 x 64, f32 in registers), the mask
  (only on pages that hold new keys or under a sliding window), the online softmax (row
  max and sums over the four lanes of a row), then O += P V with P re-packed from the S
  registers as A fragments (no trip through shared memory) and V read by `ldmatrix.trans`;
- K and V pages are loaded by the whole block with 16-byte loads into padded shared rows
  (ldmatrix reads 8 rows at once: a stride of dim/2 + 4 words puts them in distinct banks).
Splits leave (O, m, l) for attention's combine kernel exactly as the other kernels do.

In the CUDA simulator the mma, ldmatrix and the lane reductions are emulated
(luce.kernels.mma), so the same code is tested there on small shapes.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._reduce import ceil_div
from .mma import SCRATCH, f32x2_to_f16x2, ldsm_x4, ldsm_x4_trans, mma_f16, quad_max, quad_sum, sts4
from .paging import BLOCK
from .vector_load import SIM, ldg_u16_u32x4

KEYS = BLOCK  # keys a tile: one page of the pool
MAX_WARPS = 8
TILE_WARPS = 4  # warps (x16 query rows) a block when the rows need several tiles
TARGET_BLOCKS = 264  # two waves over the H200's 132 SMs


def applies(n_q: int, dim: int, q8: bool) -> bool:
    """Several queries over an f16 pool with head dims of 32, 64 or 128 (mma's k of 16, two
    k steps an ldmatrix; larger dims would not keep Q, S and O in registers)."""
    return n_q > 1 and not q8 and dim % 32 == 0 and dim <= 128


def plan(n_q: int, n_heads: int, n_kv_heads: int, n_keys: int, max_splits: int | None, target_blocks=None) -> dict:
    """Warps a block, query tiles and key splits. Up to 128 rows (a verification tree of
    32 nodes at GQA 4) stay in one tile, so every K/V byte is read once per kv head."""
    rows = n_q * (n_heads // n_kv_heads)
    warps = ceil_div(rows, 16)
    warps = warps if warps <= MAX_WARPS else TILE_WARPS
    if SIM:
        warps = min(warps, 2)  # every simulated thread is an OS thread
    n_tiles = ceil_div(rows, 16 * warps)
    n_pages = max(1, ceil_div(n_keys, KEYS))
    target = TARGET_BLOCKS if target_blocks is None else target_blocks
    ns = max(1, min(n_pages, ceil_div(target, n_kv_heads * n_tiles), 512))
    if max_splits is not None:
        ns = max(1, min(ns, max_splits))
    return dict(warps=warps, n_tiles=n_tiles, n_splits=ns)


@functools.lru_cache(maxsize=None)
def kernel(dim: int, warps: int):
    NT = 32 * warps
    ROWS = 16 * warps
    RS = dim // 2 + 4  # shared row stride in words: 16-byte padding against bank conflicts
    DK = dim // 16  # mma k steps over the head dim
    DN = dim // 8  # 8-wide output column blocks
    NB = KEYS // 8  # 8-key score column blocks of a page
    PIECES = KEYS * dim // 8  # 16-byte pieces of a K (V) page
    PT = ceil_div(PIECES, NT)  # a thread's pieces, all loaded before any is stored
    assert 2 * KEYS >= ROWS
    SCR = (warps, 32, SCRATCH) if SIM else (1,)
    NEG = -math.inf
    U = np.uint32
    U64 = np.uint64

    @cuda.jit
    def attn(q, kf, vf, table, layer, n_layers, meta, kv_pos, q_pos, mask, causal, window, scale, direct,
             out, part_o, part_ml):
        split = cuda.blockIdx.x
        hkv = cuda.blockIdx.y
        r0 = cuda.blockIdx.z * ROWS
        t = cuda.threadIdx.x
        wid = t // 32
        lane = t % 32
        g = lane >> 2
        c4 = lane & 3
        n_kvh = cuda.gridDim.y
        n_ctx = meta[0]
        n_new = meta[1]
        n_keys = n_ctx + n_new
        G = q.shape[1] // n_kvh
        n_rows = n_new * G

        kvs = cuda.shared.array(2 * KEYS * RS, np.uint32)  # K page then V page; Q staging first
        scr = cuda.shared.array(SCR, np.uint32)
        qf = cuda.local.array((DK, 4), np.uint32)
        s = cuda.local.array((NB, 4), np.float32)
        o = cuda.local.array((DN, 4), np.float32)
        kw = cuda.local.array((PT, 4), np.uint32)
        vw = cuda.local.array((PT, 4), np.uint32)

        # Q, scaled, as f16 rows in shared memory, then each warp's A fragments
        for e in range(t, ROWS * (dim // 2), NT):
            r = e // (dim // 2)
            w = e % (dim // 2)
            row = r0 + r
            lo = np.float32(0.0)
            hi = np.float32(0.0)
            if row < n_rows:
                qi = row // G
                hq = hkv * G + row % G
                lo = q[qi, hq, 2 * w] * scale
                hi = q[qi, hq, 2 * w + 1] * scale
            kvs[r * RS + w] = f32x2_to_f16x2(lo, hi)
        cuda.syncthreads()
        mt = lane >> 3
        for ks in range(DK):
            a0, a1, a2, a3 = ldsm_x4(kvs, (wid * 16 + (mt & 1) * 8 + (lane & 7)) * RS + ks * 8 + (mt >> 1) * 4,
                                     scr, wid, lane)
            qf[ks, 0] = a0
            qf[ks, 1] = a1
            qf[ks, 2] = a2
            qf[ks, 3] = a3
        cuda.syncthreads()

        # this lane's two rows (g and g + 8 of the warp's 16): query, position, tree mask
        row_a = r0 + wid * 16 + g
        row_b = row_a + 8
        qa = min(row_a // G, n_new - 1)
        qb = min(row_b // G, n_new - 1)
        pos_a = q_pos[qa] if window > 0 else 0
        pos_b = q_pos[qb] if window > 0 else 0
        bits_a = U64(0)
        bits_b = U64(0)
        if not causal:
            bits_a = U64(mask[qa])
            bits_b = U64(mask[qb])
        m_a = NEG
        m_b = NEG
        l_a = np.float32(0.0)
        l_b = np.float32(0.0)
        for d in range(DN):
            for c in range(4):
                o[d, c] = 0.0

        last_row = min(r0 + ROWS, n_rows) - 1
        key_end = n_keys
        if causal:
            key_end = min(n_keys, n_ctx + last_row // G + 1)
        min_qpos = 2147483647
        if window > 0:
            for i in range(r0 // G, last_row // G + 1):
                min_qpos = min(min_qpos, q_pos[i])
        n_pages = (key_end + KEYS - 1) // KEYS
        pps = (n_pages + cuda.gridDim.x - 1) // cuda.gridDim.x
        p_lo = split * pps
        p_hi = min(p_lo + pps, n_pages)
        if r0 >= n_rows:
            p_hi = p_lo  # a tile past the queries present (graph-sized grid): nothing to do

        for page in range(p_lo, p_hi):
            j0 = page * KEYS
            if window > 0 and j0 + KEYS <= n_ctx and kv_pos[j0 + KEYS - 1] <= min_qpos - window:
                continue  # uniform over the block: no barrier is skipped by only some threads
            base = ((table[page] * n_layers + layer) * n_kvh + hkv) * KEYS * dim  # uint16 index
            for c in range(PT):
                e = t + c * NT
                kk = e // (dim // 8)
                off = base + kk * dim + 8 * (e % (dim // 8))
                for w in range(4):  # past the last key: zeros, so no NaN of unwritten memory gets in
                    kw[c, w] = U(0)
                    vw[c, w] = U(0)
                if e < PIECES and j0 + kk < key_end:
                    a0, a1, a2, a3 = ldg_u16_u32x4(kf, off)
                    kw[c, 0] = a0
                    kw[c, 1] = a1
                    kw[c, 2] = a2
                    kw[c, 3] = a3
                    a0, a1, a2, a3 = ldg_u16_u32x4(vf, off)
                    vw[c, 0] = a0
                    vw[c, 1] = a1
                    vw[c, 2] = a2
                    vw[c, 3] = a3
            for c in range(PT):
                e = t + c * NT
                if e < PIECES:
                    kk = e // (dim // 8)
                    w4 = 4 * (e % (dim // 8))
                    sts4(kvs, kk * RS + w4, kw[c, 0], kw[c, 1], kw[c, 2], kw[c, 3])
                    sts4(kvs, (KEYS + kk) * RS + w4, vw[c, 0], vw[c, 1], vw[c, 2], vw[c, 3])
            cuda.syncthreads()

            # S = Q K^T: one ldmatrix.x4 brings two k steps of an 8-key column block
            for nb in range(NB):
                for c in range(4):
                    s[nb, c] = 0.0
                for k2 in range(DK // 2):
                    b0, b1, b2, b3 = ldsm_x4(kvs, (nb * 8 + (lane & 7)) * RS + k2 * 16 + mt * 4, scr, wid, lane)
                    for h in range(2):
                        ks = 2 * k2 + h
                        bl = b0 if h == 0 else b2
                        bh = b1 if h == 0 else b3
                        s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = mma_f16(
                            scr, wid, lane, qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3], bl, bh,
                            s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])

            # which (row, key) pairs count: only pages reaching the new keys, or under a window
            if j0 + KEYS > n_ctx or window > 0:
                for nb in range(NB):
                    for c in range(4):
                        j = j0 + nb * 8 + 2 * c4 + (c & 1)
                        row = row_a if c < 2 else row_b
                        qi = qa if c < 2 else qb
                        ok = row < n_rows and j < key_end
                        if ok and j >= n_ctx:
                            mi = j - n_ctx
                            if causal:
                                ok = mi <= row // G
                            else:
                                bits = bits_a if c < 2 else bits_b
                                ok = (bits >> U64(mi)) & U64(1) != U64(0)
                        if ok and window > 0:
                            ok = kv_pos[j] > (pos_a if c < 2 else pos_b) - window
                        if not ok:
                            s[nb, c] = NEG

            # online softmax over the page: row maxima across the row's four lanes
            mx_a = m_a
            mx_b = m_b
            for nb in range(NB):
                mx_a = max(mx_a, max(s[nb, 0], s[nb, 1]))
                mx_b = max(mx_b, max(s[nb, 2], s[nb, 3]))
            mx_a = quad_max(mx_a, scr, wid, lane)
            mx_b = quad_max(mx_b, scr, wid, lane)
            al_a = np.float32(1.0) if mx_a == NEG else math.exp(m_a - mx_a)
            al_b = np.float32(1.0) if mx_b == NEG else math.exp(m_b - mx_b)
            m_a = mx_a
            m_b = mx_b
            l_a *= al_a
            l_b *= al_b
            for d in range(DN):
                o[d, 0] *= al_a
                o[d, 1] *= al_a
                o[d, 2] *= al_b
                o[d, 3] *= al_b
            for nb in range(NB):
                for c in range(4):
                    mm = m_a if c < 2 else m_b
                    p = np.float32(0.0) if s[nb, c] == NEG else math.exp(s[nb, c] - mm)
                    s[nb, c] = p
                    if c < 2:
                        l_a += p
                    else:
                        l_b += p

            # O += P V: P's A fragments are the S registers of two column blocks, repacked
            for kb in range(KEYS // 16):
                pa0 = f32x2_to_f16x2(s[2 * kb, 0], s[2 * kb, 1])
                pa1 = f32x2_to_f16x2(s[2 * kb, 2], s[2 * kb, 3])
                pa2 = f32x2_to_f16x2(s[2 * kb + 1, 0], s[2 * kb + 1, 1])
                pa3 = f32x2_to_f16x2(s[2 * kb + 1, 2], s[2 * kb + 1, 3])
                for d2 in range(DN // 2):
                    b0, b1, b2, b3 = ldsm_x4_trans(
                        kvs, (KEYS + kb * 16 + (mt & 1) * 8 + (lane & 7)) * RS + d2 * 8 + (mt >> 1) * 4,
                        scr, wid, lane)
                    d = 2 * d2
                    o[d, 0], o[d, 1], o[d, 2], o[d, 3] = mma_f16(scr, wid, lane, pa0, pa1, pa2, pa3, b0, b1,
                                                                 o[d, 0], o[d, 1], o[d, 2], o[d, 3])
                    o[d + 1, 0], o[d + 1, 1], o[d + 1, 2], o[d + 1, 3] = mma_f16(
                        scr, wid, lane, pa0, pa1, pa2, pa3, b2, b3, o[d + 1, 0], o[d + 1, 1], o[d + 1, 2], o[d + 1, 3])
            cuda.syncthreads()

        l_a = quad_sum(l_a, scr, wid, lane)
        l_b = quad_sum(l_b, scr, wid, lane)
        for h in range(2):
            row = row_a if h == 0 else row_b
            if row < n_rows:
                qi = row // G
                hq = hkv * G + row % G
                ll = l_a if h == 0 else l_b
                for d in range(DN):
                    for c in range(2):
                        col = d * 8 + 2 * c4 + c
                        v = o[d, 2 * h + c]
                        if direct:
                            out[qi, hq, col] = v / ll
                        else:
                            part_o[split, qi, hq, col] = v
                if not direct and c4 == 0:
                    part_ml[split, qi, hq, 0] = m_a if h == 0 else m_b
                    part_ml[split, qi, hq, 1] = ll

    return attn
