"""RMSNorm, RoPE, GLU activations, a x + b y, softmax and embedding gather: CUDA kernels against
their numpy references.

These run in the CUDA simulator (tests/conftest.py) and so cover the shared-memory
reduction path of luce.kernels._reduce with one-warp blocks; the warp-shuffle path and
real block sizes are covered by tests/gpu/test_kernels_gpu.py.
"""
import numpy as np
import pytest
from numba import cuda

from luce.kernels.activation import geglu_ref, glu_cuda, softmax_cuda, softmax_ref, swiglu_ref
from luce.kernels.elementwise import axpby_cuda, axpby_ref
from luce.kernels.embedding import embed_cuda, embed_quant_cuda, embed_ref
from luce.kernels.norm import rms_norm_cuda, rms_norm_ref
from luce.kernels.rope import rope_cuda, rope_ref
from luce.models.config import ROPE_ADJACENT, ROPE_HALVES

rng = np.random.default_rng()


def nan_out(shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


@pytest.mark.parametrize("shape", [(3, 96), (2, 3, 16)])
def test_rms_norm(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    out = nan_out(shape)
    rms_norm_cuda(cuda.to_device(x), cuda.to_device(w), 1e-6, out=out)
    np.testing.assert_allclose(out.copy_to_host(), rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_rms_norm_fused_residual():
    x = rng.standard_normal((3, 80)).astype(np.float32)
    r = rng.standard_normal((3, 80)).astype(np.float32)
    w = rng.standard_normal(80).astype(np.float32)
    dx, out = cuda.to_device(x), nan_out(x.shape)
    rms_norm_cuda(dx, cuda.to_device(w), 1e-5, out=out, residual=cuda.to_device(r))
    np.testing.assert_allclose(dx.copy_to_host(), x + r, rtol=1e-6)
    np.testing.assert_allclose(out.copy_to_host(), rms_norm_ref(x + r, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", [ROPE_ADJACENT, ROPE_HALVES])
@pytest.mark.parametrize("rope_dim", [16, 12])
def test_rope(style, rope_dim):
    x = rng.standard_normal((3, 2, 16)).astype(np.float32)
    pos = rng.integers(0, 9000, 3).astype(np.int32)
    dx = cuda.to_device(x)
    rope_cuda(dx, cuda.to_device(pos), rope_dim, 1e6, style)
    np.testing.assert_allclose(dx.copy_to_host(), rope_ref(x, pos, rope_dim, 1e6, style), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,ref", [("swiglu", swiglu_ref), ("geglu", geglu_ref)])
def test_glu(kind, ref):
    g = (3 * rng.standard_normal((2, 50))).astype(np.float32)
    u = rng.standard_normal((2, 50)).astype(np.float32)
    out = nan_out(g.shape)
    glu_cuda(cuda.to_device(g), cuda.to_device(u), kind, out=out)
    np.testing.assert_allclose(out.copy_to_host(), ref(g, u), rtol=1e-5, atol=1e-6)


def test_softmax():
    x = (4 * rng.standard_normal((3, 100))).astype(np.float32)
    x[1, 7] = -np.inf
    out = nan_out(x.shape)
    softmax_cuda(cuda.to_device(x), out=out)
    np.testing.assert_allclose(out.copy_to_host(), softmax_ref(x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_embed(dtype):
    table = rng.standard_normal((50, 40)).astype(dtype)
    tok = rng.integers(0, 50, 5).astype(np.int32)
    out = nan_out((5, 40))
    embed_cuda(cuda.to_device(table), cuda.to_device(tok), out=out)
    np.testing.assert_array_equal(out.copy_to_host(), embed_ref(table, tok))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_embed_quantized(qtype):
    # raw GGUF rows with finite f16 scales; the table stays quantized on the device
    from luce.kernels.dequant import dequantize
    from luce.kernels.quant_types import as_qtype, block_bytes, block_elems, row_bytes
    n_cols, vocab = 256, 12
    nb = vocab * n_cols // block_elems(qtype)
    blocks = rng.integers(0, 256, (nb, block_bytes(qtype)), dtype=np.uint8)
    for off in {"Q8_0": (0,), "Q4_K": (0, 2)}[qtype]:
        d = (rng.uniform(0.01, 2.0, nb) * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    raw = blocks.reshape(vocab, row_bytes(qtype, n_cols))
    tok = rng.integers(0, vocab, 3).astype(np.int32)
    out = nan_out((3, n_cols))
    embed_quant_cuda(cuda.to_device(raw), as_qtype(qtype), n_cols, cuda.to_device(tok), out=out)
    want = embed_ref(dequantize(raw, as_qtype(qtype), (vocab, n_cols)), tok)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-6, atol=1e-6)


def test_axpby():
    """a x + b y into a poisoned buffer, in place into x (the residual add), and with b = 0
    (a scale: y is not read, so NaNs there do not matter)."""
    x = rng.standard_normal((3, 40)).astype(np.float32)
    y = rng.standard_normal((3, 40)).astype(np.float32)
    out = nan_out(x.shape)
    axpby_cuda(cuda.to_device(x), cuda.to_device(y), 0.5, -2.0, out=out)
    np.testing.assert_allclose(out.copy_to_host(), axpby_ref(x, y, 0.5, -2.0), rtol=1e-6, atol=1e-6)
    xd = cuda.to_device(x)
    axpby_cuda(xd, cuda.to_device(y), 1.0, 1.0, out=xd)
    np.testing.assert_array_equal(xd.copy_to_host(), x + y)
    nan_y = cuda.to_device(np.full_like(x, np.nan))
    got = axpby_cuda(cuda.to_device(x), nan_y, 25.3, 0.0).copy_to_host()
    np.testing.assert_array_equal(got, axpby_ref(x, np.zeros_like(x), 25.3, 0.0))
    with pytest.raises(ValueError, match="sizes"):
        axpby_cuda(cuda.to_device(x), cuda.to_device(y[:2]), 1.0, 1.0)
