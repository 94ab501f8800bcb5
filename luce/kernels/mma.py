"""Warp-level building blocks of the tensor-core kernels (matmul, attention).

32-bit bit operations that stay in 32-bit registers, f16x2 arithmetic, `mma.sync` m16n8k16
(f16 inputs, f32 accumulation), `ldmatrix` (plain and transposed) and a 16-byte shared
store, as llvmlite inline PTX on a GPU. In the CUDA simulator (no inline asm, no warp-level
instructions) the same names are Python stand-ins; the warp-collective ones are emulated
through a per-warp shared scratch array `scr` [warps, 32, SCRATCH] that kernels allocate
(a single word on a GPU, where it is never touched), so a tensor-core kernel's indexing can
be checked in the simulator too (slowly: tiny shapes only). Emulated collectives contain
block barriers: every thread of the block must reach them.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .device import device
from .vector_load import SIM

_dev = device  # plain Python in the simulator where it can be: see luce.kernels.device

# `alignment=` for shared arrays that ldmatrix, cp.async or 16-byte stores touch: numba
# declares shared arrays 4-byte aligned, and their placement is ptxas's choice (the
# simulator rejects the argument, and has no alignment to get wrong)
SHARED16 = None if SIM else 16

# ----------------------------------------------------------------------------------------
# 32-bit primitives. numba promotes uint32 arithmetic to 64 bits, which doubles the cost
# of the bit manipulation that dequantization is made of, so the hot operations are
# intrinsics that stay in 32-bit registers.
# ----------------------------------------------------------------------------------------
if SIM:
    _M32 = 0xFFFFFFFF

    def _h(bits):
        return np.float32(np.uint16(int(bits) & 0xFFFF).view(np.float16))

    def _hbits(v):
        return int(np.float16(v).view(np.uint16))

    @_dev
    def bits(x, s, m):
        """(x >> s) & m on 32 bits."""
        return np.uint32((int(x) >> int(s)) & int(m))

    @_dev
    def or32(a, b):
        return np.uint32((int(a) | int(b)) & _M32)

    @_dev
    def shl32(a, s):
        return np.uint32((int(a) << int(s)) & _M32)

    @_dev
    def and_or(a, m, o):
        """(a & m) | o in one LOP3 (two immediates do not fit one SASS logic op)."""
        return np.uint32(((int(a) & int(m)) | int(o)) & _M32)

    @_dev
    def pack16(lo, hi):
        return np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16))

    @_dev
    def prmt(a, b, sel):
        """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i+2:4i] of b:a."""
        src = (int(a) & _M32) | ((int(b) & _M32) << 32)
        r = 0
        for i in range(4):
            r |= ((src >> (8 * ((int(sel) >> (4 * i)) & 7))) & 0xFF) << (8 * i)
        return np.uint32(r)

    @_dev
    def f32x2_to_f16x2(lo, hi):
        return np.uint32(_hbits(lo) | (_hbits(hi) << 16))

    @_dev
    def hsub2(a, b):
        return np.uint32(_hbits(_h(a) - _h(b)) | (_hbits(_h(int(a) >> 16) - _h(int(b) >> 16)) << 16))

    @_dev
    def hfma2(a, b, c):
        lo = np.float32(_h(a) * _h(b)) + _h(c)
        hi = np.float32(_h(int(a) >> 16) * _h(int(b) >> 16)) + _h(int(c) >> 16)
        return np.uint32(_hbits(lo) | (_hbits(hi) << 16))

    # Warp-collective instructions, emulated: every lane publishes its operands in the
    # warp's scratch row, the block syncs (all warps run the same code, so every thread
    # reaches each barrier), each lane computes its share, and the block syncs again.
    SCRATCH = 8  # words per lane

    @_dev
    def mma_f16(scr, wid, lane, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        scr[wid, lane, 0] = a0
        scr[wid, lane, 1] = a1
        scr[wid, lane, 2] = a2
        scr[wid, lane, 3] = a3
        scr[wid, lane, 4] = b0
        scr[wid, lane, 5] = b1
        cuda.syncthreads()
        g = lane >> 2
        t = lane & 3
        d = [np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3)]
        # Fragment layout (PTX ISA, m16n8k16 .f16): lane 4r + c holds A[r, 2c:2c+2] in a0,
        # A[r+8, ...] in a1, A[r, 2c+8:2c+10] in a2, A[r+8, ...] in a3; B[2c:2c+2, r] in b0
        # and B[2c+8:2c+10, r] in b1; D[r, 2c:2c+2] in d0 d1 and D[r+8, ...] in d2 d3.
        for k in range(16):
            src = (k & 7) >> 1  # lane offset (c) of column k within a row's group of lanes
            half = 16 * (k & 1)
            areg = 2 * (k >> 3)
            a_lo = _h(int(scr[wid, 4 * g + src, areg]) >> half)       # A[g, k]
            a_hi = _h(int(scr[wid, 4 * g + src, areg + 1]) >> half)   # A[g + 8, k]
            for c in range(2):
                n = 2 * t + c
                b = _h(int(scr[wid, 4 * n + ((k & 7) >> 1), 4 + (k >> 3)]) >> half)  # B[k, n]
                d[c] = np.float32(d[c] + a_lo * b)
                d[2 + c] = np.float32(d[2 + c] + a_hi * b)
        cuda.syncthreads()
        return d[0], d[1], d[2], d[3]

    @_dev
    def sts4(sh, idx, a, b, c, d):
        sh[idx] = a
        sh[idx + 1] = b
        sh[idx + 2] = c
        sh[idx + 3] = d

    @_dev
    def ldsm_x4(sh, idx, scr, wid, lane):
        """ldmatrix.x4: lane l gives the word index of row l & 7 of matrix l >> 3 and gets
        word (l & 3) of row (l >> 2) of each of the four matrices."""
        scr[wid, lane, 6] = idx
        cuda.syncthreads()
        r = lane >> 2
        t = lane & 3
        v0 = sh[scr[wid, r, 6] + t]
        v1 = sh[scr[wid, 8 + r, 6] + t]
        v2 = sh[scr[wid, 16 + r, 6] + t]
        v3 = sh[scr[wid, 24 + r, 6] + t]
        cuda.syncthreads()
        return v0, v1, v2, v3

    def _half(sh, word, h):
        return (int(sh[word + (h >> 1)]) >> (16 * (h & 1))) & 0xFFFF

    @_dev
    def ldsm_x4_trans(sh, idx, scr, wid, lane):
        """ldmatrix.x4.trans: addresses as ldsm_x4; lane 4r + c gets, of each matrix, the
        halves (row 2c, column r) and (row 2c + 1, column r) as one word (row 2c low)."""
        scr[wid, lane, 6] = idx
        cuda.syncthreads()
        r = lane >> 2
        c = lane & 3
        v = [np.uint32(0)] * 4
        for m in range(4):
            lo = _half(sh, int(scr[wid, 8 * m + 2 * c, 6]), r)
            hi = _half(sh, int(scr[wid, 8 * m + 2 * c + 1, 6]), r)
            v[m] = np.uint32(lo | (hi << 16))
        cuda.syncthreads()
        return v[0], v[1], v[2], v[3]

    @_dev
    def _quad(v, scr, wid, lane, op):
        scr[wid, lane, 7] = np.float32(v).view(np.uint32)
        cuda.syncthreads()
        base = lane & ~3
        r = np.uint32(scr[wid, base, 7]).view(np.float32)
        for k in range(1, 4):
            r = op(r, np.uint32(scr[wid, base + k, 7]).view(np.float32))
        cuda.syncthreads()
        return np.float32(r)

    @_dev
    def quad_max(v, scr, wid, lane):
        """max over the four lanes 4r..4r+3 (the lanes holding one mma accumulator row)."""
        return _quad(v, scr, wid, lane, max)

    @_dev
    def cp_async16(sh, idx, src, i, nbytes):
        """sh[idx : idx + 4] (uint32 words) = the 16 bytes at src[i : i + 8] (uint16 array),
        or zeros when nbytes is 0 (cp.async's source size)."""
        for w in range(4):
            sh[idx + w] = np.uint32(int(src[i + 2 * w]) | (int(src[i + 2 * w + 1]) << 16)) if nbytes else 0

    @_dev
    def cp_async_wait():
        pass

    @_dev
    def cp_async_commit():
        pass

    @_dev
    def cp_async_wait_prior():
        pass

    # the simulator's copies are done when issued
    CP_ASYNC_WAIT_GROUP = tuple(cp_async_wait_prior for _ in range(8))

    @_dev
    def lds4(sh, idx):
        """sh[idx : idx + 4] (uint32 or float32) in one 16-byte shared load (idx % 4 == 0)."""
        return sh[idx], sh[idx + 1], sh[idx + 2], sh[idx + 3]

    @_dev
    def lds2(sh, idx):
        """sh[idx : idx + 2] (uint32 or float32) in one 8-byte shared load (idx % 2 == 0)."""
        return sh[idx], sh[idx + 1]

    @_dev
    def quad_sum(v, scr, wid, lane):
        return _quad(v, scr, wid, lane, lambda a, b: np.float32(a + b))

    @_dev
    def ex2(x):
        """2 ** x in float32 (0 at -inf)."""
        return np.float32(2.0 ** float(x))
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    def _asm(builder, ptx, cons, ret, argtys, args, side_effect=False):
        fn = ir.FunctionType(ret, argtys)
        return builder.call(ir.InlineAsm(fn, ptx, cons, side_effect=side_effect), args)

    def _u32_args(context, builder, sig, args):
        return [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]

    @intrinsic
    def bits(typingctx, x, s, m):
        """(x >> s) & m on 32 bits."""
        sig = types.uint32(x, s, m)

        def codegen(context, builder, sig, args):
            x, s, m = _u32_args(context, builder, sig, args)
            return builder.and_(builder.lshr(x, s), m)
        return sig, codegen

    @intrinsic
    def or32(typingctx, a, b):
        sig = types.uint32(a, b)

        def codegen(context, builder, sig, args):
            a, b = _u32_args(context, builder, sig, args)
            return builder.or_(a, b)
        return sig, codegen

    @intrinsic
    def shl32(typingctx, a, s):
        sig = types.uint32(a, s)

        def codegen(context, builder, sig, args):
            a, s = _u32_args(context, builder, sig, args)
            return builder.shl(a, s)
        return sig, codegen

    @intrinsic
    def pack16(typingctx, lo, hi):
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            lo, hi = _u32_args(context, builder, sig, args)
            m = ir.Constant(_I32, 0xFFFF)
            return builder.or_(builder.and_(lo, m), builder.shl(hi, ir.Constant(_I32, 16)))
        return sig, codegen

    def _op3(name, ptx):
        """An intrinsic that is one PTX instruction on three 32-bit operands."""
        def typer(typingctx, a, b, c):
            sig = types.uint32(a, b, c)

            def codegen(context, builder, sig, args):
                return _asm(builder, ptx, "=r,r,r,r", _I32, [_I32] * 3, _u32_args(context, builder, sig, args))
            return sig, codegen
        typer.__name__ = name
        return intrinsic(typer)

    prmt = _op3("prmt", "prmt.b32 $0, $1, $2, $3;")
    # (a & m) | o in one LOP3: LLVM's and + or with two constants becomes two (one immediate each)
    and_or = _op3("and_or", "lop3.b32 $0, $1, $2, $3, 0xEA;")
    hfma2 = _op3("hfma2", "fma.rn.f16x2 $0, $1, $2, $3;")

    @intrinsic
    def f32x2_to_f16x2(typingctx, lo, hi):
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            lo, hi = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args))
            # cvt.rn.f16x2.f32 d, a, b puts a in the upper half
            return _asm(builder, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", _I32, [_F32, _F32], [hi, lo])
        return sig, codegen

    @intrinsic
    def ex2(typingctx, x):
        """2 ** x by the SFU's ex2.approx (2 ulp; 0 at -inf, subnormal results flushed): an
        online softmax in base 2 spends one instruction a weight where expf spends ~10."""
        sig = types.float32(x)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            return _asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", _F32, [_F32], [v])
        return sig, codegen

    @intrinsic
    def hsub2(typingctx, a, b):
        sig = types.uint32(a, b)

        def codegen(context, builder, sig, args):
            return _asm(builder, "sub.rn.f16x2 $0, $1, $2;", "=r,r,r", _I32, [_I32] * 2,
                        _u32_args(context, builder, sig, args))
        return sig, codegen

    SCRATCH = 1

    @intrinsic
    def mma_f16(typingctx, scr, wid, lane, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A(16x16, row) B(16x8, col) + C; scr, wid, lane only serve the simulator."""
        f = types.float32
        sig = types.UniTuple(f, 4)(scr, wid, lane, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            ins = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[3:9], sig.args[3:9])]
            ins += [context.cast(builder, v, t, f) for v, t in zip(args[9:], sig.args[9:])]
            s = _asm(builder,
                     "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                     "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", ir.LiteralStructType([_F32] * 4),
                     [_I32] * 6 + [_F32] * 4, ins)
            out = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
            for k in range(4):
                out = builder.insert_value(out, builder.extract_value(s, k), k)
            return out
        return sig, codegen

    def _generic_addr(context, builder, arrty, arr, idxty, idx):
        """Generic (64-bit) address of arr[idx], without numba's negative-index wraparound:
        what global accesses take (shared ones: _smem_addr)."""
        data = context.make_array(arrty)(context, builder, value=arr).data
        i = context.cast(builder, idx, idxty, types.intp)
        return builder.ptrtoint(builder.gep(data, [i]), ir.IntType(64))

    def _smem_addr(context, builder, arrty, arr, idxty, idx):
        """32-bit shared-window address of arr[idx] (a shared array), what ld.shared,
        st.shared, ldmatrix and cp.async take in a register. Why not the generic address
        and a cvta in the asm: that made every access a 64-bit address computation (two
        instructions an add) and a conversion, ~20 of the decode attention kernel's ~46
        instructions a key in its value pass (sm_90 SASS). Here the cast of numba's shared
        array (itself a cast of the shared symbol) folds away and offsets stay 32-bit."""
        data = context.make_array(arrty)(context, builder, value=arr).data
        elt = data.type.pointee
        base = builder.ptrtoint(builder.addrspacecast(data, elt.as_pointer(3)), _I32)
        i = builder.trunc(context.cast(builder, idx, idxty, types.intp), _I32)
        return builder.add(base, builder.mul(i, ir.Constant(_I32, context.get_abi_sizeof(elt))))

    @intrinsic
    def sts4(typingctx, sh, idx, a, b, c, d):
        """sh[idx : idx + 4] = a, b, c, d in one 16-byte shared store (idx % 4 == 0)."""
        sig = types.void(sh, idx, a, b, c, d)

        def codegen(context, builder, sig, args):
            addr = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[2:], sig.args[2:])]
            _asm(builder, "st.shared.v4.u32 [$0], {$1,$2,$3,$4};",
                 "r,r,r,r,r", ir.VoidType(), [_I32] * 5, [addr] + vals, side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    def _lds(n: int):
        def lds(typingctx, sh, idx):
            # Volatile, like ldmatrix: the barriers around it order it against the copies
            # and stores that fill the array. No index wraparound: idx is non-negative.
            f32 = sh.dtype == types.float32
            sig = types.UniTuple(sh.dtype, n)(sh, idx)

            def codegen(context, builder, sig, args):
                addr = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                regs = ",".join(f"${k}" for k in range(n))
                s = _asm(builder, f"ld.shared.v{n}.{'f32' if f32 else 'u32'} {{{regs}}}, [${n}];",
                         ",".join(["=f" if f32 else "=r"] * n) + ",r", ir.LiteralStructType([_F32 if f32 else _I32] * n),
                         [_I32], [addr], side_effect=True)
                out = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
                for k in range(n):
                    out = builder.insert_value(out, builder.extract_value(s, k), k)
                return out
            return sig, codegen
        return intrinsic(lds)

    # sh[idx : idx + n] of a uint32 or float32 shared array in one 8- or 16-byte load
    # (idx % n == 0)
    lds2 = _lds(2)
    lds4 = _lds(4)

    def _ldsm(trans: bool):
        shape = "m8n8.x4.trans" if trans else "m8n8.x4"

        def ldsm(typingctx, sh, idx, scr, wid, lane):
            sig = types.UniTuple(types.uint32, 4)(sh, idx, scr, wid, lane)

            def codegen(context, builder, sig, args):
                addr = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                # Volatile: it reads shared memory that the barriers around it order; a pure
                # asm would be hoisted out of the K loop (its address does not change).
                s = _asm(builder, f"ldmatrix.sync.aligned.{shape}.shared.b16 {{$0,$1,$2,$3}}, [$4];",
                         "=r,=r,=r,=r,r", ir.LiteralStructType([_I32] * 4), [_I32], [addr], side_effect=True)
                out = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
                for k in range(4):
                    out = builder.insert_value(out, builder.extract_value(s, k), k)
                return out
            return sig, codegen
        return intrinsic(ldsm)

    # ldmatrix.sync.aligned.m8n8.x4 from the uint32 shared array sh: lane l gives the word
    # index of row l & 7 of matrix l >> 3 (16-byte aligned); .trans hands out columns
    ldsm_x4 = _ldsm(False)
    ldsm_x4_trans = _ldsm(True)

    @intrinsic
    def cp_async16(typingctx, sh, idx, src, i, nbytes):
        """cp.async.cg of 16 bytes from src[i : i + 8] (a global uint16 array) to the uint32
        shared array sh at word idx (both 16-byte aligned), without passing through
        registers; nbytes (0 or 16) is the source size: 0 fills zeros. Completes at
        cp_async_wait()."""
        sig = types.void(sh, idx, src, i, nbytes)

        def codegen(context, builder, sig, args):
            dst = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            srcp = _generic_addr(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            n = context.cast(builder, args[4], sig.args[4], types.uint32)
            _asm(builder, "{ .reg .u64 ga; cvta.to.global.u64 ga, $1; cp.async.cg.shared.global [$0], [ga], 16, $2; }",
                 "r,l,r", ir.VoidType(), [_I32, ir.IntType(64), _I32], [dst, srcp, n], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    def _barrier_asm(ptx: str):
        """An intrinsic of no arguments that emits `ptx`, ordered against memory accesses."""
        def fn(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                _asm(builder, ptx, "~{memory}", ir.VoidType(), [], [], side_effect=True)
                return context.get_dummy_value()
            return sig, codegen
        return intrinsic(fn)

    # wait for this thread's cp.async copies (a barrier must follow before others read)
    cp_async_wait = _barrier_asm("cp.async.wait_all;")
    # close this thread's cp.async copies issued so far into a group
    cp_async_commit = _barrier_asm("cp.async.commit_group;")
    # wait for every committed group but the latest (double buffering: the copies of the
    # buffer about to be read are done, those of the next one may still run)
    cp_async_wait_prior = _barrier_asm("cp.async.wait_group 1;")
    # CP_ASYNC_WAIT_GROUP[n]: wait until at most n of this thread's committed groups are
    # pending (a pipeline of n + 1 stages reads the oldest); n must be a constant in PTX
    CP_ASYNC_WAIT_GROUP = tuple(_barrier_asm(f"cp.async.wait_group {n};") for n in range(8))

    @cuda.jit(device=True, inline=True)
    def quad_max(v, scr, wid, lane):
        """max over the four lanes 4r..4r+3 (the lanes holding one mma accumulator row)."""
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        return max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))

    @cuda.jit(device=True, inline=True)
    def quad_sum(v, scr, wid, lane):
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        return v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
