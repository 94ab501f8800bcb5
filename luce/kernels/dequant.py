"""Dequantization of GGUF tensors: numpy references and CUDA kernels.

The numpy functions decode all blocks of a chunk at once with broadcasting. The device
side (second half) describes each type by a few per-unit device functions (DEVICE_SPECS)
shared with luce.kernels.matvec; they index bytes the other way round from the numpy code,
so the two are independent implementations of the same layouts and test each other.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .quant_types import SUPPORTED_TYPES, as_qtype, block_bytes, block_elems, row_bytes

__all__ = ["SUPPORTED_TYPES", "DEVICE_SPECS", "dequantize", "dequantize_device", "row_bytes"]

# Blocks per numpy pass: bounds the temporaries (a few times 16 MiB) for huge tensors.
_CHUNK_ELEMS = 1 << 22

_NIBBLE = np.array([0, 4], np.uint8)
_CRUMB = np.array([0, 2, 4, 6], np.uint8)
_BITS8 = np.arange(8, dtype=np.uint8)


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """(n, 1) float32 from the f16 at byte `off` of each block."""
    return b[:, off:off + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-element groups: low nibbles of 32 bytes first, then their high nibbles."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, 32) >> _NIBBLE[:, None]) & 15).reshape(n, -1)


def _q4_0(b):
    qs = b[:, 2:18]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
    return (q - 8) * _f16(b, 0)


def _q4_1(b):
    qs = b[:, 4:20]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_q(b, qh_off):
    qs = b[:, qh_off + 4:qh_off + 20]
    hi = np.unpackbits(b[:, qh_off:qh_off + 4], axis=1, bitorder="little")  # bit j = element j
    return (np.concatenate([qs & 15, qs >> 4], axis=1) | (hi << 4)).astype(np.float32)


def _q5_0(b):
    return (_q5_q(b, 2) - 16) * _f16(b, 0)


def _q5_1(b):
    return _f16(b, 0) * _q5_q(b, 4) + _f16(b, 2)


def _q8_0(b):
    return b[:, 2:34].view(np.int8).astype(np.float32) * _f16(b, 0)


def _q2_k(b):
    n = b.shape[0]
    sc = b[:, :16]
    q = ((b[:, 16:80].reshape(n, 2, 1, 32) >> _CRUMB[:, None]) & 3).reshape(n, 16, 16)
    dl = (_f16(b, 80) * (sc & 15).astype(np.float32))[:, :, None]
    ml = (_f16(b, 82) * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32) - ml).reshape(n, 256)


def _q3_k(b):
    n = b.shape[0]
    s = b[:, 96:108]
    lo = np.concatenate([s[:, :8] & 15, s[:, :8] >> 4], axis=1)
    hi = ((s[:, 8:12].reshape(n, 1, 4) >> _CRUMB[:, None]) & 3).reshape(n, 16)
    scale = (lo | (hi << 4)).astype(np.float32) - 32
    ql = ((b[:, 32:96].reshape(n, 2, 1, 32) >> _CRUMB[:, None]) & 3).reshape(n, 256)
    # A clear hmask bit means "subtract 4".
    h = ((b[:, :32].reshape(n, 1, 32) >> _BITS8[:, None]) & 1).reshape(n, 256)
    q = ql.astype(np.float32) - 4 * (1 - h).astype(np.float32)
    return ((_f16(b, 108) * scale)[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


def _k_scale_min(s):
    """The 8 six-bit (scale, min) pairs packed in 12 bytes by Q4_K and Q5_K."""
    a, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (md & 15) | ((a >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 16:144]).reshape(n, 8, 32).astype(np.float32)
    return ((_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    h = ((b[:, 16:48].reshape(n, 1, 32) >> _BITS8[:, None]) & 1).reshape(n, 256)
    q = (_nibbles(b[:, 48:176]) | (h << 4)).reshape(n, 8, 32).astype(np.float32)
    return ((_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    lo = ((b[:, 0:128].reshape(n, 2, 1, 64) >> _NIBBLE[:, None]) & 15).reshape(n, 256)
    hi = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMB[:, None]) & 3).reshape(n, 256)
    q = (lo | (hi << 4)).astype(np.float32) - 32
    dl = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (dl[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


def _f32(b):
    return b.view(np.float32)


def _f16_elems(b):
    return b.view(np.float16).astype(np.float32)


def _bf16(b):
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_DECODERS = {
    T.F32: _f32, T.F16: _f16_elems, T.BF16: _bf16,
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
assert set(_DECODERS) == SUPPORTED_TYPES


def _as_bytes(raw) -> np.ndarray:
    raw = np.asarray(raw)
    if not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw)
    return raw.reshape(-1).view(np.uint8)


def dequantize(raw: np.ndarray, qtype, shape) -> np.ndarray:
    """Decode a GGUF tensor's bytes to a float32 array of `shape` (numpy order, last dim contiguous)."""
    qtype = as_qtype(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise NotImplementedError(f"dequantize: {qtype.name} is not supported")
    shape = tuple(int(s) for s in np.atleast_1d(shape)) if not isinstance(shape, int) else (int(shape),)
    data = _as_bytes(raw)
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    expect = n_rows * row_bytes(qtype, shape[-1])
    if data.size != expect:
        raise ValueError(f"dequantize: {qtype.name} {shape} needs {expect} bytes, got {data.size}")
    qk, ts = block_elems(qtype), block_bytes(qtype)
    blocks = data.reshape(-1, ts)
    out = np.empty((blocks.shape[0], qk), np.float32)
    step = max(1, _CHUNK_ELEMS // qk)
    decode = _DECODERS[qtype]
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = decode(blocks[i:i + step]).reshape(-1, qk)
    return out.reshape(shape)


# ----------------------------------------------------------------------------------------
# Device side.
#
# Every type is described to the kernels by the same small interface, so one generic kernel
# body serves all of them (here: dequantize; luce.kernels.matvec: matrix-vector products).
# A block (QK elements, BS bytes; F32/F16/BF16 use 16-byte pseudo-blocks) splits into UPB
# units; a unit, the work of one thread, is RUNS runs of RL consecutive columns that share
# a scale; the values of a run are s * q + o.
#   col(u, k)                -> first column of run k of unit u, relative to the block
#   scale(sh, bo, u, k)      -> (s, o)
#   quad(sh, bo, u, k, j)    -> q of columns col(u, k) + 4j .. + 3, as four float32
# `sh` is a uint32 array holding the block's bytes (staged in shared memory by the kernels)
# and `bo` the block's byte offset in it. The layouts follow ggml-quants.c.
# ----------------------------------------------------------------------------------------
from collections import namedtuple  # noqa: E402

from numba import cuda  # noqa: E402

from .device import device  # noqa: E402
from .vector_load import SIM, f16_bits_to_f32, ldg_u16_u32, ldg_u16_u32x4, u32_bits_to_f32  # noqa: E402
from .pdl import grid_dependency_sync, ready as pdl_ready  # noqa: E402

DeviceSpec = namedtuple("DeviceSpec", "qk bs upb runs rl tile_blocks col scale quad")
_dev = device  # plain Python in the simulator where it can be: see luce.kernels.device


# Bit fiddling is written in uint32 with uint32 constants: numba widens integer arithmetic
# to 64 bits (twice the instructions on the GPU) and the U() around each result lets LLVM
# narrow it back; numpy keeps uint32 too, so the simulator computes the same. Nothing here
# subtracts in integers (it would wrap). Unsigned indices also skip numba's negative-index
# wraparound code.
U = np.uint32
B1, B2, B4, B8, B16, B24 = U(1), U(2), U(4), U(8), U(16), U(24)
M1, M3, M15, M63, M255, M16 = U(1), U(3), U(15), U(63), U(255), U(0xFFFF)


@_dev
def rd8(sh, o):
    o = U(o)
    return U(U(sh[o >> B2] >> ((o & U(3)) << U(3))) & M255)


@_dev
def rd16(sh, o):  # o even
    o = U(o)
    return U(U(sh[o >> B2] >> ((o & B2) << U(3))) & M16)


@_dev
def rd32(sh, o):  # o even; blocks only guarantee 2-byte alignment
    o = U(o)
    i = o >> B2
    if o & B2:
        return U(U(sh[i] >> B16) | U(sh[i + U(1)] << B16))
    return sh[i]


@_dev
def f16_at(sh, o):
    return f16_bits_to_f32(rd16(sh, o))


# Small unsigned ints become floats through the exponent: the bits 0x4B000000 | v are the
# float 2**23 + v (v < 2**23). One logic op and one add replace an int-to-float convert,
# which runs at a quarter of the FMA rate on recent GPUs and would bound the decode.
MAGIC = U(0x4B000000)
F_MAGIC = np.float32(8388608.0)            # 2**23
F_MAGIC_I8 = np.float32(8388608.0 + 128)   # 2**23 + 128: int8 read as offset binary


@_dev
def ufloat(v):
    return u32_bits_to_f32(U(v | MAGIC)) - F_MAGIC


@_dev
def fbits(w, shift, mask):
    """(w >> shift) & mask as float32, for each byte of w."""
    return (ufloat(U(w >> shift) & mask), ufloat(U(w >> U(B8 + shift)) & mask),
            ufloat(U(w >> U(B16 + shift)) & mask), ufloat(U(w >> U(B24 + shift)) & mask))


@_dev
def nib4(w, k):
    return fbits(w, U(4 * k), M15)


@_dev
def i8(b):
    """The int8 in the low byte of b (which holds nothing above it) as float32."""
    return u32_bits_to_f32(U(U(b ^ U(0x80)) | MAGIC)) - F_MAGIC_I8


@_dev
def col_zero(u, k):
    return 0


@_dev
def col_half(u, k):  # 32-element blocks: low nibbles are columns 0-15, high nibbles 16-31
    return 16 * k


@_dev
def col_k2(u, k):  # Q4_K/Q5_K: unit u = 64 columns, run k = sub-block 2u + k
    return 64 * u + 32 * k


@_dev
def col_k4(u, k):  # Q2_K/Q3_K/Q6_K: unit u = (128-half u >> 1, 16 lanes u & 1), run k = 32-column group
    return 128 * (u >> 1) + 32 * k + 16 * (u & 1)


@_dev
def unit_scale(sh, bo, u, k):
    return np.float32(1.0), np.float32(0.0)


# F32 / F16 / BF16: 16-byte pseudo-blocks of 4 / 8 / 8 elements.
@_dev
def quad_f32(sh, bo, u, k, j):
    return (u32_bits_to_f32(rd32(sh, bo)), u32_bits_to_f32(rd32(sh, bo + 4)),
            u32_bits_to_f32(rd32(sh, bo + 8)), u32_bits_to_f32(rd32(sh, bo + 12)))


@_dev
def quad_f16(sh, bo, u, k, j):
    a = rd32(sh, bo + 8 * j)
    b = rd32(sh, bo + 8 * j + 4)
    return (f16_bits_to_f32(a & M16), f16_bits_to_f32(a >> B16),
            f16_bits_to_f32(b & M16), f16_bits_to_f32(b >> B16))


@_dev
def quad_bf16(sh, bo, u, k, j):
    a = rd32(sh, bo + 8 * j)
    b = rd32(sh, bo + 8 * j + 4)
    hi = U(0xFFFF0000)
    return (u32_bits_to_f32(a << B16), u32_bits_to_f32(a & hi),
            u32_bits_to_f32(b << B16), u32_bits_to_f32(b & hi))


# Q4_0 / Q4_1 / Q5_0 / Q5_1: d (f16) [m (f16)] [qh (u32)] qs[16]; run k = nibble k.
@_dev
def scale_q4_0(sh, bo, u, k):
    d = f16_at(sh, bo)
    return d, np.float32(-8.0) * d


@_dev
def quad_q4_0(sh, bo, u, k, j):
    return nib4(rd32(sh, bo + 2 + 4 * j), k)


@_dev
def scale_q4_1(sh, bo, u, k):
    return f16_at(sh, bo), f16_at(sh, bo + 2)


@_dev
def quad_q4_1(sh, bo, u, k, j):
    return nib4(rd32(sh, bo + 4 + 4 * j), k)


@_dev
def q5_quad(sh, qh_o, j, k):
    lo = nib4(rd32(sh, qh_o + 4 + 4 * j), k)
    h = rd32(sh, qh_o) >> U(16 * k + 4 * j)  # bit c of qh is the fifth bit of column c
    f = np.float32(16.0)
    return (lo[0] + f * np.float32(h & M1), lo[1] + f * np.float32((h >> B1) & M1),
            lo[2] + f * np.float32((h >> B2) & M1), lo[3] + f * np.float32((h >> U(3)) & M1))


@_dev
def scale_q5_0(sh, bo, u, k):
    d = f16_at(sh, bo)
    return d, np.float32(-16.0) * d


@_dev
def quad_q5_0(sh, bo, u, k, j):
    return q5_quad(sh, bo + 2, j, k)


@_dev
def quad_q5_1(sh, bo, u, k, j):
    return q5_quad(sh, bo + 4, j, k)


# Q8_0: d (f16) qs[32] (int8); one run of 32.
@_dev
def scale_q8_0(sh, bo, u, k):
    return f16_at(sh, bo), np.float32(0.0)


@_dev
def quad_q8_0(sh, bo, u, k, j):
    w = rd32(sh, bo + 2 + 4 * j)
    return i8(w & M255), i8((w >> B8) & M255), i8((w >> B16) & M255), i8(w >> B24)


# Q2_K: scales[16] qs[64] d dmin. Column 128n + 32s + l: (qs[32n + l] >> 2s) & 3, scale (128n + 32s + l) // 16.
@_dev
def scale_q2_k(sh, bo, u, k):
    sc = rd8(sh, bo + 8 * (u >> 1) + 2 * k + (u & 1))
    return (f16_at(sh, bo + 80) * np.float32(sc & M15),
            -f16_at(sh, bo + 82) * np.float32(sc >> B4))


@_dev
def quad_q2_k(sh, bo, u, k, j):
    return fbits(rd32(sh, bo + 16 + 32 * (u >> 1) + 16 * (u & 1) + 4 * j), U(2 * k), M3)


# Q3_K: hmask[32] qs[64] scales[12] d. Low 2 bits as Q2_K; a clear hmask bit (byte l, bit
# column // 32) subtracts 4; sixteen 6-bit scales biased by 32.
@_dev
def scale_q3_k(sh, bo, u, k):
    i = 8 * (u >> 1) + 2 * k + (u & 1)
    lo = (rd8(sh, bo + 96 + (i & 7)) >> U(4 * (i >> 3))) & M15
    hi = (rd8(sh, bo + 104 + (i & 3)) >> U(2 * (i >> 2))) & M3
    return f16_at(sh, bo + 108) * (np.float32(lo | (hi << B4)) - np.float32(32.0)), np.float32(0.0)


@_dev
def quad_q3_k(sh, bo, u, k, j):
    q = quad_q2_k(sh, bo + 16, u, k, j)  # qs sits 16 bytes later than in Q2_K
    h = fbits(rd32(sh, bo + 16 * (u & 1) + 4 * j), U(4 * (u >> 1) + k), M1)
    f = np.float32(4.0)
    return q[0] + f * h[0] - f, q[1] + f * h[1] - f, q[2] + f * h[2] - f, q[3] + f * h[3] - f


# Q4_K / Q5_K: d dmin scales[12] [qh[32]] qs[128]; eight (6-bit scale, 6-bit min) pairs.
@_dev
def scale_k(sh, bo, u, k):
    i = 2 * u + k
    s = bo + 4
    if i < 4:
        sc = rd8(sh, s + i) & M63
        mn = rd8(sh, s + i + 4) & M63
    else:
        sc = (rd8(sh, s + i + 4) & M15) | ((rd8(sh, s + i - 4) >> U(6)) << B4)
        mn = (rd8(sh, s + i + 4) >> B4) | ((rd8(sh, s + i) >> U(6)) << B4)
    return f16_at(sh, bo) * np.float32(sc), -f16_at(sh, bo + 2) * np.float32(mn)


@_dev
def quad_q4_k(sh, bo, u, k, j):
    return nib4(rd32(sh, bo + 16 + 32 * u + 4 * j), k)


@_dev
def quad_q5_k(sh, bo, u, k, j):
    q = nib4(rd32(sh, bo + 48 + 32 * u + 4 * j), k)
    h = fbits(rd32(sh, bo + 16 + 4 * j), U(2 * u + k), M1)
    f = np.float32(16.0)
    return q[0] + f * h[0], q[1] + f * h[1], q[2] + f * h[2], q[3] + f * h[3]


# Q6_K: ql[128] qh[64] scales[16] (int8) d. Column 128n + 32g + l:
# ql[64n + 32(g & 1) + l] nibble g >> 1, qh[32n + l] bits 2g, scale (128n + 32g + l) // 16.
@_dev
def scale_q6_k(sh, bo, u, k):
    ds = f16_at(sh, bo + 208) * i8(rd8(sh, bo + 192 + 8 * (u >> 1) + 2 * k + (u & 1)))
    return ds, np.float32(-32.0) * ds


@_dev
def quad_q6_k(sh, bo, u, k, j):
    n = u >> 1
    l0 = 16 * (u & 1) + 4 * j
    q = nib4(rd32(sh, bo + 64 * n + 32 * (k & 1) + l0), k >> 1)
    h = fbits(rd32(sh, bo + 128 + 32 * n + l0), U(2 * k), M3)
    f = np.float32(16.0)
    return q[0] + f * h[0], q[1] + f * h[1], q[2] + f * h[2], q[3] + f * h[3]


# tile_blocks: blocks a warp stages per step: a multiple of 16 bytes, about 2 KiB, and a
# whole number of 32-unit rounds where the layout allows.
DEVICE_SPECS: dict = {
    T.F32: DeviceSpec(4, 16, 1, 1, 4, 128, col_zero, unit_scale, quad_f32),
    T.F16: DeviceSpec(8, 16, 1, 1, 8, 128, col_zero, unit_scale, quad_f16),
    T.BF16: DeviceSpec(8, 16, 1, 1, 8, 128, col_zero, unit_scale, quad_bf16),
    T.Q4_0: DeviceSpec(32, 18, 1, 2, 16, 128, col_half, scale_q4_0, quad_q4_0),
    T.Q4_1: DeviceSpec(32, 20, 1, 2, 16, 96, col_half, scale_q4_1, quad_q4_1),
    T.Q5_0: DeviceSpec(32, 22, 1, 2, 16, 96, col_half, scale_q5_0, quad_q5_0),
    T.Q5_1: DeviceSpec(32, 24, 1, 2, 16, 96, col_half, scale_q4_1, quad_q5_1),
    T.Q8_0: DeviceSpec(32, 34, 1, 1, 32, 64, col_zero, scale_q8_0, quad_q8_0),
    T.Q2_K: DeviceSpec(256, 84, 4, 4, 16, 24, col_k4, scale_q2_k, quad_q2_k),
    T.Q3_K: DeviceSpec(256, 110, 4, 4, 16, 16, col_k4, scale_q3_k, quad_q3_k),
    T.Q4_K: DeviceSpec(256, 144, 4, 2, 32, 16, col_k2, scale_k, quad_q4_k),
    T.Q5_K: DeviceSpec(256, 176, 4, 2, 32, 16, col_k2, scale_k, quad_q5_k),
    T.Q6_K: DeviceSpec(256, 210, 4, 4, 16, 8, col_k4, scale_q6_k, quad_q6_k),
}
for _q, _s in DEVICE_SPECS.items():
    assert _s.upb * _s.runs * _s.rl == _s.qk and _s.tile_blocks * _s.bs % 16 == 0, _q
    assert _s.qk % block_elems(_q) == 0 and _s.bs * block_elems(_q) == _s.qk * block_bytes(_q), _q


def tile_step(qtype) -> int:
    """Smallest number of blocks whose bytes are a multiple of 16 (tiles are multiples of it)."""
    bs = DEVICE_SPECS[as_qtype(qtype)].bs
    return 16 // np.gcd(bs, 16)


def load_width(row_nbytes: int, w=None) -> int:
    """Widest load (16, 4 or 2 bytes) that keeps every row start aligned; with the device
    array w, also its start (a tensor viewed inside a larger buffer may be misaligned)."""
    if w is not None and not SIM:
        row_nbytes = int(np.gcd(row_nbytes, w.__cuda_array_interface__["data"][0] % 16 or 16))
    return 16 if row_nbytes % 16 == 0 else 4 if row_nbytes % 4 == 0 else 2


def make_stage(vw: int, tile_bytes: int, rows: int = 1):
    """Device function stage(w, h0, nbytes, sh, s0, sw, lane) copying `nbytes` from each of
    `rows` places of the uint16 array w (starting at elements h0[0..rows-1]) into the uint32
    words sh[s0 + r * sw:]. Each lane issues all its loads before storing any, so that
    several 16-byte loads per lane are in flight."""
    nvec = -(-tile_bytes // 16)
    per_lane = -(-nvec // 32)
    regs16 = (rows * per_lane, 4)  # local array shapes must be compile-time constants
    regs4 = rows * 4 * per_lane
    words4 = 4 * per_lane

    if vw == 16:
        @_dev
        def stage(w, h0, nbytes, sh, s0, sw, lane):
            regs = cuda.local.array(regs16, np.uint32)
            nv = nbytes >> 4
            for r in range(rows):
                for i in range(per_lane):
                    v = lane + 32 * i
                    if v < nv:
                        a, b, c, d = ldg_u16_u32x4(w, h0[r] + 8 * v)
                        regs[r * per_lane + i, 0] = a
                        regs[r * per_lane + i, 1] = b
                        regs[r * per_lane + i, 2] = c
                        regs[r * per_lane + i, 3] = d
            for r in range(rows):
                for i in range(per_lane):
                    v = lane + 32 * i
                    if v < nv:
                        for e in range(4):
                            sh[s0 + r * sw + 4 * v + e] = regs[r * per_lane + i, e]
    elif vw == 4:
        @_dev
        def stage(w, h0, nbytes, sh, s0, sw, lane):
            regs = cuda.local.array(regs4, np.uint32)
            nw = nbytes >> 2
            for r in range(rows):
                for i in range(words4):
                    v = lane + 32 * i
                    if v < nw:
                        regs[r * words4 + i] = ldg_u16_u32(w, h0[r] + 2 * v)
            for r in range(rows):
                for i in range(words4):
                    v = lane + 32 * i
                    if v < nw:
                        sh[s0 + r * sw + v] = regs[r * words4 + i]
    else:
        @_dev
        def stage(w, h0, nbytes, sh, s0, sw, lane):
            nh = nbytes >> 1
            for r in range(rows):
                for v in range(lane, (nh + 1) >> 1, 32):
                    hi = np.uint32(w[h0[r] + 2 * v + 1]) if 2 * v + 1 < nh else np.uint32(0)
                    sh[s0 + r * sw + v] = np.uint32(w[h0[r] + 2 * v]) | (hi << np.uint32(16))
    return stage


if SIM:
    # The simulator has no syncwarp; every warp of a block runs the same loop, so a block
    # barrier is reached by all threads.
    @_dev
    def warp_barrier():
        cuda.syncthreads()
else:
    @_dev
    def warp_barrier():
        cuda.syncwarp()

DEQ_WARPS = 4


def _dequant_kernel(qtype, vw: int, tile_blocks: int):
    spec = DEVICE_SPECS[qtype]
    QK, BS, UPB, RUNS, NQ = spec.qk, spec.bs, spec.upb, spec.runs, spec.rl // 4
    TB = tile_blocks
    SW = TB * BS // 4 + 4  # words per warp, padded for rd32 at a tile's last bytes
    col, scale, quad = spec.col, spec.scale, spec.quad
    stage = make_stage(vw, TB * BS)
    NW = DEQ_WARPS
    SH = NW * SW

    @cuda.jit
    def kernel(w, out, n_rows, row_h, blocks_row, tiles_row):
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        sh = cuda.shared.array(SH, np.uint32)
        lane = cuda.threadIdx.x & 31
        wid = cuda.threadIdx.x >> 5
        g = cuda.blockIdx.x * NW + wid
        active = g < n_rows * tiles_row
        if not active:
            g = 0  # still reaches the barrier (the simulator's is block-wide)
        row = g // tiles_row
        t0 = (g - row * tiles_row) * TB
        nb = min(TB, blocks_row - t0)
        s0 = wid * SW
        h0 = cuda.local.array(1, np.int64)
        h0[0] = row * row_h + t0 * (BS // 2)
        stage(w, h0, nb * BS, sh, s0, SW, lane)
        warp_barrier()
        if active:
            n_cols = blocks_row * QK
            for ub in range(lane, nb * UPB, 32):
                b = ub // UPB
                u = ub - b * UPB
                bo = 4 * s0 + b * BS
                c0 = row * n_cols + (t0 + b) * QK
                for k in range(RUNS):
                    s, o = scale(sh, bo, u, k)
                    c = c0 + col(u, k)
                    for j in range(NQ):
                        q = quad(sh, bo, u, k, j)
                        for i in range(4):
                            out[c + 4 * j + i] = s * q[i] + o
    return pdl_ready(kernel)


_DEQ_CACHE: dict = {}


def as_device(a):
    """A numba device array for a: numpy arrays are copied in the simulator only; torch,
    cupy, ... arrays are wrapped through __cuda_array_interface__."""
    if SIM:
        return cuda.to_device(a) if isinstance(a, np.ndarray) else a
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    if not isinstance(a, DeviceNDArray) and cuda.is_cuda_array(a):
        return cuda.as_cuda_array(a)
    return a


def weight_u16(w_dev, qtype, n_cols: int):
    """The raw (rows, row_bytes) uint8 device weight as a flat uint16 array, and its rows."""
    w_dev = as_device(w_dev)
    rb = row_bytes(qtype, n_cols)
    shape = tuple(w_dev.shape)
    if w_dev.dtype != np.uint8 or w_dev.size % rb or (len(shape) == 2 and shape[1] != rb):
        raise ValueError(f"weight: expected uint8 rows of {rb} bytes for {as_qtype(qtype).name} x {n_cols}, "
                         f"got {w_dev.dtype} {shape}")
    if not SIM and w_dev.__cuda_array_interface__["data"][0] % 2:
        raise ValueError("weight: device pointer must be 2-byte aligned (GGUF blocks are read as uint16)")
    return w_dev.reshape(w_dev.size).view(np.uint16), w_dev.size // rb


def dequantize_device(w_dev, qtype, shape, out=None, dtype=np.float32, stream=0, tile_blocks=None):
    """Dequantize raw GGUF bytes on the device into `out` (a new device array of `shape` if
    None; float32 or float16)."""
    qtype = as_qtype(qtype)
    spec = DEVICE_SPECS[qtype]
    shape = tuple(int(s) for s in shape)
    n_cols = shape[-1]
    if n_cols % spec.qk:
        raise ValueError(f"{qtype.name}: {n_cols} columns is not a multiple of {spec.qk} on the device")
    w, n_rows = weight_u16(w_dev, qtype, n_cols)
    if n_rows * n_cols != int(np.prod(shape)):
        raise ValueError(f"dequantize_device: {n_rows} rows of {n_cols} do not make {shape}")
    if out is None:
        out = cuda.device_array(shape, dtype=dtype, stream=stream)
    out = as_device(out)
    if out.size != n_rows * n_cols or out.dtype not in (np.float32, np.float16):
        raise ValueError(f"dequantize_device: out must be float32/float16 with {n_rows * n_cols} elements")
    tb = tile_blocks or spec.tile_blocks
    if tb % tile_step(qtype):
        raise ValueError(f"tile_blocks must be a multiple of {tile_step(qtype)} for {qtype.name}")
    vw = load_width(row_bytes(qtype, n_cols), w)
    key = (qtype, vw, tb)
    if key not in _DEQ_CACHE:
        _DEQ_CACHE[key] = _dequant_kernel(qtype, vw, tb)
    blocks_row = n_cols // spec.qk
    tiles_row = -(-blocks_row // tb)
    n_warps = n_rows * tiles_row
    grid = -(-n_warps // DEQ_WARPS)
    _DEQ_CACHE[key][grid, 32 * DEQ_WARPS, stream](
        w, out.reshape(out.size), n_rows, row_bytes(qtype, n_cols) // 2, blocks_row, tiles_row)
    return out
