"""Activations quantized to int8 per 32 columns, in one or two planes, for the matvec that
multiplies 4- and 6-bit weights with dp4a (luce.kernels.matvec_fast, x8 units).

Why: the float matvec spends ~4.6 instructions a Q4_K weight (decode each nibble to a
float, one FMA with x as float32), which bounds it at 42-48% of the H200's copy bandwidth
(matvec_fast's docstring). With x as int8, one dp4a multiplies four nibbles with four x
values and adds them: ~0.5 instructions a weight for the integer part. llama.cpp's MMVQ
does the same (its q8_1 activations); the price is x rounded to 8 bits a value, an error
of at most half a step (absmax / 254) of each 32-column block.

Layout: 48 bytes a 32-column block (16-byte aligned for the matvec's vector loads): the 32
int8 values, then float32 d (the step: absmax / 127), the sum of the block's first 16 x
values, the sum of its last 16 (exact float sums of x, not of the rounded values: Q4_K's
mins multiply them), and the sums of the first 16 and the last 16 int8 values as two
int16 (Q6_K's quants are stored plus 32: its units subtract 32 times these). Stored as
uint16, the type the matvec's vector loads take.

Two planes (planes=2): each block's 48 bytes are followed by the same form of what the
first plane left (x - d q, at most half a step a value), so x = d q + d2 q2 within
d2 / 2 <= absmax / 64516: about int16's precision, through the same dp4a (two a word
instead of one). Why: one plane's rounding changed the greedy output of 3 of 10 prompts
of a real model; an int16 emulation changed none (luce.bench.x8_drift). The matvec uses
the first plane's float sums (Q4_K's mins) and each plane's int16 sums (Q6_K).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._reduce import MAX_THREADS, WARP_RED_SLOTS, block_sum, warp_allmax, warp_allsum
from .dequant import SIM
from .device import device
from .vector_load import ldg_f32x4

__all__ = ["XQ_BYTES", "xq_size", "quantize_x_ref", "dequantize_x_ref", "matvec_x8_ref", "quantize_x",
           "rms_norm_quantize"]

QB = 32         # columns a block
XQ_BYTES = 48   # bytes a block
XQ_U16 = XQ_BYTES // 2
THREADS = 128  # a multiple of 32: each warp one block


def xq_size(n_cols: int, n_rows: int = 1, planes: int = 1) -> int:
    """uint16 elements of the quantized form of n_rows rows of n_cols columns."""
    if n_cols % QB:
        raise ValueError(f"quantize_x: {n_cols} columns is not a multiple of {QB}")
    if planes not in (1, 2):
        raise ValueError(f"quantize_x: planes is 1 or 2, got {planes}")
    return n_rows * (n_cols // QB) * XQ_U16 * planes


def quantize_x_ref(x, planes: int = 1) -> np.ndarray:
    """The quantized form (uint16, xq_size elements) of float32 x, any shape whose last
    dimension is a multiple of 32; the rounding is the kernel's: floor(x * 127/absmax + 0.5);
    the second plane holds the first's remainder x - d q, rounded the same way."""
    x = np.ascontiguousarray(x, np.float32)
    b = x.reshape(-1, QB)
    one = _plane_ref(b)
    if planes == 1:
        return one.reshape(-1).view(np.uint16)
    q = one[:, :QB].view(np.int8).astype(np.float32)
    d = one[:, QB:QB + 4].copy().view(np.float32)
    two = _plane_ref((b.astype(np.float64) - q.astype(np.float64) * d).astype(np.float32))  # one rounding
    return np.concatenate([one, two], axis=1).reshape(-1).view(np.uint16)


def _plane_ref(b) -> np.ndarray:
    """One plane's blocks ([blocks, XQ_BYTES] uint8) of float32 blocks b [blocks, 32]."""
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
    qs = q.astype(np.int32)
    isums = (qs[:, :16].sum(1) & 0xFFFF) | ((qs[:, 16:].sum(1) & 0xFFFF) << 16)
    meta.view(np.uint32)[:, 3] = isums.astype(np.uint32)
    out[:, QB:] = meta.view(np.uint8)
    return out


def int_sums_ref(xq: np.ndarray, planes: int = 1) -> np.ndarray:
    """The int8 values' sums over each 16 columns, [blocks, 2] (the first plane's), from the
    stored int16 pair."""
    w = np.asarray(xq).view(np.uint8).reshape(-1, XQ_BYTES * planes)[:, 44:48].copy().view(np.int16)
    return w.reshape(-1, 2).astype(np.int32)


def dequantize_x_ref(xq: np.ndarray, n_cols: int, planes: int = 1) -> np.ndarray:
    """x as the int8 form holds it (d * q, summed over the planes: in float64 with two),
    rows of n_cols."""
    b = np.asarray(xq).view(np.uint8).reshape(-1, planes, XQ_BYTES)
    q = b[:, :, :QB].view(np.int8).astype(np.float64)
    d = b[:, :, QB:QB + 4].copy().view(np.float32).astype(np.float64)
    x = (q * d).sum(axis=1)
    return (x if planes > 1 else x.astype(np.float32)).reshape(-1, n_cols)


