"""The read-ceiling bench's kernels read every piece once: the XOR of what they return is
the XOR of the buffer (a piece skipped or read twice changes it)."""
import numpy as np
import pytest
from numba import cuda

from luce.bench.kernels_read import read_kernel
from tests.ptx_background import assert_ptx_ok, background_ptx_check


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


# The bulk kernel's inline PTX (cp.async.bulk, mbarrier) compiled for sm_90 without the
# simulator and assembled by ptxas where there is one (the dev extra ships it).
PTX_CHECK = r'''
from numba import cuda
from numba.cuda import types
from luce.bench.kernels_read import _bulk_kernel
from luce.kernels.ptx import ptxas_path, ptxas_usage
sig = (types.uint16[::1], types.uint32[::1], types.int64)
ptx, _ = cuda.compile_ptx(_bulk_kernel(4, 8, 256).py_func, sig, cc=(9, 0))
for op in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "mbarrier.try_wait.parity",
           "mbarrier.arrive.expect_tx", "fence.proxy.async"):
    assert op in ptx, op
if ptxas_path():
    use = ptxas_usage(ptx)
    assert use["spill_bytes"] == 0, use
print("PTX OK")
'''

ptx_check = background_ptx_check(PTX_CHECK)


def test_bulk_read_kernel_compiles_for_sm90(ptx_check):
    assert_ptx_ok(ptx_check)
