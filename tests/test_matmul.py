"""Prefill matmul (luce.kernels.matmul) in the CUDA simulator on small shapes: the per-type
unit decoders and the f16 staging through the FMA path, the row/column tails and epilogues,
and runs of the tensor-core path with mma.sync and ldmatrix emulated; the small-M tiles
(pick_tile) with split-K on both paths, and their GPU code generation (PTX through libNVVM,
then ptxas: no local memory). Real shapes and the real mma instructions:
tests/gpu/test_matmul_gpu.py.

Tolerance: X and W are rounded to f16 before the product (2^-11 relative each, W's f16x2
decode adds at most 2^-10 of |s q| + |o|), accumulation is f32, so every output is held to
|y - ref| <= 2^-8 * (|X| @ |W|^T), ref being the float64 product of the numpy dequantization.
"""
import numpy as np
import pytest
from numba import cuda

from luce.bench.synthetic import random_quant_rows
from luce.kernels.dequant import dequantize
from luce.kernels.matmul import MATMUL_TYPES, TILE_GPU, TILE_SIM, TILES_SMALL_M, choose_splits, matmul, matmul_ref, \
    pick_tile
from luce.kernels.quant_types import as_qtype
from tests.test_dequant import abs_terms
from tests.ptx_background import assert_ptx_ok, background_ptx_check

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


# ---------------------------------------------------------------- small M (verification)
SMALL = {m_max: tile for m_max, tile, _ in TILES_SMALL_M}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("k,n", [(4096, 12288), (12288, 4096)])
@pytest.mark.parametrize("m", [1, 8, 16, 23, 64, 100])
def test_pick_tile_small_m(qtype, k, n, m):
    tile, splits = pick_tile(m, n, k, qtype, sim=False)
    bm, bn, bk = tile[:3]
    per_sm = next(p for _, t, p in TILES_SMALL_M if t == tile)
    assert bm >= min(m, 64) and bm < 2 * max(m, 16), "one row tile: W is read once"
    assert bn <= 128 and k % bk == 0
    blocks = -(-n // bn) * -(-m // bm) * splits
    # the resident-block slots of the H200's 132 SMs filled: 4 warps a block, >= 2 blocks an SM
    assert blocks >= 0.85 * per_sm * 132 and blocks * 4 * 32 * 2 >= 0.95 * 132 * 4 * 32 * 2
    assert 1 <= splits and k // bk // splits >= 2


def test_pick_tile_defaults():
    assert pick_tile(512, 4096, 4096, "Q6_K", sim=False) == (TILE_GPU, 1)  # 128 blocks: a wave
    assert pick_tile(512, 12288, 4096, "Q4_K", sim=False) == (TILE_GPU, 1)
    # k and v of the Qwen3 shapes: 32 blocks, K split 4 ways to fill the 132 SMs
    assert pick_tile(512, 1024, 4096, "Q4_K", sim=False) == (TILE_GPU, 4)
    assert pick_tile(512, 1024, 5120, "Q6_K", sim=False) == (TILE_GPU, 4)
    assert pick_tile(16, 4096, 4096, "Q4_K", sim=True) == (TILE_SIM, 1)
    tile, _ = pick_tile(16, 896, 896, "Q8_0", sim=False)  # 896 = 7 * 128: BK shrinks to divide K
    assert 896 % tile[2] == 0
    tile, _ = pick_tile(16, 896, 864, "F16", sim=False)
    assert 864 % tile[2] == 0
    assert choose_splits(10_000, 64, 4, 132) == 1
    assert choose_splits(64, 3, 4, 132) == 1  # never under 2 K steps a split
    assert choose_splits(64, 96, 4, 132) * 64 >= 4 * 132 * 0.85


# The exact GPU tiles (block and warp shapes) with K split: on the emulated tensor-core path
# the 16- and 32-row tiles, on the FMA path the 16-row tile with an uneven split and the
# 64-row tile (256 threads: too slow emulated, so its 32 x 32 warp tile runs in one warp).
@pytest.mark.parametrize("qtype,m,n,k,splits,use_mma,tile,extra", [
    ("Q4_K", 3, 64, 256, 2, True, SMALL[16], {}),  # fewer rows than MATMUL_MIN_ROWS used to allow
    ("Q6_K", 23, 40, 256, 2, True, SMALL[32], dict(bias=True)),
    # 2-stage, 1 + 2 steps. Minutes of simulated FMA (its 128 threads decode every element
    # through device calls), and a timed-out run leaves them running to starve the next
    # tests: marked slow, so CI deselects it.
    pytest.param("Q8_0", 16, 64, 384, 2, False, SMALL[16], dict(residual=True), marks=pytest.mark.slow),
    ("Q4_0", 40, 96, 128, 2, False, SMALL[127], dict(x_dtype=np.float16)),
    ("Q8_0", 32, 24, 128, 2, True, (32, 32, 64, 32, 32, "ldsm", 1), {}),   # N tail inside the warp tile
])
def test_small_m_split_k(qtype, m, n, k, splits, use_mma, tile, extra):
    run(qtype, m, n, k, tile=tile, splits=splits, use_mma=use_mma, **extra)


@pytest.mark.parametrize("use_mma", [False, True])
def test_rows_past_f16_range(use_mma):
    """X converted to f16 first (as on the GPU): rows with values past 65504 are scaled into
    range and their outputs scaled back (finite, same bound); the other rows' outputs are
    the bits they have without those rows."""
    qtype, m, n, k = "Q4_K", 5, 16, 256
    w = random_w(qtype, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1] *= 4e5
    x[3, 9] = -7e6
    w_dev = cuda.to_device(w)
    tile, splits = pick_tile(m, n, k, qtype)  # the same sums for 5 rows and for 3
    kw = dict(use_mma=use_mma, x_convert=True, tile=tile, splits=splits)
    y = matmul(cuda.to_device(x), w_dev, qtype, n, k, **kw).copy_to_host()
    rows = [0, 1, 2, 4]
    check(y[rows], x[rows], w, as_qtype(qtype), n, k)
    # row 3: one value of 7e6 times weights decoded in f16 to 2^-10 of |s q| + |min|, far
    # coarser than |w| where the two cancel: the bound counts the terms (abs_terms)
    ref3 = matmul_ref(x[3:4], w, qtype, (n, k))[0]
    bound3 = np.abs(x[3]) @ abs_terms(w, as_qtype(qtype), (n, k)).T
    assert np.isfinite(y[3]).all() and (np.abs(y[3] - ref3) <= 2.0 ** -8 * bound3).all()
    plain = [0, 2, 4]
    y_plain = matmul(cuda.to_device(x[plain]), w_dev, qtype, n, k, **kw).copy_to_host()
    np.testing.assert_array_equal(y[plain], y_plain)


def run_gated(qtype, m, n, k, big_row=None, act="silu", **kw):
    """matmul's gated form (w_up) against the activation of the first reference product
    times the second; each product is held to check's bound, which the epilogue carries
    through the activation (slope at most 1.1 for silu, 1.13 for GELU's tanh form) and the
    product with up."""
    from luce.kernels.activation import gelu_tanh_ref, silu_ref
    f = silu_ref if act == "silu" else gelu_tanh_ref
    x = rng.standard_normal((m, k)).astype(np.float32)
    if big_row is not None:
        x[big_row] *= 4e5  # past f16's range: scaled by to_f16, scaled back in the epilogue
    wg, wu = random_w(qtype, n, k), random_w(qtype, n, k)
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))
    matmul(cuda.to_device(x), cuda.to_device(wg), qtype, n, k, out=out, w_up=cuda.to_device(wu), act=act, **kw)
    y = out.copy_to_host()
    g, u = (matmul_ref(x, w, qtype, (n, k)).astype(np.float64) for w in (wg, wu))
    bg, bu = (2.0 ** -8 * (np.abs(x) @ np.abs(dequantize(w, as_qtype(qtype), (n, k))).T) + 1e-6 for w in (wg, wu))
    bound = 1.13 * bg * np.abs(u) + np.abs(f(g)) * bu + bg * bu
    assert not np.isnan(y).any(), "unwritten outputs"
    err = np.abs(y - f(g) * u)
    assert (err <= bound * (1 + 1e-5) + 1e-6).all(), f"{(err > bound).sum()} outputs off, worst {err.max()}"


