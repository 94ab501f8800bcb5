"""luce.kernels.matvec_fast against matvec_ref in the CUDA simulator, plus a PTX compile check.

The simulator runs the same unit functions and index math as the GPU (ld16's two-piece
loads and funnel selects, per-position accumulators, the unit/lane mapping and the
clamped unroll, lane groups on row pairs, warps splitting a row's units); only ldg_*
(plain indexing here, inline asm there) and the lane-group sum (shared memory here,
shuffles there) differ. The default grid here is one warp over 8 row pairs (grid_shape:
every simulated thread is an OS thread); other group and warp counts are asked for by
name. Shapes are chosen so that rows start at every even offset mod 16 (Q6_K, Q8_0), lanes
run partial unroll steps, and the last block holds rows past the end. Outputs are
poisoned with NaN.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import cuda

from luce.kernels.matvec import matvec_ref, swiglu_ref
from luce.kernels import matvec_fast as F
from luce.kernels.matvec_fast import FAST_TYPES, matvec_fast, swiglu_fast
from test_matvec import assert_close, nan_device, weights  # one tolerance for both matvecs
from tests.ptx_background import assert_ptx_ok, background_ptx_check

ID = lambda v: getattr(v, "name", str(v))  # noqa: E731




def run(qtype, n_rows, n_cols, bias=False, residual=False, x2d=False, seed=None):
    rng = np.random.default_rng(seed if seed is not None else int(qtype) * 1000 + n_cols)
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((1, n_cols) if x2d else n_cols).astype(np.float32)
    shape = (1, n_rows) if x2d else (n_rows,)
    b = rng.standard_normal(n_rows).astype(np.float32) if bias else None
    r = rng.standard_normal(shape).astype(np.float32) if residual else None
    out = nan_device(shape)
    ret = matvec_fast(cuda.to_device(raw), qtype, cuda.to_device(x), out=out,
                      bias=None if b is None else cuda.to_device(b),
                      residual=None if r is None else cuda.to_device(r))
    assert ret is out
    assert_close(out.copy_to_host(), matvec_ref(raw, qtype, x, bias=b, residual=r), raw, qtype, x)


@pytest.mark.parametrize("qtype,n_rows,n_cols", [
    (T.Q4_K, 5, 768),     # 24 units a row: one partial unroll step; last warp past the end
    (T.Q4_K, 3, 2304),    # 72 units: a full step then a partial one
    (T.Q6_K, 16, 256),    # rows start at byte offsets 0, 2, ..., 14 mod 16
    (T.Q6_K, 5, 2048),    # 8 blocks a row: blocks at every offset within a row
    (T.Q6_K, 2, 5120),    # 4200-byte rows: the second starts 8 bytes into a 16-byte piece
    (T.Q8_0, 5, 256),
    (T.Q8_0, 8, 1056),    # 33 blocks: odd row length, rows at every offset, partial step
], ids=ID)
def test_matvec_fast(qtype, n_rows, n_cols):
    run(qtype, n_rows, n_cols)


@pytest.mark.parametrize("qtype,n_x,n_rows,n_cols,groups", [
    (T.Q4_K, 3, 5, 768, 2),    # unroll 1, a partial group past the end
    (T.Q6_K, 8, 4, 512, 1),    # the most x rows a launch takes
    (T.Q8_0, 2, 9, 1056, 4),   # rows at every offset
], ids=ID)
def test_matvec_fast_x_rows(qtype, n_x, n_rows, n_cols, groups):
    """Several activation rows in one launch (each weight load serves all of them), with
    bias and a per-row residual; and the gated form."""
    rng = np.random.default_rng(int(qtype) + n_x)
    raw, up = weights(rng, qtype, n_rows, n_cols), weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((n_x, n_cols)).astype(np.float32)
    b = rng.standard_normal(n_rows).astype(np.float32)
    r = rng.standard_normal((n_x, n_rows)).astype(np.float32)
    out = nan_device((n_x, n_rows))
    matvec_fast(cuda.to_device(raw), qtype, cuda.to_device(x), out=out, bias=cuda.to_device(b),
                residual=cuda.to_device(r), groups=groups)
    assert_close(out.copy_to_host(), matvec_ref(raw, qtype, x, bias=b, residual=r), raw, qtype, x)
    out = nan_device((n_x, n_rows))
    swiglu_fast(cuda.to_device(raw), cuda.to_device(up), qtype, cuda.to_device(x), out=out, groups=groups)
    np.testing.assert_allclose(out.copy_to_host(), swiglu_ref(raw, up, qtype, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype,n_x,n_a,n_b,n_cols,bias", [
    (T.Q4_K, 1, 21, 5, 768, False),   # the second weight's blocks start after a partial block
    (T.Q6_K, 2, 16, 12, 512, True),   # two x rows, biases, rows at every offset
    (T.Q8_0, 1, 3, 40, 256, True),    # (sizes a multiple of 16 bytes: no fallback)
], ids=ID)
def test_matvec_fast_pair(qtype, n_x, n_a, n_b, n_cols, bias):
    """Two weights of one x in one launch (q and k): each output as matvec_fast makes it
    alone with the same lane groups and warps (the same bits), and against the reference."""
    from luce.kernels.matvec_fast import matvec_fast_pair
    rng = np.random.default_rng(int(qtype) + n_a)
    wa, wb = weights(rng, qtype, n_a, n_cols), weights(rng, qtype, n_b, n_cols)
    x = rng.standard_normal((n_x, n_cols)).astype(np.float32)
    ba, bb = (rng.standard_normal(n).astype(np.float32) if bias else None for n in (n_a, n_b))
    dev = lambda a: None if a is None else cuda.to_device(a)  # noqa: E731
    oa, ob = nan_device((n_x, n_a)), nan_device((n_x, n_b))
    matvec_fast_pair(dev(wa), dev(wb), qtype, dev(x), oa, ob, dev(ba), dev(bb), groups=2, warps=1)
    for w, b, o in ((wa, ba, oa), (wb, bb, ob)):
        alone = nan_device(o.shape)
        matvec_fast(dev(w), qtype, dev(x), out=alone, bias=dev(b), groups=2, warps=1)
        np.testing.assert_array_equal(o.copy_to_host(), alone.copy_to_host())
        assert_close(o.copy_to_host(), matvec_ref(w, qtype, x, bias=b), w, qtype, x)


@pytest.mark.parametrize("n_x,bias", [(1, False), (2, True)])
def test_matvec_fast_pair_with_third(n_x, bias):
    """q and k (Q4_K) and v (Q6_K) in one launch: each output the same bits as matvec_fast
    makes it alone with the same lane groups and warps, the third's row block (rows past
    its end included) after the pair's; and a third of another block width is refused.
    (Q6_K's 4 rows of 420 bytes keep the weight a whole number of 16-byte pieces: otherwise
    all three go to matvec's path.)"""
    from luce.kernels.matvec_fast import matvec_fast_pair
    rng = np.random.default_rng(5 + n_x)
    n_cols, shapes = 512, ((T.Q4_K, 6), (T.Q4_K, 3), (T.Q6_K, 4))
    ws = [weights(rng, q, n, n_cols) for q, n in shapes]
    x = rng.standard_normal((n_x, n_cols)).astype(np.float32)
    bs = [rng.standard_normal(n).astype(np.float32) if bias else None for _, n in shapes]
    dev = lambda a: None if a is None else cuda.to_device(a)  # noqa: E731
    outs = [nan_device((n_x, n)) for _, n in shapes]
    got = matvec_fast_pair(dev(ws[0]), dev(ws[1]), T.Q4_K, dev(x), outs[0], outs[1], dev(bs[0]), dev(bs[1]),
                           groups=8, warps=1, third=(dev(ws[2]), T.Q6_K, outs[2], dev(bs[2])))
    assert got[2] is outs[2]
    for (q, _), w, b, o in zip(shapes, ws, bs, outs):
        alone = nan_device(o.shape)
        matvec_fast(dev(w), q, dev(x), out=alone, bias=dev(b), groups=8, warps=1)
        np.testing.assert_array_equal(o.copy_to_host(), alone.copy_to_host())
        assert_close(o.copy_to_host(), matvec_ref(w, q, x, bias=b), w, q, x)
    w8 = weights(rng, T.Q8_0, 5, n_cols)
    with pytest.raises(ValueError, match="third weight"):
        matvec_fast_pair(dev(ws[0]), dev(ws[1]), T.Q4_K, dev(x), outs[0], outs[1], dev(bs[0]), dev(bs[1]),
                         third=(dev(w8), T.Q8_0, nan_device((n_x, 5)), dev(bs[2])))


@pytest.mark.parametrize("qtype", sorted(FAST_TYPES, key=int), ids=ID)
def test_matvec_fast_epilogues(qtype):
    run(qtype, 8, 256, bias=True, residual=True, x2d=True)


def test_matvec_fast_residual_in_place():
    rng = np.random.default_rng(3)
    raw = weights(rng, T.Q4_K, 6, 512)
    x = rng.standard_normal(512).astype(np.float32)
    h = rng.standard_normal(6).astype(np.float32)
    h_dev = cuda.to_device(h)
    matvec_fast(cuda.to_device(raw), T.Q4_K, cuda.to_device(x), out=h_dev, residual=h_dev)
    assert_close(h_dev.copy_to_host(), matvec_ref(raw, T.Q4_K, x, residual=h), raw, T.Q4_K, x)


def test_matvec_fast_fallback():
    """5 rows of 210 bytes are not a multiple of 16 bytes: luce.kernels.matvec takes them."""
    run(T.Q6_K, 5, 256, bias=True)


@pytest.mark.parametrize("qtype", sorted(FAST_TYPES, key=int), ids=ID)
def test_swiglu_fast(qtype):
    rng = np.random.default_rng(int(qtype) + 7)
    n_rows, n_cols = 8, 256
    g, u = weights(rng, qtype, n_rows, n_cols), weights(rng, qtype, n_rows, n_cols)
    x = (0.1 * rng.standard_normal(n_cols)).astype(np.float32)
    out = nan_device(n_rows)
    swiglu_fast(cuda.to_device(g), cuda.to_device(u), qtype, cuda.to_device(x), out=out)
    got, want = out.copy_to_host(), swiglu_ref(g, u, qtype, x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=ID)
def test_geglu_fast(qtype):
    """Gemma's GeGLU in the gated launch (act="gelu_tanh"): gelu_tanh(Wg x) * (Wu x), one x
    row and two."""
    from luce.kernels.activation import geglu_ref
    rng = np.random.default_rng(int(qtype) + 11)
    n_rows, n_cols = 8, 256
    g, u = weights(rng, qtype, n_rows, n_cols), weights(rng, qtype, n_rows, n_cols)
    for shape in [(n_cols,), (2, n_cols)]:
        x = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        out = nan_device(shape[:-1] + (n_rows,))
        swiglu_fast(cuda.to_device(g), cuda.to_device(u), qtype, cuda.to_device(x), out=out, act="gelu_tanh")
        want = geglu_ref(matvec_ref(g, qtype, x).astype(np.float64), matvec_ref(u, qtype, x).astype(np.float64))
        got = out.copy_to_host()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="activation"):
        swiglu_fast(cuda.to_device(g), cuda.to_device(u), qtype, cuda.to_device(x), out=out, act="relu")


