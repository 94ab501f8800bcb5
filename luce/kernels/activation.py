"""Gated activations and softmax."""
from __future__ import annotations

import numpy as np


def silu_ref(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x) written with tanh: no exp overflow for large negative x
    return 0.5 * x * (1.0 + np.tanh(0.5 * x))


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


# ------------------------------------------------------------------------------ CUDA
import math  # noqa: E402

from numba import cuda  # noqa: E402

from ._reduce import MAX_THREADS, block_max, block_sum, block_threads, ceil_div  # noqa: E402
from .device import device  # noqa: E402
from .pdl import grid_dependency_sync, ready as pdl_ready  # noqa: E402

GLU_SWIGLU = 0
GLU_GEGLU = 1
_GLU_ID = {"swiglu": GLU_SWIGLU, "geglu": GLU_GEGLU}


@device
def gelu_tanh(g):
    """GELU, tanh approximation (Gemma's GeGLU), in float32."""
    return np.float32(0.5) * g * (np.float32(1.0) + math.tanh(np.float32(0.7978845608028654) *
                                                             (g + np.float32(0.044715) * g * g * g)))


@pdl_ready
@cuda.jit
def _glu_kernel(gate, up, out, kind):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    i = cuda.grid(1)
    if i >= out.size:
        return
    g = np.float32(gate[i])
    if kind == 0:
        a = g / (np.float32(1.0) + math.exp(-g))
    else:
        a = gelu_tanh(g)
    out[i] = a * np.float32(up[i])


def glu_cuda(gate, up, kind: str = "swiglu", out=None, stream=0):
    """act(gate) * up elementwise on device arrays of any (equal) shape; kind: swiglu|geglu."""
    if out is None:
        out = cuda.device_array(gate.shape, dtype=np.float32, stream=stream)
    n = gate.size
    nt = block_threads(256)
    _glu_kernel[ceil_div(n, nt), nt, stream](gate.reshape(n), up.reshape(n), out.reshape(n), _GLU_ID[kind])
    return out


def swiglu_cuda(gate, up, out=None, stream=0):
    return glu_cuda(gate, up, "swiglu", out, stream)


def geglu_cuda(gate, up, out=None, stream=0):
    return glu_cuda(gate, up, "geglu", out, stream)


@pdl_ready
@cuda.jit
def _softmax_kernel(x, out):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    row = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = x.shape[1]
    buf = cuda.shared.array(MAX_THREADS, np.float32)
    m = -math.inf
    for j in range(t, n, nt):
        m = max(m, np.float32(x[row, j]))
    m = block_max(np.float32(m), buf)
    s = np.float32(0.0)
    for j in range(t, n, nt):
        e = math.exp(np.float32(x[row, j]) - m)
        out[row, j] = e
        s += e
    s = block_sum(s, buf)
    inv = np.float32(1.0) / s
    for j in range(t, n, nt):
        out[row, j] *= inv


def softmax_cuda(x, out=None, stream=0):
    """Softmax over the last axis of a device array (rows of any length); out may be x."""
    n = x.shape[len(x.shape) - 1]
    rows = x.size // n
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    _softmax_kernel[rows, block_threads(256), stream](x.reshape(rows, n), out.reshape(rows, n))
    return out
