"""The paged KV cache against the contiguous KVCache, for both of its storages:
device=False runs the numpy paging references, device=True the CUDA kernels (here in
the simulator: write, gather, compaction through shared memory, evict/restore on a side
stream with pinned buffers). tests/gpu/test_kernels_gpu.py repeats the device case at
Qwen3-8B shapes on a GPU."""
import numpy as np
import pytest

from luce.kernels.paging import BLOCK, dequantize_q8_0_ref, quantize_q8_0_ref
from luce.kv.cache import KVCache
from luce.kv.paged import PagedKVCache

rng = np.random.default_rng()
L, H, D = 2, 2, 16


def forward(caches, n, pos0=None):
    """Reserve n rows and write random K/V for every layer into each cache."""
    n_past = caches[0].n_past
    pos = np.arange(n_past, n_past + n) if pos0 is None else pos0
    for c in caches:
        c.reserve(n)
    for layer in range(L):
        k = rng.standard_normal((n, H, D)).astype(np.float16)
        v = rng.standard_normal((n, H, D)).astype(np.float16)
        for c in caches:
            c.write(layer, k, v, pos)


def same(ref: KVCache, paged: PagedKVCache):
    assert paged.n_past == ref.n_past
    for layer in range(L):
        rk, rv, rp = ref.committed(layer)
        pk, pv, pp = paged.committed(layer)
        np.testing.assert_array_equal(pk.view(np.uint16), rk.view(np.uint16))
        np.testing.assert_array_equal(pv.view(np.uint16), rv.view(np.uint16))
        np.testing.assert_array_equal(pp, rp)


@pytest.fixture(params=[False, True], ids=["numpy", "device"])
def caches(request):
    n_ctx = 3 * BLOCK + 10
    return KVCache(L, n_ctx, H, D, dtype=np.float16), PagedKVCache(L, n_ctx, H, D, device=request.param)


class Q8Ref(KVCache):
    """KVCache holding what a q8_0 cache returns: rows quantized and dequantized."""

    def write(self, layer, k_new, v_new, positions):
        super().write(layer, dequantize_q8_0_ref(*quantize_q8_0_ref(k_new)),
                      dequantize_q8_0_ref(*quantize_q8_0_ref(v_new)), positions)


def test_q8_0_twins():
    """q8_0 pools: device quantization is bit-exact with the numpy twin (ggml rounding),
    commit/truncate/evict/restore move values and scales together."""
    n_ctx = 3 * BLOCK + 10
    D8 = 64
    ref = Q8Ref(L, n_ctx, H, D8, dtype=np.float32)
    twins = [PagedKVCache(L, n_ctx, H, D8, dtype="q8_0", device=dev) for dev in (False, True)]
    cs = [ref] + twins

    def fwd(n):
        base = ref.n_past
        for c in cs:
            c.reserve(n)
        for layer in range(L):
            k, v = rng.standard_normal((2, n, H, D8)).astype(np.float32)
            k[0, 0, :32] = 0.0  # an all-zero group: scale 0
            for c in cs:
                c.write(layer, k, v, np.arange(base, base + n))

    fwd(BLOCK + 3)
    for c in cs:
        c.commit()
    fwd(7)
    for c in cs:
        c.commit([1, 4, 6])
    twins[1].evict()
    twins[1].restore()
    twins[1].wait()
    for t in twins:
        assert t.n_past == ref.n_past
        for layer in range(L):
            for a, b in zip(t.committed(layer), ref.committed(layer)):
                np.testing.assert_array_equal(a, b)


def test_write_commit_across_blocks(caches):
    ref, paged = caches
    forward(caches, BLOCK - 3)  # prefill ending just before a block boundary
    for c in caches:
        c.commit()
    same(ref, paged)
    # a tree of 9 nodes straddling the boundary; accept a path that skips rows
    forward(caches, 9, pos0=np.array([61, 62, 62, 63, 63, 64, 64, 65, 66]))
    for c in caches:
        c.commit([0, 2, 4, 6, 8])
    same(ref, paged)
    forward(caches, 5)
    for c in caches:
        c.commit([3])  # only a later row survives
    same(ref, paged)
    assert paged.blocks_in_use == -(-paged.n_past // BLOCK)


def test_long_increasing_commit(caches):
    ref, paged = caches
    forward(caches, 10)
    for c in caches:
        c.commit()
    forward(caches, 150)
    acc = np.sort(rng.choice(150, 90, replace=False))
    for c in caches:
        c.commit(acc)
    same(ref, paged)


def test_truncate_and_reuse(caches):
    ref, paged = caches
    forward(caches, 140)
    for c in caches:
        c.commit()
    for c in caches:
        c.truncate(70)
    assert paged.blocks_in_use == 2
    forward(caches, 30)
    for c in caches:
        c.commit()
    same(ref, paged)


def test_evict_restore_bit_exact(caches):
    ref, paged = caches
    forward(caches, 150)
    for c in caches:
        c.commit()
    before = [paged.committed(layer) for layer in range(L)]
    evicted = paged.evict()
    assert evicted == [0, 1, 2] and paged.blocks_in_use == 0
    paged.synchronize()
    garbage = np.full(paged.k_pool.shape, np.nan, np.float16)
    if paged.device:
        paged.k_pool.copy_to_device(garbage)
        paged.v_pool.copy_to_device(garbage)
    else:
        paged.k_pool[:] = garbage
        paged.v_pool[:] = garbage
    paged.restore([2, 0, 1])  # other slots than before
    paged.wait()
    paged.synchronize()
    for layer in range(L):
        for a, b in zip(before[layer], paged.committed(layer)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    forward(caches, 4)
    for c in caches:
        c.commit([1, 3])
    same(ref, paged)


def test_errors(caches):
    _, paged = caches
    with pytest.raises(ValueError):
        paged.reserve(paged.n_ctx + 1)
    forward(caches, 4)
    for c in caches:  # both caches refuse a row the last forward did not write
        for bad in ([4], [-1, 0]):
            with pytest.raises(IndexError):
                c.commit(bad)
