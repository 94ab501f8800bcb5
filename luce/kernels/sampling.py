"""Sampling on the device: argmax, logit penalties, top-k (the draft's candidates in
speculative decoding). Numpy references first, the CUDA kernels below.

Order of candidates everywhere: larger logit first, equal logits by smaller token id
(what a stable descending sort and np.argmax give). NaN logits are never selected.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .device import device
from ._reduce import BIG_INDEX, MAX_THREADS, block_argmax, block_threads, ceil_div
from .pdl import grid_dependency_sync, ready as pdl_ready

MAX_TOP_K = 64


# ------------------------------------------------------------------------------ numpy

def token_counts(history, vocab: int, repeat_last_n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(counts over the whole history, counts over the last repeat_last_n tokens; all
    of it when repeat_last_n <= 0) as int32 [vocab]: the inputs of the penalty kernel,
    with the semantics of luce.engine.sampling.apply_penalties."""
    hist = np.asarray(history, dtype=np.int64)
    counts = np.bincount(hist, minlength=vocab).astype(np.int32)
    recent_hist = hist[-repeat_last_n:] if repeat_last_n > 0 else hist
    recent = np.bincount(recent_hist, minlength=vocab).astype(np.int32)
    return counts, recent


def apply_penalties_ref(logits: np.ndarray, counts: np.ndarray, recent: np.ndarray, repeat_penalty: float = 1.0,
                        presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> np.ndarray:
    """logits [..., V]; counts, recent int [V] shared by every row."""
    out = np.asarray(logits, dtype=np.float32).copy()
    rep = recent > 0
    out = np.where(rep, np.where(out > 0, out / np.float32(repeat_penalty), out * np.float32(repeat_penalty)), out)
    seen = counts > 0
    pen = np.float32(frequency_penalty) * counts.astype(np.float32) + np.float32(presence_penalty)
    return np.where(seen, out - pen, out).astype(np.float32)


def argmax_ref(logits: np.ndarray) -> np.ndarray:
    """Row-wise argmax of [R, V] -> int32 [R]."""
    x = np.where(np.isnan(logits), -np.inf, logits)
    return np.argmax(x, axis=-1).astype(np.int32)


def topk_ref(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top-k of [R, V] -> (values f32 [R, k], token ids int32 [R, k]), best first."""
    x = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)
    idx = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(x, idx, axis=-1), idx.astype(np.int32)


# ------------------------------------------------------------------------------ CUDA

@device
def _better(v, i, bv, bi):
    return v > bv or (v == bv and i < bi)


@pdl_ready
@cuda.jit
def _argmax_kernel(logits, out):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    row = cuda.blockIdx.x
    t = cuda.threadIdx.x
    vbuf = cuda.shared.array(MAX_THREADS, np.float32)
    ibuf = cuda.shared.array(MAX_THREADS, np.int32)
    bv = np.float32(-math.inf)
    bi = np.int32(BIG_INDEX)
    for j in range(t, logits.shape[1], cuda.blockDim.x):
        v = np.float32(logits[row, j])
        if _better(v, j, bv, bi):
            bv = v
            bi = np.int32(j)
    bv, bi = block_argmax(bv, bi, vbuf, ibuf)
    if t == 0:
        out[row] = bi


def argmax_cuda(logits, out=None, stream=0):
    """Row-wise argmax of device [R, V] (f32/f16) -> device int32 [R]."""
    rows = logits.shape[0]
    if out is None:
        out = cuda.device_array(rows, dtype=np.int32, stream=stream)
    _argmax_kernel[rows, block_threads(1024), stream](logits, out)
    return out


@pdl_ready
@cuda.jit
def _penalty_kernel(logits, counts, recent, rep, presence, frequency):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    i = cuda.grid(1)
    v_size = logits.shape[1]
    if i >= logits.shape[0] * v_size:
        return
    row = i // v_size
    j = i - row * v_size
    x = logits[row, j]
    if recent[j] > 0:
        x = x / rep if x > 0 else x * rep
    c = counts[j]
    if c > 0:
        x -= frequency * np.float32(c) + presence
    logits[row, j] = x


def apply_penalties_cuda(logits, counts, recent, repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
                         frequency_penalty: float = 0.0, stream=0):
    """In place on device f32 logits [R, V]; counts, recent: device int32 [V] (token_counts)."""
    n = logits.shape[0] * logits.shape[1]
    nt = block_threads(256)
    _penalty_kernel[ceil_div(n, nt), nt, stream](logits, counts, recent, np.float32(repeat_penalty),
                                                 np.float32(presence_penalty), np.float32(frequency_penalty))
    return logits


@pdl_ready
@cuda.jit
def _topk_kernel(vals, ids, use_ids, k, chunk, out_v, out_i):
    """Top-k of each `chunk` of a row into out[row, chunk_id, :k].

    k rounds of a block argmax; round r takes the best element strictly after round r-1's
    winner in the candidate order, so nothing is marked and the input stays read-only.
    Phase 1 runs it over logits (ids = positions), phase 2 over phase 1's candidates.
    """
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    c = cuda.blockIdx.x
    row = cuda.blockIdx.y
    t = cuda.threadIdx.x
    vbuf = cuda.shared.array(MAX_THREADS, np.float32)
    ibuf = cuda.shared.array(MAX_THREADS, np.int32)
    lo = c * chunk
    hi = min(lo + chunk, vals.shape[1])
    pv = np.float32(math.inf)
    pi = np.int32(-1)
    for r in range(k):
        bv = np.float32(-math.inf)
        bi = np.int32(BIG_INDEX)
        for j in range(lo + t, hi, cuda.blockDim.x):
            v = np.float32(vals[row, j])
            i = ids[row, j] if use_ids else np.int32(j)
            if i >= 0 and _better(pv, pi, v, i) and _better(v, i, bv, bi):
                bv = v
                bi = i
        bv, bi = block_argmax(bv, bi, vbuf, ibuf)
        if t == 0:
            out_v[row, c * k + r] = bv
            out_i[row, c * k + r] = bi if bi != BIG_INDEX else -1
        pv = bv
        pi = bi


def _topk_chunks(v_size: int, k: int) -> tuple[int, int]:
    nt = block_threads(256)
    # Chunks of >= 16 elements a thread keep phase 1's rounds busy; <= 4096 candidates
    # keep phase 2 (one block a row) short.
    n_chunks = max(1, min(ceil_div(v_size, 16 * nt), 4096 // k))
    chunk = ceil_div(v_size, n_chunks)
    return ceil_div(v_size, chunk), chunk


def topk_scratch_shape(rows: int, v_size: int, k: int) -> tuple[int, int]:
    """Shape of the two candidate buffers (f32, int32) topk_cuda needs: pass them as
    `scratch` to keep allocations out of a captured graph."""
    return rows, _topk_chunks(v_size, k)[0] * k


def topk_cuda(logits, k: int, out_values=None, out_ids=None, scratch=None, stream=0):
    """Row-wise top-k (k <= 64) of device logits [R, V] -> (f32 [R, k], int32 [R, k]),
    best first; slots beyond the number of non-NaN logits hold (-inf, -1)."""
    if not 1 <= k <= MAX_TOP_K:
        raise ValueError(f"top-k needs 1 <= k <= {MAX_TOP_K}, got {k}")
    rows, v_size = logits.shape
    nt = block_threads(256)
    n_chunks, chunk = _topk_chunks(v_size, k)
    if out_values is None:
        out_values = cuda.device_array((rows, k), dtype=np.float32, stream=stream)
    if out_ids is None:
        out_ids = cuda.device_array((rows, k), dtype=np.int32, stream=stream)
    if n_chunks == 1:
        _topk_kernel[(1, rows), nt, stream](logits, out_ids, 0, k, chunk, out_values, out_ids)
        return out_values, out_ids
    if scratch is None:
        scratch = (cuda.device_array((rows, n_chunks * k), dtype=np.float32, stream=stream),
                   cuda.device_array((rows, n_chunks * k), dtype=np.int32, stream=stream))
    cand_v, cand_i = scratch
    _topk_kernel[(n_chunks, rows), nt, stream](logits, cand_i, 0, k, chunk, cand_v, cand_i)
    _topk_kernel[(1, rows), nt, stream](cand_v, cand_i, 1, k, n_chunks * k, out_values, out_ids)
    return out_values, out_ids