@pytest.mark.parametrize("qtype,m,n,k,kw", [
    ("Q4_K", 20, 48, 256, {}),  # FMA path: row tail, three column tiles of gate/up pairs
    ("Q6_K", 16, 32, 256, dict(use_mma=True, tile=(16, 32, 32, 16, 16, "ldsm"))),
    ("Q4_K", 23, 64, 256, dict(use_mma=True, tile=SMALL[32], splits=2)),  # split K, then the epilogue
    ("Q4_K", 5, 32, 256, dict(use_mma=True, x_convert=True, tile=(16, 32, 64, 16, 16, "ldsm"), big_row=2)),
    ("Q4_K", 20, 48, 256, dict(act="gelu_tanh")),  # GeGLU (Gemma), FMA path and emulated mma
    ("Q8_0", 16, 32, 128, dict(act="gelu_tanh", use_mma=True, tile=(16, 32, 32, 16, 16, "ldsm"))),
])
def test_matmul_gated(qtype, m, n, k, kw):
    run_gated(qtype, m, n, k, **kw)


def test_matmul_gated_rejects():
    x = cuda.to_device(np.zeros((4, 256), np.float32))
    w = cuda.to_device(random_w("Q4_K", 32, 256))
    with pytest.raises(ValueError, match="activation"):
        matmul(x, w, "Q4_K", 32, 256, w_up=w, act="relu")
    with pytest.raises(ValueError, match="bias"):
        matmul(x, w, "Q4_K", 32, 256, w_up=w, bias=cuda.to_device(np.zeros(32, np.float32)))
    with pytest.raises(ValueError, match="W must be"):
        matmul(x, w, "Q4_K", 32, 256, w_up=cuda.to_device(random_w("Q4_K", 16, 256)))
    with pytest.raises(ValueError, match="multiple"):
        matmul(x, cuda.to_device(random_w("Q4_K", 24, 256)), "Q4_K", 24, 256,
               w_up=cuda.to_device(random_w("Q4_K", 24, 256)))


