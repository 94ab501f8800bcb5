"""Bandwidth-oriented decode matvec y = W x for Q4_K, Q6_K and Q8_0 (one activation row).

Why a second kernel: luce.kernels.matvec stages whole blocks in shared memory and decodes
element by element through a generic interface; on the H200 that reaches 15-28% of copy
bandwidth. Here (llama.cpp mmvq style) weights never go through shared memory: each lane
takes one "unit" (a fixed slice of one block: TPB lanes cover a block) straight into
registers with ld.global.nc.v4, reads the block's scales itself (the other lanes of the
block hit the same L1 line), and multiplies with x read as float4 (x stays in L1/L2).

Lanes and rows: a warp's 32 lanes form GROUPS groups of 32/GROUPS lanes; each group works
on its own ROWS (2) rows and all groups walk the same columns, so an x load by the warp
touches 32/GROUPS cache lines, and each x load serves both rows of a group. The warps of
a block split a row's units between them and meet in shared memory. Why: with one group
(every lane on the same two rows, lanes 64-256 bytes of x apart) each x load touched 32
lines, and Nsight Compute on the H200 showed Q4_K bound by L1 wavefronts (L1 92% busy,
DRAM 19%); with 8 groups Q4_K runs 2-2.7x faster (docs/benchmarks.md). grid_shape picks
groups and warps a block from the row count (about one wave of resident warps).

Once loads are wide, instruction issue is the next bound: Q4_K at 4 TB/s is ~32 weights
per SM clock against 128 issue slots. So each quant becomes a float with one logic op and
one add: (word | M) & (mask | M), M = 0x4B000000, read as float is 2**23 + (field << p)
exactly, and subtracting 2**23 (plus Q6_K's 32 or Q8_0's 128, still exact) leaves the
weight times 2**p. Fields at different bit positions p go to different accumulators,
scaled by 2**-p once per unit; that also gives each lane several independent FMA chains.
The floor is then 3 instructions per weight and row (logic, add, FMA); the SASS of the
loops (sm_90, ptxas 13) has about 4.6 (Q4_K), 6.4 (Q6_K) and 7.4 (Q8_0). Measured on the
H200 with row groups: Q4_K 42-48%, Q6_K 39-48%, Q8_0 51-57% of copy bandwidth at the FFN
shapes (ncu, Q4_K: L1 67%, DRAM 38%, SM 55% busy: no single unit saturated, latency
next). Fewer instructions a weight would be the next step: int8 x with dp4a (inexact) or
tensor-core mma on f16-decoded weights.

Q4_K's mins need the sums of x over each sub-block. Each unit adds up the x it
loads anyway (INLINE_SUMS); the alternative, every thread block summing all of x into
shared memory before its first weight load, reads x once per block and puts a barrier
in front of the loads (H200: Q4_K at 18-19% of copy bandwidth that way). Q6_K (210-byte) and
Q8_0 (34-byte) blocks sit at any even byte offset, so their 16-byte pieces come from two
aligned 16-byte loads and a funnel shift (ld16); the second load hits L1 and DRAM traffic
is unchanged. Arguments the fast path cannot take (a weight or x not 16-byte aligned, a
weight buffer whose size is not a multiple of 16 bytes) go to luce.kernels.matvec, which
has the same semantics.

Float32 sums, like matvec: results agree with matvec_ref to ~1e-5 of sum |W| |x| (the tests'
bound); the order of additions differs from matvec, so the two differ in the last bits.
"""
from __future__ import annotations

import functools
import math
import os
from collections import namedtuple

import numpy as np
from numba import cuda

from .device import device, fma
from . import matvec as _mv
from .activation import gelu_tanh
from .dequant import SIM, T, as_device, as_qtype, row_bytes, weight_u16
from . import pdl
from .pdl import grid_dependency_sync, l2_prefetch, ready as pdl_ready
from .quantize_x import FINE, block_bytes, int8_half_store
from .vector_load import (f16_bits_to_f32, ldg_f32x4, ldg_u16_u32x2, ldg_u16_u32x4, ldw_u16_u32x4,
                          u32_bits_to_f32)

__all__ = ["FAST_TYPES", "MAX_X_ROWS", "matvec_fast", "matvec_fast_norm", "matvec_fast_pair", "swiglu_fast",
           "bench_matvec_fast"]

_dev = device  # plain Python in the simulator where it can be: see luce.kernels.device

NW = 4     # warps per thread block (grid_shape doubles it for matrices of few rows)
ROWS = 2   # rows per lane group: each x load serves both (x is 4-8x the weight bytes per element)

U = np.uint32
U64 = np.uint64
MAGIC = U(0x4B000000)
F_MAGIC = np.float32(8388608.0)
B16 = U(16)
S8 = np.float32(1.0 / 256)


if SIM:
    @_dev
    def shr32(a, s):
        return U(U(a) >> U(s))

    @_dev
    def bitsel(a, b, c):
        return U(U(a & c) | U(b & ~U(c)))

    @_dev
    def dp4a_us(a, b, c):
        """c + the sum of a's four unsigned bytes times b's four signed bytes."""
        s = int(c)
        for k in range(4):
            sb = (int(b) >> (8 * k)) & 255
            s += ((int(a) >> (8 * k)) & 255) * (sb - 256 if sb > 127 else sb)
        return np.int32(s)
else:
    from numba.cuda import types as _types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shr32(typingctx, a, s):
        """a >> s in 32 bits: numba types uint32 >> uint32 as 64-bit, and LLVM keeps a
        variable 64-bit shift (two instructions and conversions) where one would do."""
        sig = _types.uint32(_types.uint32, _types.uint32)

        def codegen(context, builder, sig, args):
            return builder.lshr(args[0], args[1])
        return sig, codegen

    def _asm3(name, ptx, sig):
        """An intrinsic that is one PTX instruction of three 32-bit operands."""
        def typer(typingctx, a, b, c):
            def codegen(context, builder, sig_, args):
                from llvmlite import ir
                i32 = ir.IntType(32)
                return builder.call(ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), ptx, "=r,r,r,r"), args)
            return sig, codegen
        typer.__name__ = name
        return intrinsic(typer)

    # (a & c) | (b & ~c) as one lop3: written in numba, LLVM's canonical form with two
    # constant masks becomes two LOP3s (each takes one immediate)
    bitsel = _asm3("bitsel", "lop3.b32 $0, $1, $2, $3, 0xE4;",
                   _types.uint32(_types.uint32, _types.uint32, _types.uint32))
    # c + the sum of a's four unsigned bytes times b's four signed bytes (numba has no dp4a)
    dp4a_us = _asm3("dp4a_us", "dp4a.u32.s32 $0, $1, $2, $3;", _types.int32(_types.uint32, _types.uint32, _types.int32))


@_dev
def fmm(vm, mask, bias):
    """Field `mask` of vm = v | 0x4B000000 as float32, less bias - 2**23: (v & mask) | M
    equals (v | M) & (mask | M) when mask and M share no bits, and the latter needs one
    logic op with one immediate per field (the former two: LOP3 takes one immediate),
    with v | M shared by all the fields of a word."""
    return u32_bits_to_f32(U(vm & U(U(mask) | MAGIC))) - bias


@_dev
def fms(v, bias):
    """Like fm, subtracting 2**23 + an offset in the same add (int8 read as offset binary)."""
    return u32_bits_to_f32(U(v | MAGIC)) - bias


@_dev
def pieces(h):
    """For 16-byte pieces at uint16 indices h + 8k: (first aligned index, second aligned
    index, offset a of the pieces in their aligned 16 bytes). Computed once per block row so
    that every piece's two loads are a base register plus a constant."""
    a = U(h & 7)  # 32-bit: ld16's tests would otherwise be 64-bit compares
    b0 = h - a
    # When a == 0 the second piece is unused; re-reading the first keeps the load in bounds.
    return b0, b0 + (8 if a != U(0) else 0), a


@_dev
def ld16(w, i0, i1, a):
    """16 bytes at uint16 index i0 + a of w as four little-endian words, from the aligned
    16 bytes at i0 and at i1 (see pieces)."""
    a0, a1, a2, a3 = ldw_u16_u32x4(w, i0)
    b0, b1, b2, b3 = ldw_u16_u32x4(w, i1)
    s2 = U(a & U(4)) != U(0)
    c0 = a2 if s2 else a0
    c1 = a3 if s2 else a1
    c2 = b0 if s2 else a2
    c3 = b1 if s2 else a3
    c4 = b2 if s2 else b0
    c5 = b3 if s2 else b1
    s1 = U(a & U(2)) != U(0)
    d0 = c1 if s1 else c0
    d1 = c2 if s1 else c1
    d2 = c3 if s1 else c2
    d3 = c4 if s1 else c3
    d4 = c5 if s1 else c4
    if a & U(1):  # ptxas predicates this: one funnel shift (SHF) per word
        return (U(U(d0 >> B16) | U(d1 << B16)), U(U(d1 >> B16) | U(d2 << B16)),
                U(U(d2 >> B16) | U(d3 << B16)), U(U(d3 >> B16) | U(d4 << B16)))
    return d0, d1, d2, d3


# ---------------------------------------------------------------------------------------
# Per-type units, in two halves: load(w, ha, hb, t) -> raw: the weight words of unit t of
# the blocks starting at uint16 index ha (row a) and hb (row b); dot(raw, w, ha, hb, x, sxs,
# c, t) -> (ya, yb): their dot products with x, c = the block's first column; sxs = the
# sums of x over each 16 columns (filled only for types whose spec asks for them).
# ---------------------------------------------------------------------------------------
@_dev
def nib_acc(q, x0, x1, x2, x3, sh, a0, a8):
    """Nibble `sh` (0 or 4) of the four bytes of q times x0..x3, into the accumulators of
    bit positions sh (bytes 0, 2) and 8 + sh (bytes 1, 3)."""
    qm = U(q | MAGIC)
    q2m = U(U(q >> B16) | MAGIC)
    m0 = U(U(15) << U(sh))
    m8 = U(U(0xF00) << U(sh))
    a0 = fma(fmm(qm, m0, F_MAGIC), x0, a0)
    a8 = fma(fmm(qm, m8, F_MAGIC), x1, a8)
    a0 = fma(fmm(q2m, m0, F_MAGIC), x2, a0)
    a8 = fma(fmm(q2m, m8, F_MAGIC), x3, a8)
    return a0, a8