def test_matvec_fast_warps():
    """8 warps a block splitting each row's 16 units (4 lanes a row pair: warps 4-7 get
    none), 8 row pairs a block: 13 rows leave 3 row slots past the end."""
    rng = np.random.default_rng(9)
    raw = weights(rng, T.Q8_0, 13, 256)
    x = rng.standard_normal(256).astype(np.float32)
    out = nan_device(13)
    matvec_fast(cuda.to_device(raw), T.Q8_0, cuda.to_device(x), out=out, warps=8)
    assert_close(out.copy_to_host(), matvec_ref(raw, T.Q8_0, x), raw, T.Q8_0, x)


@pytest.mark.parametrize("qtype,unroll,n_cols", [(T.Q4_K, 1, 768), (T.Q6_K, 2, 2048), (T.Q8_0, 1, 1056),
                                                 (T.Q4_K, F.PIPE, 768), (T.Q6_K, F.PIPE, 1280),
                                                 (T.Q8_0, F.PIPE, 1056)], ids=ID)
def test_matvec_fast_unroll(qtype, unroll, n_cols):
    """Units a lane loads before computing, other than each type's default: full and
    partial steps, and the pipelined loop (a lane's next unit loaded before this one is
    computed; the load past a lane's last unit is clamped and dropped)."""
    rng = np.random.default_rng(int(qtype) + len(str(unroll)))
    raw = weights(rng, qtype, 5, n_cols)
    x = rng.standard_normal(n_cols).astype(np.float32)
    out = nan_device(5)
    matvec_fast(cuda.to_device(raw), qtype, cuda.to_device(x), out=out, unroll=unroll)
    assert_close(out.copy_to_host(), matvec_ref(raw, qtype, x), raw, qtype, x)


