"""Device dequantization and matvec kernels against the numpy references, in the CUDA simulator.

Shapes are small (the simulator runs one OS thread per CUDA thread). In the simulator the
kernels take their fallback paths: 16-byte loads become plain indexing and warp sums go
through shared memory with block barriers (matvec.warp_sum's SIM branch); the shuffle
reduction and the inline-asm loads are covered by tests/gpu/test_dequant_matvec_gpu.py.
Outputs are poisoned with NaN so that any element a kernel fails to write fails the test.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import cuda

from luce.kernels.dequant import DEVICE_SPECS, SUPPORTED_TYPES, dequantize, dequantize_device, load_width, tile_step
from luce.kernels.matvec import MATVEC_TYPES, matvec, matvec_ref, swiglu, swiglu_ref
from luce.kernels.quant_types import row_bytes
from test_dequant import random_tensor
from tests.ptx_background import assert_ptx_ok, background_ptx_check

BY_VALUE = lambda q: int(q)  # noqa: E731
IDS = lambda q: q.name  # noqa: E731


def weights(rng, qtype, n_rows, n_cols):
    return random_tensor(rng, qtype, (n_rows, n_cols)).reshape(n_rows, -1)


def nan_device(shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def assert_close(got, want, raw, qtype, x):
    """Float32 sums against a float64 reference: error bounded by K eps |W| |x|."""
    assert np.isfinite(got).all()
    w = np.abs(dequantize(raw, qtype, (raw.shape[0], x.shape[-1]))).astype(np.float64)
    bound = np.abs(x).astype(np.float64).reshape(-1, x.shape[-1]) @ w.T
    np.testing.assert_array_less(np.abs(got - want).reshape(bound.shape), 1e-5 * bound + 1e-6)


def run_matvec(qtype, n_rows, n_cols, nr=None, bias=False, residual=False, tile_blocks=None, seed=0,
               rows_per_warp=None):
    rng = np.random.default_rng(seed)
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((nr, n_cols) if nr else n_cols).astype(np.float32)
    out_shape = (nr, n_rows) if nr else (n_rows,)
    b = rng.standard_normal(n_rows).astype(np.float32) if bias else None
    r = rng.standard_normal(out_shape).astype(np.float32) if residual else None
    out = nan_device(out_shape)
    ret = matvec(cuda.to_device(raw), qtype, cuda.to_device(x), out=out,
                 bias=None if b is None else cuda.to_device(b),
                 residual=None if r is None else cuda.to_device(r), tile_blocks=tile_blocks,
                 rows_per_warp=rows_per_warp)
    assert ret is out
    got = out.copy_to_host()
    assert_close(got, matvec_ref(raw, qtype, x, bias=b, residual=r), raw, qtype, x)


# ---------------------------------------------------------------- device dequantization
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=BY_VALUE), ids=IDS)
def test_dequantize_device(qtype):
    """Smallest legal tiles, so rows span several tiles and the last one is partial."""
    rng = np.random.default_rng(int(qtype))
    spec = DEVICE_SPECS[qtype]
    tb = tile_step(qtype)
    n_cols = spec.qk * (tb + 1) if spec.qk > 8 else 24 * spec.qk
    raw = weights(rng, qtype, 3, n_cols)
    out = nan_device((3, n_cols))
    dequantize_device(cuda.to_device(raw), qtype, (3, n_cols), out=out, tile_blocks=tb)
    np.testing.assert_array_equal(out.copy_to_host(), dequantize(raw, qtype, (3, n_cols)))


def test_dequantize_device_f16_out():
    rng = np.random.default_rng(5)
    raw = weights(rng, T.Q6_K, 2, 512)
    out = dequantize_device(cuda.to_device(raw), T.Q6_K, (2, 512), dtype=np.float16)
    assert out.dtype == np.float16 and tuple(out.shape) == (2, 512)
    np.testing.assert_array_equal(out.copy_to_host(), dequantize(raw, T.Q6_K, (2, 512)).astype(np.float16))


# ---------------------------------------------------------------- matvec
@pytest.mark.parametrize("qtype", sorted(MATVEC_TYPES, key=BY_VALUE), ids=IDS)
def test_matvec(qtype):
    """5 rows: the last warp of the first block has rows past the end."""
    run_matvec(qtype, 5, 512, seed=int(qtype))


@pytest.mark.parametrize("rows_per_warp", [1, 3])
def test_matvec_rows_per_warp(rows_per_warp):
    """7 rows: with 3 rows a warp, the last warp of the first block holds rows 9-11 (past the end)."""
    run_matvec(T.Q5_K, 7, 256, nr=2, bias=True, rows_per_warp=rows_per_warp)


@pytest.mark.parametrize("qtype,n_cols,tile_blocks", [
    (T.Q4_K, 768, 1),     # three single-block tiles
    (T.Q4_0, 320, 8),     # tiles of 8 + 2 blocks
    (T.Q6_K, 2304, 8),    # 8 + 1
    (T.F16, 96, 2),       # 6 pseudo-blocks of 8 in tiles of 2
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_multi_tile(qtype, n_cols, tile_blocks):
    run_matvec(qtype, 3, n_cols, tile_blocks=tile_blocks)


@pytest.mark.parametrize("qtype,n_cols,width", [
    (T.Q8_0, 32, 2), (T.Q8_0, 64, 4), (T.Q8_0, 256, 16),
    (T.Q6_K, 256, 2), (T.Q6_K, 512, 4), (T.Q5_0, 96, 2), (T.Q4_1, 128, 16),
], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_load_widths(qtype, n_cols, width):
    """Rows that are not 16-byte multiples fall back to 4- or 2-byte staging loads."""
    assert load_width(row_bytes(qtype, n_cols)) == width
    run_matvec(qtype, 4, n_cols)


@pytest.mark.parametrize("bias,residual", [(True, False), (False, True), (True, True)])
def test_matvec_epilogues(bias, residual):
    run_matvec(T.Q4_K, 4, 256, bias=bias, residual=residual)


@pytest.mark.parametrize("qtype,nr", [(T.Q4_0, 2), (T.Q6_K, 3), (T.BF16, 9), (T.Q4_K, 4)], ids=lambda v: getattr(v, "name", str(v)))
def test_matvec_batched(qtype, nr):
    """9 rows run in 16 compiled slots: the padding rows must not be written."""
    run_matvec(qtype, 3, 256, nr=nr, bias=True, residual=True)


# ---------------------------------------------------------------- fused SwiGLU
@pytest.mark.parametrize("qtype,nr", [(T.Q4_K, None), (T.Q8_0, None), (T.Q5_0, 2)], ids=lambda v: getattr(v, "name", str(v)))
def test_swiglu(qtype, nr):
    rng = np.random.default_rng(7)
    n_rows, n_cols = 5, 256
    g, u = weights(rng, qtype, n_rows, n_cols), weights(rng, qtype, n_rows, n_cols)
    x = (0.1 * rng.standard_normal((nr, n_cols) if nr else n_cols)).astype(np.float32)
    out = nan_device((nr, n_rows) if nr else (n_rows,))
    swiglu(cuda.to_device(g), cuda.to_device(u), qtype, cuda.to_device(x), out=out)
    got, want = out.copy_to_host(), swiglu_ref(g, u, qtype, x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---------------------------------------------------------------- argument checks
def test_matvec_rejects_bad_arguments():
    rng = np.random.default_rng(0)
    raw = cuda.to_device(weights(rng, T.Q4_K, 4, 256))
    with pytest.raises(ValueError):  # weight rows do not match K
        matvec(raw, T.Q4_K, cuda.to_device(np.zeros(512, np.float32)))
    with pytest.raises(ValueError):  # batch too large
        matvec(raw, T.Q4_K, cuda.to_device(np.zeros((65, 256), np.float32)))
    with pytest.raises(ValueError):  # x must be float32
        matvec(raw, T.Q4_K, cuda.to_device(np.zeros(256, np.float64)))
    with pytest.raises(ValueError):  # out of the wrong size
        matvec(raw, T.Q4_K, cuda.to_device(np.zeros(256, np.float32)), out=nan_device(3))
    with pytest.raises(ValueError):  # tile not a multiple of 16 bytes
        matvec(cuda.to_device(weights(rng, T.Q6_K, 2, 512)), T.Q6_K,
               cuda.to_device(np.zeros(512, np.float32)), tile_blocks=2)


def test_bench_matvec_smoke():
    """The bench's Python path (its timings mean nothing in the simulator)."""
    from luce.kernels.matvec import bench_matvec
    rows = bench_matvec([(4, 256)], [T.Q4_K, "Q8_0"], iters=1)
    assert [r["qtype"] for r in rows] == ["Q4_K", "Q8_0"]
    assert {"kernel", "rows", "cols", "batch", "weight_bytes", "time_us", "GB/s", "timing"} <= set(rows[0])
    assert rows[0]["weight_bytes"] == 4 * row_bytes(T.Q4_K, 256)