@_dev
def k4_scales(s1, s2, s3, t):
    """Sub-blocks 2t and 2t + 1 of a Q4_K block whose scale bytes are the words s1..s3:
    (scale 2t, 256 * scale 2t+1, min 2t, 256 * min 2t+1), both bytes at once (they are
    adjacent in every word). t differs between the lanes of a warp: both layouts (t < 2,
    t >= 2) are computed and one selected with a bit mask (an `if` would stay a branch)."""
    sh = U(16 * (t & 1))
    u1 = shr32(s1, sh)
    u2 = shr32(s2, sh)
    u3 = shr32(s3, sh)
    m = U(U(t >> 1) * U(0xFFFFFFFF))  # t < 4
    sc0 = U(u1 & U(0x3F3F))
    mn0 = U(u2 & U(0x3F3F))
    sc1 = U(U(u3 & U(0x0F0F)) | U(U(u1 >> U(2)) & U(0x3030)))
    mn1 = U(U(U(u3 >> U(4)) & U(0x0F0F)) | U(U(u2 >> U(2)) & U(0x3030)))
    scm = U(U(sc0 ^ U(U(sc0 ^ sc1) & m)) | MAGIC)
    mnm = U(U(mn0 ^ U(U(mn0 ^ mn1) & m)) | MAGIC)
    return (fmm(scm, 0xFF, F_MAGIC), fmm(scm, 0xFF00, F_MAGIC),
            fmm(mnm, 0xFF, F_MAGIC), fmm(mnm, 0xFF00, F_MAGIC))


@_dev
def k4_row(s0, s1, s2, s3, t, l0, l8, h0, h8, sxl, sxh):
    d = f16_bits_to_f32(U(s0 & U(0xFFFF)))
    dm = f16_bits_to_f32(U(s0 >> B16))
    scl, sch, mnl, mnh = k4_scales(s1, s2, s3, t)
    lo = l0 + l8 * S8
    hi = (h0 + h8 * S8) * np.float32(1.0 / 4096)  # 1/16 for the high nibble, 1/256 for sch
    return d * (scl * lo + sch * hi) - dm * (mnl * sxl + mnh * (sxh * S8))


@_dev
def k4_word(qa, qb, x, c, acc):
    """One quant word (8 nibbles: 4 columns of each sub-block) of rows a and b, and the
    sums of x over those columns (for the mins; unused, and dropped by LLVM, when the
    kernel takes them from shared memory)."""
    al0, al8, ah0, ah8, bl0, bl8, bh0, bh8, sl, sh = acc
    x0, x1, x2, x3 = ldg_f32x4(x, c)
    y0, y1, y2, y3 = ldg_f32x4(x, c + 32)
    al0, al8 = nib_acc(qa, x0, x1, x2, x3, 0, al0, al8)
    ah0, ah8 = nib_acc(qa, y0, y1, y2, y3, 4, ah0, ah8)
    bl0, bl8 = nib_acc(qb, x0, x1, x2, x3, 0, bl0, bl8)
    bh0, bh8 = nib_acc(qb, y0, y1, y2, y3, 4, bh0, bh8)
    sl += (x0 + x1) + (x2 + x3)
    sh += (y0 + y1) + (y2 + y3)
    return al0, al8, ah0, ah8, bl0, bl8, bh0, bh8, sl, sh


@_dev
def load_q4_k(w, ha, hb, t):
    # Q4_K: d dmin scales[12] qs[128]; qs byte 32j + l holds columns 64j + l (low
    # nibble, sub-block 2j) and 64j + 32 + l (high nibble, sub-block 2j + 1). Unit t (4 a
    # block) holds two 16-byte pieces of rows a and b, qs bytes 16t + 64k .. + 15 for k =
    # 0, 1 (chunk j = 2k + (t >> 1)), and each row's 16-byte header (d, dmin, scales).
    # The four units' first pieces are 64 contiguous bytes, and their x (columns
    # 64j + 16 (t & 1) ..) two cache lines: with 32-byte pieces (unit t = chunk t) a
    # group's loads touched twice the lines (L1 was the bound, ncu). Every piece is
    # 16-byte aligned (144 = 9 * 16).
    return (ldw_u16_u32x4(w, ha + 8 + 8 * t), ldw_u16_u32x4(w, ha + 40 + 8 * t),
            ldw_u16_u32x4(w, hb + 8 + 8 * t), ldw_u16_u32x4(w, hb + 40 + 8 * t),
            ldw_u16_u32x4(w, ha), ldw_u16_u32x4(w, hb))


def _make_unit_q4_k(inline_sums: bool):
    load = load_q4_k

    @_dev
    def piece(qa, qb, sa, sb, x, sxs, c, j, l):
        """Rows a and b of one piece: chunk j, its 16 bytes from qs byte 32j + l."""
        # Tuple elements are taken with literal indices only: a variable index becomes a
        # branchy switch in numba.
        cl = c + 64 * j + l
        z = np.float32(0.0)
        acc = (z, z, z, z, z, z, z, z, z, z)
        acc = k4_word(qa[0], qb[0], x, cl, acc)
        acc = k4_word(qa[1], qb[1], x, cl + 4, acc)
        acc = k4_word(qa[2], qb[2], x, cl + 8, acc)
        acc = k4_word(qa[3], qb[3], x, cl + 12, acc)
        al0, al8, ah0, ah8, bl0, bl8, bh0, bh8, sxl, sxh = acc
        if not inline_sums:  # the sums of x over 16 columns of both sub-blocks, made once per block
            sxl = sxs[((c + 64 * j + l) >> 4)]
            sxh = sxs[((c + 64 * j + l) >> 4) + 2]
        return (k4_row(sa[0], sa[1], sa[2], sa[3], j, al0, al8, ah0, ah8, sxl, sxh),
                k4_row(sb[0], sb[1], sb[2], sb[3], j, bl0, bl8, bh0, bh8, sxl, sxh))

    return load, _q4_k_dot(piece)


def _q4_k_dot(piece):
    """A Q4_K unit's dot from its piece function: the unit's two 16-byte pieces (chunks
    t >> 1 and 2 + (t >> 1), half t & 1 of each) of rows a and b."""
    @_dev
    def dot(raw, w, ha, hb, x, sxs, c, t):
        qa0, qa1, qb0, qb1, sa, sb = raw
        p = t >> 1
        l = 16 * (t & 1)
        ya, yb = piece(qa0, qb0, sa, sb, x, sxs, c, p, l)
        za, zb = piece(qa1, qb1, sa, sb, x, sxs, c, p + 2, l)
        return ya + za, yb + zb
    return dot


M4 = U(0x0F0F0F0F)


@_dev
def k4x8_ints(q, lo, hi):
    """The integer dot products of one 16-byte Q4_K piece (words q) with int8 x: its low
    nibbles with the x words `lo` (sub-block 2j), its high nibbles with `hi` (2j + 1)."""
    z = np.int32(0)
    il = dp4a_us(U(q[0] & M4), lo[0], z)
    il = dp4a_us(U(q[1] & M4), lo[1], il)
    il = dp4a_us(U(q[2] & M4), lo[2], il)
    il = dp4a_us(U(q[3] & M4), lo[3], il)
    ih = dp4a_us(U(shr32(q[0], U(4)) & M4), hi[0], z)
    ih = dp4a_us(U(shr32(q[1], U(4)) & M4), hi[1], ih)
    ih = dp4a_us(U(shr32(q[2], U(4)) & M4), hi[2], ih)
    ih = dp4a_us(U(shr32(q[3], U(4)) & M4), hi[3], ih)
    return il, ih


@_dev
def k4x8_row(s0, s1, s2, s3, j, fl, fh, sxl, sxh):
    """One row's sum over a piece: fl, fh the integer products of its low and high nibbles
    with x, times x's step (summed over the planes)."""
    d = f16_bits_to_f32(U(s0 & U(0xFFFF)))
    dm = f16_bits_to_f32(U(s0 >> B16))
    scl, sch, mnl, mnh = k4_scales(s1, s2, s3, j)  # sch and mnh come 256x
    return d * (scl * fl + sch * (fh * S8)) - dm * (mnl * sxl + mnh * (sxh * S8))


def _make_unit_q4_k_x8(inline_sums: bool, planes: int = 1, xload=ldg_u16_u32x4):
    """Q4_K units over int8 x (luce.kernels.quantize_x, `planes` planes): the same weight
    loads as the float units; per 16-byte piece and row 8 dp4a a plane and 8 logic ops
    where the float unit has ~70 instructions. The mins multiply the exact float sums of x
    kept with it, so the only error is x's rounding (to 8 bits; with two planes, ~16).
    xload reads x's words (luce.kernels.persistent_decode: from shared memory)."""
    XB = block_bytes(planes) // 2  # uint16 of a 32-column block of quantized x
    TWO = planes == 2
    MO = 16 * planes  # its 16 bytes of step and sums

    @_dev
    def piece(qa, qb, sa, sb, xq, sxs, c, j, l):
        bl = ((c + 64 * j) >> 5) * XB  # sub-block 2j's x block; 2j + 1's follows
        lo = xload(xq, bl + (l >> 1))
        hi = xload(xq, bl + XB + (l >> 1))
        ml = xload(xq, bl + MO)
        mh = xload(xq, bl + XB + MO)
        first = l == 0  # this piece's 16 columns: the first or the last half of each block
        sxl = u32_bits_to_f32(ml[2] if first else ml[3])
        sxh = u32_bits_to_f32(mh[2] if first else mh[3])
        ila, iha = k4x8_ints(qa, lo, hi)
        ilb, ihb = k4x8_ints(qb, lo, hi)
        if TWO:  # the fine plane: the same nibbles (their masks computed once) with its x
            lo2 = xload(xq, bl + 16 + (l >> 1))
            hi2 = xload(xq, bl + XB + 16 + (l >> 1))
            fla, fha = k4x8_ints(qa, lo2, hi2)
            flb, fhb = k4x8_ints(qb, lo2, hi2)
            # exact in 32 bits (below 2**23); int32 spelled out: numba widens int32 sums to 64
            ila, iha = np.int32(FINE * ila + fla), np.int32(FINE * iha + fha)
            ilb, ihb = np.int32(FINE * ilb + flb), np.int32(FINE * ihb + fhb)
        dxl = u32_bits_to_f32(ml[0] if first else ml[1])
        dxh = u32_bits_to_f32(mh[0] if first else mh[1])
        return (k4x8_row(sa[0], sa[1], sa[2], sa[3], j, dxl * np.float32(ila), dxh * np.float32(iha), sxl, sxh),
                k4x8_row(sb[0], sb[1], sb[2], sb[3], j, dxl * np.float32(ilb), dxh * np.float32(ihb), sxl, sxh))

    return load_q4_k, _q4_k_dot(piece)