def test_swiglu_fast_pipelined_two_rows():
    """The gated form through the pipelined loop, two x rows: both of a lane's rows_dot
    calls (gate, then up) start their own pipeline."""
    rng = np.random.default_rng(17)
    n_rows, n_cols = 6, 768
    g, u = weights(rng, T.Q4_K, n_rows, n_cols), weights(rng, T.Q4_K, n_rows, n_cols)
    x = (0.1 * rng.standard_normal((2, n_cols))).astype(np.float32)
    out = nan_device((2, n_rows))
    swiglu_fast(cuda.to_device(g), cuda.to_device(u), T.Q4_K, cuda.to_device(x), out=out, unroll=F.PIPE)
    want = swiglu_ref(g, u, T.Q4_K, x)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("inline_sums", [True, False], ids=["inline-sums", "shared-sums"])
def test_matvec_fast_capped_grid(inline_sums):
    """A grid capped at 2 blocks (one per simulated SM) loops: 20 rows in row blocks of 4
    (2 row pairs) are 5 row blocks, so the blocks run 3 and 2 of them; Q4_K's sums of x
    inline or from shared memory."""
    rng = np.random.default_rng(11)
    raw = weights(rng, T.Q4_K, 20, 512)
    x = rng.standard_normal(512).astype(np.float32)
    out = nan_device(20)
    matvec_fast(cuda.to_device(raw), T.Q4_K, cuda.to_device(x), out=out, inline_sums=inline_sums, blocks_per_sm=1,
                groups=2)
    assert_close(out.copy_to_host(), matvec_ref(raw, T.Q4_K, x), raw, T.Q4_K, x)


