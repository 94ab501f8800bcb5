"""RMSNorm. The numpy reference is what the CPU backend runs."""
from __future__ import annotations

import numpy as np


def rms_norm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Normalize over the last axis (a head for q/k norm, the hidden state otherwise)."""
    x = x.astype(np.float32, copy=False)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)) * weight
