"""The tensor-core Q4_K / Q6_K small-M product (luce.kernels.matvec_mma) in the CUDA simulator:
1, 3, 5, 9 and 11 rows of x (one and two B fragments, partial), output rows that end inside a
tile (one or two 16-row tiles a warp), K split over the block's warps unevenly (5 blocks over
4 warps, 3 over 2), Q6_K blocks at both alignments (even and odd blocks), and the gated form,
against the float64 reference of the dequantized weights; a NaN-filled output shows unwritten
elements. Weights and x enter the mma as f16 (as in the prefill matmul): the bound is 2^-9 of
sum |w| |x|."""
import numpy as np
import pytest
from numba import cuda

from luce.kernels.dequant import T
from luce.kernels.matvec import matvec_ref
from luce.kernels.matvec_mma import (_norm_scratch, _scratch, frag_col, frag_u16, matvec_mma, matvec_mma_norm,
                                     matvec_mma_pair, rms_norm_frags, x_frags)
from tests.test_dequant import abs_terms, random_tensor
from tests.ptx_background import assert_ptx_ok, background_ptx_check

rng = np.random.default_rng(7)


def _bound(raw, qtype, x, n_out, k):
    # sum |x| (|s q| + |min|): the weights' f16 decode rounds relative to the terms, not |w|
    return np.abs(x) @ abs_terms(raw, qtype, (n_out, k)).T


@pytest.mark.parametrize("qtype,n_x,n_out,k,tiles,warps", [
    (T.Q4_K, 1, 24, 512, 1, 2), (T.Q4_K, 5, 16, 1280, 1, 4), (T.Q4_K, 11, 40, 256, 2, 1),
    (T.Q6_K, 3, 40, 768, 2, 2), (T.Q6_K, 9, 16, 512, 1, 1)])
def test_matvec_mma(qtype, n_x, n_out, k, tiles, warps):
    raw = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    out = cuda.to_device(np.full((n_x, n_out), np.nan, np.float32))
    got = matvec_mma(cuda.to_device(raw), qtype, cuda.to_device(x), n_out, out=out, tiles=tiles,
                     warps=warps).copy_to_host()
    want = matvec_ref(raw, qtype, x)
    assert not np.isnan(got).any()
    err = np.abs(got - want)
    bound = _bound(raw, qtype, x, n_out, k)
    assert np.all(err <= 2.0 ** -9 * bound + 1e-6), (err / bound).max()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_matvec_mma_gated_bias_residual(qtype):
    from luce.kernels.matvec import swiglu_ref
    n_x, n_out, k = 3, 20, 512
    wg = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    wu = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    out = cuda.to_device(np.full((n_x, n_out), np.nan, np.float32))
    got = matvec_mma(cuda.to_device(wg), qtype, cuda.to_device(x), n_out, out=out, warps=2,
                     w_up=cuda.to_device(wu)).copy_to_host()
    want = swiglu_ref(wg, wu, qtype, x)
    g, u = matvec_ref(wg, qtype, x), matvec_ref(wu, qtype, x)
    # d(silu(g) u) = silu'(g) u dg + silu(g) du, |silu'| <= 1.1
    bound = 1.1 * np.abs(u) * _bound(wg, qtype, x, n_out, k) + np.abs(g) * _bound(wu, qtype, x, n_out, k)
    assert np.all(np.abs(got - want) <= 2.0 ** -9 * bound + 1e-5)
    # bias and the residual stream updated in place
    res = rng.standard_normal((n_x, n_out)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32)
    r_dev = cuda.to_device(res)
    matvec_mma(cuda.to_device(wg), qtype, cuda.to_device(x), n_out, out=r_dev, residual=r_dev,
               bias=cuda.to_device(bias))
    want = g + bias + res
    assert np.all(np.abs(r_dev.copy_to_host() - want) <= 2.0 ** -9 * _bound(wg, qtype, x, n_out, k) + 1e-5)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_matvec_mma_x_past_f16_range(qtype):
    """Rows of x past f16's largest value (65504: a SwiGLU product of a random-weight model
    reaches 1e5) are scaled into range and back: finite, within the same relative bound,
    plain and gated; a row of small values beside them is computed as if alone (bit for bit:
    its scale stays 1)."""
    n_x, n_out, k = 3, 16, 256
    raw = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    x[0] *= 3e5
    x[1, 7] = -2.5e6
    w_dev = cuda.to_device(raw)
    got = matvec_mma(w_dev, qtype, cuda.to_device(x), n_out).copy_to_host()
    assert np.isfinite(got).all()
    err = np.abs(got - matvec_ref(raw, qtype, x))
    assert np.all(err <= 2.0 ** -9 * _bound(raw, qtype, x, n_out, k) + 1e-6)
    alone = matvec_mma(w_dev, qtype, cuda.to_device(x[2:]), n_out).copy_to_host()
    np.testing.assert_array_equal(got[2], alone[0])
    gated = matvec_mma(w_dev, qtype, cuda.to_device(x), n_out, w_up=w_dev).copy_to_host()
    assert np.isfinite(gated).all()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_frag_cols_cover_each_block_once(qtype):
    fc = getattr(frag_col, "py_func", frag_col)  # on a GPU, a device function: its Python form
    cols = sorted(fc(int(qtype == T.Q4_K), c, s) + i for c in range(4) for s in range(16) for i in range(4))
    assert cols == list(range(256))