@pytest.mark.parametrize("qtype_o,qtype_p,groups", [(T.Q4_K, T.Q6_K, 2), (T.Q6_K, T.Q4_K, 8), (T.Q8_0, T.Q8_0, 4)],
                         ids=ID)
def test_split_rms_norm(qtype_o, qtype_p, groups):
    """The RMSNorm between a residual product and the projections of its output, with no
    launch of its own (decode's o or down projection, then q/k/v or gate/up): the residual
    product stores xg = h * g and its row blocks' sums of h^2 (parts); plain, paired and
    gated products of xg with x_norm give the projections of rms_norm(h, g), with a bias;
    the residual stream is as matvec_fast leaves it."""
    from luce.kernels.matvec_fast import matvec_fast_norm, matvec_fast_pair, norm_parts_max
    from luce.kernels.norm import rms_norm_ref
    rng = np.random.default_rng(int(qtype_o) * 7 + groups)
    d, k_in, n_out, eps = 256, 256, 16, 1e-6  # Q6_K: 16 rows fill 16-byte pieces
    wo = weights(rng, qtype_o, d, k_in)
    a = rng.standard_normal(k_in).astype(np.float32)
    h = (3 * rng.standard_normal(d)).astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    h_dev, xg, parts = cuda.to_device(h), nan_device(d), nan_device(norm_parts_max(d))
    n_parts = matvec_fast_norm(cuda.to_device(wo), qtype_o, cuda.to_device(a), h_dev, cuda.to_device(g), xg, parts,
                               groups=groups)
    assert n_parts == -(-d // (F.ROWS * groups))
    h1 = matvec_ref(wo, qtype_o, a, residual=h)
    assert_close(h_dev.copy_to_host(), h1, wo, qtype_o, a)
    got_h1 = h_dev.copy_to_host()
    np.testing.assert_allclose(xg.copy_to_host(), got_h1 * g, rtol=1e-6)
    np.testing.assert_allclose(parts.copy_to_host()[:n_parts].sum(), (got_h1.astype(np.float64) ** 2).sum(), rtol=1e-5)

    normed = rms_norm_ref(got_h1, g, eps)
    wa, wb = weights(rng, qtype_p, n_out, d), weights(rng, qtype_p, n_out + 8, d)
    bias = rng.standard_normal(n_out).astype(np.float32)
    x_norm = (parts, n_parts, eps)
    dev = cuda.to_device
    out = nan_device(n_out)
    matvec_fast(dev(wa), qtype_p, xg, out=out, bias=dev(bias), x_norm=x_norm)
    assert_close(out.copy_to_host(), matvec_ref(wa, qtype_p, normed, bias=bias), wa, qtype_p, normed)
    oa, ob = nan_device(n_out), nan_device(n_out + 8)
    matvec_fast_pair(dev(wa), dev(wb), qtype_p, xg, oa, ob, stream=0, x_norm=x_norm)
    assert_close(oa.copy_to_host(), matvec_ref(wa, qtype_p, normed), wa, qtype_p, normed)
    assert_close(ob.copy_to_host(), matvec_ref(wb, qtype_p, normed), wb, qtype_p, normed)
    up = weights(rng, qtype_p, n_out, d)
    out = nan_device(n_out)
    swiglu_fast(dev(wa), dev(up), qtype_p, xg, out=out, x_norm=x_norm)
    want = swiglu_ref(wa, up, qtype_p, normed)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="one float x row"):
        matvec_fast(dev(wa), qtype_p, dev(np.zeros((2, d), np.float32)), x_norm=x_norm)


