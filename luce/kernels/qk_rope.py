"""Q and K after their projections, in one launch: per-head RMSNorm (Qwen3's q_norm/k_norm;
none for Llama) and rotary position embedding, in place.

Why one kernel: unfused that is four launches a layer (q norm, k norm, q rope, k rope),
each a few microseconds of latency over a few kilobytes (H200, Qwen3-8B decode at d70f71e:
RMSNorm 3.5 us and RoPE 2.6 us a call; 4 x 36 launches a token).

A warp is one head of one token at a time, each lane a few of its dim pairs (a rotated
pair, or two dims past rope_dim), so the norm's sum is a warp reduction with no block
barrier; a warp takes `hpw` heads of its token in turn, which is how a long prefill keeps
the grid to a few thousand warps and computes each lane's rotations once per token rather
than once per head (the angles are the same for every head). Those rotations depend on the
positions and the frequency table only, which no kernel of the forward writes just before
(the one before this is the q/k/v product), so they are formed before the programmatic
launch's wait (luce.kernels.pdl) and overlap the product's tail.

The rotation angle is position x inv_freq, formed in float64 (a float32 product is off by
~1e-3 rad at 8K positions) from a float64 inv_freq table made on the host, reduced in
float64, and then only the sine and cosine are float32 (luce.kernels.rope.sincos_at). The
standalone rope kernel (luce.kernels.rope) rotates the same way.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._reduce import WARP_RED_SLOTS, ceil_div, warp_allsum, warp_barrier
from .norm import rms_norm_ref
from .paging import BLOCK
from .pdl import grid_dependency_sync, ready as pdl_ready
from .rope import _STYLE_ID, inv_freq_table, rope_ref, sincos_at, turn

WARPS = 4  # a block
# Heads a warp for prefill-sized launches: about this many warps in all (~16 an SM on 132)
TARGET_WARPS = 4096

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


def _make_kernel(write_kv: bool, dim: int):
    """The kernel for head dim `dim`; write_kv: the kv-head warps also store their roped k
    and the token's v (f16) into the paged pool at row meta[0] + n, as
    luce.kernels.paging.write_kv_cuda does (and the token's position), so decode needs no
    launch for that."""
    WRITE = write_kv
    NP = dim // 2  # pairs of a head
    PPL = ceil_div(NP, 32)  # pairs a lane
    RED = WARPS * max(1, WARP_RED_SLOTS)

    @cuda.jit
    def kernel(q, k, pos, q_w, k_w, has_norm, eps, inv_freq, rope_dim, style, v, k_pool, v_pool, table, layer, meta,
               kv_pos, hpw):
        n = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        wid = tid // 32
        lane = tid % 32
        n_q = q.shape[1]
        n_h = n_q + k.shape[1]
        half = rope_dim // 2
        red = cuda.shared.array(RED, np.float32)
        # this lane's rotations, before the wait: neither input comes from the kernel before
        sn = cuda.local.array(PPL, np.float32)
        cs = cuda.local.array(PPL, np.float32)
        p = pos[n]
        for i in range(PPL):
            t = lane + 32 * i
            sn[i] = np.float32(0.0)
            cs[i] = np.float32(1.0)
            if t < half:
                sn[i], cs[i] = sincos_at(p, inv_freq[t])
        grid_dependency_sync()  # luce.kernels.pdl: nothing unless LUCE_PDL
        a = cuda.local.array(PPL, np.float32)
        b = cuda.local.array(PPL, np.float32)
        for j in range(hpw):  # the same trips in every warp (the simulator's barriers)
            h = (cuda.blockIdx.y * WARPS + wid) * hpw + j
            live = h < n_h
            hh = min(h, n_h - 1)
            is_q = hh < n_q
            hi = hh if is_q else hh - n_q
            ss = np.float32(0.0)
            for i in range(PPL):
                t = lane + 32 * i
                a[i] = np.float32(0.0)
                b[i] = np.float32(0.0)
                if t < NP:
                    # a rotated pair, or two of the unrotated dims past rope_dim
                    ia = (2 * t if style == 0 else t) if t < half else rope_dim + 2 * (t - half)
                    ib = (ia + 1 if style == 0 else t + half) if t < half else ia + 1
                    a[i] = q[n, hi, ia] if is_q else k[n, hi, ia]
                    b[i] = q[n, hi, ib] if is_q else k[n, hi, ib]
                    ss += a[i] * a[i] + b[i] * b[i]
            inv = np.float32(1.0)
            if has_norm:  # the same in every lane of the warp
                inv = np.float32(1.0) / math.sqrt(warp_allsum(ss, red, wid, lane) / np.float32(dim) + eps)
            for i in range(PPL):
                t = lane + 32 * i
                if live and t < NP:
                    ia = (2 * t if style == 0 else t) if t < half else rope_dim + 2 * (t - half)
                    ib = (ia + 1 if style == 0 else t + half) if t < half else ia + 1
                    x = a[i]
                    y = b[i]
                    if has_norm:
                        x *= inv * (q_w[ia] if is_q else k_w[ia])
                        y *= inv * (q_w[ib] if is_q else k_w[ib])
                    if t < half:
                        x, y = turn(x, y, sn[i], cs[i])
                    if is_q:
                        q[n, hi, ia] = x
                        q[n, hi, ib] = y
                    else:
                        k[n, hi, ia] = x
                        k[n, hi, ib] = y
                        if WRITE:
                            r = meta[0] + n
                            slot = table[r // BLOCK]
                            o = r % BLOCK
                            k_pool[slot, layer, hi, o, ia] = x
                            k_pool[slot, layer, hi, o, ib] = y
                            v_pool[slot, layer, hi, o, ia] = v[n, hi, ia]
                            v_pool[slot, layer, hi, o, ib] = v[n, hi, ib]
            warp_barrier()  # red is reused by the next head's sum
        if WRITE and cuda.blockIdx.y == 0 and tid == 0:
            kv_pos[meta[0] + n] = p

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
    if dim % 2 or rope_dim % 2 or rope_dim > dim:
        raise ValueError(f"qk_rope: head dim {dim} and rope dim {rope_dim} must be even, rope dim <= head dim")
    n_h = n_q + k.shape[1]
    hpw = heads_a_warp(n_tok, n_h)
    write = kv_write is not None
    if not write:  # arguments of the write's types, never read
        pool = _no_pool()
        kv_write = (k, pool, pool, positions, 0, positions, positions)
    v, k_pool, v_pool, table, layer, meta, kv_pos = kv_write
    _kernel(write, dim)[(n_tok, ceil_div(n_h, WARPS * hpw)), 32 * WARPS, stream](
        q, k, positions, q_norm, k_norm, has, np.float32(eps), inv_freq_table(rope_dim, base, freq_scale), rope_dim,
        _STYLE_ID[style], v, k_pool, v_pool, table, layer, meta, kv_pos, hpw)
    return q, k


def heads_a_warp(n_tok: int, n_heads: int) -> int:
    """Heads a warp takes in turn: one (a warp a head) until the grid would pass
    TARGET_WARPS warps, then as many as keep it near that."""
    return max(1, min(ceil_div(n_heads, WARPS), (n_tok * n_heads) // TARGET_WARPS))

