"""Hopper bulk copies (the TMA engine's `cp.async.bulk`) from global to shared memory,
completed on a shared-memory mbarrier, as llvmlite inline PTX (sm_90+).

Why: the decode products are chains of weight-load latency (luce.kernels.matvec_fast,
matvec_mma: "more warps in flight hide more of it"); every byte a direct load has in flight
sits in a register until it lands, so registers cap the bytes in flight an SM. One thread
issuing a bulk copy moves kilobytes with no register held and no per-thread address
arithmetic, and the stage is announced done by the barrier's transaction count.
`luce.bench.kernels_read`'s "bulk" rows measure what that reads against plain 16-byte loads.

Use (one stage of a ring; a thread issues, the block consumes):
    mbar_init(bar, s, 1); bulk_init_fence()                  # once, then a block barrier
    mbar_expect_tx(bar, s, n); bulk_g2s(sh, word, src, i, n, bar, s)   # issuing thread
    while not mbar_try_wait(bar, s, phase): pass             # every consumer; phase flips
    ... read sh ...; cuda.syncthreads(); bulk_reuse_fence()  # before the stage is refilled
Sizes and both addresses are multiples of 16 bytes.

In the CUDA simulator the copy happens when issued and the barrier calls do nothing, so a
kernel's stage and index logic can be tested there.
"""
from __future__ import annotations

import numpy as np

from .device import device
from .vector_load import SIM

__all__ = ["bulk_g2s", "bulk_init_fence", "bulk_reuse_fence", "emit_l2_prefetch", "mbar_expect_tx",
           "mbar_init", "mbar_try_wait"]

if SIM:
    @device
    def mbar_init(bar, i, count):
        bar[i] = 0

    @device
    def mbar_expect_tx(bar, i, nbytes):
        pass

    @device
    def mbar_try_wait(bar, i, parity):
        return True

    @device
    def bulk_g2s(sh, idx, src, i, nbytes, bar, b):
        """sh[idx : idx + nbytes / 4] (uint32 words) = nbytes of src (a uint16 array) from
        element i."""
        for w in range(nbytes // 4):
            sh[idx + w] = np.uint32(int(src[i + 2 * w]) | (int(src[i + 2 * w + 1]) << 16))

    def bulk_init_fence():
        pass

    def bulk_reuse_fence():
        pass
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .mma import _asm, _barrier_asm, _generic_addr, _smem_addr

    _I32 = ir.IntType(32)

    def _u32(context, builder, v, t):
        return context.cast(builder, v, t, types.uint32)

    @intrinsic
    def mbar_init(typingctx, bar, i, count):
        """Initialise the mbarrier bar[i] (a uint64 shared array) for `count` arrivals."""
        sig = types.void(bar, i, count)

        def codegen(context, builder, sig, args):
            addr = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            _asm(builder, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", ir.VoidType(), [_I32, _I32],
                 [addr, _u32(context, builder, args[2], sig.args[2])], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def mbar_expect_tx(typingctx, bar, i, nbytes):
        """Arrive on bar[i] expecting nbytes more of transactions (the bulk copies that
        complete on it) before its phase completes."""
        sig = types.void(bar, i, nbytes)

        def codegen(context, builder, sig, args):
            addr = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            _asm(builder, "{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }", "r,r",
                 ir.VoidType(), [_I32, _I32], [addr, _u32(context, builder, args[2], sig.args[2])],
                 side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def mbar_try_wait(typingctx, bar, i, parity):
        """True once the phase of bar[i] with this parity has completed (the hardware may
        suspend the thread a while before saying False: call it in a loop)."""
        sig = types.boolean(bar, i, parity)

        def codegen(context, builder, sig, args):
            addr = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            r = _asm(builder, "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                     "selp.u32 $0, 1, 0, p; }", "=r,r,r", _I32, [_I32, _I32],
                     [addr, _u32(context, builder, args[2], sig.args[2])], side_effect=True)
            return builder.icmp_unsigned("!=", r, ir.Constant(_I32, 0))
        return sig, codegen

    @intrinsic
    def bulk_g2s(typingctx, sh, idx, src, i, nbytes, bar, b):
        """Copy nbytes from src[i] (a global array) to the shared uint32 array sh at word
        idx, completing as transactions on the mbarrier bar[b]."""
        sig = types.void(sh, idx, src, i, nbytes, bar, b)

        def codegen(context, builder, sig, args):
            dst = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            g = _generic_addr(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            mb = _smem_addr(context, builder, sig.args[5], args[5], sig.args[6], args[6])
            _asm(builder, "{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [ga], $2, [$3]; }",
                 "r,l,r,r", ir.VoidType(), [_I32, ir.IntType(64), _I32, _I32],
                 [dst, g, _u32(context, builder, args[4], sig.args[4]), mb], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    def emit_l2_prefetch(context, builder, sig, args):
        """The codegen of pdl.l2_prefetch (arr, i, nbytes): nbytes of global memory from
        arr[i] on their way to L2 in one bulk prefetch, nothing to wait for (both 16-byte
        multiples)."""
        addr = _generic_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        _asm(builder, "{ .reg .u64 ga; cvta.to.global.u64 ga, $0; cp.async.bulk.prefetch.L2.global [ga], $1; }",
             "l,r", ir.VoidType(), [ir.IntType(64), _I32], [addr, _u32(context, builder, args[2], sig.args[2])],
             side_effect=True)

    # after mbar_init, before a block barrier: the barriers visible to the copy engine
    bulk_init_fence = _barrier_asm("fence.mbarrier_init.release.cluster;")
    # before refilling a stage the block has read (after its barrier): the generic-proxy
    # reads ordered before the async-proxy writes
    bulk_reuse_fence = _barrier_asm("fence.proxy.async.shared::cta;")
