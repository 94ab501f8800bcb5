"""Dequantization of GGUF tensors: numpy references and CUDA kernels.

The numpy functions decode all blocks of a chunk at once with broadcasting; the CUDA
kernels (below) decode one block per thread group with the per-type device functions of
luce.kernels.matvec, so the two stay independent implementations of the same layouts.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .quant_types import SUPPORTED_TYPES, as_qtype, block_bytes, block_elems, row_bytes

__all__ = ["SUPPORTED_TYPES", "dequantize", "row_bytes"]

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