def test_bench_gated_runs():
    """`python -m luce.bench.kernels_matmul --gated` end to end on a tiny shape (the
    simulator: no sleeping kernel, so its times mean nothing here)."""
    from luce.bench.kernels_matmul import bench_gated
    (row,) = bench_gated(shapes=((4, 256, 32),), reps=1, warmup=1, rotate_mb=0)
    assert row["weight_copies"] == 2 and (row["M"], row["K"], row["N"]) == (4, 256, 32)
    assert np.isfinite([row["fused_us"], row["two_launches_and_swiglu_us"], row["x_before"]]).all()


def test_to_f16_scales_rows_in_every_chunk():
    """The conversion scales flagged rows wherever they lie, sets each row's scale (a power
    of two; 1 for rows in range, whose f16 bits are plain), and leaves the flags cleared:
    the next call on the same buffers scales nothing."""
    from luce.kernels.matmul import to_f16
    m, k = 40, 32
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[3] *= 1e5
    x[36, 5] = 3e6
    q, scales = to_f16(cuda.to_device(x), k)
    q, scales = q.copy_to_host()[:m * k].reshape(m, k), scales.copy_to_host()[:m]
    big = [3, 36]
    assert (scales[big] > 1).all() and (np.delete(scales, big) == 1).all()
    assert np.all(np.log2(scales) == np.round(np.log2(scales)))
    np.testing.assert_array_equal(q, (x / scales[:, None]).astype(np.float16).view(np.uint16))
    assert np.isfinite(q.view(np.float16).astype(np.float32)).all()
    x[big] = 1.0
    q2, scales2 = to_f16(cuda.to_device(x), k)
    assert (scales2.copy_to_host()[:m] == 1).all()
    np.testing.assert_array_equal(q2.copy_to_host()[:m * k].reshape(m, k), x.astype(np.float16).view(np.uint16))


# ---------------------------------------------------------------- GPU code generation
# The simulator never compiles the GPU code. With libNVVM installed, compile the small-M
# kernels to PTX in a subprocess without the simulator (no GPU or driver needed once numba
# is told the architecture), and assemble it with ptxas when there is one: the local
# arrays (accumulators, fragments, raw words) must all live in registers.
PTX_CHECK = r'''
from numba import cuda
from numba.cuda import types
from luce.kernels import matmul as MM
from luce.kernels.ptx import ptxas_path, ptxas_usage
ptxas = ptxas_path()  # the dev extra's nvidia-cuda-nvcc-cu12 ships one
u16, f32, i32 = types.uint16[::1], types.float32[::1], types.int32[::1]
sig = (u16, u16, u16, f32, f32, f32, f32, i32, f32) + (types.int64,) * 5
for q, m, split, bias_res, gated in [
        ("Q4_K", 16, True, False, None), ("Q6_K", 16, True, True, None), ("Q4_K", 32, True, True, None),
        ("Q6_K", 32, False, False, None), ("Q4_K", 64, True, False, None), ("Q6_K", 64, True, True, None),
        ("Q4_K", 512, True, True, None), ("Q6_K", 512, True, False, None),  # prefill's tile, K split
        ("Q4_K", 512, False, False, "silu"), ("Q6_K", 32, True, False, "gelu_tanh")]:  # the gated forms
    tile, _ = MM.pick_tile(m, 4096, 4096, q, sim=False)
    kern, nt = MM._build(MM.as_qtype(q), tile, True, True, bias_res, bias_res, None, split, bias_res, gated)
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
    name = f"{q} {tile} split={split} gated={gated}"
    assert ".local" not in ptx, name + ": local arrays left in memory"
    for op in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "ld.global.nc.v4.u32"):
        assert op in ptx, name + ": no " + op
    assert ("atom.global.add" in ptx or "red.global.add" in ptx) == split, name
    if ptxas:
        use = ptxas_usage(ptx)
        assert use["spill_bytes"] == 0, (name, use)
        print(name, use)
print("PTX OK", "ptxas" if ptxas else "(no ptxas)")
'''


ptx_check = background_ptx_check(PTX_CHECK)


def test_small_m_kernels_compile_to_ptx(ptx_check):
    assert_ptx_ok(ptx_check)
