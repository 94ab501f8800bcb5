"""Paged KV storage: numpy references and CUDA kernels.

Layout. A pool of fixed-size blocks, each holding BLOCK (64) consecutive tokens of
every layer: k_pool, v_pool: [n_slots, n_layers, n_kv_heads, BLOCK, head_dim] (f16).
Putting the layers inside a block makes a block one contiguous range, so eviction to
host memory and restore are a single copy each; keeping a head's 64 tokens contiguous
makes attention read a [64, head_dim] tile in one sweep.

A block table (int32, logical block -> pool slot, -1 when unmapped) maps logical row p
to pool[table[p // BLOCK], layer, head, p % BLOCK].

The CUDA wrappers take the first logical row from a device int32 array (`meta[0]`) so
that a captured CUDA graph replays with a new context length without re-capture.

q8_0 KV (ggml's Q8_0 numerics: 32 int8 per f16 scale) keeps two pools per K and V with
the same layout: the int8 values [..., D] and the scales [..., D / 32]; every row
operation runs on both (`with_pos` keeps the position array to one of the two passes).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._reduce import block_threads, stride_grid
from .pdl import grid_dependency_sync, ready as pdl_ready

BLOCK = 64
MAX_MOVE = 64  # rows one compaction pass moves (a speculative tree has at most 64 nodes)
Q8 = 32  # values per q8_0 scale


# ------------------------------------------------------------------------------ numpy

def _rows(block_table: np.ndarray, start: int, n: int):
    p = np.arange(start, start + n)
    slots = block_table[p // BLOCK]
    if len(p) and slots.min() < 0:
        raise IndexError("logical row in an unmapped block")
    return slots, p % BLOCK


def quantize_q8_0_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., D] float -> (int8 [..., D], f16 scales [..., D/32]) as ggml quantize_row_q8_0."""
    x = np.asarray(x, dtype=np.float32)
    b = x.reshape(*x.shape[:-1], -1, Q8)
    d = np.abs(b).max(axis=-1) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d != 0)
    v = b * inv[..., None]
    a = np.abs(v)
    r = np.floor(a)
    r += (a - r >= 0.5)  # C roundf (half away from zero); exact, unlike floor(v + 0.5)
    q = (np.sign(v) * r).astype(np.int8)  # |v| <= 127: no clipping needed
    return q.reshape(x.shape), d.astype(np.float16)