def test_matvec_residual_in_place():
    """residual may be out itself: h += W x in one launch."""
    rng = np.random.default_rng(11)
    raw = weights(rng, T.Q6_K, 5, 256)
    x = rng.standard_normal(256).astype(np.float32)
    h = rng.standard_normal(5).astype(np.float32)
    h_dev = cuda.to_device(h)
    matvec(cuda.to_device(raw), T.Q6_K, cuda.to_device(x), out=h_dev, residual=h_dev)
    assert_close(h_dev.copy_to_host(), matvec_ref(raw, T.Q6_K, x, residual=h), raw, T.Q6_K, x)


# ---------------------------------------------------------------- GPU code generation
# The simulator never compiles the GPU code (inline-asm loads, bit casts, shuffles). When
# libNVVM is installed, compile the kernels to PTX in a subprocess without the simulator;
# no GPU or driver is needed once numba is told which architecture to target.
PTX_CHECK = r'''
import os, re, sys
from numba import cuda
from numba.cuda import types
from luce.kernels import dequant as D, matvec as M
u16, f32 = types.uint16[::1], types.float32[::1]
mv_sig = (u16, u16, f32, f32, f32, f32) + (types.int64,) * 5
for q, s in D.DEVICE_SPECS.items():
    ptx, _ = cuda.compile_ptx(M._make_kernel(q, 16, s.tile_blocks, 1, 2, False, False, False).py_func, mv_sig, cc=(9, 0))
    assert "ld.global.nc.v4.u32" in ptx and "ld.global.nc.v4.f32" in ptx and "shfl.sync" in ptx, q.name
T = D.T
for q, vw, nr, rpw, glu, bias_res in [(T.Q6_K, 4, 3, 1, True, False), (T.Q8_0, 2, 2, 3, False, True),
                                      (T.Q4_K, 16, 9, 2, False, True)]:
    cuda.compile_ptx(M._make_kernel(q, vw, D.DEVICE_SPECS[q].tile_blocks, M._batch_slots(nr), rpw, glu,
                                    bias_res, bias_res).py_func, mv_sig, cc=(9, 0))
for q, dt in [(T.Q5_1, types.float32), (T.Q3_K, types.float16), (T.BF16, types.float16)]:
    cuda.compile_ptx(D._dequant_kernel(q, 16, D.DEVICE_SPECS[q].tile_blocks).py_func,
                     (u16, dt[::1]) + (types.int64,) * 4, cc=(9, 0))
print("PTX OK")
'''


ptx_check = background_ptx_check(PTX_CHECK)


def test_gpu_kernels_compile_to_ptx(ptx_check):
    assert_ptx_ok(ptx_check)
