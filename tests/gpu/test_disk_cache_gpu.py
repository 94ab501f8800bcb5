"""luce.kernels.disk_cache on a GPU: a forward kernel compiled in one interpreter is loaded,
not compiled, in the next (numba's cache-hit counter), computes the same result, and is
captured into a CUDA graph like a compiled one.

Run: NUMBA_ENABLE_CUDASIM=0 python -m pytest -m gpu tests/gpu/test_disk_cache_gpu.py"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import numpy as np
from numba import cuda
from luce.kernels import sampling
x = np.random.default_rng(0).standard_normal((1, 151936)).astype(np.float32) * 3
out = cuda.device_array(1, np.int32)
sp = sampling.sample_params(0.8, 40, 0.95, 0.05, 0.3)
sampling.sample_cuda(cuda.to_device(x), cuda.to_device(sp), out)
run_keys, draw = sampling._sample_kernels(sampling.SAMPLE_RUN)
hits = sum(run_keys._cache_hits.values()) + sum(draw._cache_hits.values())
misses = sum(run_keys._cache_misses.values()) + sum(draw._cache_misses.values())
from luce.kernels.disk_cache import counts
assert counts() == (hits, misses), counts()  # what luce bench reports
# a loaded kernel is captured like a compiled one (luce reads its py_func while recording)
from luce.backends.cuda_graph import Graph
stream = cuda.stream()
xd, spd, out2 = cuda.to_device(x, stream=stream), cuda.to_device(sp, stream=stream), cuda.device_array(1, np.int32)
g = Graph(stream, lambda: sampling.sample_cuda(xd, spd, out2, stream=stream))
g.replay()
stream.synchronize()
assert int(out2.copy_to_host()[0]) == int(out.copy_to_host()[0])
print("RESULT", int(out.copy_to_host()[0]), sampling.sample_ref(x[0], sp), hits, misses)
'''


def test_a_kernel_compiled_once_is_loaded_by_the_next_interpreter(tmp_path):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", LUCE_KERNEL_CACHE=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    results = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
        results.append([int(v) for v in line.split()[1:]])
    (tok1, ref1, hits1, misses1), (tok2, ref2, hits2, misses2) = results
    assert tok1 == ref1 == tok2 == ref2
    assert hits1 == 0 and misses1 == 2  # compiled, then saved
    assert hits2 == 2 and misses2 == 0  # loaded
    assert any(tmp_path.glob("*.nbc"))


NORMS = r'''
import numpy as np
from numba import cuda
from luce.kernels.norm import norm_shape, rms_norm_cuda, rms_norm_ref
rng = np.random.default_rng(0)
for d in (200, 640):  # 256 and then 1024 threads a block: one closure, two launch bounds
    assert norm_shape(d)[1] == (256 if d == 200 else 1024)
    x = rng.standard_normal((3, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    got = rms_norm_cuda(cuda.to_device(x), cuda.to_device(w), 1e-6).copy_to_host()
    np.testing.assert_allclose(got, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)
print("OK")
'''


def test_kernels_of_one_closure_and_other_launch_bounds_are_kept_apart(tmp_path):
    """Two RMSNorm kernels whose factory differs only in the launch bound (threads a block)
    have one closure; the cache keyed by it alone loaded the 256-thread kernel for the
    1024-thread launch, refused with CUDA_ERROR_INVALID_VALUE. In a fresh cache, in one
    interpreter and again in the next (loading both)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", LUCE_KERNEL_CACHE=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", NORMS], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
