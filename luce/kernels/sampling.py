"""Sampling on the device: argmax, logit penalties, top-k (the draft's candidates in
speculative decoding), and a sampled token drawn whole (sample_cuda: top-k, top-p, min-p,
penalties and the draw with the host generator's uniform, inside the decode graph). Numpy
references first, the CUDA kernels below.

Order of candidates everywhere: larger logit first, equal logits by smaller token id
(what a stable descending sort and np.argmax give). NaN logits are never selected.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from .device import device
from ._reduce import BIG_INDEX, MAX_THREADS, block_argmax, block_threads, ceil_div, smem_sum
from .pdl import grid_dependency_sync, ready as pdl_ready
from .split_merge import arrive
from .vector_load import f32_to_u32_bits, u32_bits_to_f32

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


def logsumexp_ref(logits: np.ndarray) -> np.ndarray:
    """Row-wise log(sum(exp(x))) of [R, V] logits (float64 [R]): the normalizer of a
    log-softmax, as luce.engine.sampling.top_logprobs takes it (float32 exp of x - max,
    summed in float64)."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=1, keepdims=True)
    return m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=1, dtype=np.float64))


# ------------------------------------------------------------------------------ CUDA

@device
def _better(v, i, bv, bi):
    return v > bv or (v == bv and i < bi)


# The argmax of a row is split over blocks of ARGMAX_CHUNK logits: one block walking a
# whole 151,936-logit row took 43.1 us on the H200 (`luce bench --kernels`, 30706f5), more
# than the draw (29.2). Each block leaves its best (value, id); the row's last block to
# finish (luce.kernels.split_merge.arrive) reduces them.
ARGMAX_THREADS = 256
ARGMAX_CHUNK = 8 * ARGMAX_THREADS  # logits a block: 75 blocks a 151,936-logit row


@pdl_ready
@cuda.jit
def _argmax_kernel(logits, out, part_v, part_i, counter):
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    b = cuda.blockIdx.x
    row = cuda.blockIdx.y
    t = cuda.threadIdx.x
    nb = cuda.gridDim.x
    vbuf = cuda.shared.array(MAX_THREADS, np.float32)
    ibuf = cuda.shared.array(MAX_THREADS, np.int32)
    cbuf = cuda.shared.array(1, np.int32)
    bv = np.float32(-math.inf)
    bi = np.int32(BIG_INDEX)
    n = logits.shape[1]
    per = (n + nb - 1) // nb
    for j in range(b * per + t, min(n, (b + 1) * per), cuda.blockDim.x):
        v = np.float32(logits[row, j])
        if _better(v, j, bv, bi):
            bv = v
            bi = np.int32(j)
    bv, bi = block_argmax(bv, bi, vbuf, ibuf)
    if nb == 1:
        if t == 0:
            out[row] = bi
        return
    if t == 0:
        part_v[row, b] = bv
        part_i[row, b] = bi
    if arrive(counter, row, nb, cbuf, t):
        bv = np.float32(-math.inf)
        bi = np.int32(BIG_INDEX)
        for k in range(t, nb, cuda.blockDim.x):
            if _better(part_v[row, k], part_i[row, k], bv, bi):
                bv = part_v[row, k]
                bi = part_i[row, k]
        bv, bi = block_argmax(bv, bi, vbuf, ibuf)
        if t == 0:
            out[row] = bi


_ARGMAX_SCRATCH: dict = {}  # (rows, blocks, stream) -> partials and counters: fixed addresses for graphs


def argmax_cuda(logits, out=None, stream=0):
    """Row-wise argmax of device [R, V] (f32/f16) -> device int32 [R]."""
    rows, n = logits.shape
    if out is None:
        out = cuda.device_array(rows, dtype=np.int32, stream=stream)
    nb = max(1, ceil_div(n, ARGMAX_CHUNK))
    key = (rows, nb, id(stream))
    if key not in _ARGMAX_SCRATCH:
        _ARGMAX_SCRATCH[key] = (cuda.device_array((rows, nb), np.float32), cuda.device_array((rows, nb), np.int32),
                                cuda.to_device(np.zeros(rows, np.int32)))
    pv, pi, counter = _ARGMAX_SCRATCH[key]
    _argmax_kernel[(nb, rows), block_threads(ARGMAX_THREADS), stream](logits, out, pv, pi, counter)
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


