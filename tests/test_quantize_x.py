"""luce.kernels.quantize_x (int8 activations) and matvec_fast's units over them (x8: dp4a
on the GPU, its Python stand-in here), in the CUDA simulator. The x8 matvec is checked
against matvec_x8_ref (the same arithmetic in float64: scaled quants times the rounded x,
mins times the exact x) to float32 accuracy, and against the exact matvec_ref within the
rounding error of x, bounded independently: sum |W_scaled| * step / 2."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import cuda

from luce.kernels.matvec import matvec_ref, swiglu_ref
from luce.kernels.matvec_fast import matvec_fast, swiglu_fast
from luce.kernels.quantize_x import (block_bytes, dequantize_x_ref, int8_quad_store, matvec_x8_ref, quantize_x,
                                     quantize_x_ref, xq_size)
from test_matvec import nan_device, weights


def _step(x, planes):
    """The rounding step of x's values a priori: absmax / 127 of each 32-column block; with
    a second plane, which holds at most half the first's step, 254 times finer."""
    return np.repeat(np.abs(x).reshape(-1, 32).max(1) / 127 / (254 if planes == 2 else 1), 32).reshape(-1, x.shape[-1])


@pytest.mark.parametrize("planes", [1, 2])
def test_quantize_x_matches_reference_and_bounds_its_error(planes):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 256)) * rng.uniform(0.01, 50, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0  # an all-zero block: step 0, no division by zero
    x[2, 5] = 1e4    # an outlier: its block's step is large, the others' unchanged
    x[0, 64:96] = 0.5  # a block of one value: nothing left for the second plane
    out = cuda.to_device(np.full(xq_size(256, 3, planes), 0xFFFF, np.uint16))  # poisoned
    got = quantize_x(cuda.to_device(x), out=out, planes=planes).copy_to_host()
    want = quantize_x_ref(x, planes)
    assert_same_form(got, want, planes, rtol=1e-6, atol=1e-4)
    w = want.view(np.uint8).reshape(-1, block_bytes(planes))
    halves = x.reshape(-1, 16)
    np.testing.assert_allclose(w[:, 32 * planes + 8:].copy().view(np.float32).reshape(-1), halves.sum(1), rtol=1e-5,
                               atol=1e-3)  # the exact sums of each 16 columns
    steps = w[:, 32 * planes:32 * planes + 8].copy().view(np.float32).reshape(-1)
    np.testing.assert_array_equal(steps, np.abs(halves).max(1) / np.float32(127) / np.float32(254 if planes == 2 else 1))
    xh = dequantize_x_ref(want, 256, planes)
    assert (np.abs(xh - x) <= _step(x, planes) / 2 * (1 + 1e-5) + 1e-30).all()
    assert (xh[1, 32:64] == 0).all()
    np.testing.assert_allclose(xh[0, 64:96], 0.5, rtol=1e-6)  # two planes: 254 fine steps are d to rounding
    if planes == 2:  # the fine plane holds what the first left: x to ~16 bits
        one = dequantize_x_ref(quantize_x_ref(x), 256)
        assert np.abs(xh - x).max() < np.abs(one - x).max() / 50
        assert (w[:, 32:64] != 0).any() and (np.abs(w[:, 32:64].view(np.int8)) <= 127).all()
    with pytest.raises(ValueError):
        xq_size(100)
    with pytest.raises(ValueError):
        xq_size(256, 1, 3)


@cuda.jit
def _quad_kernel(x, xq_w, xq_f, n, planes):
    red = cuda.shared.array(64, np.float32)  # the simulator's reductions: 32 slots a warp
    t = cuda.threadIdx.x
    c = 4 * (cuda.blockIdx.x * cuda.blockDim.x + t)
    live = c < n
    cc = min(c, n - 4)
    int8_quad_store(x[cc], x[cc + 1], x[cc + 2], x[cc + 3], live, c, t & 31, t >> 5, red, xq_w, xq_f, planes)


@pytest.mark.parametrize("planes", [1, 2])
def test_int8_quad_store_writes_quantize_xs_form(planes):
    """Four columns a thread (persistent_decode's staging) give quantize_x's form; the last
    block's threads past n write nothing (poisoned words beyond stay)."""
    rng = np.random.default_rng(11)
    n = 224  # 56 live threads of 64: two warps, the second partly past the end
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    x[32:48] = 0  # a zero half
    size = xq_size(n, 1, planes)
    out = cuda.to_device(np.full(size + 8, 0xFFFF, np.uint16))
    _quad_kernel[1, 64](cuda.to_device(x), out.view(np.uint32), out.view(np.float32), n, planes)
    got = out.copy_to_host()
    assert_same_form(got[:size], quantize_x_ref(x, planes), planes, rtol=1e-6, atol=1e-5)
    assert (got[size:] == 0xFFFF).all()


def assert_same_form(got, want, planes, rtol, atol):
    """Two quantize_x forms: the int8 values and the steps bit for bit, the float sums of x
    to rounding: the kernel adds in another order, so a sum of 16 columns may differ by a few
    float32 roundings of 16 max|x| (max|x| is 127 steps, 127 * 254 fine steps), which
    cancellation can make large against the sum itself."""
    nb = block_bytes(planes)
    g, w = got.view(np.uint8).reshape(-1, nb), want.view(np.uint8).reshape(-1, nb)
    m = 32 * planes  # where the steps and the sums start
    np.testing.assert_array_equal(g[:, :m + 8], w[:, :m + 8])
    xmax = w[:, m:m + 8].copy().view(np.float32) * np.float32(127 * (254 if planes == 2 else 1))
    rounding = 4 * 16 * np.finfo(np.float32).eps * xmax
    gs, ws = g[:, m + 8:].copy().view(np.float32), w[:, m + 8:].copy().view(np.float32)
    bad = np.abs(gs - ws) > atol + rtol * np.abs(ws) + rounding
    assert not bad.any(), f"sums differ at {np.argwhere(bad)[:5].tolist()}: {gs[bad][:5]} vs {ws[bad][:5]}"


def _x8_bound(raw, qtype, x, planes=1):
    """|x8 result - W x| <= sum |W_scaled| |x - rounded x| <= sum |W_scaled| step / 2, where
    W_scaled is the part of W that meets the rounded x (Q4_K: without its mins; Q6_K: d scale q,
    without the -32 d scale its stored quants carry)."""
    from luce.kernels.dequant import dequantize
    n_rows, n_cols = raw.shape[0], x.shape[-1]
    w = dequantize(raw, qtype, (n_rows, n_cols)).astype(np.float64)
    const = raw.copy().reshape(n_rows, -1, 144 if qtype == T.Q4_K else 210)
    if qtype == T.Q4_K:
        const[:, :, 0:2] = 0  # d = 0: the min part alone
    else:
        const[:, :, :192] = 0  # quants 0: the offset alone
    w_sc = np.abs(w - dequantize(const.reshape(n_rows, -1), qtype, (n_rows, n_cols)).astype(np.float64))
    return (_step(x, planes) / 2) @ w_sc.T, np.abs(x).reshape(-1, n_cols).astype(np.float64) @ np.abs(
        dequantize(raw, qtype, (n_rows, n_cols))).astype(np.float64).T


@pytest.mark.parametrize("qtype,n_x,n_rows,n_cols,planes", [
    (T.Q4_K, 1, 5, 768, 1), (T.Q4_K, 3, 3, 512, 1), (T.Q4_K, 1, 5, 768, 2), (T.Q4_K, 2, 3, 512, 2),
    (T.Q6_K, 1, 16, 256, 1),   # rows at every offset mod 16
    (T.Q6_K, 2, 8, 768, 1), (T.Q6_K, 1, 16, 256, 2), (T.Q6_K, 2, 8, 512, 2)], ids=str)  # sizes of 16-byte multiples: else the float fallback
def test_matvec_fast_x8(qtype, n_x, n_rows, n_cols, planes):
    rng = np.random.default_rng(n_x * 100 + n_cols)
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((n_x, n_cols) if n_x > 1 else n_cols).astype(np.float32)
    xd = cuda.to_device(x)
    out = nan_device((n_x, n_rows) if n_x > 1 else (n_rows,))
    got = matvec_fast(cuda.to_device(raw), qtype, xd, out=out, xq=quantize_x(xd, planes=planes)).copy_to_host()
    want = matvec_x8_ref(raw, qtype, x, planes)
    rounding, scale = _x8_bound(raw, qtype, x, planes)
    np.testing.assert_array_less(np.abs(got - want).reshape(scale.shape), 1e-5 * scale + 1e-6)
    exact = matvec_ref(raw, qtype, x)
    np.testing.assert_array_less(np.abs(got - exact).reshape(scale.shape), rounding * 1.001 + 1e-5 * scale + 1e-6)
    assert np.abs(got - exact).max() > 0  # x really went through int8 (else the test checks nothing new)


@pytest.mark.parametrize("unroll", [1, "pipe"])
def test_x8_unroll_setting(monkeypatch, unroll):
    """LUCE_X8_UNROLL: the products over int8 x take it (float x keeps its type's entry)."""
    from luce.kernels import matvec_fast as F
    monkeypatch.setattr(F, "X8_UNROLL", unroll)
    keys = []
    kernel = F._kernel
    monkeypatch.setattr(F, "_kernel", lambda *key: keys.append(key) or kernel(*key))
    rng = np.random.default_rng(3)
    raw = weights(rng, T.Q4_K, 4, 512)
    x = rng.standard_normal(512).astype(np.float32)
    xd = cuda.to_device(x)
    got = matvec_fast(cuda.to_device(raw), T.Q4_K, xd, out=nan_device((4,)), xq=quantize_x(xd, planes=2))
    np.testing.assert_allclose(got.copy_to_host(), matvec_x8_ref(raw, T.Q4_K, x, 2), rtol=1e-5, atol=1e-5)
    matvec_fast(cuda.to_device(raw), T.Q4_K, xd, out=nan_device((4,)))
    assert [k[6] for k in keys] == [unroll, F.FAST_SPECS[T.Q4_K].unroll]  # _make_kernel's unroll


@pytest.mark.parametrize("planes", [1, 2])
def test_swiglu_fast_x8_and_other_types_ignore_xq(planes):
    rng = np.random.default_rng(3)
    n_rows, n_cols = 4, 512
    g, u = weights(rng, T.Q4_K, n_rows, n_cols), weights(rng, T.Q4_K, n_rows, n_cols)
    x = rng.standard_normal(n_cols).astype(np.float32)
    xd = cuda.to_device(x)
    xq = quantize_x(xd, planes=planes)
    got = swiglu_fast(cuda.to_device(g), cuda.to_device(u), T.Q4_K, xd, out=nan_device(n_rows), xq=xq).copy_to_host()
    yg, yu = matvec_x8_ref(g, T.Q4_K, x, planes), matvec_x8_ref(u, T.Q4_K, x, planes)
    want = yg * 0.5 * (1 + np.tanh(yg / 2)) * yu  # silu without exp overflow
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.abs(got - swiglu_ref(g, u, T.Q4_K, x)).max() > 0
    # a type without x8 units takes x as float32, xq or not
    w8 = weights(rng, T.Q8_0, n_rows, n_cols)
    a = matvec_fast(cuda.to_device(w8), T.Q8_0, xd, out=nan_device(n_rows), xq=xq).copy_to_host()
    b = matvec_fast(cuda.to_device(w8), T.Q8_0, xd, out=nan_device(n_rows)).copy_to_host()
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        matvec_fast(cuda.to_device(g), T.Q4_K, xd, out=nan_device(n_rows), xq=xq[:-24])


@pytest.mark.parametrize("rows,d,planes", [(1, 128, 1), (2, 96, 1), (2, 96, 2)])
def test_rms_norm_quantize(rows, d, planes):
    check_rms_norm_quantize(rows, d, planes)


def check_rms_norm_quantize(rows, d, planes=1):
    """One launch for RMSNorm and quantize_x (the decode path with int8 activations): the
    norm to float32 accuracy, and its int8 form bit for bit that of quantize_x_ref applied
    to the output it wrote (also run by the GPU tests, at model sizes)."""
    from luce.kernels.norm import rms_norm_ref
    from luce.kernels.quantize_x import rms_norm_quantize
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((rows, d)) * 4).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    out = cuda.to_device(np.full((rows, d), np.nan, np.float32))
    xq = cuda.to_device(np.full(xq_size(d, rows, planes), 0xFFFF, np.uint16))
    rms_norm_quantize(cuda.to_device(x), cuda.to_device(w), 1e-6, out, xq, planes=planes)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    assert_same_form(xq.copy_to_host(), quantize_x_ref(got, planes), planes, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        rms_norm_quantize(cuda.to_device(x), cuda.to_device(w), 1e-6, out, xq[:-1], planes=planes)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=str)
