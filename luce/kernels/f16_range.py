"""Activations into f16's range for the tensor-core products.

The mma products (matvec_mma, the prefill matmul) take x as f16, whose largest value is
65504. Activations can pass it: the SwiGLU products a down projection takes reached
1.2e5-2.5e5 in a random-weight Q4_K_M qwen3 (real SmolLM2 on a code prompt: 2,822), and an
inf there makes NaN logits. So a row of x whose largest |value| reaches 2**15 is scaled by a
power of two into range (exact; f16 keeps its 11 bits for all but values ~1e-9 of the
largest) and its outputs are multiplied back by the inverse in the product's epilogue.

Such rows are rare, so a conversion stays one thread an item over the whole grid and only
flags rows that overflow; a second launch (a block a row, `row_fixup_scale`) rewrites the flagged
rows scaled, sets every row's scale (1 for the rest, whose bits are what they would be
without any of this) and clears the flags for the next call. A first form, a block a row
finding each row's largest value before converting, made the H200's 23-node verification
forward 13% slower (7.43 ms against 6.58)."""
from __future__ import annotations

import numpy as np
from numba import cuda

from ._reduce import block_max
from .device import device

F16_SAFE = np.float32(32768.0)  # rows with max |x| at or above this are scaled down
FIXUP_THREADS = 256


@device(inline=True)
def row_scales(maxabs):
    """(down, up): powers of two with maxabs * down < 2**15 and down * up == 1 (1, 1 when
    maxabs < 2**15 already). Halvings and doublings: exact."""
    down = np.float32(1.0)
    up = np.float32(1.0)
    m = maxabs
    e = 0
    while m >= F16_SAFE and e < 126:
        m *= np.float32(0.5)
        down *= np.float32(0.5)
        up *= np.float32(2.0)
        e += 1
    return down, up


@device(inline=True)
def row_fixup_scale(x, t, n_x, flags, scales, buf):
    """Block-wide, in a block per row t of a fixup kernel: the factor to convert row t with
    (0 when the row was not flagged: nothing to rewrite; its scale is set to 1). Every
    thread must call it; the block's barriers come after every thread has read the flag."""
    tid = cuda.threadIdx.x
    if flags[t] == 0 or t >= n_x:  # the same for the whole block
        if tid == 0:
            scales[t] = np.float32(1.0)
        return np.float32(0.0)
    mx = np.float32(0.0)
    for e in range(tid, x.shape[1], cuda.blockDim.x):
        mx = max(mx, abs(x[t, e]))
    down, up = row_scales(block_max(mx, buf))
    if tid == 0:
        scales[t] = up
        flags[t] = 0
    return down


_UNIT: list = []  # [ones]: the largest set made; outgrown ones are kept (graphs point at them)


def unit_scales(n_rows: int):
    """float32 ones for at least n_rows rows: the row scales of a conversion made without
    the guard (every |x| known to be below 2**15)."""
    if not _UNIT or _UNIT[-1].size < n_rows:
        _UNIT.append(cuda.to_device(np.ones(max(n_rows, 1024), np.float32)))
    return _UNIT[-1]


def unit_flags():
    """A zeroed int32 flag array that a kernel's absent epilogue is given (never written):
    one for the process, so that captured graphs keep its address."""
    if not _UNIT_FLAGS:
        _UNIT_FLAGS.append(new_flags(8))
    return _UNIT_FLAGS[0]


_UNIT_FLAGS: list = []


def new_flags(n_rows: int):
    """Zeroed overflow flags (int32) for n_rows rows; each fixup leaves them zeroed."""
    return cuda.to_device(np.zeros(n_rows, np.int32))