@device(inline=True)
def _topk_rounds(vals, ids, use_ids, row, lo, hi, k, out_v, out_i, base, vbuf, ibuf):
    """Block-wide: the top-k of vals[row, lo:hi] into out[row, base:base + k]; returns the
    best value (the same in every thread).

    k rounds of a block argmax; round r takes the best element strictly after round r-1's
    winner in the candidate order, so nothing is marked and the input stays read-only.
    use_ids 0: ids are positions; 1: ids[row, j] (-1: an empty candidate)."""
    t = cuda.threadIdx.x
    pv = np.float32(math.inf)
    pi = np.int32(-1)
    top = np.float32(-math.inf)
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
            out_v[row, base + r] = bv
            out_i[row, base + r] = bi if bi != BIG_INDEX else -1
        if r == 0:
            top = bv
        pv = bv
        pi = bi
    return top


@pdl_ready
@cuda.jit
def _topk_kernel(vals, ids, use_ids, k, chunk, out_v, out_i):
    """Top-k of each `chunk` of a row into out[row, chunk_id, :k] (_topk_rounds). Phase 1
    runs it over logits (ids = positions), phase 2 over phase 1's candidates."""
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    c = cuda.blockIdx.x
    vbuf = cuda.shared.array(MAX_THREADS, np.float32)
    ibuf = cuda.shared.array(MAX_THREADS, np.int32)
    lo = c * chunk
    _topk_rounds(vals, ids, use_ids, cuda.blockIdx.y, lo, min(lo + chunk, vals.shape[1]), k, out_v, out_i, c * k,
                 vbuf, ibuf)


# A draft's chain on the device, float64 [rows, 3] a row: the sum of its tokens'
# log-probabilities so far, whether it has stopped (1.0), and the cut-off (log p_min; -inf:
# never). Why: a draft that stops where its chain gets unlikely must otherwise read each
# step before queuing the one after next, and the step queued past the stop runs for
# nothing (a whole draft step, ~1 ms of the 0.6B draft on an H100); with the stop taken on
# the device every step is queued at once and those past the stop do nothing.
CHAIN_LOGP, CHAIN_STOPPED, CHAIN_CUT = range(3)


def chain_state(rows: int = 1, log_p_min: float = -math.inf) -> np.ndarray:
    """A fresh chain (host array to copy into a device one): nothing summed, not stopped."""
    ch = np.zeros((rows, 3), np.float64)
    ch[:, CHAIN_CUT] = log_p_min
    return ch


