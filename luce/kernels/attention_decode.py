"""Decode attention (one new query) over the paged f16 pool, a thread block a (split, kv
head), each step's keys spread over all of the block's threads.

Why another decode kernel: the row kernel (luce.kernels.attention._decode_kernel) gives each
warp its own chunk of 16 keys for all the kv head's q heads, softmax included, so one warp
runs ~4.5 K instructions a chunk, ~12 of them for each multiply-add (warp-wide max and sum
for every row and chunk, q read from shared memory for every product). Nsight Compute on
the H200 (Qwen3-8B shape, 640 keys in an 8K-sized grid, 14.1 us): 1.63 M instructions,
0.26 eligible warps a scheduler, DRAM 4% busy: one latency chain. Here a step of KS keys
(K and V copied into shared memory with cp.async, the next step's copies in flight while
this one is computed) goes through three passes over the whole block:

- scores: LPK lanes a key, each with its share of the head dims of every q head of the kv
  head in registers (q loaded once, pre-scaled), a group sum over the key's lanes;
- softmax: a thread a key, the block's max and sum for each q head through one shared
  exchange (every thread then holds the same running max and sum);
- values: a thread a (8-dim block, key partition), 16-byte V reads (rows padded so the
  partitions' reads fall in different banks), accumulating over the block's steps in
  registers; the partitions are added once, at the end, by a group sum of adjacent lanes.

A split leaves its partial (output, max, sum) like the row kernel's, and the last block of
a kv head merges the splits (luce.kernels.split_merge). Decode only (the tree and chain
forms of several queries keep their kernels), f16 pools, head dims 32-256 in multiples of
8, up to 8 q heads a kv head ... and not yet timed on the GPU: attention_plan takes it only
with LUCE_DECODE_ATTN=keys.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import cuda

from ._reduce import SIM, WARP_RED_SLOTS, ceil_div, warp_allmax, warp_allsum, warp_groupsum
from .device import device
from .paging import BLOCK
from .vector_load import f16_bits_to_f32

__all__ = ["applies", "plan", "kernel", "ENABLED"]

# LUCE_DECODE_ATTN=keys: decode attention on this kernel (default: the row kernel)
ENABLED = os.environ.get("LUCE_DECODE_ATTN", "row") == "keys"
THREADS = 128
SIM_THREADS = 32  # the simulator runs a thread an OS thread: one warp a block there
KEYS_A_STEP = 32  # a step's K and V (two buffers each) fit static shared memory at head dim 256
BUFFERS = 2
# q values a lane keeps in registers (rows x dims of its share; more where a lane would hold
# less than a 16-byte piece of K). 64 took the kernel to 208 registers (sm_90, ptxas 12.9).
QREGS = 32
TARGET_BLOCKS = 512  # splits x kv heads over a grid sized for the whole context (~4 an H200 SM)
_SMEM = 48 * 1024
U = np.uint32


def lanes_per_key(dim: int, rows: int) -> int:
    """Lanes that share a key in the score pass: enough that each keeps at most QREGS of the
    rows' q values, a power of two, at least one 16-byte piece of K each."""
    lpk = 1
    while dim * rows > QREGS * lpk and lpk < 32 and dim // (2 * lpk) >= 8:
        lpk *= 2
    return lpk


def smem_bytes(dim: int, rows: int, threads: int, keys: int, bufs: int) -> int:
    warps = threads // 32
    k = bufs * keys * dim * 2
    v = bufs * keys * (dim + 8) * 2
    return k + v + 4 * (keys * rows + 2 * warps * rows + max(1, warps * WARP_RED_SLOTS) + 1)


def buffers(dim: int, rows: int) -> int:
    """K/V buffers a step: BUFFERS where they fit static shared memory (not at head dim 256)."""
    return BUFFERS if smem_bytes(dim, rows, THREADS, KEYS_A_STEP, BUFFERS) <= _SMEM else 1


