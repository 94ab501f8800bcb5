"""The tensor-core Q4_K / Q6_K small-M product on the GPU at Qwen3-8B's layer shapes, 1 to 32 rows
of x (one to four B fragments, one or two tiles a warp), plain and gated, against the float64
reference (f16 inputs: 2^-9 of sum |w| |x|); a token's outputs are the same bits alone and
among 23; and its bench rows."""
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for test_dequant
from test_dequant import random_tensor  # noqa: E402

pytestmark = [pytest.mark.gpu]
if cuda.config.ENABLE_CUDASIM or not cuda.is_available():
    pytestmark.append(pytest.mark.skip(reason="needs a CUDA GPU (NUMBA_ENABLE_CUDASIM=0)"))

from luce.kernels.dequant import dequantize  # noqa: E402
from luce.kernels.matvec import matvec_ref  # noqa: E402
from luce.kernels.matvec_mma import matvec_mma  # noqa: E402


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_x", [1, 8, 23, 32])
@pytest.mark.parametrize("n_out,k", [(12288, 4096), (4096, 12288), (1000, 4096)])
def test_matvec_mma_gpu(qtype, n_x, n_out, k):
    rng = np.random.default_rng(n_x + n_out)
    raw = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    out = cuda.to_device(np.full((n_x, n_out), np.nan, np.float32))
    got = matvec_mma(cuda.to_device(raw), qtype, cuda.to_device(x), n_out, out=out).copy_to_host()
    want = matvec_ref(raw, qtype, x)
    bound = np.abs(x) @ np.abs(dequantize(raw.reshape(-1), qtype, (n_out, k))).T
    assert np.isfinite(got).all()
    err = np.abs(got - want)
    assert (err <= 2.0 ** -9 * bound + 1e-5).all(), float((err / bound).max())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_matvec_mma_gated_gpu(qtype):
    from luce.kernels.matvec import swiglu_ref
    rng = np.random.default_rng(5)
    n_out, k, n_x = 12288, 4096, 23
    wg = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    wu = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    x = (1e-3 * rng.standard_normal((n_x, k))).astype(np.float32)  # random scales are large
    got = matvec_mma(cuda.to_device(wg), qtype, cuda.to_device(x), n_out, w_up=cuda.to_device(wu)).copy_to_host()
    g, u = matvec_ref(wg, qtype, x), matvec_ref(wu, qtype, x)
    bg = np.abs(x) @ np.abs(dequantize(wg.reshape(-1), qtype, (n_out, k))).T
    bu = np.abs(x) @ np.abs(dequantize(wu.reshape(-1), qtype, (n_out, k))).T
    err = np.abs(got - swiglu_ref(wg, wu, qtype, x))
    assert (err <= 2.0 ** -9 * (1.1 * np.abs(u) * bg + np.abs(g) * bu) + 1e-5).all()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_matvec_mma_same_bits_at_every_width_gpu(qtype):
    """Decode (one token) and verification (23) give a token the same outputs, bit for bit."""
    rng = np.random.default_rng(3)
    n_out, k = 4096, 12288
    w = cuda.to_device(random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1))
    x = rng.standard_normal((23, k)).astype(np.float32)
    wide = matvec_mma(w, qtype, cuda.to_device(x), n_out).copy_to_host()
    for i in (0, 7, 22):
        alone = matvec_mma(w, qtype, cuda.to_device(x[i:i + 1]), n_out).copy_to_host()
        assert np.array_equal(alone[0], wide[i])


def test_bench_matvec_mma_rows():
    from luce.bench.kernels_matvec_mma import bench_matvec_mma
    rows = bench_matvec_mma(rows=(1, 23), shapes=(("Q4_K", 4096, 12288, True),), reps=3)
    assert [r["rows"] for r in rows] == [1, 23] and all(r["time_us"] > 0 and r["current_us"] > 0 for r in rows)


@pytest.mark.parametrize("gated", [False, True])
def test_matvec_mma_rows_past_f16_range_gpu(gated):
    """23 rows of x at the down projection's shape, two of them past f16's 65504: finite,
    within the bound; the others the same bits as without them."""
    rng = np.random.default_rng(9)
    qtype, n_out, k, n_x = T.Q6_K, 4096, 12288, 23
    raw = random_tensor(rng, qtype, (n_out, k)).reshape(n_out, -1)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    x[3] *= 2e5
    x[17, 100] = 5e6
    w = cuda.to_device(raw)
    up = w if gated else None
    got = matvec_mma(w, qtype, cuda.to_device(x), n_out, w_up=up).copy_to_host()
    assert np.isfinite(got).all()
    if not gated:
        rows = [i for i in range(n_x) if i != 17]  # 17: one huge value times weights whose f16 decode is loose
        bound = np.abs(x[rows]) @ np.abs(dequantize(raw.reshape(-1), qtype, (n_out, k))).T
        assert (np.abs(got[rows] - matvec_ref(raw, qtype, x)[rows]) <= 2.0 ** -9 * bound + 1e-5).all()
    plain = [i for i in range(n_x) if i not in (3, 17)]
    alone = matvec_mma(w, qtype, cuda.to_device(x[plain]), n_out, w_up=up).copy_to_host()
    np.testing.assert_array_equal(got[plain], alone)


