"""Paged attention (decode, tree verification, causal prefill, sliding window, GQA)
against attention_ref, in the CUDA simulator: one-warp blocks, head_dim 16, query tiles
of 2..64 rows (so register micro-tiles of 1..4 rows), one and several query tiles, the
single-split (direct) and flash-decoding (split + combine) paths, NaN-poisoned pools.
head_dim 64/128/256 with 128-thread blocks and the Qwen3-8B shapes at 8K context run in
tests/gpu/test_kernels_gpu.py."""
import numpy as np
import pytest
from numba import cuda
from gguf import GGMLQuantizationType as T

from luce.kernels import attention as A
from luce.kernels.attention import attention_cache_cuda, attention_ref, causal_mask, tree_mask, tree_mask_bits
from luce.kv.paged import PagedKVCache
from tests.ptx_background import assert_ptx_ok, background_ptx_check

rng = np.random.default_rng()
D = 16


def setup(n_ctx_rows, n_new, hq=4, hkv=2, ctx_pos=None, new_pos=None, d=D, capacity=256):
    """A device paged cache with n_ctx_rows committed rows and n_new pending ones written
    (layer 1 of 2); returns the cache, the queries and what attention_ref needs."""
    cache = PagedKVCache(2, capacity, hkv, d, device=True)
    nan = np.full(cache.k_pool.shape, np.nan, np.float16)  # unwritten rows must never reach the output
    cache.k_pool.copy_to_device(nan)
    cache.v_pool.copy_to_device(nan)
    kc = rng.standard_normal((n_ctx_rows, hkv, d)).astype(np.float16)
    vc = rng.standard_normal((n_ctx_rows, hkv, d)).astype(np.float16)
    cpos = np.arange(n_ctx_rows) if ctx_pos is None else ctx_pos
    if n_ctx_rows:
        cache.reserve(n_ctx_rows)
        cache.write(1, kc, vc, cpos)
        cache.commit()
    kn = rng.standard_normal((n_new, hkv, d)).astype(np.float16)
    vn = rng.standard_normal((n_new, hkv, d)).astype(np.float16)
    npos = np.arange(n_ctx_rows, n_ctx_rows + n_new) if new_pos is None else new_pos
    cache.reserve(n_new)
    cache.write(1, kn, vn, npos)
    q = (2 * rng.standard_normal((n_new, hq, d))).astype(np.float32)
    return cache, q, (kc, vc, kn, vn), cpos, npos


def run(cache, q, npos, mask=None, window=None, max_splits=None):
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    bits = None if mask is None else cuda.to_device(tree_mask_bits(mask))
    attention_cache_cuda(cache, 1, cuda.to_device(q), cuda.to_device(np.asarray(npos, np.int32)), bits, window,
                         out=out, max_splits=max_splits)
    return out.copy_to_host()


def ref(q, kv, cpos, npos, mask, window=None):
    kc, vc, kn, vn = (a.astype(np.float32) for a in kv)
    return attention_ref(q, kc, vc, kn, vn, mask, q_pos=np.asarray(npos), ctx_pos=np.asarray(cpos), window=window)


def test_mask_bits():
    m = tree_mask(np.array([-1, 0, 0, 1, 3, 2, -1]))
    bits = tree_mask_bits(m)
    assert all(bool(bits[i] >> np.uint64(j) & np.uint64(1)) == m[i, j] for i in range(7) for j in range(7))
    assert tree_mask_bits(np.ones((64, 64), bool))[63] == np.uint64(2 ** 64 - 1)


@pytest.mark.parametrize("max_splits", [1, None])  # direct write; split over 3 pages + combine
def test_decode(max_splits):
    cache, q, kv, cpos, npos = setup(150, 1)
    got = run(cache, q, npos, np.ones((1, 1), bool), max_splits=max_splits)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, np.ones((1, 1), bool)), rtol=2e-4, atol=2e-5)


# The one-query kernel (head_dim a multiple of 32): warps of (split, kv head) walking
# chunks of 32 keys, a key per lane, or of 8 or 16 keys with 4 or 2 lanes a key (summed
# by shuffles). 150 context rows: 5 chunks of 32, the last partial; split over several
# blocks + combine, or direct; GQA groups of 1, 2 and 4; 1, 2 or 4 warps a block, merged
# in the block (one split of 4 warps: runs of 2, 2, 1 and no chunks); two K/V buffers a
# warp (the next chunk copied while one is computed), or one at head dim 256; a sliding
# window that masks keys inside a chunk; a grid planned for the whole context (a
# captured graph's); the split merge 2, 3 (a trip past the last split) or 4 splits a trip;
# 8 q heads a kv head (8 keys a step, the merge left to the combine kernel).
@pytest.mark.parametrize("d,hq,hkv,max_splits,max_warps,bufs,chunk,shape,per_trip", [
    (32, 4, 2, None, 4, (2, 1), 32, (4, 2), 3), (32, 4, 2, 1, 4, (1,), 32, (4, 1), None),
    (64, 4, 1, None, 2, (2, 1), 32, (2, 2), None), (32, 2, 2, 3, 1, (2, 1), 32, (1, 2), 2),
    (64, 2, 1, 1, 2, (1,), 32, (2, 1), None), (256, 2, 1, None, 4, (2, 1), 32, (1, 1), None),
    (32, 4, 2, None, 4, (1,), 8, (4, 1), None), (64, 4, 1, 2, 2, (2, 1), 16, (2, 2), None),
    (32, 8, 1, None, 4, (1,), 16, (4, 1), None),
    # lanes of 3, 5 and 6 dims (Phi-3's head dim 96: its value pass once covered 2 of 3)
    (96, 4, 2, None, 4, (1,), 16, (4, 1), None), (160, 2, 1, 2, 2, (1,), 16, (2, 1), None),
    (192, 2, 2, None, 2, (1,), 16, (2, 1), None)])