def matvec_x8_ref(raw: np.ndarray, qtype, x, planes: int = 1) -> np.ndarray:
    """What the x8 units compute, in float64: the weights' scaled quants times x as its
    int8 planes hold it, and (Q4_K) the weights' min terms times the exact x. Rows of x give
    rows of y."""
    import gguf
    from .dequant import dequantize
    qtype = gguf.GGMLQuantizationType(qtype)
    x = np.asarray(x, np.float32)
    n_cols = x.shape[-1]
    n_rows = raw.shape[0]
    xh = dequantize_x_ref(quantize_x_ref(x, planes), n_cols, planes).astype(np.float64)
    w = dequantize(raw, qtype, (n_rows, n_cols)).astype(np.float64)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # no mins: all of W meets the rounded x
        return (xh @ w.T).reshape(x.shape[:-1] + (n_rows,))
    if qtype != gguf.GGMLQuantizationType.Q4_K:
        raise NotImplementedError(f"matvec_x8_ref: {qtype.name}")
    no_min = raw.copy().reshape(n_rows, -1, 144)
    no_min[:, :, 2:4] = 0  # dmin = 0: the scaled quants alone
    w_sc = dequantize(no_min.reshape(n_rows, -1), qtype, (n_rows, n_cols)).astype(np.float64)
    y = xh @ w_sc.T + x.reshape(-1, n_cols).astype(np.float64) @ (w - w_sc).T
    return y.reshape(x.shape[:-1] + (n_rows,))


if SIM:
    def _remainder(v, q, d):
        """v - q d rounded once (the GPU's fma; q d is exact in float64)."""
        return np.float32(np.float64(v) - np.float64(q) * np.float64(d))
else:
    @cuda.jit(device=True)
    def _remainder(v, q, d):
        return cuda.fma(-q, d, v)


@device
def int8_block_store(o, live, blk, lane, wid, red, xq_b, xq_f, planes):
    """Lane `lane` of warp `wid` holds value o (live) of 32-column block `blk`, lane = its
    column in the block: the warp writes the block's int8 form (`planes` planes) into xq_b
    (bytes) / xq_f (the same memory as float32). Warp reductions (absmax, the two half
    sums): every lane of the block's threads must call it, live or not."""
    r = int8_plane_store(o, live, XQ_BYTES * planes * blk, lane, wid, red, xq_b, xq_f)
    if planes == 2:
        int8_plane_store(r, live, XQ_BYTES * (2 * blk + 1), lane, wid, red, xq_b, xq_f)


@device
def int8_plane_store(o, live, at, lane, wid, red, xq_b, xq_f):
    """One plane of int8_block_store at byte `at`; returns what it leaves of o (o - d q)."""
    zero = np.float32(0.0)
    v = o if live else zero
    amax = warp_allmax(abs(v), red, wid, lane)
    sc = np.float32(127.0) / amax if amax > 0 else zero
    q = np.int32(math.floor(v * sc + np.float32(0.5)))
    qf = np.float32(q)  # small integers: their float sums are exact
    lo = lane < 16
    s_lo = warp_allsum(v if lo else zero, red, wid, lane)
    s_hi = warp_allsum(zero if lo else v, red, wid, lane)
    i_lo = np.int32(warp_allsum(qf if lo else zero, red, wid, lane))
    i_hi = np.int32(warp_allsum(zero if lo else qf, red, wid, lane))
    d = amax / np.float32(127.0)
    if live:
        xq_b[at + lane] = np.uint8(q & 255)
        if lane == 0:
            xq_f[(at >> 2) + 8] = d
            xq_f[(at >> 2) + 9] = s_lo
            xq_f[(at >> 2) + 10] = s_hi
        if lane < 4:  # the int16 pair, a byte a lane (the buffer's float view cannot take the bits)
            pair = (i_lo & 0xFFFF) | ((i_hi & 0xFFFF) << 16)
            xq_b[at + 44 + lane] = np.uint8((pair >> (8 * lane)) & 255)
    return _remainder(v, qf, d)