@_dev
def q6_bits(ql, qh, g):
    """Group g of Q6_K in one word of ql and qh: nibble g >> 1 of ql with bits 2g, 2g + 1
    of qh as bits 4-5 of each byte (bits 6-7 are left over: callers mask them)."""
    lo = U(ql >> U(4 * (g >> 1)))
    # qh's bits 2g, 2g + 1 of each byte to bits 4-5 (g is a literal: one shift or none)
    if g == 0:
        hi = U(qh << U(4))
    elif g == 1:
        hi = U(qh << U(2))
    elif g == 2:
        hi = qh
    else:
        hi = U(qh >> U(2))
    return bitsel(lo, hi, U(0x0F0F0F0F))  # one bit-select: low nibbles from lo, the rest from hi


@_dev
def q6_acc(ql, qh, g, x0, x1, x2, x3, a0, a8):
    """Group g of Q6_K: each byte's 6-bit q, less 32 in the same add as the magic (exact:
    small integers); the field masks drop bits 6-7."""
    v = q6_bits(ql, qh, g)
    vm = U(v | MAGIC)
    v2m = U(U(v >> B16) | MAGIC)
    b0 = np.float32(8388608.0 + 32)
    b8 = np.float32(8388608.0 + 32 * 256)
    a0 = fma(fmm(vm, 63, b0), x0, a0)
    a8 = fma(fmm(vm, 0x3F00, b8), x1, a8)
    a0 = fma(fmm(v2m, 63, b0), x2, a0)
    a8 = fma(fmm(v2m, 0x3F00, b8), x3, a8)
    return a0, a8


@_dev
def i8f(b):
    """The int8 in the low byte of b as float32."""
    return fms(U(U(b ^ U(0x80)) & U(255)), np.float32(8388608.0 + 128))


@_dev
def q6_group(pa, ha, pb, hb, g, x, c):
    """Group g (32 columns; this unit's 16 start at c) of rows a and b of a Q6_K block:
    the sums of (q - 32) * x."""
    z = np.float32(0.0)
    x0, x1, x2, x3 = ldg_f32x4(x, c)
    y0, y1, y2, y3 = ldg_f32x4(x, c + 4)
    a0, a8 = q6_acc(pa[0], ha[0], g, x0, x1, x2, x3, z, z)
    b0, b8 = q6_acc(pb[0], hb[0], g, x0, x1, x2, x3, z, z)
    a0, a8 = q6_acc(pa[1], ha[1], g, y0, y1, y2, y3, a0, a8)
    b0, b8 = q6_acc(pb[1], hb[1], g, y0, y1, y2, y3, b0, b8)
    x0, x1, x2, x3 = ldg_f32x4(x, c + 8)
    y0, y1, y2, y3 = ldg_f32x4(x, c + 12)
    a0, a8 = q6_acc(pa[2], ha[2], g, x0, x1, x2, x3, a0, a8)
    b0, b8 = q6_acc(pb[2], hb[2], g, x0, x1, x2, x3, b0, b8)
    a0, a8 = q6_acc(pa[3], ha[3], g, y0, y1, y2, y3, a0, a8)
    b0, b8 = q6_acc(pb[3], hb[3], g, y0, y1, y2, y3, b0, b8)
    return a0 + a8 * S8, b0 + b8 * S8


@_dev
def load_q6_k(w, ha, hb, t):
    # Q6_K: ql[128] qh[64] scales[16] (int8) d. Column 128n + 32g + l: nibble g >> 1 of
    # ql[64n + 32(g & 1) + l], bits 2g of qh[32n + l], scale 8n + 2g + l // 16. Unit t (4 a
    # block) = (n, h) = (t >> 1, t & 1) holds l = 16h .. 16h + 15 of all four groups g.
    # All four pieces of a unit share one offset mod 16, so ld16's selects agree.
    n = t >> 1
    hh = t & 1
    o = 32 * n + 8 * hh
    oh = 64 + 16 * n + 8 * hh
    p0, p1, pa = pieces(ha)
    la0 = ld16(w, p0 + o, p1 + o, pa)                    # ql, groups 0 and 2
    la1 = ld16(w, p0 + o + 16, p1 + o + 16, pa)          # ql, groups 1 and 3
    lha = ld16(w, p0 + oh, p1 + oh, pa)                  # qh
    p0, p1, pa = pieces(hb)
    return la0, la1, lha, ld16(w, p0 + o, p1 + o, pa), ld16(w, p0 + o + 16, p1 + o + 16, pa), \
        ld16(w, p0 + oh, p1 + oh, pa), q6_scales(w, ha, n), q6_scales(w, hb, n)


@_dev
def q6_scales(w, h, n):
    """The uint16 words holding scales 8n + 2g + (0, 1) for g = 0..3 (scale 8n + 2g + hh is
    byte hh of uint16 96 + 4n + g), and d, of the block at uint16 h: loaded with the quants
    so that a unit's arithmetic waits on no load of its own."""
    sa = U64(h + 96 + 4 * n)  # unsigned: numba adds no negative-index wraparound
    return w[sa], w[sa + U64(1)], w[sa + U64(2)], w[sa + U64(3)], w[U64(h + 104)]


@_dev
def dot_q6_k(raw, w, ha, hb, x, sxs, c, t):
    la0, la1, lha, lb0, lb1, lhb, sa, sb = raw
    n = t >> 1
    hh = t & 1
    cc = c + 128 * n + 16 * hh
    ssh = U(8 * hh)
    z = np.float32(0.0)
    ya, yb = q6_step(sa[0], sb[0], ssh, la0, lha, lb0, lhb, 0, x, cc, z, z)
    ya, yb = q6_step(sa[1], sb[1], ssh, la1, lha, lb1, lhb, 1, x, cc + 32, ya, yb)
    ya, yb = q6_step(sa[2], sb[2], ssh, la0, lha, lb0, lhb, 2, x, cc + 64, ya, yb)
    ya, yb = q6_step(sa[3], sb[3], ssh, la1, lha, lb1, lhb, 3, x, cc + 96, ya, yb)
    return f16_bits_to_f32(U(sa[4])) * ya, f16_bits_to_f32(U(sb[4])) * yb


@_dev
def q6_step(sca, scb, ssh, pa, qa, pb, qb, g, x, c, ya, yb):
    da, db = q6_group(pa, qa, pb, qb, g, x, c)
    ya = fma(i8f(shr32(U(sca), ssh)), da, ya)
    yb = fma(i8f(shr32(U(scb), ssh)), db, yb)
    return ya, yb


@_dev
def q8_acc(q, x0, x1, x2, x3, a0, a8):
    v = U(q ^ U(0x80808080))
    vm = U(v | MAGIC)
    v2m = U(U(v >> B16) | MAGIC)
    b0 = np.float32(8388608.0 + 128)
    b8 = np.float32(8388608.0 + 128 * 256)
    a0 = fma(fmm(vm, 255, b0), x0, a0)
    a8 = fma(fmm(vm, 0xFF00, b8), x1, a8)
    a0 = fma(fmm(v2m, 255, b0), x2, a0)
    a8 = fma(fmm(v2m, 0xFF00, b8), x3, a8)
    return a0, a8


@_dev
def load_q8_0(w, ha, hb, t):
    # Q8_0: d qs[32]. Unit t (2 a block) holds qs bytes 16t .. 16t + 15 = columns 16t + 0..15.
    p0, p1, pa = pieces(ha + 1 + 8 * t)
    qa = ld16(w, p0, p1, pa)
    p0, p1, pa = pieces(hb + 1 + 8 * t)
    return qa, ld16(w, p0, p1, pa), w[U64(ha)], w[U64(hb)]


@_dev
def dot_q8_0(raw, w, ha, hb, x, sxs, c, t):
    qa, qb, da_bits, db_bits = raw
    da = f16_bits_to_f32(U(da_bits))
    db = f16_bits_to_f32(U(db_bits))
    z = np.float32(0.0)
    acc = q8_word(qa[0], qb[0], x, c + 16 * t, (z, z, z, z))
    acc = q8_word(qa[1], qb[1], x, c + 16 * t + 4, acc)
    acc = q8_word(qa[2], qb[2], x, c + 16 * t + 8, acc)
    a0, a8, b0, b8 = q8_word(qa[3], qb[3], x, c + 16 * t + 12, acc)
    return da * (a0 + a8 * S8), db * (b0 + b8 * S8)


@_dev
def q8_word(qa, qb, x, c, acc):
    a0, a8, b0, b8 = acc
    x0, x1, x2, x3 = ldg_f32x4(x, c)
    a0, a8 = q8_acc(qa, x0, x1, x2, x3, a0, a8)
    b0, b8 = q8_acc(qb, x0, x1, x2, x3, b0, b8)
    return a0, a8, b0, b8