def test_decode_one_query_kernel(monkeypatch, d, hq, hkv, max_splits, max_warps, bufs, chunk, shape, per_trip):
    monkeypatch.setattr(A, "DECODE_MAX_WARPS", max_warps)
    monkeypatch.setattr(A, "DECODE_BUFS", bufs)
    monkeypatch.setattr(A, "DECODE_CHUNK", chunk)
    monkeypatch.setattr(A, "DECODE_MERGE_PER_TRIP", per_trip)
    cache, q, kv, cpos, npos = setup(150, 1, hq=hq, hkv=hkv, d=d)
    assert A._row_kernel_applies(1, d, False, hq // hkv)
    plan = A.attention_plan(1, hq, hkv, d, 151, max_splits)
    if hq // hkv >= 8:  # blocks of 8+ rows take DECODE_CHUNK_WIDE keys a step
        chunk = A.DECODE_CHUNK_WIDE
    assert plan["kind"] == "row" and (plan["warps"], plan["bufs"], plan["chunk"]) == shape + (chunk,)
    assert plan["per_trip"] == (per_trip or 4)  # these shapes leave room for 4
    # the last block merges where it has a warp a q head; the combine kernel otherwise
    assert plan["self_merge"] == (hq // hkv <= shape[0])
    one = np.ones((1, 1), bool)
    got = run(cache, q, npos, one, max_splits=max_splits)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, one), rtol=2e-4, atol=2e-5)


# Decode on the tensor-core kernel (LUCE_DECODE_ATTN=mma): one query's GQA rows in a
# 16-row tile, the rest zeros; one split (direct) or split over pages + the combine kernel,
# with its block target small enough that splits hold several pages and a sliding window
# (head dim 64 and a GQA group of 3 there: SmolLM2's).
@pytest.mark.parametrize("hq,hkv,max_splits,blocks,window,d", [(4, 2, 1, 792, None, 32), (8, 1, None, 792, None, 32),
                                                               (6, 2, None, 4, 70, 64)])
def test_decode_on_tensor_cores(monkeypatch, hq, hkv, max_splits, blocks, window, d):
    from luce.kernels import attention_mma as M
    monkeypatch.setattr(M, "DECODE", "mma")
    monkeypatch.setattr(M, "DECODE_TARGET_BLOCKS", blocks)
    cache, q, kv, cpos, npos = setup(150, 1, hq=hq, hkv=hkv, d=d)
    plan = A.attention_plan(1, hq, hkv, d, 151, max_splits)
    assert plan["kind"] == "mma" and (plan["n_splits"] == 1) == (max_splits == 1)
    # auto (the default): tensor cores only where the context is long
    monkeypatch.setattr(M, "DECODE", "auto")
    assert A.attention_plan(1, hq, hkv, d, 151, long=True)["kind"] == "mma"
    assert A.attention_plan(1, hq, hkv, d, 151, long=False)["kind"] == "row"
    monkeypatch.setattr(M, "DECODE", "mma")
    assert max_splits == 1 or plan["n_splits"] == (3 if blocks == 792 else 2)
    one = np.ones((1, 1), bool)
    got = run(cache, q, npos, one, max_splits=max_splits, window=window)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, one, window=window), rtol=2e-4, atol=2e-5)


# The decode output's int8 form (LUCE_X8_OUT's "attn": the o projection's x) from the
# kernel's epilogue: one split (direct), the last block's merge, the combine kernel (8 q
# heads a kv head), and a tree (the tile kernel's, by a quantize_x launch after it); the
# int8 values and steps bit for bit those of quantize_x_ref over the output, the sums to
# rounding.
@pytest.mark.parametrize("hq,hkv,max_splits,planes,n_new", [(4, 2, 1, 2, 1), (4, 2, None, 1, 1), (8, 1, None, 2, 1),
                                                            (4, 2, None, 2, 3)])
