"""The fused per-head RMSNorm + RoPE of q and k (luce.kernels.qk_rope) against the numpy
reference (rms_norm_ref then rope_ref), in the CUDA simulator: both rotation styles, a
partial rotary dim, with and without the norm, GQA (fewer k heads), positions past 8K.
The GPU check at the Qwen3-8B shape is in tests/gpu/test_kernels_gpu.py."""
import numpy as np
import pytest
from numba import cuda

from luce.kernels.qk_rope import qk_rope_cuda, qk_rope_ref
from luce.kernels.rope import rope_ref

rng = np.random.default_rng()


@pytest.mark.parametrize("style,rope_dim,norm", [("halves", 32, True), ("adjacent", 32, False), ("halves", 16, True),
                                                 ("adjacent", 16, True)])
def test_qk_rope_matches_reference(style, rope_dim, norm):
    n, hq, hkv, d = 3, 4, 2, 32
    q = (2 * rng.standard_normal((n, hq, d))).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    pos = rng.integers(0, 9000, n).astype(np.int32)
    qw = rng.uniform(0.5, 1.5, d).astype(np.float32) if norm else None
    kw = rng.uniform(0.5, 1.5, d).astype(np.float32) if norm else None
    dq, dk = cuda.to_device(q), cuda.to_device(k)
    qk_rope_cuda(dq, dk, cuda.to_device(pos), None if qw is None else cuda.to_device(qw),
                 None if kw is None else cuda.to_device(kw), 1e-6, rope_dim, 1e6, style)
    wq, wk = qk_rope_ref(q, k, pos, qw, kw, 1e-6, rope_dim, 1e6, style)
    np.testing.assert_allclose(dq.copy_to_host(), wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk.copy_to_host(), wk, rtol=1e-5, atol=1e-5)


def test_linear_rope_scaling():
    """freq_scale (1 / a linear scaling factor) turns position p into p * freq_scale: the
    reference at 8p with scale 1/8 is the reference at p unscaled, and the kernels (qk_rope
    and rope) follow the reference."""
    from luce.kernels.rope import rope_cuda
    n, hq, hkv, d = 2, 2, 1, 32
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    pos = np.array([5, 1234], np.int32)
    np.testing.assert_allclose(rope_ref(q, 8 * pos, d, 1e6, "halves", freq_scale=0.125),
                               rope_ref(q, pos, d, 1e6, "halves"), rtol=1e-6, atol=1e-6)
    assert not np.allclose(rope_ref(q, pos, d, 1e6, "halves", freq_scale=0.125), rope_ref(q, pos, d, 1e6, "halves"))
    qw = rng.uniform(0.5, 1.5, d).astype(np.float32)
    dq, dk = cuda.to_device(q), cuda.to_device(k)
    qk_rope_cuda(dq, dk, cuda.to_device(pos), cuda.to_device(qw), cuda.to_device(qw), 1e-6, d, 1e6, "halves",
                 freq_scale=0.125)
    wq, wk = qk_rope_ref(q, k, pos, qw, qw, 1e-6, d, 1e6, "halves", freq_scale=0.125)
    np.testing.assert_allclose(dq.copy_to_host(), wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk.copy_to_host(), wk, rtol=1e-5, atol=1e-5)
    dk = cuda.to_device(k)
    rope_cuda(dk, cuda.to_device(pos), d, 1e6, "adjacent", freq_scale=0.125)
    np.testing.assert_allclose(dk.copy_to_host(), rope_ref(k, pos, d, 1e6, "adjacent", freq_scale=0.125),
                               rtol=1e-5, atol=1e-5)


def test_one_norm_weight_is_an_error():
    q = cuda.to_device(np.zeros((1, 2, 32), np.float32))
    with pytest.raises(ValueError):
        qk_rope_cuda(q, q, cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(np.ones(32, np.float32)), None,
                     1e-6, 32, 1e4, "halves")


def test_qk_rope_writes_the_pool_as_write_kv_does():
    """kv_write: the kv-head blocks store their roped k and the tokens' v (and positions) into
    the paged pool, bit for bit what qk_rope followed by write_kv_cuda stores; q and k as
    without it. Three tokens after 62 committed rows: the write crosses a page."""
    from luce.kernels.paging import write_kv_cuda
    from luce.kv.paged import PagedKVCache
    n, hq, hkv, d = 3, 4, 2, 32
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    pos = np.arange(62, 65, dtype=np.int32)
    qw, kw = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
    got = {}
    for fused in (True, False):
        cache = PagedKVCache(2, 256, hkv, d, device=True)
        for pool in (cache.k_pool, cache.v_pool):  # rows no write reaches compare equal
            pool.copy_to_device(np.zeros(pool.shape, np.float16))
        cache.reserve(62)
        cache.commit()
        cache.reserve(n)
        dq, dk, dp = cuda.to_device(q), cuda.to_device(k), cuda.to_device(pos)
        dv = cuda.to_device(v)
        write = (dv, cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, cache.pos_d) if fused else None
        qk_rope_cuda(dq, dk, dp, cuda.to_device(qw), cuda.to_device(kw), 1e-6, d, 1e6, "halves", kv_write=write)
        if not fused:
            write_kv_cuda(cache.k_pool, cache.v_pool, cache.table_d, 1, cache.meta, dk, dv, dp, cache.pos_d)
        got[fused] = [a.copy_to_host() for a in (dq, dk, cache.k_pool, cache.v_pool, cache.pos_d)]
    for a, b in zip(got[True], got[False]):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(got[True][2]).any() and (got[True][4][62:65] == pos).all()