def dequantize_q8_0_ref(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    b = q.reshape(*q.shape[:-1], -1, Q8).astype(np.float32) * d.astype(np.float32)[..., None]
    return b.reshape(q.shape)


def write_kv_ref(k_pool, v_pool, block_table, layer: int, start: int, k_new, v_new) -> None:
    """Store k_new, v_new [N, Hkv, D] at logical rows start .. start+N-1 of `layer`."""
    slots, off = _rows(block_table, start, len(k_new))
    k_pool[slots, layer, :, off] = k_new
    v_pool[slots, layer, :, off] = v_new


def gather_kv_ref(pool, block_table, layer: int, start: int, n: int) -> np.ndarray:
    """Logical rows start .. start+n-1 of `layer` as [n, Hkv, D]."""
    slots, off = _rows(block_table, start, n)
    return pool[slots, layer, :, off]


def compact_ref(k_pool, v_pool, block_table, base: int, accepted, pos=None) -> None:
    """Row base + accepted[j] moves to row base + j, in every layer (and in `pos`, the
    per-row position array, when given)."""
    acc = np.asarray(accepted, dtype=np.int64)
    src_s, src_o = _rows(block_table, base, int(acc.max()) + 1 if len(acc) else 0)
    dst_s, dst_o = _rows(block_table, base, len(acc))
    k_pool[dst_s, :, :, dst_o] = k_pool[src_s[acc], :, :, src_o[acc]]
    v_pool[dst_s, :, :, dst_o] = v_pool[src_s[acc], :, :, src_o[acc]]
    if pos is not None:
        pos[base:base + len(acc)] = pos[base + acc]


# ------------------------------------------------------------------------------ CUDA

@pdl_ready
@cuda.jit
def _write_kernel(k_pool, v_pool, table, layer, meta, k_new, v_new, positions, pos):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # grid-stride over (token, head, dim) elements; token n goes to logical row meta[0] + n
    n_tok, n_heads, dim = k_new.shape
    start = cuda.grid(1)
    for i in range(start, n_tok * n_heads * dim, cuda.gridsize(1)):
        d = i % dim
        nh = i // dim
        h = nh % n_heads
        n = nh // n_heads
        p = meta[0] + n
        slot = table[p // BLOCK]
        o = p % BLOCK
        k_pool[slot, layer, h, o, d] = k_new[n, h, d]
        v_pool[slot, layer, h, o, d] = v_new[n, h, d]
    for i in range(start, n_tok, cuda.gridsize(1)):
        pos[meta[0] + i] = positions[i]


@pdl_ready
@cuda.jit
def _write_q8_kernel(kq, kd, vq, vd, table, layer, meta, k_new, v_new, positions, pos):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # grid-stride over (token, head, 32-value group, K or V): ggml's Q8_0 rounding
    n_tok, n_heads, dim = k_new.shape
    groups = dim // Q8
    start = cuda.grid(1)
    for i in range(start, n_tok * n_heads * groups * 2, cuda.gridsize(1)):
        which = i % 2
        g = (i // 2) % groups
        nh = i // (2 * groups)
        h = nh % n_heads
        n = nh // n_heads
        src = k_new if which == 0 else v_new
        dq = kq if which == 0 else vq
        dd = kd if which == 0 else vd
        amax = np.float32(0.0)
        for e in range(Q8):
            amax = max(amax, abs(np.float32(src[n, h, g * Q8 + e])))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        p = meta[0] + n
        slot = table[p // BLOCK]
        o = p % BLOCK
        for e in range(Q8):
            # C roundf (half away from zero), exact like quantize_q8_0_ref
            v = np.float32(src[n, h, g * Q8 + e]) * inv
            a = abs(v)
            r = math.floor(a)
            if a - r >= 0.5:
                r += 1
            dq[slot, layer, h, o, g * Q8 + e] = np.int8(r if v >= 0 else -r)
        dd[slot, layer, h, o, g] = d
    for i in range(start, n_tok, cuda.gridsize(1)):
        pos[meta[0] + i] = positions[i]


@pdl_ready
@cuda.jit
def _gather_kernel(pool, table, layer, start, out):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    n_tok, n_heads, dim = out.shape
    for i in range(cuda.grid(1), n_tok * n_heads * dim, cuda.gridsize(1)):
        d = i % dim
        nh = i // dim
        h = nh % n_heads
        p = start + nh // n_heads
        out[nh // n_heads, h, d] = pool[table[p // BLOCK], layer, h, p % BLOCK, d]


@pdl_ready
@cuda.jit
def _compact_kernel(k_pool, v_pool, table, meta, accepted, first, n_move, pos, with_pos):
    """Rows base + accepted[j] -> base + j for j in [first, first + n_move), base = meta[0].

    One block per (layer * head, K or V) reads all its rows into shared memory before
    writing any: a destination row may be another row's source, and no two blocks touch
    the same (layer, head, K/V) plane, so one barrier orders everything.
    """
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    lh = cuda.blockIdx.x
    which = cuda.blockIdx.y
    n_heads = k_pool.shape[2]
    dim = k_pool.shape[4]
    layer = lh // n_heads
    h = lh % n_heads
    pool = k_pool if which == 0 else v_pool
    buf = cuda.shared.array((MAX_MOVE, 256), np.float16)
    pbuf = cuda.shared.array(MAX_MOVE, np.int32)
    base = meta[0]
    t = cuda.threadIdx.x
    for e in range(t, n_move * dim, cuda.blockDim.x):
        j = e // dim
        d = e % dim
        p = base + accepted[first + j]
        buf[j, d] = pool[table[p // BLOCK], layer, h, p % BLOCK, d]
    move_pos = with_pos != 0 and lh == 0 and which == 0
    if move_pos:
        for j in range(t, n_move, cuda.blockDim.x):
            pbuf[j] = pos[base + accepted[first + j]]
    cuda.syncthreads()
    for e in range(t, n_move * dim, cuda.blockDim.x):
        j = e // dim
        d = e % dim
        p = base + first + j
        pool[table[p // BLOCK], layer, h, p % BLOCK, d] = buf[j, d]
    if move_pos:
        for j in range(t, n_move, cuda.blockDim.x):
            pos[base + first + j] = pbuf[j]


def write_kv_cuda(k_pool, v_pool, table, layer: int, meta, k_new, v_new, positions, pos, stream=0) -> None:
    """Device twin of write_kv_ref; start row = meta[0]; also stores positions [N] into
    the per-row position array pos (device int32 [n_ctx])."""
    n = k_new.shape[0] * k_new.shape[1] * k_new.shape[2]
    nt = block_threads(256)
    _write_kernel[stride_grid(n, nt), nt, stream](k_pool, v_pool, table, layer, meta, k_new, v_new, positions, pos)


def write_kv_q8_cuda(kq, kd, vq, vd, table, layer: int, meta, k_new, v_new, positions, pos, stream=0) -> None:
    """write_kv_cuda into q8_0 pools (values kq/vq int8, scales kd/vd f16), quantizing."""
    n = k_new.shape[0] * k_new.shape[1] * (k_new.shape[2] // Q8) * 2
    nt = block_threads(256)
    _write_q8_kernel[stride_grid(n, nt), nt, stream](kq, kd, vq, vd, table, layer, meta, k_new, v_new, positions,
                                                     pos)


def gather_kv_cuda(pool, table, layer: int, start: int, n: int, out=None, stream=0):
    """Device twin of gather_kv_ref -> device [n, Hkv, D] of the pool's dtype."""
    if out is None:
        out = cuda.device_array((n, pool.shape[2], pool.shape[4]), dtype=pool.dtype, stream=stream)
    total = out.shape[0] * out.shape[1] * out.shape[2]
    nt = block_threads(256)
    if total:
        _gather_kernel[stride_grid(total, nt), nt, stream](pool, table, layer, start, out)
    return out


def compact_cuda(k_pool, v_pool, table, meta, accepted, n_accepted: int, pos, stream=0, first: int = 0,
                 with_pos: bool = True) -> None:
    """Device twin of compact_ref with base = meta[0]; accepted: device int32. Rows
    before `first` are known to stay put (accepted[j] == j) and are skipped.

    Up to 64 rows move in one race-free pass; longer lists go in passes of 64 in order,
    which is safe when `accepted` is increasing (sources of a later pass lie beyond the
    destinations of the earlier ones), as it is for any path of a tree whose parents
    precede their children.
    """
    if k_pool.shape[4] > 256:
        raise ValueError("head_dim > 256")
    n_planes = k_pool.shape[1] * k_pool.shape[2]
    for f in range(first, n_accepted, MAX_MOVE):
        n_move = min(MAX_MOVE, n_accepted - f)
        _compact_kernel[(n_planes, 2), block_threads(256), stream](k_pool, v_pool, table, meta, accepted, f,
                                                                    n_move, pos, 1 if with_pos else 0)
