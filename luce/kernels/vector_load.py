"""Device load and bit-cast primitives, with plain-Python fallbacks for the CUDA simulator.

numba has no vector loads: a numba kernel only reaches the H200's memory ceiling when each
thread loads 16 bytes at a time (see shared/gpu/NOTES.md), so the GPU versions emit
`ld.global.nc.v4.u32` through llvmlite inline asm. The simulator runs kernels as Python and
has neither inline asm nor libdevice, so there the same names are small Python functions.

All loads take a 1-D array and an element index; the address must be aligned to the load
size (16 bytes for the x4 loads). `.nc` (read-only cache) is valid because kernels never
write the arrays they read this way; the `ldcg_*` loads (L2) are for arrays that other
blocks of the same kernel write (luce.kernels.persistent_decode).
"""
from __future__ import annotations

import os

import numpy as np
from numba import cuda

from .device import device

SIM = bool(cuda.config.ENABLE_CUDASIM)

__all__ = ["SIM", "ldg_u16_u32x4", "ldg_u16_u32x2", "ldg_u16_u32", "ldg_f32x4", "f16_bits_to_f32", "u32_bits_to_f32",
           "f32_to_u32_bits", "ldw_u16_u32x4", "ldw_u16_u32", "ldcg_u16_u32x4", "ldcg_f32", "ld_u16_u32x4", "WEIGHT_HINTS"]

# Cache hints for streamed weight loads (ldw_*: read once a forward), LUCE_WEIGHT_HINT picks
# one. H200, 5fab17b, `luce.bench.kernels_matvec_mma` (us, none / prefetch / no_allocate /
# both): matvec_mma gated Q4_K 2 x 12288x4096 at 1 row 27.7 / 26.2 / 27.5 / 26.2, at 23 rows
# 42.2 / 39.4 / 41.5 / 38.8; Q6_K 4096x12288 at 1 row 32.7 / 31.7 / 39.0 / 38.3 (its
# overlapping 4-byte loads then miss L1); matvec_fast's gated one row 28.9 / 27.2 / 28.0 /
# 27.3. The L2 256-byte prefetch by default.
WEIGHT_HINTS = {"none": "", "no_allocate": ".L1::no_allocate", "prefetch": ".L2::256B",
                "no_allocate_prefetch": ".L1::no_allocate.L2::256B"}
WEIGHT_HINT = os.environ.get("LUCE_WEIGHT_HINT", "prefetch")
if WEIGHT_HINT not in WEIGHT_HINTS:
    raise ValueError(f"LUCE_WEIGHT_HINT={WEIGHT_HINT!r}: one of {', '.join(WEIGHT_HINTS)}")