@pdl_ready
@cuda.jit
def _topk_lse_kernel(logits, k, chunk, cand_v, cand_i, part, counter, chain, out_v, out_i, out_lz, out_arg):
    """A draft step's candidates in one launch: each block the top-k of its chunk of the
    row and the chunk's sum of exp(x - its max); the row's last block to finish merges
    them into the row's top-k, its log-sum-exp and its argmax (the top-1 id), and adds
    the top-1's log-probability to the row's chain (CHAIN_*: stopped once the sum falls
    below the cut-off). A stopped chain's launch does nothing (the draft ended before it)."""
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    c = cuda.blockIdx.x
    row = cuda.blockIdx.y
    if chain[row, CHAIN_STOPPED] != 0.0:  # read by every block before the last one sets it
        return
    t = cuda.threadIdx.x
    nb = cuda.gridDim.x
    vbuf = cuda.shared.array(MAX_THREADS, np.float32)
    ibuf = cuda.shared.array(MAX_THREADS, np.int32)
    dbuf = cuda.shared.array(MAX_THREADS, np.float64)
    cbuf = cuda.shared.array(1, np.int32)
    lo = c * chunk
    hi = min(lo + chunk, logits.shape[1])
    m = _topk_rounds(logits, cand_i, 0, row, lo, hi, k, cand_v, cand_i, c * k, vbuf, ibuf)
    s = np.float64(0.0)
    if m > -math.inf:  # else every logit here is -inf or NaN: nothing to add
        for j in range(lo + t, hi, cuda.blockDim.x):
            s += np.float64(math.exp(np.float32(logits[row, j]) - m))  # float32 exps, as logsumexp_ref
    s = smem_sum(s, dbuf)
    if t == 0:
        part[row, c, 0] = np.float64(m)
        part[row, c, 1] = s
    if arrive(counter, row, nb, cbuf, t):
        top = _topk_rounds(cand_v, cand_i, 1, row, 0, nb * k, k, out_v, out_i, 0, vbuf, ibuf)
        big = np.float64(top)
        s = np.float64(0.0)
        if top > -math.inf:
            for b in range(t, nb, cuda.blockDim.x):
                if part[row, b, 0] > -math.inf:
                    s += part[row, b, 1] * math.exp(part[row, b, 0] - big)
        s = smem_sum(s, dbuf)
        if t == 0:
            lz = big + math.log(s) if top > -math.inf else big
            out_lz[row] = lz
            first = out_i[row, 0]
            out_arg[row] = first if first >= 0 else 0
            # the host's sum (PendingTopK: float64(value) - lz, added in order): same bits
            lp = chain[row, CHAIN_LOGP] + (np.float64(out_v[row, 0]) - lz)
            chain[row, CHAIN_LOGP] = lp
            if lp < chain[row, CHAIN_CUT]:
                chain[row, CHAIN_STOPPED] = 1.0


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


@pdl_ready
@cuda.jit
def _logsumexp_kernel(logits, maxima, out):
    """out[row] = log(sum(exp(logits[row]))), one block a row; maxima[row, 0] is the row's
    largest logit (topk_cuda's first value: no pass of its own for the max)."""
    grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
    row = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(MAX_THREADS, np.float64)
    m = np.float32(maxima[row, 0])
    s = np.float64(0.0)
    for j in range(t, logits.shape[1], nt):
        s += np.float64(math.exp(np.float32(logits[row, j]) - m))
    s = smem_sum(s, buf)
    if t == 0:
        out[row] = np.float64(m) + math.log(s)


def logsumexp_cuda(logits, maxima, out=None, stream=0):
    """Row-wise log(sum(exp(logits))) of device [R, V] -> device float64 [R], given each
    row's maximum in maxima[:, 0] (topk_cuda's values): with the top-k, a draft position's
    candidates and their log-probabilities without the row leaving the device."""
    rows = logits.shape[0]
    if out is None:
        out = cuda.device_array(rows, dtype=np.float64, stream=stream)
    _logsumexp_kernel[rows, block_threads(1024), stream](logits, maxima, out)
    return out


TOPK_LSE_PER_THREAD = 8  # logits a thread in a block's chunk: 75 blocks a 151,936-logit row


def _topk_lse_chunks(v_size: int, k: int) -> tuple[int, int]:
    nt = block_threads(256)
    chunk = max(TOPK_LSE_PER_THREAD * nt, k)
    return ceil_div(v_size, chunk), chunk


def topk_lse_scratch(rows: int, v_size: int, k: int) -> tuple:
    """What topk_logsumexp_cuda needs besides its outputs, at fixed addresses (graphs); the
    last is the rows' chains (CHAIN_*), made never to stop."""
    n_chunks, _ = _topk_lse_chunks(v_size, k)
    return (cuda.device_array((rows, n_chunks * k), np.float32), cuda.device_array((rows, n_chunks * k), np.int32),
            cuda.device_array((rows, n_chunks, 2), np.float64), cuda.to_device(np.zeros(rows, np.int32)),
            cuda.to_device(chain_state(rows)))


