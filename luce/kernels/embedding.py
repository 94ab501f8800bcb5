"""Embedding gather."""
from __future__ import annotations

import numpy as np


def embed_ref(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return table[np.asarray(tokens, dtype=np.int64)].astype(np.float32, copy=False)


# ------------------------------------------------------------------------------ CUDA
# Tables of float32 or float16 rows (a GGUF F16 token_embd is used as is). Quantized
# tables are dequantized at load for now: luce.kernels.dequant exposes no per-block
# device functions yet to decode a single gathered row with.
from numba import cuda  # noqa: E402

from ._reduce import block_threads  # noqa: E402


@cuda.jit
def _embed_kernel(table, tokens, out):
    # grid (N, ceil(D / threads)): one token per blockIdx.x, coalesced over the row
    n = cuda.blockIdx.x
    d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if d < out.shape[1]:
        out[n, d] = np.float32(table[tokens[n], d])


def embed_cuda(table, tokens, out=None, stream=0):
    """Gather rows of device table [V, D] (f32/f16) for device int32 tokens [N] -> f32 [N, D]."""
    n = tokens.shape[0]
    d = table.shape[1]
    if out is None:
        out = cuda.device_array((n, d), dtype=np.float32, stream=stream)
    nt = block_threads(256)
    _embed_kernel[(n, -(-d // nt)), nt, stream](table, tokens, out)
    return out