def test_splits_norm_needs_whole_16_byte_pieces():
    """Weights the fast path would hand to luce.kernels.matvec (no x_norm there): the CUDA
    backend makes the norm itself for them."""
    from luce.kernels.matvec_fast import splits_norm
    odd, even = cuda.to_device(np.zeros((5, 210), np.uint8)), cuda.to_device(np.zeros((16, 210), np.uint8))
    assert splits_norm(even) and not splits_norm(odd) and not splits_norm(even, odd)


def test_matvec_fast_rejects():
    rng = np.random.default_rng(0)
    raw = cuda.to_device(weights(rng, T.Q4_K, 4, 256))
    with pytest.raises(ValueError):  # more x rows than one launch takes: matmul's job
        matvec_fast(raw, T.Q4_K, cuda.to_device(np.zeros((F.MAX_X_ROWS + 1, 256), np.float32)))
    with pytest.raises(ValueError):  # the shared x sums hold one row
        matvec_fast(raw, T.Q4_K, cuda.to_device(np.zeros((2, 256), np.float32)), inline_sums=False)
    with pytest.raises(ValueError):  # weight rows do not match K
        matvec_fast(raw, T.Q4_K, cuda.to_device(np.zeros(512, np.float32)))
    with pytest.raises(NotImplementedError):
        matvec_fast(raw, T.Q4_0, cuda.to_device(np.zeros(256, np.float32)))


def test_bench_matvec_fast_smoke():
    from luce.kernels.matvec_fast import bench_matvec_fast
    rows = bench_matvec_fast([(8, 256)], ["Q4_K"], iters=1, warps=(4, 2), baseline=True)
    assert [(r["kernel"], r["warps"]) for r in rows] == [("matvec_fast", 4), ("matvec_fast", 2), ("matvec", None)]
    assert {"kernel", "qtype", "rows", "cols", "weight_bytes", "time_us", "GB/s"} <= set(rows[0])
    assert rows[0]["weight_bytes"] == 8 * 144


