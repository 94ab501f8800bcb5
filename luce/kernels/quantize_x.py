"""Activations quantized to int8 per 32 columns, for the matvec that multiplies 4-bit weights
with dp4a (luce.kernels.matvec_fast, x8 units).

Why: the float matvec spends ~4.6 instructions a Q4_K weight (decode each nibble to a
float, one FMA with x as float32), which bounds it at 42-48% of the H200's copy bandwidth
(matvec_fast's docstring). With x as int8, one dp4a multiplies four nibbles with four x
values and adds them: ~0.5 instructions a weight for the integer part. llama.cpp's MMVQ
does the same (its q8_1 activations); the price is x rounded to 8 bits a value, an error
of at most half a step (absmax / 254) of each 32-column block.

Layout: 48 bytes a 32-column block (16-byte aligned for the matvec's vector loads): the 32
int8 values, then float32 d (the step: absmax / 127), the sum of the block's first 16 x
values, the sum of its last 16 (exact float sums of x, not of the rounded values: Q4_K's
mins multiply them) and 4 bytes of padding. Stored as uint16, the type the matvec's
vector loads take.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .dequant import SIM
from .vector_load import ldg_f32x4

__all__ = ["XQ_BYTES", "xq_size", "quantize_x_ref", "dequantize_x_ref", "matvec_x8_ref", "quantize_x"]

QB = 32         # columns a block
XQ_BYTES = 48   # bytes a block
XQ_U16 = XQ_BYTES // 2
THREADS = 128


def xq_size(n_cols: int, n_rows: int = 1) -> int:
    """uint16 elements of the quantized form of n_rows rows of n_cols columns."""
    if n_cols % QB:
        raise ValueError(f"quantize_x: {n_cols} columns is not a multiple of {QB}")
    return n_rows * (n_cols // QB) * XQ_U16


def quantize_x_ref(x) -> np.ndarray:
    """The quantized form (uint16, xq_size elements) of float32 x, any shape whose last
    dimension is a multiple of 32; the rounding is the kernel's: floor(x * 127/absmax + 0.5)."""
    x = np.ascontiguousarray(x, np.float32)
    b = x.reshape(-1, QB)
    amax = np.abs(b).max(axis=1)
    inv = np.zeros_like(amax)
    nz = amax > 0
    inv[nz] = np.float32(127) / amax[nz]
    q = np.floor(b * inv[:, None] + np.float32(0.5)).astype(np.int8)
    out = np.zeros((b.shape[0], XQ_BYTES), np.uint8)
    out[:, :QB] = q.view(np.uint8)
    meta = np.zeros((b.shape[0], 4), np.float32)
    meta[:, 0] = amax / np.float32(127)
    meta[:, 1] = b[:, :16].sum(axis=1, dtype=np.float32)
    meta[:, 2] = b[:, 16:].sum(axis=1, dtype=np.float32)
    out[:, QB:] = meta.view(np.uint8)
    return out.reshape(-1).view(np.uint16)


def dequantize_x_ref(xq: np.ndarray, n_cols: int) -> np.ndarray:
    """x as the int8 form holds it (d * q), float32, rows of n_cols."""
    b = np.asarray(xq).view(np.uint8).reshape(-1, XQ_BYTES)
    q = b[:, :QB].view(np.int8).astype(np.float32)
    d = b[:, QB:QB + 4].copy().view(np.float32)
    return (q * d).reshape(-1, n_cols)


def matvec_x8_ref(raw: np.ndarray, qtype, x) -> np.ndarray:
    """What the x8 units compute, in float64: the weights' scaled quants times x as rounded
    to int8, and (Q4_K) the weights' min terms times the exact x. Rows of x give rows of y."""
    import gguf
    from .dequant import dequantize
    qtype = gguf.GGMLQuantizationType(qtype)
    x = np.asarray(x, np.float32)
    n_cols = x.shape[-1]
    n_rows = raw.shape[0]
    xh = dequantize_x_ref(quantize_x_ref(x), n_cols).astype(np.float64)
    w = dequantize(raw, qtype, (n_rows, n_cols)).astype(np.float64)
    if qtype != gguf.GGMLQuantizationType.Q4_K:
        raise NotImplementedError(f"matvec_x8_ref: {qtype.name}")
    no_min = raw.copy().reshape(n_rows, -1, 144)
    no_min[:, :, 2:4] = 0  # dmin = 0: the scaled quants alone
    w_sc = dequantize(no_min.reshape(n_rows, -1), qtype, (n_rows, n_cols)).astype(np.float64)
    y = xh @ w_sc.T + x.reshape(-1, n_cols).astype(np.float64) @ (w - w_sc).T
    return y.reshape(x.shape[:-1] + (n_rows,))


