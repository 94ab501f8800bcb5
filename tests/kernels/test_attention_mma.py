"""The tensor-core attention kernel (luce.kernels.attention_mma) against attention_ref, in
the CUDA simulator (mma, ldmatrix and the lane reductions emulated): trees, chains and
causal prefill, GQA groups, a sliding window, one and several query tiles and warps, the
direct and split + combine paths, NaN-poisoned pools. Q and P enter the mma as f16 hi + lo
pairs, so the tolerances are those of the f32 kernels. Real shapes (Qwen3-8B at 8K) run in
tests/gpu/test_kernels_gpu.py."""
import numpy as np
import pytest

from luce.kernels import attention as A
from luce.kernels import attention_mma as M
from luce.kernels.attention import causal_mask, tree_mask

from test_attention import ref, run, setup  # noqa: E402 - beside this file (rootdir import mode)


def _depths(parents):
    depth = np.zeros(len(parents), int)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("d,hq,hkv,n_ctx,window,max_splits,long", [
    (32, 4, 1, 70, None, None, False),   # 7 nodes x GQA 4 = 28 rows: two warps, splits + combine
    (32, 4, 1, 70, None, None, True),    # the same over a "long" context: Q in shared memory
    (64, 4, 2, 30, None, 1, False),      # direct write, context inside the first page
    (32, 2, 2, 100, 40, None, False),    # sliding window over the committed rows
    (32, 6, 2, 100, 40, None, True),     # (GQA 3: 21 rows, two warps)
    (32, 3, 1, 40, None, None, True),    # GQA 3 (SmolLM2): rows of a query straddle the 8-row halves
])
def test_tree(monkeypatch, d, hq, hkv, n_ctx, window, max_splits, long):
    parents = np.array([-1, 0, 0, 1, 1, 2, 3])
    mask = tree_mask(parents)
    # long: the cache's committed keys count as a long context (attention_cache_cuda's long)
    monkeypatch.setattr(M, "DECODE_LONG_KEYS", n_ctx if long else 10 ** 9)
    plan = A.attention_plan(7, hq, hkv, d, n_ctx + 7, long=long)
    assert plan["kind"] == "mma" and plan["qsh"] == long
    cache, q, kv, cpos, npos = setup(n_ctx, 7, hq=hq, hkv=hkv, d=d, new_pos=n_ctx + _depths(parents))
    got = run(cache, q, npos, mask, window=window, max_splits=max_splits)
    _close(got, ref(q, kv, cpos, npos, mask, window=window))


def test_prefill_causal_several_tiles_window():
    # 17 queries x GQA 2 = 34 rows: two tiles of two warps, the second of one query (started
    # first: the last tiles go first); the chain crosses a page
    cache, q, kv, cpos, npos = setup(50, 17, hq=2, hkv=1, d=32)
    assert M.plan(17, 2, 1, 67, None)["n_tiles"] == 2
    got = run(cache, q, npos, None, 25)
    _close(got, ref(q, kv, cpos, npos, causal_mask(17), 25))


def test_rows_past_the_queries_and_empty_splits():
    # a graph-sized grid: splits planned for 256 keys, 2 queries present over 10 keys
    cache, q, kv, cpos, npos = setup(8, 2, hq=4, hkv=2, d=32)
    out = run(cache, q, npos, None, None, max_splits=None)
    _close(out, ref(q, kv, cpos, npos, causal_mask(2)))


def test_q_in_shared_memory_where_two_blocks_fit(monkeypatch):
    """attention_mma.plan keeps Q in shared memory for a one-tile tree over a long context
    where that fits two blocks an SM, and splits for two waves of blocks then; registers
    for short contexts, prefill tiles and 8-warp tiles (one block an SM either way). The
    GPU's warps: the simulator's plan caps them at two."""
    monkeypatch.setattr(M, "SIM", False)
    monkeypatch.setattr(M, "Q_SHARED", True)
    # Qwen3-8B heads (GQA 4, head dim 128): 23 nodes are 92 rows, 6 warps
    long, short = (M.plan(23, 32, 8, 8192 + 23, None, dim=128, long=lg) for lg in (True, False))
    assert (long["warps"], long["qsh"], long["n_splits"]) == (6, True, 33)
    assert (short["warps"], short["qsh"], short["n_splits"]) == (6, False, 17)
    assert not M.plan(32, 32, 8, 8192 + 32, None, dim=128, long=True)["qsh"]  # 8 warps: 197 registers
    assert not M.plan(512, 32, 8, 8192 + 512, None, dim=128, long=True)["qsh"]  # prefill: many tiles
    monkeypatch.setattr(M, "Q_SHARED", False)
    assert not M.plan(23, 32, 8, 8192 + 23, None, dim=128, long=True)["qsh"]