# ---------------------------------------------------------------- GPU code generation
PTX_CHECK = r'''
import os, re, sys
from numba import cuda
from numba.cuda import types
from luce.kernels import matvec_fast as F
u16, f32 = types.uint16[::1], types.float32[::1]
norm_args = (f32, f32, f32, types.int64, types.float32)  # gn, xg, parts, n_parts, eps
norm_args += (u16, f32, f32) + (types.int64,) * 2  # the third weight: w_c, out_c, bias_c, n_rows_c, row_h_c
norm_args += (types.uint8[::1], f32)  # xg's int8 form: xo_b, xo_f
sig = (u16, u16, f32, f32, f32, f32) + (types.int64,) * 4 + (f32, f32, types.int64) + norm_args
out_dir = sys.argv[1] if len(sys.argv) > 1 else None
for q in F.FAST_SPECS:
    for glu, br, nw, inl, un, g in [(False, False, F.NW, True, None, 8), (False, True, F.NW, True, None, 4),
                                    (True, False, F.NW, True, None, 8), (2, False, F.NW, True, None, 8),
                                    (False, False, 8, True, None, 1),
                                    (False, False, F.NW, False, None, 16),
                                    (False, False, F.NW, True, 3 - F.FAST_SPECS[q].unroll, 2)]:
        ptx, _ = cuda.compile_ptx(F._make_kernel(q, glu, br, br, nw, inl, un, g).py_func, sig, cc=(9, 0))
        name = f"{q.name}_glu{int(glu)}_br{int(br)}_nw{nw}_inline{int(inl)}_unroll{un}_groups{g}"
        if out_dir:
            open(os.path.join(out_dir, name + ".ptx"), "w").write(ptx)
        # 16-byte weight loads, with or without a cache hint (vector_load.WEIGHT_HINTS)
        assert re.search(r"ld\.global\.nc(\.L[12]::\w+)*\.v4\.u32", ptx) and "ld.global.nc.v4.f32" in ptx, name
        assert ("shfl.sync" in ptx) == (g < 32), name  # groups of 32 / g lanes add up by shuffles
        assert not re.search(r"\.local\b", ptx), name + ": local memory (spills or indexed arrays)"
        # weights never go through shared memory: it holds the lanes' sums (and x's sums)
        smem = sum(int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", ptx))
        sums = 4 * (F.SX_MAX if F.FAST_SPECS[q].sums and not inl else 1)
        assert smem == 4 * 32 * nw * F.ROWS * (2 if glu else 1) + sums + 8, (name, smem)  # + nsq, qred: 1 each
# q and k in one launch (pair), with and without biases
for q in F.FAST_SPECS:
    for br in (False, True):
        ptx, _ = cuda.compile_ptx(F._make_kernel(q, False, br, False, F.NW, True, None, 8, 1, False, True).py_func,
                                  sig, cc=(9, 0))
        assert not re.search(r"\.local\b", ptx), f"{q.name} pair: local memory"
# q and k with a third weight of another type (v: Q6_K where q and k are Q4_K), and the
# pipelined loop: no local memory
for q, third, un in [(F.T.Q4_K, F.T.Q6_K, None), (F.T.Q4_K, F.T.Q6_K, F.PIPE), (F.T.Q6_K, F.T.Q4_K, None)]:
    ptx, _ = cuda.compile_ptx(F._make_kernel(q, False, False, False, 8, True, un, 8, 1, False, True, True, False,
                                             third).py_func, sig, cc=(9, 0))
    assert not re.search(r"\.local\b", ptx), f"{q.name} with {third.name}, unroll {un}: local memory"
# the split RMSNorm: the residual product that stores xg and the parts, and its consumers
for q in F.FAST_SPECS:
    for glu, br, res, pair, xn, no in [(False, False, True, False, False, True), (False, True, False, True, True, False),
                                       (True, False, False, False, True, False)]:
        k = F._make_kernel(q, glu, br, res, F.NW, True, None, 8, 1, False, pair, xn, no)
        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
        name = f"{q.name}_norm_glu{int(glu)}_pair{int(pair)}_xnorm{int(xn)}_normout{int(no)}"
        assert not re.search(r"\.local\b", ptx), name + ": local memory"
        assert ("rsqrt" in ptx or "sqrt" in ptx) == xn, name
# ... and they fit as many blocks an SM (65536 registers) as the products without the norm:
# a form of the residual product's row-block sum once took Q6_K from 80 to 102 registers
from luce.kernels.ptx import ptxas_usage
blocks = lambda regs, nw: 65536 // (-(-regs // 8) * 8 * 32 * nw)
for q, nw, glu, res, xn, no in [(F.T.Q4_K, 8, False, True, False, True), (F.T.Q6_K, 8, False, True, False, True),
                                 (F.T.Q4_K, 4, True, False, True, False)]:  # o, down (the 8B grids), gate/up
    base = ptxas_usage(cuda.compile_ptx(F._make_kernel(q, glu, False, res, nw, True, None, 8).py_func, sig,
                                        cc=(9, 0))[0])
    k = F._make_kernel(q, glu, False, res, nw, True, None, 8, 1, False, False, xn, no)
    got = ptxas_usage(cuda.compile_ptx(k.py_func, sig, cc=(9, 0))[0])
    assert got["spill_bytes"] == 0 and blocks(got["registers"], nw) >= blocks(base["registers"], nw), \
        (q.name, nw, glu, base, got)
# units over int8 x (quantize_x): x comes as uint16, multiplied with dp4a, never as floats
sig8 = (u16, u16, u16, f32, f32, f32) + (types.int64,) * 4 + (f32, f32, types.int64) + norm_args
for q in F.X8_TYPES:
    for glu, g, nx, planes in [(False, 8, 1, 1), (True, 16, 1, 1), (False, 4, 3, 1), (False, 8, 1, 2), (True, 16, 1, 2)]:
        k = F._make_kernel(q, glu, False, False, F.NW, True, None if nx == 1 else 1, g, nx, planes)
        ptx, _ = cuda.compile_ptx(k.py_func, sig8, cc=(9, 0))
        name = f"{q.name}_x8_glu{int(glu)}_groups{g}_nx{nx}_planes{planes}"
        assert "dp4a.u32.s32" in ptx and re.search(r"ld\.global\.nc(\.L[12]::\w+)*\.v4\.u32", ptx), name
        assert "ld.global.nc.v4.f32" not in ptx, name
        assert not re.search(r"\.local\b", ptx), name + ": local memory (spills or indexed arrays)"
# the split norm over int8 x: o / down storing xg and its int8 form, and the norm's readers
for q in F.X8_TYPES:
    for glu, res, xn, no in [(False, True, False, True), (False, False, True, False), (True, False, True, False)]:
        k = F._make_kernel(q, glu, False, res, 8 if no else F.NW, True, None, 8, 1, 2, False, xn, no, None,
                           2 if no else 0)
        ptx, _ = cuda.compile_ptx(k.py_func, sig8, cc=(9, 0))
        name = f"{q.name}_x8_glu{int(glu)}_xn{int(xn)}_no{int(no)}"
        assert "dp4a.u32.s32" in ptx and not re.search(r"\.local\b", ptx), name
        assert ptxas_usage(ptx)["spill_bytes"] == 0, name
# Q6_K in groups of eight blocks (q6k_groups): aligned loads only, fewer registers than the
# GGUF layout's down product (ptxas 13: 76 against 102)
k = F._make_kernel(F.T.Q6_K, False, False, True, 8, True, None, 8, 1, 2, False, False, True, None, 2, True)
ptx, _ = cuda.compile_ptx(k.py_func, sig8, cc=(9, 0))
use = ptxas_usage(ptx)
assert not re.search(r"\.local\b", ptx) and use["spill_bytes"] == 0 and use["registers"] <= 96, use
print("PTX OK")
'''