def test_decode_int8_out(hq, hkv, max_splits, planes, n_new):
    from luce.kernels.quantize_x import quantize_x_ref, xq_size
    from tests.test_quantize_x import assert_same_form
    cache, q, kv, cpos, npos = setup(150, n_new, hq=hq, hkv=hkv, d=32)
    mask = causal_mask(n_new)
    plan = A.attention_plan(n_new, hq, hkv, 32, 150 + n_new, max_splits)
    assert (plan["kind"] == "row") == (n_new == 1)
    assert n_new > 1 or plan["self_merge"] == (hq // hkv <= plan["warps"]) and (plan["n_splits"] == 1) == (max_splits == 1)
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    xq = cuda.to_device(np.full(xq_size(hq * 32, n_new, planes), 0xFFFF, np.uint16))
    A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d,
                           cuda.to_device(npos.astype(np.int32)), n_keys=150 + n_new, out=out, max_splits=max_splits,
                           xq_out=xq, xq_planes=planes)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, mask), rtol=2e-4, atol=2e-5)
    assert_same_form(xq.copy_to_host(), quantize_x_ref(got, planes), planes, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="xq_out"):
        A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta,
                               cache.pos_d, cuda.to_device(npos.astype(np.int32)), n_keys=150 + n_new, out=out,
                               xq_out=xq, xq_planes=3 - planes)


def test_decode_one_query_window_and_graph_grid():
    cache, q, kv, cpos, npos = setup(150, 1, d=32)
    one = np.ones((1, 1), bool)
    got = run(cache, q, npos, None, window=40)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, one, window=40), rtol=2e-4, atol=2e-5)
    plan = A.attention_plan(1, 4, 2, 32, cache.n_ctx)
    # 256 keys: a chunk a warp, 4 warps a block
    assert plan["warps"] == 4 and plan["chunk"] == A.DECODE_CHUNK
    assert plan["n_splits"] == A.decode_plan(2, cache.n_ctx, 4, plan["chunk"]) == 256 // (4 * plan["chunk"])
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d,
                           cuda.to_device(npos.astype(np.int32)), n_keys=cache.n_ctx, out=out)
    np.testing.assert_allclose(out.copy_to_host(), ref(q, kv, cpos, npos, one), rtol=2e-4, atol=2e-5)


def test_decode_gemma3_shape_window_graph_grid_int8_out():
    """Gemma 3's decode attention: head dim 256 (2 warps a block, 4 query dims a thread),
    4 q heads a kv head (more rows than warps: the block merges a row a warp in two trips
    and leaves the splits to the combine kernel), a 32-token sliding window, a grid sized
    for the whole cache, and the output's int8 form from the combine."""
    from luce.kernels.quantize_x import quantize_x_ref, xq_size
    from tests.test_quantize_x import assert_same_form
    d, hq, hkv, planes = 256, 4, 1, 2
    cache, q, kv, cpos, npos = setup(120, 1, hq=hq, hkv=hkv, d=d)
    plan = A.attention_plan(1, hq, hkv, d, cache.n_ctx)
    assert plan["kind"] == "row" and plan["warps"] == 2 and not plan["self_merge"] and plan["n_splits"] > 1
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    xq = cuda.to_device(np.full(xq_size(hq * d, 1, planes), 0xFFFF, np.uint16))
    A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d,
                           cuda.to_device(npos.astype(np.int32)), window=32, n_keys=cache.n_ctx, out=out, xq_out=xq,
                           xq_planes=planes)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, np.ones((1, 1), bool), window=32), rtol=2e-4, atol=2e-5)
    assert_same_form(xq.copy_to_host(), quantize_x_ref(got.reshape(1, -1), planes), planes, rtol=1e-5, atol=1e-6)


def run_in_graph_grid(cache, q, npos):
    """Decode over the keys present in a grid sized for the whole cache (as a captured graph
    runs it), the split scratch NaN-filled: (output, the splits' (m, l), splits)."""
    ns = A.attention_plan(1, q.shape[1], cache.k_pool.shape[2], q.shape[2], cache.n_ctx)["n_splits"]
    scratch = (cuda.to_device(np.full((ns,) + q.shape, np.nan, np.float32)),
               cuda.to_device(np.full((ns,) + q.shape[:2] + (2,), np.nan, np.float32)))
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d,
                           cuda.to_device(npos.astype(np.int32)), n_keys=cache.n_ctx, out=out, scratch=scratch)
    return out.copy_to_host(), scratch[1].copy_to_host(), ns


@pytest.mark.parametrize("n_ctx,warps,used", [(39, None, 1), (99, 2, 2)])
def test_decode_graph_grid_with_empty_splits(monkeypatch, n_ctx, warps, used):
    # keys in a grid sized for 256 (chunks of 32): the splits past the last chunk neither
    # write nor count, and the merge waits on and reads only the used ones (the scratch is
    # NaN, so a read of an empty split's partials would reach the output); one used split
    # writes the output directly
    monkeypatch.setattr(A, "DECODE_CHUNK", 32)
    if warps:
        monkeypatch.setattr(A, "DECODE_MAX_WARPS", warps)
    cache, q, kv, cpos, npos = setup(n_ctx, 1, d=32)
    got, ml, ns = run_in_graph_grid(cache, q, npos)
    assert ns > used
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, np.ones((1, 1), bool)), rtol=2e-4, atol=2e-5)
    assert np.isnan(ml[used:]).all()
    if used > 1:
        assert (ml[:used, 0, :, 1] > 0).all()
    else:
        assert np.isnan(ml).all()