def test_cpu_emulation_of_int8_activations(qtype, planes):
    """luce.bench.x8_drift's numpy emulation (what measures X8's effect on real models'
    greedy output on the CPU) computes what the GPU units do: matvec_x8_ref, for decode's
    one- and two-row forwards; wider forwards stay float."""
    from types import SimpleNamespace
    from luce.bench.x8_drift import X8CPUBackend, X8Ops
    rng = np.random.default_rng(int(qtype))
    raw = weights(rng, qtype, 6, 512)
    be = X8CPUBackend(planes=planes)
    w = be.load_tensor(SimpleNamespace(data=raw.reshape(-1), qtype=qtype, shape=(6, 512)))
    ops = X8Ops(be)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    assert np.allclose(ops.linear(x, w), x @ w.T)  # off until enabled
    be.enabled = True
    got = ops.linear(x, w)
    want = matvec_x8_ref(raw, qtype, x, planes)
    exact = x @ w.T
    np.testing.assert_allclose(got, want, atol=(1e-4 if planes == 1 else 1e-6) * np.abs(want).max())
    assert np.abs(got - exact).max() > 0
    if planes == 2:  # the second plane: the product 100x nearer the float one than one plane's
        one = matvec_x8_ref(raw, qtype, x, 1)
        assert np.abs(got - exact).max() < np.abs(one - exact).max() / 100
    x3 = rng.standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_array_equal(ops.linear(x3, w), x3 @ w.T)


