"""The CUDA kernels of norm/rope/activation/embedding/sampling/paging/attention on a real
GPU at real shapes (Qwen3-8B: 32 q heads, 8 kv heads, head_dim 128, 8K context, a tree of
23 nodes) against the numpy references.

Run: NUMBA_ENABLE_CUDASIM=0 python -m pytest -m gpu tests/gpu/test_kernels_gpu.py
These are the only tests that run the warp-shuffle reductions (luce.kernels._reduce),
128..1024-thread blocks, head_dim 64/128/256 attention tiles with 128 threads, q8_0 KV
at 8K and the 8K-context split counts; the simulator tests (tests/kernels/) run the same
code with shared-memory reductions, one-warp blocks and small shapes, and
tests/kernels/test_attention.py::test_gpu_kernels_compile_to_ptx compiles the GPU paths.
The paged-cache test uses 4 layers (real heads and head_dim) to keep host memory small.
"""
import numpy as np
import pytest
from numba import cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cuda.config.ENABLE_CUDASIM) or not cuda.is_available(),
                       reason="needs a GPU: NUMBA_ENABLE_CUDASIM=0"),
]

from luce.kernels.activation import geglu_ref, glu_cuda, softmax_cuda, softmax_ref, swiglu_ref  # noqa: E402
from luce.kernels.attention import (attention_cache_cuda, attention_ref, causal_mask, tree_mask,  # noqa: E402
                                    tree_mask_bits)
from luce.kernels.elementwise import axpby_cuda, axpby_ref  # noqa: E402
from luce.kernels.embedding import embed_cuda, embed_quant_cuda, embed_ref  # noqa: E402
from luce.kernels.norm import rms_norm_cuda, rms_norm_ref  # noqa: E402
from luce.kernels.rope import rope_cuda, rope_ref  # noqa: E402
from luce.kernels.sampling import (apply_penalties_cuda, apply_penalties_ref, argmax_cuda, argmax_ref,  # noqa: E402
                                   sample_cuda, sample_params, sample_ref, token_counts, topk_cuda, topk_ref)
from luce.kv.paged import PagedKVCache  # noqa: E402
from luce.models.config import ROPE_ADJACENT, ROPE_HALVES  # noqa: E402

rng = np.random.default_rng()
HQ, HKV, D, CTX, TREE, VOCAB = 32, 8, 128, 8192, 23, 151936


