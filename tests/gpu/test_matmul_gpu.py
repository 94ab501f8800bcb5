"""Prefill matmul (luce.kernels.matmul) on a real GPU at real shapes against the numpy
reference: the tensor-core path (mma.sync + ldmatrix inline asm) for every type at
Qwen3-8B projection shapes, the 32-bit-fragment and single-buffer variants, the FMA path,
tails, f16 activations and the fused epilogues; the small-M tiles that matmul picks for
speculative verification (8-64 rows) with their split-K reduction, at Qwen3-8B FFN shapes.

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
from luce.kernels import matmul as MM  # noqa: E402
from luce.kernels.matmul import TILE_GPU, TILES_SMALL_M, matmul, matmul_ref, pick_tile  # noqa: E402

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


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_mma_big_tile_split_k(qtype):
    """The prefill tile with K split (k and v projections: too few column tiles for a wave),
    against the reference, with a residual, arrival counters left at zero."""
    assert pick_tile(512, 1024, 4096, qtype)[1] > 1
    run(qtype, 512, 1024, 4096, residual=True)
    assert not MM._SPLITBUF["cnt"].copy_to_host().any()


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


# ---------------------------------------------------------------- small M (verification)
_W: dict = {}


def weight(qtype, n, k):
    """(host bytes, device bytes, |dequantized| float32) of one random weight per shape,
    shared by the tests of that shape."""
    key = (qtype, n, k)
    if key not in _W:
        w = random_weight(qtype, n, k, rng)
        _W[key] = (w, cuda.to_device(w), np.abs(dequantize(w, qtype, (n, k))).astype(np.float32))
    return _W[key]


def check_small(qtype, m, n, k, x_dtype=np.float32, bias=None, residual=None, **kw):
    w, wd, wabs = weight(qtype, n, k)
    x = rng.standard_normal((m, k)).astype(x_dtype)
    if residual is not None:
        out = cuda.to_device(residual)  # in place, as the backend updates the residual stream
        res = out
    else:
        out, res = cuda.to_device(np.full((m, n), np.nan, np.float32)), None
    matmul(cuda.to_device(x), wd, qtype, n, k, out=out, bias=None if bias is None else cuda.to_device(bias),
           residual=res, **kw)
    y = out.copy_to_host()
    assert not np.isnan(y).any(), f"{np.isnan(y).sum()} outputs unwritten"
    ref = matmul_ref(x, w, qtype, (n, k), bias=bias, residual=residual)
    bound = np.abs(x.astype(np.float32)) @ wabs.T
    err = np.abs(y - ref)
    bad = err > 2.0 ** -8 * bound + 1e-6
    assert not bad.any(), f"{qtype} M={m}: {bad.sum()} outputs off, worst {err.max()}"
    return y, x


@pytest.mark.parametrize("k,n", [(4096, 12288), (12288, 4096)])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [2, 8, 16, 23, 64])
def test_small_m_real_shapes(m, qtype, k, n):
    tile, splits = pick_tile(m, n, k, qtype)
    assert tile in [t for _, t, _ in TILES_SMALL_M] and tile[0] >= m
    assert splits > 1  # neither shape has enough column tiles alone
    check_small(qtype, m, n, k)  # matmul's own choice (tile=None)
    cnt = MM._SPLITBUF["cnt"].copy_to_host()
    assert not cnt.any(), "split-K arrival counters left non-zero"


def test_small_m_deterministic_and_split_invariant():
    m, k, n = 16, 12288, 4096
    y1, x = check_small("Q4_K", m, n, k)
    _, wd, _ = weight("Q4_K", n, k)
    xd = cuda.to_device(x)
    y2 = matmul(xd, wd, "Q4_K", n, k).copy_to_host()
    assert np.array_equal(y1, y2), "split-K sums depend on block arrival order"
    tile, splits = pick_tile(m, n, k, "Q4_K")
    y3 = matmul(xd, wd, "Q4_K", n, k, tile=tile, splits=1).copy_to_host()
    y4 = matmul(xd, wd, "Q4_K", n, k, tile=tile, splits=splits + 3).copy_to_host()  # uneven split
    scale = np.abs(y3).max()
    assert np.abs(y1 - y3).max() <= 1e-4 * scale and np.abs(y4 - y3).max() <= 1e-4 * scale


@pytest.mark.parametrize("m", [16, 64])
def test_small_m_bias_residual_in_place(m):
    k, n = 12288, 4096
    check_small("Q6_K", m, n, k, bias=rng.standard_normal(n).astype(np.float32),
                residual=rng.standard_normal((m, n)).astype(np.float32))


@pytest.mark.parametrize("qtype,m,k,n,x_dtype", [
    ("Q8_0", 16, 4096, 4096, np.float32), ("Q4_0", 23, 4096, 4096, np.float16),
    ("F16", 8, 4096, 4096, np.float32), ("Q8_0", 16, 896, 4864, np.float32),  # K = 7 x 128
])
def test_small_m_other_types(qtype, m, k, n, x_dtype):
    check_small(qtype, m, n, k, x_dtype=x_dtype)


def test_small_m_fma_path_and_x_in_kernel():
    check_small("Q4_K", 16, 12288, 4096, use_mma=False)
    check_small("Q4_K", 64, 12288, 4096, x_convert=False)


def test_big_tile_from_128_rows():
    # the big tile; K split as auto_splits says (a 4096-row product fills a wave only split)
    assert pick_tile(128, 4096, 4096, "Q4_K")[0] == TILE_GPU
    check_small("Q4_K", 128, 4096, 4096)


def test_matmul_rows_past_f16_range_gpu():
    """Prefill rows with values past f16's 65504 (as a down projection's SwiGLU products can
    reach) at a real shape: finite, within the usual bound; the plain rows' outputs are the
    bits they get without the big rows (same tile and split)."""
    from luce.bench.synthetic import random_quant_rows
    from luce.kernels.quant_types import as_qtype
    rng = np.random.default_rng(4)
    q, m, n, k = as_qtype("Q6_K"), 96, 4096, 12288
    w = random_quant_rows(q, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[5] *= 3e5
    x[70] *= 1e6
    tile, splits = pick_tile(m, n, k, q)
    w_dev = cuda.to_device(w)
    y = matmul(cuda.to_device(x), w_dev, q, n, k, tile=tile, splits=splits).copy_to_host()
    assert np.isfinite(y).all()
    ref = matmul_ref(x, w, q, (n, k))
    bound = np.abs(x) @ np.abs(dequantize(w, q, (n, k))).T
    assert (np.abs(y - ref) <= 2.0 ** -8 * bound + 1e-4).all()
    plain = [i for i in range(m) if i not in (5, 70)]
    y2 = matmul(cuda.to_device(x[plain]), w_dev, q, n, k, tile=tile, splits=splits).copy_to_host()
    np.testing.assert_array_equal(y[plain], y2)


@pytest.mark.parametrize("qtype,m,k,n,act", [("Q4_K", 512, 4096, 12288, "silu"), ("Q4_K", 200, 5120, 25600, "silu"),
                                             ("Q6_K", 512, 4096, 12288, "silu"), ("Q4_K", 64, 4096, 12288, "silu"),
                                             ("Q4_K", 23, 4096, 12288, "silu"),
                                             ("Q4_K", 512, 2560, 10240, "gelu_tanh")])  # Gemma 3 4B's GeGLU
def test_gated_real_shapes(qtype, m, k, n, act):
    """The gated form (w_up) at the Qwen3-8B and 32B FFN shapes (SwiGLU) and Gemma 3 4B's
    (GeGLU), prefill's big tile and the small-M tiles, against the activation of the first
    reference product times the second (each product held to run's bound, carried through
    the activation's slope <= 1.13 and the product with up), on a random
    subset of rows; and, where both take the same tile (the same sums in the same order),
    what two launches and the SwiGLU kernel give to float32 rounding (their silu differs in
    how it is written)."""
    from luce.kernels.activation import gelu_tanh_ref, glu_cuda, silu_ref
    f = silu_ref if act == "silu" else gelu_tanh_ref
    x = rng.standard_normal((m, k)).astype(np.float32)
    wg, wu = random_weight(qtype, n, k, rng), random_weight(qtype, n, k, rng)
    xd, wgd, wud = cuda.to_device(x), cuda.to_device(wg), cuda.to_device(wu)
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))
    matmul(xd, wgd, qtype, n, k, out=out, w_up=wud, act=act)
    y = out.copy_to_host()
    assert not np.isnan(y).any(), f"{np.isnan(y).sum()} outputs unwritten"
    sel = np.sort(rng.choice(m, size=min(24, m), replace=False))
    sel[-1] = m - 1
    g, u = (matmul_ref(x[sel], w, qtype, (n, k)).astype(np.float64) for w in (wg, wu))
    bg, bu = (2.0 ** -8 * (np.abs(x[sel]) @ np.abs(dequantize(w, qtype, (n, k))).T) + 1e-6 for w in (wg, wu))
    bound = 1.13 * bg * np.abs(u) + np.abs(f(g)) * bu + bg * bu
    err = np.abs(y[sel] - f(g) * u)
    assert (err <= bound * (1 + 1e-5) + 1e-6).all(), f"{(err > bound).sum()} outputs off"
    tile, splits = pick_tile(m, 2 * n, k, qtype)
    if splits == 1 and pick_tile(m, n, k, qtype) == (tile, 1):
        gs = [matmul(xd, w, qtype, n, k, tile=tile, splits=1) for w in (wgd, wud)]
        two = glu_cuda(gs[0], gs[1], "swiglu" if act == "silu" else "geglu").copy_to_host()
        np.testing.assert_allclose(y, two, rtol=2e-6, atol=1e-6)