def topk_logsumexp_cuda(logits, k: int, out_values, out_ids, out_lz, out_argmax, scratch=None, stream=0):
    """topk_cuda, logsumexp_cuda and argmax_cuda of device logits [R, V] in one launch (a
    draft step's candidates, their normalizer and its next token): out_values f32 [R, k],
    out_ids int32 [R, k], out_lz float64 [R], out_argmax int32 [R]; scratch's chains (CHAIN_*)
    add each row's top-1 log-probability, and a stopped row is left as it was. As four launches
    (argmax, top-k in two phases, one block's log-sum-exp over the row) these took ~67 us
    of a 0.6B draft's ~1.01 ms step (H100, 2728e07)."""
    if not 1 <= k <= MAX_TOP_K:
        raise ValueError(f"top-k needs 1 <= k <= {MAX_TOP_K}, got {k}")
    rows, v_size = logits.shape
    n_chunks, chunk = _topk_lse_chunks(v_size, k)
    cand_v, cand_i, part, counter, chain = scratch if scratch is not None else topk_lse_scratch(rows, v_size, k)
    _topk_lse_kernel[(n_chunks, rows), block_threads(256), stream](logits, k, chunk, cand_v, cand_i, part, counter,
                                                                   chain, out_values, out_ids, out_lz, out_argmax)
    return out_values, out_ids, out_lz, out_argmax


# ------------------------------------------------------------------------------ a drawn token

# Why a token is drawn on the device: with the logits row copied out and sampled on the
# host, the GPU waits every step for that copy and the host's work, and the next step
# cannot be queued before the token is known (H200, Qwen3-8B shape, 10644a2: 276.7 tok/s
# sampled on the host against 320.9 with the greedy token taken on the device).
#
# How: the k best (logit, id) pairs of a 152K-row without sorting it. A pass over the row
# keeps each run of SAMPLE_RUN logits' best key; a radix search over those run maxima finds
# a key floor that at least k and at most SAMPLE_MAX_RUNS runs reach; only those runs'
# logits are candidates (<= SAMPLE_MAX_RUNS * SAMPLE_RUN), ranked by counting. Then top-k,
# top-p, min-p and the draw over the kept tokens in id order with the host's uniform, as
# luce.engine.sampling.kept and Generator.choice do (float64 throughout).
SAMPLE_RUN = 64
SAMPLE_MAX_RUNS = 64
SAMPLE_THREADS = 1024
# sample_params' layout (float64): the uniform, the parameters, the penalties (SP_PENALIZE:
# 1 where any applies: then the draw reads and updates the penalty state)
(SP_U, SP_TEMPERATURE, SP_TOP_P, SP_MIN_P, SP_TOP_K, SP_REPEAT, SP_PRESENCE, SP_FREQUENCY,
 SP_PENALIZE) = range(9)
# the longest repeat_last_n window the device keeps (penalty_state's ring)
MAX_REPEAT_WINDOW = 4096