@cuda.jit
def _quantize_kernel(x, out_w, out_f, n_blocks):
    # One thread a 32-column block: 4096 columns are 128 threads, and the whole pass is a few
    # hundred instructions a thread (no shuffles: the simulator runs it as is).
    b = cuda.grid(1)
    if b >= n_blocks:
        return
    base = QB * b
    amax = np.float32(0.0)
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    for i in range(0, QB, 4):
        x0, x1, x2, x3 = ldg_f32x4(x, base + i)
        amax = max(amax, max(max(abs(x0), abs(x1)), max(abs(x2), abs(x3))))
        if i < 16:
            s0 += (x0 + x1) + (x2 + x3)
        else:
            s1 += (x0 + x1) + (x2 + x3)
    inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    half = np.float32(0.5)
    for k in range(QB // 4):
        x0, x1, x2, x3 = ldg_f32x4(x, base + 4 * k)
        q0 = np.int32(math.floor(x0 * inv + half)) & 255
        q1 = np.int32(math.floor(x1 * inv + half)) & 255
        q2 = np.int32(math.floor(x2 * inv + half)) & 255
        q3 = np.int32(math.floor(x3 * inv + half)) & 255
        out_w[12 * b + k] = np.uint32(q0 | (q1 << 8) | (q2 << 16) | (q3 << 24))
    out_f[12 * b + 8] = amax / np.float32(127.0)
    out_f[12 * b + 9] = s0
    out_f[12 * b + 10] = s1
    out_f[12 * b + 11] = np.float32(0.0)


def quantize_x(x, out=None, stream=0):
    """The quantized form of device float32 x (contiguous, 16-byte aligned, last dimension
    a multiple of 32) into out (device uint16, xq_size elements; allocated when None)."""
    n = x.size
    if n % QB:
        raise ValueError(f"quantize_x: {n} elements is not a multiple of {QB}")
    flat = x.reshape(n) if len(x.shape) != 1 else x
    if out is None:
        out = cuda.device_array(n // QB * XQ_U16, np.uint16, stream=stream)
    if out.size != n // QB * XQ_U16:
        raise ValueError(f"quantize_x: out holds {out.size} uint16, need {n // QB * XQ_U16}")
    n_blocks = n // QB
    threads = 32 if SIM else THREADS
    grid = -(-n_blocks // threads)
    _quantize_kernel[grid, threads, stream](flat, out.view(np.uint32), out.view(np.float32), n_blocks)
    return out


def bench_quantize_x(cols=(4096, 12288), rows=(1, 8), iters: int = 100) -> list[dict]:
    """Time quantize_x (cuda events around a replayed graph of `iters` launches)."""
    from .matvec import _capture
    stream = cuda.stream()
    out = []
    for n_rows in rows:
        for n_cols in cols:
            x = cuda.to_device(np.random.default_rng(0).standard_normal((n_rows, n_cols)).astype(np.float32))
            xq = cuda.device_array(xq_size(n_cols, n_rows), np.uint16)
            quantize_x(x, out=xq, stream=stream)
            stream.synchronize()
            run = _capture(lambda: quantize_x(x, out=xq, stream=stream), stream, iters)
            run()
            start, end = cuda.event(), cuda.event()
            start.record(stream)
            run()
            end.record(stream)
            end.synchronize()
            out.append({"kernel": "quantize_x", "rows": n_rows, "cols": n_cols,
                        "time_us": round(start.elapsed_time(end) * 1e3 / iters, 2)})
    return out