@pytest.mark.parametrize("qtype_o,qtype_p,groups,planes", [(T.Q6_K, T.Q4_K, 8, 2), (T.Q4_K, T.Q6_K, 16, 2),
                                                            (T.Q4_K, T.Q4_K, 4, 1)], ids=str)
def test_split_rms_norm_over_int8_x(qtype_o, qtype_p, groups, planes):
    """The split RMSNorm (decode's o or down projection storing xg = h * g and the parts of
    sum h^2) over int8 x: the residual product reads its x in int8 form and also stores xg's
    (each row block's 16 or 32 rows whole half blocks; 4 groups asked: 8 taken), bit for bit
    quantize_x_ref of the xg it wrote; the norm's readers over that form with x_norm give
    1/rms times matvec_x8_ref of xg."""
    check_split_rms_norm_over_int8_x(qtype_o, qtype_p, groups, planes, 256, 512, 16)


def check_split_rms_norm_over_int8_x(qtype_o, qtype_p, groups, planes, d, k_in, n_out):
    """test_split_rms_norm_over_int8_x at d rows of k_in columns, readers of n_out rows (the
    GPU tests run it at model shapes; groups None: the launch's own choice)."""
    from luce.kernels.matvec_fast import matvec_fast_norm, norm_parts_max
    rng = np.random.default_rng(int(qtype_o) * 7 + (groups or 0) + planes)
    eps = 1e-6
    dev = cuda.to_device
    wo = weights(rng, qtype_o, d, k_in)
    a = rng.standard_normal(k_in).astype(np.float32)
    h = (3 * rng.standard_normal(d)).astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    h_dev, xg, parts = dev(h), nan_device(d), nan_device(norm_parts_max(d))
    xq_out = dev(np.full(xq_size(d, 1, planes), 0xFFFF, np.uint16))  # poisoned
    a_dev = dev(a)
    n_parts = matvec_fast_norm(dev(wo), qtype_o, a_dev, h_dev, dev(g), xg, parts, groups=groups,
                               xq=quantize_x(a_dev, planes=planes), xq_out=xq_out)
    assert groups is None or n_parts == -(-d // (2 * max(groups, 8)))
    h1 = h_dev.copy_to_host()
    want_h1 = matvec_x8_ref(wo, qtype_o, a, planes) + h
    _, scale = _x8_bound(wo, qtype_o, a, planes)
    assert (np.abs(h1 - want_h1) <= 1e-5 * scale.reshape(-1) + 1e-5).all()
    xg_h = xg.copy_to_host()
    np.testing.assert_allclose(xg_h, h1 * g, rtol=1e-6)
    assert_same_form(xq_out.copy_to_host(), quantize_x_ref(xg_h, planes), planes, rtol=1e-5, atol=1e-4)
    rs = 1 / np.sqrt((h1.astype(np.float64) ** 2).mean() + eps)
    x_norm = (parts, n_parts, eps)
    wa, up = weights(rng, qtype_p, n_out, d), weights(rng, qtype_p, n_out, d)
    bias = rng.standard_normal(n_out).astype(np.float32)
    out = nan_device(n_out)
    matvec_fast(dev(wa), qtype_p, xg, out=out, bias=dev(bias), x_norm=x_norm, xq=xq_out)
    want = rs * matvec_x8_ref(wa, qtype_p, xg_h, planes) + bias
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    out = nan_device(n_out)
    swiglu_fast(dev(wa), dev(up), qtype_p, xg, out=out, x_norm=x_norm, xq=xq_out)
    yg, yu = rs * matvec_x8_ref(wa, qtype_p, xg_h, planes), rs * matvec_x8_ref(up, qtype_p, xg_h, planes)
    want = yg * 0.5 * (1 + np.tanh(yg / 2)) * yu
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="xq_out"):
        matvec_fast_norm(dev(wo), qtype_o, a_dev, h_dev, dev(g), xg, parts, xq_out=xq_out[:-8])


