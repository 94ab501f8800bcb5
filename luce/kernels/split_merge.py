"""The flash-decoding split merge, run by the last block of a query tile to finish.

An attention kernel split over the keys leaves, for each split and query row, its output
not yet normalized and its softmax (max m, sum l). Merging them took a second kernel (the
combine in luce.kernels.attention). For decode both launches are latency chains (H200,
Nsight Compute, Qwen3-8B shape over 640 keys: 10% achieved occupancy in the attention
kernel, 6% in its combine), so the second launch's gap and ramp cost about as much as the
merge itself. Here every block of the grid, empty splits included, counts itself done on
its tile's counter; the one that counts last sees every split's partials (each block
fences its writes before counting) and merges them in the same launch, one warp a query
row, and leaves the counter at 0 for the next launch.

Splits that saw no key (l == 0) get weight 0; their partial outputs, never written, are
read but not used.

Decode takes it (H200, Qwen3-8B shape, 2143d32+: 640 keys in an 8K-sized grid 14.07 ->
13.29 us, 8K keys 33.62 -> 32.76). The tensor-core tree kernel does not: its tiles hold 64+
rows and few blocks, so one block merging a tile's rows a warp at a time took a 23-node
tree from 22.0 to 66.3 us over 640 keys and 78.7 to 136.0 over 8K; the combine kernel
spreads the same work over a block per (query, head)."""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._reduce import ceil_div, warp_allmax
from .device import device


@device(inline=True)
def arrive(counter, slot, n_blocks, ibuf, tid):
    """Block-wide, after a block's last write: True in the last of n_blocks blocks counting
    on counter[slot] (the same answer in all its threads), which then sees their writes and
    resets the slot. ibuf: int32 shared, one or more.

    Every thread fences its own writes before the count (the threadFenceReduction
    pattern). One fence by thread 0 after the barrier (cooperative groups' grid sync, and
    fence.acq_rel in place of fence.sc) was measured faster at 369d85c, but a GPU test at
    the end of that session failed (test_random_gemma3_matches_cpu, not diagnosed for want
    of device time), so the form whose ordering needs no cumulativity argument is back."""
    # release: this block's partials visible device-wide before its count
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        ibuf[0] = cuda.atomic.add(counter, slot, 1)
    cuda.syncthreads()
    last = ibuf[0] == n_blocks - 1
    if last:
        cuda.threadfence()
        if tid == 0:
            counter[slot] = 0
    return last


@device(inline=True)
def used_splits(part_ml, n_splits, qi, hq, live, red, wid, lane):
    """Warp-wide, for query row (qi, hq): (the largest m among the splits that saw a key,
    1 + the last such split), each lane scanning every 32nd split. live False: a padding
    row whose lanes only take part in the warp's reductions (-inf, 0)."""
    mv = np.float32(-math.inf)
    last = np.float32(-1.0)
    if live:
        for s in range(lane, n_splits, 32):
            if part_ml[s, qi, hq, 1] > 0:
                mv = max(mv, part_ml[s, qi, hq, 0])
                last = np.float32(s)
    return warp_allmax(mv, red, wid, lane), int(warp_allmax(last, red, wid, lane)) + 1


# Splits a warp's merge reads a trip, their loads in flight together: the trips are a chain
# of L2 round trips (48 splits at 8K keys on the Qwen3-8B shape: 24 trips at 2). Registers
# of the decode kernel (sm_90, ptxas 13) at 2: 140 (head dim 128, 4 q heads a kv head), 168
# (8: the 32B shape), 128 (dim 256); at 4: 164, 218, 156. Blocks of 4 warps an SM: 3 at up
# to 168 registers (a warp's registers are allocated 256 at a time), 2 at 218.
MERGE_PER_TRIP = 2


def merge_per_trip(dim: int, rows: int) -> int:
    """Splits a trip for a decode block of `rows` query rows over head dim `dim`: 4 where
    its accumulators (rows x dims a lane) leave room, which kept 3 blocks an SM in the
    counts above; MERGE_PER_TRIP otherwise."""
    return 4 if rows * ceil_div(dim, 32) <= 16 else MERGE_PER_TRIP


