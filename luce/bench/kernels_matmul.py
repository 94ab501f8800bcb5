"""Prefill matmul throughput (luce.kernels.matmul) on random GGUF weights.

    NUMBA_ENABLE_CUDASIM=0 python -m luce.bench.kernels_matmul [--small-m] [--sweep] [--gated]

Shapes are (M, K, N): Y[M, N] = X[M, K] @ W[N, K]^T; the defaults are Qwen3-8B's FFN up/gate
(4096 -> 12288), down (12288 -> 4096) and a 4096 x 4096 projection at a 512-token prefill;
--small-m takes the speculative-verification widths (M = 8, 16, 23, 64) of the first two.
Times are CUDA-event means over `reps` launches after a warm-up (which also compiles).
time_us is GPU time: the launches are queued behind a sleeping kernel, so they run back to
back whatever the host's launch cost (numba: ~50-150 us a launch, more than a 4096 x 4096
product takes); wall_us is the same loop without the queueing, host cost included.
Successive launches cycle through copies of W at distinct addresses, >= rotate_mb in all
(256 MB: five times the H200's 50 MB L2), so that each launch reads its weights from HBM as
a model's layers do; with one copy a 28 MB weight would stay in L2 and small M would look
faster than it is. GB/s is weight bytes over time: at small M the kernel should approach
HBM speed (~3-4 TB/s on the H200); baseline=True adds the time of the 1-row matvec on the
same weights (timed the same way) and their ratio.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

DEFAULT_SHAPES = ((512, 4096, 12288), (512, 12288, 4096), (512, 4096, 4096))
SMALL_M_SHAPES = tuple((m, k, n) for m in (8, 16, 23, 64) for _, k, n in DEFAULT_SHAPES[:2])


def random_weight(qtype, n: int, k: int, rng) -> np.ndarray:
    """uint8 [n, row_bytes]: GGUF bytes of a random n x k weight of `qtype`."""
    from luce.kernels.quant_types import as_qtype
    qtype = as_qtype(qtype)
    if qtype.name == "F16":
        return (0.02 * rng.standard_normal((n, k))).astype(np.float16).view(np.uint8)
    from .synthetic import random_quant_rows
    return random_quant_rows(qtype, n, k, rng)


_SLEEP: dict = {}


def _timer(stream, reps: int, warmup: int):
    """time_us(fn) -> {"wall": us, "gpu": us} per fn(i) call, i the launch's index: GPU time
    with the launches queued behind a sleeping kernel (see the module's docstring)."""
    from numba import cuda
    if "k" not in _SLEEP:
        @cuda.jit
        def sleep(n):  # holds the stream while the host queues the timed launches
            for _ in range(n):
                cuda.nanosleep(1000000)
        _SLEEP["k"] = sleep

    def time_us(fn):
        for i in range(warmup):
            fn(i)
        stream.synchronize()
        e0, e1 = cuda.event(), cuda.event()  # timing events by default
        res = {}
        for mode in ("wall", "gpu"):
            if mode == "gpu" and not cuda.config.ENABLE_CUDASIM:  # (no nanosleep there; smoke runs only)
                _SLEEP["k"][1, 1, stream](2 * reps + 5)  # ~1 ms a unit (nanosleep is approximate): > host time
            e0.record(stream)
            for i in range(reps):
                fn(i)
            e1.record(stream)
            e1.synchronize()
            res[mode] = e0.elapsed_time(e1) * 1e3 / reps
        return res
    return time_us


# (M, K, N) of the SwiGLU FFNs at a 512-token prefill: Qwen3-8B and Qwen3-32B
GATED_SHAPES = ((512, 4096, 12288), (512, 5120, 25600))


def bench_gated(shapes=GATED_SHAPES, qtype="Q4_K", reps: int = 10, warmup: int = 2, seed: int = 0,
                rotate_mb: float = 512) -> list[dict]:
    """The SwiGLU FFN product silu(X W_gate^T) * (X W_up^T) as one launch (matmul's w_up)
    against what it replaced: two matmul launches and the SwiGLU kernel. One row per shape:
    both times (us), TFLOP/s of the fused launch (4 M N K flops) and the ratio."""
    import math

    from numba import cuda

    from luce.kernels.activation import swiglu_cuda
    from luce.kernels.matmul import matmul
    from luce.kernels.quant_types import as_qtype, row_bytes
    rng = np.random.default_rng(seed)
    rows = []
    for m, k, n in shapes:
        x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float32))
        h, g, u = (cuda.device_array((m, n), np.float32) for _ in range(3))
        w0 = cuda.to_device(random_weight(qtype, n, k, rng))
        ws = [w0]
        for _ in range(max(2, math.ceil(rotate_mb * 2**20 / (n * row_bytes(as_qtype(qtype), k)))) - 1):
            c = cuda.device_array_like(w0)
            c.copy_to_device(w0)
            ws.append(c)
        stream = cuda.stream()
        time_us = _timer(stream, reps, warmup)

        def fused(i):
            matmul(x, ws[2 * i % len(ws)], qtype, n, k, out=h, stream=stream, w_up=ws[(2 * i + 1) % len(ws)])

        def two(i):
            matmul(x, ws[2 * i % len(ws)], qtype, n, k, out=g, stream=stream)
            matmul(x, ws[(2 * i + 1) % len(ws)], qtype, n, k, out=u, stream=stream)
            swiglu_cuda(g, u, out=h, stream=stream)
        us, us2 = time_us(fused)["gpu"], time_us(two)["gpu"]
        rows.append(dict(M=m, K=k, N=n, qtype=qtype, fused_us=round(us, 1), two_launches_and_swiglu_us=round(us2, 1),
                         **{"TFLOP/s": round(4 * m * n * k / (us * 1e-6) / 1e12, 1)},
                         x_before=round(us / us2, 3), weight_copies=len(ws)))
        del ws, w0
    return rows


