"""luce.kernels.matvec_fast on a real GPU at model shapes, against matvec_ref.

Run with: NUMBA_ENABLE_CUDASIM=0 pytest -m gpu tests/gpu/test_matvec_fast_gpu.py -s
Covers what the simulator cannot: the ld.global.nc.v4 inline-asm loads (ld16's aligned
pieces), the shuffle reduction, f16 bit casts through LLVM, and timing (bench_matvec_fast).
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

pytestmark = [pytest.mark.gpu]
if cuda.config.ENABLE_CUDASIM or not cuda.is_available():
    pytestmark.append(pytest.mark.skip(reason="needs a CUDA GPU (NUMBA_ENABLE_CUDASIM=0)"))

from luce.kernels.dequant import dequantize  # noqa: E402
from luce.kernels.matvec import matvec, matvec_ref, swiglu_ref  # noqa: E402
from luce.kernels.matvec_fast import bench_matvec_fast, matvec_fast, swiglu_fast  # noqa: E402

SHAPES = [(4096, 12288), (12288, 4096)]  # (rows N, columns K)
TYPES = [T.Q4_K, T.Q6_K, T.Q8_0]


def check(got, want, raw, qtype, x, tol=1e-5):
    """Float32 sums against a float64 reference: error bounded by tol |W| |x|."""
    assert np.isfinite(got).all()
    w = np.abs(dequantize(raw, qtype, (raw.shape[0], x.shape[-1])))
    bound = np.abs(x).reshape(-1, x.shape[-1]) @ np.abs(w).T  # one row per x row
    err = np.abs(got - want).reshape(bound.shape)
    assert (err <= tol * bound + 1e-5).all(), float((err / (bound + 1e-30)).max())


@pytest.mark.parametrize("shape", SHAPES, ids=ID)
@pytest.mark.parametrize("qtype", TYPES, ids=ID)
def test_matvec_fast_gpu(qtype, shape):
    n_rows, n_cols = shape
    raw = weights(qtype, n_rows, n_cols)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n_cols).astype(np.float32)
    bias = rng.standard_normal(n_rows).astype(np.float32)
    res = rng.standard_normal(n_rows).astype(np.float32)
    w_dev, x_dev = cuda.to_device(raw), cuda.to_device(x)
    out = cuda.to_device(np.full(n_rows, np.nan, np.float32))
    matvec_fast(w_dev, qtype, x_dev, out=out)
    check(out.copy_to_host(), matvec_ref(raw, qtype, x), raw, qtype, x)
    # bias and an in-place residual (h += W x + b)
    h = cuda.to_device(res)
    matvec_fast(w_dev, qtype, x_dev, out=h, bias=cuda.to_device(bias), residual=h)
    check(h.copy_to_host(), matvec_ref(raw, qtype, x, bias=bias, residual=res), raw, qtype, x)
    # agrees with the general kernel
    ref = matvec(w_dev, qtype, x_dev).copy_to_host()
    check(out.copy_to_host(), ref, raw, qtype, x, tol=2e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=ID)
def test_matvec_fast_gpu_odd_shapes(qtype):
    """5120 columns: Q6_K/Q8_0 rows that are not 16-byte multiples (rows at every even
    offset); 1000 rows: the last warp holds rows past the end; x given as (1, K)."""
    n_rows, n_cols = 1000, 5120
    raw = weights(qtype, n_rows, n_cols, seed=3)
    if raw.nbytes % 16:
        raw = raw[:-1]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, n_cols)).astype(np.float32)
    out = cuda.to_device(np.full((1, raw.shape[0]), np.nan, np.float32))
    matvec_fast(cuda.to_device(raw), qtype, cuda.to_device(x), out=out)
    check(out.copy_to_host(), matvec_ref(raw, qtype, x), raw, qtype, x)


@pytest.mark.parametrize("qtype", TYPES, ids=ID)
def test_swiglu_fast_gpu(qtype):
    n_rows, n_cols = 12288, 4096
    g, u = weights(qtype, n_rows, n_cols, seed=5), weights(qtype, n_rows, n_cols, seed=6)
    rng = np.random.default_rng(4)
    x = (0.05 * rng.standard_normal(n_cols)).astype(np.float32)
    out = cuda.to_device(np.full(n_rows, np.nan, np.float32))
    swiglu_fast(cuda.to_device(g), cuda.to_device(u), qtype, cuda.to_device(x), out=out)
    got, want = out.copy_to_host(), swiglu_ref(g, u, qtype, x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_bench_matvec_fast_gpu():
    """Prints the timings (-s) of the target shapes, both block sizes and the general kernel;
    asserts only that they are plausible. All default shapes: python -m luce.kernels.matvec_fast."""
    rows = bench_matvec_fast(shapes=((4096, 12288), (12288, 4096), (4096, 4096)), iters=50, warps=(4, 8),
                             baseline=True)
    for r in rows:
        print(json.dumps(r))
    assert all(r["time_us"] > 0 and r["timing"] == "graph" for r in rows)


@pytest.mark.parametrize("groups,warps", [(1, 4), (2, 8), (4, 4), (16, 4), (8, 2)])
@pytest.mark.parametrize("qtype", TYPES, ids=ID)
def test_matvec_fast_gpu_groups(qtype, groups, warps):
    """Every row-group split of a warp, and of the units between warps, at a real shape
    (1000 rows: the last block holds rows past the end)."""
    n_rows, n_cols = 1000, 4096
    raw = weights(qtype, n_rows, n_cols, seed=7)
    rng = np.random.default_rng(8)
    x = rng.standard_normal(n_cols).astype(np.float32)
    out = cuda.to_device(np.full(n_rows, np.nan, np.float32))
    matvec_fast(cuda.to_device(raw), qtype, cuda.to_device(x), out=out, groups=groups, warps=warps)
    check(out.copy_to_host(), matvec_ref(raw, qtype, x), raw, qtype, x)


@pytest.mark.parametrize("n_x", [2, 3, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=ID)
def test_matvec_fast_gpu_x_rows(qtype, n_x):
    """Several activation rows a launch at a real shape, with a per-row residual, and the
    gated form, against the references."""
    n_rows, n_cols = 4096, 4096
    raw = weights(qtype, n_rows, n_cols, seed=9)
    up = weights(qtype, n_rows, n_cols, seed=10)
    rng = np.random.default_rng(n_x)
    x = (0.1 * rng.standard_normal((n_x, n_cols))).astype(np.float32)
    res = rng.standard_normal((n_x, n_rows)).astype(np.float32)
    out = cuda.to_device(np.full((n_x, n_rows), np.nan, np.float32))
    matvec_fast(cuda.to_device(raw), qtype, cuda.to_device(x), out=out, residual=cuda.to_device(res))
    check(out.copy_to_host(), matvec_ref(raw, qtype, x, residual=res), raw, qtype, x)
    out = cuda.to_device(np.full((n_x, n_rows), np.nan, np.float32))
    swiglu_fast(cuda.to_device(raw), cuda.to_device(up), qtype, cuda.to_device(x), out=out)
    want = swiglu_ref(raw, up, qtype, x)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("n_x", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=ID)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=ID)
def test_matvec_fast_x8_gpu(qtype, shape, n_x, planes):
    """Q4_K and Q6_K over int8 x (dp4a, luce.kernels.quantize_x, one or two planes) at the
    FFN shapes: the quantizer bit for bit against its reference (float sums to rounding),
    the matvec against matvec_x8_ref (the same arithmetic in float64) to float32 accuracy,
    and the gated form."""
    from luce.kernels.quantize_x import matvec_x8_ref, quantize_x, quantize_x_ref
    n_rows, n_cols = shape
    raw = weights(qtype, n_rows, n_cols)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n_x, n_cols) if n_x > 1 else n_cols).astype(np.float32)
    x_dev = cuda.to_device(x)
    xq = quantize_x(x_dev, planes=planes)
    from test_quantize_x import assert_same_form
    assert_same_form(xq.copy_to_host(), quantize_x_ref(x, planes), planes, rtol=1e-5, atol=1e-3)
    out = cuda.to_device(np.full((n_x, n_rows) if n_x > 1 else n_rows, np.nan, np.float32))
    matvec_fast(cuda.to_device(raw), qtype, x_dev, out=out, xq=xq)
    check(out.copy_to_host(), matvec_x8_ref(raw, qtype, x, planes), raw, qtype, x)
    if n_x == 1 and n_rows == 12288:
        up = weights(qtype, n_rows, n_cols, seed=6)
        out = cuda.to_device(np.full(n_rows, np.nan, np.float32))
        swiglu_fast(cuda.to_device(raw), cuda.to_device(up), qtype, x_dev, out=out, xq=xq)
        yg, yu = matvec_x8_ref(raw, qtype, x, planes), matvec_x8_ref(up, qtype, x, planes)
        want = yg * 0.5 * (1 + np.tanh(yg / 2)) * yu
        got = out.copy_to_host()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("rows,d", [(1, 4096), (2, 5120)])
def test_rms_norm_quantize_gpu(rows, d, planes):
    """RMSNorm and its int8 form in one launch (LUCE_MATVEC_X8's decode norms) at the 8B and
    32B hidden sizes."""
    from test_quantize_x import check_rms_norm_quantize
    check_rms_norm_quantize(rows, d, planes)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("qtype_o,qtype_p,d,k_in,n_out", [(T.Q6_K, T.Q4_K, 4096, 12288, 12288),  # down, gate/up
                                                          (T.Q4_K, T.Q4_K, 5120, 8192, 1024)], ids=ID)  # 32B's o, k
def test_split_rms_norm_over_int8_x_gpu(qtype_o, qtype_p, d, k_in, n_out, planes):
    """The split RMSNorm over int8 x at the 8B and 32B shapes with the launches' own grids
    (the residual product's int8 output by shuffles): as the simulator test."""
    from test_quantize_x import check_split_rms_norm_over_int8_x
    check_split_rms_norm_over_int8_x(qtype_o, qtype_p, None, planes, d, k_in, n_out)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("qtype,n_rows,n_cols", [(T.Q4_K, 12288, 4096), (T.Q4_K, 25600, 5120)], ids=ID)
def test_gated_int8_out_gpu(qtype, n_rows, n_cols, planes):
    """The gated product storing its output's int8 form at the 8B and 32B FFN shapes."""
    from test_quantize_x import check_gated_int8_out
    check_gated_int8_out(qtype, None, planes, n_rows, n_cols)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("qtype,n_rows,n_cols", [(T.Q4_K, 10240, 2560), (T.Q6_K, 10240, 2560),
                                                 (T.Q4_K, 21504, 5376)], ids=ID)
def test_geglu_int8_out_gpu(qtype, n_rows, n_cols, planes):
    """Gemma's GeGLU as one gated launch (LUCE_FUSED_GEGLU's decode form) at the Gemma 3 4B
    and 27B FFN shapes, over int8 x and storing its output's int8 form."""
    from test_quantize_x import check_gated_int8_out
    check_gated_int8_out(qtype, None, planes, n_rows, n_cols, act="gelu_tanh")


@pytest.mark.parametrize("qtype_o,qtype_p", [(T.Q4_K, T.Q4_K), (T.Q6_K, T.Q6_K)], ids=ID)
def test_split_rms_norm_gpu(qtype_o, qtype_p):
    """The split RMSNorm at the 8B shape with the default grids (shuffle sums of the parts):
    down (or o) with residual, then paired q/k, gate/up and a plain product of xg."""
    from luce.kernels.matvec_fast import matvec_fast_norm, matvec_fast_pair, norm_parts_max
    from luce.kernels.norm import rms_norm_ref
    rng = np.random.default_rng(5)
    d, k_in, eps = 4096, 12288, 1e-6
    wo = weights(qtype_o, d, k_in, seed=1)
    a = rng.standard_normal(k_in).astype(np.float32)
    h = (3 * rng.standard_normal(d)).astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    h_dev, xg = cuda.to_device(h), cuda.device_array(d, np.float32)
    parts = cuda.device_array(norm_parts_max(d), np.float32)
    n_parts = matvec_fast_norm(cuda.to_device(wo), qtype_o, cuda.to_device(a), h_dev, cuda.to_device(g), xg, parts)
    h1 = h_dev.copy_to_host()
    check(h1, matvec_ref(wo, qtype_o, a, residual=h), wo, qtype_o, a)
    np.testing.assert_allclose(xg.copy_to_host(), h1 * g, rtol=1e-6)
    normed = rms_norm_ref(h1, g, eps)
    x_norm = (parts, n_parts, eps)
    wq, wk = weights(qtype_p, 4096, d, seed=2), weights(qtype_p, 1024, d, seed=3)
    oq, ok = cuda.device_array(4096, np.float32), cuda.device_array(1024, np.float32)
    matvec_fast_pair(cuda.to_device(wq), cuda.to_device(wk), qtype_p, xg, oq, ok, x_norm=x_norm)
    check(oq.copy_to_host(), matvec_ref(wq, qtype_p, normed), wq, qtype_p, normed)
    check(ok.copy_to_host(), matvec_ref(wk, qtype_p, normed), wk, qtype_p, normed)
    wg, wu = weights(qtype_p, 12288, d, seed=4), weights(qtype_p, 12288, d, seed=6)
    out = swiglu_fast(cuda.to_device(wg), cuda.to_device(wu), qtype_p, xg, x_norm=x_norm).copy_to_host()
    want = swiglu_ref(wg, wu, qtype_p, normed)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    out = matvec_fast(cuda.to_device(wk), qtype_p, xg, x_norm=x_norm).copy_to_host()
    check(out, matvec_ref(wk, qtype_p, normed), wk, qtype_p, normed)


@pytest.mark.parametrize("unroll", [None, "pipe"])
def test_matvec_fast_pair_with_third_gpu(unroll):
    """q and k (Q4_K) with v (Q6_K) as the third weight of one launch at the Qwen3-8B shape,
    with biases, the grid sized for all three; and the pipelined loop on the same."""
    from luce.kernels.matvec_fast import matvec_fast_pair
    rng = np.random.default_rng(9)
    d = 4096
    shapes = ((T.Q4_K, 4096, 11), (T.Q4_K, 1024, 12), (T.Q6_K, 1024, 13))
    ws = [weights(q, n, d, seed=s) for q, n, s in shapes]
    bs = [rng.standard_normal(n).astype(np.float32) for _, n, _ in shapes]
    x = rng.standard_normal(d).astype(np.float32)
    outs = [cuda.to_device(np.full(n, np.nan, np.float32)) for _, n, _ in shapes]
    dev = [cuda.to_device(a) for a in ws + bs]
    matvec_fast_pair(dev[0], dev[1], T.Q4_K, cuda.to_device(x), outs[0], outs[1], dev[3], dev[4],
                     third=(dev[2], T.Q6_K, outs[2], dev[5]))
    for (q, _, _), w, b, o in zip(shapes, ws, bs, outs):
        check(o.copy_to_host(), matvec_ref(w, q, x, bias=b), w, q, x)
    if unroll:  # the pipelined loop, one weight at a time
        for (q, _, _), w, b in zip(shapes, ws, bs):
            got = matvec_fast(cuda.to_device(w), q, cuda.to_device(x), bias=cuda.to_device(b), unroll=unroll)
            check(got.copy_to_host(), matvec_ref(w, q, x, bias=b), w, q, x)


@pytest.mark.parametrize("n_rows,n_cols", [(4096, 12288), (151936 // 8, 4096)], ids=["down", "head_part"])
def test_q6_k_groups_layout_gpu(n_rows, n_cols):
    """layout="g8" (luce.kernels.q6k_groups) at the decode down and head shapes: the same
    bits as the GGUF layout over the same int8 x (the same sums in the same order), both
    within float32 accuracy of the reference; and the down product with its norm."""
    from luce.kernels.matvec_fast import matvec_fast_norm
    from luce.kernels.q6k_groups import g8_ref
    from luce.kernels.quantize_x import matvec_x8_ref, quantize_x
    raw = weights(T.Q6_K, n_rows, n_cols)
    g8 = cuda.to_device(g8_ref(raw, n_rows, n_cols))
    rng = np.random.default_rng(12)
    x = rng.standard_normal(n_cols).astype(np.float32)
    x_dev = cuda.to_device(x)
    xq = quantize_x(x_dev, planes=2)
    outs = []
    for w, layout in ((cuda.to_device(raw), None), (g8, "g8")):
        out = cuda.to_device(np.full(n_rows, np.nan, np.float32))
        matvec_fast(w, T.Q6_K, x_dev, out=out, xq=xq, layout=layout)
        outs.append(out.copy_to_host())
    np.testing.assert_array_equal(outs[1], outs[0])
    check(outs[1], matvec_x8_ref(raw, T.Q6_K, x, 2), raw, T.Q6_K, x)
    res0 = rng.standard_normal(n_rows).astype(np.float32)
    gn = cuda.to_device(rng.standard_normal(n_rows).astype(np.float32))
    got = []
    for w, layout in ((cuda.to_device(raw), None), (g8, "g8")):
        res = cuda.to_device(res0)
        xg = cuda.to_device(np.full(n_rows, np.nan, np.float32))
        parts = cuda.to_device(np.full(4096, np.nan, np.float32))
        n = matvec_fast_norm(w, T.Q6_K, x_dev, res, gn, xg, parts, xq=xq, layout=layout)
        got.append((res.copy_to_host(), xg.copy_to_host(), parts.copy_to_host()[:n]))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(got[1][1]).all()