@functools.lru_cache(maxsize=None)
def split_sums(dim: int, per_trip: int):
    """The device function adding splits' partials for one query row, per_trip splits a
    trip with every load of the trip issued before the first use (a trip is one L2 round
    trip): splits first..first+per_trip-1, then the same from first + stride on, below
    n_used. acc[d] (dims lane + 32 d) gains each partial times exp(m - big); returns the
    sum of l exp(m - big). Past n_used a split repeats the last one, weighted 0; a split
    that saw no key (l = 0) is skipped, not multiplied (its partial may hold NaN)."""
    DL = ceil_div(dim, 32)
    PT = per_trip
    PTDL = PT * DL  # array shapes must be plain constants

    @device(inline=True)
    def sums(part_o, part_ml, qi, hq, big, n_used, first, stride, acc, lane):
        v = cuda.local.array(PTDL, np.float32)
        ml = cuda.local.array(PT, np.float32)
        ll = cuda.local.array(PT, np.float32)
        den = np.float32(0.0)
        for s in range(first, n_used, stride):
            for j in range(PT):
                sj = min(s + j, n_used - 1)
                ll[j] = part_ml[sj, qi, hq, 1] if s + j < n_used else np.float32(0.0)
                ml[j] = part_ml[sj, qi, hq, 0]
                for d in range(DL):
                    v[j * DL + d] = part_o[sj, qi, hq, min(lane + 32 * d, dim - 1)]
            for j in range(PT):
                w = math.exp(ml[j] - big) if ll[j] > 0 else np.float32(0.0)
                den += ll[j] * w
                if w != 0:
                    for d in range(DL):
                        acc[d] += v[j * DL + d] * w
        return den

    return sums


@functools.lru_cache(maxsize=None)
def merge_rows(dim: int, per_trip: int = MERGE_PER_TRIP, xq_planes: int = 0):
    """The device function merging head dim `dim`'s splits for a tile of query rows;
    xq_planes > 0: it also stores the output rows in quantize_x's form (dim a multiple of 32)."""
    from .quantize_x import int8_block_store
    DL = ceil_div(dim, 32)  # dims a lane owns (lanes past the last dim idle)
    PT = per_trip
    XQ = xq_planes
    add_splits = split_sums(dim, per_trip)

    @device(inline=True)
    def merge(part_o, part_ml, n_splits, out, hkv, G, r0, rows, n_rows, red, tid, nt, xq_b, xq_f):
        """Block-wide, in the tile's last block: out[q, h] for its query rows r0.. r0 + rows
        (row r: query r // G, q head hkv * G + r % G; those below n_rows), from the
        partials part_o [split, q, h, dim] and part_ml [split, q, h, (m, l)]; with XQ also
        out's quantize_x form (each output row of q heads x dim columns) in xq_b / xq_f."""
        wid = tid // 32
        lane = tid % 32
        nw = nt // 32
        acc = cuda.local.array(DL, np.float32)
        for rb in range(0, rows, nw):  # the same trips in every warp (the simulator's barriers)
            row = r0 + rb + wid
            live = rb + wid < rows and row < n_rows
            qi = row // G if live else 0
            hq = hkv * G + row % G if live else 0
            big, n_used = used_splits(part_ml, n_splits, qi, hq, live, red, wid, lane)
            for d in range(DL):
                acc[d] = 0.0
            den = add_splits(part_o, part_ml, qi, hq, big, n_used, 0, PT, acc, lane)
            if live:
                for d in range(DL):
                    c = lane + 32 * d
                    if c < dim:
                        out[qi, hq, c] = acc[d] / den
            if XQ:  # a lane's 32 columns d are one int8 block; every lane takes part, live or not
                for d in range(DL):
                    o = acc[d] / den if live else np.float32(0.0)
                    int8_block_store(o, live, ((qi * out.shape[1] + hq) * dim + 32 * d) >> 5, lane, wid, red, xq_b,
                                     xq_f, XQ)

    return merge


# stream -> zeroed int32 counters of `arrive` (each launch leaves them at 0):
# fixed addresses for captured graphs; one set per stream, so that launches in flight on two
# streams never count on one; outgrown sets are kept, since a graph may still point at them
_COUNTERS: dict = {}
_COUNTERS_RETIRED: list = []


def merge_counters(n: int, stream=0):
    """At least n zeroed split-merge counters for launches on `stream`."""
    c = _COUNTERS.get(id(stream))
    if c is None or c.size < n:
        _COUNTERS_RETIRED.append(c)
        c = _COUNTERS[id(stream)] = cuda.to_device(np.zeros(max(n, 256), np.int32), stream=stream)
    return c
