"""Activations quantized to int8 (a step a 16 columns, blocks of 32), in one or two planes,
for the matvec that multiplies 4- and 6-bit weights with dp4a (luce.kernels.matvec_fast,
x8 units).

Why: the float matvec spends ~4.6 instructions a Q4_K weight (decode each nibble to a
float, one FMA with x as float32), which bounds it at 42-48% of the H200's copy bandwidth
(matvec_fast's docstring). With x as int8, one dp4a multiplies four nibbles with four x
values and adds them: ~0.5 instructions a weight for the integer part. llama.cpp's MMVQ
does the same (its q8_1 activations); the price is x rounded to 8 bits a value, an error
of at most half a step (absmax / 254) of each 16 columns.

Layout: 48 bytes a 32-column block (16-byte aligned for the matvec's vector loads): the 32
int8 values, then four float32: the steps of its first and its last 16 values (absmax /
127 of each half), and the sums of those halves (exact float sums of x, not of the
rounded values: Q4_K's mins multiply them, and Q6_K's quants are stored plus 32). Stored
as uint16, the type the matvec's vector loads take. A step per 16 columns because a unit
reads 16 columns of a block anyway, and because 16 consecutive outputs are what a row
block of a matvec makes (so a product's epilogue can write its output in this form).

Two planes (planes=2): 80 bytes a block: the 32 int8 values q, then 32 more, q2, the
rounding of what q left (x - d q, at most half a step) in steps of d / 254, then the same
16 bytes with the fine steps d / 254 in place of d. So x = (254 q + q2) d / 254 within
d / 508 = absmax / 64516, about int16's precision, and a unit's integer products of both
planes combine as 254 i + i2 before one float multiply. Why: one plane's rounding
changed the greedy output of 3 or 4 of 10 prompts of a real model; two planes changed none
(luce.bench.x8_drift). Why not two full 48-byte planes: the x8 units are bound by their
load instructions (each 16-byte x load serves one row pair), and the second plane's own
steps and sums cost one more load a block (H200, a377fae: gated Q4_K 12288x4096 24.2 us
with two full planes, 15.7 with one, 25.6 with float x; aa140c3, 80-byte blocks: 17.0).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._reduce import MAX_THREADS, WARP_RED_SLOTS, block_sum, warp_groupmax, warp_groupsum
from .dequant import SIM
from .device import device
from .pdl import grid_dependency_sync, ready as pdl_ready
from .vector_load import ldg_f32x4

__all__ = ["XQ_BYTES", "xq_size", "quantize_x_ref", "dequantize_x_ref", "matvec_x8_ref", "quantize_x",
           "rms_norm_quantize", "int8_half_store", "int8_quad_store"]

QB = 32         # columns a block
HB = 16         # columns a step
XQ_BYTES = 48   # bytes a block, one plane
XQ2_BYTES = 80  # two planes
FINE = 254      # the second plane's steps in one of the first's
THREADS = 128  # a multiple of 32: each warp one block


def block_bytes(planes: int) -> int:
    """Bytes of a 32-column block in `planes` planes."""
    return XQ_BYTES if planes == 1 else XQ2_BYTES


def xq_size(n_cols: int, n_rows: int = 1, planes: int = 1) -> int:
    """uint16 elements of the quantized form of n_rows rows of n_cols columns."""
    if n_cols % QB:
        raise ValueError(f"quantize_x: {n_cols} columns is not a multiple of {QB}")
    if planes not in (1, 2):
        raise ValueError(f"quantize_x: planes is 1 or 2, got {planes}")
    return n_rows * (n_cols // QB) * block_bytes(planes) // 2


def quantize_x_ref(x, planes: int = 1) -> np.ndarray:
    """The quantized form (uint16, xq_size elements) of float32 x, any shape whose last
    dimension is a multiple of 32; the rounding is the kernel's: floor(x * 127/absmax + 0.5)
    over each 16 columns, and with two planes floor(r * (127/absmax * 254) + 0.5) of the
    remainder r = x - d q (rounded once, as the GPU's fma)."""
    x = np.ascontiguousarray(x, np.float32)
    h = x.reshape(-1, HB)  # halves of blocks
    amax = np.abs(h).max(axis=1)
    inv = np.zeros_like(amax)
    nz = amax > 0
    inv[nz] = np.float32(127) / amax[nz]
    q = np.floor(h * inv[:, None] + np.float32(0.5)).astype(np.int8)
    d = amax / np.float32(127)
    n = h.shape[0] // 2
    out = np.zeros((n, block_bytes(planes)), np.uint8)
    out[:, :QB] = q.reshape(n, QB).view(np.uint8)
    meta = np.zeros((n, 4), np.float32)
    meta[:, :2] = d.reshape(n, 2)
    if planes == 2:
        r = (h.astype(np.float64) - q.astype(np.float64) * d[:, None].astype(np.float64)).astype(np.float32)
        q2 = np.clip(np.floor(r * (inv * np.float32(FINE))[:, None] + np.float32(0.5)), -127, 127).astype(np.int8)
        out[:, QB:2 * QB] = q2.reshape(n, QB).view(np.uint8)
        meta[:, :2] = (d / np.float32(FINE)).reshape(n, 2)
    meta[:, 2:] = h.sum(axis=1, dtype=np.float32).reshape(n, 2)
    out[:, QB * planes:] = meta.view(np.uint8)
    return out.reshape(-1).view(np.uint16)


def dequantize_x_ref(xq: np.ndarray, n_cols: int, planes: int = 1) -> np.ndarray:
    """x as the int8 form holds it, rows of n_cols: d q (float32), or with two planes
    (254 q + q2) times the fine step, in float64."""
    nb = block_bytes(planes)
    b = np.asarray(xq).view(np.uint8).reshape(-1, nb)
    q = b[:, :QB].view(np.int8).astype(np.float64).reshape(-1, HB)
    step = b[:, QB * planes:QB * planes + 8].copy().view(np.float32).astype(np.float64).reshape(-1, 1)
    if planes == 1:
        return (q * step).astype(np.float32).reshape(-1, n_cols)
    q2 = b[:, QB:2 * QB].view(np.int8).astype(np.float64).reshape(-1, HB)
    return ((FINE * q + q2) * step).reshape(-1, n_cols)


def matvec_x8_ref(raw: np.ndarray, qtype, x, planes: int = 1) -> np.ndarray:
    """What the x8 units compute, in float64: the weights' scaled quants times x as its
    int8 planes hold it, and the weights' constant terms (Q4_K's mins, Q6_K's -32 d scale)
    times the exact x. Rows of x give rows of y."""
    import gguf
    from .dequant import dequantize
    qtype = gguf.GGMLQuantizationType(qtype)
    x = np.asarray(x, np.float32)
    n_cols = x.shape[-1]
    n_rows = raw.shape[0]
    xh = dequantize_x_ref(quantize_x_ref(x, planes), n_cols, planes).astype(np.float64)
    w = dequantize(raw, qtype, (n_rows, n_cols)).astype(np.float64)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        zero = raw.copy().reshape(n_rows, -1, 210)
        zero[:, :, :192] = 0  # every 6-bit quant 0: what is left is the offset, -32 d scale
        off = dequantize(zero.reshape(n_rows, -1), qtype, (n_rows, n_cols)).astype(np.float64)
        y = xh @ (w - off).T + x.reshape(-1, n_cols).astype(np.float64) @ off.T  # the float sums of x
        return y.reshape(x.shape[:-1] + (n_rows,))
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
    (bytes) / xq_f (the same memory as float32). Warp reductions (absmax and sum of each
    half): every lane of the block's threads must call it, live or not."""
    int8_half_store(o, live, XQ_BYTES * blk if planes == 1 else XQ2_BYTES * blk, lane, lane, wid, red, xq_b,
                    xq_f, planes)


@device
def _q8(v, sc):
    """v's first-plane int8 at scale sc (127 / the half's absmax)."""
    return np.int32(math.floor(v * sc + np.float32(0.5)))


@device
def _q8_fine(v, q, d, sc):
    """The second plane: what q (step d) left of v, in steps FINE times finer, clamped."""
    return max(-127, min(127, np.int32(math.floor(_remainder(v, np.float32(q), d) * (sc * np.float32(FINE)) +
                                                  np.float32(0.5)))))


@device
def int8_half_store(o, live, at, c, lane, wid, red, xq_b, xq_f, planes):
    """As int8_block_store for the 32-column block at byte `at`, whose column c this lane
    holds: each aligned 16 lanes of the warp (c & 15 = lane & 15) make one half's step and
    sum, so the halves of a block may come from different warps."""
    zero = np.float32(0.0)
    v = o if live else zero
    amax = warp_groupmax(abs(v), HB, red, wid, lane)
    s = warp_groupsum(v, HB, red, wid, lane)
    sc = np.float32(127.0) / amax if amax > 0 else zero
    q = _q8(v, sc)
    d = amax / np.float32(127.0)
    meta = (at + QB * planes) >> 2
    if live:
        xq_b[at + c] = np.uint8(q & 255)
        if planes == 2:
            xq_b[at + QB + c] = np.uint8(_q8_fine(v, q, d, sc) & 255)
        if (c & (HB - 1)) == 0:
            h = c >> 4
            xq_f[meta + h] = d if planes == 1 else d / np.float32(FINE)
            xq_f[meta + 2 + h] = s


@device
def _pack4(a, b, c, d):
    """Four int8 (in ints) as one little-endian word."""
    return (np.uint32(a & 255) | (np.uint32(b & 255) << np.uint32(8)) | (np.uint32(c & 255) << np.uint32(16)) |
            (np.uint32(d & 255) << np.uint32(24)))


@device
def int8_quad_store(v0, v1, v2, v3, live, c, lane, wid, red, xq_w, xq_f, planes):
    """As int8_half_store with four consecutive columns c .. c + 3 a thread (c % 4 == 0;
    the four lanes of each 16-column half adjacent and aligned): two reductions over four
    lanes instead of four over sixteen, and each plane's four int8 written as one word of
    xq_w (the memory as uint32). Every lane of the block's threads must call it."""
    zero = np.float32(0.0)
    if not live:
        v0 = v1 = v2 = v3 = zero
    amax = warp_groupmax(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))), 4, red, wid, lane)
    s = warp_groupsum((v0 + v1) + (v2 + v3), 4, red, wid, lane)
    sc = np.float32(127.0) / amax if amax > 0 else zero
    d = amax / np.float32(127.0)
    q0, q1, q2, q3 = _q8(v0, sc), _q8(v1, sc), _q8(v2, sc), _q8(v3, sc)
    at = (XQ_BYTES if planes == 1 else XQ2_BYTES) * (c >> 5)  # the block's first byte
    if live:
        xq_w[(at + (c & 31)) >> 2] = _pack4(q0, q1, q2, q3)
        if planes == 2:
            xq_w[(at + QB + (c & 31)) >> 2] = _pack4(_q8_fine(v0, q0, d, sc), _q8_fine(v1, q1, d, sc),
                                                       _q8_fine(v2, q2, d, sc), _q8_fine(v3, q3, d, sc))
        if (c & (HB - 1)) == 0:
            meta = (at + QB * planes) >> 2
            h = (c >> 4) & 1
            xq_f[meta + h] = d if planes == 1 else d / np.float32(FINE)
            xq_f[meta + 2 + h] = s


_RED = max(1, THREADS // 32 * WARP_RED_SLOTS)


@cuda.jit
def _quantize_kernel(x, xq_b, xq_f, n, planes):
    # A thread a value, a warp a block: a 4096-wide row is 32 blocks of 128 threads, each
    # thread a load and two reductions over its 16 lanes (three over the warp at 7e624ca).
    # H200, in a graph: 1.39 us a 4096-wide row (7e624ca); with a thread walking each
    # block's 32 values, 2.44 us. Written by the
    # RMSNorm kernel instead (its threads hold whole blocks a warp), the norm took 5.84 us
    # a call instead of 2.97 (7e624ca): more than this launch, so it stays a launch.
    grid_dependency_sync()  # luce.kernels.pdl: nothing unless LUCE_PDL
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
    grid_dependency_sync()
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


pdl_ready(_quantize_kernel)
pdl_ready(_norm_quantize_kernel)


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