@pytest.mark.parametrize("qtype,n_a,n_b,biased", [(T.Q4_K, 24, 16, True), (T.Q6_K, 16, 8, False)],
                         ids=["Q4_K-tile-across", "Q6_K"])
def test_matvec_mma_pair(qtype, n_a, n_b, biased):
    """Two weights in one launch (verification's q and k): each output against the float64
    reference; 24 + 16 rows put W_b's first rows in the tile after W_a's last ones."""
    n_x, k = 3, 512
    ra = random_tensor(rng, qtype, (n_a, k)).reshape(n_a, -1)
    rb = random_tensor(rng, qtype, (n_b, k)).reshape(n_b, -1)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    ba = rng.standard_normal(n_a).astype(np.float32) if biased else None
    bb = rng.standard_normal(n_b).astype(np.float32) if biased else None
    oa = cuda.to_device(np.full((n_x, n_a), np.nan, np.float32))
    ob = cuda.to_device(np.full((n_x, n_b), np.nan, np.float32))
    dev = lambda a: None if a is None else cuda.to_device(a)  # noqa: E731
    matvec_mma_pair(cuda.to_device(ra), cuda.to_device(rb), qtype, cuda.to_device(x), n_a, n_b, oa, ob,
                    dev(ba), dev(bb))
    for got, raw, bias, n in ((oa, ra, ba, n_a), (ob, rb, bb, n_b)):
        got = got.copy_to_host()
        assert not np.isnan(got).any()
        err = np.abs(got - matvec_ref(raw, qtype, x, bias=bias))
        assert np.all(err <= 2.0 ** -9 * _bound(raw, qtype, x, n, k) + 1e-6)


@pytest.mark.parametrize("qt_c,plain_tiles,biased", [(T.Q6_K, 0, False), (T.Q4_K, 2, True)],
                         ids=["Q6_K-third", "Q4_K-third-two-tiles"])
