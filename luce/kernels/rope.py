"""Rotary position embedding in both rotation styles, positions given per token."""
from __future__ import annotations

import numpy as np

from ..models.config import ROPE_ADJACENT, ROPE_HALVES


def rope_angles(positions: np.ndarray, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_ref(x: np.ndarray, positions: np.ndarray, rope_dim: int, base: float, style: str) -> np.ndarray:
    """x: [N, heads, head_dim]; rotates the first rope_dim dims of every head."""
    cos, sin = rope_angles(positions, rope_dim, base)
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
