"""Prefill matmul (luce.kernels.matmul) in the CUDA simulator on small shapes: the per-type
unit decoders and the f16 staging through the FMA path, the row/column tails and epilogues,
and one run of the tensor-core path with mma.sync and ldmatrix emulated. Real shapes and
the real mma instructions: tests/gpu/test_matmul_gpu.py.

Tolerance: X and W are rounded to f16 before the product (2^-11 relative each, W's f16x2
decode adds at most 2^-10 of |s q| + |o|), accumulation is f32, so every output is held to
|y - ref| <= 2^-8 * (|X| @ |W|^T), ref being the float64 product of the numpy dequantization.
"""
import numpy as np
import pytest
from numba import cuda

from luce.bench.synthetic import random_quant_rows
from luce.kernels.dequant import dequantize
from luce.kernels.matmul import MATMUL_TYPES, matmul, matmul_ref
from luce.kernels.quant_types import as_qtype

rng = np.random.default_rng()


def random_w(qtype, n, k):
    qtype = as_qtype(qtype)
    if qtype.name == "F16":
        return (0.05 * rng.standard_normal((n, k))).astype(np.float16).view(np.uint8)
    return random_quant_rows(qtype, n, k, rng)


def check(y, x, w, qtype, n, k, bias=None, residual=None):
    ref = matmul_ref(x, w, qtype, (n, k), bias=bias, residual=residual)
    bound = np.abs(x.astype(np.float32)) @ np.abs(dequantize(w, qtype, (n, k))).T
    assert not np.isnan(y).any(), "unwritten outputs"
    err = np.abs(y - ref)
    bad = err > 2.0 ** -8 * bound + 1e-6
    assert not bad.any(), f"{bad.sum()} outputs off, worst {err.max()} (bound {bound[bad].min()})"


def run(qtype, m, n, k, x_dtype=np.float32, bias=False, residual=False, **kw):
    x = rng.standard_normal((m, k)).astype(x_dtype)
    w = random_w(qtype, n, k)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((m, n)).astype(np.float32) if residual else None
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))
    matmul(cuda.to_device(x), cuda.to_device(w), qtype, n, k, out=out,
           bias=None if b is None else cuda.to_device(b), residual=None if r is None else cuda.to_device(r), **kw)
    check(out.copy_to_host(), x, w, qtype, n, k, bias=b, residual=r)


def test_types_listed():
    assert {"Q4_K", "Q6_K", "Q8_0", "Q4_0", "F16"} <= {t.name for t in MATMUL_TYPES}


@pytest.mark.parametrize("qtype,k", [("Q4_K", 256), ("Q6_K", 256), ("Q8_0", 128), ("Q4_0", 128), ("F16", 128)])
def test_matmul_fma(qtype, k):
    run(qtype, 16, 32, k)  # two K steps at least; odd and even rows (block alignment parities)


def test_matmul_tails_epilogue_f16_x():
    # M and N not multiples of the 16 x 32 tile; f16 activations; bias and residual fused
    run("Q8_0", 20, 40, 64, x_dtype=np.float16, bias=True, residual=True)


def test_matmul_mma_emulated():
    # BK=32: fewer W units than threads (the guarded case); X goes through to_f16 first
    run("Q4_K", 16, 32, 256, use_mma=True, tile=(16, 32, 32, 16, 16, "ldsm"))


def test_matmul_rejects_bad_shapes():
    x = cuda.to_device(np.zeros((4, 100), np.float32))
    with pytest.raises(ValueError):
        matmul(x, cuda.to_device(np.zeros((8, 100 // 32 * 34), np.uint8)), "Q8_0", 8, 100)
    with pytest.raises(NotImplementedError):
        matmul(x, cuda.to_device(np.zeros(8, np.uint8)), "Q2_K", 8, 256)