# The same kernel for several queries (verification trees and chains) in tiles of
# row_tile queries; not the default for them (ROW_KERNEL_MAX_QUERIES: slower on the H200),
# so one case here (group 4: three tiles of 2 queries, the last partial, under a tree mask);
# windows, direct writes and chains of the same code run in the one-query tests.
@pytest.mark.parametrize("kind,n_new,hq,hkv,window,max_splits", [("tree", 5, 4, 1, None, None)])
def test_row_kernel_several_queries(monkeypatch, kind, n_new, hq, hkv, window, max_splits):
    monkeypatch.setattr(A, "ROW_KERNEL_MAX_QUERIES", 64)
    assert A._row_kernel_applies(n_new, 32, False, hq // hkv)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3][:n_new]) if kind == "tree" else np.arange(-1, n_new - 1)
    depth = np.zeros(n_new, int)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    mask = tree_mask(parents)
    cache, q, kv, cpos, npos = setup(90, n_new, hq=hq, hkv=hkv, d=32, new_pos=90 + depth)
    got = run(cache, q, npos, mask if kind == "tree" else None, window=window, max_splits=max_splits)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, mask, window=window), rtol=2e-4, atol=2e-5)


def test_tree():
    parents = np.array([-1, 0, 0, 1, 1, 2, 3])
    depth = np.zeros(7, int)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    mask = tree_mask(parents)
    cache, q, kv, cpos, npos = setup(70, 7, hq=4, hkv=1, new_pos=70 + depth)  # GQA group of 4: 28 rows
    got = run(cache, q, npos, mask)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, mask), rtol=2e-4, atol=2e-5)


def test_tree_combine_writes_the_o_projections_fragments():
    """A tree over several splits with frags_out: the combine also writes the output's
    matvec_mma fragments of both layouts, the bits x_frags makes of the output (padding rows
    to 8 zeros, though the buffers held garbage), and the output is unchanged; a plan with
    no combine refuses frags_out."""
    from luce.kernels import matvec_mma as M
    parents = np.array([-1, 0, 0, 1, 2])
    depth = np.array([0, 1, 1, 2, 2])
    hq, d = 4, 64  # rows of 256 columns: one fragment block
    cache, q, kv, cpos, npos = setup(70, 5, hq=hq, hkv=1, d=d, new_pos=70 + depth)
    bits = cuda.to_device(tree_mask_bits(tree_mask(parents)))
    plan = A.attention_plan(5, hq, 1, d, cache.n_ctx, max_splits=2)
    assert A.combines(plan), plan
    fr = M.frags_targets(5, hq * d)
    for qt in fr:
        fr[qt][0].copy_to_device(np.full(fr[qt][0].shape, 0x7C01, np.uint16))  # f16 NaN: unwritten shows
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d,
                           cuda.to_device(npos.astype(np.int32)), bits, n_keys=cache.n_ctx, out=out, max_splits=2,
                           frags_out=(fr[T.Q4_K][0], fr[T.Q6_K][0]))
    got = {qt: f[0].copy_to_host() for qt, f in fr.items()}
    o = out.copy_to_host()
    np.testing.assert_allclose(o, ref(q, kv, cpos, npos, tree_mask(parents)), rtol=2e-4, atol=2e-5)
    for qt in got:
        want = M.x_frags(cuda.to_device(o.reshape(5, hq * d)), qt, guard=False)[0].copy_to_host()
        np.testing.assert_array_equal(got[qt], want)
    with pytest.raises(ValueError, match="no combine"):
        A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta,
                               cache.pos_d, cuda.to_device(npos.astype(np.int32)), bits, n_keys=cache.n_ctx,
                               max_splits=1, frags_out=(fr[T.Q4_K][0], fr[T.Q6_K][0]))


@pytest.mark.parametrize("window", [None, 20])
def test_prefill_causal(window):
    # no committed rows: the chain's causal mask runs across a page boundary; 2 query tiles
    # (one head: the simulated mma is slow, and head indexing is covered elsewhere)
    cache, q, kv, cpos, npos = setup(0, 70, hq=1, hkv=1)
    got = run(cache, q, npos, None, window)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, causal_mask(70), window), rtol=2e-4, atol=2e-5)