@pytest.mark.parametrize("qtype,groups,planes,act", [(T.Q4_K, 8, 2, "silu"), (T.Q6_K, 16, 2, "silu"),
                                                     (T.Q4_K, 2, 1, "silu"), (T.Q6_K, 8, 2, "gelu_tanh")], ids=str)
def test_gated_product_stores_its_int8_form(qtype, groups, planes, act):
    """swiglu_fast's xq_out: the gated product also stores its output in quantize_x form
    (the down projection's int8 x, no launch of its own), bit for bit quantize_x_ref of the
    output it wrote; 2 groups asked: 8 taken (whole half blocks a row block); GeGLU too."""
    check_gated_int8_out(qtype, groups, planes, 96, 256, act)


def check_gated_int8_out(qtype, groups, planes, n_rows, n_cols, act="silu"):
    """test_gated_product_stores_its_int8_form at n_rows x n_cols (also the GPU tests');
    act="gelu_tanh": Gemma's GeGLU."""
    from luce.kernels.activation import geglu_ref
    rng = np.random.default_rng(int(qtype) + (groups or 0) + 10 * planes)
    g, u = weights(rng, qtype, n_rows, n_cols), weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal(n_cols).astype(np.float32)
    xd = cuda.to_device(x)
    xq_out = cuda.to_device(np.full(xq_size(n_rows, 1, planes), 0xFFFF, np.uint16))
    out = nan_device(n_rows)
    swiglu_fast(cuda.to_device(g), cuda.to_device(u), qtype, xd, out=out, xq=quantize_x(xd, planes=planes),
                xq_out=xq_out, groups=groups, act=act)
    got = out.copy_to_host()
    yg, yu = matvec_x8_ref(g, qtype, x, planes), matvec_x8_ref(u, qtype, x, planes)
    want = geglu_ref(yg, yu) if act == "gelu_tanh" else yg * 0.5 * (1 + np.tanh(yg / 2)) * yu
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert_same_form(xq_out.copy_to_host(), quantize_x_ref(got, planes), planes, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="xq_out"):  # two x rows: no
        swiglu_fast(cuda.to_device(g), cuda.to_device(u), qtype, cuda.to_device(np.stack([x, x])),
                    out=nan_device((2, n_rows)), xq_out=xq_out)
