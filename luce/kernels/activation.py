"""Gated activations and softmax."""
from __future__ import annotations

import numpy as np


def silu_ref(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return silu_ref(gate) * up


def gelu_tanh_ref(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def geglu_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gelu_tanh_ref(gate) * up


def softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)