def test_chunked_prefill_window_skips_pages():
    # 140 committed rows, window 30: the first pages are skipped outright, the rest masked
    cache, q, kv, cpos, npos = setup(140, 4, hq=2, hkv=1)
    got = run(cache, q, npos, None, 30)
    np.testing.assert_allclose(got, ref(q, kv, cpos, npos, causal_mask(4), 30), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("n_new", [5, 1])  # a tree; one query (the tiled kernel, not decode's f16 one)
def test_q8_0_kv(n_new):
    """q8_0 pools are dequantized tile by tile (to f16) inside the kernel: compared with
    attention_ref over the rows the cache itself returns (quantized, dequantized)."""
    from luce.kernels.paging import dequantize_q8_0_ref, quantize_q8_0_ref
    d8, hkv, hq = 32, 1, 2
    cache = PagedKVCache(1, 256, hkv, d8, dtype="q8_0", device=True)
    k, v = rng.standard_normal((2, 70 + n_new, hkv, d8)).astype(np.float32)
    cache.reserve(70)
    cache.write(0, k[:70], v[:70], np.arange(70))
    cache.commit()
    cache.reserve(n_new)
    cache.write(0, k[70:], v[70:], np.arange(70, 70 + n_new))
    q = rng.standard_normal((n_new, hq, d8)).astype(np.float32)
    mask = tree_mask(np.array([-1, 0, 0, 1, -1][:n_new]))
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    attention_cache_cuda(cache, 0, cuda.to_device(q), cuda.to_device(np.arange(70, 70 + n_new, dtype=np.int32)),
                         cuda.to_device(tree_mask_bits(mask)), out=out)
    kc, vc, _ = cache.committed(0)
    qd = lambda a: dequantize_q8_0_ref(*quantize_q8_0_ref(a))
    want = attention_ref(q, kc, vc, qd(k[70:]), qd(v[70:]), mask)
    # the tile holds f16 copies of d * q: ~5e-4 relative rounding on top of f32 math
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=3e-3, atol=2e-3)


def test_attention_op_matches_cpu_ops():
    """attention_op_cuda over a device PagedKVCache = the CPU backend's attention over a
    KVCache, for a prefill chain, a tree forward and a commit of the tree's path."""
    from luce.backends.cpu import NumpyOps
    from luce.kv.cache import KVCache
    hq, hkv, n_ctx = 1, 1, 256  # one head: the simulated mma is slow, and head indexing is covered elsewhere
    ref = KVCache(1, n_ctx, hkv, D, dtype=np.float16)
    dev = PagedKVCache(1, n_ctx, hkv, D, device=True)
    # the grid is planned for the whole context, as for a captured graph
    steps = [(66, None, np.arange(66)),
             (5, tree_mask(np.array([-1, 0, 0, 1, 2])), 66 + np.array([0, 1, 1, 2, 2]))]
    for n, mask, pos in steps:
        q = rng.standard_normal((n, hq, D)).astype(np.float32)
        k = rng.standard_normal((n, hkv, D)).astype(np.float16)
        v = rng.standard_normal((n, hkv, D)).astype(np.float16)
        ref.reserve(n)
        dev.reserve(n)
        full = causal_mask(n) if mask is None else mask
        want = NumpyOps.attention(ref, 0, q, k.astype(np.float32), v.astype(np.float32), pos, full, None)
        got = A.attention_op_cuda(dev, 0, cuda.to_device(q), k, v, pos, mask, None, n_keys=n_ctx).copy_to_host()
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
        acc = None if mask is None else [0, 2, 4]
        ref.commit(acc)
        dev.commit(acc)
    for a, b in zip(dev.committed(0), ref.committed(0)):
        np.testing.assert_array_equal(a, b)