@_dev
def q6_vals(ql, qh, g):
    """The four 6-bit quants (0..63, stored plus 32) of group g in one word of ql and qh, a
    byte each, for dp4a."""
    return U(q6_bits(ql, qh, g) & U(0x3F3F3F3F))


@_dev
def load_q6_k_g8(w, ha, hb, t):
    """load_q6_k's words from Q6_K rows in q6k_groups' g8 layout, every piece one aligned
    load. ha, hb: 8 x (a row's group start, uint16) + the block's place in its group."""
    n = t >> 1
    hh = t & 1
    ga = ha >> 3
    ja = ha & 7
    gb = hb >> 3
    jb = hb & 7
    o = 32 * n + 8 * hh
    oh = 512 + 16 * n + 8 * hh
    la0 = ldw_u16_u32x4(w, ga + 64 * ja + o)             # ql, groups 0 and 2
    la1 = ldw_u16_u32x4(w, ga + 64 * ja + o + 16)        # ql, groups 1 and 3
    lha = ldw_u16_u32x4(w, ga + 32 * ja + oh)            # qh
    lb0 = ldw_u16_u32x4(w, gb + 64 * jb + o)
    lb1 = ldw_u16_u32x4(w, gb + 64 * jb + o + 16)
    lhb = ldw_u16_u32x4(w, gb + 32 * jb + oh)
    sa0, sa1 = ldg_u16_u32x2(w, ga + 768 + 8 * ja + 4 * n)  # scales 8n .. 8n + 7: 8 bytes
    sb0, sb1 = ldg_u16_u32x2(w, gb + 768 + 8 * jb + 4 * n)
    sa = (sa0, U(sa0 >> B16), sa1, U(sa1 >> B16), U(w[U64(ga + 832 + ja)]))
    sb = (sb0, U(sb0 >> B16), sb1, U(sb1 >> B16), U(w[U64(gb + 832 + jb)]))
    return la0, la1, lha, lb0, lb1, lhb, sa, sb


def _make_unit_q6_k_x8(inline_sums: bool, planes: int = 1, xload=ldg_u16_u32x4):
    """Q6_K units over int8 x (`planes` planes): dot_q6_k's loads and scales, each group's
    16 quants times x with four dp4a a row and plane (the float unit: ~100 instructions a
    group and row)."""
    XB = block_bytes(planes) // 2
    TWO = planes == 2
    MO = 16 * planes

    @_dev
    def ints(pa, qa, pb, qb, g, xw):
        z = np.int32(0)
        ia = dp4a_us(q6_vals(pa[0], qa[0], g), xw[0], z)
        ib = dp4a_us(q6_vals(pb[0], qb[0], g), xw[0], z)
        ia = dp4a_us(q6_vals(pa[1], qa[1], g), xw[1], ia)
        ib = dp4a_us(q6_vals(pb[1], qb[1], g), xw[1], ib)
        ia = dp4a_us(q6_vals(pa[2], qa[2], g), xw[2], ia)
        ib = dp4a_us(q6_vals(pb[2], qb[2], g), xw[2], ib)
        ia = dp4a_us(q6_vals(pa[3], qa[3], g), xw[3], ia)
        ib = dp4a_us(q6_vals(pb[3], qb[3], g), xw[3], ib)
        return ia, ib

    @_dev
    def plane(pa, qa, pb, qb, g, xq, xb, hh):
        """Rows a and b of group g's 16 columns of this unit (x block at uint16 xb): the sums
        of q x as x's int8 form holds it less 32 times the exact x (the quants are stored
        plus 32)."""
        m = xload(xq, xb + MO)
        ia, ib = ints(pa, qa, pb, qb, g, xload(xq, xb + 8 * hh))
        if TWO:
            fa, fb = ints(pa, qa, pb, qb, g, xload(xq, xb + 16 + 8 * hh))
            ia, ib = np.int32(FINE * ia + fa), np.int32(FINE * ib + fb)  # below 2**25
        off = np.float32(-32.0) * u32_bits_to_f32(m[3] if hh else m[2])
        dx = u32_bits_to_f32(m[1] if hh else m[0])
        return fma(dx, np.float32(ia), off), fma(dx, np.float32(ib), off)

    @_dev
    def step(sca, scb, ssh, pa, qa, pb, qb, g, xq, xb, hh, ya, yb):
        """Group g's 16 columns of this unit (its x block at uint16 xb), rows a and b."""
        fa, fb = plane(pa, qa, pb, qb, g, xq, xb, hh)
        ya = fma(i8f(shr32(U(sca), ssh)), fa, ya)
        yb = fma(i8f(shr32(U(scb), ssh)), fb, yb)
        return ya, yb

    @_dev
    def dot(raw, w, ha, hb, xq, sxs, c, t):
        la0, la1, lha, lb0, lb1, lhb, sa, sb = raw
        n = t >> 1
        hh = t & 1
        xb = ((c + 128 * n) >> 5) * XB  # group 0's x block; group g's is g blocks on
        ssh = U(8 * hh)
        z = np.float32(0.0)
        ya, yb = step(sa[0], sb[0], ssh, la0, lha, lb0, lhb, 0, xq, xb, hh, z, z)
        ya, yb = step(sa[1], sb[1], ssh, la1, lha, lb1, lhb, 1, xq, xb + XB, hh, ya, yb)
        ya, yb = step(sa[2], sb[2], ssh, la0, lha, lb0, lhb, 2, xq, xb + 2 * XB, hh, ya, yb)
        ya, yb = step(sa[3], sb[3], ssh, la1, lha, lb1, lhb, 3, xq, xb + 3 * XB, hh, ya, yb)
        return f16_bits_to_f32(U(sa[4])) * ya, f16_bits_to_f32(U(sb[4])) * yb

    return load_q6_k, dot


# qk, bytes per block, units (lanes) per block, units a lane runs per loop step (loads in
# flight), unit factory (inline_sums -> (load, dot): a unit's weight loads, and its dot
# products from what they returned), whether units need the sums of x per sub-block
# (from shared memory, or summed inline by each unit).
FastSpec = namedtuple("FastSpec", "qk bs tpb unroll make_unit sums")
FAST_SPECS = {
    T.Q4_K: FastSpec(256, 144, 4, 2, _make_unit_q4_k, True),
    T.Q6_K: FastSpec(256, 210, 4, 1, lambda inline_sums: (load_q6_k, dot_q6_k), False),
    T.Q8_0: FastSpec(32, 34, 2, 2, lambda inline_sums: (load_q8_0, dot_q8_0), False),
}
# Q4_K's sums of x per sub-block: summed by each unit from the x it loads anyway (~0.5
# add per weight and row) rather than by every thread block into shared memory first
# (a prologue that reads all of x per block and puts a barrier before the first weight
# load). Both stay selectable for the benchmark.
INLINE_SUMS = True
# Thread blocks per SM when the grid is capped (each block then loops over row blocks):
# None launches one block per row block.
BLOCKS_PER_SM = None
# Row pairs a warp works on at once (see the module docstring): 8 for the K-quants; Q8_0
# keeps one (its x is read 16 bytes per 4 weights already; more groups measured slower).
GROUPS = {T.Q4_K: 8, T.Q6_K: 8, T.Q8_0: 1}
# Q4_K takes 16 row pairs a warp where that grid still fills the GPU (H200, 25600 rows:
# +30% over 8).
WIDE_GROUPS = {T.Q4_K: 16}
# Grid shape by the warps it puts on the GPU: measured best near one full wave of
# resident warps (~24 a SM at these kernels' 66-80 registers). Below it a block gets 8
# warps (each covering 1/8 of a row's units), and with still fewer rows, fewer groups.
WAVE_WARPS_PER_SM = 24
# Activation rows one launch takes (short verification forwards): every weight load serves
# all of them, and each lane keeps two sums per row.
MAX_X_ROWS = 8
# Shared memory for the sums of x over each 16 columns: rows up to 16 * SX_MAX columns (8 KiB a block).
SX_MAX = 2048
FAST_TYPES = frozenset(FAST_SPECS)
# unroll=PIPE: one unit a step, the next step's loads issued before this step's arithmetic
# (H200: no faster than the default; kept for `python -m luce.kernels.matvec_fast --unroll`)
PIPE = "pipe"
# Types with units over int8 x (quantize_x): their unit factories ((inline_sums, planes) ->
# (load, dot))
X8_UNITS = {T.Q4_K: _make_unit_q4_k_x8, T.Q6_K: _make_unit_q6_k_x8}
X8_TYPES = frozenset(X8_UNITS)
# Units a lane loads before computing in the products over int8 x (LUCE_X8_UNROLL: 1, 2 or
# pipe; default each type's FAST_SPECS entry, chosen over float x). Over two planes the
# decode q/k/v launch takes 107 registers at Q4_K's 2 and 88 at 1 (ptxas sm_90): not timed.
_X8_UNROLLS = {"": None, "1": 1, "2": 2, PIPE: PIPE}
if os.environ.get("LUCE_X8_UNROLL", "") not in _X8_UNROLLS:
    raise ValueError(f"LUCE_X8_UNROLL={os.environ['LUCE_X8_UNROLL']}: 1, 2 or {PIPE}")
X8_UNROLL = _X8_UNROLLS[os.environ.get("LUCE_X8_UNROLL", "")]
# Measured and removed (H200, docs/benchmarks.md, thirty-first session): next-step L1
# prefetches in the loop (LUCE_MV_PREFETCH: decode 342 -> 305 tok/s for every type, 342
# -> 330 for Q6_K alone) and launch bounds at the block's threads (LUCE_MV_BOUNDS=threads:
# fewer registers, 342 -> 314 tok/s).