def test_matvec_mma_pair_with_a_third_weight(monkeypatch, qt_c, plain_tiles, biased):
    """q, k and v in one launch: the third weight's rows (another type, a partial last tile)
    against the reference, and bit for bit what its own launch with the pair's plan gives
    (the same sums in the same order); a misaligned pair is refused."""
    import luce.kernels.matvec_mma as M
    monkeypatch.setattr(M, "PLAIN_TILES", plain_tiles)
    n_x, k, n_a, n_b, n_c = 5, 512, 48, 16, 24
    ra, rb = (random_tensor(rng, T.Q4_K, (n, k)).reshape(n, -1) for n in (n_a, n_b))
    rc = random_tensor(rng, qt_c, (n_c, k)).reshape(n_c, -1)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    dev = lambda a: None if a is None else cuda.to_device(a)  # noqa: E731
    ba, bb, bc = ((rng.standard_normal(n).astype(np.float32) if biased else None) for n in (n_a, n_b, n_c))
    oa, ob, oc = (cuda.to_device(np.full((n_x, n), np.nan, np.float32)) for n in (n_a, n_b, n_c))
    xd = cuda.to_device(x)
    M.matvec_mma_pair(dev(ra), dev(rb), T.Q4_K, xd, n_a, n_b, oa, ob, dev(ba), dev(bb),
                      third=(dev(rc), qt_c, n_c, oc, dev(bc), None))
    for got, raw, qt, bias, n in ((oa, ra, T.Q4_K, ba, n_a), (ob, rb, T.Q4_K, bb, n_b), (oc, rc, qt_c, bc, n_c)):
        got = got.copy_to_host()
        assert not np.isnan(got).any()
        err = np.abs(got - matvec_ref(raw, qt, x, bias=bias))
        assert np.all(err <= 2.0 ** -9 * _bound(raw, qt, x, n, k) + 1e-6)
    tiles, warps = M.plan(n_x, n_a + n_b, k)
    assert M.third_align(n_x, n_a + n_b, k) == 16 * (plain_tiles or 1)
    alone = M.matvec_mma(dev(rc), qt_c, xd, n_c, bias=dev(bc), tiles=tiles, warps=warps).copy_to_host()
    np.testing.assert_array_equal(oc.copy_to_host(), alone)
    if plain_tiles:
        with pytest.raises(ValueError, match="multiple of 32"):
            M.matvec_mma_pair(dev(ra), dev(rb[:8]), T.Q4_K, xd, n_a, 8, oa, ob, dev(ba), dev(bb[:8]),
                              third=(dev(rc), qt_c, n_c, oc, dev(bc), None))