def test_graph_sized_grid():
    """A grid planned for the whole context (as a captured graph is) over a shorter one:
    the kernel spreads the pages present over the splits, idle splits are skipped."""
    cache, q, kv, cpos, npos = setup(70, 3, hq=2, hkv=1)
    mask = tree_mask(np.array([-1, 0, -1]))
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    assert A.attention_plan(3, 2, 1, D, cache.n_ctx)["n_splits"] == 4
    A.paged_attention_cuda(cuda.to_device(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d,
                           cuda.to_device(npos.astype(np.int32)), cuda.to_device(tree_mask_bits(mask)),
                           n_keys=cache.n_ctx, out=out)
    np.testing.assert_allclose(out.copy_to_host(), ref(q, kv, cpos, npos, mask), rtol=2e-4, atol=2e-5)


# ---------------------------------------------------------------- GPU code generation
# The simulator never compiles the GPU path (warp-shuffle reductions, register tiles,
# shared-memory views). When libNVVM is installed, compile every kernel of norm, rope,
# activation, elementwise, embedding, sampling, paging and attention to sm_90 PTX in a subprocess
# without the simulator (no GPU or driver needed); without libNVVM (the dev extra installs it) the check fails.
PTX_CHECK = r'''
import os, re, sys
from numba import cuda
from luce.kernels import activation, attention, elementwise, embedding, norm, paging, qk_rope, quantize_x, rope, sampling

def ptx(kernel, sig):
    return cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))[0]

F2, F3, I1 = "float32[:, ::1]", "float32[:, :, ::1]", "int32[::1]"
P5 = lambda t: t + "[:, :, :, :, ::1]"
# rms_norm's widest rows at each block size fit that block's register budget without
# spilling (a fixed 16-element row buffer a thread needed more than the 64 registers of a
# 1024-thread block, and the launch failed on the H200); also its Gemma form (a pre-norm
# and the int8 output) at Gemma 3's widths
from luce.kernels.ptx import ptxas_usage
for d, pre_q in [(128, False), (4096, False), (5120, False), (8192, False), (16384, False), (2560, True),
                 (5376, True)]:
    vpt, nt = norm.norm_shape(d)
    code = cuda.compile_ptx(norm._rms_norm_kernel(vpt, nt, pre_q, pre_q).py_func,
                            f"void({F2}, {F2}, float32[::1], {F2}, {F2}, float32, int64, float32[::1], uint8[::1], "
                            "float32[::1], int64)", cc=(9, 0), launch_bounds=nt)[0]
    use = ptxas_usage(code)
    assert "shfl.sync" in code and use["registers"] * nt <= 65536, (d, vpt, nt, use)
    assert use["spill_bytes"] == 0 or d > 8192, (d, vpt, nt, use)
# kernels launched with large blocks: warp shuffles, and registers that fit the block
# (compiled without a launch bound, as the wrappers launch them), or every launch fails
for k, sig, threads in [(sampling._argmax_kernel, f"void({F2}, {I1}, {F2}, int32[:, ::1], {I1})",
                         sampling.ARGMAX_THREADS),
                        (activation._softmax_kernel, f"void({F2}, {F2})", 256),
                        (sampling._topk_kernel, f"void({F2}, int32[:, ::1], int64, int64, int64, {F2}, int32[:, ::1])", 256),
                        *[(attention._combine(128, p, w, fr), f"void(float32[:, :, :, ::1], float32[:, :, :, ::1], "
                           f"int64, {I1}, {F3}, uint8[::1], float32[::1], uint16[::1], uint16[::1])", 32 * w)
                          for p, fr in ((0, False), (2, False), (0, True))
                          for w in (attention.COMBINE_WARPS, attention.COMBINE_MAX_WARPS)],
                        (sampling._sample_kernels(sampling.SAMPLE_RUN)[1],
                         f"void({F2}, int64, uint64[::1], float64[::1], {I1}, int32[:, ::1], {I1})",
                         sampling.SAMPLE_THREADS),
                        (quantize_x._quantize_kernel, "void(float32[::1], uint8[::1], float32[::1], int64, int64)",
                         quantize_x.THREADS),
                        (quantize_x._norm_quantize_kernel, "void(float32[::1], float32[::1], float32[::1], "
                         "uint8[::1], float32[::1], int64, float32, int64)", quantize_x.THREADS)]:
    code = ptx(k, sig)
    use = ptxas_usage(code)
    assert use["registers"] * threads <= 65536, (k, threads, use)
    assert "shfl.sync" in code or k is sampling._sample_kernels(sampling.SAMPLE_RUN)[1], k
for k, sig in [(rope._rope_kernel, f"void({F3}, {I1}, float64[::1], int64, int64)"),
               (elementwise._axpby_kernel, "void(float32[::1], float32[::1], float32, float32, float32[::1])"),
               *[(qk_rope._kernel(w), f"void({F3}, {F3}, {I1}, float32[::1], float32[::1], int64, float32, "
                                      f"float64[::1], int64, int64, {F3}, {P5('float16')}, {P5('float16')}, {I1}, "
                                      f"int64, {I1}, {I1})") for w in (False, True)],
               (activation._glu_kernel, "void(float32[::1], float32[::1], float32[::1], int64)"),
               (embedding._embed_kernel, f"void(float16[:, ::1], {I1}, {F2})"),
               (embedding._gather_rows_u16_kernel, f"void(uint16[:, ::1], {I1}, uint16[:, ::1])"),
               (sampling._sample_kernels(sampling.SAMPLE_RUN)[0],
                f"void({F2}, int64, uint64[::1], float64[::1], int32[:, ::1])"),
               (sampling._penalty_kernel, f"void({F2}, {I1}, {I1}, float32, float32, float32)"),
               (paging._write_kernel, f"void({P5('float16')}, {P5('float16')}, {I1}, int64, {I1}, {F3}, {F3}, {I1}, {I1})"),
               (paging._write_q8_kernel, f"void({P5('int8')}, {P5('float16')}, {P5('int8')}, {P5('float16')}, {I1}, "
                                         f"int64, {I1}, {F3}, {F3}, {I1}, {I1})"),
               (paging._gather_kernel, f"void({P5('float16')}, {I1}, int64, int64, float16[:, :, ::1])"),
               (paging._compact_kernel, f"void({P5('float16')}, {P5('float16')}, {I1}, {I1}, {I1}, int64, int64, {I1}, int64)")]:
    ptx(k, sig)
for dim, qt, q8 in [(128, 4, False), (128, 32, False), (64, 64, False), (256, 8, False), (128, 4, True)]:
    sc = "float16" if q8 else "uint32"
    sig = (f"void({F3}, {P5('uint32')}, {P5('uint32')}, {P5(sc)}, {P5(sc)}, {I1}, int64, {I1}, {I1}, {I1}, "
           f"uint64[::1], int64, int64, float32, int64, {F3}, float32[:, :, :, ::1], float32[:, :, :, ::1])")
    code = ptx(attention._attn_kernel(dim, qt, 128, q8), sig)
    assert ".local" not in code or qt == 64, (dim, qt, q8)  # accumulators stay in registers
for dim, group, qt, mask, chunk, xq, rope in [
        (128, 4, 1, I1, 32, 0, False), (128, 8, 1, I1, 16, 0, False), (64, 3, 1, I1, 32, 0, False),
        (256, 2, 1, I1, 32, 0, False), (128, 4, 2, "uint64[::1]", 32, 0, False),
        (128, 2, 4, "uint64[::1]", 32, 0, False), (128, 4, 2, I1, 32, 0, False), (128, 4, 1, I1, 8, 0, False),
        (128, 4, 1, I1, 16, 2, False), (128, 4, 1, I1, 16, 1, False), (96, 4, 1, I1, 16, 0, False),
        (192, 2, 1, I1, 16, 0, False), (128, 4, 1, I1, 16, 2, True), (128, 8, 1, I1, 16, 2, True)]:
    sig = (f"void({F3}, uint16[::1], uint16[::1], {I1}, int64, int64, {I1}, {I1}, {I1}, {mask}, int64, int64, "
           f"float32, int64, {F3}, float32[:, :, :, ::1], float32[:, :, :, ::1], {I1}, uint8[::1], float32[::1], "
           f"{F3}, {F3}, float32[::1], float32[::1], int64, float32, float64[::1], int64, int64)")
    attention.DECODE_CHUNK = chunk
    code = ptx(attention._decode_kernel(dim, group, qt, *attention.decode_shape(dim, qt * group), xq_planes=xq,
                                        rope=rope), sig)
    # registers only; K and V rows by cp.async, K read back 16 bytes at a time
    assert "cp.async" in code and "ld.shared.v4.u32" in code and ".local" not in code, (dim, group, qt)
    # merges its splits, in float32 (the rope variant's angles alone in float64, as qk_rope's)
    assert "atom.global.add" in code and (".f64" not in code or rope), (dim, group, qt)
    # shared memory by 32-bit shared-window addresses, none converted from a generic one
    assert "cvta.to.shared" not in code, (dim, group, qt)
from luce.kernels import attention_mma
for dim, warps, half, qsh in [(128, 4, False, False), (128, 6, False, False), (64, 5, False, False),
                              (32, 8, False, False), (128, 1, True, False), (128, 6, False, True),
                              (64, 3, False, True)]:
    sig = (f"void({F3}, uint16[::1], uint16[::1], {I1}, int64, int64, {I1}, {I1}, {I1}, uint64[::1], int64, "
           f"int64, float32, int64, {F3}, float32[:, :, :, ::1], float32[:, :, :, ::1])")
    code = ptx(attention_mma.kernel(dim, warps, half, qsh=qsh), sig)
    # registers only, tensor cores, async copies, and no float64 (a float64 softmax once cost ~7x)
    assert ".local" not in code and "mma.sync" in code and "cp.async" in code and ".f64" not in code, (dim, warps)
    assert "cvta.to.shared" not in code, (dim, warps)
    # Q read back from shared memory with 16-byte loads
    assert not qsh or "ld.shared.v4.u32" in code and "st.shared.v4.u32" in code, (dim, warps)
print("PTX OK")
'''


ptx_check = background_ptx_check(PTX_CHECK)


def test_gpu_kernels_compile_to_ptx(ptx_check):
    assert_ptx_ok(ptx_check)


@pytest.mark.parametrize("d", [16, 80])  # not multiples of 32: a lane's last dim may be past the head's
def test_combine_splits_skips_empty_splits(d):
    """The split combine against a numpy merge of random partials: splits with l = 0 (no
    key seen: past the context, or wholly outside a window) hold NaN accumulators that
    must not reach the output, wherever they lie among the used ones."""
    n_splits, n_q, hq = 11, 2, 3
    part_o = rng.standard_normal((n_splits, n_q, hq, d)).astype(np.float32)
    m = rng.standard_normal((n_splits, n_q, hq)).astype(np.float32)
    ell = rng.uniform(0.5, 3.0, (n_splits, n_q, hq)).astype(np.float32)
    empty = np.zeros(n_splits, bool)
    empty[[1, 4, 9, 10]] = True
    ell[empty] = 0.0
    m[empty] = -np.inf
    part_o[empty] = np.nan
    part_ml = np.stack([m, ell], axis=-1)
    w = np.where(ell > 0, np.exp(m - m.max(axis=0)), 0.0)
    want = np.einsum("sqh,sqhd->qhd", w, np.nan_to_num(part_o)) / (w * ell).sum(axis=0)[..., None]
    out = cuda.to_device(np.full((n_q, hq, d), np.nan, np.float32))
    A.combine_splits(cuda.to_device(part_o), cuda.to_device(part_ml), n_splits,
                     cuda.to_device(np.array([5, n_q], np.int32)), out)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=2e-5, atol=2e-6)


