"""Ceilings measured in the same run as the figures they judge."""
from __future__ import annotations

import numpy as np


def copy_bandwidth_gbs(n_bytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy, counting read + write bytes (as torch's clone is usually quoted)."""
    from numba import cuda
    src = cuda.device_array(n_bytes // 4, dtype=np.float32)
    dst = cuda.device_array_like(src)
    dst.copy_to_device(src)
    cuda.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record()
    for _ in range(reps):
        dst.copy_to_device(src)
    end.record()
    end.synchronize()
    ms = cuda.event_elapsed_time(start, end) / reps
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def time_ms(fn, reps: int = 20, warmup: int = 3, stream=None) -> float:
    """Mean milliseconds per call of fn() measured with CUDA events."""
    from numba import cuda
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(stream=stream or 0)
    for _ in range(reps):
        fn()
    end.record(stream=stream or 0)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / reps
