"""Prefill matmul (luce.kernels.matmul) on a real GPU at real shapes against the numpy
reference: the tensor-core path (mma.sync + ldmatrix inline asm) for every type at
Qwen3-8B projection shapes, the 32-bit-fragment and single-buffer variants, the FMA path,
tails, f16 activations and the fused epilogues.

Run: NUMBA_ENABLE_CUDASIM=0 python -m pytest -m gpu tests/gpu/test_matmul_gpu.py

Tolerance: X and W are rounded to f16 before the product (2^-11 relative each; W's f16x2
decode adds at most 2^-10 of |s q| + |o|) and accumulation is f32, so every output is held
to |y - ref| <= 2^-8 * (|X| @ |W|^T), ref being the float64 product of the numpy
dequantization. The reference covers a random subset of the rows (all columns) to keep
the CPU side short.
"""
import numpy as np
import pytest
from numba import cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(cuda.config.ENABLE_CUDASIM) or not cuda.is_available(),
                       reason="needs a GPU: NUMBA_ENABLE_CUDASIM=0"),
]

from luce.bench.kernels_matmul import random_weight  # noqa: E402
from luce.kernels.dequant import dequantize  # noqa: E402
from luce.kernels.matmul import matmul, matmul_ref  # noqa: E402

rng = np.random.default_rng()


def run(qtype, m, n, k, x_dtype=np.float32, bias=False, residual=False, rows=48, **kw):
    x = rng.standard_normal((m, k)).astype(x_dtype)
    w = random_weight(qtype, n, k, rng)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((m, n)).astype(np.float32) if residual else None
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))
    matmul(cuda.to_device(x), cuda.to_device(w), qtype, n, k, out=out,
           bias=None if b is None else cuda.to_device(b), residual=None if r is None else cuda.to_device(r), **kw)
    y = out.copy_to_host()
    assert not np.isnan(y).any(), f"{np.isnan(y).sum()} outputs unwritten"
    sel = np.sort(rng.choice(m, size=min(rows, m), replace=False))
    sel[-1] = m - 1  # the last row tile's edge
    ref = matmul_ref(x[sel], w, qtype, (n, k), bias=b, residual=None if r is None else r[sel])
    bound = np.abs(x[sel].astype(np.float32)) @ np.abs(dequantize(w, qtype, (n, k))).T
    err = np.abs(y[sel] - ref)
    bad = err > 2.0 ** -8 * bound + 1e-6
    assert not bad.any(), f"{qtype}: {bad.sum()} outputs off, worst {err.max()}"
    return err.max() / np.abs(ref).max()


@pytest.mark.parametrize("qtype,k,n", [("Q4_K", 4096, 12288), ("Q6_K", 12288, 4096), ("Q8_0", 4096, 4096),
                                       ("Q4_0", 4096, 4096), ("F16", 4096, 4096)])
def test_mma_real_shapes(qtype, k, n):
    run(qtype, 512, n, k)


@pytest.mark.parametrize("tile,min_blocks", [
    ((128, 128, 32, 64, 32, "lds", 2), None),   # 32-bit fragment loads; fewer W units than threads
    ((128, 128, 32, 64, 32, "ldsm", 2), 2),     # register-capped for two blocks per SM
    ((128, 128, 64, 32, 64, "ldsm", 1), None),
    ((64, 128, 64, 32, 64, "ldsm", 1), None),
])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_mma_tile_variants(tile, min_blocks, qtype):
    run(qtype, 300, 1000, 2048, tile=tile, min_blocks=min_blocks)


def test_mma_x_converted_in_kernel():
    run("Q4_K", 200, 1024, 4096, x_convert=False)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_fma_path_tails(qtype):
    run(qtype, 100, 1000, 2048, use_mma=False)


def test_f16_x_epilogues_tails():
    run("Q4_K", 77, 3000, 4096, x_dtype=np.float16, bias=True, residual=True)


def test_residual_in_place():
    m, n, k = 64, 512, 1024
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = random_weight("Q8_0", n, k, rng)
    r = rng.standard_normal((m, n)).astype(np.float32)
    dr = cuda.to_device(r)
    matmul(cuda.to_device(x), cuda.to_device(w), "Q8_0", n, k, out=dr, residual=dr)
    ref = matmul_ref(x, w, "Q8_0", (n, k), residual=r)
    bound = np.abs(x) @ np.abs(dequantize(w, "Q8_0", (n, k))).T
    assert (np.abs(dr.copy_to_host() - ref) <= 2.0 ** -8 * bound + 1e-6).all()
