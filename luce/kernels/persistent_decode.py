"""A small model's whole one-token decode step in one persistent kernel (a "megakernel").

Why: a draft model's step is a chain of ~170 launches whose every op reads 0.5-3.5 MB and
is bound by latency (synthetic Qwen3-0.6B on an H100: graph 1,087 us a step against 906
us of ops, each 3-9 us; docs/benchmarks.md, thirty-fifth session), and speculative
decoding runs ~8 of those steps for every target forward. Here one launch of one block an
SM runs every layer, the phases separated by a grid barrier instead of a kernel boundary:

  (A) each block norms the residual stream itself (1-4 KB) into int8 x (or float x where
      a matrix is not Q4_K / Q6_K), warps take q/k/v row pairs; v goes straight into the
      paged pool;
  (B) attention items (kv head x group of 64-key pages): each item's K and first V loads
      issued first, then q's and the new k's head norm and rotation (a warp a head), the
      new k stored by the item holding its row, online softmax over the item's keys
      (TPK threads a key), each item's partials (output, max, sum) written;
  (C) every block merges the splits of the columns it stages (online softmax over the
      splits), warps take o's rows, added into the residual stream;
  (D) the norm again in each block, gate and up rows with SwiGLU;
  (E) down rows, added into the residual stream;
and after the last layer the output norm and the head's rows into logits (the backend's
argmax / top-k launches take them from there).

Status (docs/benchmarks.md, fortieth session): at the synthetic Qwen3-0.6B shape on an
H100, 947.5 us a step alone and 985.9 through the backend (the argmax / top-k launches
after it) against 1,157.2 for the backend's graph-replayed launch chain in the same call
(0.85x; 3,435 us alone at its first version), its GPU tests passing; so CUDABackend takes
it by default where applies() holds, for a draft's size of weights (LUCE_PERSISTENT_DECODE=0
turns it off). At the Qwen3-8B shape (its shared memory past 48 KB since it is one dynamic
allocation) it runs, but slower than the chain: 4,390 against 3,282 us a step on an H100
(forty-first session: every block stages each phase's whole x, 5-7.6 us a phase, and one
block of 16 warps an SM streams the rows slower than matvec_fast's grids). Where the time
goes is printed by `python -m luce.bench.persistent_decode [SHAPE]` (the phases' grid
barriers, block 0's stamps inside them).

Every block must be resident at once (the barrier waits for all of them): the grid is one
block an SM. The simulator runs blocks one after another, so there the grid is one block,
and every phase is a loop over its items strided by the grid that one block covers whole.

Scope: Llama/Qwen-style dense layers (RMSNorm, optional per-head q/k norm, RoPE of either
style, GQA, SwiGLU), Q4_K, Q6_K and Q8_0 weights, an f16 paged pool, no sliding window,
no biases. `applies(cfg, weights, kv)` says why a model is out of scope.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda
from numba import float32 as nb_float32

from ._reduce import WARP_RED_SLOTS, block_sum, warp_allmax, warp_allsum, warp_barrier, warp_groupsum
from . import disk_cache
from .device import SIM, SMEM_STATIC, device, with_shared
from .matvec_fast import (S8, _make_unit_q4_k_x8, _make_unit_q6_k_x8, i8f, k4_row, ld16, nib_acc, pieces, q6_acc,
                          q6_scales, q8_acc, shr32)
from .quantize_x import XQ2_BYTES, int8_quad_store
from .rope import sincos_at
from .sampling import CHAIN_STOPPED, chain_state
from .vector_load import f16_bits_to_f32, ld_u16_u32x4, ldcg_f32, ldcg_u16_u32x4, ldw_u16_u32x4, u32_bits_to_f32

__all__ = ["PackedWeights", "PersistentDecode", "applies", "QTYPE_CODES"]

PAGE = 64  # the pool's rows a block (luce.kv.paged.BLOCK)
KINDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm")
THREADS = 512  # a block (one an SM): 16 warps, at most 128 registers a thread
_Q4K, _Q6K, _Q8_0 = 0, 1, 2


def _qtype_codes():
    import gguf
    Q = gguf.GGMLQuantizationType
    return {Q.Q4_K: _Q4K, Q.Q6_K: _Q6K, Q.Q8_0: _Q8_0}


QTYPE_CODES = _qtype_codes()
_BLOCK = {_Q4K: (256, 144), _Q6K: (256, 210), _Q8_0: (32, 34)}  # (weights, bytes) a block


# ----------------------------------------------------------------------------- device side
if SIM:
    def _ld_acquire(a, i):
        return a[i]

    def _red_release(a, i, v):
        a[i] += v

    def _globaltimer():
        return np.int64(0)
else:
    from llvmlite import ir
    from numba.cuda import types as _types
    from numba.cuda.extending import intrinsic

    from .mma import _asm, _generic_addr

    @intrinsic
    def _ld_acquire(typingctx, a, i):
        """a[i] (int32) loaded with acquire semantics at GPU scope: the barrier's spin."""
        sig = _types.int32(a, i)

        def codegen(context, builder, sig, args):
            addr = _generic_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return _asm(builder, "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", ir.IntType(32), [ir.IntType(64)],
                        [addr], side_effect=True)
        return sig, codegen

    @intrinsic
    def _red_release(typingctx, a, i, v):
        """a[i] += v (int32) with release semantics at GPU scope, nothing returned (the
        barrier's arrival: ordered after the block's writes without a full fence)."""
        sig = _types.void(a, i, v)

        def codegen(context, builder, sig, args):
            addr = _generic_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            val = context.cast(builder, args[2], sig.args[2], _types.int32)
            _asm(builder, "red.release.gpu.global.add.s32 [$0], $1;", "l,r", ir.VoidType(),
                 [ir.IntType(64), ir.IntType(32)], [addr, val], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def _globaltimer(typingctx):
        """The GPU's nanosecond clock (the phase stamps)."""
        sig = _types.int64()

        def codegen(context, builder, sig, args):
            return _asm(builder, "mov.u64 $0, %globaltimer;", "=l", ir.IntType(64), [], [], side_effect=True)
        return sig, codegen


@device
def _grid_sync(cnt, target, tid):
    """Every block of the grid has reached its target-th barrier; their writes before it are
    visible after it. A block barrier, then its thread 0 counts with a release reduction
    and spins with acquire loads (CUTLASS's generic barrier; cooperative groups' full
    fences around an atomic add: 1,182 against 1,143 us a step, H100, df85697), then the
    block barrier again."""
    cuda.syncthreads()
    if tid == 0:  # the block's writes, ordered before thread 0's count by the barrier
        _red_release(cnt, 0, 1)
        while _ld_acquire(cnt, 0) < target:
            pass
    cuda.syncthreads()


@device
def _phase_end(cnt, epoch, nb, tid, stamp, stamps):
    """The grid barrier that ends the epoch-th phase, its time stamped by block 0's thread 0."""
    _grid_sync(cnt, epoch * nb, tid)
    if stamp:
        stamps[epoch] = _globaltimer()


@device
def _mark(stamp, stamps, i):
    """Block 0's thread 0 stamps the time at stamps[i] (inside a phase: phase_detail)."""
    if stamp:
        stamps[i] = _globaltimer()


@device
def _f16(w, o):
    return f16_bits_to_f32(np.uint32(w[o]) | (np.uint32(w[o + 1]) << 8))


@device
def _i8(b):
    v = np.int32(b)
    return v - 256 if v >= 128 else v


@device
def _k4_scale_min(w, b, sub):
    """Q4_K's 6-bit scale and min of sub-block sub (get_scale_min_k4 over the block's
    scales at byte b + 4)."""
    if sub < 4:
        return np.int32(w[b + 4 + sub]) & 63, np.int32(w[b + 8 + sub]) & 63
    hi = np.int32(w[b + 8 + sub])
    return (hi & 15) | ((np.int32(w[b + sub]) >> 6) << 4), (hi >> 4) | ((np.int32(w[b + 4 + sub]) >> 6) << 4)


@device
def _value(w, base, qt, j):
    """Weight j of the row at byte base (the embedding's row: D weights a step, bytes do)."""
    if qt == _Q4K:
        b = base + 144 * (j >> 8)
        jj = j & 255
        sub = jj >> 5
        sc, mn = _k4_scale_min(w, b, sub)
        q = (np.int32(w[b + 16 + 32 * (sub >> 1) + (jj & 31)]) >> (4 * (sub & 1))) & 15
        return _f16(w, b) * np.float32(sc) * np.float32(q) - _f16(w, b + 2) * np.float32(mn)
    if qt == _Q6K:
        b = base + 210 * (j >> 8)
        jj = j & 255
        n = jj >> 7
        q = (jj & 127) >> 5
        l = jj & 31
        v = ((np.int32(w[b + 64 * n + l + 32 * (q & 1)]) >> (4 * (q >> 1))) & 15) | \
            (((np.int32(w[b + 128 + 32 * n + l]) >> (2 * q)) & 3) << 4)
        return _f16(w, b + 208) * np.float32(_i8(w[b + 192 + 8 * n + (l >> 4) + 2 * q])) * np.float32(v - 32)
    b = base + 34 * (j >> 5)
    return _f16(w, b) * np.float32(_i8(w[b + 2 + (j & 31)]))


# Row products: matvec_fast's units (a lane takes a fixed slice of a block in 16-byte loads
# and turns each quant into a float with one logic op and one add), one row a unit, with x
# from shared memory (each block norms the stream itself: nothing global to be stale).
# The lanes of a row read x 16 or 128 columns apart, all on two of the 32 banks (8- to
# 16-way conflicts: H200, 0.6B shape, the head's 127 MB took 170 us); x's column i sits at
# _xi(i) = i + i // 64 in shared memory, which spreads them (at most 2-way for the three
# types at 1024-3072 columns). A unit reads runs of 16 columns inside one 64.
@device
def _xi(i):
    return i + (i >> 6)


@device
def _k4_word(q, xs, c, acc):
    """One word of a Q4_K piece: its low nibbles times xs[c:c+4], its high ones times
    xs[c+32:c+36], and the sums of those x (for the mins)."""
    l0, l8, h0, h8, sl, sh = acc
    x0, x1, x2, x3 = xs[c], xs[c + 1], xs[c + 2], xs[c + 3]
    y0, y1, y2, y3 = xs[c + 32], xs[c + 33], xs[c + 34], xs[c + 35]
    l0, l8 = nib_acc(q, x0, x1, x2, x3, 0, l0, l8)
    h0, h8 = nib_acc(q, y0, y1, y2, y3, 4, h0, h8)
    return l0, l8, h0, h8, sl + ((x0 + x1) + (x2 + x3)), sh + ((y0 + y1) + (y2 + y3))


@device
def _k4_piece(q, s, j, xs, c):
    """A 16-byte Q4_K piece of chunk j (sub-blocks 2j, 2j + 1) whose first low nibble is
    column c, with the block's header words s."""
    z = np.float32(0.0)
    c = _xi(c)
    acc = _k4_word(q[0], xs, c, (z, z, z, z, z, z))
    acc = _k4_word(q[1], xs, c + 4, acc)
    acc = _k4_word(q[2], xs, c + 8, acc)
    l0, l8, h0, h8, sl, sh = _k4_word(q[3], xs, c + 12, acc)
    return k4_row(s[0], s[1], s[2], s[3], j, l0, l8, h0, h8, sl, sh)


@device
def _q6_group(pl, qh, g, xs, c):
    z = np.float32(0.0)
    c = _xi(c)
    a0, a8 = q6_acc(pl[0], qh[0], g, xs[c], xs[c + 1], xs[c + 2], xs[c + 3], z, z)
    a0, a8 = q6_acc(pl[1], qh[1], g, xs[c + 4], xs[c + 5], xs[c + 6], xs[c + 7], a0, a8)
    a0, a8 = q6_acc(pl[2], qh[2], g, xs[c + 8], xs[c + 9], xs[c + 10], xs[c + 11], a0, a8)
    a0, a8 = q6_acc(pl[3], qh[3], g, xs[c + 12], xs[c + 13], xs[c + 14], xs[c + 15], a0, a8)
    return a0 + a8 * S8


@device
def _unit_dot(w, qt, hrow, u, xs):
    """Unit u of the row at uint16 hrow of w, dotted with x (the units' layouts are
    matvec_fast's load_q4_k, load_q6_k and load_q8_0, for one row)."""
    z = np.float32(0.0)
    if qt == _Q4K:
        b = u >> 2
        t = u & 3
        h = hrow + 72 * b
        qa = ldw_u16_u32x4(w, h + 8 + 8 * t)
        qb = ldw_u16_u32x4(w, h + 40 + 8 * t)
        s = ldw_u16_u32x4(w, h)
        p = t >> 1
        c = 256 * b + 16 * (t & 1) + 64 * p
        return _k4_piece(qa, s, p, xs, c) + _k4_piece(qb, s, p + 2, xs, c + 128)
    if qt == _Q6K:
        b = u >> 2
        t = u & 3
        n = t >> 1
        hh = t & 1
        h = hrow + 105 * b
        o = 32 * n + 8 * hh
        oh = 64 + 16 * n + 8 * hh
        p0, p1, a = pieces(h)
        l0 = ld16(w, p0 + o, p1 + o, a)
        l1 = ld16(w, p0 + o + 16, p1 + o + 16, a)
        qh = ld16(w, p0 + oh, p1 + oh, a)
        sc = q6_scales(w, h, n)
        c = 256 * b + 128 * n + 16 * hh
        ssh = np.uint32(8 * hh)
        y = i8f(shr32(np.uint32(sc[0]), ssh)) * _q6_group(l0, qh, 0, xs, c)
        y += i8f(shr32(np.uint32(sc[1]), ssh)) * _q6_group(l1, qh, 1, xs, c + 32)
        y += i8f(shr32(np.uint32(sc[2]), ssh)) * _q6_group(l0, qh, 2, xs, c + 64)
        y += i8f(shr32(np.uint32(sc[3]), ssh)) * _q6_group(l1, qh, 3, xs, c + 96)
        return f16_bits_to_f32(np.uint32(sc[4])) * y
    b = u >> 1
    t = u & 1
    h = hrow + 17 * b
    p0, p1, a = pieces(h + 1 + 8 * t)
    q = ld16(w, p0, p1, a)
    c = _xi(32 * b + 16 * t)
    a0, a8 = q8_acc(q[0], xs[c], xs[c + 1], xs[c + 2], xs[c + 3], z, z)
    a0, a8 = q8_acc(q[1], xs[c + 4], xs[c + 5], xs[c + 6], xs[c + 7], a0, a8)
    a0, a8 = q8_acc(q[2], xs[c + 8], xs[c + 9], xs[c + 10], xs[c + 11], a0, a8)
    a0, a8 = q8_acc(q[3], xs[c + 12], xs[c + 13], xs[c + 14], xs[c + 15], a0, a8)
    return f16_bits_to_f32(np.uint32(w[h])) * (a0 + a8 * S8)


@device
def _units(qt, cols):
    return cols >> 4 if qt == _Q8_0 else cols >> 6


@device
def _row_h(qt, cols):
    """A row's uint16 count."""
    if qt == _Q4K:
        return np.int64(cols >> 8) * 72
    if qt == _Q6K:
        return np.int64(cols >> 8) * 105
    return np.int64(cols >> 5) * 17


@device
def _lanes_a_row(cols):
    """Lanes that share a row: the largest power of two <= min(32, a K-quant row's units),
    the same for every type of one width, so that a warp's groups agree (Q8_0's rows have 4x
    the units and loop more)."""
    n = 32
    while n > (cols >> 6) and n > 1:
        n >>= 1
    return n


@device
def _row_dot2(w, qa, ha, qb, hb, cols, xs, lpr, red, wid, lane):
    """Two rows of the same width against float x in shared memory, their loads together,
    in every lane of lane's group of lpr lanes."""
    sa = np.float32(0.0)
    sb = np.float32(0.0)
    na = _units(qa, cols)
    nb = _units(qb, cols)
    for u in range(lane & (lpr - 1), max(na, nb), lpr):
        if u < na:
            sa += _unit_dot(w, qa, ha, u, xs)
        if u < nb:
            sb += _unit_dot(w, qb, hb, u, xs)
    return warp_groupsum(sa, lpr, red, wid, lane), warp_groupsum(sb, lpr, red, wid, lane)


@device
def _silu(y):
    return y / (np.float32(1.0) + np.float32(math.exp(-y)))


@device
def _h2(wd):
    """The two f16 of a little-endian word as float32."""
    return f16_bits_to_f32(wd & np.uint32(0xFFFF)), f16_bits_to_f32(wd >> np.uint32(16))


PS = 64  # an attention item's first page slots, staged in shared memory
# shared memory a block can opt into (sm_90's 227 KB; sm_80 163 KB), where the device does
# not say (the simulator, offline PTX)
SMEM_OPTIN = 227 * 1024


def smem_max() -> int:
    """Shared memory a block of the kernel may have on this device."""
    if SIM:
        return SMEM_OPTIN
    try:
        return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    except Exception:  # an attribute this driver binding lacks
        return SMEM_OPTIN


def _xq_floats(D, HQ, DH, F, x8):
    """x in int8 (two planes, quantize_x's layout) in shared memory, as float32 words."""
    return max(D, F, HQ * DH) // 32 * XQ2_BYTES // 4 if x8 else 4


def _key_threads(DH):
    """Threads that share a key's score in attention (its 16-byte K pieces split among them)."""
    return min(8, DH // 8)


def _shared_layout(D, HQ, HKV, DH, F, NT, x8=False):
    """The kernel's dynamic shared memory at a shape: each array's offset (float32 words,
    a multiple of 4: 16-byte aligned; x in int8 first) and the words in all."""
    G, W, MX = HQ // HKV, NT // 32, max(D, F, HQ * DH)
    KC = NT // _key_threads(DH)
    sizes = {"xq": _xq_floats(D, HQ, DH, F, x8), "xs": max(MX + MX // 64 + 1, W * G * DH),
             "red": max(1, W * WARP_RED_SLOTS), "bred": NT, "qsh": G * DH + DH, "ss": G * KC, "ml": 3 * G,
             "cs": DH, "ps": PS}
    offsets, o = {}, 0
    for name, n in sizes.items():
        offsets[name] = o
        o += -(-n // 4) * 4
    return offsets, o


def _shared_bytes(D, HQ, HKV, DH, F, NT, x8=False):
    """The kernel's shared memory at a shape."""
    return 4 * _shared_layout(D, HQ, HKV, DH, F, NT, x8)[1]


def _static_shared(D, HQ, HKV, DH, F, NT, x8=False):
    """Whether the kernel's arrays are static shared memory (within the 48 KB a launch gets
    without opting in, on a GPU) rather than slices of one dynamic allocation: at the
    Qwen3-0.6B shape the slices cost ptxas spills (sm_90: 516 / 820 bytes of spill stores
    / loads against 320 / 504), and the step, 947.5 us with static arrays (H100, 41398cc),
    measured 1,021.2 with the slices (H100, e7cef8a; the allocation was the kernel's main
    change between them)."""
    return not SIM and _shared_bytes(D, HQ, HKV, DH, F, NT, x8) <= SMEM_STATIC


@functools.lru_cache(maxsize=None)
def _kernel(D, HQ, HKV, DH, F, L, ROPE, HALVES, QKN, EPS, NT, MAXP, X8=False, PPI=0):
    G = HQ // HKV
    W = NT // 32
    QR = HQ * DH
    KR = HKV * DH
    XS = max(D, F, QR) + max(D, F, QR) // 64 + 1  # x with _xi's gaps
    RED = max(1, W * WARP_RED_SLOTS)
    HALF = ROPE // 2
    NPL = DH // 32                   # a head's values a lane
    TPK = _key_threads(DH)           # threads a key's score
    KC = NT // TPK                   # keys an attention pass scores
    CH = DH // 8                     # 16-byte pieces of a K/V row
    SPW = 32 // CH                   # keys a warp's value pass takes at once
    KS = W * SPW
    KB = CH // TPK                   # K pieces a thread loads, all in flight together
    VB = 2                           # V rows a thread has in flight
    KW, VW = 4 * KB, 4 * VB          # their words (local arrays' sizes: plain closure values)
    GA = G * 8
    # shared arrays' sizes: compile-time constants only as plain closure values
    QSH, SSN, MLN, TMPN = G * DH + DH, G * KC, 3 * G, DH
    XSN = max(XS, W * G * DH)  # attention's per-warp partials live in xs (free in that phase)
    SUB = 5 * L + 3  # stamps inside block 0's first attention item start here
    DET = 9 * L + 3  # then stamps inside block 0's row phases: 8 a layer, one for the head
    SCALE = np.float32(1.0 / math.sqrt(DH))
    eps = np.float32(EPS)
    f32 = np.float32
    XQN = _xq_floats(D, HQ, DH, F, X8)
    offs, words = _shared_layout(D, HQ, HKV, DH, F, NT, X8)
    O_XS, O_RED, O_BRED, O_QSH = offs["xs"], offs["red"], offs["bred"], offs["qsh"]
    O_SS, O_ML, O_CS, O_PS = offs["ss"], offs["ml"], offs["cs"], offs["ps"]
    assert offs["xq"] == 0 and words >= XSN + RED + NT + QSH + SSN + MLN + TMPN + PS + XQN
    if _static_shared(D, HQ, HKV, DH, F, NT, X8):
        @device(inline=True)
        def carve():
            """The phases' arrays as static shared memory (a draft's shape: see _static_shared);
            x in int8 read 16 bytes at a time."""
            return (cuda.shared.array(XQN, np.float32, alignment=16), cuda.shared.array(XSN, np.float32),
                    cuda.shared.array(RED, np.float32), cuda.shared.array(NT, np.float32),
                    cuda.shared.array(QSH, np.float32), cuda.shared.array(SSN, np.float32),
                    cuda.shared.array(MLN, np.float32), cuda.shared.array(TMPN, np.float32),
                    cuda.shared.array(PS, np.int32))
    else:
        @device(inline=True)
        def carve():
            """The phases' arrays carved from one dynamic allocation: past 48 KB at an 8B's
            shape (x staged for a 12,288-wide down projection), which a launch must opt into."""
            if SIM:  # no alignment argument there
                sm = cuda.shared.array(0, nb_float32)  # a numba type: the simulator sizes it by itemsize
            else:  # x in int8 (X8), quantize_x's layout, read 16 bytes at a time: at offset 0
                sm = cuda.shared.array(0, np.float32, alignment=16)
            return (sm[0:XQN], sm[O_XS:O_XS + XSN], sm[O_RED:O_RED + RED], sm[O_BRED:O_BRED + NT],
                    sm[O_QSH:O_QSH + QSH], sm[O_SS:O_SS + SSN], sm[O_ML:O_ML + MLN], sm[O_CS:O_CS + TMPN],
                    sm[O_PS:O_PS + PS].view(np.int32))

    def stager(n):
        """stage(xs, src, tid): xs[_xi(i)] = src[i] for i < n (other blocks' writes, from L2),
        every load of a thread issued before its first store; returns the sum of squares of
        this thread's values."""
        TR = (n + NT - 1) // NT

        @device
        def stage(xs, src, tid):
            v = cuda.local.array(TR, np.float32)
            for k in range(TR):
                v[k] = ldcg_f32(src, min(tid + k * NT, n - 1))
            ss = f32(0.0)
            for k in range(TR):
                i = tid + k * NT
                if i < n:
                    xs[_xi(i)] = v[k]
                    ss += v[k] * v[k]
            return ss
        return stage

    stage_d, stage_f = stager(D), stager(F)

    @device
    def norm_into(xs, src, nw, off, bred, xqw, xqf, red, tid, wid, lane):
        """xs = rms_norm(src[:D]) * nw[off:] in this block (X8: into xq instead); every
        thread calls it."""
        tot = block_sum(stage_d(xs, src, tid), bred)
        inv = f32(1.0) / math.sqrt(tot / f32(D) + eps)
        if X8:
            quantize_normed(xs, inv, nw, off, xqw, xqf, red, tid, wid, lane)
        else:
            for i in range(tid, D, NT):
                xs[_xi(i)] = xs[_xi(i)] * inv * nw[off + i]
            cuda.syncthreads()

    # X8: every row product over x in int8 (two planes: ~16 bits, what the launch chain's
    # products take by default), a row pair a lane group with matvec_fast's x8 units and x's
    # words from shared memory. Over float x (ncu, H100, a1c21e5's kernel) the rows ran ~16
    # instructions a weight, the row phases bound by issue; dp4a takes four quants at once.
    ld4, dot4 = _make_unit_q4_k_x8(True, 2, ld_u16_u32x4)
    ld6, dot6 = _make_unit_q6_k_x8(True, 2, ld_u16_u32x4)

    # x into xq four columns a thread (int8_quad_store: a warp a 32-column block and two
    # 16-lane reductions took 2.4-3.4 us a phase with the staging, d59ff40)
    TQD = (D // 4 + NT - 1) // NT

    @device
    def quantize_normed(xs, inv, nw, off, xqw, xqf, red, tid, wid, lane):
        """rms_norm's output (xs, staged, times inv and nw[off:]) into xq."""
        for k in range(TQD):
            c = 4 * (tid + k * NT)
            live = c < D
            cc = min(c, D - 4)
            i = _xi(cc)  # a run of four inside one 64
            int8_quad_store(xs[i] * inv * nw[off + cc], xs[i + 1] * inv * nw[off + cc + 1],
                            xs[i + 2] * inv * nw[off + cc + 2], xs[i + 3] * inv * nw[off + cc + 3], live, c, lane, wid,
                            red, xqw, xqf, 2)
        cuda.syncthreads()

    def quad_stager(n):
        """stage(src16, xqw, xqf, ...): src[:n] (other blocks' writes; float32 seen as
        uint16) straight into xq, every load of a thread issued before the first store."""
        TQ = (n // 4 + NT - 1) // NT
        TW = 4 * TQ

        @device
        def stage(src16, xqw, xqf, red, tid, wid, lane):
            v = cuda.local.array(TW, np.uint32)
            for k in range(TQ):
                c = min(4 * (tid + k * NT), n - 4)
                v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3] = ldcg_u16_u32x4(src16, 2 * c)
            for k in range(TQ):
                c = 4 * (tid + k * NT)
                int8_quad_store(u32_bits_to_f32(v[4 * k]), u32_bits_to_f32(v[4 * k + 1]),
                                u32_bits_to_f32(v[4 * k + 2]), u32_bits_to_f32(v[4 * k + 3]), c < n, c, lane, wid, red,
                                xqw, xqf, 2)
            cuda.syncthreads()
        return stage

    qstage_f = quad_stager(F)

    def unit_loop(ld, dot, BH):
        """A lane's units of a row pair (ld / dot: a type's x8 unit; BH: its uint16 a block)."""
        @device
        def rows(w, ha, hb, cols, xq, lpr, lane):
            sa = f32(0.0)
            sb = f32(0.0)
            for u in range(lane & (lpr - 1), cols >> 6, lpr):
                b = u >> 2
                t = u & 3
                oa = ha + BH * b
                ob = hb + BH * b
                ya, yb = dot(ld(w, oa, ob, t), w, oa, ob, xq, xq, 256 * b, t)
                sa += ya
                sb += yb
            return sa, sb
        return rows

    rows4, rows6 = unit_loop(ld4, dot4, 72), unit_loop(ld6, dot6, 105)

    @device
    def pair_x8(w, qt, ha, hb, cols, xq, lpr, red, wid, lane):
        if qt == _Q4K:
            sa, sb = rows4(w, ha, hb, cols, xq, lpr, lane)
        else:
            sa, sb = rows6(w, ha, hb, cols, xq, lpr, lane)
        return warp_groupsum(sa, lpr, red, wid, lane), warp_groupsum(sb, lpr, red, wid, lane)

    @device
    def dot2(w, qa, ha, qb, hb, cols, xs, xq, lpr, red, wid, lane):
        """Rows at uint16 ha (type qa) and hb (qb) with x, in every lane of lane's group of
        lpr lanes (X8: the same type, as the host checks)."""
        if X8:
            return pair_x8(w, qa, ha, hb, cols, xq, lpr, red, wid, lane)
        return _row_dot2(w, qa, ha, qb, hb, cols, xs, lpr, red, wid, lane)

    @device
    def qkv_row(wtab, li, r):
        """Row r of q|k|v (layer li): which (0, 1, 2), its row in it, its type and uint16 start."""
        if r < QR:
            kind = 0
            rr = r
        elif r < QR + KR:
            kind = 1
            rr = r - QR
        else:
            kind = 2
            rr = r - QR - KR
        qt = wtab[li, kind, 1]
        return kind, rr, qt, wtab[li, kind, 0] + np.int64(rr) * _row_h(qt, D)

    @device
    def head_load(src, qb, kb, nq, hd, xv, lane):
        """Head hd's DH floats (q heads < nq from src[qb + hd DH:], head nq from src[kb:]),
        a lane's NPL of them into xv: every load issued before anything waits on one (the
        L2 loads keep program order: a store between them waited on its load, four round
        trips a head at 128, 3.5 us with the item's K/V loads, 485b280, H100)."""
        sb = qb + hd * DH if hd < nq else kb
        for m in range(NPL):
            xv[m] = ldcg_f32(src, sb + lane + 32 * m)

    @device
    def head_norm_rope(src, qb, kb, v, nw, offq, offk, nq, ntot, cs, red, wid, lane, xv):
        """ntot heads of DH floats into v (shared memory), a warp a head: heads < nq from
        src[qb + hd DH:] (other blocks' writes), head nq from src[kb:]; each RMSNormed (by
        nw[offq:], head nq by nw[offk:]; off < 0: none) and rotated by cs (the step's cos
        and sin) in its warp's registers and shared memory, no block barrier until the
        caller's (a block's passes over all heads took 1.9 us an item each for q and the
        new k, H100). Loading q before the item's K/V instead of after was slower (H100:
        1,144 against 1,132 us a step)."""
        for hd in range(wid, ntot, W):
            hb = hd * DH
            off = offq if hd < nq else offk
            head_load(src, qb, kb, nq, hd, xv, lane)
            ss = f32(0.0)
            for m in range(NPL):
                ss += xv[m] * xv[m]
            inv = f32(1.0)
            if off >= 0:
                inv = f32(1.0) / math.sqrt(warp_allsum(ss, red, wid, lane) / f32(DH) + eps)
            for m in range(NPL):
                d = lane + 32 * m
                v[hb + d] = xv[m] * inv * nw[off + d] if off >= 0 else xv[m]
            warp_barrier()
            for k in range(lane, HALF, 32):
                if HALVES:
                    ia = hb + k
                    ib = ia + HALF
                else:
                    ia = hb + 2 * k
                    ib = ia + 1
                a = v[ia]
                b = v[ib]
                v[ia] = a * cs[k] - b * cs[HALF + k]
                v[ib] = a * cs[HALF + k] + b * cs[k]
            warp_barrier()

    @device
    def into_stream(xs, xq, n, w, off, qt, xg, red, wid, lane, gw, nw_all, stamp, stamps, si):
        """xg += W x for the D rows of an n-column weight at uint16 off (o: n = QR, down:
        n = F), a row pair a lane group, x staged by the caller (X8: in xq)."""
        _mark(stamp, stamps, si)
        rh = _row_h(qt, n)
        lpr = _lanes_a_row(n)
        rpw = 32 // lpr
        for pb in range(gw * rpw, D // 2, nw_all * rpw):  # the same trips in every lane of a warp
            p = pb + lane // lpr
            r = 2 * min(p, D // 2 - 1)
            old0 = ldcg_f32(xg, r)  # in flight with the weights
            old1 = ldcg_f32(xg, r + 1)
            y0, y1 = dot2(w, qt, off + np.int64(r) * rh, qt, off + np.int64(r + 1) * rh, n, xs, xq, lpr, red, wid,
                          lane)
            if (lane & (lpr - 1)) == 0 and p < D // 2:
                xg[r] = old0 + y0
                xg[r + 1] = old1 + y1
        _mark(stamp, stamps, si + 1)

    # Attention's splits are merged where o's rows take their x, by every block for itself
    # (four splits' partials in flight a trip, online softmax over the splits), not by each
    # head's last item after a count: nothing of it on attention's critical path and no
    # round trip through a global buffer (H100, 0.6B shape: 1,048 against 1,132 us a step)
    TQQ = (QR // 4 + NT - 1) // NT

    @device
    def merged_quad(po16, pml, hq, d, n_ch):
        """Columns d .. d + 3 of q head hq's attention output from its n_ch splits'
        partials (unnormalized output, m and l a split)."""
        mx = f32(-math.inf)
        den = f32(0.0)
        n0 = f32(0.0)
        n1 = f32(0.0)
        n2 = f32(0.0)
        n3 = f32(0.0)
        base = hq * MAXP
        for c0 in range(0, n_ch, 4):
            ia = base + c0
            ib = base + min(c0 + 1, n_ch - 1)
            ic = base + min(c0 + 2, n_ch - 1)
            idd = base + min(c0 + 3, n_ch - 1)
            ma, la = ldcg_f32(pml, 2 * ia), ldcg_f32(pml, 2 * ia + 1)
            mb, lb = ldcg_f32(pml, 2 * ib), ldcg_f32(pml, 2 * ib + 1)
            mc, lc = ldcg_f32(pml, 2 * ic), ldcg_f32(pml, 2 * ic + 1)
            md, ld = ldcg_f32(pml, 2 * idd), ldcg_f32(pml, 2 * idd + 1)
            oa = ldcg_u16_u32x4(po16, 2 * (ia * DH + d))
            ob = ldcg_u16_u32x4(po16, 2 * (ib * DH + d))
            oc = ldcg_u16_u32x4(po16, 2 * (ic * DH + d))
            od = ldcg_u16_u32x4(po16, 2 * (idd * DH + d))
            # a clamped split repeats the last one: it takes no weight
            mb = mb if c0 + 1 < n_ch else f32(-math.inf)
            mc = mc if c0 + 2 < n_ch else f32(-math.inf)
            md = md if c0 + 3 < n_ch else f32(-math.inf)
            m_new = max(max(mx, ma), max(max(mb, mc), md))
            a = f32(math.exp(mx - m_new)) if mx > -math.inf else f32(0.0)
            ea = f32(math.exp(ma - m_new))
            eb = f32(math.exp(mb - m_new)) if mb > -math.inf else f32(0.0)
            ec = f32(math.exp(mc - m_new)) if mc > -math.inf else f32(0.0)
            ed = f32(math.exp(md - m_new)) if md > -math.inf else f32(0.0)
            den = den * a + ea * la + eb * lb + ec * lc + ed * ld
            n0 = n0 * a + ea * u32_bits_to_f32(oa[0]) + eb * u32_bits_to_f32(ob[0]) + \
                ec * u32_bits_to_f32(oc[0]) + ed * u32_bits_to_f32(od[0])
            n1 = n1 * a + ea * u32_bits_to_f32(oa[1]) + eb * u32_bits_to_f32(ob[1]) + \
                ec * u32_bits_to_f32(oc[1]) + ed * u32_bits_to_f32(od[1])
            n2 = n2 * a + ea * u32_bits_to_f32(oa[2]) + eb * u32_bits_to_f32(ob[2]) + \
                ec * u32_bits_to_f32(oc[2]) + ed * u32_bits_to_f32(od[2])
            n3 = n3 * a + ea * u32_bits_to_f32(oa[3]) + eb * u32_bits_to_f32(ob[3]) + \
                ec * u32_bits_to_f32(oc[3]) + ed * u32_bits_to_f32(od[3])
            mx = m_new
        inv = f32(1.0) / den
        return n0 * inv, n1 * inv, n2 * inv, n3 * inv

    @device
    def merge_stage(po16, pml, n_ch, xs, xqw, xqf, red, tid, wid, lane):
        """Attention's output, merged from its splits, staged for o's rows (X8: into xq)."""
        for k in range(TQQ):
            c = 4 * (tid + k * NT)
            cc = min(c, QR - 4)
            v0, v1, v2, v3 = merged_quad(po16, pml, cc // DH, cc % DH, n_ch)
            if X8:
                int8_quad_store(v0, v1, v2, v3, c < QR, c, lane, wid, red, xqw, xqf, 2)
            elif c < QR:
                i = _xi(cc)  # a run of four inside one 64
                xs[i] = v0
                xs[i + 1] = v1
                xs[i + 2] = v2
                xs[i + 3] = v3
        cuda.syncthreads()

    @device
    def kv_index(table, pslot, pg0, li, h, key):
        """The uint16 index of key's row of kv head h in a flat pool (the page's slot from
        pslot, the item's first PS pages from page pg0, or from the table past them)."""
        pg = key // PAGE - pg0
        slot = np.int64(pslot[pg] if pg < PS else table[pg + pg0])
        return (((slot * L + li) * HKV + h) * PAGE + key % PAGE) * DH

    @device
    def load_v(vp, table, pslot, pg0, li, h, kc0, nk, j0, vw, lane):
        """The value loop's V words of keys j0, j0 + KS, .. (VB of them) of a pass into vw:
        the lane's 16-byte piece of each row."""
        for u in range(VB):
            vw[4 * u], vw[4 * u + 1], vw[4 * u + 2], vw[4 * u + 3] = ldcg_u16_u32x4(
                vp, kv_index(table, pslot, pg0, li, h, kc0 + min(j0 + u * KS, nk - 1)) + 8 * (lane // SPW))

    @device
    def load_pass(kp, vp, table, pslot, pg0, li, h, kc0, nk, kw, vw, tid, wid, lane):
        """A pass's K words (TPK adjacent threads a key, each KB 16-byte pieces) and its
        value loop's first V words (VB keys a lane) into kw and vw: loads issued together,
        before anything waits on them."""
        j = tid // TPK
        sub = tid % TPK
        base = kv_index(table, pslot, pg0, li, h, kc0 + min(j, nk - 1))
        for k in range(KB):
            kw[4 * k], kw[4 * k + 1], kw[4 * k + 2], kw[4 * k + 3] = ldcg_u16_u32x4(kp, base + 8 * (sub + TPK * k))
        load_v(vp, table, pslot, pg0, li, h, kc0, nk, wid * SPW + (lane & (SPW - 1)), vw, lane)

    @device
    def k_piece(kw, k, fresh, qsh, at):
        """Piece k of a thread's K row: from its loaded words, or (fresh: the step's new row,
        which this block is writing to the pool) qsh[at:at + 8] as the pool's f16 holds it."""
        if fresh:
            return (f32(np.float16(qsh[at])), f32(np.float16(qsh[at + 1])), f32(np.float16(qsh[at + 2])),
                    f32(np.float16(qsh[at + 3])), f32(np.float16(qsh[at + 4])), f32(np.float16(qsh[at + 5])),
                    f32(np.float16(qsh[at + 6])), f32(np.float16(qsh[at + 7])))
        e0, e1 = _h2(kw[4 * k])
        e2, e3 = _h2(kw[4 * k + 1])
        e4, e5 = _h2(kw[4 * k + 2])
        e6, e7 = _h2(kw[4 * k + 3])
        return e0, e1, e2, e3, e4, e5, e6, e7

    @device
    def attend(kp, vp, table, pslot, pg0, li, h, k0, k1, newk, qsh, ss, ml, part, red, tid, wid, lane, acc, kw, vw):
        """Keys k0..k1 of kv head h against the G query heads in qsh (online softmax, its
        state in ml: m, l a head); the unnormalized output summed over this block's warps
        into part[0:G * DH] (each warp's share at part[wid * G * DH:]). kw and vw hold the
        first pass's loads (load_pass, issued before q was normed); newk: key k1 - 1 is the
        step's new row, its K in qsh[G * DH:]."""
        c = lane // SPW  # the value pass: the lanes of one 16-byte column piece are adjacent
        for i in range(GA):
            acc[i] = f32(0.0)
        jv = wid * SPW + (lane & (SPW - 1))
        for kc0 in range(k0, k1, KC):
            nk = min(KC, k1 - kc0)
            if kc0 != k0:
                load_pass(kp, vp, table, pslot, pg0, li, h, kc0, nk, kw, vw, tid, wid, lane)
            # scores: TPK adjacent threads a key, each KB of its 16-byte pieces, summed over
            # the group. A thread a key left 64-key items to two warps' long serial chains
            # (H100, a1c21e5 / d59ff40: 11.4-12.0 us for 64 keys).
            j = tid // TPK
            sub = tid % TPK
            fresh = newk and kc0 + min(j, nk - 1) == k1 - 1  # threads past the keys repeat the last
            sg = cuda.local.array(G, np.float32)
            for g in range(G):
                sg[g] = f32(0.0)
            for k in range(KB):
                e0, e1, e2, e3, e4, e5, e6, e7 = k_piece(kw, k, fresh, qsh, G * DH + 8 * (sub + TPK * k))
                for g in range(G):
                    q = g * DH + 8 * (sub + TPK * k)
                    sg[g] += (qsh[q] * e0 + qsh[q + 1] * e1) + (qsh[q + 2] * e2 + qsh[q + 3] * e3) + \
                        (qsh[q + 4] * e4 + qsh[q + 5] * e5) + (qsh[q + 6] * e6 + qsh[q + 7] * e7)
            for g in range(G):
                v = warp_groupsum(sg[g], TPK, red, wid, lane)
                if sub == 0 and j < nk:
                    ss[g * KC + j] = v * SCALE
            cuda.syncthreads()
            for g in range(wid, G, W):  # softmax: a warp a head
                m_old = ml[g]
                mx = m_old
                for j in range(lane, nk, 32):
                    mx = max(mx, ss[g * KC + j])
                mx = warp_allmax(mx, red, wid, lane)
                lsum = f32(0.0)
                for j in range(lane, nk, 32):
                    e = f32(math.exp(ss[g * KC + j] - mx))
                    ss[g * KC + j] = e
                    lsum += e
                lsum = warp_allsum(lsum, red, wid, lane)
                if lane == 0:
                    a = f32(math.exp(m_old - mx)) if m_old > -math.inf else f32(0.0)
                    ml[g] = mx
                    ml[G + g] = ml[G + g] * a + lsum
                    ml[2 * G + g] = a
            cuda.syncthreads()
            for g in range(G):
                a = ml[2 * G + g]
                for e in range(8):
                    acc[g * 8 + e] *= a
            for j0 in range(jv, nk, VB * KS):  # VB keys' loads in flight
                if j0 != jv:  # the first keys' came with load_pass
                    load_v(vp, table, pslot, pg0, li, h, kc0, nk, j0, vw, lane)
                for u in range(VB):
                    j = min(j0 + u * KS, nk - 1)
                    e0, e1 = _h2(vw[4 * u])
                    e2, e3 = _h2(vw[4 * u + 1])
                    e4, e5 = _h2(vw[4 * u + 2])
                    e6, e7 = _h2(vw[4 * u + 3])
                    live = j0 + u * KS < nk
                    for g in range(G):
                        pj = ss[g * KC + j] if live else f32(0.0)
                        acc[g * 8] += pj * e0
                        acc[g * 8 + 1] += pj * e1
                        acc[g * 8 + 2] += pj * e2
                        acc[g * 8 + 3] += pj * e3
                        acc[g * 8 + 4] += pj * e4
                        acc[g * 8 + 5] += pj * e5
                        acc[g * 8 + 6] += pj * e6
                        acc[g * 8 + 7] += pj * e7
            cuda.syncthreads()  # ss is the next pass's
        for i in range(GA):  # a warp's keys, summed in the first lane of each piece
            v = warp_groupsum(acc[i], SPW, red, wid, lane)
            if (lane & (SPW - 1)) == 0:
                part[wid * G * DH + (i // 8) * DH + 8 * c + (i % 8)] = v
        cuda.syncthreads()
        for i in range(tid, G * DH, NT):
            o = part[i]
            for k in range(1, W):
                o += part[k * G * DH + i]
            part[i] = o
        cuda.syncthreads()

    NPA = (QR + 2 * KR) // 2  # q, k and v's row pairs

    # ptxas must fit NT threads a block (at 512 without the bound: out of resources)
    @(cuda.jit if SIM else cuda.jit(launch_bounds=NT))
    def kernel(w, wtab, nw, ntab, emb, emb_qt, outw, out_qt, out_norm, inv_freq, tok, pos,
               k_pool, v_pool, kp, vp, table, meta, kv_pos, xg, qkv, hg, part_o, part_ml, cnt, logits,
               stamps, chain):
        # a draft that stopped on the device (luce.kernels.sampling's chain, set by the step
        # before) leaves the steps queued past its stop with nothing to do: every block
        # returns before the first grid barrier
        if chain[0, CHAIN_STOPPED] != 0.0:
            return
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        bid = cuda.blockIdx.x
        nb = cuda.gridDim.x
        # the row phases' warp index: a block's warps nb apart, so that a phase with fewer
        # row pairs than warps (o and down: a pair a warp, 512 at Qwen3-0.6B's shape, against
        # 16 warps a block) runs on every SM, not on the first 32 of them (H100, 0.6B shape:
        # 1,031 against 1,132 us a step)
        gw = wid * nb + bid
        nw_all = nb * W
        # xq, xs, red, bred, qsh (the group's q heads, then the new k), ss, ml (m, l, the
        # pass's rescale a head), cs (the step's RoPE cos, then sin), pslot
        xqf, xs, red, bred, qsh, ss, ml, cs, pslot = carve()
        part = xs
        xqw = xqf.view(np.uint32)
        xq = xqf.view(np.uint16)
        acc = cuda.local.array(GA, np.float32)
        kw = cuda.local.array(KW, np.uint32)
        vw = cuda.local.array(VW, np.uint32)
        xv = cuda.local.array(NPL, np.float32)  # a warp's head in attention (head_load)
        pslot_pg0 = -1
        n_past = meta[0]
        p = pos[0]
        n_keys = n_past + 1
        slot_new = table[n_past // PAGE]
        row_new = n_past % PAGE
        for k in range(tid, HALF, NT):  # one position a step: its angles once, not per head and layer
            sn, cn = sincos_at(p, inv_freq[k])
            cs[k] = cn
            cs[HALF + k] = sn
        epoch = 0
        stamp = bid == 0 and tid == 0
        if stamp:
            stamps[0] = _globaltimer()
        n_pages = (n_keys + PAGE - 1) // PAGE

        # the token's embedding: block 0 writes the residual stream
        t = tok[0]
        ebase = np.int64(t) * np.int64(2 * _row_h(emb_qt, D))
        if bid == 0:
            for i in range(tid, D, NT):
                xg[i] = _value(emb, ebase, emb_qt, i)
            if tid == 0:
                kv_pos[n_past] = p
        epoch += 1
        _phase_end(cnt, epoch, nb, tid, stamp, stamps)

        lpr = _lanes_a_row(D)
        rpw = 32 // lpr
        mine = (lane & (lpr - 1)) == 0
        for li in range(L):
            # (A) q, k, v rows of the normed stream; v into the pool
            norm_into(xs, xg, nw, ntab[li, 0], bred, xqw, xqf, red, tid, wid, lane)
            _mark(stamp, stamps, DET + 8 * li)
            for pb in range(gw * rpw, NPA, nw_all * rpw):  # row pairs, the same trips in a warp's lanes
                p0 = pb + lane // lpr
                r = 2 * min(p0, NPA - 1)
                kind, rr, qt, ha = qkv_row(wtab, li, r)
                ya, yb = dot2(w, qt, ha, qt, ha + _row_h(qt, D), D, xs, xq, lpr, red, wid, lane)
                if mine and p0 < NPA:
                    qkv[r] = ya
                    qkv[r + 1] = yb
                    if kind == 2:
                        v_pool[slot_new, li, rr // DH, row_new, rr % DH] = np.float16(ya)
                        v_pool[slot_new, li, (rr + 1) // DH, row_new, (rr + 1) % DH] = np.float16(yb)
            _mark(stamp, stamps, DET + 8 * li + 1)
            epoch += 1
            _phase_end(cnt, epoch, nb, tid, stamp, stamps)

            # (B) attention: items of (kv head, group of pages)
            ppi = PPI if PPI > 0 else max(1, (n_pages * HKV + nb - 1) // nb)
            n_ch = (n_pages + ppi - 1) // ppi
            for it in range(bid, HKV * n_ch, nb):
                h = it // n_ch
                ch = it % n_ch
                pg0 = ch * ppi
                pg1 = min(n_pages, pg0 + ppi)
                if pg0 != pslot_pg0:  # an item's pages are the same every layer: staged once unless a block has several
                    if tid < min(PS, pg1 - pg0):
                        pslot[tid] = table[pg0 + tid]
                    pslot_pg0 = pg0
                    cuda.syncthreads()
                if tid < G:
                    ml[tid] = f32(-math.inf)
                    ml[G + tid] = f32(0.0)
                sub = stamp and it == 0  # block 0's first item: where an item's time goes
                if sub:
                    stamps[SUB + 4 * li] = _globaltimer()
                k0 = pg0 * PAGE
                k1 = min(pg1 * PAGE, n_keys)
                last = pg1 == n_pages  # this item holds the new row: its k, normed and rotated, into the pool
                ntot = G + 1 if last else G
                # K and the first V in flight while q (and the new row's k) are normed
                load_pass(kp, vp, table, pslot, pg0, li, h, k0, min(KC, k1 - k0), kw, vw, tid, wid, lane)
                head_norm_rope(qkv, h * G * DH, QR + h * DH, qsh, nw, ntab[li, 2] if QKN else -1,
                               ntab[li, 3] if QKN else -1, G, ntot, cs, red, wid, lane, xv)
                cuda.syncthreads()
                if sub:
                    stamps[SUB + 4 * li + 1] = _globaltimer()
                if last:  # for later steps: this step's scores take it from qsh
                    for i in range(tid, DH, NT):
                        k_pool[slot_new, li, h, row_new, i] = np.float16(qsh[G * DH + i])
                attend(kp, vp, table, pslot, pg0, li, h, k0, k1, last, qsh, ss, ml, part, red, tid, wid, lane, acc, kw,
                       vw)
                if sub:
                    stamps[SUB + 4 * li + 2] = _globaltimer()
                for i in range(tid, G * DH, NT):
                    part_o[((h * G + i // DH) * MAXP + ch) * DH + i % DH] = part[i]
                if tid < G:
                    part_ml[((h * G + tid) * MAXP + ch) * 2] = ml[tid]
                    part_ml[((h * G + tid) * MAXP + ch) * 2 + 1] = ml[G + tid]
                cuda.syncthreads()
                if sub:
                    stamps[SUB + 4 * li + 3] = _globaltimer()
            epoch += 1
            _phase_end(cnt, epoch, nb, tid, stamp, stamps)

            # (C) o rows into the residual stream, over attention's merged splits
            merge_stage(part_o.view(np.uint16), part_ml, n_ch, xs, xqw, xqf, red, tid, wid, lane)
            into_stream(xs, xq, QR, w, wtab[li, 3, 0], wtab[li, 3, 1], xg, red, wid, lane, gw, nw_all,
                        stamp, stamps, DET + 8 * li + 2)
            epoch += 1
            _phase_end(cnt, epoch, nb, tid, stamp, stamps)

            # (D) gate and up rows of the normed stream, SwiGLU
            qg = wtab[li, 4, 1]
            qu = wtab[li, 5, 1]
            norm_into(xs, xg, nw, ntab[li, 1], bred, xqw, xqf, red, tid, wid, lane)
            _mark(stamp, stamps, DET + 8 * li + 4)
            for rb in range(gw * rpw, F, nw_all * rpw):
                r = rb + lane // lpr
                rr = min(r, F - 1)
                yg, yu = dot2(w, qg, wtab[li, 4, 0] + np.int64(rr) * _row_h(qg, D), qu,
                              wtab[li, 5, 0] + np.int64(rr) * _row_h(qu, D), D, xs, xq, lpr, red, wid, lane)
                if mine and r < F:
                    hg[r] = _silu(yg) * yu
            _mark(stamp, stamps, DET + 8 * li + 5)
            epoch += 1
            _phase_end(cnt, epoch, nb, tid, stamp, stamps)

            # (E) down rows into the residual stream, over hg (other blocks' writes) staged
            if X8:
                qstage_f(hg.view(np.uint16), xqw, xqf, red, tid, wid, lane)
            else:
                stage_f(xs, hg, tid)
                cuda.syncthreads()
            into_stream(xs, xq, F, w, wtab[li, 6, 0], wtab[li, 6, 1], xg, red, wid, lane, gw, nw_all,
                        stamp, stamps, DET + 8 * li + 6)
            epoch += 1
            _phase_end(cnt, epoch, nb, tid, stamp, stamps)

        # the head
        norm_into(xs, xg, out_norm, 0, bred, xqw, xqf, red, tid, wid, lane)
        _mark(stamp, stamps, DET + 8 * L)
        rh = _row_h(out_qt, D)
        n_out = logits.shape[1]
        n_pairs = (n_out + 1) // 2
        for pb in range(gw * rpw, n_pairs, nw_all * rpw):  # row pairs: their loads in flight together
            p = pb + lane // lpr
            r = 2 * min(p, n_pairs - 1)
            ya, yb = dot2(outw, out_qt, np.int64(r) * rh, out_qt, np.int64(min(r + 1, n_out - 1)) * rh, D, xs, xq,
                          lpr, red, wid, lane)
            if mine and p < n_pairs:
                logits[0, r] = ya
                if r + 1 < n_out:
                    logits[0, r + 1] = yb
        # the last block out resets the barrier's counter for the next launch (no block
        # reads it after its own count here) and stamps the step's end
        cuda.syncthreads()
        if tid == 0:
            if cuda.atomic.add(cnt, 1, 1) == nb - 1:
                cnt[0] = 0
                cnt[1] = 0
                stamps[epoch + 1] = _globaltimer()

    # on disk like the other forward kernels: uncached, it compiled on every start (a
    # draft's load took ~105 s with the cache warm, H100, forty-sixth session)
    return disk_cache.enable(kernel)


def compile_ptx_at(D, HQ, HKV, DH, F, L, threads: int = THREADS, rope_halves: bool = True, qk_norm: bool = True,
                   max_pages: int = 32, x8: bool = True) -> str:
    """The kernel's sm_90 PTX at a shape, as the GPU would compile it (launch bounds
    included), for a machine without one (luce.kernels.ptx.offline_target first): the
    simulator runs the Python and misses what only the compiler rejects."""
    from numba import types as T
    A = lambda dt, nd=1: T.Array(dt, nd, "C")  # noqa: E731
    f32, i32, u16 = A(T.float32), A(T.int32), A(T.uint16)
    sig = (u16, A(T.int64, 3), f32, A(T.int64, 2), A(T.uint8), T.int64, u16, T.int64, f32, A(T.float64), i32, i32,
           A(T.float16, 5), A(T.float16, 5), u16, u16, i32, i32, i32, f32, f32, f32, f32, f32, i32,
           A(T.float32, 2), A(T.int64), A(T.float64, 2))
    k = _kernel(D, HQ, HKV, DH, F, L, DH, rope_halves, qk_norm, 1e-6, threads, max_pages, x8)
    return cuda.compile_ptx(k.py_func, sig, cc=(9, 0), launch_bounds=threads)[0]


# ----------------------------------------------------------------------------- host side
def x8_fits(weights) -> bool:
    """Whether every row product can take x in int8 (matvec_fast's x8 units: Q4_K and
    Q6_K), gate and up of one type in each layer (they run as one row pair)."""
    x8 = {QTYPE_CODES[t] for t in QTYPE_CODES} - {_Q8_0}
    mats = [getattr(lw, k) for lw in weights.layers for k in KINDS] + [weights.output]
    return all(QTYPE_CODES.get(m.qtype) in x8 for m in mats) and \
        all(lw.w_gate.qtype == lw.w_up.qtype for lw in weights.layers)


def applies(cfg, weights, kv) -> str | None:
    """None where the persistent kernel runs this model's decode, else why not."""
    if cfg.qkv_bias or cfg.post_norms or cfg.embed_scale != 1.0 or cfg.attn_scale is not None:
        return "biases, post-norms, embedding or attention scales"
    if cfg.ffn_act != "silu":
        return f"FFN activation {cfg.ffn_act}"
    if any(cfg.layer_window(i) for i in range(cfg.n_layers)) or cfg.rope_freq_scale != 1.0:
        return "sliding windows or scaled RoPE"
    if kv.k_scale is not None or np.dtype(kv.dtype) != np.float16:
        return "a quantized KV pool"
    if cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 32 or cfg.head_dim > 256:
        return "head layout"
    mats = [getattr(lw, k) for lw in weights.layers for k in KINDS] + [weights.tok_embd, weights.output]
    for m in mats:
        if m.qtype not in QTYPE_CODES:
            return f"weight type {getattr(m.qtype, 'name', m.qtype)}"
        qk = _BLOCK[QTYPE_CODES[m.qtype]][0]
        if m.shape[1] % qk:
            return f"a {m.shape[1]}-column weight in {qk}-column blocks"
    smem = _shared_bytes(cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_ff, 32 if SIM else THREADS,
                         x8_fits(weights))
    most = smem_max()
    if smem > most:
        return f"its shape needs {smem} bytes of shared memory a block (at most {most})"
    if weights.output.raw.size % 16:
        return "an output head whose bytes are not a multiple of 16 (its rows are read 16 bytes at a time)"
    return None


class PackedWeights:
    """A model's weights as the kernel reads them: every layer matrix copied into one
    buffer (16-byte aligned each; a copy on the device, meant for small models such as
    drafts), the norms into another, with their tables; the embedding and head in place."""

    def __init__(self, cfg, weights, stream=0):
        L = cfg.n_layers
        offs, total = [], 0
        for lw in weights.layers:
            for k in KINDS:
                m = getattr(lw, k)
                offs.append((total, m))
                total += -(-m.raw.size // 16) * 16
        w8 = cuda.device_array(max(16, total), np.uint8)
        wtab = np.zeros((L, len(KINDS), 2), np.int64)  # (uint16 offset, type code)
        for i, (o, m) in enumerate(offs):
            w8[o:o + m.raw.size].copy_to_device(m.raw.reshape(m.raw.size), stream=stream)
            wtab[i // len(KINDS), i % len(KINDS)] = (o // 2, QTYPE_CODES[m.qtype])
        self.w = w8.view(np.uint16)
        norms, ntab, n = [], np.full((L, len(NORMS)), -1, np.int64), 0
        for li, lw in enumerate(weights.layers):
            for j, name in enumerate(NORMS):
                v = getattr(lw, name)
                if v is None or (name in ("q_norm", "k_norm") and not cfg.qk_norm):
                    continue
                host = v.copy_to_host().astype(np.float32)
                norms.append(host)
                ntab[li, j] = n
                n += host.size
        self.wtab, self.ntab = cuda.to_device(wtab, stream=stream), cuda.to_device(ntab, stream=stream)
        self.nw = cuda.to_device(np.concatenate(norms), stream=stream)
        emb, out = weights.tok_embd, weights.output
        self.emb, self.emb_qt = emb.raw.reshape(emb.raw.size), QTYPE_CODES[emb.qtype]
        self.outw, self.out_qt = out.raw.reshape(out.raw.size).view(np.uint16), QTYPE_CODES[out.qtype]
        self.out_norm = weights.out_norm
        from .rope import inv_freqs
        self.inv_freq = cuda.to_device(inv_freqs(cfg.rope_dim, cfg.rope_base), stream=stream)


class PersistentDecode:
    """A model's one-token forward on one cache through the persistent kernel: scratch at
    fixed addresses (CUDA graphs capture `forward`); `packed` (PackedWeights) may be shared
    by the caches of one model. x8: the row products over x in int8 (two planes, as the
    launch chain's products by default) where x8_fits (None), or over float x (False).
    pages_an_item > 0 fixes attention's pages an item (else as many as spread the items
    over the grid; the simulator's one block then still has several splits)."""

    def __init__(self, cfg, weights, kv, stream=0, blocks: int | None = None, packed: PackedWeights | None = None,
                 threads: int = THREADS, x8: bool | None = None, pages_an_item: int = 0):
        why = applies(cfg, weights, kv)
        if why is not None:
            raise ValueError(f"the persistent decode kernel does not take this model: {why}")
        self.cfg, self.kv, self.stream = cfg, kv, stream
        self.pk = packed or PackedWeights(cfg, weights, stream)
        L = cfg.n_layers
        d, dh = cfg.n_embd, cfg.head_dim
        qr, kr = cfg.n_heads * dh, cfg.n_kv_heads * dh
        self.xg = cuda.device_array(d, np.float32)
        self.qkv = cuda.device_array(qr + 2 * kr, np.float32)
        self.hg = cuda.device_array(cfg.n_ff, np.float32)
        pages = kv.max_blocks
        self.part_o = cuda.device_array(cfg.n_heads * pages * dh, np.float32)
        self.part_ml = cuda.device_array(cfg.n_heads * pages * 2, np.float32)
        self.cnt = cuda.to_device(np.zeros(2, np.int32), stream=stream)
        self.logits = cuda.device_array((1, cfg.vocab_size), np.float32)
        # globaltimer stamps (ns): the start, after each grid barrier, and the step's end
        # and inside block 0's first attention item of each layer (phase_times)
        # and inside block 0's row phases (phase_detail)
        self.stamps = cuda.to_device(np.zeros(17 * L + 4, np.int64), stream=stream)
        self.never = cuda.to_device(chain_state(), stream=stream)  # a chain that never stops
        self.kp = kv.k_pool.reshape(kv.k_pool.size).view(np.uint16)
        self.vp = kv.v_pool.reshape(kv.v_pool.size).view(np.uint16)
        self.threads = 32 if SIM else threads
        if SIM:
            self.blocks = 1  # blocks run one after another there: a grid barrier would never open
        else:
            self.blocks = blocks or cuda.get_current_device().MULTIPROCESSOR_COUNT
        from ..models.config import ROPE_HALVES
        fits = x8_fits(weights)
        if x8 and not fits:
            raise ValueError("int8 x needs Q4_K / Q6_K row products, gate and up of one type")
        self.x8 = fits if x8 is None else x8
        self.kernel = _kernel(d, cfg.n_heads, cfg.n_kv_heads, dh, cfg.n_ff, L, cfg.rope_dim,
                              cfg.rope_style == ROPE_HALVES, bool(cfg.qk_norm), float(cfg.rms_eps), self.threads, pages,
                              self.x8, pages_an_item)
        shape = (d, cfg.n_heads, cfg.n_kv_heads, dh, cfg.n_ff, self.threads, self.x8)
        self.smem = 0 if _static_shared(*shape) else _shared_bytes(*shape)  # the dynamic bytes a launch asks for

    def forward(self, tok_d, pos_d, chain=None):
        """Logits [1, vocab] of the token tok_d[0] at position pos_d[0] (device int32), its
        K/V written at the pool's row meta[0] (the caller has reserved it). chain: a
        draft's device chain (luce.kernels.sampling.chain_state): once it has stopped the
        step does nothing (None: never)."""
        kv, pk = self.kv, self.pk
        with_shared(self.kernel, self.blocks, self.threads, self.stream, self.smem)(
            pk.w, pk.wtab, pk.nw, pk.ntab, pk.emb, pk.emb_qt, pk.outw, pk.out_qt, pk.out_norm, pk.inv_freq, tok_d, pos_d, kv.k_pool, kv.v_pool, self.kp, self.vp, kv.table_d, kv.meta,
            kv.pos_d, self.xg, self.qkv, self.hg, self.part_o, self.part_ml, self.cnt, self.logits,
            self.stamps, self.never if chain is None else chain)
        return self.logits

    def phase_times(self):
        """us a phase of the last step, from its globaltimer stamps: (embedding, [per layer:
        q/k/v, attention, o, gate/up, down], head). Meaningful on a GPU only."""
        st = self.stamps.copy_to_host().astype(np.float64) / 1e3
        d = np.diff(st)
        L = self.cfg.n_layers
        return d[0], d[1:1 + 5 * L].reshape(L, 5), d[1 + 5 * L]

    def attention_item_times(self):
        """us of block 0's first attention item of the last step, mean over layers: (q norm
        and rotation, the new k and the keys, the partials' write)."""
        L = self.cfg.n_layers
        st = self.stamps.copy_to_host().astype(np.float64)[5 * L + 3:9 * L + 3].reshape(-1, 4) / 1e3
        return np.diff(st, axis=1).mean(axis=0)

    def phase_detail(self):
        """us inside block 0's row phases of the last step, mean over layers: for q/k/v, o,
        gate/up and down each (x staged and normed, its rows, the rest of the phase: the
        wait for the other blocks and the grid barrier); then the head's norm and rows."""
        L = self.cfg.n_layers
        st = self.stamps.copy_to_host().astype(np.float64) / 1e3
        ends = st[1:2 + 5 * L]  # ends[e]: the barrier that ends phase e (0: the embedding)
        det = st[9 * L + 3:17 * L + 3].reshape(L, 4, 2)
        out = np.zeros((L, 4, 3))
        for li in range(L):
            for j, ph in enumerate((0, 2, 3, 4)):  # q/k/v, o, gate/up, down among a layer's 5 phases
                start, end = ends[5 * li + ph], ends[5 * li + ph + 1]
                out[li, j] = (det[li, j, 0] - start, det[li, j, 1] - det[li, j, 0], end - det[li, j, 1])
        head_norm = st[17 * L + 3] - ends[5 * L]
        head_rows = st[5 * L + 2] - st[17 * L + 3]
        return out.mean(axis=0), (head_norm, head_rows)
