"""The tensor-core Q4_K matvec (luce.kernels.matvec_mma) against what the backend runs now
for the same rows of x: the fast matvec for one row (decode), the small-M matmul for more
(verification), at Qwen3-8B's FFN shapes. Weights rotate through copies larger than the L2
(as a model's layers do) inside one captured graph; time_us is GPU time a launch.

    NUMBA_ENABLE_CUDASIM=0 python -m luce.bench.kernels_matvec_mma
"""
from __future__ import annotations

import math

import numpy as np

from .kernels_attention import time_launch
from .kernels_matmul import random_weight

SHAPES = ((4096, 12288), (12288, 4096))  # (K, N): gate/up, down
ROWS = (1, 8, 16, 23, 32)


def bench_matvec_mma(rows=ROWS, shapes=SHAPES, reps: int = 20, rotate_mb: float = 256, seed: int = 0) -> list[dict]:
    """Rows {rows, K, N, time_us, GB/s, current, current_us, x_current}."""
    from numba import cuda

    from ..kernels.matmul import matmul
    from ..kernels.matvec_fast import matvec_fast
    from ..kernels.matvec_mma import matvec_mma
    from ..kernels.quant_types import T, row_bytes

    rng = np.random.default_rng(seed)
    stream = cuda.stream()
    out_rows = []
    for k, n in shapes:
        wbytes = n * row_bytes(T.Q4_K, k)
        w0 = cuda.to_device(random_weight("Q4_K", n, k, rng), stream=stream)
        ws = [w0] + [cuda.to_device(w0.copy_to_host(), stream=stream)
                     for _ in range(max(1, math.ceil(rotate_mb * 2**20 / wbytes)) - 1)]
        for m in rows:
            x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float32), stream=stream)
            out = cuda.device_array((m, n), np.float32, stream=stream)
            turn = [0]

            def nxt():
                turn[0] += 1
                return ws[turn[0] % len(ws)]

            def mma():
                matvec_mma(nxt(), T.Q4_K, x, n, out=out, stream=stream)

            def current():
                if m == 1:
                    matvec_fast(nxt(), T.Q4_K, x.reshape(k), out=out.reshape(n), stream=stream)
                else:
                    matmul(x, nxt(), T.Q4_K, n, k, out=out, stream=stream)
            us, _ = time_launch(mma, stream, reps)
            cur, _ = time_launch(current, stream, reps)
            out_rows.append(dict(rows=m, K=k, N=n, time_us=round(us, 2), **{"GB/s": round(wbytes / (us * 1e-6) / 1e9)},
                                 current="matvec_fast" if m == 1 else "matmul", current_us=round(cur, 2),
                                 x_current=round(us / cur, 2)))
    return out_rows


if __name__ == "__main__":
    for row in bench_matvec_mma():
        print(row)
