"""The CUDA backend: the shared forward on luce.kernels' numba kernels.

- Weights are uploaded once and stay quantized (raw GGUF blocks, dequantized in
  registers by the matvec/matmul kernels); norms and biases as float32.
- Activations live in a workspace arena at fixed addresses: the buffers one forward
  over N tokens uses are the same every time, which is what lets decode, each tree width
  and each power-of-two prefill piece be recorded once as a CUDA graph (on first sight,
  once its kernels are compiled) and replayed. A form whose recording fails runs eagerly.
- Rows up to 64 tokens go through the batched matvec (weights read once for all rows);
  longer prefill chunks through the tensor-core matmul.
"""
from __future__ import annotations

import functools
import math
import os
import re
import time
import weakref
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from ..kv.paged import PagedKVCache
from . import tile_runs
from .cuda_copy import d2d, d2h_async, d2h_sync, h2d

MAX_MATVEC_ROWS = 64
# from this many rows the small-M tensor-core matmul beats the batched matvec, which is
# arithmetic-bound (16 rows cost ~10x one row on the H200; a 2- or 4-token verification
# forward through it cost 4x a decode step on the Qwen3-8B shape, 8-32 tokens through the
# matmul 2.8-3.4x)
MATMUL_MIN_ROWS = 2
# Forwards of up to this many tokens take the fast matvec with several x rows (each weight
# read once) where the weight type has one. H200, f1edff7 (docs/data/
# matvec_fast_x_rows_f1edff7.jsonl): 2 rows cost 1.25-1.9x one row, 4 rows 1.8-2.7x, 8 rows
# 3-6.8x (its sums and x loads grow with the rows), while a whole 4- or 8-token forward
# through the matmul cost 2.1-2.3x a decode step: so 2 rows only. The 2-token forward with
# this routing was not timed end to end.
FAST_MATVEC_MAX_ROWS = 2


def rows_from_env(name: str, default: range) -> range:
    """A range of forward widths from environment variable `name`: "N" or "N-M"."""
    import os
    spec = os.environ.get(name, "").strip()
    if not spec:
        return default
    lo, _, hi = spec.partition("-")
    try:
        return range(int(lo), int(hi or lo) + 1)
    except ValueError:
        from ..errors import LuceError
        raise LuceError(f"{name}: expected a width N or a range N-M, got {spec!r}") from None


# Forwards of these widths (tokens: chain and tree verification, short prefill pieces) take
# the tensor-core small-M product for Q4_K and Q6_K weights (luce.kernels.matvec_mma: each
# weight read once, dequantized into mma fragments). H200, Qwen3-8B shapes (d80fd0b): the
# gated FFN at 23 rows 40.2 us against 78.2 for the small-M matmul, 26.5 us up to 8 rows;
# the 23-node verification forward 8.25 ms (1.92x a decode step) against 12.3-12.7 ms. One
# row stays on matvec_fast (as fast for the FFN, faster for the small projections).
# LUCE_MATVEC_MMA_ROWS=N-M sets the widths (0: none).
MATVEC_MMA_ROWS = rows_from_env("LUCE_MATVEC_MMA_ROWS", range(2, 33))


def _norm_in_range(w, k: int) -> bool:
    """Whether an RMSNorm with weight w over rows of k stays in f16's range: |x_i| / rms(x)
    <= sqrt(k), so the output stays below sqrt(k) max|w| (load_tensor records max|w| of
    every vector it uploads)."""
    wmax = getattr(w, "luce_absmax", None)
    return wmax is not None and wmax * math.sqrt(k) < 0.99 * 2.0 ** 15


def _takes_mma(n: int, qtype, k: int) -> bool:
    """Whether an n-token product with a qtype weight of k columns goes to matvec_mma."""
    from ..kernels.matvec_mma import MMA_TYPES, QK
    return n in MATVEC_MMA_ROWS and qtype in MMA_TYPES and k % QK == 0


def _takes_matmul(n: int, qtype, k: int) -> bool:
    """Whether CudaOps.linear sends an n-token product with a qtype weight of k columns to
    the prefill matmul (after matvec_mma's and matvec_fast's widths)."""
    from ..kernels.matmul import MATMUL_TYPES
    from ..kernels.matvec_fast import FAST_TYPES
    return (not _takes_mma(n, qtype, k) and not (n <= FAST_MATVEC_MAX_ROWS and qtype in FAST_TYPES)
            and n >= MATMUL_MIN_ROWS and qtype in MATMUL_TYPES)


# Decode's Q4_K and Q6_K matvecs take x rounded to int8 (a step a 16 columns) and multiply
# with dp4a (luce.kernels.quantize_x), in two planes by default (x and what its rounding
# left: about int16's precision, two dp4a a weight word); LUCE_MATVEC_X8=1 for one plane, 0
# for float x. H200, Qwen3-8B shape, one call (18da752): two planes with the norm
# epilogues 308.9 decode tok/s with the next token on device against 287.1 for float x;
# DDTree stayed lossless on the GPU (decode over int8 x, verification over float x).
# One plane is faster still but moves a real model's logits by ~1.3% (luce.bench.x8_drift:
# 4 of 10 prompts' greedy output changed; two planes: none, logits ~5e-5), enough to make
# decode and the verification forward of speculative decoding disagree at near-ties.
MATVEC_X8 = int(os.environ.get("LUCE_MATVEC_X8", "2") or 0)
if MATVEC_X8 not in (0, 1, 2):
    raise ValueError(f"LUCE_MATVEC_X8={MATVEC_X8}: 0 (float x), 1 or 2 (int8 planes)")
# Under MATVEC_X8 the ops whose output the next product reads as int8 can store that form
# from their epilogue, so it has no launch of its own: o and down with the split norm
# ("norm"), decode attention ("attn") and the gated product ("gated"). LUCE_X8_OUT lists
# them (comma-separated; "0" none, "all" every one); the default is "norm". H200, 8B shape,
# two planes: norm and gated 291.7 decode tok/s on device, none (aa140c3's launches) 298.0
# in one call at a1a8e55 (the gated product's epilogue takes it from 80 to 112 registers,
# sm_90, and from 20.0 to 26.8 us); norm alone 308.9 at 18da752; norm and attn 300.4
# against norm alone 307.6 in one call at 92ca685 (the attention op 14.5 us a layer against 12.9: its last block's merge
# quantizing 4 rows costs more than the launch it saves).
_X8_OUT = os.environ.get("LUCE_X8_OUT", "norm").strip().lower()
_X8_PARTS = {"norm", "attn", "gated"}
X8_OUT = (set(_X8_PARTS) if _X8_OUT == "all" else set() if _X8_OUT in ("0", "", "none")
          else set(_X8_OUT.split(",")))
if not X8_OUT <= _X8_PARTS:
    raise ValueError(f"LUCE_X8_OUT={_X8_OUT}: a list of {', '.join(sorted(_X8_PARTS))} (or all, 0)")