def sample_params(temperature: float, top_k: int, top_p: float, min_p: float, u: float, repeat_penalty: float = 1.0,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> np.ndarray:
    """The parameter vector sample_cuda reads (device float64 [9] in the layout SP_*)."""
    sp = np.zeros(9, np.float64)
    sp[SP_U], sp[SP_TEMPERATURE], sp[SP_TOP_P], sp[SP_MIN_P], sp[SP_TOP_K] = u, temperature, top_p, min_p, top_k
    sp[SP_REPEAT], sp[SP_PRESENCE], sp[SP_FREQUENCY] = repeat_penalty, presence_penalty, frequency_penalty
    sp[SP_PENALIZE] = float(repeat_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0)
    return sp


def penalty_state(history, vocab: int, repeat_last_n: int) -> tuple[np.ndarray, np.ndarray]:
    """What the draw's penalties read, for a history of tokens (the prompt and the output so
    far): int32 [2, vocab] (each token's count over the whole history; over the last
    repeat_last_n tokens, all of them when <= 0), and the window's ring int32 [2 +
    MAX_REPEAT_WINDOW]: (the slot the next token takes, the window's length, the tokens,
    oldest first from that slot; -1 where the history is shorter). The draw updates both
    with each token it takes."""
    hist = np.asarray(history, dtype=np.int64)
    counts, recent = token_counts(hist, vocab, repeat_last_n)
    ring = np.full(2 + MAX_REPEAT_WINDOW, -1, np.int32)
    n = max(0, repeat_last_n)
    if n > MAX_REPEAT_WINDOW:
        raise ValueError(f"repeat_last_n {repeat_last_n} is past the device's window of {MAX_REPEAT_WINDOW}")
    if n:
        last = hist[-n:]
        ring[2:2 + len(last)] = last
        ring[0] = len(last) % n
    ring[1] = n
    return np.stack([counts, recent]).astype(np.int32), ring


def sample_applies(temperature: float, top_k: int, vocab: int, repeat_last_n: int = 0) -> bool:
    """Whether sample_cuda draws with these parameters: a temperature, a top-k of at most
    MAX_TOP_K below the vocabulary (without one, the kept set is bounded only by the whole
    row's normalizer), a repeat window the device keeps."""
    return (temperature > 0.0 and 0 < top_k <= MAX_TOP_K and top_k < vocab
            and repeat_last_n <= MAX_REPEAT_WINDOW)


def sample_ref(logits: np.ndarray, sp: np.ndarray, pen: np.ndarray | None = None) -> int:
    """The token drawn from one logits row [V] with sample_params `sp` (and its penalties
    over penalty_state's counts `pen`, as apply_penalties_ref): a stable descending
    sort of the whole row (ties: the smaller id first; NaN as -inf), the first top_k, their
    softmax at the temperature; the smallest prefix whose mass reaches top_p, the tokens of
    at least min_p of the best's probability; then the inverse CDF at u over the kept
    tokens in id order (numpy's Generator.choice for a uniform u)."""
    x = np.where(np.isnan(logits), -np.inf, np.asarray(logits, np.float32))
    if sp[SP_PENALIZE]:
        x = apply_penalties_ref(x, pen[0], pen[1], sp[SP_REPEAT], sp[SP_PRESENCE], sp[SP_FREQUENCY])
    k = int(sp[SP_TOP_K])
    order = np.argsort(-x, kind="stable")[:k]
    z = x[order].astype(np.float64) / sp[SP_TEMPERATURE]
    ps = np.exp(z - z[0])
    ps /= ps.sum()
    keep = k
    if sp[SP_TOP_P] < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(ps), sp[SP_TOP_P])) + 1)
    if sp[SP_MIN_P] > 0.0:
        keep = min(keep, max(1, int(np.sum(ps >= sp[SP_MIN_P] * ps[0]))))
    ids, ps = order[:keep], ps[:keep] / ps[:keep].sum()
    asc = np.argsort(ids)
    cdf = np.cumsum(ps[asc])
    cdf /= cdf[-1]
    return int(ids[asc][min(keep - 1, int(np.searchsorted(cdf, sp[SP_U], side="right")))])


U32 = np.uint32
U64 = np.uint64


@device(inline=True)
def _order_key(v, j):
    """A uint64 whose order is the candidate order of (logit v, token id j): the logit's
    bits made unsigned-ordered above, the id inverted below (NaN as -inf, -0 as 0)."""
    v = np.float32(v)
    if v != v:
        v = np.float32(-math.inf)
    if v == 0:
        v = np.float32(0.0)
    b = f32_to_u32_bits(v)
    b = U32(U32(0xFFFFFFFF) ^ b) if b & U32(0x80000000) else U32(b | U32(0x80000000))
    return U64(U64(b) << U64(32)) | U64(U32(0xFFFFFFFF) - U32(j))


@device(inline=True)
def _key_logit(key):
    b = U32(key >> U64(32))
    b = U32(b & U32(0x7FFFFFFF)) if b & U32(0x80000000) else U32(U32(0xFFFFFFFF) ^ b)
    return u32_bits_to_f32(b)


@device(inline=True)
def _key_id(key):
    return np.int32(U32(0xFFFFFFFF) - U32(key & U64(0xFFFFFFFF)))


