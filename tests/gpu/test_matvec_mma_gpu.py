"""The tensor-core Q4_K / Q6_K matvec on the GPU at Qwen3-8B's FFN shapes, 1 to 32 rows of x (one
to four B fragments, one or two tiles a warp, 4 or 8 warps a block), against the float64
reference; and its bench rows."""
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
    assert (err <= 2e-6 * bound + 1e-5).all(), float((err / bound).max())


def test_bench_matvec_mma_rows():
    from luce.bench.kernels_matvec_mma import bench_matvec_mma
    rows = bench_matvec_mma(rows=(1, 23), shapes=((4096, 12288),), reps=3)
    assert [r["rows"] for r in rows] == [1, 23] and all(r["time_us"] > 0 and r["current_us"] > 0 for r in rows)
