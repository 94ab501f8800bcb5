"""The read-ceiling bench's kernels read every piece once: the XOR of what they return is
the XOR of the buffer (a piece skipped or read twice changes it)."""
import numpy as np
import pytest
from numba import cuda

from luce.bench.kernels_read import read_kernel


@pytest.mark.parametrize("kind,stages,loads,n16", [
    ("direct", 1, 1, None), ("direct", 1, 4, None), ("async", 3, 1, None), ("async", 4, 2, None),
    ("bulk", 2, 1, None), ("bulk", 3, 1, 150)])  # bulk: 1 KB stages; 150 pieces end in a partial chunk
def test_read_kernels_cover_the_buffer_once(kind, stages, loads, n16):
    rng = np.random.default_rng(3)
    threads, blocks = 32, 2
    n16 = n16 or threads * blocks * loads * 3  # whole steps: no piece clamped to the last
    host = rng.integers(0, 1 << 16, 8 * n16, dtype=np.uint16)
    out = cuda.to_device(np.full(threads * blocks, 0xDEADBEEF, np.uint32))
    read_kernel(kind, stages, loads, threads)[blocks, threads](cuda.to_device(host), out, n16)
    want = np.bitwise_xor.reduce(host.view(np.uint32))
    assert np.bitwise_xor.reduce(out.copy_to_host()) == want