# Decode's q and k projections (same type and width) as one matvec_fast launch, and
# verification's as one matvec_mma_pair launch: the 1024-row k projection alone is a
# latency-bound launch (4.5 us for 2.4 MB at the 8B shape, H200, 77d259d) plus a graph gap.
# The verification pair is not yet timed; LUCE_PAIR_PROJECTIONS=0 turns both off.
PAIR_PROJECTIONS = os.environ.get("LUCE_PAIR_PROJECTIONS", "1") != "0"
# ... and decode's v projection in the same launch where it follows them (a Q4_K_M model's
# Q6_K v: matvec_fast_pair's third weight): alone it is another latency-bound launch (Q6_K
# 1024x4096 4.9 us for 3.4 MB, H200). LUCE_TRIO_PROJECTIONS=0 turns it off.
TRIO_PROJECTIONS = os.environ.get("LUCE_TRIO_PROJECTIONS", "1") != "0"
# ... and verification's v in matvec_mma_pair's launch (its third weight, of its own type):
# at 23 rows alone it was a 3.4 MB product taking ~8 us, all latency (H100, thirty-second
# session). LUCE_MMA_TRIO=0 turns it off.
MMA_TRIO = os.environ.get("LUCE_MMA_TRIO", "1") != "0"
# ... and the o projection's fragments written by attention's combine launch, not by a
# conversion launch of their own. LUCE_ATTN_FRAGS=0 turns it off.
ATTN_FRAGS = os.environ.get("LUCE_ATTN_FRAGS", "1") != "0"
# Decode's RMSNorms after the o and down projections, split between the launches around
# them (luce.kernels.matvec_fast: matvec_fast_norm and x_norm), so they cost no launch of their
# own: 72 of the 73 norm launches of a Qwen3-8B decode step (2.95 us each, H200, f4d4220).
# LUCE_FUSED_NORM=0 turns it off.
FUSED_NORM = os.environ.get("LUCE_FUSED_NORM", "1") != "0"
# ... and verification's (matvec_mma's widths), LUCE_MMA_NORM=1, off: the o and down
# products write the norm's fragments prescaled and their last block the rows' 1 / rms
# (matvec_mma_norm), where rms_norm_frags had a launch of its own after each. Measured
# slower (H100, Qwen3-8B shape, thirty-fourth session, 23-node forward, one run each in
# one call): 5.84 / 6.17 ms on against 5.46 / 5.54 off, in two calls (the second with the
# last block's sums loaded eight at a time); where the time goes was not measured.
MMA_NORM = os.environ.get("LUCE_MMA_NORM", "0") == "1"
# Gemma's residual steps (x += RMSNorm(y) w_post, then the next norm) as one launch
# (rms_norm_cuda's pre_weight) instead of three; LUCE_FUSED_POST_NORM=0 composes them
FUSED_POST_NORM = os.environ.get("LUCE_FUSED_POST_NORM", "1") != "0"
# Gemma's GeGLU on decode rows as matvec_fast's gated launch (swiglu_fast's act) instead of
# both products and an activation pass; LUCE_FUSED_GEGLU=0 goes back to those
FUSED_GEGLU = os.environ.get("LUCE_FUSED_GEGLU", "1") != "0"
# On matvec_mma's widths the gated FFN's kernel also writes its output's fragments for the
# down projection (luce.kernels.matvec_mma: frags_out), which then runs only the f16 guard's
# fixup before its product: a conversion launch a layer fewer.
GATED_FRAGS = os.environ.get("LUCE_GATED_FRAGS", "1") != "0"
# qk_rope also writes the layer's new K (roped) and V rows into the f16 pool, so attention
# has no write_kv launch of its own (one launch a layer fewer in every forward). Only where
# no plugin swapped an op in (the write relies on linears, qk_rope and attention being
# these). H200, Qwen3-8B shape (a377fae, one call): decode 282.1 tok/s host-sampled, 286.8
# with the next token on the device, against 278.0 / 280.9; LUCE_FUSED_KV_WRITE=0 turns it off.
FUSED_KV_WRITE = os.environ.get("LUCE_FUSED_KV_WRITE", "1") != "0"
# Decode's qk_rope (per-head norms and rotation of q and k) done by the attention kernel
# itself, which also writes the new K/V row (luce.kernels.attention, paged_attention_cuda's
# rope): one launch a layer fewer in the decode step. Off by default, because it measured
# slower (H200, Qwen3-8B shape, d86eae9, runs alternating in one call): decode with the
# next token on the device 305.5 / 305.7 tok/s against 334.5 / 334.6 without. By op, the
# fused attention took 15.4 us a layer against 11.0 + 3.1 for attention and qk_rope, but
# the decode graph grew 2,943 -> 3,216 us: launched early (PDL) behind the q/k/v product,
# the attention grid's blocks (47 KB of shared memory each) wait on the SMs that product
# still needs, where qk_rope's 40 small blocks did not. At 8K it was ahead (250.1 against
# 245.0 tok/s, single runs). LUCE_FUSED_ROPE=1 turns it on (where the fused K/V write
# runs, on the one-query kernel over an f16 pool, without an attention scale of the
# family's own).
FUSED_ROPE = os.environ.get("LUCE_FUSED_ROPE", "0") == "1"
# Prefill's gated FFN (SwiGLU; Gemma's GeGLU) as one matmul launch (luce.kernels.matmul's
# w_up: W_gate and W_up rows interleaved in the tile, act(g) u in the epilogue) where it took
# two products and an activation pass: H200, Qwen3-32B shape, 512-token prefill 2,247 ->
# 2,348 tok/s (4678b07). LUCE_FUSED_GATED_MATMUL=0 turns it off (for the comparison).
FUSED_GATED_MATMUL = os.environ.get("LUCE_FUSED_GATED_MATMUL", "1") != "0"
# A small model's one-token forward (a draft's step) as one persistent kernel
# (luce.kernels.persistent_decode) instead of the graph of ~170 launches, where the kernel
# takes the model (its applies()) and no plugin overrides an op: H100, synthetic Qwen3-0.6B,
# 986 against 1,157 us a step through the backend, its GPU tests passing (41398cc;
# docs/benchmarks.md, fortieth session). LUCE_PERSISTENT_DECODE=0 turns it off. Off in the
# simulator, where its own tests turn it on: there it would run every one-token step of
# the backend's tests one block at a time.
PERSISTENT_DECODE = {"0": False, "1": True}.get(os.environ.get("LUCE_PERSISTENT_DECODE", ""))  # None: the default
# By default only for models whose layer weights are at most this (a draft's: measured
# faster there). An 8B's shape fits the kernel's shared memory since it is opted into past
# 48 KB, but runs slower than the chain (H100: 4,390 against 3,282 us a step, forty-first
# session); LUCE_PERSISTENT_DECODE=1 takes it all the same.
PERSISTENT_DEFAULT_BYTES = 1 << 30
GRAPH_WIDTHS_MAX = 64  # decode and tree verification widths that get a CUDA graph
# Prefill forwards of a power-of-two width up to this get one too: the engine splits a prompt
# into such pieces (engine.generator.prefill_pieces), so a bounded set of graphs serves every
# prompt length. Eagerly, a 512-token Qwen3-8B forward spent ~70 ms of its ~150 ms in Python
# launches (H200, d70f71e: 832 launches; the same kernels as a graph: 78 ms).
PREFILL_GRAPH_MAX = 512
WARMUP_WIDTHS = (1, 2, 4, 8, 16, 23, 32, 64, 96, 128, 256, 512)
ALIGN = 256


# Q6_K regrouped eight blocks at a time (luce.kernels.q6k_groups: every 16-byte piece one
# aligned load): the down projections and the output head (the embedding table where it is
# the head) also get a copy in that layout, which the verification widths' tensor-core
# products (matvec_mma) read. On the H200 (8B shape) the 23-node verification forward took
# 5.21 / 5.25 ms against 5.48 / 5.42 without (two calls), its down product with the norm
# 32.3 us a layer against 37.8. Decode keeps the GGUF layout: its down product with the
# norm profiled 19.0 us a layer over the copy against 16.2 without (the kernel alone,
# without the norm: 18.05 against 19.71), and end to end decode moved within the spread.
# It costs those weights' memory twice (8B: ~2 GB), so LUCE_Q6K_G8=auto (the default) makes
# the copies only where the whole model and its copies leave g8_reserve of the free memory
# (plan_weights); 1 always, 0 never. Figures: docs/benchmarks.md, thirty-first session.
Q6K_G8 = os.environ.get("LUCE_Q6K_G8", "auto").strip().lower()
if Q6K_G8 not in ("auto", "0", "1"):
    raise ValueError(f"LUCE_Q6K_G8={Q6K_G8!r}: auto, 0 or 1")
_G8_DOWN = re.compile(r"blk\.\d+\.ffn_down\.weight")