def test_rms_norm_frags_is_the_norm_then_both_conversions():
    """One launch for an RMSNorm and its fragments in both layouts: h against the numpy
    norm, and each layout bit for bit what x_frags makes of that h (rows past n_x
    included: zeros), into buffers filled with garbage first."""
    from luce.kernels.dequant import T as QT
    from luce.kernels.norm import rms_norm_ref
    n_x, k = 5, 512
    x = (3 * rng.standard_normal((n_x, k))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    for qt in (QT.Q4_K, QT.Q6_K):
        _scratch(8, k, qt, 0)[0].copy_to_device(np.full(8 * k // 2, 0x7E007E00, np.uint32))  # f16 NaNs
    h = cuda.to_device(np.full((n_x, k), np.nan, np.float32))
    got = {qt: (f.copy_to_host(), sc.copy_to_host()[:8]) for qt, (f, sc) in
           rms_norm_frags(cuda.to_device(x), cuda.to_device(w), 1e-6, h).items()}
    h_host = h.copy_to_host()
    np.testing.assert_allclose(h_host, rms_norm_ref(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    for qt in (QT.Q4_K, QT.Q6_K):
        want, scales = x_frags(cuda.to_device(h_host), qt, guard=False)
        assert np.array_equal(got[qt][0], want.copy_to_host()), qt
        assert np.all(got[qt][1] == 1) and np.all(scales.copy_to_host()[:8] == 1)


@pytest.mark.parametrize("qtype,n_x,passes", [(T.Q4_K, 3, (False, True, False))], ids=str)
def test_matvec_mma_norm_leaves_the_norm_to_the_next_product(qtype, n_x, passes):
    # Q6_K, 23 rows and the groups layout: tests/gpu/test_matvec_mma_gpu.py (~70 s a case here)
    """matvec_mma_norm: the residual stream updated in place as matvec_mma's residual form
    makes it; each layout's fragments bit for bit x_frags of residual * norm_w * the
    prescale (the rows' 1 / rms the last launch left; rows past n_x zeros, over NaN
    garbage), the row scales 1 / rms over the prescale within float32 rounding and the new
    1 / rms left for the next launch, and a row past f16's range written as the norm itself
    with scale 1 (its flag cleared: the next launch's rows get scales again, even over a
    prescale a million times off). The next product over those fragments is the product of
    the numpy norm."""
    from luce.kernels.norm import rms_norm_ref
    n_out, k = 256, 256  # 16 blocks of 16 rows: the last block sums 16 partials a row
    w = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    x = (1e-3 * rng.standard_normal((n_x, k))).astype(np.float32)  # the random scales are large
    res = (3 * rng.standard_normal((n_x, n_out))).astype(np.float32)
    gw = rng.uniform(0.5, 1.5, n_out).astype(np.float32)
    eps = 1e-6
    rows8 = -(-n_x // 8) * 8
    w_dev, x_dev, gw_dev = cuda.to_device(w), cuda.to_device(x), cuda.to_device(gw)
    want_res = matvec_mma(w_dev, qtype, x_dev, n_out, residual=cuda.to_device(res)).copy_to_host()
    for p, big in enumerate(passes):
        r = res.copy()
        if big:
            r[1] *= 1e6  # x w reaches past 2^15 even prescaled
        for qt in (T.Q4_K, T.Q6_K):
            _scratch(rows8, n_out, qt, 0, 2)[0].copy_to_device(np.full(rows8 * n_out // 2, 0x7E007E00, np.uint32))
        r_dev = cuda.to_device(r)
        invs = _norm_scratch(rows8, n_out, 0)[3]
        sp = invs.copy_to_host()[:n_x, None]
        sp = np.where((sp > 0) & np.isfinite(sp), sp, np.float32(1))
        frags = matvec_mma_norm(w_dev, qtype, x_dev, r_dev, gw_dev, eps)
        got_res = r_dev.copy_to_host()
        want = want_res.copy()
        if big:
            want[1] = matvec_mma(w_dev, qtype, x_dev, n_out, residual=cuda.to_device(r)).copy_to_host()[1]
        assert np.array_equal(got_res, want), big
        inv = 1 / np.sqrt((got_res.astype(np.float64) ** 2).mean(1) + eps)
        np.testing.assert_allclose(invs.copy_to_host()[:n_x], inv, rtol=2e-6)
        h = rms_norm_ref(got_res, gw, eps)
        for qt in (T.Q4_K, T.Q6_K):
            f, sc = (a.copy_to_host() for a in frags[qt])
            want_f = x_frags(cuda.to_device(got_res * gw * sp), qt, guard=False)[0].copy_to_host()
            if not big:
                assert np.array_equal(f, want_f), qt
                np.testing.assert_allclose(sc[:n_x], inv / sp[:, 0], rtol=3e-6)
                continue
            norm_f = x_frags(cuda.to_device(h), qt, guard=False)[0].copy_to_host()
            # row 1 as the norm (its inv from the kernel's sums: within f16's rounding of
            # the numpy one), the other rows untouched
            fu = getattr(frag_u16, "py_func", frag_u16)
            row1 = np.zeros(f.shape, bool)
            row1[[fu(int(qt == T.Q4_K), c, 1, rows8) for c in range(n_out)]] = True
            assert np.array_equal(f[~row1], want_f[~row1]), qt
            np.testing.assert_allclose(f[row1].view(np.float16).astype(np.float32),
                                       norm_f[row1].view(np.float16).astype(np.float32), rtol=2e-3, atol=1e-4)
            assert sc[1] == 1 and np.allclose(np.delete(sc[:n_x], 1), np.delete(inv / sp[:, 0], 1), rtol=3e-6), qt
        if p:
            continue
        # the next product over the fragments against the numpy norm's product
        w2 = random_tensor(rng, T.Q4_K, (16, n_out)).reshape(16, -1)
        got = matvec_mma(cuda.to_device(w2), T.Q4_K, cuda.to_device(h), 16, frags=frags[T.Q4_K]).copy_to_host()
        ref = matvec_ref(w2, T.Q4_K, h)
        assert np.all(np.abs(got - ref) <= 2.0 ** -8 * _bound(w2, T.Q4_K, h, 16, n_out) + 1e-5), big


def test_gated_writes_its_outputs_fragments():
    """frags_out: the gated kernel's outputs also go into both layouts' fragments (rows past
    n_x zeros, over NaN garbage; buffers of their own, so n_out == K is fine), and after
    frags_fixup they are bit for bit what x_frags makes of the output, with a row past f16's
    range flagged and scaled."""
    from luce.kernels.dequant import T as QT
    from luce.kernels.matvec_mma import frags_fixup
    n_x, n = 5, 256
    wg, wu = (cuda.to_device(random_tensor(rng, QT.Q4_K, (n, n)).reshape(n, -1)) for _ in range(2))
    x = (1e-3 * rng.standard_normal((n_x, n))).astype(np.float32)  # the random scales are large
    x[2] *= 30  # its outputs reach ~1e5
    for qt in (QT.Q4_K, QT.Q6_K):
        _scratch(8, n, qt, 0, True)[0].copy_to_device(np.full(8 * n // 2, 0x7E007E00, np.uint32))
    out = matvec_mma(wg, QT.Q4_K, cuda.to_device(x), n, warps=1, w_up=wu, frags_out=True)
    h = out.copy_to_host()
    assert np.abs(h[2]).max() >= 2 ** 15 > np.abs(np.delete(h, 2, 0)).max()
    for qt in (QT.Q4_K, QT.Q6_K):
        got, got_s = (a.copy_to_host() for a in frags_fixup(out, qt, gated_out=True))
        want, want_s = (a.copy_to_host() for a in x_frags(cuda.to_device(h), qt))
        assert np.array_equal(got, want), qt
        assert np.array_equal(got_s[:8], want_s[:8]) and got_s[2] > 1, qt


def test_fixup_scales_flagged_rows_and_clears_the_flags():
    """Over a row of 1,024 columns, the flagged rows come out as the conversion of the row
    scaled by its power of two and the others untouched, the scales are set, and the flags
    are left zeroed for the next call (whose unflagged rows get scale 1 again)."""
    from luce.kernels.dequant import T as QT
    n_x, k = 5, 1024
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    x[1] *= 4e4
    x[3, 100] = -9e5
    for qt in (QT.Q4_K, QT.Q6_K):
        got, got_s = (a.copy_to_host() for a in x_frags(cuda.to_device(x), qt))
        want_x = x.copy()
        for t in (1, 3):
            down = 1.0
            while np.abs(x[t]).max() * down >= 2 ** 15:
                down /= 2
            want_x[t] *= np.float32(down)
            assert got_s[t] == np.float32(1 / down) > 1, (qt, t)
        want = x_frags(cuda.to_device(want_x), qt, guard=False)[0].copy_to_host()
        np.testing.assert_array_equal(got, want)
        assert np.all(got_s[[0, 2, 4]] == 1)
        _, flags, _ = _scratch(8, k, qt, 0)
        assert not flags.copy_to_host().any(), qt
        again = x_frags(cuda.to_device(x[[0, 2, 4, 0, 2]]), qt)[1].copy_to_host()
        assert np.all(again[:n_x] == 1), qt


def test_matvec_mma_rejects():
    raw = random_tensor(rng, T.Q4_K, (16, 256)).reshape(16, -1)
    with pytest.raises(ValueError, match="Q4_K and Q6_K only"):
        matvec_mma(cuda.to_device(raw), T.Q8_0, cuda.to_device(np.zeros((1, 256), np.float32)), 16)
    with pytest.raises(ValueError, match="rows"):
        matvec_mma(cuda.to_device(raw), T.Q4_K, cuda.to_device(np.zeros((33, 256), np.float32)), 16)


PTX_CHECK = """
from numba import cuda
from luce.kernels import matvec_mma as M
from luce.kernels.dequant import T
sig = ("void(uint16[::1], uint16[::1], uint16[::1], float32[::1], int64, int64, int64, float32[::1], float32[:, ::1], "
       "int64, int64, float32[:, ::1], int64, float32[::1], float32[:, ::1], uint16[::1], uint16[::1], int32[::1], "
       "int32[::1], uint16[::1], uint16[::1], float32[::1], int64, float32[::1], float32[:, ::1], float32[::1], "
       "float32[::1], int32[::1], float32[::1], float32[::1], float32)")
from luce.kernels.ptx import ptxas_usage
for qt, nt, tiles, warps, gated, pair, frags, third in [
        (T.Q4_K, 1, 1, 4, False, False, False, None), (T.Q4_K, 3, 2, 4, False, False, False, None),
        (T.Q4_K, 4, 1, 8, False, False, False, None), (T.Q4_K, 3, 2, 4, True, False, False, None),
        (T.Q4_K, 4, 2, 4, True, False, False, None), (T.Q6_K, 1, 1, 8, False, False, False, None),
        (T.Q6_K, 3, 2, 8, False, False, False, None), (T.Q6_K, 4, 1, 8, False, False, False, None),
        (T.Q4_K, 1, 1, 1, False, False, False, None), (T.Q4_K, 3, 1, 8, False, True, False, None),
        (T.Q4_K, 3, 2, 8, True, False, True, None), (T.Q4_K, 3, 2, 4, True, False, True, None),
        (T.Q4_K, 3, 2, 8, False, True, False, None), (T.Q4_K, 3, 2, 8, False, True, False, T.Q6_K)]:
    blocks = M._min_blocks(nt, warps, gated, pair, tiles, third is not None)
    code = cuda.compile_ptx(M._kernel(qt, nt, tiles, warps, gated, pair, frags, False, third).py_func, sig,
                            cc=(9, 0), launch_bounds=(32 * warps, blocks))[0]
    assert "mma.sync" in code and ".f64" not in code, (qt, nt, tiles)  # tensor cores, f32
    use = ptxas_usage(code)
    # the blocks launch_bounds asks for fit an SM's registers
    assert use["registers"] * 32 * warps * blocks <= 65536, (qt, nt, tiles, warps, blocks, use)
    # the pair form's 2 blocks an SM cost a few spilled words, measured to pay (_min_blocks);
    # with a third weight of another type, more
    spill = (480 if third else 320) if pair and blocks > 1 else 0
    assert ".local" not in code and use["spill_bytes"] <= spill, \
        (qt, nt, tiles, warps, gated, pair, frags, third, blocks, use)
    print(qt.name, nt, tiles, warps, gated, pair, frags, third, use)
# Q6_K in q6k_groups' layout: aligned loads only (no local memory, no spills)
code = cuda.compile_ptx(M._kernel(T.Q6_K, 3, 2, 8, False, False, False, True).py_func, sig, cc=(9, 0),
                        launch_bounds=(256, M._min_blocks(3, 8, False, False)))[0]
use = ptxas_usage(code)
assert ".local" not in code and use["spill_bytes"] == 0, use
print("Q6_K g8", use)
# matvec_mma_norm's forms (o: Q4_K; down: Q6_K over the groups copy): the block count and the
# row scales' tail cost no spills
for qt, g8 in ((T.Q4_K, False), (T.Q6_K, True)):
    code = cuda.compile_ptx(M._kernel(qt, 3, 2, 8, False, False, False, g8, None, True).py_func, sig, cc=(9, 0),
                            launch_bounds=(256, M._min_blocks(3, 8, False, False)))[0]
    use = ptxas_usage(code)
    assert "atom.global.add" in code and ".local" not in code and use["spill_bytes"] == 0, (qt, use)
    print(qt.name, "norm", use)
for k, sig in [(M._frags_kernel, "void(float32[:, ::1], int64, int64, uint32[::1], int32[::1])"),
               (M._frags_fixup, "void(float32[:, ::1], int64, int64, uint32[::1], int32[::1], float32[::1])"),
               (M._norm_frags_kernel, "void(float32[:, ::1], float32[::1], float32[::1], float32, int64, "
                                      "float32[:, ::1], uint32[::1], uint32[::1], float32[::1])")]:
    code = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))[0]
    assert ".local" not in code and ".f64" not in code
print("PTX OK")
"""


ptx_check = background_ptx_check(PTX_CHECK)


def test_matvec_mma_compiles_to_ptx(ptx_check):
    """The sm_90 code: tensor cores, no local memory, no float64, launchable."""
    assert_ptx_ok(ptx_check)


def test_matvec_mma_q6_k_in_groups_of_eight_blocks():
    """layout="g8" (luce.kernels.q6k_groups): the same sums as the GGUF layout, bit for bit,
    at two tiles a warp and K split over two warps."""
    from luce.kernels.q6k_groups import g8_ref
    n_x, n_out, k = 1, 32, 2048
    raw = random_tensor(rng, T.Q6_K, (n_out, k)).reshape(n_out, -1)
    x = cuda.to_device(rng.standard_normal((n_x, k)).astype(np.float32))
    got = []
    for w, layout in ((raw, None), (g8_ref(raw, n_out, k), "g8")):
        out = cuda.to_device(np.full((n_x, n_out), np.nan, np.float32))
        got.append(matvec_mma(cuda.to_device(w), T.Q6_K, x, n_out, out=out, tiles=2, warps=2,
                              layout=layout).copy_to_host())
    assert not np.isnan(got[0]).any()
    np.testing.assert_array_equal(got[1], got[0])
