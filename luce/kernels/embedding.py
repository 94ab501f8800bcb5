"""Embedding gather."""
from __future__ import annotations

import numpy as np


def embed_ref(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return table[np.asarray(tokens, dtype=np.int64)].astype(np.float32, copy=False)


# ------------------------------------------------------------------------------ CUDA
# Tables of float32 or float16 rows are gathered directly; a quantized table stays raw
# GGUF bytes on the device: the tokens' rows are gathered as bytes and decoded by
# luce.kernels.dequant.dequantize_device (the same decoders as the matvec kernels).
from numba import cuda  # noqa: E402

from ._reduce import block_threads, stride_grid  # noqa: E402
from .pdl import grid_dependency_sync, ready as pdl_ready  # noqa: E402


@pdl_ready
@cuda.jit
def _embed_kernel(table, tokens, out):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
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


@pdl_ready
@cuda.jit
def _gather_rows_u16_kernel(raw, tokens, out):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    # raw [V, row_bytes/2], out [N, row_bytes/2]: every GGUF block size is even
    n_tok, words = out.shape
    for i in range(cuda.grid(1), n_tok * words, cuda.gridsize(1)):
        n = i // words
        w = i - n * words
        out[n, w] = raw[tokens[n], w]


def embed_quant_cuda(table_raw, qtype, n_cols: int, tokens, out=None, rows=None, stream=0):
    """Rows of a quantized GGUF table (device uint8 [V, row_bytes]) for device int32
    tokens [N], dequantized -> f32 [N, n_cols]; only the N rows are read and decoded."""
    from .dequant import dequantize_device, row_bytes

    rb = row_bytes(qtype, n_cols)
    n = tokens.shape[0]
    v = table_raw.size // rb
    if rows is None:  # scratch for the gathered raw rows (pass one to keep a graph's addresses fixed)
        rows = cuda.device_array((n, rb), dtype=np.uint8, stream=stream)
    src = table_raw.reshape(v, rb).view(np.uint16)
    dst = rows.view(np.uint16)
    nt = block_threads(256)
    _gather_rows_u16_kernel[stride_grid(n * rb // 2, nt), nt, stream](src, tokens, dst)
    if out is None:
        out = cuda.device_array((n, n_cols), dtype=np.float32, stream=stream)
    return dequantize_device(rows, qtype, (n, n_cols), out=out, stream=stream)
