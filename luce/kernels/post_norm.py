"""Gemma's sandwich norm step: the residual stream takes a sublayer's output RMS-normed
(x += RMSNorm(y) w_post), and the next norm reads the result (h = RMSNorm(x) w_next), with
h's int8 form (luce.kernels.quantize_x) for the projections that read it, in one launch.

Why: composed, that is three launches (RMSNorm of y, the add, the next RMSNorm with its
quantization) twice a Gemma layer, each a few microseconds of one-row latency in a decode
step of ~90 us a layer. One block owns a row (up to 32 values a thread in registers), so
the residual stream is updated in place with no block reading what another writes.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._reduce import MAX_THREADS, SIM, WARP_RED_SLOTS, block_sum
from .norm import norm_shape, rms_norm_ref
from .pdl import grid_dependency_sync, ready as pdl_ready
from .quantize_x import QB, int8_block_store, quantize_x_ref, xq_size


def post_norm_residual_ref(y, x, w_post, w_next, eps: float, planes: int | None = None):
    """(x + RMSNorm(y) w_post, RMSNorm of that w_next[, its int8 form in `planes` planes])."""
    s = (x.astype(np.float32) + rms_norm_ref(y, w_post, eps)).astype(np.float32)
    h = rms_norm_ref(s, w_next, eps).astype(np.float32)
    return (s, h) if planes is None else (s, h, quantize_x_ref(h, planes))


@functools.cache
def _kernel(vpt: int, nt: int, quant: bool):
    jit = cuda.jit if SIM else cuda.jit(launch_bounds=nt)
    RED = max(1, nt // 32 * WARP_RED_SLOTS)

    @jit
    def kernel(y, x, w_post, w_next, h, xq_b, xq_f, eps, planes):
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        d_model = x.shape[1]
        buf = cuda.shared.array(MAX_THREADS, np.float32)
        red = cuda.shared.array(RED, np.float32)
        yv = cuda.local.array(vpt, np.float32)
        xv = cuda.local.array(vpt, np.float32)
        zero = np.float32(0.0)
        ss = zero
        for i in range(vpt):
            d = t + i * nt
            yv[i] = y[row, d] if d < d_model else zero
            xv[i] = x[row, d] if d < d_model else zero
            ss += yv[i] * yv[i]
        # float32 throughout: tot / int would be a float64 divide
        inv = np.float32(1.0) / math.sqrt(block_sum(ss, buf) / np.float32(d_model) + eps)
        ss = zero
        for i in range(vpt):
            d = t + i * nt
            if d < d_model:
                v = xv[i] + yv[i] * inv * w_post[d]
                xv[i] = v
                x[row, d] = v
                ss += v * v
        inv = np.float32(1.0) / math.sqrt(block_sum(ss, buf) / np.float32(d_model) + eps)
        for i in range(vpt):
            d = t + i * nt
            live = d < d_model
            o = xv[i] * inv * w_next[d] if live else zero
            if live:
                h[row, d] = o
            if quant:  # every lane of the warp, live or not: the block's reductions
                int8_block_store(o, live, (row * d_model + d) // QB, t % 32, t // 32, red, xq_b, xq_f, planes)
    return pdl_ready(kernel)


def post_norm_residual_cuda(y, x, w_post, w_next, eps: float, h=None, xq=None, planes: int = 1, stream=0):
    """x += RMSNorm(y) w_post (in place) and h = RMSNorm(x) w_next for rows of device float32
    [N, D]; with xq (device uint16 of xq_size(D, N, planes)), h's int8 form too (D a
    multiple of 32). Returns (x, h)."""
    rows, d_model = x.shape
    if y.shape != x.shape:
        raise ValueError(f"post_norm_residual: y {y.shape} and x {x.shape} differ")
    if h is None:
        h = cuda.device_array(x.shape, np.float32, stream=stream)
    quant = xq is not None
    if quant and (d_model % QB or xq.size != xq_size(d_model, rows, planes)):
        raise ValueError(f"post_norm_residual: rows of {d_model} (a multiple of {QB}) into "
                         f"{xq_size(d_model, rows, planes)} uint16, got {xq.size}")
    vpt, nt = norm_shape(d_model)
    if quant and nt % 32:
        raise ValueError(f"post_norm_residual: {nt} threads a row is not whole warps")
    # without quant, h's memory stands in for xq (never touched): nothing allocated while a
    # graph is captured
    xq_b, xq_f = (xq.view(np.uint8), xq.view(np.float32)) if quant else (h.reshape(h.size).view(np.uint8),
                                                                          h.reshape(h.size))
    _kernel(vpt, nt, quant)[rows, nt, stream](y, x, w_post, w_next, h, xq_b, xq_f, np.float32(eps), planes)
    return x, h