if SIM:
    @device
    def ldg_u16_u32x4(a, i):
        """Four little-endian uint32 words from a[i : i + 8] (uint16 array)."""
        return (np.uint32(a[i] | (np.uint32(a[i + 1]) << 16)),
                np.uint32(a[i + 2] | (np.uint32(a[i + 3]) << 16)),
                np.uint32(a[i + 4] | (np.uint32(a[i + 5]) << 16)),
                np.uint32(a[i + 6] | (np.uint32(a[i + 7]) << 16)))

    @device
    def ldg_u16_u32(a, i):
        """One uint32 word from a[i : i + 2] (uint16 array)."""
        return np.uint32(a[i] | (np.uint32(a[i + 1]) << 16))

    @device
    def ldg_u16_u32x2(a, i):
        """Two little-endian uint32 words from a[i : i + 4] (uint16 array)."""
        return (np.uint32(a[i] | (np.uint32(a[i + 1]) << 16)),
                np.uint32(a[i + 2] | (np.uint32(a[i + 3]) << 16)))

    ldw_u16_u32x4, ldw_u16_u32 = ldg_u16_u32x4, ldg_u16_u32  # hints mean nothing here
    ldcg_u16_u32x4 = ldg_u16_u32x4  # the simulator's memory is numpy's: no cache to be stale
    ld_u16_u32x4 = ldg_u16_u32x4

    @device
    def ldcg_f32(a, i):
        return a[i]

    @device
    def ldg_f32x4(a, i):
        return (np.float32(a[i]), np.float32(a[i + 1]), np.float32(a[i + 2]), np.float32(a[i + 3]))

    @device
    def f16_bits_to_f32(h):
        return np.float32(np.uint16(h).view(np.float16))

    @device
    def u32_bits_to_f32(u):
        return np.uint32(u).view(np.float32)

    @device
    def f32_to_u32_bits(f):
        return np.float32(f).view(np.uint32)

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def _address(context, builder, arrty, arr, idx):
        data = context.make_array(arrty)(context, builder, value=arr).data
        return builder.ptrtoint(builder.gep(data, [idx]), ir.IntType(64))

    def _resize(builder, v, width):
        if v.type.width > width:
            return builder.trunc(v, ir.IntType(width))
        if v.type.width < width:
            return builder.zext(v, ir.IntType(width))
        return v

    def _vector_load(context, builder, sig, args, ptx, reg, lltype, n, side_effect=False):
        arrty, _ = sig.args
        addr = _address(context, builder, arrty, args[0], args[1])
        outs = ",".join(["=" + reg] * n)
        asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([lltype] * n) if n > 1 else lltype,
                                           [ir.IntType(64)]), ptx, outs + ",l", side_effect=side_effect)
        val = builder.call(asm, [addr])
        if n == 1:
            return val
        out = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
        for k in range(n):
            out = builder.insert_value(out, builder.extract_value(val, k), k)
        return out

    def _ldg_u32(n: int, hint: str = "", op: str = "nc"):
        """op "cg": from L2, for data other blocks write during the kernel (the asm is then
        volatile, so that it stays on its side of the barriers that order those writes);
        op "generic": a generic address (shared memory's included), volatile likewise."""
        regs = ",".join(f"${k}" for k in range(n))
        space = "" if op == "generic" else f".global.{op}"
        ptx = f"ld{space}{hint}.v{n}.u32 {{{regs}}}, [${n}];" if n > 1 else f"ld{space}{hint}.u32 $0, [$1];"

        def ldg(typingctx, a, i):
            sig = (types.UniTuple(types.uint32, n) if n > 1 else types.uint32)(a, types.intp)

            def codegen(context, builder, sig, args):
                return _vector_load(context, builder, sig, args, ptx, "r", ir.IntType(32), n, side_effect=op != "nc")
            return sig, codegen
        return intrinsic(ldg)

    # n little-endian uint32 words from a[i : i + 2n] (uint16 array, aligned to 4n bytes)
    ldg_u16_u32x4 = _ldg_u32(4)
    ldg_u16_u32x2 = _ldg_u32(2)
    ldg_u16_u32 = _ldg_u32(1)
    ldw_u16_u32x4 = _ldg_u32(4, WEIGHT_HINTS[WEIGHT_HINT])
    ldw_u16_u32 = _ldg_u32(1, WEIGHT_HINTS[WEIGHT_HINT])
    ldcg_u16_u32x4 = _ldg_u32(4, op="cg")
    # from an array in shared memory (16-byte aligned), ordered among the block's barriers
    ld_u16_u32x4 = _ldg_u32(4, op="generic")

    @intrinsic
    def ldcg_f32(typingctx, a, i):
        """a[i] of a float32 array from L2, past this SM's L1 (written by other blocks since)."""
        sig = types.float32(a, types.intp)

        def codegen(context, builder, sig, args):
            return _vector_load(context, builder, sig, args, "ld.global.cg.f32 $0, [$1];", "f", ir.FloatType(), 1,
                                side_effect=True)
        return sig, codegen

    @intrinsic
    def ldg_f32x4(typingctx, a, i):
        """a[i : i + 4] of a float32 array in one 16-byte load (16-byte aligned)."""
        sig = types.UniTuple(types.float32, 4)(a, types.intp)

        def codegen(context, builder, sig, args):
            return _vector_load(context, builder, sig, args,
                                "ld.global.nc.v4.f32 {$0,$1,$2,$3}, [$4];", "f", ir.FloatType(), 4)
        return sig, codegen

    @intrinsic
    def f16_bits_to_f32(typingctx, h):
        """The IEEE half whose bits are the low 16 bits of h, as float32 (one cvt.f32.f16)."""
        sig = types.float32(h)

        def codegen(context, builder, sig, args):
            bits = _resize(builder, args[0], 16)
            return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())
        return sig, codegen

    @intrinsic
    def u32_bits_to_f32(typingctx, u):
        sig = types.float32(u)

        def codegen(context, builder, sig, args):
            return builder.bitcast(_resize(builder, args[0], 32), ir.FloatType())
        return sig, codegen

    @intrinsic
    def f32_to_u32_bits(typingctx, f):
        """The bits of a float32 as uint32 (no instruction: a register's reading)."""
        sig = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            v = args[0] if args[0].type == ir.FloatType() else builder.fptrunc(args[0], ir.FloatType())
            return builder.bitcast(v, ir.IntType(32))
        return sig, codegen