@pytest.mark.parametrize("n_x,k", [(23, 4096), (2, 5120), (32, 4096)])
def test_rms_norm_frags_gpu(n_x, k):
    """The RMSNorm with both layouts' fragments in one launch, at the 8B/32B hidden sizes:
    the norm against numpy, each layout bit for bit x_frags of that norm (rows past n_x:
    zeros), buffers filled with f16 NaNs first."""
    from luce.kernels.matvec_mma import _scratch, rms_norm_frags, x_frags
    from luce.kernels.norm import rms_norm_ref
    rng = np.random.default_rng(n_x + k)
    x = (3 * rng.standard_normal((n_x, k))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    rows8 = -(-n_x // 8) * 8
    for qt in (T.Q4_K, T.Q6_K):
        _scratch(rows8, k, qt, 0)[0].copy_to_device(np.full(rows8 * k // 2, 0x7E007E00, np.uint32))
    h = cuda.to_device(np.full((n_x, k), np.nan, np.float32))
    got = {qt: f.copy_to_host() for qt, (f, _) in rms_norm_frags(cuda.to_device(x), cuda.to_device(w), 1e-6, h).items()}
    h_host = h.copy_to_host()
    np.testing.assert_allclose(h_host, rms_norm_ref(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    for qt in (T.Q4_K, T.Q6_K):
        assert np.array_equal(got[qt], x_frags(cuda.to_device(h_host), qt, guard=False)[0].copy_to_host()), qt


@pytest.mark.parametrize("n_x", [2, 23])
@pytest.mark.parametrize("third", [False, True], ids=["qk", "qkv"])
def test_matvec_mma_pair_gpu(n_x, third):
    """Verification's q and k projections in one launch at the 8B shape (4096 + 1024 rows of
    Q4_K over 4096), and with v (1024 rows of Q6_K) as the launch's third weight, each
    against the float64 reference."""
    from luce.kernels.matvec_mma import matvec_mma_pair
    rng = np.random.default_rng(n_x)
    k = 4096
    shapes = [(T.Q4_K, 4096), (T.Q4_K, 1024)] + ([(T.Q6_K, 1024)] if third else [])
    raws = [random_tensor(rng, qt, (n, k)).reshape(n, -1) for qt, n in shapes]
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    outs = [cuda.to_device(np.full((n_x, n), np.nan, np.float32)) for _, n in shapes]
    t3 = (cuda.to_device(raws[2]), T.Q6_K, 1024, outs[2], None, None) if third else None
    matvec_mma_pair(cuda.to_device(raws[0]), cuda.to_device(raws[1]), T.Q4_K, cuda.to_device(x), 4096, 1024,
                    outs[0], outs[1], third=t3)
    for (qt, _), raw, out in zip(shapes, raws, outs):
        got = out.copy_to_host()
        bound = np.abs(x) @ np.abs(dequantize(raw.reshape(-1), qt, (raw.shape[0], k))).T
        assert np.isfinite(got).all()
        assert (np.abs(got - matvec_ref(raw, qt, x)) <= 2.0 ** -9 * bound + 1e-5).all()


@pytest.mark.parametrize("n_x", [2, 23])
def test_gated_frags_out_gpu(n_x):
    """The gated FFN at the 8B shape also writing its output's fragments (the down
    projection's x): the outputs the same bits as without, and after frags_fixup each
    layout bit for bit what x_frags makes of them, a row past f16's range scaled alike."""
    from luce.kernels.matvec_mma import _scratch, frags_fixup, x_frags
    rng = np.random.default_rng(n_x)
    n_out, k = 12288, 4096
    wg, wu = (cuda.to_device(random_tensor(rng, T.Q4_K, (n_out, k)).reshape(n_out, -1)) for _ in range(2))
    x = (1e-3 * rng.standard_normal((n_x, k))).astype(np.float32)  # random scales are large
    x[n_x - 1] *= 30  # outputs past 2**15
    xd = cuda.to_device(x)
    plain = matvec_mma(wg, T.Q4_K, xd, n_out, w_up=wu).copy_to_host()
    rows8 = -(-n_x // 8) * 8
    for qt in (T.Q4_K, T.Q6_K):  # garbage first: rows past n_x must come out zero
        _scratch(rows8, n_out, qt, 0, True)[0].copy_to_device(np.full(rows8 * n_out // 2, 0x7E007E00, np.uint32))
    out = matvec_mma(wg, T.Q4_K, xd, n_out, w_up=wu, frags_out=True)
    h = out.copy_to_host()
    np.testing.assert_array_equal(h, plain)
    assert np.abs(h[n_x - 1]).max() >= 2 ** 15
    for qt in (T.Q4_K, T.Q6_K):
        got, got_s = (a.copy_to_host() for a in frags_fixup(out, qt, gated_out=True))
        want, want_s = (a.copy_to_host() for a in x_frags(cuda.to_device(h), qt))
        assert np.array_equal(got, want), qt
        assert np.array_equal(got_s[:rows8], want_s[:rows8]) and got_s[n_x - 1] > 1, qt


@pytest.mark.parametrize("n_x", [1, 23])
def test_matvec_mma_q6_k_groups_layout_gpu(n_x):
    """The verification products over the Q6_K groups copy (layout="g8") at the down shape:
    the GGUF layout's bits, and within the reference's bound."""
    from luce.kernels.q6k_groups import g8_ref
    rng = np.random.default_rng(9)
    n_out, k = 4096, 12288
    raw = random_tensor(rng, T.Q6_K, (n_out, k)).reshape(n_out, -1)
    x = cuda.to_device(rng.standard_normal((n_x, k)).astype(np.float32))
    plain = matvec_mma(cuda.to_device(raw), T.Q6_K, x, n_out).copy_to_host()
    grouped = matvec_mma(cuda.to_device(g8_ref(raw, n_out, k)), T.Q6_K, x, n_out, layout="g8").copy_to_host()
    np.testing.assert_array_equal(grouped, plain)
    want = matvec_ref(raw, T.Q6_K, x.copy_to_host())
    bound = np.abs(x.copy_to_host()) @ np.abs(dequantize(raw.reshape(-1), T.Q6_K, (n_out, k))).T
    assert (np.abs(grouped - want) <= 2.0 ** -9 * bound + 1e-5).all()


@pytest.mark.parametrize("n_x", [2, 23])
@pytest.mark.parametrize("what", ["o", "down_g8"])
def test_matvec_mma_norm_gpu(n_x, what):
    """matvec_mma_norm at the 8B shape's o and down (over the groups copy) projections: the
    residual stream the bits of matvec_mma's residual form, each layout's fragments bit for
    bit x_frags of residual * norm_w * the prescale (the last launch's 1 / rms), the row
    scales 1 / rms over it (float32 rounding), and again in a second launch (the block
    counter reset by the last block)."""
    from luce.kernels.matvec_mma import _norm_scratch, matvec_mma_norm, x_frags
    from luce.kernels.q6k_groups import g8_ref
    rng = np.random.default_rng(n_x)
    qt, k = (T.Q4_K, 4096) if what == "o" else (T.Q6_K, 12288)
    n_out = 4096
    raw = random_tensor(rng, qt, (n_out, k)).reshape(n_out, -1)
    w = cuda.to_device(g8_ref(raw, n_out, k) if what == "down_g8" else raw)
    layout = "g8" if what == "down_g8" else None
    x = cuda.to_device((1e-3 * rng.standard_normal((n_x, k))).astype(np.float32))
    res = (3 * rng.standard_normal((n_x, n_out))).astype(np.float32)
    gw = rng.uniform(0.5, 1.5, n_out).astype(np.float32)
    want = matvec_mma(w, qt, x, n_out, residual=cuda.to_device(res), layout=layout).copy_to_host()
    for _ in range(2):
        r = cuda.to_device(res)
        rows8 = -(-n_x // 8) * 8
        sp = _norm_scratch(rows8, n_out, 0)[3].copy_to_host()[:n_x, None]
        frags = matvec_mma_norm(w, qt, x, r, cuda.to_device(gw), 1e-6, layout=layout)
        got = r.copy_to_host()
        np.testing.assert_array_equal(got, want)
        inv = 1 / np.sqrt((got.astype(np.float64) ** 2).mean(1) + 1e-6)
        for lt in (T.Q4_K, T.Q6_K):
            f, sc = (a.copy_to_host() for a in frags[lt])
            assert np.array_equal(f, x_frags(cuda.to_device(got * gw * sp), lt, guard=False)[0].copy_to_host()), lt
            np.testing.assert_allclose(sc[:n_x], inv / sp[:, 0], rtol=3e-6)
