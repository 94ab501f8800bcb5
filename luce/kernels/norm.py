"""RMSNorm. The numpy reference is what the CPU backend runs."""
from __future__ import annotations

import numpy as np


def rms_norm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Normalize over the last axis (a head for q/k norm, the hidden state otherwise)."""
    x = x.astype(np.float32, copy=False)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)) * weight


# ------------------------------------------------------------------------------ CUDA
import math  # noqa: E402

import numpy as _np  # noqa: E402
from numba import cuda  # noqa: E402

from ._reduce import MAX_THREADS, block_sum, block_threads  # noqa: E402


@cuda.jit
def _rms_norm_kernel(x, res, w, out, sum_out, eps, has_res):
    # One block per row; a row is a hidden state or one head (q/k norm), so D is 64..8192.
    row = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    d_model = x.shape[1]
    buf = cuda.shared.array(MAX_THREADS, _np.float32)
    ss = _np.float32(0.0)
    for d in range(t, d_model, nt):
        v = _np.float32(x[row, d])
        if has_res:
            v += _np.float32(res[row, d])
            sum_out[row, d] = v
        ss += v * v
    tot = block_sum(ss, buf)
    inv = _np.float32(1.0) / math.sqrt(tot / _np.float32(d_model) + eps)  # float32: tot / int is a float64 divide
    for d in range(t, d_model, nt):
        # Re-read what this thread itself wrote: sum_out may alias x (residual in place).
        v = _np.float32(sum_out[row, d]) if has_res else _np.float32(x[row, d])
        out[row, d] = v * inv * w[d]


def rms_norm_cuda(x, weight, eps: float, out=None, residual=None, residual_out=None, stream=0):
    """RMSNorm of device array x ([N, D] or [N, H, D]: every last-axis row separately).

    With `residual`, normalizes s = x + residual and also stores s in `residual_out`
    (default: x itself, the usual in-place residual stream). Returns `out`.
    """
    d_model = x.shape[len(x.shape) - 1]  # the simulator's shape tuple rejects -1
    rows = x.size // d_model
    if out is None:
        out = cuda.device_array(x.shape, dtype=_np.float32, stream=stream)
    x2 = x.reshape(rows, d_model)
    o2 = out.reshape(rows, d_model)
    if residual is not None:
        r2 = residual.reshape(rows, d_model)
        s2 = (x if residual_out is None else residual_out).reshape(rows, d_model)
        has = 1
    else:
        r2 = s2 = x2  # never touched: has_res=0 (numba cannot type a None array here)
        has = 0
    # Up to a thread per element: each thread's loads run one after another (a loop of
    # 16 dependent trips at 256 threads for a 4096-wide row), so a one-row norm is all
    # latency; H200, Qwen3-8B decode at 256 threads: 4.3 us a call, 145 calls a token.
    nt = block_threads(min(MAX_THREADS, max(32, 1 << (d_model - 1).bit_length())))
    _rms_norm_kernel[rows, nt, stream](x2, r2, weight, o2, s2, _np.float32(eps), has)
    return out
