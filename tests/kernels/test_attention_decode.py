"""The a-thread-a-key decode attention kernel (luce.kernels.attention_decode) against
attention_ref in the CUDA simulator: NaN-poisoned pools (unwritten rows must not reach the
output), 150 committed keys (5 steps of 32, the last partial), GQA groups of 1, 2, 3, 4
and 8, head dims 32-128, one or two warps a block, one or two K/V buffers, 16 or 32 keys a
step, the direct path and split merges with a step or several a split, a sliding window
inside a step, and a grid sized for more keys than are present (empty splits). The 8B and
32B shapes at 8K run in tests/gpu/test_kernels_gpu.py."""
import numpy as np
import pytest

from luce.kernels import attention as A
from luce.kernels import attention_decode as AD
from tests.kernels.test_attention import ref, run, run_in_graph_grid, setup
from tests.ptx_background import assert_ptx_ok, background_ptx_check

ONE = np.ones((1, 1), bool)


@pytest.mark.parametrize("d,hq,hkv,max_splits,window,threads,bufs,keys", [
    (32, 4, 2, None, None, 32, 2, 32),   # a step a split, merged by the last block
    (64, 8, 1, 2, 40, 32, 2, 32),        # 8 q heads (8 lanes a key), 3 steps a split, a window
    (128, 2, 2, 1, None, 32, 1, 32),     # direct, one buffer, head dim 128
    (32, 4, 1, 3, None, 64, 2, 16),      # two warps, 16 keys a step (10 steps over 3 splits)
    (32, 6, 2, None, None, 32, 2, 32),   # 3 q heads a kv head (SmolLM2's group)
])
def test_decode_keys_kernel(monkeypatch, d, hq, hkv, max_splits, window, threads, bufs, keys):
    monkeypatch.setattr(AD, "ENABLED", True)
    monkeypatch.setattr(AD, "SIM_THREADS", threads)
    monkeypatch.setattr(AD, "BUFFERS", bufs)
    monkeypatch.setattr(AD, "KEYS_A_STEP", keys)
    cache, q, kv, cpos, npos = setup(150, 1, hq=hq, hkv=hkv, d=d)
    plan = A.attention_plan(1, hq, hkv, d, 151, max_splits)
    assert plan["kind"] == "keys" and (plan["nt"], plan["bufs"], plan["keys"]) == (threads, bufs, keys)
    assert plan["n_splits"] == (max_splits or -(-151 // keys))
    got = run(cache, q, npos, ONE, window=window, max_splits=max_splits)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, ONE, window=window), rtol=2e-4, atol=2e-5)


def test_decode_keys_graph_grid_with_empty_splits(monkeypatch):
    """39 keys in a grid sized for 256 (8 splits of a step): splits 2-7 only mark l = 0;
    their partials (NaN scratch) must not reach the output."""
    monkeypatch.setattr(AD, "ENABLED", True)
    cache, q, kv, cpos, npos = setup(39, 1, d=32)
    got, ml, ns = run_in_graph_grid(cache, q, npos)
    assert ns == cache.n_ctx // AD.KEYS_A_STEP
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, ONE), rtol=2e-4, atol=2e-5)
    assert ml[2:, 0, :, 1].tolist() == [[0.0] * 4] * (ns - 2)


def test_decode_keys_kernel_applies_only_where_it_can(monkeypatch):
    monkeypatch.setattr(AD, "ENABLED", True)
    assert AD.applies(1, 128, False, 4) and AD.applies(1, 128, False, 8)
    assert not AD.applies(2, 128, False, 4)    # several queries: the tree and chain kernels
    assert not AD.applies(1, 128, True, 4)     # q8_0 pools
    assert not AD.applies(1, 128, False, 16)   # 16 q heads a kv head
    assert not AD.applies(1, 16, False, 4)     # head dim 16
    assert AD.applies(1, 256, False, 2) and AD.buffers(256, 2) == 1 and AD.buffers(128, 8) == 2
    monkeypatch.setattr(AD, "ENABLED", False)
    assert not AD.applies(1, 128, False, 4)


PTX_CHECK = r'''
from numba import cuda
from luce.kernels import attention_decode as AD
from luce.kernels.ptx import ptxas_usage
F3, I1 = "float32[:, :, ::1]", "int32[::1]"
sig = (f"void({F3}, uint16[::1], uint16[::1], {I1}, int64, int64, {I1}, {I1}, {I1}, int64, float32, int64, {F3}, "
       "float32[:, :, :, ::1], float32[:, :, :, ::1], int32[::1])")
for dim, group in [(128, 4), (128, 8), (64, 4), (256, 2), (128, 1)]:
    code = cuda.compile_ptx(AD.kernel(dim, group, bufs=AD.buffers(dim, group)).py_func, sig, cc=(9, 0))[0]
    use = ptxas_usage(code)
    # registers only (q, the running softmax and the accumulators), K/V by cp.async read back
    # 16 bytes at a time, shuffles, the split merge's counter, no float64; 128 threads fit
    assert ".local" not in code and "cp.async" in code and "ld.shared.v4.u32" in code, (dim, group)
    assert "shfl.sync" in code and "atom.global.add" in code and ".f64" not in code, (dim, group)
    assert use["spill_bytes"] == 0 and use["registers"] * AD.THREADS <= 65536, (dim, group, use)
    print(dim, group, use)
print("PTX OK")
'''

ptx_check = background_ptx_check(PTX_CHECK)


def test_decode_keys_kernel_compiles_to_ptx(ptx_check):
    assert_ptx_ok(ptx_check)
