"""Rotary position embedding in both rotation styles, positions given per token."""
from __future__ import annotations

import numpy as np

from ..models.config import ROPE_ADJACENT, ROPE_HALVES


def rope_angles(positions: np.ndarray, rope_dim: int, base: float, freq_scale: float = 1.0
                ) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = inv_freqs(rope_dim, base, freq_scale)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def inv_freqs(rope_dim: int, base: float, freq_scale: float = 1.0) -> np.ndarray:
    """float64 base^(-2i/rope_dim) for i < rope_dim / 2, times freq_scale: linear RoPE scaling
    (1 / the GGUF's rope.scaling.factor) turns position p into p * freq_scale."""
    inv = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    return inv * freq_scale if freq_scale != 1.0 else inv


def rope_ref(x: np.ndarray, positions: np.ndarray, rope_dim: int, base: float, style: str,
             freq_scale: float = 1.0) -> np.ndarray:
    """x: [N, heads, head_dim]; rotates the first rope_dim dims of every head."""
    cos, sin = rope_angles(positions, rope_dim, base, freq_scale)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.astype(np.float32, copy=True)
    if style == ROPE_ADJACENT:
        a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = a * cos - b * sin
        out[..., 1:rope_dim:2] = a * sin + b * cos
    elif style == ROPE_HALVES:
        half = rope_dim // 2
        a, b = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = a * cos - b * sin
        out[..., half:rope_dim] = a * sin + b * cos
    else:
        raise ValueError(f"unknown rope style {style!r}")
    return out


# ------------------------------------------------------------------------------ CUDA
import math  # noqa: E402

from numba import cuda  # noqa: E402

from ._reduce import block_threads, ceil_div  # noqa: E402
from .device import SIM, device  # noqa: E402
from .pdl import grid_dependency_sync, ready as pdl_ready  # noqa: E402

_STYLE_ID = {ROPE_ADJACENT: 0, ROPE_HALVES: 1}
_INV_PI = 1.0 / math.pi  # a multiply: a float64 divide is a Newton iteration of DFMAs
_INV_FREQ: dict = {}  # (rope_dim, base) -> device inv_freq table

if SIM:
    def _sincospi(t):
        return np.float32(math.sin(math.pi * t)), np.float32(math.cos(math.pi * t))
else:
    from numba.cuda import libdevice

    @device(inline=True)
    def _sincospi(t):
        return libdevice.sincospif(t)


@device(inline=True)
def rotate(a, b, pos, inv_freq):
    """(a, b) rotated by pos * inv_freq: the product, in units of pi, and its reduction to
    [-1, 1] in float64, then sin(pi t) and cos(pi t) in float32. Why sincospif: sinf/cosf
    carry a slow path for huge arguments whose scratch is local memory (28 bytes in every
    kernel that rotates; in the decode attention kernel, 32 bytes of spills and 128 -> 168
    registers), where sinpi's reduction is exact and needs none; the accuracy is the same
    (float32 t: ~2e-7 rad, as a float32 angle on [-pi, pi])."""
    s, c = sincos_at(pos, inv_freq)
    return a * c - b * s, a * s + b * c


@device(inline=True)
def sincos_at(pos, inv_freq):
    """sin and cos of the angle pos * inv_freq, as rotate takes them."""
    t = float(pos) * inv_freq * _INV_PI
    t -= 2.0 * math.floor(t * 0.5 + 0.5)
    return _sincospi(np.float32(t))


def inv_freq_table(rope_dim: int, base: float, freq_scale: float = 1.0):
    """inv_freqs on the device, made once per (shape, base, scale)."""
    key = (rope_dim, float(base), float(freq_scale))
    t = _INV_FREQ.get(key)
    if t is None:
        t = _INV_FREQ[key] = cuda.to_device(inv_freqs(rope_dim, base, freq_scale))
    return t


@pdl_ready
@cuda.jit
def _rope_kernel(x, pos, inv_freq, rope_dim, style):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # One thread per rotated pair; the angle as in qk_rope.rotate (float64 product and range
    # reduction: at 8K+ positions a float32 product is off by ~1e-3 rad; float32 sin/cos).
    i = cuda.grid(1)
    n_tok, n_heads, _ = x.shape
    half = rope_dim // 2
    if i >= n_tok * n_heads * half:
        return
    k = i % half
    nh = i // half
    h = nh % n_heads
    n = nh // n_heads
    if style == 0:
        ia = 2 * k
        ib = ia + 1
    else:
        ia = k
        ib = k + half
    x[n, h, ia], x[n, h, ib] = rotate(x[n, h, ia], x[n, h, ib], pos[n], inv_freq[k])


def rope_cuda(x, positions, rope_dim: int, base: float, style: str, stream=0, freq_scale: float = 1.0):
    """Rotate device array x [N, H, D] (float32) in place; positions: device int32 [N]."""
    n_tok, n_heads, _ = x.shape
    total = n_tok * n_heads * (rope_dim // 2)
    nt = block_threads(256)
    _rope_kernel[ceil_div(total, nt), nt, stream](x, positions, inv_freq_table(rope_dim, base, freq_scale),
                                                  rope_dim, _STYLE_ID[style])
    return x
