"""How fast a numba kernel can stream a layer's weights: the read ceiling at the sizes a
decode step reads, against the device copy figure that the matvec targets are quoted on.

Why: the decode matvecs reach ~50% of copy bandwidth, and nothing said whether the rest is
the kernels' arithmetic, their loads in flight, or what any kernel of 3-60 MB can get
(ramp-up and the last wave's tail are a larger share of a 10 us kernel than of a copy of
1 GB). Two ways to keep bytes in flight are timed, each with the same XOR of every word:
`direct` (each thread `loads` independent 16-byte ld.global.nc a step, as the matvecs do)
and `async` (each thread keeps `stages - 1` steps of cp.async copies to shared memory in
flight, `loads` 16-byte pieces a step, which costs no registers), and `bulk` (a ring of
`stages` shared buffers of `loads` KB a block, each filled by one cp.async.bulk: the TMA
engine, luce.kernels.bulk_copy). Reads rotate through a buffer larger than the L2 (as a
model's layers do), all launches replayed from one graph.

    NUMBA_ENABLE_CUDASIM=0 python -m luce.bench.kernels_read [direct,async,bulk,empty]
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda  # a module global: the simulator swaps it inside kernels

from .kernels_attention import time_launch

# (what, bytes): the Qwen3-8B shape's decode reads (Q4_K 144 bytes / 256, Q6_K 210 / 256)
SIZES = (("v Q6_K 1024x4096", 1024 * 4096 * 210 // 256), ("q/o Q4_K 4096x4096", 4096 * 4096 * 144 // 256),
         ("down Q6_K 4096x12288", 4096 * 12288 * 210 // 256), ("gate+up Q4_K 2x12288x4096", 2 * 12288 * 4096 * 144 // 256),
         ("head Q6_K 151936x4096", 151936 * 4096 * 210 // 256))
THREADS = 256
DIRECT = tuple(("direct", 1, n, bps) for n in (1, 2, 4, 8) for bps in (2, 4, 8))
ASYNC = tuple(("async", s, n, bps) for s in (3, 4) for n in (1, 2) for bps in (2, 4))
# bulk copies (stages, KB a stage, blocks an SM): up to 32 KB of a block's ring in flight
BULK = tuple(("bulk", s, kb, bps) for s, kb in ((2, 16), (4, 8), (8, 4)) for bps in (1, 2, 4))
EMPTY = ("empty", 0, 0, 1)
ROTATE_BYTES = 1 << 30


@functools.lru_cache(maxsize=None)
def read_kernel(kind: str, stages: int, loads: int, threads: int = THREADS):
    """kernel(w, out, n16), launched with `threads` threads a block: the XOR of the 16-byte
    pieces of w (uint16) each thread reads into out[thread] (the last piece stands in for
    any past n16)."""
    from ..kernels.mma import CP_ASYNC_WAIT_GROUP, SHARED16, cp_async16, cp_async_commit, lds4
    from ..kernels.vector_load import ldw_u16_u32x4
    U = np.uint32
    L = loads
    S = stages

    if kind == "empty":
        @cuda.jit
        def empty(w, out, n16):
            if cuda.grid(1) == n16:  # never: keeps the arguments
                out[0] = U(w[0])
        return empty

    if kind == "direct":
        @cuda.jit
        def direct(w, out, n16):
            nt = cuda.gridDim.x * cuda.blockDim.x
            i = cuda.grid(1)
            acc = U(0)
            for base in range(i, n16, nt * L):
                for k in range(L):
                    a, b, c, d = ldw_u16_u32x4(w, 8 * min(base + k * nt, n16 - 1))
                    acc ^= a ^ b ^ c ^ d
            out[i] = acc
        return direct

    if kind == "bulk":
        return _bulk_kernel(stages, loads, threads)

    WAIT = CP_ASYNC_WAIT_GROUP[S - 1]
    NT = threads
    SH = S * L * NT * 4

    @cuda.jit
    def pipelined(w, out, n16):
        sh = cuda.shared.array(SH, np.uint32, alignment=SHARED16)
        tid = cuda.threadIdx.x
        nt = cuda.gridDim.x * NT
        i = cuda.grid(1)
        n_steps = (n16 + nt * L - 1) // (nt * L)
        acc = U(0)
        # piece k of step j: (j * L + k) * nt + i; shared slot ((j % S) * L + k) * NT + tid, so a
        # warp's 16-byte shared reads are contiguous. Each thread reads only its own copies:
        # its wait_group is all the synchronisation there is.
        for j in range(S - 1):
            if j < n_steps:
                for k in range(L):
                    cp_async16(sh, ((j * L + k) * NT + tid) * 4, w, 8 * min((j * L + k) * nt + i, n16 - 1), 16)
            cp_async_commit()
        for j in range(n_steps):
            jn = j + S - 1
            if jn < n_steps:
                slot = jn % S
                for k in range(L):
                    cp_async16(sh, ((slot * L + k) * NT + tid) * 4, w, 8 * min((jn * L + k) * nt + i, n16 - 1), 16)
            cp_async_commit()
            WAIT()
            slot = j % S
            for k in range(L):
                a, b, c, d = lds4(sh, ((slot * L + k) * NT + tid) * 4)
                acc ^= a ^ b ^ c ^ d
        out[i] = acc
    return pipelined


def _bulk_kernel(stages: int, kb: int, threads: int):
    """The "bulk" read: each block streams chunks of kb KB (its chunks b, b + grid, ...)
    through a ring of `stages` shared buffers, each filled by one cp.async.bulk that thread 0
    issues, completing on the stage's mbarrier (luce.kernels.bulk_copy); the block XORs a
    stage's words once its barrier's phase completes, then thread 0 refills it. No
    register holds a byte in flight."""
    from ..kernels.bulk_copy import (bulk_g2s, bulk_init_fence, bulk_reuse_fence, mbar_expect_tx, mbar_init,
                                     mbar_try_wait)
    from ..kernels.mma import lds4
    U = np.uint32
    S = stages
    assert S >= 2  # (the simulator: a refill is done by the time its stage comes round)
    C = kb * 1024  # bytes a stage
    CW = C // 4
    SH = S * CW
    NT = threads
    align = None if cuda.config.ENABLE_CUDASIM else 128

    @cuda.jit
    def bulk(w, out, n16):
        sh = cuda.shared.array(SH, np.uint32, alignment=align)
        bar = cuda.shared.array(S, np.uint64)
        tid = cuda.threadIdx.x
        g = cuda.gridDim.x
        b = cuda.blockIdx.x
        n_bytes = n16 * 16
        n_chunks = (n_bytes + C - 1) // C
        mine = (n_chunks - b + g - 1) // g if b < n_chunks else 0
        # the first copies before the barrier: in the simulator the waits pass at once
        if tid == 0:
            for s in range(S):
                mbar_init(bar, s, 1)
            bulk_init_fence()
            for s in range(S):
                if s < mine:
                    off = (b + s * g) * C
                    nb = min(C, n_bytes - off)
                    mbar_expect_tx(bar, s, nb)
                    bulk_g2s(sh, s * CW, w, off // 2, nb, bar, s)
        cuda.syncthreads()
        acc = U(0)
        for j in range(mine):
            s = j % S
            while not mbar_try_wait(bar, s, (j // S) & 1):
                pass
            nb = min(C, n_bytes - (b + j * g) * C)
            for p in range(tid, nb // 16, NT):
                a0, a1, a2, a3 = lds4(sh, s * CW + 4 * p)
                acc ^= a0 ^ a1 ^ a2 ^ a3
            cuda.syncthreads()  # every thread is done with stage s
            jn = j + S
            if tid == 0 and jn < mine:
                bulk_reuse_fence()
                off = (b + jn * g) * C
                nb = min(C, n_bytes - off)
                mbar_expect_tx(bar, s, nb)
                bulk_g2s(sh, s * CW, w, off // 2, nb, bar, s)
        out[cuda.grid(1)] = acc
    return bulk


def bench_read(sizes=SIZES, variants=DIRECT + ASYNC + BULK + (EMPTY,), reps: int = 20) -> list[dict]:
    """Rows {what, MB, kind, stages, loads, blocks_per_sm, time_us, GB/s}."""
    sm = cuda.get_current_device().MULTIPROCESSOR_COUNT
    stream = cuda.stream()
    pool = cuda.device_array(ROTATE_BYTES // 2, np.uint16)  # contents do not matter
    rows = []
    for what, n_bytes in sizes:
        n16 = n_bytes // 16
        n_bufs = max(2, ROTATE_BYTES // (16 * n16))
        views = [pool[j * 8 * n16:(j + 1) * 8 * n16] for j in range(n_bufs)]
        for kind, stages, loads, bps in variants:
            kernel = read_kernel(kind, stages, loads)
            blocks = sm * bps
            out = cuda.device_array(blocks * THREADS, np.uint32)
            state = {"i": 0}

            def launch():
                kernel[blocks, THREADS, stream](views[state["i"] % n_bufs], out, n16)
                state["i"] += 1
            us, timing = time_launch(launch, stream, reps)
            rows.append({"what": what, "MB": round(n_bytes / 1e6, 2), "kind": kind, "stages": stages, "loads": loads,
                         "blocks_per_sm": bps, "time_us": round(us, 2),
                         "GB/s": round(n_bytes / us / 1e3, 1) if kind != "empty" else None, "timing": timing})
    return rows


def main(argv=None) -> None:
    import json
    import sys

    from .ceilings import copy_bandwidth_gbs
    args = sys.argv[1:] if argv is None else argv
    kinds = set(args[0].split(",")) if args else {"direct", "async", "bulk", "empty"}
    copy = copy_bandwidth_gbs()
    print(json.dumps({"copy GB/s": round(copy, 1)}), flush=True)
    for r in bench_read(variants=tuple(v for v in DIRECT + ASYNC + BULK + (EMPTY,) if v[0] in kinds)):
        if r["GB/s"]:
            r["% copy"] = round(100 * r["GB/s"] / copy, 1)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