_RED = max(1, THREADS // 32 * WARP_RED_SLOTS)


@cuda.jit
def _quantize_kernel(x, xq_b, xq_f, n, planes):
    # A thread a value, a warp a block: a 4096-wide row is 32 blocks of 128 threads, each
    # thread a load and three warp reductions. H200, in a graph: 1.39 us a 4096-wide row
    # (7e624ca); with a thread walking each block's 32 values, 2.44 us. Written by the
    # RMSNorm kernel instead (its threads hold whole blocks a warp), the norm took 5.84 us
    # a call instead of 2.97 (7e624ca): more than this launch, so it stays a launch.
    red = cuda.shared.array(_RED, np.float32)
    t = cuda.threadIdx.x
    e = cuda.blockIdx.x * cuda.blockDim.x + t
    live = e < n
    o = x[e] if live else np.float32(0.0)
    int8_block_store(o, live, e >> 5, t & 31, t >> 5, red, xq_b, xq_f, planes)


@cuda.jit
def _norm_quantize_kernel(x, w, out, xq_b, xq_f, d_model, eps, planes):
    # RMSNorm and quantize_x in one launch, for the decode rows whose every projection takes
    # int8 x: block (bx, row) makes columns bx * THREADS + t. Each block sums the squares of
    # the whole row itself (4096 floats: eight 16-byte loads a thread, from L2) rather than
    # waiting for a reduction across blocks. (RMSNorm's own kernel, one 1024-thread block a
    # row, took 5.84 us with the quantization added, 7e624ca.)
    buf = cuda.shared.array(MAX_THREADS, np.float32)
    red = cuda.shared.array(_RED, np.float32)
    t = cuda.threadIdx.x
    row = cuda.blockIdx.y
    base = row * d_model
    col = cuda.blockIdx.x * cuda.blockDim.x + t
    ss = np.float32(0.0)
    for i in range(4 * t, d_model, 4 * cuda.blockDim.x):
        x0, x1, x2, x3 = ldg_f32x4(x, base + i)
        ss += (x0 * x0 + x1 * x1) + (x2 * x2 + x3 * x3)
    tot = block_sum(ss, buf)
    inv = np.float32(1.0) / math.sqrt(tot / np.float32(d_model) + eps)
    live = col < d_model
    o = x[base + col] * inv * w[col] if live else np.float32(0.0)
    if live:
        out[base + col] = o
    int8_block_store(o, live, (base + col) >> 5, t & 31, t >> 5, red, xq_b, xq_f, planes)


def rms_norm_quantize(x, weight, eps: float, out, xq, stream=0, planes: int = 1):
    """out = RMSNorm(x) (rows of device float32 x [N, D], D a multiple of 32, 16-byte
    aligned) and xq = quantize_x(out, planes=planes), in one launch. Returns (out, xq)."""
    rows, d_model = x.shape
    if d_model % QB or xq.size != xq_size(d_model, rows, planes) or xq.dtype != np.uint16:
        raise ValueError(f"rms_norm_quantize: rows of {d_model} (a multiple of {QB}) into "
                         f"{xq_size(d_model, rows, planes)} uint16, got {xq.size} {xq.dtype}")
    threads = 32 if SIM else THREADS
    grid = (-(-d_model // threads), rows)
    _norm_quantize_kernel[grid, threads, stream](x.reshape(x.size), weight, out.reshape(out.size), xq.view(np.uint8),
                                                 xq.view(np.float32), d_model, np.float32(eps), planes)
    return out, xq


def quantize_x(x, out=None, stream=0, planes: int = 1):
    """The quantized form of device float32 x (contiguous, 16-byte aligned, last dimension
    a multiple of 32) into out (device uint16, xq_size elements; allocated when None), in
    `planes` int8 planes (1, or 2 for about int16's precision)."""
    n = x.size
    if n % QB:
        raise ValueError(f"quantize_x: {n} elements is not a multiple of {QB}")
    size = xq_size(n, 1, planes)
    flat = x.reshape(n) if len(x.shape) != 1 else x
    if out is None:
        out = cuda.device_array(size, np.uint16, stream=stream)
    if out.size != size:
        raise ValueError(f"quantize_x: out holds {out.size} uint16, need {size}")
    threads = 32 if SIM else THREADS
    _quantize_kernel[-(-n // threads), threads, stream](flat, out.view(np.uint8), out.view(np.float32), n, planes)
    return out


def bench_quantize_x(cols=(4096, 12288), rows=(1, 8), iters: int = 100, planes=(1, 2)) -> list[dict]:
    """Time quantize_x (cuda events around a replayed graph of `iters` launches)."""
    from .matvec import _capture
    stream = cuda.stream()
    out = []
    for p in planes:
        for n_rows in rows:
            for n_cols in cols:
                x = cuda.to_device(np.random.default_rng(0).standard_normal((n_rows, n_cols)).astype(np.float32))
                xq = cuda.device_array(xq_size(n_cols, n_rows, p), np.uint16)
                quantize_x(x, out=xq, stream=stream, planes=p)
                stream.synchronize()
                run = _capture(lambda: quantize_x(x, out=xq, stream=stream, planes=p), stream, iters)
                run()
                start, end = cuda.event(), cuda.event()
                start.record(stream)
                run()
                end.record(stream)
                end.synchronize()
                out.append({"kernel": "quantize_x", "planes": p, "rows": n_rows, "cols": n_cols,
                            "time_us": round(start.elapsed_time(end) * 1e3 / iters, 2)})
    return out