def bench_matmul(shapes=DEFAULT_SHAPES, qtypes=("Q4_K", "Q6_K"), tile=None, x_dtype=np.float32,
                 use_mma=None, reps: int = 20, warmup: int = 3, seed: int = 0, min_blocks=None,
                 x_convert=None, splits=None, per_sm: int | None = None, rotate_mb: float = 256,
                 baseline: bool = False) -> list[dict]:
    """One row per (shape, qtype): M, K, N, qtype, tile, splits, time_us, TFLOP/s (2 M N K
    flops), GB/s (weight bytes), wall_us[, matvec_us and x_matvec with baseline].

    tile=None: matmul's own choice (pick_tile), splits as it decides. A given tile runs
    with `splits`, or, with per_sm (resident blocks an SM) given instead, auto_splits'."""
    import math

    from numba import cuda

    from luce.kernels.matmul import auto_splits, matmul, pick_tile
    from luce.kernels.quant_types import as_qtype, row_bytes

    rng = np.random.default_rng(seed)
    rows = []
    for m, k, n in shapes:
        x = cuda.to_device(rng.standard_normal((m, k)).astype(x_dtype))
        x1 = cuda.to_device(rng.standard_normal(k).astype(np.float32))
        out = cuda.device_array((m, n), np.float32)
        out1 = cuda.device_array(n, np.float32)
        for qt in qtypes:
            if tile is None:
                t, sp = pick_tile(m, n, k, qt, sim=False)
            else:
                t = tuple(tile)
                sp = splits or (auto_splits(t, m, n, k, per_sm) if per_sm else 1)
            wbytes = n * row_bytes(as_qtype(qt), k)
            w0 = cuda.to_device(random_weight(qt, n, k, rng))
            ws = [w0]
            for _ in range(max(1, math.ceil(rotate_mb * 2**20 / wbytes)) - 1):
                c = cuda.device_array_like(w0)
                c.copy_to_device(w0)
                ws.append(c)
            stream = cuda.stream()

            def call(i):
                matmul(x, ws[i % len(ws)], qt, n, k, out=out, stream=stream, use_mma=use_mma, tile=t,
                       min_blocks=min_blocks, x_convert=x_convert, splits=sp)

            time_us = _timer(stream, reps, warmup)
            res = time_us(call)
            us = res["gpu"]
            row = dict(M=m, K=k, N=n, qtype=qt, tile="x".join(map(str, t[:5])) + "/" + "/".join(map(str, t[5:])),
                       splits=sp, time_us=round(us, 1),
                       **{"TFLOP/s": round(2 * m * n * k / (us * 1e-6) / 1e12, 1),
                          "GB/s": round(wbytes / (us * 1e-6) / 1e9)},
                       wall_us=round(res["wall"], 1), weight_copies=len(ws))
            if baseline:
                from luce.kernels.matvec import matvec

                def call1(i):
                    matvec(ws[i % len(ws)], qt, x1, out=out1, stream=stream)
                mv = time_us(call1)["gpu"]
                row.update(matvec_us=round(mv, 1), x_matvec=round(us / mv, 2))
            rows.append(row)
            del ws, w0
    return rows


