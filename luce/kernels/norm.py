"""RMSNorm. The numpy reference is what the CPU backend runs."""
from __future__ import annotations

import numpy as np


def rms_norm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Normalize over the last axis (a head for q/k norm, the hidden state otherwise)."""
    x = x.astype(np.float32, copy=False)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)) * weight


def post_norm_residual_ref(y, x, w_post, w_next, eps: float):
    """Gemma's residual step and the norm after it: (x + RMSNorm(y) w_post, RMSNorm of that
    w_next)."""
    s = (x.astype(np.float32) + rms_norm_ref(y, w_post, eps)).astype(np.float32)
    return s, rms_norm_ref(s, w_next, eps).astype(np.float32)


# ------------------------------------------------------------------------------ CUDA
import math  # noqa: E402

import numpy as _np  # noqa: E402
from numba import cuda  # noqa: E402

from ._reduce import MAX_THREADS, SIM, WARP_RED_SLOTS, block_sum, block_threads  # noqa: E402
from .pdl import grid_dependency_sync, ready as pdl_ready  # noqa: E402
from .quantize_x import QB, int8_block_store, xq_size  # noqa: E402


import functools  # noqa: E402


@functools.cache
def _rms_norm_kernel(vpt: int, nt: int, pre: bool = False, quant: bool = False):
    """The kernel for rows of up to vpt x nt elements, vpt of them a thread in registers;
    pre: x is first RMS-normed by w_pre (Gemma's post-norm of a sublayer's output, before
    the residual add); quant: the output's int8 form too (luce.kernels.quantize_x; nt whole
    warps, rows a multiple of 32).

    vpt is a compile-time constant so the three row buffers are exactly as large as the row
    needs: a fixed 16 a thread (48 registers of buffers) needed more than the 64 registers a
    thread that 1024-thread blocks allow, and the launch failed (H200, 4096-wide rows).
    """
    # the launch bound makes the compiler keep registers within what nt threads allow (the
    # simulator's jit takes no launch bounds)
    jit = cuda.jit if SIM else cuda.jit(launch_bounds=nt)
    PRE, QUANT = pre, quant
    RED = max(1, nt // 32 * WARP_RED_SLOTS) if quant else 1  # the int8 form's warp reductions

    @jit
    def kernel(x, res, w, out, sum_out, eps, has_res, w_pre, xq_b, xq_f, planes):
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        # One block per row; a row is a hidden state or one head (q/k norm), so D is 64..16384.
        # Every load of the row is issued before the first store (a store to sum_out, which may
        # alias x, kept the next load from being issued before it), and the weights load while
        # the block reduces: each is one memory latency, not one a loop trip.
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        d_model = x.shape[1]
        buf = cuda.shared.array(MAX_THREADS, _np.float32)
        red = cuda.shared.array(RED, _np.float32)
        xv = cuda.local.array(vpt, _np.float32)
        rv = cuda.local.array(vpt, _np.float32)
        wv = cuda.local.array(vpt, _np.float32)
        for i in range(vpt):
            d = t + i * nt
            xv[i] = _np.float32(x[row, d]) if d < d_model else _np.float32(0.0)
            rv[i] = _np.float32(res[row, d]) if has_res and d < d_model else _np.float32(0.0)
        if PRE:
            ss = _np.float32(0.0)
            for i in range(vpt):
                ss += xv[i] * xv[i]
            inv = _np.float32(1.0) / math.sqrt(block_sum(ss, buf) / _np.float32(d_model) + eps)
            for i in range(vpt):
                d = t + i * nt
                xv[i] = xv[i] * inv * w_pre[d] if d < d_model else _np.float32(0.0)
        ss = _np.float32(0.0)
        for i in range(vpt):
            d = t + i * nt
            v = xv[i] + rv[i]
            xv[i] = v
            if has_res and d < d_model:
                sum_out[row, d] = v
            ss += v * v
        for i in range(vpt):
            d = t + i * nt
            wv[i] = w[d] if d < d_model else _np.float32(0.0)
        tot = block_sum(ss, buf)
        inv = _np.float32(1.0) / math.sqrt(tot / _np.float32(d_model) + eps)  # float32: tot / int is a float64 divide
        for i in range(vpt):
            d = t + i * nt
            o = xv[i] * inv * wv[i]
            if d < d_model:
                out[row, d] = o
            if QUANT:  # every lane of the warp, live or not: its reductions
                int8_block_store(o, d < d_model, (row * d_model + d) // QB, t % 32, t // 32, red, xq_b, xq_f,
                                 planes)
    return pdl_ready(kernel)


def norm_shape(d_model: int) -> tuple[int, int]:
    """(elements a thread, threads a block) for rows of d_model.

    sm_90, ptxas 13, with the launch bound: up to 8 a thread at 1024 threads (rows up to 8192)
    holds the row in 46 registers without spilling; 16 a thread spills 236 bytes, which only
    rows wider than any model luce runs on one GPU would pay.
    """
    nt = block_threads(min(MAX_THREADS, max(32, 1 << (d_model - 1).bit_length())))
    vpt = -(-d_model // nt)
    if not SIM and vpt > 32:
        raise ValueError(f"rms_norm: rows of {d_model} are wider than {32 * nt}")
    return vpt, nt


def rms_norm_cuda(x, weight, eps: float, out=None, residual=None, residual_out=None, stream=0, pre_weight=None,
                  xq=None, planes: int = 1):
    """RMSNorm of device array x ([N, D] or [N, H, D]: every last-axis row separately).

    With `residual`, normalizes s = x + residual and also stores s in `residual_out`
    (default: x itself, the usual in-place residual stream). pre_weight: x is RMSNorm(x)
    pre_weight first (Gemma's post-norm residual step with the next norm in one launch,
    post_norm_residual_ref). xq (device uint16 of quantize_x.xq_size(D, N, planes)): the
    output's int8 form as well (D a multiple of 32). Returns `out`.
    """
    d_model = x.shape[len(x.shape) - 1]  # the simulator's shape tuple rejects -1
    rows = x.size // d_model
    if out is None:
        out = cuda.device_array(x.shape, dtype=_np.float32, stream=stream)
    x2 = x.reshape(rows, d_model)
    o2 = out.reshape(rows, d_model)
    if residual is not None:
        r2 = residual.reshape(rows, d_model)
        s2 = (x if residual_out is None else residual_out).reshape(rows, d_model)
        has = 1
    else:
        r2 = s2 = x2  # never touched: has_res=0 (numba cannot type a None array here)
        has = 0
    # Up to a thread per element: a one-row norm is all latency (H200, 4096-wide row at
    # 1024 threads, 4 elements a thread: 2.9 us a call, 9c10a00; 4.3 us at 256 threads).
    vpt, nt = norm_shape(d_model)
    quant = xq is not None
    if quant:
        if d_model % QB or nt % 32 or xq.size != xq_size(d_model, rows, planes):
            raise ValueError(f"rms_norm: rows of {d_model} (a multiple of {QB}) into {xq_size(d_model, rows, planes)}"
                             f" uint16 (int8 form), got {xq.size}")
        xq_b, xq_f = xq.view(_np.uint8), xq.view(_np.float32)
    else:  # never touched: out's memory stands in (nothing allocated while a graph is captured)
        xq_b, xq_f = o2.reshape(o2.size).view(_np.uint8), o2.reshape(o2.size)
    w_pre = weight if pre_weight is None else pre_weight
    _rms_norm_kernel(vpt, nt, pre_weight is not None, quant)[rows, nt, stream](
        x2, r2, weight, o2, s2, _np.float32(eps), has, w_pre, xq_b, xq_f, planes)
    return out