def g8_reserve(total_bytes: int) -> int:
    """Device memory left free for the KV cache, activations and graphs when deciding on
    the Q6_K groups copies: a fifth of the device, at least 8 GiB."""
    return max(8 << 30, total_bytes // 5)


@dataclass
class DeviceWeight:
    raw: object  # uint8 device array [rows, row_bytes]
    qtype: object
    shape: tuple[int, int]  # (rows, cols)
    g8: object = None  # Q6K_G8: the same rows in q6k_groups' layout


def g8_eligible(qtype, cols: int) -> bool:
    import gguf
    from ..kernels.q6k_groups import g8_applies
    return qtype == gguf.GGMLQuantizationType.Q6_K and g8_applies(cols)


def g8_plan(tensors: dict, tied_output: bool, free_bytes: int, total_bytes: int, setting: str = None) -> set:
    """The tensors (by name) that get a Q6_K groups copy: the eligible down projections and
    head, all of them or none (a model whose products differ layer to layer gains nothing
    over the slowest), and under "auto" only if the model, the copies and g8_reserve fit
    in free_bytes."""
    setting = Q6K_G8 if setting is None else setting
    head = "token_embd.weight" if tied_output else "output.weight"
    names = {n for n, t in tensors.items() if (_G8_DOWN.fullmatch(n) or n == head)
             and len(t.shape) == 2 and g8_eligible(t.qtype, t.shape[1])}
    if setting == "0" or not names:
        return set()
    if setting == "1":
        return names
    need = sum(t.n_bytes for t in tensors.values()) + sum(tensors[n].n_bytes for n in names)
    return names if need + g8_reserve(total_bytes) <= free_bytes else set()


def _g8_copy(cuda, host_rows: np.ndarray, qtype, cols: int, name, planned):
    """The device copy of Q6_K rows in q6k_groups' layout where plan_weights named the
    tensor (planned None: weights loaded without a plan get none)."""
    from ..kernels.q6k_groups import g8_ref
    if not planned or name not in planned or not g8_eligible(qtype, cols):
        return None
    return cuda.to_device(g8_ref(host_rows, host_rows.shape[0], cols))


@dataclass
class MmaNorm:
    """rms_norm(x, w) of matvec_mma's widths left to the products that read it: their
    fragments (kept by the ops under this object) hold x w and their row scales 1 / rms
    (matvec_mma_norm). h is where CudaOps._plain makes the norm for any other reader."""
    h: object
    x: object  # the residual stream it is the norm of, unchanged until its readers have run
    w: object
    eps: float

    @property
    def shape(self):
        return self.h.shape


@dataclass
class SplitNorm:
    """rms_norm(x, w) of one row with its scaling left to the products that read it: xg = x w
    and parts (sums of x^2 by row block) from matvec_fast_norm; x_norm=(parts, n_parts, eps)
    makes a matvec_fast product of xg one of the norm's output. Ops that cannot take it make
    the norm itself (CudaOps._plain)."""
    xg: object
    parts: object
    n_parts: int
    eps: float
    x: object  # the residual stream it is the norm of, unchanged until its readers have run
    w: object
    xq: object = None  # xg's quantize_x form (MATVEC_X8), for readers over int8 x

    @property
    def shape(self):
        return self.xg.shape

    @property
    def x_norm(self):
        return self.parts, self.n_parts, self.eps


class Arena:
    """A bump allocator over one device buffer. `mark()` ends the persistent part of a
    forward (the residual stream); `release()` returns to it, so per-layer temporaries
    reuse the same memory in every layer."""

    def __init__(self, n_bytes: int):
        from numba import cuda
        self.size = n_bytes
        self.buf = cuda.device_array(n_bytes, dtype=np.uint8)
        self.off = self.persist = 0

    def reset(self) -> None:
        self.off = self.persist = 0

    def mark(self) -> None:
        self.persist = self.off

    def release(self) -> None:
        self.off = self.persist

    def alloc(self, shape, dtype=np.float32):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        start = -(-self.off // ALIGN) * ALIGN
        if start + n > self.size:
            raise MemoryError(f"workspace arena of {self.size} bytes is too small")
        self.off = start + n
        return self.buf[start:start + n].view(dtype).reshape(tuple(shape))


def _addr(a) -> int:
    """A device array's address (the simulator's arrays: their host buffer's)."""
    ary = getattr(a, "_ary", None)  # numba's simulator wraps a numpy array
    return (ary.__array_interface__ if ary is not None else a.__cuda_array_interface__)["data"][0]


def _takes_int8_x(weights) -> bool:
    """Whether a layer projection of these weights has int8-x units (matvec_fast.X8_TYPES)."""
    from ..kernels.matvec_fast import X8_TYPES
    layers = getattr(weights, "layers", None)
    return bool(layers) and any(isinstance(w, DeviceWeight) and w.qtype in X8_TYPES for w in vars(layers[0]).values())


class CudaOps:
    """The op interface of models.transformer on device arrays, writing into the arena."""

    def __init__(self, backend: "CUDABackend", cfg):
        self.b = backend
        self.cfg = cfg
        self.arena: Arena = None
        self.stream = backend.stream
        self.mask_bits = None
        self.n_keys = 0
        # a context of attention_mma.DECODE_LONG_KEYS+ keys: decode's attention on tensor
        # cores, a tree's Q in shared memory (a graph of its own: see CUDABackend._launch)
        self.long_context = False
        self._xq = None  # (x, its int8 form): q, k (and gate with up) share one quantize_x
        # whether the model's projections take int8 x (MATVEC_X8 and a Q4_K or Q6_K layer
        # projection: set with the weights); other models' norms and products make none
        self.x8_weights = False
        # arrays of this layer whose every |value| is below 2**15 (an RMSNorm's output with a
        # small enough weight, attention over an f16 pool): their tensor-core products skip
        # the f16 guard's fixup launch (luce.kernels.f16_range)
        self._in_range = []
        # weight layout (Q4_K, Q6_K) -> (x, its matvec_mma fragments): the conversion kept in
        # luce.kernels.matvec_mma's buffer for that layout, until a conversion of another x
        # (every one goes through _frags_for) or rms_norm_frags rewrites it
        self._frags = {}
        # linear_norm's outputs, read in the next layer: two sets of buffers outside the
        # per-layer memory, used in turn ((h, parts, xq) each; made by embed)
        self._carry = []
        self._flip = 0
        # the fused K/V write (FUSED_KV_WRITE): whether it may run for these ops and a weak
        # reference to their cache (both set with the cache), the forward's layer (new_layer
        # counts), the v made with the layer's k by linears (k's device address, v), and the
        # layer whose rows qk_rope wrote
        self.fuse_kv_write = False
        self.kv_ref = None
        self._layer = -1
        self._v_for = None
        self._kv_written = None
        # decode's rope left to attention (FUSED_ROPE): whether it may be, and the pending
        # one (q's and k's device addresses, their RopeArgs)
        self.fuse_rope = False
        self._rope_for = None

    # -- memory -------------------------------------------------------------------
    def _out(self, shape):
        return self.arena.alloc(shape)

    def begin_forward(self, mask_bits=None):
        """Per-forward state back to its start: the arena, what is kept of the last
        forward's x conversions, the layer count and the fused K/V write's bookkeeping."""
        self.arena.reset()
        self._xq = None
        self._in_range = []
        self.mask_bits = mask_bits
        self._layer, self._v_for, self._kv_written, self._rope_for = -1, None, None, None

    def layer_state(self):
        """What an op's fusion decisions read besides its arguments (see set_layer_state)."""
        return self._layer, self._v_for, self._kv_written, self._rope_for

    def set_layer_state(self, state):
        """Put back a layer_state: a profiler replaying one recorded op alone runs it as
        it ran inside the forward."""
        self._layer, self._v_for, self._kv_written, self._rope_for = state

    def new_layer(self):
        self._layer += 1
        self._v_for = None
        self._rope_for = None
        self.arena.release()
        carried = [c[0] for c in self._carry]
        if self._xq is not None and not any(self._xq[0] is h for h in carried):
            self._xq = None
        self._frags = {qt: f for qt, f in self._frags.items() if any(f[0] is h for h in carried)}
        self._in_range = [a for a in self._in_range if any(a is h for h in carried)]

    def _own(self, *names) -> bool:
        """Whether these ops are this class's own (no plugin kernel swapped in for them)."""
        return all(getattr(getattr(self, n), "__func__", None) is getattr(CudaOps, n) for n in names)

    def _plain(self, x):
        """x as an array: a SplitNorm's norm made here, for ops that cannot finish it."""
        if isinstance(x, MmaNorm):
            return self.rms_norm(x.x, x.w, x.eps, out=x.h)
        if not isinstance(x, SplitNorm):
            return x
        return self.rms_norm(x.x, x.w, x.eps)

    def _mma_x(self, x, qtypes):
        """x for matvec_mma products of these weight types: an MmaNorm stays one where its
        fragments are kept for every type (the products finish the norm); else plain."""
        if isinstance(x, MmaNorm) and all(self._frags.get(qt, (None,))[0] is x for qt in qtypes):
            return x
        return self._plain(x)

    def _guard(self, x) -> bool:
        """Whether x's f16 conversion needs the guard (not known to be in range)."""
        return not any(x is a for a in self._in_range)

    def _x8(self, x, qtype):
        """quantize_x(x) where the matvec of `qtype` has int8-x units and MATVEC_X8 is on,
        made once for consecutive projections of the same x; else None."""
        from ..kernels.matvec_fast import X8_TYPES
        if not self.x8_weights or qtype not in X8_TYPES:
            return None
        if self._xq is not None and self._xq[0] is x:
            return self._xq[1]
        from ..kernels.quantize_x import quantize_x, xq_size
        xq = quantize_x(x, out=self.arena.alloc((xq_size(x.shape[1], x.shape[0], MATVEC_X8),), np.uint16),
                        stream=self.stream, planes=MATVEC_X8)
        self._xq = (x, xq)
        return xq

    def _xq_out(self, h, part="gated"):
        """Where op `part`'s launch also stores its output h's int8 form (one decode row under
        MATVEC_X8: the next product's x), kept as h's for _x8; else None."""
        if not (part in X8_OUT and self._x8_rows(h) and h.shape[0] == 1):
            return None
        from ..kernels.quantize_x import xq_size
        xq = self.arena.alloc((xq_size(h.shape[1], 1, MATVEC_X8),), np.uint16)
        self._xq = (h, xq)
        return xq

    # -- ops ----------------------------------------------------------------------
    def embed(self, table: DeviceWeight, tokens):
        from ..kernels.embedding import embed_quant_cuda
        n = tokens.shape[0]
        out = self._out((n, table.shape[1]))
        rows = self.arena.alloc((n, table.raw.shape[1]), np.uint8)
        embed_quant_cuda(table.raw, table.qtype, table.shape[1], tokens, out=out, rows=rows, stream=self.stream)
        from ..kernels.matvec_fast import norm_parts_max
        from ..kernels.quantize_x import xq_size
        d = table.shape[1]
        self._carry = [(self.arena.alloc((n, d)), self.arena.alloc((norm_parts_max(d),)),
                        self.arena.alloc((xq_size(d, n, MATVEC_X8),), np.uint16) if self._x8_rows(out) else None)
                       for _ in range(2)]
        self._flip = 0
        self._frags = {}  # another forward (or model) on this stream may have rewritten them
        self.arena.mark()  # the residual stream (and the carried norms) outlive every layer
        return out

    def _x8_rows(self, x) -> bool:
        """Whether x's projections take int8 x (MATVEC_X8, a model with int8-x weights,
        decode widths)."""
        return (self.x8_weights and len(x.shape) == 2 and x.shape[0] <= FAST_MATVEC_MAX_ROWS
                and x.shape[1] % 32 == 0)

    def _written(self, a):
        """a is rewritten in place: its kept conversions (fragments, int8 form) and its
        in-range mark no longer hold."""
        self._frags = {qt: f for qt, f in self._frags.items() if f[0] is not a}
        if self._xq is not None and self._xq[0] is a:
            self._xq = None
        self._in_range = [r for r in self._in_range if r is not a]

    def _frags_for(self, x, qtype):
        """matvec_mma's fragments of x for qtype's layout: the kept conversion when it is of
        x, else a new one (the f16 guard's fixup unless x is known in range)."""
        from ..kernels.matvec_mma import x_frags
        kept = self._frags.get(qtype)
        if kept is not None and kept[0] is x:
            if kept[1] is not None:
                return kept[1]
            from ..kernels.matvec_mma import frags_fixup
            f = frags_fixup(x, qtype, self.stream, gated_out=True)  # the gated kernel's: only the guard's fixup left
        else:
            f = x_frags(x, qtype, self.stream, self._guard(x))
        self._frags[qtype] = (x, f)
        return f

    def rms_norm(self, x, w, eps, out=None, xq=None):
        """out (default: new) = RMSNorm of x's rows; xq: where the int8 form goes where the
        projections take one (default: new). On matvec_mma's widths, with the output in
        f16's range, the fragments of both weight layouts come from the same launch."""
        from ..kernels.norm import rms_norm_cuda
        out = self._out(x.shape) if out is None else out
        in_range = _norm_in_range(w, x.shape[len(x.shape) - 1])
        if self._norm_frags(x, in_range):
            from ..kernels.matvec_mma import rms_norm_frags
            for qt, f in rms_norm_frags(x, w, eps, out, stream=self.stream).items():
                self._frags[qt] = (out, f)
            self._in_range.append(out)
            return out
        if self._x8_rows(x):
            # the norm feeds projections (q, k, v; gate and up; the output head) that take
            # int8 x: made in the same launch
            from ..kernels.quantize_x import rms_norm_quantize, xq_size
            if xq is None:
                xq = self.arena.alloc((xq_size(x.shape[1], x.shape[0], MATVEC_X8),), np.uint16)
            rms_norm_quantize(x, w, eps, out, xq, stream=self.stream, planes=MATVEC_X8)
            self._xq = (out, xq)
        else:
            rms_norm_cuda(x, w, eps, out=out, stream=self.stream)
        if in_range:
            self._in_range.append(out)
        return out

    def _norm_frags(self, x, in_range: bool) -> bool:
        """Whether rms_norm of x (its weight in_range) makes matvec_mma's fragments."""
        return (in_range and len(x.shape) == 2 and _takes_mma(x.shape[0], T.Q4_K, x.shape[1])
                and not self._x8_rows(x))

    def post_norm_residual(self, y, x, w_post, w_next, eps):
        """Gemma's residual step x += RMSNorm(y) w_post and the next norm h = RMSNorm(x)
        w_next: (x, h), h in the carried buffers (the next layer reads it). One launch
        (rms_norm_cuda's pre_weight, with h's int8 form where its projections take one),
        except where rms_norm makes matvec_mma's fragments."""
        y = self._plain(y)
        h, _, xq = self._carry[self._flip]
        if len(x.shape) != 2 or h.shape != x.shape or not self._own("rms_norm", "add"):
            x = self.add(x, self.rms_norm(y, w_post, eps))
            return x, self.rms_norm(x, w_next, eps)  # a plugin's: its own memory
        self._flip ^= 1
        self._written(h)
        in_range = _norm_in_range(w_next, x.shape[1])
        if self._norm_frags(x, in_range) or not FUSED_POST_NORM:
            x = self.add(x, self.rms_norm(y, w_post, eps))
            return x, self.rms_norm(x, w_next, eps, out=h, xq=xq)
        from ..kernels.norm import rms_norm_cuda
        self._written(x)
        xq = xq if self._x8_rows(x) else None
        rms_norm_cuda(y, w_next, eps, out=h, residual=x, residual_out=x, stream=self.stream, pre_weight=w_post, xq=xq,
                      planes=MATVEC_X8 or 1)
        if xq is not None:
            self._xq = (h, xq)
        if in_range:
            self._in_range.append(h)
        return x, h

    def linear_norm(self, x, w: DeviceWeight, residual, norm_w, eps):
        """residual += x W^T and the RMSNorm of the result: (residual, norm). The norm goes to
        the carried buffers (it may be read after the next new_layer). One decode row with
        a matvec_fast weight: a SplitNorm (FUSED_NORM), whose readers finish the norm."""
        from ..kernels.matvec_fast import FAST_TYPES, matvec_fast_norm, splits_norm
        h, parts, xq = self._carry[self._flip]
        self._flip ^= 1
        self._written(h)  # rewritten: rms_norm says again
        n = x.shape[0]
        if (FUSED_NORM and n == 1 and w.qtype in FAST_TYPES and splits_norm(w.raw)
                and ("norm" in X8_OUT or not self.x8_weights) and h.shape == residual.shape
                and self._own("linear", "linears", "gated_linear", "rms_norm", "take_rows")):
            x = self._plain(x)
            n_parts = matvec_fast_norm(w.raw, w.qtype, x, residual, norm_w, h, parts, stream=self.stream,
                                       xq=self._x8(x, w.qtype), xq_out=xq)
            return residual, SplitNorm(h, parts, n_parts, eps, residual, norm_w, xq)
        if (MMA_NORM and _takes_mma(n, w.qtype, w.shape[1]) and h.shape == residual.shape
                and _takes_mma(n, T.Q4_K, residual.shape[1]) and not self._x8_rows(residual)
                and _norm_in_range(norm_w, residual.shape[1])
                and self._own("linear", "linears", "gated_linear", "rms_norm", "take_rows")):
            from ..kernels.matvec_mma import matvec_mma_norm
            x = self._plain(x)
            self._written(residual)
            g8 = w.g8 is not None
            frags = matvec_mma_norm(w.g8 if g8 else w.raw, w.qtype, x, residual, norm_w, eps, stream=self.stream,
                                    frags=self._frags_for(x, w.qtype), layout="g8" if g8 else None)
            hn = MmaNorm(h, residual, norm_w, eps)
            for qt, f in frags.items():
                self._frags[qt] = (hn, f)
            return residual, hn
        residual = self.linear(x, w, residual=residual)
        if self._own("rms_norm") and h.shape == residual.shape:
            return residual, self.rms_norm(residual, norm_w, eps, out=h, xq=xq)
        return residual, self.rms_norm(residual, norm_w, eps)  # a plugin's: its own memory

    def linear(self, x, w: DeviceWeight, bias=None, residual=None):
        from ..kernels.matmul import matmul
        from ..kernels.matvec import matvec
        from ..kernels.matvec_fast import FAST_TYPES, matvec_fast
        from ..kernels.matvec_mma import matvec_mma
        n = x.shape[0]
        if isinstance(x, SplitNorm):
            from ..kernels.matvec_fast import splits_norm
            if w.qtype in FAST_TYPES and splits_norm(w.raw):
                out = residual if residual is not None else self._out((n, w.shape[0]))
                return matvec_fast(w.raw, w.qtype, x.xg, out=out, bias=bias, residual=residual,
                                   stream=self.stream, x_norm=x.x_norm, xq=x.xq)
            x = self._plain(x)
        if isinstance(x, MmaNorm):
            x = self._mma_x(x, (w.qtype,)) if _takes_mma(n, w.qtype, w.shape[1]) else self._plain(x)
        # the residual stream is updated in place: out aliases residual
        out = residual if residual is not None else self._out((n, w.shape[0]))
        if residual is not None:
            self._written(residual)
        if _takes_mma(n, w.qtype, w.shape[1]):
            g8 = w.g8 is not None
            return matvec_mma(w.g8 if g8 else w.raw, w.qtype, x, w.shape[0], out=out, bias=bias, residual=residual,
                              stream=self.stream, frags=self._frags_for(x, w.qtype), layout="g8" if g8 else None)
        if n <= FAST_MATVEC_MAX_ROWS and w.qtype in FAST_TYPES:  # decode, 2-token verification
            return matvec_fast(w.raw, w.qtype, x, out=out, bias=bias, residual=residual,
                               stream=self.stream, xq=self._x8(x, w.qtype))
        if _takes_matmul(n, w.qtype, w.shape[1]):
            return matmul(x, w.raw, w.qtype, w.shape[0], w.shape[1], out=out, bias=bias, residual=residual,
                          stream=self.stream, x_guard=self._guard(x))
        # a few rows; also long prefill of types the matmul lacks, 64 rows at a time
        for s in range(0, n, MAX_MATVEC_ROWS):
            e = min(n, s + MAX_MATVEC_ROWS)
            matvec(w.raw, w.qtype, x[s:e], out=out[s:e], bias=bias,
                   residual=None if residual is None else residual[s:e], stream=self.stream)
        return out

    def linears(self, x, ws, biases):
        """linear(x, w, b) for each (w, b). On decode widths, two consecutive weights of one
        type and width that matvec_fast takes (q and k of a Q4_K_M model) run as one
        launch (PAIR_PROJECTIONS), and on matvec_mma's widths two consecutive weights of one
        type and width too; weights of one type share x's conversion."""
        outs, i = [], 0
        while i < len(ws):
            if i + 1 < len(ws) and self._pairable(x, ws[i], ws[i + 1], biases[i], biases[i + 1]):
                from ..kernels.matvec_fast import matvec_fast_pair
                w, w2 = ws[i], ws[i + 1]
                n = x.shape[0]
                split = isinstance(x, SplitNorm)
                xq = x.xq if split else self._x8(x, w.qtype)
                third = None
                if i + 2 < len(ws) and self._third_fits(x, w, ws[i + 2], biases[i], biases[i + 2], xq is not None):
                    w3 = ws[i + 2]
                    third = (w3.raw, w3.qtype, self._out((n, w3.shape[0])), biases[i + 2])
                outs += matvec_fast_pair(w.raw, w2.raw, w.qtype, x.xg if split else x, self._out((n, w.shape[0])),
                                         self._out((n, w2.shape[0])), biases[i], biases[i + 1], stream=self.stream,
                                         xq=xq, x_norm=x.x_norm if split else None, third=third)
                i += 2 if third is None else 3
            elif _takes_mma(x.shape[0], ws[i].qtype, ws[i].shape[1]):
                x = self._mma_x(x, {wi.qtype for wi in ws[i:i + 3]})
                # one f16 conversion of x per weight type (q and k of a Q4_K_M model share one)
                from ..kernels.matvec_mma import matvec_mma, matvec_mma_pair
                w, n = ws[i], x.shape[0]
                if (PAIR_PROJECTIONS and i + 1 < len(ws) and ws[i + 1].qtype == w.qtype
                        and ws[i + 1].shape[1] == w.shape[1] and (biases[i] is None) == (biases[i + 1] is None)):
                    w2 = ws[i + 1]
                    frags, third = self._frags_for(x, w.qtype), None
                    if i + 2 < len(ws) and self._mma_third_fits(x, w, w2, ws[i + 2], biases[i], biases[i + 2]):
                        w3 = ws[i + 2]
                        third = (w3.raw, w3.qtype, w3.shape[0], self._out((n, w3.shape[0])), biases[i + 2],
                                 frags if w3.qtype == w.qtype else self._frags_for(x, w3.qtype))
                    outs += matvec_mma_pair(w.raw, w2.raw, w.qtype, x, w.shape[0], w2.shape[0],
                                            self._out((n, w.shape[0])), self._out((n, w2.shape[0])), biases[i],
                                            biases[i + 1], stream=self.stream, frags=frags, third=third)
                    i += 2 if third is None else 3
                    continue
                outs.append(matvec_mma(w.raw, w.qtype, x, w.shape[0], out=self._out((n, w.shape[0])),
                                       bias=biases[i], stream=self.stream, frags=self._frags_for(x, w.qtype)))
                i += 1
            else:
                outs.append(self.linear(x, ws[i], biases[i]))
                i += 1
        if self.fuse_kv_write and len(ws) == 3:  # q, k, v: the v a fused K/V write in qk_rope stores with k
            self._v_for = (_addr(outs[1]), outs[2])
        return outs

    @staticmethod
    def _pairable(x, w: DeviceWeight, w2: DeviceWeight, b, b2) -> bool:
        from ..kernels.matvec_fast import FAST_TYPES, splits_norm
        n = x.shape[0]
        return (PAIR_PROJECTIONS and n <= FAST_MATVEC_MAX_ROWS and w.qtype == w2.qtype and w.qtype in FAST_TYPES
                and w.shape[1] == w2.shape[1] and (b is None) == (b2 is None)
                and not _takes_mma(n, w.qtype, w.shape[1])
                and (not isinstance(x, SplitNorm) or splits_norm(w.raw, w2.raw)))

    @staticmethod
    def _mma_third_fits(x, w: DeviceWeight, w2: DeviceWeight, w3: DeviceWeight, b, b3) -> bool:
        """Whether w3 can ride as the third weight of w and w2's matvec_mma_pair (MMA_TRIO)."""
        from ..kernels.matvec_mma import third_align
        n_ab = w.shape[0] + w2.shape[0]
        return (MMA_TRIO and _takes_mma(x.shape[0], w3.qtype, w3.shape[1]) and w3.g8 is None
                and w3.shape[1] == w.shape[1] and (b is None) == (b3 is None)
                and n_ab % third_align(x.shape[0], n_ab, w.shape[1]) == 0)

    @staticmethod
    def _third_fits(x, w: DeviceWeight, w3: DeviceWeight, b, b3, x8: bool) -> bool:
        """Whether w3 can ride as the third weight of w's pair launch (TRIO_PROJECTIONS)."""
        from ..kernels.matvec_fast import FAST_SPECS, X8_TYPES, splits_norm
        s, s3 = FAST_SPECS[w.qtype], FAST_SPECS.get(w3.qtype)
        return (TRIO_PROJECTIONS and s3 is not None and (s3.qk, s3.tpb) == (s.qk, s.tpb)
                and w3.shape[1] == w.shape[1] and (b is None) == (b3 is None) and splits_norm(w3.raw)
                and (not x8 or w3.qtype in X8_TYPES))

    def scale(self, x, s):
        from ..kernels.elementwise import axpby_cuda
        self._written(x)
        return axpby_cuda(x, x, s, 0.0, out=x, stream=self.stream)

    def add(self, x, y):
        from ..kernels.elementwise import axpby_cuda
        self._written(x)
        return axpby_cuda(x, y, 1.0, 1.0, out=x, stream=self.stream)

    def gated_linear(self, x, w_gate: DeviceWeight, w_up: DeviceWeight, act="silu"):
        from ..kernels.matmul import MATMUL_TYPES
        from ..kernels.matvec_fast import FAST_TYPES, swiglu_fast
        from ..kernels.matvec_mma import matvec_mma
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"gated_linear: unknown activation {act!r}")
        n = x.shape[0]
        qt = w_gate.qtype
        # decode rows: both products and the activation in one launch (SwiGLU, and Gemma's
        # GeGLU where FUSED_GEGLU), with the output's int8 form for the down projection
        fast = act == "silu" or FUSED_GEGLU
        if isinstance(x, SplitNorm):
            from ..kernels.matvec_fast import splits_norm
            if fast and w_up.qtype == qt and qt in FAST_TYPES and splits_norm(w_gate.raw, w_up.raw):
                h = self._out((n, w_gate.shape[0]))
                return swiglu_fast(w_gate.raw, w_up.raw, qt, x.xg, out=h, stream=self.stream, x_norm=x.x_norm,
                                   xq=x.xq, xq_out=self._xq_out(h), act=act)
            x = self._plain(x)
        k = x.shape[1]
        if isinstance(x, MmaNorm):
            x = self._mma_x(x, (qt,)) if act == "silu" and w_up.qtype == qt and _takes_mma(n, qt, k) else \
                self._plain(x)
        if act == "silu" and w_up.qtype == qt and _takes_mma(n, qt, k):
            n_ff = w_gate.shape[0]
            frags_out = GATED_FRAGS and _takes_mma(n, T.Q4_K, n_ff)  # the down projection takes matvec_mma too
            h = matvec_mma(w_gate.raw, qt, x, n_ff, out=self._out((n, n_ff)), stream=self.stream, w_up=w_up.raw,
                           frags=self._frags_for(x, qt), frags_out=frags_out)
            if frags_out:
                for layout in (T.Q4_K, T.Q6_K):
                    self._frags[layout] = (h, None)  # written, less the fixup (see _frags_for)
            return h
        if w_up.qtype == qt:
            if fast and n <= FAST_MATVEC_MAX_ROWS and qt in FAST_TYPES and not _takes_mma(n, qt, k):
                h = self._out((n, w_gate.shape[0]))
                return swiglu_fast(w_gate.raw, w_up.raw, qt, x, out=h, stream=self.stream, xq=self._x8(x, qt),
                                   xq_out=self._xq_out(h), act=act)
            if act == "silu" and (n < MATMUL_MIN_ROWS or qt not in MATMUL_TYPES and n <= MAX_MATVEC_ROWS):
                from ..kernels.matvec import swiglu
                return swiglu(w_gate.raw, w_up.raw, qt, x, out=self._out((n, w_gate.shape[0])),
                              stream=self.stream)
            h = self._gated_matmul(x, w_gate, w_up, act)
            if h is not None:
                return h
        # both products, then the activation (GeGLU's through one `linears`: x converted once)
        from ..kernels.activation import glu_cuda
        g, u = (self.linear(x, w_gate), self.linear(x, w_up)) if act == "silu" else \
            self.linears(x, (w_gate, w_up), (None, None))
        return glu_cuda(g, u, "swiglu" if act == "silu" else "geglu", out=g, stream=self.stream)

    def _gated_matmul(self, x, w_gate: DeviceWeight, w_up: DeviceWeight, act: str):
        """act(x W_gate^T) * (x W_up^T) as one matmul launch (FUSED_GATED_MATMUL) on the
        widths where linear() would take the matmul for both products; None elsewhere."""
        from ..kernels.matmul import matmul, pick_tile
        n, qt = x.shape[0], w_gate.qtype
        n_ff, k = w_gate.shape
        if (not FUSED_GATED_MATMUL or isinstance(x, SplitNorm) or w_up.qtype != qt or w_up.shape != w_gate.shape
                or not _takes_matmul(n, qt, k) or n_ff % (pick_tile(n, 2 * n_ff, k, qt)[0][1] // 2)):
            return None
        return matmul(x, w_gate.raw, qt, n_ff, k, out=self._out((n, n_ff)), stream=self.stream,
                      x_guard=self._guard(x), w_up=w_up.raw, act=act)

    @staticmethod
    def split_heads(x, n_heads, head_dim):
        return x.reshape((x.shape[0], n_heads, head_dim))

    def merge_heads(self, x):
        y = x.reshape((x.shape[0], x.shape[1] * x.shape[2]))
        if self._xq is not None and self._xq[0] is x:  # attention's int8 form: the same memory
            self._xq = (y, self._xq[1])
        for qt, kept in list(self._frags.items()):  # ... and its fragments
            if kept[0] is x:
                self._frags[qt] = (y, kept[1])
        if not self._guard(x):
            self._in_range.append(y)
        return y

    def take_rows(self, x, rows):
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        if hi - lo != len(rows):
            raise ValueError("the CUDA backend returns logits for a contiguous range of rows")
        if (lo, hi) == (0, x.shape[0]):  # the same object: a SplitNorm, or x with its int8 form
            return x
        return self._plain(x)[lo:hi]

    def rope(self, x, positions, rope_dim, base, style, freq_scale=1.0):
        from ..kernels.rope import rope_cuda
        return rope_cuda(x, positions, rope_dim, base, style, stream=self.stream, freq_scale=freq_scale)

    def qk_rope(self, q, k, positions, q_norm, k_norm, eps, rope_dim, base, style, freq_scale=1.0):
        from ..kernels.attention import rope_args, rope_fuses
        from ..kernels.qk_rope import qk_rope_cuda
        write = None
        kv = self.kv_ref() if self.kv_ref is not None else None
        if (self.fuse_rope and kv is not None and kv.k_scale is None and self._v_for is not None
                and self._v_for[0] == _addr(k) and rope_fuses(q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                                              self.n_keys, long=self.long_context)):
            # decode: attention norms and rotates q and k itself (and stores k and v)
            v = self._v_for[1].reshape(tuple(k.shape))
            self._rope_for = (_addr(q), _addr(k), rope_args(k, v, q_norm, k_norm, eps, rope_dim, base, style,
                                                            freq_scale))
            return q, k
        if (self.fuse_kv_write and kv is not None and kv.k_scale is None and self._v_for is not None
                and self._v_for[0] == _addr(k)):
            write = (self._v_for[1].reshape(tuple(k.shape)), kv.k_pool, kv.v_pool, kv.table_d, self._layer, kv.meta,
                     kv.pos_d)
            self._kv_written = self._layer
        return qk_rope_cuda(q, k, positions, q_norm, k_norm, eps, rope_dim, base, style, stream=self.stream,
                            freq_scale=freq_scale, kv_write=write)

    def attention(self, kv: PagedKVCache, layer, q, k, v, positions, mask, window):
        from ..kernels.attention import attention_plan, combines, paged_attention_cuda
        from ..kernels.paging import write_kv_cuda
        written, self._kv_written = self._kv_written, None
        rope, self._rope_for = self._rope_for, None
        if rope is not None:
            if (rope[0], rope[1]) != (_addr(q), _addr(k)) or kv is not self.kv_ref():
                raise RuntimeError("qk_rope left its rotation to attention, which got other q/k or another cache: "
                                   "set LUCE_FUSED_ROPE=0")
        elif written is None:
            write_kv_cuda(kv.k_pool, kv.v_pool, kv.table_d, layer, kv.meta, k, v, positions, kv.pos_d, self.stream)
        elif written != layer or kv is not self.kv_ref():  # rows stored under another layer: say so, loudly
            raise RuntimeError(f"qk_rope wrote the K/V rows of layer {written} into the cache, attention is at layer "
                               f"{layer}: set LUCE_FUSED_KV_WRITE=0")
        n, hq, d = q.shape
        plan = attention_plan(n, hq, kv.n_kv_heads, d, self.n_keys, long=self.long_context)
        ns = plan["n_splits"]
        scratch = (self.arena.alloc((ns, n, hq, d)), self.arena.alloc((ns, n, hq, 2))) if ns > 1 else None
        out = self._out((n, hq, d))
        xq = self._xq_out(out.reshape((n, hq * d)), "attn")
        # verification widths: the combine also writes the o projection's fragments (both
        # layouts), where the pool is f16 (outputs in f16's range) and this op's reader is ours
        frags = None
        if (ATTN_FRAGS and xq is None and kv.k_scale is None and combines(plan) and self._own("linear_norm", "linear")
                and _takes_mma(n, T.Q4_K, hq * d)):
            from ..kernels.matvec_mma import frags_targets
            frags = frags_targets(n, hq * d, self.stream)
        out = paged_attention_cuda(q, kv.k_pool, kv.v_pool, kv.table_d, layer, kv.meta, kv.pos_d, positions,
                                   self.mask_bits, window=window or 0, n_keys=self.n_keys, out=out, scratch=scratch,
                                   xq_out=xq, xq_planes=MATVEC_X8, rope=None if rope is None else rope[2],
                                   long=self.long_context, stream=self.stream,
                                   frags_out=None if frags is None else (frags[T.Q4_K][0], frags[T.Q6_K][0]))
        if xq is not None:
            self._xq = (out, xq)  # merge_heads passes it on to its view
        if frags is not None:  # merge_heads passes them on to its view
            for qt, f in frags.items():
                self._frags[qt] = (out, f)
        if kv.k_scale is None:  # each output a convex sum of f16 values: within f16's range
            self._in_range.append(out)
        return out


class CUDABackend:
    name = "cuda"
    graph_prefill = True  # prompts in power-of-two pieces: see PREFILL_GRAPH_MAX

    def __init__(self, use_graphs: bool = True, kv_dtype=np.float16):
        from numba import cuda
        self.cuda = cuda
        self.stream = cuda.stream()
        self.use_graphs = use_graphs and not cuda.config.ENABLE_CUDASIM  # the simulator has no graphs
        self.kv_dtype = kv_dtype
        self._state = {}  # (id(weights), id(cache)) -> device state of a model and a cache
        self._persistent_packs = {}  # id(weights) -> PackedWeights (LUCE_PERSISTENT_DECODE)
        # (width, tree, logits rows) forms that have run eagerly on this backend: their kernels
        # are compiled, so a graph may be recorded at once (compiling inside a capture is not safe)
        self._compiled = set()
        self._ungraphable = set()  # forward keys whose capture failed
        self._g8_names = None  # plan_weights: the tensors with a Q6_K groups copy
        self._warm_long = False  # warmup: a decode forward as over a long context (its kernels)
        # forwards by how they ran: a timed loop that still records graphs or runs eagerly
        # measures one-time costs (the spec bench prints these over its timed runs)
        self.forward_counts = {"replayed": 0, "captured": 0, "eager": 0}

    @property
    def wait_s(self) -> float:
        """Seconds the host has spent blocked on the GPU in this process (forwards' result
        copies, pending tokens and candidates): what a phase's wall time less its change is
        host work (the spec bench's breakdown of a target forward)."""
        return _WAITED[0]

    device_sampling = True  # forward_next_token draws sampled tokens too (sample=...)

    @property
    def pipelined_greedy(self) -> bool:
        """Whether generate decodes through forward_next_token (engine.generator.DeviceStepper):
        with graphs (eager launches keep the host busy anyway) unless LUCE_ASYNC_HOST=0."""
        from . import cuda_copy
        return self.use_graphs and cuda_copy.ASYNC_HOST

    # -- weights ------------------------------------------------------------------
    def load_tensor(self, info):
        import gguf
        from ..kernels.dequant import dequantize
        cuda = self.cuda
        Q = gguf.GGMLQuantizationType
        if len(info.shape) == 1:  # norms and biases: small, float32
            host = dequantize(info.data, info.qtype, info.shape).astype(np.float32)
            dev = cuda.to_device(host)
            dev.luce_absmax = float(np.abs(host).max()) if host.size else 0.0  # see CudaOps.rms_norm
            return dev
        rows, cols = info.shape
        if info.qtype == Q.F32:  # the kernels read f16/bf16/quantized rows: keep f32 matrices as f16
            raw = dequantize(info.data, info.qtype, info.shape).astype(np.float16).view(np.uint8)
            return DeviceWeight(cuda.to_device(raw.reshape(rows, -1)), Q.F16, (rows, cols))
        host = np.asarray(info.data).reshape(rows, -1)
        return DeviceWeight(cuda.to_device(host), info.qtype, (rows, cols),
                            _g8_copy(cuda, host, info.qtype, cols, info.name, self._g8_names))

    def plan_weights(self, tensors: dict, tied_output: bool) -> None:
        """Before load_tensor: decide which Q6_K weights also get the groups copy (g8_plan),
        from the model's tensors and the device's free memory now."""
        free, total = self.cuda.current_context().get_memory_info()
        self._g8_names = g8_plan(tensors, tied_output, free, total)

    def tiled_weight(self, pool: np.ndarray, qtype, rows: int, cols: int, name: str | None = None,
                     start: int = 0) -> DeviceWeight:
        """A [rows, row_bytes] device weight filled by repeating the host rows of `pool` from
        row `start` on, wrapping (random-weight benchmark models: one small upload, then
        device copies)."""
        cuda = self.cuda

        def tiled(src):
            dst = cuda.device_array((rows, pool.shape[1]), dtype=np.uint8)
            for r, s, n in tile_runs(pool.shape[0], rows, start):
                dst[r:r + n].copy_to_device(src[s:s + n])
            return dst
        g8 = _g8_copy(cuda, pool, qtype, cols, name, self._g8_names)  # the layout is by row: the tiling of the pool's
        w = DeviceWeight(tiled(cuda.to_device(pool)), qtype, (rows, cols), None if g8 is None else tiled(g8))
        cuda.synchronize()
        return w

    def warmup(self, family, cfg, weights, widths=WARMUP_WIDTHS) -> None:
        """Compile every kernel specialization the first requests will meet (decode, the
        verification widths, a prefill chunk) at load time, on a throwaway cache."""
        kv = self.new_cache(cfg, 2 * max(widths) + 8)
        for n in widths:
            self.forward(family, cfg, weights, kv, np.zeros(n, np.int64), np.arange(n), None, [n - 1])
            kv.commit([])
        self.forward_next_token(family, cfg, weights, kv, 0, 0).result()  # greedy decode: + the argmax
        kv.commit([])
        from ..kernels.attention import long_context_differs
        for n in widths:  # long-context attention (attention_plan's long), on this short cache
            if long_context_differs(n, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, kv.n_ctx, kv.k_scale is not None):
                self._warm_long = True
                try:
                    self.forward(family, cfg, weights, kv, np.zeros(n, np.int64), np.arange(n), None, [n - 1])
                finally:
                    self._warm_long = False
                kv.commit([])
        self._forget((id(weights), id(kv)))

    def new_cache(self, cfg, n_ctx: int) -> PagedKVCache:
        return PagedKVCache(cfg.n_layers, n_ctx, cfg.n_kv_heads, cfg.head_dim, dtype=self.kv_dtype, device=True,
                            stream=self.stream)

    # -- forward ------------------------------------------------------------------
    def _forget(self, key) -> None:
        self._state.pop(key, None)

    def _model_state(self, family, cfg, weights, kv):
        key = (id(weights), id(kv))
        st = self._state.get(key)
        if st is None:
            from ..plugins import ops_with_overrides
            ops = CudaOps(self, cfg)
            st = self._state[key] = {"ops": ops, "run_ops": ops_with_overrides(ops, family, self.name),
                                     "graphs": {}, "arena_tokens": 0, "inputs": None}
            ops.n_keys = kv.n_ctx
            ops.x8_weights = MATVEC_X8 > 0 and _takes_int8_x(weights)
            # the pool write rides in qk_rope only where linears, qk_rope and attention are ours;
            # a weak reference: the state must not keep its cache alive (see below)
            ops.fuse_kv_write = FUSED_KV_WRITE and st["run_ops"] is ops
            ops.fuse_rope = FUSED_ROPE and ops.fuse_kv_write and cfg.attn_scale is None
            ops.kv_ref = weakref.ref(kv)
            st["persistent"] = self._persistent_decode(cfg, weights, kv) if st["run_ops"] is ops else None
            # The state (its graphs point at this cache's pools) dies with the cache: a later
            # cache may get the same id(), and replaying these graphs would read freed memory.
            weakref.finalize(kv, self._forget, key)
        return st

    def _persistent_decode(self, cfg, weights, kv):
        """The persistent one-token forward for this model and cache where it is on and
        takes them, else None; the packed weights are shared by every cache of a model."""
        on = not self.cuda.config.ENABLE_CUDASIM if PERSISTENT_DECODE is None else PERSISTENT_DECODE
        if not on:
            return None
        from ..kernels.persistent_decode import KINDS, PackedWeights, PersistentDecode, applies
        if applies(cfg, weights, kv) is not None:
            return None
        if PERSISTENT_DECODE is None and \
                sum(getattr(lw, k).raw.nbytes for lw in weights.layers for k in KINDS) > PERSISTENT_DEFAULT_BYTES:
            return None
        packs = self._persistent_packs
        pack = packs.get(id(weights))
        if pack is None:
            pack = packs[id(weights)] = PackedWeights(cfg, weights, self.stream)
            weakref.finalize(weights, packs.pop, id(weights), None)
        try:
            return PersistentDecode(cfg, weights, kv, stream=self.stream, packed=pack)
        except ValueError:  # a model the kernel refuses (applies() above, int8 x)
            return None

    def _ensure_arena(self, st, cfg, n_tokens: int, kv):
        if st["arena_tokens"] >= n_tokens:
            return
        from ..kernels.attention import attention_plan
        n = max(n_tokens, 1)
        per_tok = 4 * (9 * cfg.n_embd + 4 * cfg.q_dim + 4 * cfg.kv_dim + 3 * cfg.n_ff) + 64
        # the largest split scratch of a forward up to n tokens over a short or a long
        # context: decode's kernels and a one-tile tree's (Q in shared memory) take more
        # splits than wider forwards (attention_plan: ~2 us a call)
        attn = max(4 * p["n_splits"] * m * cfg.n_heads * (cfg.head_dim + 2) if p["n_splits"] > 1 else 0
                   for m, p in ((m, attention_plan(m, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, kv.n_ctx, long=lg))
                                for m in {n} | set(range(1, min(n, 64) + 1)) for lg in (False, True)))
        logits = 4 * n * cfg.vocab_size
        size = per_tok * n + attn + logits + n * 8192 + 16 * ALIGN * (cfg.n_layers + 16) + (1 << 20)
        st["ops"].arena = Arena(size)
        st["arena_tokens"] = n
        st["graphs"].clear()  # captured graphs point into the old arena
        cuda = self.cuda
        st["inputs"] = {"tokens": cuda.device_array(n, np.int32), "positions": cuda.device_array(n, np.int32),
                        "mask": cuda.device_array(n, np.uint64)}

    def _graphable(self, n: int) -> bool:
        """Decode and verification widths, and the power-of-two prefill pieces."""
        return self.use_graphs and (n <= GRAPH_WIDTHS_MAX or _is_pow2(n) and n <= PREFILL_GRAPH_MAX)

    def forward(self, family, cfg, weights, kv: PagedKVCache, tokens, positions, mask=None, logits_rows=None):
        st, logits = self._launch(family, cfg, weights, kv, tokens, positions, mask, logits_rows)
        # Through a pinned buffer kept per logits shape: a pageable destination makes the
        # driver stage the copy, and a fresh numpy array each step adds an allocation.
        host = st.setdefault("host_logits", {})
        buf = host.get(logits.shape)
        if buf is None:
            buf = host[logits.shape] = self.cuda.pinned_array(logits.shape, np.float32)
        _waited(d2h_sync, buf, logits, self.stream)
        return buf.copy()  # callers keep logits across steps; the buffer is reused

    def forward_greedy(self, family, cfg, weights, kv: PagedKVCache, tokens, positions, mask=None):
        """forward for greedy verification: every row's argmax is taken inside the graph and
        only those come back (4 bytes a row); a row's logits are copied when asked for, until
        the next forward on this model state reuses the device buffer."""
        return self.queue_greedy(family, cfg, weights, kv, tokens, positions, mask).result()

    def queue_greedy(self, family, cfg, weights, kv: PagedKVCache, tokens, positions, mask=None) -> "PendingRows":
        """forward_greedy queued: returns at once, its GreedyRows from `.result()`. Meanwhile
        another model's work (a draft's next steps, on its own stream) can run beside it."""
        n = len(tokens)
        st = self._model_state(family, cfg, weights, kv)
        ids_d = st.setdefault("row_ids", {})
        if n not in ids_d:  # a fixed address per width: graphs write into it
            ids_d[n] = (self.cuda.device_array(n, np.int32), self.cuda.pinned_array(n, np.int32), self.cuda.event())
        st, logits = self._launch(family, cfg, weights, kv, tokens, positions, mask, None, argmax=ids_d[n][0])
        dev, host, event = ids_d[n]
        d2h_async(host, dev, self.stream)
        event.record(self.stream)
        turn = st["forward_turn"]

        def fetch(i):
            if st["forward_turn"] != turn:
                raise RuntimeError("logits of an earlier forward: its device buffer has been reused")
            row = st.get("row_host")
            if row is None or row.shape[0] != logits.shape[1]:
                row = st["row_host"] = self.cuda.pinned_array(logits.shape[1], np.float32)
            d2h_sync(row, logits[i], self.stream)
            return row.copy()
        return PendingRows(host, event, fetch)

    def forward_next_token(self, family, cfg, weights, kv: PagedKVCache, token, position,
                           sample=None) -> "PendingToken":
        """Queue a one-token decode forward whose next token is computed inside the graph
        and read back as 4 bytes; returns at once. The token is the argmax of the logits,
        or with `sample` (luce.kernels.sampling.sample_params: the host's uniform and the
        parameters, for which sample_applies holds) the one drawn as sample_ref draws it.
        token None: the next token of the previous forward_next_token on this model and
        cache, taken on the device, so a caller can queue a step before it has read the
        token it consumes. Nothing here waits for the GPU."""
        st = self._model_state(family, cfg, weights, kv)
        self._next_token_buffers(st)
        if token is None and not st.get("next_token_set"):
            raise RuntimeError("forward_next_token(None) needs a queued forward_next_token before it")
        draw = None
        if sample is not None:
            self._sampling_buffers(st, cfg)
            h2d(st["sample_params"], np.asarray(sample, np.float64), self.stream)
            draw = (st["sample_params"], st["sample_scratch"], st["sample_state"])
        self._launch(family, cfg, weights, kv, None if token is None else [token], [position], None, None,
                     argmax=st["next_token"], draw=draw)
        st["next_token_set"] = True
        turn = st["token_turn"]
        st["token_turn"] += 1
        slot = _take_slot(st["token_slots"], turn)
        d2h_async(slot[0], st["next_token"], self.stream)
        slot[1].record(self.stream)
        return PendingToken(slot, turn)

    def forward_topk(self, family, cfg, weights, kv: PagedKVCache, token, position, k: int,
                     rows: int = 1) -> "PendingTopK":
        """forward_next_token's greedy step (token None: the previous step's argmax, still on
        the device) that also brings back the k best candidates of its logits and their
        log-probabilities, taken inside the graph (top-k and the log-sum-exp): a draft
        model's step. About 12 bytes a candidate come back instead of the logits row (600
        KB at a 152K vocabulary, then a host top-k and normalizer of ~0.5 ms a position),
        and the draft's steps queue one after another without waiting for the host.
        token may be a list (a draft catching up with the tokens the target accepted,
        at positions position..): one forward, the candidates after its last token, or
        with rows > 1 after each of its last `rows` tokens (a catch-up carrying a guess at
        the draft's chain: DraftModel's lookup seeding); a forward_topk(None) may not follow
        that one."""
        st = self._model_state(family, cfg, weights, kv)
        self._next_token_buffers(st)
        if token is None and not st.get("next_token_set"):
            raise RuntimeError("forward_topk(None) needs a queued forward_topk or forward_next_token before it")
        b = self._topk_buffers(st, cfg, k, rows)
        tokens = None if token is None else [int(t) for t in np.atleast_1d(token)]
        n = 1 if tokens is None else len(tokens)
        if not 1 <= rows <= n:
            raise ValueError(f"forward_topk: 1 <= rows <= {n} tokens, got {rows}")
        self._launch(family, cfg, weights, kv, tokens, list(range(position, position + n)), None,
                     list(range(n - rows, n)), argmax=st["next_token"] if rows == 1 else b["arg"], topk=b)
        st["next_token_set"] = rows == 1
        turn = b["turn"]
        b["turn"] += 1
        slot = _take_slot(b["slots"], turn)
        d2h_async(slot[0], b["i"], self.stream)
        d2h_async(slot[1], b["v"], self.stream)
        d2h_async(slot[2], b["lz"], self.stream)
        d2h_async(slot[3], b["scratch"][4], self.stream)  # the chain after this step
        slot[4].record(self.stream)
        return PendingTopK(slot, turn)

    def _topk_buffers(self, st, cfg, k: int, rows: int = 1) -> dict:
        """forward_topk's outputs, scratch and readback slots for k candidates of `rows` rows,
        at fixed addresses (graphs write into them)."""
        from ..kernels.sampling import MAX_TOP_K, topk_lse_scratch
        if not 1 <= k <= MAX_TOP_K:
            raise ValueError(f"forward_topk: 1 <= k <= {MAX_TOP_K}, got {k}")
        tk = st.setdefault("topk", {})
        key = k if rows == 1 else (k, rows)
        if key not in tk:
            cuda = self.cuda
            tk[key] = {"v": cuda.device_array((rows, k), np.float32), "i": cuda.device_array((rows, k), np.int32),
                       "lz": cuda.device_array(rows, np.float64), "arg": cuda.device_array(rows, np.int32),
                       "scratch": topk_lse_scratch(rows, cfg.vocab_size, k),
                       "slots": [[cuda.pinned_array((rows, k), np.int32), cuda.pinned_array((rows, k), np.float32),
                                  cuda.pinned_array(rows, np.float64), cuda.pinned_array((rows, 3), np.float64),
                                  cuda.event(), -1] for _ in range(TOKEN_SLOTS if rows == 1 else 2)],
                       "turn": 0}
        return tk[key]

    def begin_chain(self, family, cfg, weights, kv: PagedKVCache, k: int, log_p_min: float) -> bool:
        """Start a draft's chain on the device for forward_topk's steps with k candidates on
        this cache: nothing summed, stopped once the sum of its tokens' log-probabilities
        falls below log_p_min (-inf: never; luce.kernels.sampling.chain_state). Returns
        whether one-token steps queued past a stop do nothing (they go through the
        persistent kernel, which reads the chain): then a draft may queue every step at once
        and read PendingTopK.stopped. Where the launch chain would run them, nothing is
        written (the chain never stops) and the answer is False."""
        from ..kernels.sampling import chain_state
        st = self._model_state(family, cfg, weights, kv)
        if st["persistent"] is None:  # the chain stays never to stop: the host loop decides
            return False
        h2d(self._topk_buffers(st, cfg, k)["scratch"][4], chain_state(1, log_p_min), self.stream)
        return True

    @property
    def readback_slots(self) -> int:
        """Queued steps whose pending results (forward_next_token, forward_topk) stay
        readable: a caller reads them before queueing more."""
        return TOKEN_SLOTS

    def _next_token_buffers(self, st) -> None:
        if "next_token" not in st:
            cuda = self.cuda
            st["next_token"] = cuda.device_array(1, np.int32)  # the last token, at a fixed address
            st["token_slots"] = [[cuda.pinned_array(1, np.int32), cuda.event(), -1] for _ in range(TOKEN_SLOTS)]
            st["token_turn"] = 0

    def _sampling_buffers(self, st, cfg) -> None:
        """The draw's parameters, scratch and penalty state: fixed addresses, graphs read them."""
        if "sample_params" in st:
            return
        from ..kernels.sampling import MAX_REPEAT_WINDOW, sample_params, sample_scratch
        cuda = self.cuda
        st["sample_params"] = cuda.device_array(len(sample_params(1.0, 1, 1.0, 0.0, 0.0)), np.float64)
        st["sample_scratch"] = sample_scratch(cfg.vocab_size)
        st["sample_state"] = (cuda.device_array((2, cfg.vocab_size), np.int32),
                              cuda.device_array(2 + MAX_REPEAT_WINDOW, np.int32))

    def set_penalty_history(self, family, cfg, weights, kv: PagedKVCache, history, repeat_last_n: int) -> None:
        """The history the next forward_next_token draws penalize (luce.kernels.sampling.
        penalty_state); each draw with penalties then adds its token on the device."""
        from ..kernels.sampling import penalty_state
        st = self._model_state(family, cfg, weights, kv)
        self._sampling_buffers(st, cfg)
        pen, ring = penalty_state(history, cfg.vocab_size, repeat_last_n)
        h2d(st["sample_state"][0], pen, self.stream)
        h2d(st["sample_state"][1], ring, self.stream)

    def _launch(self, family, cfg, weights, kv: PagedKVCache, tokens, positions, mask, logits_rows, argmax=None,
                draw=None, topk=None):
        """Queue one forward (a captured graph where it can); returns (model state, device
        logits). tokens None: one token, the model state's device-side next token. argmax:
        a device int32 array (fixed per width) that gets each logits row's argmax, or with
        draw (device sample parameters and scratch, fixed) the last row's drawn token.
        topk (forward_topk's buffers, one-token forwards): the row's top-k and log-sum-exp
        too."""
        from ..kernels.attention import tree_mask_bits
        n = 1 if tokens is None else len(tokens)
        st = self._model_state(family, cfg, weights, kv)
        self._ensure_arena(st, cfg, max(n, min(64, kv.n_ctx)), kv)
        kv.reserve(n)
        inp = st["inputs"]
        views = inp.setdefault("views", {})  # numba slicing costs ~50 us: once per width
        if n not in views:
            views[n] = inp["tokens"][:n], inp["positions"][:n], inp["mask"][:n]
        tok_d, pos_d, mask_d = views[n]
        if tokens is None:
            d2d(tok_d, st["next_token"], self.stream)
        else:
            h2d(tok_d, np.asarray(tokens, np.int32), self.stream)
        h2d(pos_d, np.asarray(positions, np.int32), self.stream)
        tree = mask is not None and not _is_causal(mask)
        if tree:
            h2d(mask_d, tree_mask_bits(mask), self.stream)
        rows = list(range(n)) if logits_rows is None else [int(r) for r in logits_rows]
        ops = st["ops"]
        run_ops = st["run_ops"]
        # attention's kernel or plan may depend on the context's length (decode's kernel, a
        # tree's Q: attention_plan's long): then a graph for each side of DECODE_LONG_KEYS
        # (whether they differ is fixed for a state and width: asked once, not every step)
        from ..kernels import attention_mma
        long = kv.n_past >= attention_mma.DECODE_LONG_KEYS or self._warm_long
        if long:
            differs = st.setdefault("long_differs", {})
            if n not in differs:
                from ..kernels.attention import long_context_differs
                differs[n] = long_context_differs(n, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ops.n_keys,
                                                  kv.k_scale is not None)
            long = differs[n]
        ops.long_context = long

        persistent = st["persistent"] if n == 1 and not tree and rows == [0] else None

        def run():
            if persistent is not None:
                st["logits"] = persistent.forward(tok_d, pos_d, None if topk is None else topk["scratch"][4])
            else:
                ops.begin_forward(mask_d if tree else None)
                st["logits"] = family.run_forward(cfg, weights, run_ops, kv, tok_d, pos_d, None, rows)
            if draw is not None:
                from ..kernels.sampling import sample_cuda
                logits = st["logits"]
                sample_cuda(logits, draw[0], argmax, scratch=draw[1], row=logits.shape[0] - 1, stream=self.stream,
                            state=draw[2])
            elif topk is not None:
                from ..kernels.sampling import topk_logsumexp_cuda
                topk_logsumexp_cuda(st["logits"], topk["v"].shape[1], topk["v"], topk["i"], topk["lz"], argmax,
                                    scratch=topk["scratch"], stream=self.stream)
            elif argmax is not None:
                from ..kernels.sampling import argmax_cuda
                argmax_cuda(st["logits"], out=argmax, stream=self.stream)

        st["forward_turn"] = st.get("forward_turn", 0) + 1
        # the argmax's destination is part of what a graph captured (next token, verify rows)
        key = (n, tree, tuple(rows), None if argmax is None else id(argmax), draw is not None,
               None if topk is None else id(topk), long)
        form = (n, tree, len(rows), argmax is not None, draw is not None, topk is not None, long)
        g = st["graphs"].get(key) if self.use_graphs else None
        if g is not None:
            graph, st["logits"] = g  # the output buffer this graph writes, not the last eager run's
            graph.replay()
            self.forward_counts["replayed"] += 1
        elif self._graphable(n) and form in self._compiled and key not in self._ungraphable:
            from . import cuda_graph
            try:
                graph = cuda_graph.Graph(self.stream, run)  # records only (host work of an eager run) ...
            except Exception as e:  # e.g. a plugin op that synchronizes: this form runs eagerly from now on
                import warnings
                warnings.warn(f"luce: no CUDA graph for a {n}-token forward ({e}); running it eagerly")
                self._ungraphable.add(key)
                run()
                self.forward_counts["eager"] += 1
            else:
                st["graphs"][key] = (graph, st["logits"])
                graph.replay()  # ... then runs
                self.forward_counts["captured"] += 1
        else:
            run()  # eager; also compiles every kernel before any capture
            self._compiled.add(form)
            self.forward_counts["eager"] += 1
        return st, st["logits"]


_WAITED = [0.0]  # CUDABackend.wait_s


def _waited(fn, *args):
    t = time.perf_counter()
    fn(*args)
    _WAITED[0] += time.perf_counter() - t


# pinned readback slots of queued next tokens a model state cycles through: a whole draft of
# the default depth (12) in flight, or one queued ahead (depth + 1)
TOKEN_SLOTS = 16


def _take_slot(slots, turn: int) -> list:
    """The pinned readback slot of step `turn` ([buffers..., event, turn]), once its copies
    of TOKEN_SLOTS steps ago have landed (at once, unless nobody read them)."""
    slot = slots[turn % TOKEN_SLOTS]
    slot[-2].synchronize()
    slot[-1] = turn
    return slot


class PendingToken:
    """A greedy next token on its way back from the GPU, readable until TOKEN_SLOTS later
    tokens of the same model state have been queued."""

    def __init__(self, slot, turn: int):
        self._slot, self._turn = slot, turn

    def result(self) -> int:
        host, event, turn = self._slot
        if turn != self._turn:
            raise RuntimeError(f"a pending token read after {TOKEN_SLOTS} more were queued: its slot is reused")
        _waited(event.synchronize)
        return int(host[0])


class PendingTopK:
    """A draft step's candidates on their way back from the GPU (forward_topk), readable
    until TOKEN_SLOTS later steps with the same k have been queued."""

    def __init__(self, slot, turn: int):
        self._slot, self._turn = slot, turn

    def result(self, row: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64 [k], log-probabilities float64 [k]), most likely first: what
        luce.engine.sampling.top_logprobs gives for the same logits (ids past the
        row's non-NaN logits are dropped). row: of forward_topk's rows (the last)."""
        ids, vals, lz, _, event, turn = self._slot
        if turn != self._turn:
            raise RuntimeError("pending candidates read after their slot was reused by later steps")
        _waited(event.synchronize)
        keep = ids[row] >= 0
        return ids[row][keep].astype(np.int64), vals[row][keep].astype(np.float64) - float(lz[row])

    @property
    def stopped(self) -> bool:
        """Whether the draft's chain (CUDABackend.begin_chain) had stopped by this step
        (read after result())."""
        from ..kernels.sampling import CHAIN_STOPPED
        return bool(self._slot[3][0, CHAIN_STOPPED] != 0.0)


class PendingRows:
    """A queued greedy forward's argmaxes on their way back (queue_greedy), read before the
    next forward of the same width on that model state."""

    def __init__(self, host, event, fetch):
        self._host, self._event, self._fetch = host, event, fetch

    def result(self):
        from . import GreedyRows
        _waited(self._event.synchronize)
        return GreedyRows(self._host.copy(), self._fetch)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=64)
def _tril(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


def _is_causal(mask) -> bool:
    m = np.asarray(mask, dtype=bool)
    return m.ndim == 2 and m.shape[0] == m.shape[1] and bool(np.array_equal(m, _tril(m.shape[0])))
