"""out = a x + b y over device arrays: the residual add after a post-norm (Gemma's
attention and FFN outputs are normed before they join the residual stream) and the
embedding scale (a = sqrt(n_embd), b = 0)."""
from __future__ import annotations

import numpy as np
from numba import cuda

from ._reduce import block_threads, ceil_div
from .pdl import grid_dependency_sync, ready as pdl_ready


def axpby_ref(x: np.ndarray, y: np.ndarray, a: float, b: float) -> np.ndarray:
    return (np.float32(a) * np.asarray(x, np.float32) + np.float32(b) * np.asarray(y, np.float32)).astype(np.float32)


@pdl_ready
@cuda.jit
def _axpby_kernel(x, y, a, b, out):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    i = cuda.grid(1)
    if i < out.size:
        v = a * x[i]
        if b != 0:  # y may be x itself or anything when b == 0
            v += b * y[i]
        out[i] = v


def axpby_cuda(x, y, a: float, b: float, out=None, stream=0):
    """a x + b y elementwise (float32 device arrays of one size; y ignored when b == 0;
    out may be x or y itself). Returns out, shaped like x."""
    if out is None:
        out = cuda.device_array(x.shape, np.float32, stream=stream)
    n = x.size
    if y.size != n or out.size != n:
        raise ValueError(f"axpby: sizes {x.size}, {y.size}, {out.size} differ")
    nt = block_threads(256)
    _axpby_kernel[max(1, ceil_div(n, nt)), nt, stream](x.reshape(n), y.reshape(n), np.float32(a), np.float32(b),
                                                       out.reshape(n))
    return out
