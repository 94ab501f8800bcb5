"""Q and K after their projections, in one launch: per-head RMSNorm (Qwen3's q_norm/k_norm;
none for Llama) and rotary position embedding, in place.

Why one kernel: unfused that is four launches a layer (q norm, k norm, q rope, k rope),
each a few microseconds of latency over a few kilobytes (H200, Qwen3-8B decode at d70f71e:
RMSNorm 3.5 us and RoPE 2.6 us a call; 4 x 36 launches a token). A block is one head of
one token; each thread owns one rotated pair (or a pair of unrotated dims past rope_dim).

The rotation angle is position x inv_freq, formed in float64 (a float32 product is off by
~1e-3 rad at 8K positions) from a float64 inv_freq table made on the host, reduced in
float64 (in units of pi, to [-1, 1]), and then only the sine and cosine are float32
(luce.kernels.rope.rotate, sincospif). The standalone rope kernel rotates the same way.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._reduce import MAX_THREADS, block_sum
from .norm import rms_norm_ref
from .paging import BLOCK
from .pdl import grid_dependency_sync, ready as pdl_ready
from .rope import _STYLE_ID, inv_freq_table, rope_ref, rotate

_NO_NORM: dict = {}  # arguments of the kernels' types that a launch never reads


def qk_rope_from(norm, rope):
    """qk_rope as its parts: `norm(x, w, eps)` on each head (when its weight is given), then
    `rope(x, positions, rope_dim, base, style)`. The reference below, and what a plugin
    that overrides `rms_norm` or `rope` gets (luce.plugins.ops_with_overrides)."""
    def qk_rope(q, k, positions, q_norm, k_norm, eps, rope_dim, base, style, freq_scale=1.0):
        if q_norm is not None:
            q = norm(q, q_norm, eps)
        if k_norm is not None:
            k = norm(k, k_norm, eps)
        # the keyword only where it scales: a plugin's rope of the older signature still runs
        kw = {} if freq_scale == 1.0 else {"freq_scale": freq_scale}
        return rope(q, positions, rope_dim, base, style, **kw), rope(k, positions, rope_dim, base, style, **kw)
    return qk_rope


# q [N, Hq, D], k [N, Hkv, D] -> (q, k): what the CPU backend runs
qk_rope_ref = qk_rope_from(rms_norm_ref, rope_ref)


def _make_kernel(write_kv: bool):
    """The kernel; write_kv: the kv-head blocks also store their roped k and the token's v
    (f16) into the paged pool at row meta[0] + n, as luce.kernels.paging.write_kv_cuda does
    (and the token's position), so decode needs no launch for that."""
    WRITE = write_kv

    @cuda.jit
    def kernel(q, k, pos, q_w, k_w, has_norm, eps, inv_freq, rope_dim, style, v, k_pool, v_pool, table, layer, meta,
               kv_pos):
        grid_dependency_sync()  # luce.kernels.pdl: nothing unless LUCE_PDL
        n = cuda.blockIdx.x
        h = cuda.blockIdx.y
        t = cuda.threadIdx.x
        n_q = q.shape[1]
        dim = q.shape[2]
        half = rope_dim // 2
        buf = cuda.shared.array(MAX_THREADS, np.float32)
        is_q = h < n_q
        hh = h if is_q else h - n_q
        # this thread's two dims: a rotated pair, or two of the unrotated dims past rope_dim
        if t < half:
            ia = 2 * t if style == 0 else t
            ib = ia + 1 if style == 0 else t + half
        else:
            ia = rope_dim + 2 * (t - half)
            ib = ia + 1
        live = ib < dim
        a = np.float32(0.0)
        b = np.float32(0.0)
        if live:
            a = q[n, hh, ia] if is_q else k[n, hh, ia]
            b = q[n, hh, ib] if is_q else k[n, hh, ib]
        if has_norm:  # every thread reaches the reduction's barriers
            inv = np.float32(1.0) / math.sqrt(block_sum(a * a + b * b, buf) / np.float32(dim) + eps)
            if live:
                a *= inv * (q_w[ia] if is_q else k_w[ia])
                b *= inv * (q_w[ib] if is_q else k_w[ib])
        if live and t < half:
            a, b = rotate(a, b, pos[n], inv_freq[t])
        if live:
            if is_q:
                q[n, hh, ia] = a
                q[n, hh, ib] = b
            else:
                k[n, hh, ia] = a
                k[n, hh, ib] = b
                if WRITE:
                    p = meta[0] + n
                    slot = table[p // BLOCK]
                    o = p % BLOCK
                    k_pool[slot, layer, hh, o, ia] = a
                    k_pool[slot, layer, hh, o, ib] = b
                    v_pool[slot, layer, hh, o, ia] = v[n, hh, ia]
                    v_pool[slot, layer, hh, o, ib] = v[n, hh, ib]
        if WRITE and h == 0 and t == 0:
            kv_pos[meta[0] + n] = pos[n]

    return pdl_ready(kernel)


_kernel = functools.lru_cache(maxsize=None)(_make_kernel)


def _no_norm():
    t = _NO_NORM.get("w")
    if t is None:
        t = _NO_NORM["w"] = cuda.to_device(np.ones(1, np.float32))
    return t


def _no_pool():
    """A one-element f16 pool standing in for the write's where there is none."""
    t = _NO_NORM.get("pool")
    if t is None:
        t = _NO_NORM["pool"] = cuda.to_device(np.zeros((1, 1, 1, 1, 1), np.float16))
    return t


def qk_rope_cuda(q, k, positions, q_norm, k_norm, eps: float, rope_dim: int, base: float, style: str, stream=0,
                 freq_scale: float = 1.0, kv_write=None):
    """In place on device arrays q [N, Hq, D] and k [N, Hkv, D] (float32); positions: device
    int32 [N]; q_norm/k_norm: device float32 [D], both or neither. kv_write: (v, k_pool,
    v_pool, table, layer, meta, kv_pos) of an f16 paged pool: also what write_kv_cuda(k_pool,
    v_pool, table, layer, meta, k, v, positions, kv_pos) stores, with k roped. Returns (q, k)."""
    n_tok, n_q, dim = q.shape
    if (q_norm is None) != (k_norm is None):
        raise ValueError("qk_rope: give both q_norm and k_norm or neither")
    has = 1 if q_norm is not None else 0
    if not has:
        q_norm = k_norm = _no_norm()  # never read (numba needs a float32 array here)
    # a thread a pair of dims, a whole number of warps (the reduction's shuffle path)
    nt = max(32, -(-(dim // 2) // 32) * 32)
    if cuda.config.ENABLE_CUDASIM:  # the simulator's reduction wants a power of two
        nt = 1 << (max(1, dim // 2) - 1).bit_length()
    write = kv_write is not None
    if not write:  # arguments of the write's types, never read
        pool = _no_pool()
        kv_write = (k, pool, pool, positions, 0, positions, positions)
    v, k_pool, v_pool, table, layer, meta, kv_pos = kv_write
    _kernel(write)[(n_tok, n_q + k.shape[1]), nt, stream](
        q, k, positions, q_norm, k_norm, has, np.float32(eps), inv_freq_table(rope_dim, base, freq_scale), rope_dim,
        _STYLE_ID[style], v, k_pool, v_pool, table, layer, meta, kv_pos)
    return q, k