def _make_rows(qtype, inline_sums, unroll=None, nx: int = 1, x8: int = 0, g8: bool = False):
    """g8: Q6_K rows in q6k_groups' layout (over int8 x): a unit's block handle is 8 x its
    group's start + its place in the group instead of the block's start."""
    spec = FAST_SPECS[qtype]
    TPB, QK, BH = spec.tpb, spec.qk, spec.bs // 2
    UN = unroll or spec.unroll
    NX = nx
    load, dot = X8_UNITS[qtype](inline_sums, x8) if x8 else spec.make_unit(inline_sums)
    G8 = g8
    assert not g8 or (qtype == T.Q6_K and x8)
    if G8:
        load = load_q6_k_g8
    GH = 8 * BH  # uint16 of a group of 8 blocks
    SH = TPB.bit_length() - 1
    assert TPB == 1 << SH and UN in (1, 2, PIPE)  # 4 was slower for all three types (H200)

    @_dev
    def where(n_units, u):
        # Units past the row's end are clamped to its last unit, so every load stays in
        # bounds and can issue before any branch; the caller drops their sums.
        u = min(u, n_units - 1)
        return u >> SH, u & (TPB - 1)  # u >= 0: a shift, not numba's floor division

    # A step's loads are written before its arithmetic, but ptxas (sm_90) sinks each unit's
    # loads to just before its use. Forcing them all up front (23c5ef6: the accumulators
    # seeded from a hash of every load) took Q4_K from 75 to 123 registers and changed
    # nothing measurable on the H200 (docs/benchmarks.md), so the compiler's order stays.
    @_dev
    def load_at(w, ha, hb, n_units, u):
        b, t = where(n_units, u)
        if G8:
            return load(w, ((ha + (b >> 3) * GH) << 3) + (b & 7), ((hb + (b >> 3) * GH) << 3) + (b & 7), t), b, t
        return load(w, ha + b * BH, hb + b * BH, t), b, t

    @_dev
    def dot_at(raw, w, ha, hb, x, sxs, b, t, xoff):
        # xoff: the x row's offset; the units read x at their columns + xoff and nothing
        # else by column (Q4_K's shared sums excepted: one x row only)
        return dot(raw, w, ha + b * BH, hb + b * BH, x, sxs, b * QK + xoff, t)

    if UN == 1:
        @_dev
        def rows_dot(w, ha, hb, x, sxs, n_units, first, step, xs, acc):
            """acc[2r], acc[2r + 1] += the sums of rows a and b (uint16 starts ha, hb) with x
            row r (x rows xs apart) over units first, first + step, ..."""
            for u in range(first, n_units, step):
                r0, b0, t0 = load_at(w, ha, hb, n_units, u)
                for r in range(NX):  # each weight load serves every x row
                    pa, pb = dot_at(r0, w, ha, hb, x, sxs, b0, t0, r * xs)
                    acc[2 * r] += pa
                    acc[2 * r + 1] += pb
    elif UN == PIPE:
        @_dev
        def rows_dot(w, ha, hb, x, sxs, n_units, first, step, xs, acc):
            """As above, with the next unit's loads issued before this unit's arithmetic and
            carried into the next trip: a lane's loads are in flight while it computes (a
            load and its first use in one trip are scheduled close together)."""
            r0, b0, t0 = load_at(w, ha, hb, n_units, first)
            for u in range(first, n_units, step):
                r1, b1, t1 = load_at(w, ha, hb, n_units, u + step)  # past the end: clamped, unused
                for r in range(NX):
                    pa, pb = dot_at(r0, w, ha, hb, x, sxs, b0, t0, r * xs)
                    acc[2 * r] += pa
                    acc[2 * r + 1] += pb
                r0, b0, t0 = r1, b1, t1
    else:
        @_dev
        def rows_dot(w, ha, hb, x, sxs, n_units, first, step, xs, acc):
            """As above, two units (u and u + step) a loop step."""
            for u in range(first, n_units, 2 * step):
                r0, b0, t0 = load_at(w, ha, hb, n_units, u)
                r1, b1, t1 = load_at(w, ha, hb, n_units, u + step)
                more = u + step < n_units
                for r in range(NX):
                    pa, pb = dot_at(r0, w, ha, hb, x, sxs, b0, t0, r * xs)
                    qa, qb = dot_at(r1, w, ha, hb, x, sxs, b1, t1, r * xs)
                    acc[2 * r] += pa
                    acc[2 * r + 1] += pb
                    if more:
                        acc[2 * r] += qa
                        acc[2 * r + 1] += qb
    return rows_dot


def _make_group_sum(lanes):
    """The sum over each aligned group of `lanes` lanes, in every lane of the group (warp
    shuffles). The simulator has no shuffles: there the value comes back unchanged and the
    kernel's reader adds up the group's partials from shared memory instead."""
    if SIM or lanes == 1:
        return _dev(lambda v: v)

    @cuda.jit(device=True)
    def group_sum(v):
        off = lanes >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off >>= 1
        return v
    return group_sum


def _make_parts_total():
    """The sum of parts[0:n] in every lane of a warp, the same bits in each (an xor
    butterfly adds the same two values in every lane, in either order). The simulator has
    no shuffles (its warp sum returns the value as it is): there every thread adds them all."""
    warp_sum = _make_group_sum(32)
    STEP = 1 if SIM else 32

    @_dev
    def parts_total(parts, n, lane):
        s = np.float32(0.0)
        for i in range(0 if SIM else lane, n, STEP):
            s += parts[i]
        return warp_sum(s)
    return parts_total


