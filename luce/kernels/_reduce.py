"""Block-wide reductions shared by the kernels of luce.kernels.

Two implementations behind one name, picked once at import: the CUDA simulator has no
warp shuffles, so it gets a shared-memory tree (block size a power of two); real GPUs
get warp shuffles plus one shared-memory round between warps (block size a multiple of
32). Kernels call `block_sum` etc. and never branch on the path themselves.

Every reduction ends with a barrier so the caller may reuse `buf` at once; every thread
of the block must call it (they contain barriers).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .device import device

SIM = bool(cuda.config.ENABLE_CUDASIM)

# Shared scratch a kernel allocates for these helpers: one slot per thread on the
# simulator path, one per warp on the shuffle path; sized for the largest block.
MAX_THREADS = 1024
BIG_INDEX = 2147483647

_FULL = 0xFFFFFFFF


def block_threads(gpu_threads: int) -> int:
    """Block size a host wrapper should launch with: the simulator runs one OS thread
    per CUDA thread and pays for every barrier per thread, so it gets one warp."""
    return 32 if SIM else gpu_threads


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stride_grid(n_items: int, threads: int, gpu_max_blocks: int = 4096) -> int:
    """Grid size for a grid-stride kernel: enough blocks to cover n_items on a GPU
    (capped), two on the simulator, where every thread is an OS thread to start."""
    return max(1, min(ceil_div(n_items, threads), 2 if SIM else gpu_max_blocks))


# ---------------------------------------------------------------- simulator path

@device
def _smem_sum(v, buf):
    t = cuda.threadIdx.x
    buf[t] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            buf[t] += buf[t + s]
        cuda.syncthreads()
        s //= 2
    r = buf[0]
    cuda.syncthreads()
    return r


@device
def _smem_max(v, buf):
    t = cuda.threadIdx.x
    buf[t] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            buf[t] = max(buf[t], buf[t + s])
        cuda.syncthreads()
        s //= 2
    r = buf[0]
    cuda.syncthreads()
    return r


@device
def _smem_argmax(v, i, vbuf, ibuf):
    t = cuda.threadIdx.x
    vbuf[t] = v
    ibuf[t] = i
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            ov = vbuf[t + s]
            oi = ibuf[t + s]
            if ov > vbuf[t] or (ov == vbuf[t] and oi < ibuf[t]):
                vbuf[t] = ov
                ibuf[t] = oi
        cuda.syncthreads()
        s //= 2
    rv = vbuf[0]
    ri = ibuf[0]
    cuda.syncthreads()
    return rv, ri


# ---------------------------------------------------------------- shuffle path (GPU only)

@device
def _warp_sum(v):
    off = 16
    while off > 0:
        v += cuda.shfl_xor_sync(_FULL, v, off)
        off //= 2
    return v


@device
def _warp_max(v):
    off = 16
    while off > 0:
        v = max(v, cuda.shfl_xor_sync(_FULL, v, off))
        off //= 2
    return v


@device
def _warp_argmax(v, i):
    off = 16
    while off > 0:
        ov = cuda.shfl_xor_sync(_FULL, v, off)
        oi = cuda.shfl_xor_sync(_FULL, i, off)
        if ov > v or (ov == v and oi < i):
            v = ov
            i = oi
        off //= 2
    return v, i


@device
def _shfl_sum(v, buf):
    t = cuda.threadIdx.x
    lane = t & 31
    v = _warp_sum(v)
    if lane == 0:
        buf[t >> 5] = v
    cuda.syncthreads()
    # every warp reduces the per-warp partials itself: no second barrier before the read
    v = buf[lane] if lane < (cuda.blockDim.x >> 5) else np.float32(0.0)
    v = _warp_sum(v)
    cuda.syncthreads()
    return v


@device
def _shfl_max(v, buf):
    t = cuda.threadIdx.x
    lane = t & 31
    v = _warp_max(v)
    if lane == 0:
        buf[t >> 5] = v
    cuda.syncthreads()
    v = buf[lane] if lane < (cuda.blockDim.x >> 5) else np.float32(-math.inf)
    v = _warp_max(v)
    cuda.syncthreads()
    return v


@device
def _shfl_argmax(v, i, vbuf, ibuf):
    t = cuda.threadIdx.x
    lane = t & 31
    v, i = _warp_argmax(v, i)
    if lane == 0:
        vbuf[t >> 5] = v
        ibuf[t >> 5] = i
    cuda.syncthreads()
    if lane < (cuda.blockDim.x >> 5):
        v = vbuf[lane]
        i = ibuf[lane]
    else:
        v = np.float32(-math.inf)
        i = np.int32(BIG_INDEX)
    v, i = _warp_argmax(v, i)
    cuda.syncthreads()
    return v, i


# a block's sum through shared memory in the buffer's dtype, on both paths: float64 sums,
# which the shuffle path does not take
smem_sum = _smem_sum

if SIM:
    block_sum, block_max, block_argmax = _smem_sum, _smem_max, _smem_argmax
else:
    block_sum, block_max, block_argmax = _shfl_sum, _shfl_max, _shfl_argmax

__all__ = ["SIM", "MAX_THREADS", "BIG_INDEX", "block_threads", "ceil_div", "stride_grid",
           "block_sum", "block_max", "block_argmax", "smem_sum"]


# ---------------------------------------------------------------- one warp's sum
# warp_sum(v, red, wid, lane): the sum of v over warp `wid`, in lane 0 at least. `red` is
# shared scratch of WARP_RED_SLOTS floats per warp: the simulator path needs them, the
# shuffle path none (size the array max(1, warps * WARP_RED_SLOTS)).
if SIM:
    WARP_RED_SLOTS = 32

    @device
    def _warp_all(v, red, wid, lane, is_max):
        red[wid * 32 + lane] = v
        cuda.syncthreads()
        r = red[wid * 32]
        for i in range(1, 32):
            r = max(r, red[wid * 32 + i]) if is_max else r + red[wid * 32 + i]
        cuda.syncthreads()
        return np.float32(r)

    @device
    def warp_allmax(v, red, wid, lane):
        """max of v over warp `wid`, in every lane."""
        return _warp_all(v, red, wid, lane, True)

    @device
    def warp_allsum(v, red, wid, lane):
        """sum of v over warp `wid`, in every lane."""
        return _warp_all(v, red, wid, lane, False)

    @device
    def _group_all(v, n, red, wid, lane, is_max):
        red[wid * 32 + lane] = v
        cuda.syncthreads()
        base = wid * 32 + (lane & ~(n - 1))
        r = red[base]
        for i in range(1, n):
            r = max(r, red[base + i]) if is_max else r + red[base + i]
        cuda.syncthreads()
        return np.float32(r)

    @device
    def warp_groupsum(v, n, red, wid, lane):
        """sum of v over the n lanes (a power of two) of lane's aligned group, in each."""
        return _group_all(v, n, red, wid, lane, False)

    @device
    def warp_groupmax(v, n, red, wid, lane):
        """max of v over the n lanes (a power of two) of lane's aligned group, in each."""
        return _group_all(v, n, red, wid, lane, True)

    @device
    def warp_sum(v, red, wid, lane):
        return _warp_all(v, red, wid, lane, False)

    @device
    def warp_barrier():
        """A barrier for one warp's lanes. The simulator has no __syncwarp: there it is the
        block's barrier, so every warp of the block must reach it the same number of times."""
        cuda.syncthreads()
else:
    WARP_RED_SLOTS = 0

    @device
    def warp_barrier():
        cuda.syncwarp()

    @device
    def warp_sum(v, red, wid, lane):
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(_FULL, v, off)
        return v

    @device
    def warp_allmax(v, red, wid, lane):
        return _warp_max(v)

    @device
    def warp_allsum(v, red, wid, lane):
        return _warp_sum(v)

    @device
    def warp_groupsum(v, n, red, wid, lane):
        off = n // 2
        while off > 0:
            v += cuda.shfl_xor_sync(_FULL, v, off)
            off //= 2
        return v

    @device
    def warp_groupmax(v, n, red, wid, lane):
        off = n // 2
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(_FULL, v, off))
            off //= 2
        return v