ptx_check = background_ptx_check(PTX_CHECK)


def test_matvec_fast_compiles_to_ptx(ptx_check):
    assert_ptx_ok(ptx_check)


@pytest.mark.parametrize("n_rows,n_cols,planes", [(5, 2048, 2), (3, 4096, 1)])
def test_q6_k_in_groups_of_eight_blocks(n_rows, n_cols, planes):
    """layout="g8" (luce.kernels.q6k_groups: each 8 blocks' ql, qh, scales and d side by
    side, every piece one aligned load): the same sums in the same order as the GGUF layout,
    so the same bits; with the split norm's epilogue too (the decode down product)."""
    from luce.kernels.q6k_groups import g8_ref
    from luce.kernels.quantize_x import quantize_x
    rng = np.random.default_rng(11)
    raw = weights(rng, T.Q6_K, n_rows, n_cols)
    g8 = g8_ref(raw, n_rows, n_cols)
    assert g8.shape == raw.reshape(n_rows, -1).shape and sorted(g8.ravel()) == sorted(raw.ravel())
    x = cuda.to_device(rng.standard_normal((1, n_cols)).astype(np.float32))
    xq = quantize_x(x, planes=planes)
    outs = []
    for w, layout in ((raw, None), (g8, "g8")):
        out = nan_device((1, n_rows))
        matvec_fast(cuda.to_device(w), T.Q6_K, x, out=out, xq=xq, layout=layout)
        outs.append(out.copy_to_host())
    np.testing.assert_array_equal(outs[1], outs[0])
    assert not np.isnan(outs[0]).any()
    # the down product's form: residual += W x, xg and the norm's parts
    res0 = rng.standard_normal(n_rows).astype(np.float32)
    gn = cuda.to_device(rng.standard_normal(n_rows).astype(np.float32))
    got = []
    for w, layout in ((raw, None), (g8, "g8")):
        res, xg, parts = cuda.to_device(res0), nan_device((n_rows,)), nan_device((64,))
        n = F.matvec_fast_norm(cuda.to_device(w), T.Q6_K, x, res, gn, xg, parts, xq=xq, layout=layout)
        got.append((res.copy_to_host(), xg.copy_to_host(), parts.copy_to_host()[:n]))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="layout"):
        matvec_fast(cuda.to_device(g8), T.Q6_K, x, xq=None, layout="g8")  # float x: no g8 units