@device(inline=True)
def _penalized(v, j, sp, pen):
    """Logit v of token j after sp's penalties over pen (apply_penalties_ref's float32 steps)."""
    v = np.float32(v)
    if sp[SP_PENALIZE] != 0.0:
        if pen[1, j] > 0:
            rep = np.float32(sp[SP_REPEAT])
            v = v / rep if v > 0 else v * rep
        c = pen[0, j]
        if c > 0:
            v = v - (np.float32(sp[SP_FREQUENCY]) * np.float32(c) + np.float32(sp[SP_PRESENCE]))
    return v


@functools.lru_cache(maxsize=None)
def _sample_kernels(run: int):
    RUN = run
    MAXR = SAMPLE_MAX_RUNS
    CAND = SAMPLE_MAX_RUNS * run
    K = MAX_TOP_K

    @cuda.jit
    def run_keys(logits, row, rk, sp, pen):
        """rk[r] = the best order key of run r of the row (penalized)."""
        grid_dependency_sync()  # luce.kernels.pdl: the kernel before may still run
        r = cuda.grid(1)
        v_size = logits.shape[1]
        if r >= rk.shape[0]:
            return
        best = U64(0)
        for j in range(r * RUN, min(r * RUN + RUN, v_size)):
            key = _order_key(_penalized(logits[row, j], j, sp, pen), j)
            if key > best:
                best = key
        rk[r] = best

    @cuda.jit
    def draw(logits, row, rk, sp, out, pen, ring):
        """One block: out[0] = the token drawn from the row (see sample_ref); with
        penalties, the token then counts in pen and ring (penalty_state)."""
        grid_dependency_sync()
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        v_size = logits.shape[1]
        n_runs = rk.shape[0]
        hist = cuda.shared.array(16, np.int32)
        ctl = cuda.shared.array(2, np.uint64)  # the floor's prefix so far, and its mask
        ints = cuda.shared.array(5, np.int32)  # runs above the prefix, done, runs kept, candidates, tokens kept
        sel = cuda.shared.array(MAXR, np.int32)
        cand = cuda.shared.array(CAND, np.uint64)
        top = cuda.shared.array(K, np.uint64)
        ps = cuda.shared.array(K, np.float64)
        asc_p = cuda.shared.array(K, np.float64)
        asc_id = cuda.shared.array(K, np.int32)
        k = min(np.int32(sp[SP_TOP_K]), K)
        if tid == 0:
            ctl[0] = U64(0)
            ctl[1] = U64(0)
            ints[0] = 0
            ints[1] = 1 if n_runs <= MAXR else 0  # few runs: all of them are candidates
            ints[2] = 0
            ints[3] = 0
        cuda.syncthreads()
        # the floor: 4 bits a pass from the top, into the bucket that holds the k-th best
        # run maximum, until the runs at or above the bucket's least key are few enough
        shift = 64
        while ints[1] == 0:
            shift -= 4
            if tid < 16:
                hist[tid] = 0
            cuda.syncthreads()
            prefix = ctl[0]
            mask = ctl[1]
            for r in range(tid, n_runs, nt):
                key = rk[r]
                if key & mask == prefix:
                    cuda.atomic.add(hist, np.int32((key >> U64(shift)) & U64(15)), 1)
            cuda.syncthreads()
            if tid == 0:
                need = k - ints[0]
                above = 0
                d = 15
                while d > 0 and above + hist[d] < need:
                    above += hist[d]
                    d -= 1
                ints[0] += above
                ctl[0] = prefix | U64(U64(d) << U64(shift))
                ctl[1] = mask | U64(U64(15) << U64(shift))
                if ints[0] + hist[d] <= MAXR:
                    ints[1] = 1
            cuda.syncthreads()
        floor = ctl[0]
        for r in range(tid, n_runs, nt):
            if rk[r] >= floor:
                sel[cuda.atomic.add(ints, 2, 1)] = r
        cuda.syncthreads()
        for e in range(tid, ints[2] * RUN, nt):
            j = sel[e // RUN] * RUN + e % RUN
            if j < v_size:
                key = _order_key(_penalized(logits[row, j], j, sp, pen), j)
                if key >= floor:
                    cand[cuda.atomic.add(ints, 3, 1)] = key
        cuda.syncthreads()
        n_c = ints[3]
        for c in range(tid, n_c, nt):  # rank by counting: keys are distinct
            key = cand[c]
            rank = 0
            for o in range(n_c):
                if cand[o] > key:
                    rank += 1
            if rank < k:
                top[rank] = key
        cuda.syncthreads()
        kk = min(k, n_c)
        temp = sp[SP_TEMPERATURE]
        z0 = np.float64(_key_logit(top[0])) / temp
        for i in range(tid, kk, nt):
            ps[i] = math.exp(np.float64(_key_logit(top[i])) / temp - z0)
        cuda.syncthreads()
        if tid == 0:
            s = np.float64(0.0)
            for i in range(kk):
                s += ps[i]
            keep = kk
            top_p = sp[SP_TOP_P]
            if top_p < 1.0:  # the smallest prefix whose mass reaches top_p
                c = np.float64(0.0)
                for i in range(kk):
                    c += ps[i] / s
                    if c >= top_p:
                        keep = min(keep, i + 1)
                        break
            min_p = sp[SP_MIN_P]
            if min_p > 0.0:
                n_min = 0
                for i in range(kk):
                    if ps[i] / s >= min_p * (ps[0] / s):
                        n_min += 1
                keep = min(keep, max(1, n_min))
            ints[4] = keep
        cuda.syncthreads()
        keep = ints[4]
        for t in range(tid, keep, nt):  # the kept tokens in id order: a token's place is the count of smaller ids
            my = _key_id(top[t])
            at = 0
            for i in range(keep):
                if _key_id(top[i]) < my:
                    at += 1
            asc_id[at] = my
            asc_p[at] = ps[t]
        cuda.syncthreads()
        if tid == 0:
            s = np.float64(0.0)
            for i in range(keep):
                s += asc_p[i]
            c = np.float64(0.0)
            for i in range(keep):
                c += asc_p[i] / s
                asc_p[i] = c
            u = sp[SP_U]
            pick = keep - 1
            for i in range(keep):
                if asc_p[i] / asc_p[keep - 1] > u:
                    pick = i
                    break
            t = asc_id[pick]
            out[0] = t
            if sp[SP_PENALIZE] != 0.0:  # the history the next draw penalizes has t
                pen[0, t] += 1
                pen[1, t] += 1
                n = ring[1]
                if n > 0:
                    slot = ring[0]
                    old = ring[2 + slot]
                    if old >= 0:
                        pen[1, old] -= 1  # out of the window
                    ring[2 + slot] = t
                    ring[0] = (slot + 1) % n

    return pdl_ready(run_keys), pdl_ready(draw)


def sample_scratch(v_size: int, run: int = SAMPLE_RUN):
    """The run maxima sample_cuda needs (device uint64 [runs]): allocate once, outside a
    captured graph."""
    return cuda.device_array(ceil_div(v_size, run), dtype=np.uint64)


def sample_cuda(logits, sp, out, scratch=None, row: int = 0, run: int = SAMPLE_RUN, stream=0, state=None):
    """out[0] = the token drawn from row `row` of device logits [R, V] (f32) with the
    device parameters sp (sample_params; sample_applies must hold), as sample_ref draws it.
    state: device (pen, ring) of penalty_state, read and updated where sp has penalties
    (None: sp must have none)."""
    rk = sample_scratch(logits.shape[1], run) if scratch is None else scratch
    if state is None:
        state = (cuda.device_array((2, 1), np.int32, stream=stream), cuda.device_array(2, np.int32, stream=stream))
    run_keys, draw = _sample_kernels(run)
    nt = block_threads(128)
    run_keys[ceil_div(rk.shape[0], nt), nt, stream](logits, row, rk, sp, state[0])
    draw[1, block_threads(SAMPLE_THREADS), stream](logits, row, rk, sp, out, state[0], state[1])
    return out
