"""The tensor-core small-M product (luce.kernels.matvec_mma) against what the backend runs now
for the same rows of x: the fast matvec for one row (decode), the small-M matmul for more
(verification; the gated rows: two matmuls and the SwiGLU), at Qwen3-8B's layer shapes.
Weights rotate through copies larger than the L2 (as a model's layers do) inside one
captured graph; time_us is GPU time a launch, with x's conversion to fragments included.

    NUMBA_ENABLE_CUDASIM=0 python -m luce.bench.kernels_matvec_mma
"""
from __future__ import annotations

import math

import numpy as np

from .kernels_attention import time_launch
from .kernels_matmul import random_weight

# (qtype, K, N, gated): gate/up, down, q/o, k, v
SHAPES = (("Q4_K", 4096, 12288, True), ("Q6_K", 12288, 4096, False), ("Q4_K", 4096, 4096, False),
          ("Q4_K", 4096, 1024, False), ("Q6_K", 4096, 1024, False))
ROWS = (1, 2, 8, 16, 23, 32)


def bench_matvec_mma(rows=ROWS, shapes=SHAPES, reps: int = 20, rotate_mb: float = 256, seed: int = 0,
                     tiles=None) -> list[dict]:
    """Rows {qtype, rows, K, N, time_us, GB/s, current, current_us, x_current}."""
    from numba import cuda

    from ..kernels.activation import swiglu_cuda
    from ..kernels.matmul import matmul
    from ..kernels.matvec_fast import matvec_fast, swiglu_fast
    from ..kernels.matvec_mma import matvec_mma
    from ..kernels.quant_types import as_qtype, row_bytes

    rng = np.random.default_rng(seed)
    stream = cuda.stream()
    out_rows = []
    for qname, k, n, gated in shapes:
        qt = as_qtype(qname)
        wbytes = n * row_bytes(qt, k) * (2 if gated else 1)
        copies = max(2, math.ceil(rotate_mb * 2**20 / wbytes))
        w0 = cuda.to_device(random_weight(qt, n, k, rng), stream=stream)
        ws = [w0] + [cuda.to_device(w0.copy_to_host(), stream=stream) for _ in range(2 * copies - 1)]
        for m in rows:
            x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float32), stream=stream)
            out = cuda.device_array((m, n), np.float32, stream=stream)
            out2 = cuda.device_array((m, n), np.float32, stream=stream)
            turn = [0]

            def nxt():
                turn[0] += 1
                return ws[turn[0] % len(ws)]

            def mma():
                matvec_mma(nxt(), qt, x, n, out=out, stream=stream, tiles=tiles, w_up=nxt() if gated else None)

            def current():
                if m <= 2:
                    if gated:
                        swiglu_fast(nxt(), nxt(), qt, x, out=out, stream=stream)
                    else:
                        matvec_fast(nxt(), qt, x, out=out, stream=stream)
                else:
                    matmul(x, nxt(), qt, n, k, out=out, stream=stream)
                    if gated:
                        matmul(x, nxt(), qt, n, k, out=out2, stream=stream)
                        swiglu_cuda(out, out2, out=out, stream=stream)
            us, _ = time_launch(mma, stream, reps)
            cur, _ = time_launch(current, stream, reps)
            out_rows.append(dict(qtype=qname + (" gated" if gated else ""), rows=m, K=k, N=n, time_us=round(us, 2),
                                 **{"GB/s": round(wbytes / (us * 1e-6) / 1e9)},
                                 current="matvec_fast" if m <= 2 else "matmul", current_us=round(cur, 2),
                                 x_current=round(us / cur, 2)))
    return out_rows


if __name__ == "__main__":
    import sys
    for row in bench_matvec_mma(tiles=int(sys.argv[1]) if len(sys.argv) > 1 else None):
        print(row)