# Configurations compared by --sweep: label -> bench_matmul keyword arguments
SWEEP = {
    "default (128x128x64 w64x32 ldsm, X to f16 first)": dict(qtypes=("Q4_K", "Q6_K", "Q8_0", "F16")),
    "default, X converted in the kernel": dict(x_convert=False),
    "128x128x64 w32x64": dict(tile=(128, 128, 64, 32, 64, "ldsm", 1)),
    "128x128x32 w64x32 2-stage, 2 blocks/SM": dict(tile=(128, 128, 32, 64, 32, "ldsm", 2), min_blocks=2),
    "64x128x64 w32x64 (4 warps)": dict(tile=(64, 128, 64, 32, 64, "ldsm", 1)),
    "FMA path": dict(use_mma=False, shapes=DEFAULT_SHAPES[:1], reps=3),
}
# --small-m --sweep: candidates for TILES_SMALL_M (luce.kernels.matmul) at the M they would
# serve; per_sm sets the split count (auto_splits), from ptxas register counts.
_M16, _M23, _M64 = (SMALL_M_SHAPES[2:4], SMALL_M_SHAPES[4:6], SMALL_M_SHAPES[6:8])
SWEEP_SMALL_M = {
    "default (pick_tile), vs the 1-row matvec": dict(shapes=SMALL_M_SHAPES, baseline=True),
    "default, X converted in the kernel": dict(shapes=_M16 + _M64, x_convert=False),
    "16x64x128 2-stage unsplit": dict(shapes=_M16, tile=(16, 64, 128, 16, 16, "ldsm", 2), splits=1),
    "16x64x128 1-stage": dict(shapes=_M16, tile=(16, 64, 128, 16, 16, "ldsm", 1), per_sm=4),
    "16x64x256 1-stage (2 blocks/SM)": dict(shapes=_M16, tile=(16, 64, 256, 16, 16, "ldsm", 1), per_sm=2),
    "16x128x128 8 warps (half the X traffic from L2)": dict(shapes=_M16, tile=(16, 128, 128, 16, 16, "ldsm", 1),
                                                         per_sm=2),
    "16x64x64 2-stage": dict(shapes=_M16, tile=(16, 64, 64, 16, 16, "ldsm", 2), per_sm=7),
    "32x64x64 2-stage at M=23": dict(shapes=_M23, tile=(32, 64, 64, 32, 16, "ldsm", 2), per_sm=5),
    "32x64x128 w16x32 at M=23": dict(shapes=_M23, tile=(32, 64, 128, 16, 32, "ldsm", 1), per_sm=3),
    "64x64x128 4 warps at M=64": dict(shapes=_M64, tile=(64, 64, 128, 32, 32, "ldsm", 1), per_sm=2),
    "128x128 prefill tile at M=64 (before)": dict(shapes=_M64, tile=(128, 128, 64, 64, 32, "ldsm", 1)),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="compare the tile configurations of SWEEP")
    ap.add_argument("--small-m", action="store_true",
                    help="verification widths (SMALL_M_SHAPES, with the 1-row matvec for scale; "
                         "with --sweep: SWEEP_SMALL_M)")
    ap.add_argument("--gated", action="store_true",
                    help="the SwiGLU FFN as one launch against two launches and the SwiGLU kernel (GATED_SHAPES)")
    ap.add_argument("--qtypes", default="Q4_K,Q6_K")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    qtypes = tuple(a.qtypes.split(","))
    out = []
    if a.gated:
        out = bench_gated(qtype=qtypes[0], reps=a.reps)
        for r in out:
            print(json.dumps(r), flush=True)
    elif a.sweep:
        for label, kw in (SWEEP_SMALL_M if a.small_m else SWEEP).items():
            kw = {"qtypes": qtypes[:1], "reps": a.reps, **kw}
            try:
                rows = bench_matmul(**kw)
            except Exception as e:  # one failing configuration must not hide the others
                print(f"{label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            for r in rows:
                r["config"] = label
                print(json.dumps(r), flush=True)
            out += rows
    else:
        kw = dict(shapes=SMALL_M_SHAPES, baseline=True) if a.small_m else {}
        out = bench_matmul(qtypes=qtypes, reps=a.reps, **kw)
        for r in out:
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
