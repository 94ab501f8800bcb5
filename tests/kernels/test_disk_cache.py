"""luce.kernels.disk_cache: the key of a factory-made kernel is the same in two fresh
interpreters (numba's own closure pickle is not: a dispatcher pickles with a per-process
uuid) and differs where the factory's arguments differ; every kernel the modules create
at import gets the cache. Dispatchers are made without a GPU (NUMBA_ENABLE_CUDASIM=0 in a
subprocess: creating one needs no driver); saving and loading compiled kernels needs a
device: tests/gpu/test_disk_cache_gpu.py."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from luce.kernels import disk_cache

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import gc
from numba.cuda.dispatcher import CUDADispatcher
from luce.kernels import attention, disk_cache, matvec, matvec_fast, persistent_decode, sampling
from luce.kernels.dequant import T
ks = [attention._decode_kernel(128, 4, 1, 4, 1, 16), attention._decode_kernel(64, 4, 1, 4, 1, 16),
      matvec_fast._kernel(T.Q4_K, True, False, False, 4, True, None, 8, 1, 2), sampling._sample_kernels(64)[1]]
# made by the backend, not at import: the draft's persistent kernel (Qwen3-0.6B's shape)
# and the generic matvec
made = [persistent_decode._kernel(1024, 16, 8, 128, 3072, 28, 128, False, True, 1e-6, 512, 64, True, 0),
        matvec._make_kernel(T.Q8_0, 4, 8, 1, 2, False, False, False)]
print("MADE", " ".join(type(k._cache).__name__ for k in made))
print("KEYS", " ".join(disk_cache.closure_key(k.py_func) for k in ks))
from luce.kernels import norm
# one closure, two launch bounds (the threads a block): kernels that must not share a cache entry
ns = [norm._rms_norm_kernel(1, 256), norm._rms_norm_kernel(1, 1024)]
print("NORM", " ".join(disk_cache.closure_key(k.py_func) for k in ns),
      " ".join(k._cache._closure_key for k in ns))
ds = [o for o in gc.get_objects() if isinstance(o, CUDADispatcher) and not o.targetoptions.get("device")]
print("CACHED", sum(type(d._cache).__name__ == "KernelCache" for d in ds), len(ds))
print("STAMP", disk_cache.stamp())
from numba import cuda
from luce.kernels import pdl
@cuda.jit
def elsewhere(x):  # a plugin's kernel: its device functions are not in the stamp
    x[0] = 1
print("PLUGIN", type(pdl.ready(elsewhere)._cache).__name__)
'''


def _run(tmp_path, **env):
    e = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", LUCE_KERNEL_CACHE=str(tmp_path), PYTHONPATH=str(ROOT), **env)
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line[:1].isupper())
    assert out["PLUGIN"] != "KernelCache"
    assert out["MADE"].split() == ["KernelCache"] * 2
    c256, c1024, k256, k1024 = out["NORM"].split()
    assert c256 == c1024 and k256 != k1024  # the closures agree; the cache keys see the launch bound
    return out["KEYS"].split(), [int(v) for v in out["CACHED"].split()], out["STAMP"]


def test_keys_agree_across_interpreters_and_every_kernel_is_cached(tmp_path):
    keys, (cached, total), stamp = _run(tmp_path)
    keys2, _, stamp2 = _run(tmp_path)
    assert keys == keys2 and stamp == stamp2
    assert len(set(keys)) == 4  # head dim 128 vs 64, another factory, another module
    assert total >= 10 and cached == total
    _, _, stamp3 = _run(tmp_path, LUCE_PDL="0")  # a compile-time setting: another stamp
    assert stamp3 != stamp
    _, _, stamp4 = _run(tmp_path, LUCE_API_KEY="k")  # the server's key: no kernel's code
    assert stamp4 == stamp


def test_describe_by_value():
    def make(n, f):
        def k():
            return n + f()
        return k

    def one():
        return 1

    def two():
        return 2
    d = disk_cache.describe
    k = make(3, one)
    assert d(k.__closure__[k.__code__.co_freevars.index("f")].cell_contents) == d(one)
    assert disk_cache.closure_key(make(3, one)) == disk_cache.closure_key(make(3, one))
    assert disk_cache.closure_key(make(3, one)) != disk_cache.closure_key(make(4, one))
    assert disk_cache.closure_key(make(3, one)) != disk_cache.closure_key(make(3, two))
    assert d(np.float32) != d(np.float64) and d((1, 2.0, "a")) == d((1, 2.0, "a"))
    with pytest.raises(disk_cache.Undescribable):
        d(object())
    f = make(3, one)
    kk = disk_cache.kernel_key
    assert kk(f, {"launch_bounds": 256}) != kk(f, {"launch_bounds": 1024})
    assert kk(f, {"launch_bounds": (192, 2), "link": ()}) == kk(f, {"link": (), "launch_bounds": (192, 2)})
    assert kk(f, {"extensions": []}) == kk(f, {"extensions": []})
    with pytest.raises(disk_cache.Undescribable):
        kk(f, {"extensions": [object()]})


def test_an_unwritable_directory_leaves_kernels_uncached(tmp_path):
    (tmp_path / "a_file").write_text("")
    assert not disk_cache._writable(tmp_path / "a_file" / "kernels")  # cannot be made, even by root
    assert disk_cache._writable(tmp_path / "w" / "kernels")


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("LUCE_KERNEL_CACHE", "0")
    assert disk_cache.cache_dir() is None
    monkeypatch.setenv("LUCE_KERNEL_CACHE", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path
    monkeypatch.delenv("LUCE_KERNEL_CACHE")
    monkeypatch.setenv("LUCE_CACHE", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "kernels"


DAMAGED = r'''
import warnings
from luce.kernels import disk_cache, sampling
k = sampling._sample_kernels(64)[1]
assert type(k._cache).__name__ == "KernelCache"
class Codegen:
    def magic_tuple(self):
        return ("nvptx64", "sm_90", "")
class Ctx:
    def refresh(self):
        pass
    def codegen(self):
        return Codegen()
k._cache._impl.locator.ensure_cache_path()
open(k._cache._cache_file._index_path, "wb").write(b"not a pickle")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    assert k._cache.load_overload(("sig",), Ctx()) is None
assert any("could not be read" in str(x.message) for x in w), [str(x.message) for x in w]
print("OK")
'''


def test_a_damaged_cache_file_means_compiling_not_failing(tmp_path):
    e = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", LUCE_KERNEL_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", DAMAGED], capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