def _make_kernel(qtype, glu: int, has_bias: bool, has_res: bool, nw: int = NW, inline_sums: bool = True,
                 unroll=None, groups: int = 1, nx: int = 1, x8: int = 0, pair: bool = False,
                 x_norm: bool = False, norm_out: bool = False, third=None, xq_out: int = 0, g8: bool = False):
    """g8: the weights (not a third's) in q6k_groups' layout. glu: 0, or the gated form act(w x) * (w_up x) with act silu (1) or gelu_tanh (2).
    pair: two weights of the same x in one launch (a model's q and k projections): the row
    blocks of w_up (n_rows_b rows, into out_b with bias_b) follow those of w; not with glu or
    a residual. third (with pair): the qtype of a third weight w_c (the v projection, which
    a Q4_K_M model keeps in Q6_K) of the same block width (so the same units a row), whose
    row blocks (n_rows_c rows of row_h_c uint16, into out_c with bias_c) follow w_up's: its
    lanes run that type's units. A 1024-row product
    alone is mostly launch latency (H200: Q6_K 1024x4096 4.9 us, for 3.4 MB).

    The RMSNorm between a residual product and the projections of its output, split between
    the two launches so it costs no launch of its own (one x row): norm_out (with a residual)
    also stores xg = y * gn and each row block's sum of y^2 in parts[block]; x_norm (its
    consumers, x = xg) sums the n_parts parts (every warp, from L2, while its weights load)
    and scales each product by 1 / sqrt(sum / K + eps) before the activation and bias.
    xq_out: the output (with norm_out, xg) is also stored in quantize_x's form with that
    many planes (xo_b / xo_f: its bytes and floats), for consumers over int8 x: a row
    block's 16 or 32 rows are whole halves of its 32-column blocks (groups >= 8), each
    quantized by 16 lanes of warp 0; quantization is per 16 columns, so the norm's scale (a
    factor of the whole row) can stay with the consumers."""
    rows_dot = _make_rows(qtype, inline_sums, unroll, nx, x8, g8)
    TRIO = third is not None
    rows_dot_c = _make_rows(third, inline_sums, unroll, nx, x8) if TRIO else rows_dot
    SUMS = FAST_SPECS[qtype].sums and not inline_sums and not x8
    SXN = SX_MAX if SUMS else 1
    NT = 32 * nw
    G = groups                 # row pairs a warp works on at once
    L = 32 // G                # lanes per row pair
    GSH = L.bit_length() - 1
    RPB = ROWS * G             # rows a thread block makes; every warp covers 1/nw of their units
    NX = nx                    # activation rows: each weight load serves all of them
    NA = ROWS * NX             # a lane's sums: row a and b for each x row
    NV = 2 if glu else 1       # sums per row and lane (gate, up)
    GELU = glu == GLU_CODES["gelu_tanh"]
    LS = L if SIM else 1       # partials per row pair and warp that reach shared memory
    RED = NT * NA * NV
    group_sum = _make_group_sum(L)
    parts_total = _make_parts_total()
    PAIR = pair
    XN, NO = x_norm, norm_out
    NSQ = RPB if NO and SIM else 1  # the simulator's stand-in for the shuffle sum
    QO = xq_out
    QRED = NT if QO and SIM else 1  # the simulator's group reductions go through shared memory
    QBB = block_bytes(QO) if QO else 0
    RMASK = (1 << RPB) - 1 if RPB < 32 else 0xFFFFFFFF  # norm_out: the lanes holding a row block's rows
    PF = pdl.PREFETCH
    assert G * L == 32 and not (SUMS and NX > 1) and not (pair and (glu or has_res))
    assert not (TRIO and (not pair or SUMS or (FAST_SPECS[third].sums and not inline_sums and not x8)))
    assert not ((XN or NO) and NX > 1) and not (NO and (glu or pair or not has_res or RPB > 32))
    assert not QO or (RPB % 16 == 0 and NX == 1 and not pair)

    @cuda.jit
    def kernel(w, w_up, x, out, bias, res, n_rows, row_h, n_units, xs, out_b, bias_b, n_rows_b,
               gn, xg, parts, n_parts, eps, w_c, out_c, bias_c, n_rows_c, row_h_c, xo_b, xo_f):
        # LUCE_PDL=2: this block's first row block toward L2 (rows whole 16-byte pieces)
        if PF and cuda.threadIdx.x == 0 and (row_h & 7) == 0 and (not TRIO or (row_h_c & 7) == 0):
            r0 = cuda.blockIdx.x
            nba = -(-n_rows // RPB)
            nbb = nba + (-(-n_rows_b // RPB) if PAIR else 0)
            if TRIO and r0 >= nbb:
                lb = (r0 - nbb) * RPB
                l2_prefetch(w_c, lb * row_h_c, min(RPB, n_rows_c - lb) * row_h_c * 2)
            elif PAIR and r0 >= nba:
                lb = (r0 - nba) * RPB
                l2_prefetch(w_up, lb * row_h, min(RPB, n_rows_b - lb) * row_h * 2)
            elif r0 < nba:
                lb = r0 * RPB
                l2_prefetch(w, lb * row_h, min(RPB, n_rows - lb) * row_h * 2)
                if glu:
                    l2_prefetch(w_up, lb * row_h, min(RPB, n_rows - lb) * row_h * 2)
        grid_dependency_sync()  # luce.kernels.pdl: nothing unless LUCE_PDL
        red = cuda.shared.array(RED, np.float32)
        qred = cuda.shared.array(QRED, np.float32)
        sxs = cuda.shared.array(SXN, np.float32)
        nsq = cuda.shared.array(NSQ, np.float32)  # norm_out: the block's y^2, summed in order
        acc = cuda.local.array(NA, np.float32)
        accu = cuda.local.array(NA, np.float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        g = lane >> GSH
        first = (lane & (L - 1)) + L * wid
        rs = np.float32(1.0)
        if XN:
            rs = np.float32(1.0) / math.sqrt(parts_total(parts, n_parts, lane) / np.float32(xs) + eps)
        if SUMS:
            # Row-independent: summed once here rather than by every row's units (which
            # cost ~0.5 add per weight element and row).
            for gi in range(tid, x.size >> 4, NT):
                s = np.float32(0.0)
                for j in range(4):
                    x0, x1, x2, x3 = ldg_f32x4(x, 16 * gi + 4 * j)
                    s += (x0 + x1) + (x2 + x3)
                sxs[gi] = s
            cuda.syncthreads()
        # A capped grid loops over row blocks (the sums above are then made once per
        # block, not once per row block); all warps of a block run the same iterations.
        nba = -(-n_rows // RPB)
        nbb = nba + (-(-n_rows_b // RPB) if PAIR else 0)
        nblk = nbb + (-(-n_rows_c // RPB) if TRIO else 0)
        for rblk in range(cuda.blockIdx.x, nblk, cuda.gridDim.x):
            second = PAIR and rblk >= nba  # a row block of the pair's second weight (or the third's)
            thrd = TRIO and rblk >= nbb  # a row block of the third weight
            wr = w_up if second else w
            nr = n_rows_c if thrd else (n_rows_b if second else n_rows)
            lblk = rblk - nbb if thrd else (rblk - nba if second else rblk)
            row0 = lblk * RPB + ROWS * g
            # Rows past the end repeat the last row and are not stored: every warp runs the
            # same loop, as the block-wide barriers need.
            ra = min(row0, nr - 1)
            rb = min(row0 + 1, nr - 1)
            for e in range(NA):
                acc[e] = np.float32(0.0)
                if glu:
                    accu[e] = np.float32(0.0)
            if thrd:
                rows_dot_c(w_c, ra * row_h_c, rb * row_h_c, x, sxs, n_units, first, L * nw, xs, acc)
            else:
                rows_dot(wr, ra * row_h, rb * row_h, x, sxs, n_units, first, L * nw, xs, acc)
            if glu:
                rows_dot(w_up, ra * row_h, rb * row_h, x, sxs, n_units, first, L * nw, xs, accu)
            # red[thread, x row, row of the pair, gate/up]
            for e in range(NA):
                red[(tid * NA + e) * NV] = group_sum(acc[e])
                if glu:
                    red[(tid * NA + e) * NV + 1] = group_sum(accu[e])
            cuda.syncthreads()
            sq = np.float32(0.0)  # norm_out: this thread's row's y^2 (rows of a block: warp 0's lanes)
            xgv = np.float32(0.0)  # and its xg
            for o in range(tid, RPB * NX, NT):  # (x row, row): coalesced stores
                r = o // RPB if NX > 1 else 0
                rr = o - r * RPB
                row = lblk * RPB + rr
                e = r * ROWS + (rr & 1)  # ROWS == 2
                gi = rr >> 1
                y = np.float32(0.0)
                u = np.float32(0.0)
                for ww in range(nw):
                    for j in range(LS):
                        k = ((ww * 32 + gi * L + j) * NA + e) * NV
                        y += red[k]
                        if glu:
                            u += red[k + 1]
                if row < nr:
                    if XN:
                        y *= rs
                        u *= rs
                    if glu:
                        y = (gelu_tanh(y) if GELU else _mv.silu(y)) * u
                    if has_bias:
                        y += bias_c[row] if thrd else (bias_b[row] if second else bias[row])
                    if has_res:
                        y += res[r * n_rows + row]
                    if NO:
                        xgv = y * gn[row]
                        xg[row] = xgv
                        sq = y * y
                    elif QO:
                        xgv = y
                    if thrd:
                        out_c[r * nr + row] = y
                    elif second:
                        out_b[r * nr + row] = y
                    else:
                        out[r * nr + row] = y
                if NO:
                    # the row block's y^2 summed by its RPB lanes (warp 0's first: one row each)
                    # where they stored it. Any later code writing the sum (a thread-0 loop over
                    # shared memory, or shuffles after the loop) took the kernel from 80 to 102
                    # registers (Q6_K, sm_90, ptxas 13); this form has 75.
                    if SIM:
                        nsq[rr] = sq
                    else:
                        off = RPB >> 1
                        while off > 0:
                            sq += cuda.shfl_xor_sync(RMASK, sq, off)
                            off >>= 1
                        if o == 0:
                            parts[lblk] = sq
            if QO:  # every thread calls it (its reductions); warp 0's first RPB lanes hold the rows
                qrow = lblk * RPB + tid
                int8_half_store(xgv, tid < RPB and qrow < nr, QBB * (qrow >> 5), qrow & 31, lane, wid, qred, xo_b,
                                xo_f, QO)
            cuda.syncthreads()
            if NO and SIM and tid == 0:  # read before the next row block's epilogue: a barrier away
                ss = np.float32(0.0)
                for i in range(RPB):
                    ss += nsq[i]
                parts[lblk] = ss
    return pdl_ready(kernel)


_KERNELS: dict = {}


def _kernel(*key):
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(*key)
    return _KERNELS[key]


def _addr(a) -> int:
    return 0 if SIM else a.__cuda_array_interface__["data"][0]


@functools.lru_cache(maxsize=1)
def _sm_count() -> int:
    return 2 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT


def grid_shape(qtype, n_rows: int) -> tuple[int, int]:
    """(row pairs a warp works on, warps a block) for a matrix of n_rows rows."""
    if SIM:  # every simulated thread is an OS thread: few blocks of one warp (tests pick others)
        return 8, 1
    wave = WAVE_WARPS_PER_SM * _sm_count()

    def warps_for(g, nw):
        return -(-n_rows // (ROWS * g)) * nw
    wide = WIDE_GROUPS.get(qtype)
    if wide and warps_for(wide, NW) >= wave:
        return wide, NW
    g = GROUPS[qtype]
    if warps_for(g, NW) >= wave * 0.6:
        return g, NW
    while g > 1 and warps_for(g, 8) < wave // 2:
        g //= 2
    return g, 8


GLU_CODES = {"silu": 1, "gelu_tanh": 2}  # _make_kernel's glu for a gated launch's activation


def _launch(w_list, qtype, x_dev, out, bias, residual, stream, warps=None, inline_sums=None, blocks_per_sm=0,
            unroll=None, groups=None, xq=None, pair=None, x_norm=None, norm_out=None, third=None, xq_out=None,
            act="silu", layout=None):
    """pair: (w_b, out_b, bias_b), a second weight of the same type and columns whose
    product with x goes to out_b in the same launch (w_list then holds one weight).
    third (with pair): (w_c, qtype_c, out_c, bias_c), a third weight of the same columns,
    of any fast type with qtype's block width (Q4_K, Q6_K), biased like the pair.
    x_norm: (parts, n_parts, eps) of the norm_out launch that made x; norm_out: (gn, xg,
    parts) (see _make_kernel). xq_out: where the output's (with norm_out, xg's) quantize_x
    form goes (one x row). act: the activation of a gated launch (w_list of two: gate, up),
    silu or gelu_tanh. layout "g8": Q6_K weights in luce.kernels.q6k_groups' layout, over
    int8 x, one weight (no pair, third or gated form). Returns out, or with norm_out the
    number of parts."""
    qtype = as_qtype(qtype)
    if qtype not in FAST_TYPES:
        raise NotImplementedError(f"matvec_fast: {qtype.name} is not supported (Q4_K, Q6_K, Q8_0)")
    spec = FAST_SPECS[qtype]
    x_dev = as_device(x_dev)
    xshape = tuple(x_dev.shape)
    if len(xshape) not in (1, 2) or (len(xshape) == 2 and not 1 <= xshape[0] <= MAX_X_ROWS):
        raise ValueError(f"matvec_fast: x must be (K,) or (n, K) with n <= {MAX_X_ROWS}, got {xshape}")
    nx = 1 if len(xshape) == 1 else xshape[0]
    n_cols = xshape[-1]
    if n_cols % spec.qk:
        raise ValueError(f"{qtype.name}: {n_cols} columns is not a multiple of {spec.qk}")
    inline = INLINE_SUMS if inline_sums is None else bool(inline_sums)
    if spec.sums and not inline and (n_cols > 16 * SX_MAX or nx > 1):
        raise ValueError(f"matvec_fast: {qtype.name} with shared x sums: one x row of at most "
                         f"{16 * SX_MAX} columns")
    ws = [weight_u16(w, qtype, n_cols) for w in w_list]
    n_rows = ws[0][1]
    if any(r != n_rows for _, r in ws):
        raise ValueError("gate and up weights differ in rows")
    x = _mv._flat_f32(x_dev, "x")
    x8 = 0  # float x, or the int8 planes of quantize_x(x) the units read (1 or 2)
    if xq is not None and qtype in X8_TYPES:
        from .quantize_x import xq_size
        xq = as_device(xq)
        x8 = next((p for p in (1, 2) if xq.size == xq_size(n_cols, nx, p)), -1)
    if (x_norm is not None or norm_out is not None) and (nx != 1 or len(xshape) != 1 and xshape[0] != 1):
        raise ValueError("matvec_fast: the split RMSNorm takes one float x row")
    if x8:  # the units read the int8 form of x instead
        if xq.dtype != np.uint16 or x8 < 0:
            raise ValueError(f"matvec_fast: xq must be quantize_x(x) in 1 or 2 planes: {xq_size(n_cols, nx)} or "
                             f"{xq_size(n_cols, nx, 2)} uint16, got {xq.size} {xq.dtype}")
        x = xq.reshape(xq.size) if len(xq.shape) != 1 else xq
    rb = row_bytes(qtype, n_cols)
    wb, n_rows_b = weight_u16(pair[0], qtype, n_cols) if pair else (None, 0)
    if pair and (residual is not None or (bias is None) != (pair[2] is None)):
        raise ValueError("matvec_fast pair: both weights with a bias or neither, and no residual")
    wc, n_rows_c, qc = None, 0, None
    if third is not None:
        qc = as_qtype(third[1])
        sc = FAST_SPECS.get(qc)
        if not pair or sc is None or (sc.qk, sc.tpb) != (spec.qk, spec.tpb) or (bias is None) != (third[3] is None) \
                or (x8 and qc not in X8_TYPES):
            raise ValueError(f"matvec_fast: a third weight needs a pair, a fast type of {qtype.name}'s block width "
                             f"(got {qc.name}), a bias like the pair's, and int8-x units where x8 is used")
        wc, n_rows_c = weight_u16(third[0], qc, n_cols)
    if not splits_norm(*[w for w, _ in ws], *([wb] if pair else []), *([wc] if third else [])) \
            or _addr(x) % 16:  # not whole: matvec's
        if x_norm is not None or norm_out is not None or xq_out is not None:
            raise ValueError("matvec_fast: the split RMSNorm and xq_out need 16-byte aligned weights and x")
        if len(w_list) == 2 and act == "silu":
            return _mv.swiglu(w_list[0], w_list[1], qtype, x_dev, out=out, stream=stream)
        if len(w_list) == 2:  # the other activations: both products, then the activation pass
            from .activation import glu_cuda
            g = _mv.matvec(w_list[0], qtype, x_dev, out=out, stream=stream)
            u = _mv.matvec(w_list[1], qtype, x_dev, stream=stream)
            return glu_cuda(g, u, "geglu", out=g, stream=stream)
        if pair:
            _mv.matvec(pair[0], qtype, x_dev, out=pair[1], bias=pair[2], stream=stream)
        if third is not None:
            _mv.matvec(third[0], qc, x_dev, out=third[2], bias=third[3], stream=stream)
        return _mv.matvec(w_list[0], qtype, x_dev, out=out, bias=bias, residual=residual, stream=stream)
    out_shape = (n_rows,) if len(xshape) == 1 else (nx, n_rows)
    if out is None:
        out = cuda.device_array(out_shape, np.float32, stream=stream)
    out_flat = _mv._flat_f32(out, "out", nx * n_rows)
    b = _mv._flat_f32(bias, "bias", n_rows) if bias is not None else _mv._dummy()
    r = _mv._flat_f32(residual, "residual", nx * n_rows) if residual is not None else _mv._dummy()
    out_b, bias_b = out_flat, b  # the pair's second output and bias (never read without one)
    if pair:
        out_b = _mv._flat_f32(pair[1], "out_b", nx * n_rows_b)
        if pair[2] is not None:
            bias_b = _mv._flat_f32(pair[2], "bias_b", n_rows_b)
    out_c, bias_c = out_flat, b
    if third is not None:
        out_c = _mv._flat_f32(third[2], "out_c", nx * n_rows_c)
        if third[3] is not None:
            bias_c = _mv._flat_f32(third[3], "bias_c", n_rows_c)
    g, nw = grid_shape(qtype, n_rows + n_rows_b + n_rows_c)
    g, nw = groups or g, warps or nw
    qo, xo = 0, None  # the output's int8 form: its planes and buffer
    if xq_out is not None:
        from .quantize_x import xq_size
        xo = as_device(xq_out)
        qo = next((p for p in (1, 2) if xo.size == xq_size(n_rows, 1, p)), 0)
        if not qo or xo.dtype != np.uint16 or nx != 1 or pair or n_rows % 32:
            raise ValueError(f"matvec_fast: xq_out must hold quantize_x of {n_rows} columns (a multiple of 32; "
                             f"uint16, 1 or 2 planes) of one x row, no pair; got {xo.size} {xo.dtype}")
        g = max(g, 8)  # whole half blocks a row block
    # several x rows: registers go to their sums
    un = unroll or (X8_UNROLL if x8 and X8_UNROLL else spec.unroll if nx == 1 else 1)
    g8 = layout == "g8"
    if layout not in (None, "g8") or g8 and (qtype != T.Q6_K or not x8 or len(ws) != 1 or pair or third is not None
                                              or n_cols % 2048):
        raise ValueError(f"matvec_fast: layout {layout!r}: None, or 'g8' for one Q6_K weight of a multiple of 2048 "
                         "columns over int8 x (xq)")
    kern = _kernel(qtype, GLU_CODES[act] if len(ws) == 2 else 0, bias is not None, residual is not None, nw, inline,
                   un, g, nx, x8, bool(pair), x_norm is not None, norm_out is not None, qc, qo, g8)
    grid = -(-n_rows // (ROWS * g)) + -(-n_rows_b // (ROWS * g)) + -(-n_rows_c // (ROWS * g))
    per_sm = BLOCKS_PER_SM if blocks_per_sm == 0 else blocks_per_sm
    if per_sm:
        grid = min(grid, per_sm * _sm_count())
    w0 = ws[0][0]
    w1 = ws[1][0] if len(ws) == 2 else (wb if pair else w0)
    gn, xg, parts, n_parts, eps = _mv._dummy(), _mv._dummy(), _mv._dummy(), 0, 0.0
    if x_norm is not None:
        parts, n_parts, eps = _mv._flat_f32(x_norm[0], "parts"), int(x_norm[1]), float(x_norm[2])
        if not 0 < n_parts <= parts.size:
            raise ValueError(f"matvec_fast: {n_parts} norm parts, the buffer holds {parts.size}")
    if norm_out is not None:
        n_parts = -(-n_rows // (ROWS * g))
        gn, xg = _mv._flat_f32(norm_out[0], "gn", n_rows), _mv._flat_f32(norm_out[1], "xg", n_rows)
        parts = _mv._flat_f32(norm_out[2], "parts")
        if parts.size < n_parts:
            raise ValueError(f"matvec_fast: the norm parts buffer needs {n_parts} floats, has {parts.size}")
    kern[grid, 32 * nw, stream](w0, w1, x, out_flat, b, r, n_rows, rb // 2, n_cols // spec.qk * spec.tpb, n_cols,
                                out_b, bias_b, n_rows_b, gn, xg, parts, n_parts, np.float32(eps),
                                wc if third is not None else w0, out_c, bias_c, n_rows_c,
                                row_bytes(qc, n_cols) // 2 if third is not None else 0,
                                xo.view(np.uint8) if qo else _mv._dummy().view(np.uint8),
                                xo.view(np.float32) if qo else _mv._dummy())
    return n_parts if norm_out is not None else out


def matvec_fast(w_dev, qtype, x_dev, out=None, bias=None, residual=None, stream=0, *, warps=None,
                inline_sums=None, blocks_per_sm=0, unroll=None, groups=None, xq=None, x_norm=None, layout=None):
    """out = W x (+ bias) (+ residual) for Q4_K / Q6_K / Q8_0 W, as luce.kernels.matvec.matvec
    with up to MAX_X_ROWS activation rows, each weight read once for all of them: x (K,)
    gives out (N,), x (n, K) gives (n, N); residual may be out itself. For tuning: warps
    per thread block (default from grid_shape), inline_sums (default INLINE_SUMS),
    blocks_per_sm (0: BLOCKS_PER_SM; None: uncapped grid), unroll (units a
    lane loads before computing: 1, 2 or PIPE; default the type's FAST_SPECS entry), groups (row
    pairs a warp works on at once: 1, 2, 4, 8, 16; default from GROUPS and the row count).
    xq: quantize_x(x) in one or two planes, for types in X8_TYPES: their units then multiply
    int8 x with dp4a (x rounded to 8 bits a value, or ~16 with two planes; see
    luce.kernels.quantize_x); other types ignore it.
    x_norm: (parts, n_parts, eps) when x is the xg of matvec_fast_norm: out is then W times
    the RMSNorm of its result (scaled before the bias). layout: "g8" for Q6_K weights in
    luce.kernels.q6k_groups' layout (with xq)."""
    return _launch([w_dev], qtype, x_dev, out, bias, residual, stream, warps, inline_sums, blocks_per_sm, unroll,
                   groups, xq, x_norm=x_norm, layout=layout)


def matvec_fast_norm(w_dev, qtype, x_dev, residual, norm_w, xg, parts, stream=0, *, warps=None, groups=None,
                     xq=None, xq_out=None, layout=None) -> int:
    """residual += W x (one x row), and half of the RMSNorm of the result that follows it in
    a transformer: xg = result * norm_w, and parts[i] = the sum of squares of the result over
    the launch's row block i. Returns the number of parts; the projections of the norm take
    xg as x with x_norm=(parts, n_parts, eps) and finish it, so the norm has no launch.
    xq: x's quantize_x form (as matvec_fast); xq_out: where xg's goes (uint16, xq_size of
    the rows, 1 or 2 planes), for projections over int8 x (with x_norm as well)."""
    return _launch([w_dev], qtype, x_dev, residual, None, residual, stream, warps, None, 0, None, groups, xq,
                   norm_out=(norm_w, xg, parts), xq_out=xq_out, layout=layout)


def splits_norm(*ws) -> bool:
    """Whether the fast path takes these weights (device arrays) whole: 16-byte aligned and a
    whole number of 16-byte pieces (the v4 loads need aligned bases, and ld16's second piece
    must not leave the buffer). Others go to luce.kernels.matvec, which has no x_norm: the
    split RMSNorm asks first."""
    return all(_addr(w) % 16 == 0 and (w.size * w.dtype.itemsize) % 16 == 0 for w in ws)


def norm_parts_max(n_rows: int) -> int:
    """The most parts matvec_fast_norm makes for n_rows rows (one a row pair, at one group)."""
    return -(-n_rows // ROWS)


def matvec_fast_pair(w_a, w_b, qtype, x_dev, out_a, out_b, bias_a=None, bias_b=None, stream=0, *, xq=None,
                     groups=None, warps=None, x_norm=None, third=None):
    """out_a = W_a x (+ bias_a) and out_b = W_b x (+ bias_b) in one launch (two projections of
    one x with weights of one type and width: a model's q and k), each as matvec_fast gives
    it; the grid sized for both. third: (w_c, qtype_c, out_c, bias_c), a third projection in
    the same launch (v: Q6_K where q and k are Q4_K), of a type of the same block width.
    Returns (out_a, out_b), or (out_a, out_b, out_c) with a third."""
    _launch([w_a], qtype, x_dev, out_a, bias_a, None, stream, warps, None, 0, None, groups, xq,
            pair=(w_b, out_b, bias_b), x_norm=x_norm, third=third)
    return (out_a, out_b) if third is None else (out_a, out_b, third[2])


def swiglu_fast(w_gate, w_up, qtype, x_dev, out=None, stream=0, *, warps=None, inline_sums=None,
                blocks_per_sm=0, unroll=None, groups=None, xq=None, x_norm=None, xq_out=None, act="silu"):
    """out = silu(Wg x) * (Wu x), as luce.kernels.matvec.swiglu (x rows, xq and x_norm as
    matvec_fast); act="gelu_tanh": GeGLU (Gemma), gelu_tanh(Wg x) * (Wu x). xq_out: where
    out's quantize_x form goes as well (one x row: the down projection's int8 x, made in
    the same launch)."""
    if act not in GLU_CODES:
        raise ValueError(f"swiglu_fast: unknown activation {act!r} (silu, gelu_tanh)")
    return _launch([w_gate, w_up], qtype, x_dev, out, None, None, stream, warps, inline_sums, blocks_per_sm,
                   unroll, groups, xq, x_norm=x_norm, xq_out=xq_out, act=act)


# ---------------------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------------------
BENCH_SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288), (25600, 5120), (5120, 25600))
BENCH_TYPES = ("Q4_K", "Q6_K", "Q8_0")
ROTATE_BYTES = 256 << 20  # 5x the H200's 50 MB L2: each launch reads its weights from HBM


def bench_matvec_fast(shapes=BENCH_SHAPES, qtypes=BENCH_TYPES, iters: int = 100, seed: int = 0,
                      rotate_bytes: int = ROTATE_BYTES, warps=None, baseline: bool = False,
                      variants=None) -> list[dict]:
    """Time matvec_fast for each (rows, cols), qtype and variant: cuda events around a
    replayed CUDA graph of `iters` launches, launch i reading weight copy i % n_copies,
    with enough copies (>= rotate_bytes together) that the L2 cannot hold the weights
    between launches. "GB/s" = weight bytes of one launch / time of one launch.
    variants: dicts of matvec_fast tuning arguments (warps, inline_sums, blocks_per_sm,
    groups, unroll), x_rows (activation rows, default 1) and gated (swiglu_fast of two
    copies: weight_bytes counts both);
    default one per entry of `warps`. baseline=True also times luce.kernels.matvec.matvec
    the same way (kernel "matvec")."""
    rng = np.random.default_rng(seed)
    stream = cuda.stream()
    if variants is None:
        variants = [{"warps": w_} for w_ in warps] if warps else [{}]  # {}: grid_shape's choice
    variants = list(variants)
    rows = []
    for n_rows, n_cols in shapes:
        xs = {k: cuda.to_device(rng.standard_normal((k, n_cols)).astype(np.float32))
              for k in {v.get("x_rows", 1) for v in variants} | {1}}
        xqs = {}
        outs = {k: cuda.device_array((k, n_rows), np.float32) for k in xs}
        for qtype in qtypes:
            qtype = as_qtype(qtype)
            rb = row_bytes(qtype, n_cols)
            nbytes = rb * n_rows
            host = rng.integers(0, 256, (n_rows, rb), dtype=np.uint8)
            copies = max(1, min(iters, math.ceil(rotate_bytes / nbytes))) if not SIM else 1
            ws = [cuda.to_device(host) for _ in range(copies)]
            ws += [cuda.to_device(host)] if any(v.get("gated") for v in variants) and copies == 1 else []
            todo = [("swiglu_fast" if v.get("gated") else "matvec_fast", v) for v in variants] + (
                [("matvec", {})] if baseline else [])
            for kernel, v in todo:
                k = v.get("x_rows", 1)
                tuning = {a: b for a, b in v.items() if a not in ("x_rows", "x8", "gated")}
                if v.get("x8"):  # x8=P: int8 x in P planes, made once outside the timing (bench_quantize_x times that)
                    from .quantize_x import quantize_x
                    if (k, v["x8"]) not in xqs:
                        xqs[k, v["x8"]] = quantize_x(xs[k], planes=int(v["x8"]))
                    tuning["xq"] = xqs[k, v["x8"]]
                rows.append(_time_one(kernel, tuning, ws, qtype, xs[k], outs[k], stream, iters) | {
                    "qtype": qtype.name, "rows": n_rows, "cols": n_cols,
                    "weight_bytes": nbytes * (2 if kernel == "swiglu_fast" else 1),
                    "copies": copies, "x_rows": k, "variant": ",".join(f"{a}={b}" for a, b in v.items()) or "auto"})
                rows[-1]["GB/s"] = round(rows[-1]["weight_bytes"] / (rows[-1]["time_us"] * 1e-6) / 1e9, 1)
            del ws
    return rows


def _time_one(kernel, variant, ws, qtype, x, out, stream, iters):
    copies = len(ws)
    state = {"i": 0}

    def launch():
        w = ws[state["i"] % copies]
        if kernel == "matvec":
            _mv.matvec(w, qtype, x, out=out, stream=stream)
        elif kernel == "swiglu_fast":  # gate and up: two different copies
            swiglu_fast(w, ws[(state["i"] + 1) % len(ws)], qtype, x, out=out, stream=stream, **variant)
        else:
            matvec_fast(w, qtype, x, out=out, stream=stream, **variant)
        state["i"] += 1
    us, timing, compile_s = _mv.time_launch(launch, stream, iters)
    label = ",".join(f"{k}={v}" for k, v in variant.items() if k != "xq") or "auto"
    g, nw = grid_shape(qtype, ws[0].shape[0]) if kernel != "matvec" else (None, None)
    return {"kernel": kernel, "variant": label, "warps": variant.get("warps", nw), "groups": variant.get("groups", g),
            "time_us": round(us, 2),
            "timing": timing, "compile_s": round(compile_s, 2)}


# the tuning variants of the 2026-11-30 H200 run (docs/benchmarks.md)
TUNING_VARIANTS = ({"inline_sums": False, "blocks_per_sm": None}, {"inline_sums": True, "blocks_per_sm": None},
                   {"inline_sums": True, "blocks_per_sm": 4}, {"inline_sums": True, "blocks_per_sm": 8},
                   {"inline_sums": True, "blocks_per_sm": 16}, {"warps": 8, "inline_sums": True, "blocks_per_sm": None})

if __name__ == "__main__":  # python -m luce.kernels.matvec_fast [--baseline|--variants|--unroll|--x-rows|--x8|--g8]
    import json
    import sys
    if "--x8" in sys.argv:  # int8 x with dp4a against float x, the types with x8 units
        rows = bench_matvec_fast(shapes=((12288, 4096), (4096, 4096), (1024, 4096), (4096, 12288), (25600, 5120)),
                                 qtypes=[q.name for q in X8_TYPES], iters=50,
                                 variants=[{}, {"x8": 1}, {"x8": 2}, {"gated": True}, {"gated": True, "x8": 1},
                                           {"gated": True, "x8": 2}, {"x8": 2, "x_rows": 8}, {"x_rows": 8}])
        from .quantize_x import bench_quantize_x
        rows += bench_quantize_x()
    elif "--g8" in sys.argv:  # Q6_K in luce.kernels.q6k_groups' layout against the GGUF one, over int8 x
        rows = bench_matvec_fast(shapes=((4096, 12288), (12288, 4096), (1024, 4096), (4096, 4096)), qtypes=("Q6_K",),
                                 iters=50, variants=[{"x8": 2}, {"x8": 2, "layout": "g8"}, {"x8": 1},
                                                     {"x8": 1, "layout": "g8"}])
    elif "--x-rows" in sys.argv:  # activation rows a launch (short verification forwards)
        rows = bench_matvec_fast(shapes=((12288, 4096), (4096, 12288), (4096, 4096)), qtypes=("Q4_K", "Q6_K"),
                                 iters=50, variants=[{"x_rows": k} for k in (1, 2, 4, 8)])
    elif "--unroll" in sys.argv:  # units in flight per lane (the default is each type's FAST_SPECS entry)
        rows = bench_matvec_fast(shapes=((12288, 4096), (4096, 12288), (4096, 4096), (1024, 4096)), iters=50,
                                 qtypes=("Q4_K", "Q6_K"),
                                 variants=[{"unroll": u, **g} for g in ({}, {"gated": True})
                                           for u in (1, 2, PIPE)])
    elif "--variants" in sys.argv:
        rows = bench_matvec_fast(shapes=((12288, 4096), (4096, 12288), (4096, 4096), (25600, 5120)), iters=50,
                                 variants=TUNING_VARIANTS)
    else:
        rows = bench_matvec_fast(warps=(4, 8), baseline="--baseline" in sys.argv)
    for r in rows:
        print(json.dumps(r), flush=True)
