"""Prefill matmul throughput (luce.kernels.matmul) on random GGUF weights.

    NUMBA_ENABLE_CUDASIM=0 python -m luce.bench.kernels_matmul [--sweep]

Shapes are (M, K, N): Y[M, N] = X[M, K] @ W[N, K]^T; the defaults are Qwen3-8B's FFN up/gate
(4096 -> 12288), down (12288 -> 4096) and a 4096 x 4096 projection at a 512-token prefill.
Times are CUDA-event means over `reps` launches after a warm-up (which also compiles).
time_us is GPU time: the launches are queued behind a sleeping kernel, so they run back to
back whatever the host's launch cost (numba: ~50-150 us a launch, more than a 4096 x 4096
product takes); wall_us is the same loop without the queueing, host cost included.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

DEFAULT_SHAPES = ((512, 4096, 12288), (512, 12288, 4096), (512, 4096, 4096))


def random_weight(qtype, n: int, k: int, rng) -> np.ndarray:
    """uint8 [n, row_bytes]: GGUF bytes of a random n x k weight of `qtype`."""
    from luce.kernels.quant_types import as_qtype
    qtype = as_qtype(qtype)
    if qtype.name == "F16":
        return (0.02 * rng.standard_normal((n, k))).astype(np.float16).view(np.uint8)
    from .synthetic import random_quant_rows
    return random_quant_rows(qtype, n, k, rng)


def bench_matmul(shapes=DEFAULT_SHAPES, qtypes=("Q4_K", "Q6_K"), tile=None, x_dtype=np.float32,
                 use_mma=None, reps: int = 20, warmup: int = 3, seed: int = 0, min_blocks=None,
                 x_convert=None) -> list[dict]:
    """One row per (shape, qtype): M, K, N, qtype, time_us, TFLOP/s (2 M N K flops)."""
    from numba import cuda

    from luce.kernels.matmul import matmul

    @cuda.jit
    def sleep(n):  # holds the stream while the host queues the timed launches
        for _ in range(n):
            cuda.nanosleep(1000000)
    rng = np.random.default_rng(seed)
    rows = []
    for m, k, n in shapes:
        x = cuda.to_device(rng.standard_normal((m, k)).astype(x_dtype))
        out = cuda.device_array((m, n), np.float32)
        for qt in qtypes:
            w = cuda.to_device(random_weight(qt, n, k, rng))
            stream = cuda.stream()

            def call():
                matmul(x, w, qt, n, k, out=out, stream=stream, use_mma=use_mma, tile=tile, min_blocks=min_blocks,
                       x_convert=x_convert)
            for _ in range(warmup):
                call()
            stream.synchronize()
            e0, e1 = cuda.event(), cuda.event()  # timing events by default
            res = {}
            for mode in ("wall", "gpu"):
                if mode == "gpu":
                    sleep[1, 1, stream](2 * reps + 5)  # ~1 ms a unit (nanosleep is approximate): > host time
                e0.record(stream)
                for _ in range(reps):
                    call()
                e1.record(stream)
                e1.synchronize()
                res[mode] = e0.elapsed_time(e1) * 1e3 / reps
            us = res["gpu"]
            rows.append(dict(M=m, K=k, N=n, qtype=qt, time_us=round(us, 1),
                             **{"TFLOP/s": round(2 * m * n * k / (us * 1e-6) / 1e12, 1)},
                             wall_us=round(res["wall"], 1)))
            del w
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="compare the tile configurations of SWEEP")
    ap.add_argument("--qtypes", default="Q4_K,Q6_K")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    qtypes = tuple(a.qtypes.split(","))
    out = []
    if a.sweep:
        for label, kw in SWEEP.items():
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
        out = bench_matmul(qtypes=qtypes, reps=a.reps)
        for r in out:
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