# Decode with qk_rope's work inside the kernel (paged_attention_cuda's rope, what the CUDA
# backend's decode runs): q and the new k as the projections leave them, the new token's
# K/V row never written before the launch (its pool row NaN). The output against the
# reference over qk_rope_ref's q and k; the pool row, its position and every other row
# as write_kv_cuda would leave them. Both rotation styles, a partial rotary dim, with and
# without the norm, a sliding window, the new key in a chunk of its own or mid-chunk, no
# context at all (a one-token prompt), split (the last block merges; with 8 q heads a kv
# head the combine kernel) or direct.
@pytest.mark.parametrize("style,rope_dim,norm,n_ctx,window,max_splits,hq,hkv", [
    ("halves", 32, True, 150, None, None, 4, 2), ("adjacent", 32, False, 64, None, 1, 4, 2),
    ("halves", 16, True, 95, 40, None, 4, 2), ("adjacent", 16, True, 31, None, 2, 4, 2),
    ("halves", 32, True, 0, None, None, 4, 2), ("halves", 32, True, 70, None, None, 8, 1)])
def test_decode_with_rope_in_the_kernel(style, rope_dim, norm, n_ctx, window, max_splits, hq, hkv):
    check_decode_with_rope(style, rope_dim, norm, n_ctx, window, max_splits, hq, hkv, 32)


