"""Dequantization and matvec kernels on a real GPU at model shapes.

Run with: NUMBA_ENABLE_CUDASIM=0 pytest -m gpu tests/gpu/test_dequant_matvec_gpu.py -s
These cover what the simulator cannot: the ld.global.nc.v4 inline-asm loads, the warp
shuffle reduction, f16/bf16 bit casts through LLVM, and timing (bench_matvec).
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for test_dequant
from tests.gpu.gpu_weights import ID, weights  # noqa: E402
from test_dequant import random_tensor  # noqa: E402

pytestmark = [pytest.mark.gpu]
if cuda.config.ENABLE_CUDASIM or not cuda.is_available():
    pytestmark.append(pytest.mark.skip(reason="needs a CUDA GPU (NUMBA_ENABLE_CUDASIM=0)"))

from luce.kernels.dequant import SUPPORTED_TYPES, dequantize, dequantize_device  # noqa: E402
from luce.kernels.matvec import bench_matvec, matvec, matvec_ref, swiglu, swiglu_ref  # noqa: E402

SHAPES = [(4096, 12288), (12288, 4096)]  # (rows N, columns K)
MV_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16]


def check(got, want, raw, qtype, x, tol=5e-5):
    assert np.isfinite(got).all()
    w = np.abs(dequantize(raw, qtype, (raw.shape[0], x.shape[-1])))
    bound = np.abs(x) @ w.T
    err = np.abs(got - want)
    assert (err <= tol * bound + 1e-5).all(), float((err / (bound + 1e-30)).max())


@pytest.mark.parametrize("shape", SHAPES, ids=ID)
@pytest.mark.parametrize("qtype", MV_TYPES, ids=ID)
def test_matvec_gpu(qtype, shape):
    n_rows, n_cols = shape
    raw = weights(qtype, n_rows, n_cols)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n_cols).astype(np.float32)
    out = cuda.to_device(np.full(n_rows, np.nan, np.float32))
    matvec(cuda.to_device(raw), qtype, cuda.to_device(x), out=out)
    check(out.copy_to_host(), matvec_ref(raw, qtype, x), raw, qtype, x)


@pytest.mark.parametrize("nr", [2, 8, 23, 64])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.BF16], ids=ID)
def test_matvec_batched_gpu(qtype, nr):
    n_rows, n_cols = 4096, 4096
    raw = weights(qtype, n_rows, n_cols)
    rng = np.random.default_rng(nr)
    x = rng.standard_normal((nr, n_cols)).astype(np.float32)
    bias = rng.standard_normal(n_rows).astype(np.float32)
    res = rng.standard_normal((nr, n_rows)).astype(np.float32)
    out = cuda.to_device(np.full((nr, n_rows), np.nan, np.float32))
    matvec(cuda.to_device(raw), qtype, cuda.to_device(x), out=out, bias=cuda.to_device(bias),
           residual=cuda.to_device(res))
    check(out.copy_to_host(), matvec_ref(raw, qtype, x, bias=bias, residual=res), raw, qtype, x)


def test_matvec_unaligned_x_gpu():
    """x starting off a 16-byte boundary is copied before the 16-byte loads."""
    raw = weights(T.Q4_K, 4096, 4096)
    x = np.random.default_rng(2).standard_normal(4097).astype(np.float32)
    x_dev = cuda.to_device(x)[1:]
    out = matvec(cuda.to_device(raw), T.Q4_K, x_dev)
    check(out.copy_to_host(), matvec_ref(raw, T.Q4_K, x[1:]), raw, T.Q4_K, x[1:])


@pytest.mark.parametrize("offset", [4, 2])
def test_matvec_unaligned_weight_gpu(offset):
    """A tensor inside a larger device buffer, off a 16-byte boundary: narrower staging loads."""
    raw = weights(T.Q4_K, 4096, 4096)
    buf = cuda.to_device(np.concatenate([np.zeros(offset, np.uint8), raw.reshape(-1)]))
    x = np.random.default_rng(4).standard_normal(4096).astype(np.float32)
    out = matvec(buf[offset:], T.Q4_K, cuda.to_device(x))
    check(out.copy_to_host(), matvec_ref(raw, T.Q4_K, x), raw, T.Q4_K, x)


@pytest.mark.parametrize("rows_per_warp", [1, 3])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=ID)
def test_matvec_rows_per_warp_gpu(qtype, rows_per_warp):
    raw = weights(qtype, 4096, 12288)
    x = np.random.default_rng(5).standard_normal(12288).astype(np.float32)
    out = matvec(cuda.to_device(raw), qtype, cuda.to_device(x), rows_per_warp=rows_per_warp)
    check(out.copy_to_host(), matvec_ref(raw, qtype, x), raw, qtype, x)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.BF16], ids=ID)
def test_swiglu_gpu(qtype):
    n_rows, n_cols = 12288, 4096
    rng = np.random.default_rng(3)
    g = random_tensor(rng, qtype, (n_rows, n_cols)).reshape(n_rows, -1)
    u = random_tensor(rng, qtype, (n_rows, n_cols)).reshape(n_rows, -1)
    x = (0.01 * rng.standard_normal(n_cols)).astype(np.float32)
    out = swiglu(cuda.to_device(g), cuda.to_device(u), qtype, cuda.to_device(x))
    want = swiglu_ref(g, u, qtype, x)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=int), ids=ID)
def test_dequantize_device_gpu(qtype):
    n_rows, n_cols = 4096, 4096
    raw = weights(qtype, n_rows, n_cols)
    out = dequantize_device(cuda.to_device(raw), qtype, (n_rows, n_cols))
    want = dequantize(raw, qtype, (n_rows, n_cols))
    # The GPU may fuse s * q + o into one FMA: not bit-exact against numpy.
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_bench_matvec_gpu():
    rows = bench_matvec([(4096, 12288), (12288, 4096)], [T.Q4_K, T.Q6_K, T.Q8_0, T.BF16], iters=20)
    rows += bench_matvec([(4096, 4096)], [T.Q4_K], batch=8, iters=20)
    rows += bench_matvec([(12288, 4096)], [T.Q4_K], glu=True, iters=20)
    rows += bench_matvec([(4096, 12288)], [T.Q4_K], rows_per_warp=1, iters=20)
    for r in rows:
        print(json.dumps(r))
        assert r["time_us"] > 0 and r["GB/s"] > 0