def applies(n_q: int, dim: int, q8: bool, group: int) -> bool:
    lpk = lanes_per_key(dim, group)
    return (ENABLED and n_q == 1 and not q8 and dim % 8 == 0 and 32 <= dim <= 256 and group <= 8
            and (dim // lpk) % 8 == 0 and (dim // lpk) * group <= 2 * QREGS
            and smem_bytes(dim, group, THREADS, KEYS_A_STEP, 1) <= _SMEM)


def plan(n_kv_heads: int, n_keys: int, dim: int, rows: int, max_splits: int | None = None) -> dict:
    """Splits of a grid sized for n_keys keys (the kernel re-divides the steps present at run
    time): a step of keys each up to TARGET_BLOCKS blocks in all."""
    from .attention import COMBINE_MAX_SPLITS
    steps = max(1, ceil_div(n_keys, KEYS_A_STEP))
    ns = max(1, min(steps, ceil_div(TARGET_BLOCKS, n_kv_heads), COMBINE_MAX_SPLITS))
    if max_splits is not None:
        ns = max(1, min(ns, max_splits))
    threads = SIM_THREADS if SIM else THREADS
    return dict(kind="keys", n_splits=ns, nt=threads, keys=KEYS_A_STEP, bufs=buffers(dim, rows), n_tiles=1)


@functools.lru_cache(maxsize=None)
def kernel(dim: int, group: int, threads: int = THREADS, keys: int = KEYS_A_STEP, bufs: int = BUFFERS,
           per_trip: int | None = None):
    """kernel(q, kf, vf, table, layer, n_layers, meta, kv_pos, q_pos, window, scale, direct, out,
    part_o, part_ml, counter), grid (splits, kv heads), `threads` threads: q f32 [1, Hq, D]
    (roped), kf/vf the pools as flat uint16, meta[0] + meta[1] keys present (meta[1] == 1)."""
    from .mma import CP_ASYNC_WAIT_GROUP, SHARED16, cp_async16, cp_async_commit, cp_async_wait, lds4
    from .split_merge import arrive, merge_per_trip, merge_rows
    from . import attention_mma

    R = group
    NT = threads
    W = NT // 32
    KS = keys
    NB = bufs
    LPK = lanes_per_key(dim, R)
    DPL = dim // LPK          # head dims a lane of a key holds in the score pass
    PPL = DPL // 8            # its 16-byte pieces
    KPW = 32 // LPK           # keys a warp's score trip
    KPB = W * KPW             # keys a block's score trip
    TRIPS = ceil_div(KS, KPB)
    QN = R * DPL
    DB = dim // 8             # 8-dim blocks of the value pass
    KP = NT // DB             # key partitions of the value pass (adjacent lanes)
    KROW = dim // 2           # uint32 words of a K row in shared memory
    VROW = dim // 2 + 4       # of a V row: 16 bytes of padding, so partitions hit other banks
    KW = KS * KROW
    VW = KS * VROW
    KSH, VSH = NB * KW, NB * VW
    NSC = KS * R
    NWR = W * R
    RED = max(1, W * WARP_RED_SLOTS)
    NACC = R * 8
    WAIT_PRIOR = CP_ASYNC_WAIT_GROUP[NB - 1]
    merge = merge_rows(dim, per_trip or merge_per_trip(dim, R))
    assert NT % 32 == 0 and KS <= NT and (KS % KPB == 0 or KPB > KS), (NT, KS, KPB)
    assert NT % DB == 0 and 1 <= KP <= 32 and 32 % KP == 0 and KS % KP == 0 and BLOCK % KS == 0, (dim, NT, KS)
    assert DPL % 8 == 0 and QN <= 2 * QREGS and NB in (1, 2) and smem_bytes(dim, R, NT, KS, NB) <= _SMEM

    @device(inline=True)
    def copy_step(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, j0, n_keys, tid, buf):
        """Start the copies of keys j0 .. j0 + KS - 1 (one page: KS divides BLOCK) into
        buffer `buf`; keys past the last are zero-filled."""
        base = (((table[j0 // BLOCK] * n_layers + layer) * n_kvh + hkv) * BLOCK + j0 % BLOCK) * dim
        for e in range(tid, KS * (dim // 8), NT):
            row = e // (dim // 8)
            pc = e % (dim // 8)
            nb = 16 if j0 + row < n_keys else 0
            cp_async16(ksh, buf * KW + row * KROW + 4 * pc, kf, base + 8 * e, nb)
            cp_async16(vsh, buf * VW + row * VROW + 4 * pc, vf, base + 8 * e, nb)

    @cuda.jit
    def decode(q, kf, vf, table, layer, n_layers, meta, kv_pos, q_pos, window, scale, direct, out, part_o,
               part_ml, counter):
        split = cuda.blockIdx.x
        hkv = cuda.blockIdx.y
        n_splits = cuda.gridDim.x
        n_kvh = cuda.gridDim.y
        tid = cuda.threadIdx.x
        wid = tid // 32
        lane = tid % 32
        ksh = cuda.shared.array(KSH, np.uint32, alignment=SHARED16)
        vsh = cuda.shared.array(VSH, np.uint32, alignment=SHARED16)
        sc = cuda.shared.array(NSC, np.float32, alignment=SHARED16)  # a step's scores, then probabilities
        wmax = cuda.shared.array(NWR, np.float32)
        wsum = cuda.shared.array(NWR, np.float32)
        red = cuda.shared.array(RED, np.float32)
        ibuf = cuda.shared.array(1, np.int32)
        n_keys = meta[0] + meta[1]
        n_steps = (n_keys + KS - 1) // KS
        sps = (n_steps + n_splits - 1) // n_splits
        s_lo = split * sps
        trips = max(0, min(sps, n_steps - s_lo))
        if trips == 0:
            # past the last key (a graph's grid is sized for the whole context)
            attention_mma.mark_empty_split(part_ml, split, hkv, R, 0, R, R, tid, NT)
        else:
            copy_step(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, s_lo * KS, n_keys, tid, 0)
            cp_async_commit()
            qpos = q_pos[0]
            part = lane % LPK
            kg = lane // LPK
            qv = cuda.local.array(QN, np.float32)
            for r in range(R):
                for i in range(PPL):
                    for h in range(8):
                        qv[r * DPL + 8 * i + h] = q[0, hkv * R + r, 8 * (i * LPK + part) + h] * scale
            m = cuda.local.array(R, np.float32)
            lsum = cuda.local.array(R, np.float32)
            s = cuda.local.array(R, np.float32)
            al = cuda.local.array(R, np.float32)
            acc = cuda.local.array(NACC, np.float32)
            for r in range(R):
                m[r] = -math.inf
                lsum[r] = 0.0
            for e in range(NACC):
                acc[e] = 0.0
            kp = tid % KP
            db = tid // KP
            for it in range(trips):
                j0 = (s_lo + it) * KS
                b = it % NB
                if NB == 2:
                    if it + 1 < trips:  # the next step's copies run while this one is computed
                        copy_step(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, j0 + KS, n_keys, tid,
                                  (it + 1) % NB)
                    cp_async_commit()
                    WAIT_PRIOR()
                else:
                    if it > 0:
                        copy_step(ksh, vsh, kf, vf, table, layer, n_layers, n_kvh, hkv, j0, n_keys, tid, 0)
                        cp_async_commit()
                    cp_async_wait()
                cuda.syncthreads()
                # scores: key kk of the step, this lane's pieces i * LPK + part of it
                for t in range(TRIPS):
                    kk = min(t * KPB + wid * KPW + kg, KS - 1)  # past KS (small steps): a repeat, not stored
                    for r in range(R):
                        s[r] = 0.0
                    for i in range(PPL):
                        w0, w1, w2, w3 = lds4(ksh, b * KW + kk * KROW + 4 * (i * LPK + part))
                        for h in range(8):
                            word = w0 if h < 2 else (w1 if h < 4 else (w2 if h < 6 else w3))
                            kx = f16_bits_to_f32(U(word >> U(16 * (h & 1))) & U(0xFFFF))
                            for r in range(R):
                                s[r] += qv[r * DPL + 8 * i + h] * kx
                    for r in range(R):
                        tot = warp_groupsum(s[r], LPK, red, wid, lane) if LPK > 1 else s[r]
                        if part == 0 and t * KPB + wid * KPW + kg < KS:
                            sc[kk * R + r] = tot
                cuda.syncthreads()
                # softmax: thread tid holds key j0 + tid (threads past KS hold none)
                j = j0 + tid
                ok = tid < KS and j < n_keys
                if ok and window > 0:
                    ok = kv_pos[j] > qpos - window
                for r in range(R):
                    s[r] = sc[tid * R + r] if ok else np.float32(-math.inf)
                    mx = warp_allmax(s[r], red, wid, lane)
                    if lane == 0:
                        wmax[wid * R + r] = mx
                cuda.syncthreads()
                for r in range(R):
                    mn = m[r]
                    for w in range(W):
                        mn = max(mn, wmax[w * R + r])
                    al[r] = np.float32(1.0) if mn == -math.inf else math.exp(m[r] - mn)
                    m[r] = mn
                    p = np.float32(0.0) if s[r] == -math.inf else math.exp(s[r] - mn)
                    if tid < KS:
                        sc[tid * R + r] = p
                    ps = warp_allsum(p, red, wid, lane)
                    if lane == 0:
                        wsum[wid * R + r] = ps
                cuda.syncthreads()
                for r in range(R):
                    tot = np.float32(0.0)
                    for w in range(W):
                        tot += wsum[w * R + r]
                    lsum[r] = lsum[r] * al[r] + tot
                    for d in range(8):
                        acc[r * 8 + d] *= al[r]
                # values: this thread's 8 dims of every KP-th key
                for k in range(kp, KS, KP):
                    v0, v1, v2, v3 = lds4(vsh, b * VW + k * VROW + 4 * db)
                    for h in range(8):
                        word = v0 if h < 2 else (v1 if h < 4 else (v2 if h < 6 else v3))
                        vx = f16_bits_to_f32(U(word >> U(16 * (h & 1))) & U(0xFFFF))
                        for r in range(R):
                            acc[r * 8 + h] += sc[k * R + r] * vx
                cuda.syncthreads()  # the next step's copies and scores overwrite these buffers
            # the key partitions are adjacent lanes: their group sum is the split's output
            for e in range(NACC):
                acc[e] = warp_groupsum(acc[e], KP, red, wid, lane) if KP > 1 else acc[e]
            if kp == 0:
                for r in range(R):
                    hq = hkv * R + r
                    for d in range(8):
                        if direct:
                            out[0, hq, 8 * db + d] = acc[r * 8 + d] / lsum[r]
                        else:
                            part_o[split, 0, hq, 8 * db + d] = acc[r * 8 + d]
                    if db == 0 and not direct:
                        part_ml[split, 0, hq, 0] = m[r]
                        part_ml[split, 0, hq, 1] = lsum[r]
        if not direct and arrive(counter, hkv, n_splits, ibuf, tid):
            merge(part_o, part_ml, n_splits, out, hkv, R, 0, R, R, red, tid, NT)

    return decode