def check_decode_with_rope(style, rope_dim, norm, n_ctx, window, max_splits, hq, hkv, d, capacity=256):
    """The test above for any shape (tests/gpu/test_kernels_gpu.py: the Qwen3 shapes at 8K)."""
    from luce.kernels.paging import BLOCK
    from luce.kernels.qk_rope import qk_rope_ref
    cache, _, (kc, vc, _, _), cpos, _ = setup(n_ctx, 0, hq=hq, hkv=hkv, d=d, capacity=capacity)
    cache.reserve(1)  # the new row: NaN in the pool until the kernel writes it
    npos = np.array([n_ctx + 7], np.int32)  # positions need not be row numbers
    q = (2 * rng.standard_normal((1, hq, d))).astype(np.float32)
    k = rng.standard_normal((1, hkv, d)).astype(np.float32)
    v = rng.standard_normal((1, hkv, d)).astype(np.float32)
    qw = rng.uniform(0.5, 1.5, d).astype(np.float32) if norm else None
    kw = rng.uniform(0.5, 1.5, d).astype(np.float32) if norm else None
    dev = lambda a: None if a is None else cuda.to_device(a)  # noqa: E731
    assert A.rope_fuses(1, hq, hkv, d, capacity)
    ra = A.rope_args(dev(k), dev(v), dev(qw), dev(kw), 1e-6, rope_dim, 1e6, style)
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    A.paged_attention_cuda(dev(q), cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d,
                           dev(npos), window=window or 0, n_keys=capacity, out=out, max_splits=max_splits, rope=ra)
    rq, rk = qk_rope_ref(q, k, npos, qw, kw, 1e-6, rope_dim, 1e6, style)
    kn, vn = rk.astype(np.float16), v.astype(np.float16)
    want = ref(rq, (kc, vc, kn, vn), cpos, npos, np.ones((1, 1), bool), window)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=2e-4, atol=2e-5)
    # the pool: the new row as write_kv_cuda stores it (k rounded from within float32
    # rounding of the reference: compare in f16 steps), the context rows untouched
    table = cache.table_d.copy_to_host()
    kp, vp = cache.k_pool.copy_to_host(), cache.v_pool.copy_to_host()
    slot, off = table[n_ctx // BLOCK], n_ctx % BLOCK
    np.testing.assert_allclose(kp[slot, 1, :, off].astype(np.float32), kn.astype(np.float32)[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(vp[slot, 1, :, off], vn[0])
    assert cache.pos_d.copy_to_host()[n_ctx] == npos[0]
    rows = np.arange(n_ctx)
    np.testing.assert_array_equal(kp[table[rows // BLOCK], 1, :, rows % BLOCK], kc)
    np.testing.assert_array_equal(vp[table[rows // BLOCK], 1, :, rows % BLOCK], vc)
    with pytest.raises(ValueError, match="rope"):  # verification's queries take qk_rope's launch
        A.paged_attention_cuda(dev(np.zeros((2, hq, d), np.float32)), cache.k_pool, cache.v_pool, cache.table_d, 1,
                               cache.meta, cache.pos_d, dev(np.zeros(2, np.int32)), n_keys=n_ctx + 2, rope=ra)