def nan_out(shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def randn(*shape, dtype=np.float32, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def test_rms_norm_fused_residual():
    x, r, w = randn(TREE, 4096), randn(TREE, 4096), randn(4096)
    dx, out = cuda.to_device(x), nan_out(x.shape)
    rms_norm_cuda(dx, cuda.to_device(w), 1e-6, out=out, residual=cuda.to_device(r))
    np.testing.assert_allclose(dx.copy_to_host(), x + r, rtol=1e-6)
    np.testing.assert_allclose(out.copy_to_host(), rms_norm_ref(x + r, w, 1e-6), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows,d,planes", [(1, 2560, 2), (5, 5376, 1), (23, 640, None)])  # Gemma 3 4B / 27B / 270M
def test_rms_norm_post_norm_residual(rows, d, planes):
    """Gemma's residual step and the next norm in one launch (pre_weight), with the output's
    int8 form where asked, against the numpy references at model widths."""
    from luce.kernels.norm import post_norm_residual_ref
    from luce.kernels.quantize_x import quantize_x_ref, xq_size
    from test_quantize_x import assert_same_form
    y, x = randn(rows, d, scale=20.0), randn(rows, d)
    w_post, w_next = (rng.uniform(0.2, 2.0, d).astype(np.float32) for _ in range(2))
    dx, out = cuda.to_device(x), nan_out((rows, d))
    xq = None if planes is None else cuda.to_device(np.full(xq_size(d, rows, planes), 0xFFFF, np.uint16))
    rms_norm_cuda(cuda.to_device(y), cuda.to_device(w_next), 1e-6, out=out, residual=dx, residual_out=dx,
                  pre_weight=cuda.to_device(w_post), xq=xq, planes=planes or 1)
    want_x, want_h = post_norm_residual_ref(y, x, w_post, w_next, 1e-6)
    np.testing.assert_allclose(dx.copy_to_host(), want_x, rtol=1e-5, atol=1e-5)
    h = out.copy_to_host()
    np.testing.assert_allclose(h, want_h, rtol=1e-4, atol=1e-5)
    if planes is not None:
        assert_same_form(xq.copy_to_host(), quantize_x_ref(h, planes), planes, rtol=1e-5, atol=1e-5)


def test_rms_norm_per_head():
    x, w = randn(TREE, HQ, D), randn(D)
    out = nan_out(x.shape)
    rms_norm_cuda(cuda.to_device(x), cuda.to_device(w), 1e-6, out=out)
    np.testing.assert_allclose(out.copy_to_host(), rms_norm_ref(x, w, 1e-6), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("style", [ROPE_ADJACENT, ROPE_HALVES])
def test_rope(style):
    x = randn(TREE, HQ, D)
    pos = np.concatenate([np.arange(CTX, CTX + 20), rng.integers(0, 40000, TREE - 20)]).astype(np.int32)
    dx = cuda.to_device(x)
    rope_cuda(dx, cuda.to_device(pos), D, 1e6, style)
    np.testing.assert_allclose(dx.copy_to_host(), rope_ref(x, pos, D, 1e6, style), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["halves", "adjacent"])
def test_qk_rope(style):
    """Fused per-head norm + RoPE of q and k at the Qwen3-8B shape, 5 tokens past 8K."""
    from luce.kernels.qk_rope import qk_rope_cuda, qk_rope_ref
    q, k = randn(5, HQ, D, scale=3), randn(5, HKV, D)
    pos = np.arange(8190, 8195).astype(np.int32)
    qw, kw = randn(D) + 1, randn(D) + 1
    dq, dk = cuda.to_device(q), cuda.to_device(k)
    qk_rope_cuda(dq, dk, cuda.to_device(pos), cuda.to_device(qw), cuda.to_device(kw), 1e-6, D, 1e6, style)
    wq, wk = qk_rope_ref(q, k, pos, qw, kw, 1e-6, D, 1e6, style)
    np.testing.assert_allclose(dq.copy_to_host(), wq, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(dk.copy_to_host(), wk, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("n", [1, TREE])
def test_qk_rope_kv_write(n):
    """qk_rope storing the new K (roped) and V rows (LUCE_FUSED_KV_WRITE) at the Qwen3-8B
    shape past 8K: the pool and positions bit for bit what qk_rope then write_kv_cuda store."""
    from luce.kernels.paging import write_kv_cuda
    from luce.kernels.qk_rope import qk_rope_cuda
    q, k, v = randn(n, HQ, D, scale=3), randn(n, HKV, D), randn(n, HKV, D)
    pos = np.arange(8190, 8190 + n).astype(np.int32)
    qw, kw = randn(D) + 1, randn(D) + 1
    got = []
    for fused in (True, False):
        cache = PagedKVCache(2, 8192 + 128, HKV, D, device=True)
        for pool in (cache.k_pool, cache.v_pool):
            pool.copy_to_device(np.zeros(pool.shape, np.float16))
        cache.reserve(8190)
        cache.commit()
        cache.reserve(n)
        dk, dv, dp = cuda.to_device(k), cuda.to_device(v), cuda.to_device(pos)
        write = (dv, cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d) if fused else None
        qk_rope_cuda(cuda.to_device(q), dk, dp, cuda.to_device(qw), cuda.to_device(kw), 1e-6, D, 1e6, "halves",
                     kv_write=write)
        if not fused:
            write_kv_cuda(cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, dk, dv, dp, cache.pos_d)
        got.append([a.copy_to_host() for a in (dk, cache.k_pool, cache.v_pool, cache.pos_d)])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind,ref", [("swiglu", swiglu_ref), ("geglu", geglu_ref)])
def test_glu(kind, ref):
    g, u = randn(TREE, 12288, scale=3), randn(TREE, 12288)
    out = nan_out(g.shape)
    glu_cuda(cuda.to_device(g), cuda.to_device(u), kind, out=out)
    np.testing.assert_allclose(out.copy_to_host(), ref(g, u), rtol=1e-5, atol=1e-5)


def test_axpby_residual_and_scale():
    """Gemma's post-norm residual add (512 tokens x 5376) and embedding scale."""
    x, y = randn(512, 5376), randn(512, 5376)
    out = nan_out(x.shape)
    axpby_cuda(cuda.to_device(x), cuda.to_device(y), 1.0, 1.0, out=out)
    np.testing.assert_array_equal(out.copy_to_host(), axpby_ref(x, y, 1.0, 1.0))
    xd = cuda.to_device(x)
    axpby_cuda(xd, xd, 73.3, 0.0, out=xd)
    np.testing.assert_allclose(xd.copy_to_host(), 73.3 * x, rtol=1e-6)


def test_softmax_vocab():
    x = randn(4, VOCAB, scale=5)
    out = nan_out(x.shape)
    softmax_cuda(cuda.to_device(x), out=out)
    np.testing.assert_allclose(out.copy_to_host(), softmax_ref(x), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_embed(dtype):
    table = randn(32000, 4096, dtype=dtype)
    tok = rng.integers(0, 32000, TREE).astype(np.int32)
    out = nan_out((TREE, 4096))
    embed_cuda(cuda.to_device(table), cuda.to_device(tok), out=out)
    np.testing.assert_array_equal(out.copy_to_host(), embed_ref(table, tok))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_embed_quantized(qtype):
    from luce.kernels.dequant import dequantize
    from luce.kernels.quant_types import as_qtype, block_bytes, block_elems, row_bytes
    qt, vocab, n_cols = as_qtype(qtype), 32000, 4096
    nb = vocab * n_cols // block_elems(qt)
    blocks = rng.integers(0, 256, (nb, block_bytes(qt)), dtype=np.uint8)
    for off in {"Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype]:
        d = (rng.uniform(0.01, 2.0, nb) * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    raw = blocks.reshape(vocab, row_bytes(qt, n_cols))
    tok = rng.integers(0, vocab, TREE).astype(np.int32)
    out = nan_out((TREE, n_cols))
    embed_quant_cuda(cuda.to_device(raw), qt, n_cols, cuda.to_device(tok), out=out)
    want = embed_ref(dequantize(raw[tok], qt, (TREE, n_cols)), np.arange(TREE))
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-6, atol=1e-6)


def test_argmax_and_penalties():
    x = randn(TREE, VOCAB, scale=4)
    x[3, 100] = x[3, VOCAB - 5] = 50.0  # a tie: the smaller id wins
    counts, recent = token_counts(rng.integers(0, VOCAB, 3000), VOCAB, 64)
    d = cuda.to_device(x)
    apply_penalties_cuda(d, cuda.to_device(counts), cuda.to_device(recent), 1.1, 0.3, 0.05)
    xp = apply_penalties_ref(x, counts, recent, 1.1, 0.3, 0.05)
    np.testing.assert_allclose(d.copy_to_host(), xp, rtol=1e-6, atol=1e-6)
    out = cuda.to_device(np.full(TREE, -7, np.int32))
    argmax_cuda(d, out=out)
    np.testing.assert_array_equal(out.copy_to_host(), argmax_ref(d.copy_to_host()))


@pytest.mark.parametrize("k", [64, 10, 1])
def test_topk_vocab(k):
    x = randn(TREE, VOCAB, scale=4)
    x[0, VOCAB // 3:VOCAB // 3 + 100] = 20.0  # ties beyond k
    ov, oi = cuda.to_device(np.full((TREE, k), np.nan, np.float32)), cuda.to_device(np.full((TREE, k), -7, np.int32))
    topk_cuda(cuda.to_device(x), k, ov, oi)
    rv, ri = topk_ref(x, k)
    np.testing.assert_array_equal(oi.copy_to_host(), ri)
    np.testing.assert_array_equal(ov.copy_to_host(), rv)


@pytest.mark.parametrize("k", [8, 1])
def test_topk_logsumexp_vocab(k):
    """The draft step's fused candidates at Qwen's vocabulary (75 blocks merged by the
    last): top-k, argmax and log-sum-exp as the references, three launches in a row."""
    from luce.kernels.sampling import logsumexp_ref, topk_logsumexp_cuda, topk_lse_scratch
    x = randn(2, VOCAB, scale=4)
    x[0, VOCAB // 3:VOCAB // 3 + 100] = 20.0  # ties beyond k
    x[1, : VOCAB // 2] = -np.inf
    d, scratch = cuda.to_device(x), topk_lse_scratch(2, VOCAB, k)
    for _ in range(3):
        ov, oi = cuda.to_device(np.full((2, k), np.nan, np.float32)), cuda.to_device(np.full((2, k), -7, np.int32))
        lz, am = cuda.to_device(np.full(2, np.nan)), cuda.to_device(np.full(2, -7, np.int32))
        topk_logsumexp_cuda(d, k, ov, oi, lz, am, scratch=scratch)
        rv, ri = topk_ref(x, k)
        np.testing.assert_array_equal(oi.copy_to_host(), ri)
        np.testing.assert_array_equal(ov.copy_to_host(), rv)
        np.testing.assert_array_equal(am.copy_to_host(), argmax_ref(x))
        np.testing.assert_allclose(lz.copy_to_host(), logsumexp_ref(x), rtol=0, atol=1e-5)


def test_sample_vocab():
    """The device draw at Qwen's vocabulary with 1024-thread blocks: rows of spread-out
    logits, a peaked row, and one with a block of equal logits at the top (ties beyond k)."""
    x = randn(4, VOCAB, scale=4)
    x[1, 1234] = 30.0
    x[2, VOCAB // 3:VOCAB // 3 + 100] = 20.0
    d = cuda.to_device(x)
    out = cuda.to_device(np.full(1, -7, np.int32))
    picks = set()
    for row in range(4):
        for case in [(0.8, 40, 0.95, 0.05), (1.5, 64, 1.0, 0.0), (0.7, 20, 0.8, 0.0), (1.0, 1, 1.0, 0.0)]:
            for u in (0.01, 0.5, 0.97, rng.random()):
                sp = sample_params(*case, u)
                sample_cuda(d, cuda.to_device(sp), out, row=row)
                got = int(out.copy_to_host()[0])
                assert got == sample_ref(x[row], sp), (row, case, u)
                picks.add(got)
    assert len(picks) > 10


def _fill(caches, layers, n, pos=None):
    n_past = caches[0].n_past
    pos = np.arange(n_past, n_past + n) if pos is None else pos
    for c in caches:
        c.reserve(n)
    for layer in range(layers):
        k, v = randn(n, HKV, D, dtype=np.float16), randn(n, HKV, D, dtype=np.float16)
        for c in caches:
            c.write(layer, k, v, pos)
    return pos


def test_paged_cache_device_vs_numpy():
    layers = 4
    dev = PagedKVCache(layers, CTX + 64, HKV, D, device=True)
    ref = PagedKVCache(layers, CTX + 64, HKV, D, device=False)
    _fill([dev, ref], layers, CTX - 10)
    for c in (dev, ref):
        c.commit()
    _fill([dev, ref], layers, TREE, pos=CTX - 10 + np.arange(TREE) // 3)  # straddles a block boundary
    acc = [i for i in (0, 2, 5, 9, 14, 22) if i < TREE]
    for c in (dev, ref):
        c.commit(acc)
    evicted = dev.evict(range(dev.max_blocks // 4, dev.max_blocks // 2))
    dev.synchronize()
    nan_block = np.full(dev.k_pool.shape[1:], np.nan, np.float16)
    for slot in dev.free:  # the freed slots are scrambled before the restore reuses them
        dev.k_pool[slot].copy_to_device(nan_block)
        dev.v_pool[slot].copy_to_device(nan_block)
    dev.restore(evicted[::-1])
    dev.wait()
    dev.synchronize()
    for layer in range(layers):
        for a, b in zip(dev.committed(layer), ref.committed(layer)):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _attention_case(n_ctx, n_new, mask, hq=HQ, hkv=HKV, dim=D, new_pos=None, window=None, xq_planes=0,
                    n_keys=None):
    cache = PagedKVCache(1, n_ctx + n_new + 64, hkv, dim, device=True)
    cache.k_pool.copy_to_device(np.full(cache.k_pool.shape, np.nan, np.float16))
    cache.v_pool.copy_to_device(np.full(cache.v_pool.shape, np.nan, np.float16))
    kc, vc = randn(n_ctx, hkv, dim, dtype=np.float16), randn(n_ctx, hkv, dim, dtype=np.float16)
    if n_ctx:
        cache.reserve(n_ctx)
        cache.write(0, kc, vc, np.arange(n_ctx))
        cache.commit()
    kn, vn = randn(n_new, hkv, dim, dtype=np.float16), randn(n_new, hkv, dim, dtype=np.float16)
    npos = np.arange(n_ctx, n_ctx + n_new) if new_pos is None else new_pos
    cache.reserve(n_new)
    cache.write(0, kn, vn, npos)
    q = randn(n_new, hq, dim, scale=2)
    out = nan_out(q.shape)
    bits = None if mask is None else cuda.to_device(tree_mask_bits(mask))
    xq = None
    if xq_planes:
        from luce.kernels.quantize_x import xq_size
        xq = cuda.to_device(np.full(xq_size(hq * dim, n_new, xq_planes), 0xFFFF, np.uint16))
    attention_cache_cuda(cache, 0, cuda.to_device(q), cuda.to_device(npos.astype(np.int32)), bits, window, out=out,
                         n_keys=n_keys, xq_out=xq, xq_planes=xq_planes or 1)
    full = causal_mask(n_new) if mask is None else mask
    want = attention_ref(q, kc.astype(np.float32), vc.astype(np.float32), kn.astype(np.float32),
                         vn.astype(np.float32), full, q_pos=npos, ctx_pos=np.arange(n_ctx), window=window)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    if xq_planes:  # the output's int8 form from the kernel's epilogue: quantize_x's of the output
        from luce.kernels.quantize_x import quantize_x_ref
        from tests.test_quantize_x import assert_same_form
        assert_same_form(xq.copy_to_host(), quantize_x_ref(got, xq_planes), xq_planes, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_new", [1, TREE])
def test_q8_0_kv_8k(n_new):
    from luce.kernels.paging import dequantize_q8_0_ref, quantize_q8_0_ref
    cache = PagedKVCache(1, CTX + 64, HKV, D, dtype="q8_0", device=True)
    k, v = randn(CTX + n_new, HKV, D), randn(CTX + n_new, HKV, D)
    cache.reserve(CTX)
    cache.write(0, k[:CTX], v[:CTX], np.arange(CTX))
    cache.commit()
    cache.reserve(n_new)
    cache.write(0, k[CTX:], v[CTX:], np.arange(CTX, CTX + n_new))
    q = randn(n_new, HQ, D, scale=2)
    mask = causal_mask(n_new)
    out = nan_out(q.shape)
    attention_cache_cuda(cache, 0, cuda.to_device(q), cuda.to_device(np.arange(CTX, CTX + n_new, dtype=np.int32)),
                         cuda.to_device(tree_mask_bits(mask)), out=out)
    kc, vc, _ = cache.committed(0)
    qd = lambda a: dequantize_q8_0_ref(*quantize_q8_0_ref(a))
    want = attention_ref(q, kc, vc, qd(k[CTX:]), qd(v[CTX:]), mask)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=3e-3, atol=2e-3)


def test_decode_8k():
    _attention_case(CTX, 1, np.ones((1, 1), bool))


def test_tree23_8k():
    parents = np.array([-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, TREE)])
    depth = np.zeros(TREE, int)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    _attention_case(CTX, TREE, tree_mask(parents), new_pos=CTX + depth)


def test_tree64_full_mask_word():
    _attention_case(1000, 64, tree_mask(np.arange(-1, 63)))


@pytest.mark.parametrize("window", [None, 1024])
def test_prefill_causal(window):
    _attention_case(0, 1500, None, window=window)


@pytest.mark.parametrize("dim,hq,hkv", [(64, 16, 2), (256, 8, 4), (96, 32, 32)])
def test_other_head_dims(dim, hq, hkv):
    _attention_case(3000, 5, causal_mask(5), hq=hq, hkv=hkv, dim=dim)
    _attention_case(200, 300, None, hq=hq, hkv=hkv, dim=dim, window=100)


@pytest.mark.parametrize("hq,n_ctx,window", [(32, CTX, None), (64, CTX, None), (32, 1000, None), (32, CTX, 1024)])
def test_decode_on_tensor_cores(monkeypatch, hq, n_ctx, window):
    """Decode on the tensor-core kernel (LUCE_DECODE_ATTN=mma) at the Qwen3-8B (4 q heads a
    kv head) and 32B (8) groups over 8K keys, a short context in an 8K grid and a window."""
    from luce.kernels import attention_mma as M
    monkeypatch.setattr(M, "DECODE", "mma")
    _attention_case(n_ctx, 1, np.ones((1, 1), bool), hq=hq, window=window, n_keys=CTX + 1)


def test_bench_attention_rows():
    from luce.bench.kernels_attention import bench_attention
    # the rows the asserts name: every variant compiles its own kernels (all of them ran
    # past a 400 s step on the H200)
    rows = bench_attention(reps=5, only="decode$,decode_shortplan$,decode_nosplit$,decode640_in_grid$,tree23$,"
                                        "tree23_640_in_grid$")
    names = [r["name"] for r in rows]
    # decode over 8K keys on tensor cores has a combine to time; as over a short context (the
    # one-query kernel) and over 640 keys it merges its splits itself
    assert names[:4] == ["attention_decode", "attention_decode_combine_only", "attention_decode_shortplan",
                         "attention_decode_nosplit"], names
    assert "attention_decode640_in_grid" in names and "attention_decode640_in_grid_combine_only" not in names
    assert "attention_tree23_640_in_grid_combine_only" in names
    assert "attention_tree23" in names and all(r["time_us"] > 0 for r in rows)


def test_bench_small_ops_rows():
    from luce.bench.kernels_small import bench_small_ops
    rows = bench_small_ops(tokens=(1,), reps=5)
    assert [r["name"].split()[0] for r in rows] == ["rms_norm", "qk_rope", "q/k", "next", "next", "next"]
    assert all(r["time_us"] > 0 for r in rows)


@pytest.mark.parametrize("dim,hq,hkv,n_ctx,window", [(64, 16, 2, 3000, None), (256, 8, 4, 701, None),
                                                     (128, 64, 8, 1000, 300), (128, 32, 8, 37, None),
                                                     (64, 9, 3, 530, None), (96, 32, 32, 900, None),
                                                     (192, 8, 2, 640, None)])
def test_decode_one_query(dim, hq, hkv, n_ctx, window):
    """The one-query kernel at other head dims and GQA groups (3: SmolLM2's, whose
    probabilities are read one at a time), a sliding window, and contexts ending mid-page:
    the pool is NaN outside the written rows, so a key past the end or outside the window
    that leaked into a sum would show."""
    _attention_case(n_ctx, 1, np.ones((1, 1), bool), hq=hq, hkv=hkv, dim=dim, window=window)


@pytest.mark.parametrize("bufs,max_warps", [((2, 1), 4), ((1,), 1)])
def test_decode_8k_other_shapes(monkeypatch, bufs, max_warps):
    """The decode kernel's other block shapes at 8K: two K/V buffers a warp (the next
    chunk copied while one is computed), and one warp a block (no merge)."""
    from luce.kernels import attention as A
    monkeypatch.setattr(A, "DECODE_BUFS", bufs)
    monkeypatch.setattr(A, "DECODE_MAX_WARPS", max_warps)
    test_decode_8k()


@pytest.mark.parametrize("chunk", [8, 16, 32])
@pytest.mark.parametrize("dim,hq,hkv,n_ctx,window", [(128, 32, 8, 8192, None), (128, 32, 8, 640, None),
                                                     (64, 9, 3, 530, 100), (256, 8, 4, 701, None)])
def test_decode_chunk_sizes(monkeypatch, chunk, dim, hq, hkv, n_ctx, window):
    """The decode kernel with 8, 16 or 32 keys a warp's step (4, 2 or 1 lanes a key, whose
    partial scores are summed by shuffles), at the 8B shape over 8K and 640 keys and at
    other head dims and groups, against the reference."""
    from luce.kernels import attention as A
    monkeypatch.setattr(A, "DECODE_CHUNK", chunk)
    _attention_case(n_ctx, 1, np.ones((1, 1), bool), hq=hq, hkv=hkv, dim=dim, window=window)


@pytest.mark.parametrize("hq,n_ctx,n_keys,planes", [(32, CTX, None, 2), (32, 640, CTX + 1, 2), (64, CTX, None, 2),
                                                     (64, 640, CTX + 1, 1), (32, 37, None, 2)])
def test_decode_int8_out(hq, n_ctx, n_keys, planes):
    """Decode attention storing its output's int8 form (LUCE_X8_OUT's "attn") at the 8B
    (its last block merges the splits) and 32B (8 q heads a kv head: the combine kernel
    does) shapes, over 8K keys, over 640 in a grid sized for 8K (a captured graph's), and
    over 38 keys (one split: the kernel writes the output directly)."""
    _attention_case(n_ctx, 1, np.ones((1, 1), bool), hq=hq, xq_planes=planes, n_keys=n_keys)


def test_tree23_8k_row_kernel(monkeypatch):
    """A 23-node tree over 8K through the one-query kernel's structure (tiles of queries;
    not yet the default for trees) against the reference."""
    from luce.kernels import attention as A
    monkeypatch.setattr(A, "ROW_KERNEL_MAX_QUERIES", 64)
    test_tree23_8k()




# Decode with qk_rope's work in the attention kernel (the CUDA backend's decode step) at the
# Qwen3-8B and Qwen3-32B shapes (4 and 8 q heads a kv head: the last block's merge, the
# combine kernel), in a grid sized for 8K, over 8K and over a short context.
@pytest.mark.parametrize("hq,hkv,n_ctx", [(32, 8, 8190), (32, 8, 600), (64, 8, 8190), (64, 8, 37)])
def test_decode_with_rope_in_the_kernel(hq, hkv, n_ctx):
    from tests.kernels.test_attention import check_decode_with_rope
    check_decode_with_rope("halves", 128, True, n_ctx, None, None, hq, hkv, 128, capacity=8192)
