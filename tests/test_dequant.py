"""numpy dequantization against gguf-py's independent implementation (gguf.quants)."""
import time

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from luce.kernels.dequant import SUPPORTED_TYPES, dequantize, row_bytes
from luce.kernels.quant_types import block_bytes, block_elems

# Byte offsets of the f16 scales inside one block; everything else is payload.
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}


def random_tensor(rng, qtype, shape) -> np.ndarray:
    """Random bytes of a `shape` tensor whose float fields are finite."""
    n = int(np.prod(shape))
    if qtype == T.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = n // block_elems(qtype)
    blocks = rng.integers(0, 256, (nb, block_bytes(qtype)), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        # Normal f16 magnitudes with both signs: kernels that flush subnormals agree too.
        d = (rng.uniform(0.01, 2.0, nb) * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(-1)


def abs_terms(raw, qtype, shape) -> np.ndarray:
    """|scale * q| + |min| per weight: what an f16 decode's rounding is relative to. Where
    the two terms cancel (w near 0) it is far larger than |w|, so error bounds of products
    whose weights are decoded in f16 take this, not |w|. Each block is decoded once with its
    min zeroed and once with its scale zeroed; types without a min give |w|."""
    fields = F16_FIELDS.get(qtype, ())
    if len(fields) < 2:
        return np.abs(dequantize(raw.reshape(-1), qtype, shape))
    blocks = raw.reshape(-1, block_bytes(qtype))
    total = 0
    for off in fields:
        part = blocks.copy()
        part[:, off:off + 2] = 0
        total = total + np.abs(dequantize(part.reshape(-1), qtype, shape))
    return total


def reference(raw, qtype, shape):
    rows = int(np.prod(shape[:-1]))
    return gguf.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(shape)


def test_supported_types():
    assert SUPPORTED_TYPES == frozenset({
        T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
        T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=int), ids=lambda q: q.name)
def test_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    qk = block_elems(qtype)
    for shape in [(qk,), (3, 2 * qk), (2, 3, 4 * qk), (17, 1024 if qk <= 256 else qk)]:
        raw = random_tensor(rng, qtype, shape)
        got = dequantize(raw, qtype, shape)
        assert got.dtype == np.float32 and got.shape == shape
        want = reference(raw, qtype, shape)
        assert np.isfinite(want).all()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16])
def test_typed_input(qtype):
    rng = np.random.default_rng(1)
    raw = random_tensor(rng, qtype, (4, 8))
    typed = raw.view({T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[qtype]).reshape(4, 8)
    np.testing.assert_array_equal(dequantize(typed, qtype, (4, 8)), dequantize(raw, qtype, (4, 8)))


def test_memmap_input(tmp_path):
    rng = np.random.default_rng(2)
    raw = random_tensor(rng, T.Q4_K, (4, 512))
    path = tmp_path / "t.bin"
    raw.tofile(path)
    mm = np.memmap(path, np.uint8, "r")
    np.testing.assert_array_equal(dequantize(mm, T.Q4_K, (4, 512)), reference(raw, T.Q4_K, (4, 512)))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q4_0, T.Q6_K])
def test_wrong_size_raises(qtype):
    qk = block_elems(qtype)
    good = np.zeros(2 * row_bytes(qtype, qk), np.uint8)
    dequantize(good, qtype, (2, qk))
    for bad in (good[:-1], np.zeros(good.size + 1, np.uint8)):
        with pytest.raises(ValueError):
            dequantize(bad, qtype, (2, qk))
    if qk > 1:
        with pytest.raises(ValueError):  # row not a whole number of blocks
            dequantize(good, qtype, (1, 2 * qk + 1))


def test_row_bytes():
    assert row_bytes(T.Q4_K, 4096) == 16 * 144
    assert row_bytes(T.Q8_0, 64) == 68
    assert row_bytes(T.F16, 3) == 6
    with pytest.raises(ValueError):
        row_bytes(T.Q6_K, 100)


def test_large_tensor_is_fast():
    """Whole-block numpy ops: 16M Q4_K elements well under a second on a laptop core."""
    raw = random_tensor(np.random.default_rng(3), T.Q4_K, (4096, 4096))
    t0 = time.perf_counter()
    out = dequantize(raw, T.Q4_K, (4096, 4096))
    elapsed = time.perf_counter() - t0
    assert out.shape == (4096, 4096)
    assert elapsed < 5.0, elapsed
