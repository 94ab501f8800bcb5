"""Forward kernels compiled once per machine: an on-disk cache that numba's own key cannot be.

Why: the CUDA backend compiles its kernels when a model loads, every time `luce serve`
starts (H200, Qwen3-8B shape: 40-46 s of `luce bench`'s "first prefill + 4 decode steps"
went to compiling and capturing). numba's cache (`cuda.jit(cache=True)`) keys a kernel by
its bytecode and a pickle of its closure; the kernels here come from factories whose
closures hold device functions, and a dispatcher pickles with a uuid drawn per process,
so that key never matched in a new process (checked: the decode attention and matvec
kernels' closure hashes differ between two interpreters).

How: `enable(kernel)` (luce.kernels.pdl.ready calls it: every forward kernel passes there)
gives the dispatcher a numba CUDACache whose index key describes the closure by value
instead: numbers, strings and enums by repr, device functions and plain functions by
their code (constants and nested code included) and their own closures, recursively;
with the dispatcher's compile options (launch bounds) beside it (kernel_key).
What that key does not see is in the stamp of the whole cache: the source of every
luce.kernels module (globals and called device functions), the LUCE_* and NUMBA_*
settings (read at compile time: LUCE_PDL, LUCE_WEIGHT_HINT, ...), numba-cuda's version.
numba adds the device's compute capability. A closure value this cannot describe leaves
that kernel uncached (compiled as before).

Where: LUCE_KERNEL_CACHE (a directory; default ~/.cache/luce/kernels; 0 turns it off).
"""
from __future__ import annotations

import enum
import functools
import hashlib
import os
import types
import warnings
from pathlib import Path

import numpy as np
from numba import cuda

SIM = bool(cuda.config.ENABLE_CUDASIM)


def cache_dir() -> Path | None:
    v = os.environ.get("LUCE_KERNEL_CACHE", "")
    if v == "0":
        return None
    if v:
        return Path(v).expanduser()
    base = Path(os.environ.get("LUCE_CACHE", "~/.cache/luce")).expanduser()
    return base / "kernels"


# settings no kernel's code depends on (where files go, the server's key, plugins, models)
_NOT_CODE = frozenset({"LUCE_KERNEL_CACHE", "LUCE_CACHE", "LUCE_API_KEY", "LUCE_PLUGINS", "LUCE_DRAFT_DIR",
                       "LUCE_MODEL_CACHE", "LUCE_COMMIT", "LUCE_DRAFT_ON_DEVICE",
                       "LUCE_DRAFT_DEVICE_STOP"})


@functools.lru_cache(maxsize=None)
def stamp() -> str:
    """What every cached kernel depends on beyond its own closure (see the module doc)."""
    import numba_cuda
    h = hashlib.sha256(numba_cuda.__version__.encode())
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    for k in sorted(os.environ):
        if k.startswith(("LUCE_", "NUMBA_")) and k not in _NOT_CODE:
            h.update(f"{k}={os.environ[k]}\0".encode())
    return h.hexdigest()[:20]


class Undescribable(TypeError):
    pass


def describe(v, _seen=None) -> str:
    """A description of a closure value that is the same in every process for the same
    value and differs where the compiled code could (Undescribable where it cannot tell)."""
    seen = set() if _seen is None else _seen
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return repr(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__qualname__}.{v.name}"
    if isinstance(v, (np.generic, np.dtype)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, type):
        return f"type:{v.__module__}.{v.__qualname__}"
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__}(" + ",".join(describe(x, seen) for x in v) + ")"
    if isinstance(v, dict):
        return "dict(" + ",".join(f"{describe(k, seen)}:{describe(x, seen)}" for k, x in
                                  sorted(v.items(), key=lambda kv: repr(kv[0]))) + ")"
    if id(v) in seen:  # a recursive closure: its name is enough the second time
        return f"<seen {getattr(v, '__qualname__', type(v).__name__)}>"
    seen.add(id(v))
    py_func = getattr(v, "py_func", None)  # a numba dispatcher: device function or kernel
    if isinstance(py_func, types.FunctionType):
        opts = getattr(v, "targetoptions", {})
        return "jit:" + _function(py_func, seen) + describe({k: opts[k] for k in sorted(opts)
                                                              if isinstance(opts[k], (bool, int, str))}, seen)
    defn = getattr(v, "_defn", None)  # a numba intrinsic: its typing/codegen function
    if isinstance(defn, types.FunctionType):
        return "intrinsic:" + _function(defn, seen)
    if isinstance(v, types.FunctionType):
        return "fn:" + _function(v, seen)
    raise Undescribable(f"{type(v).__module__}.{type(v).__qualname__}")


def _code(c: types.CodeType) -> str:
    consts = ",".join(_code(x) if isinstance(x, types.CodeType) else repr(x) for x in c.co_consts)
    return f"{c.co_name}:{hashlib.sha256(c.co_code).hexdigest()[:16]}:[{consts}]:{c.co_names}"


def _function(f: types.FunctionType, seen) -> str:
    cells = tuple(c.cell_contents for c in f.__closure__) if f.__closure__ else ()
    return (f"{f.__module__}.{f.__qualname__}({_code(f.__code__)})"
            f"[{describe(cells, seen)}]{describe(f.__defaults__, seen)}")


def closure_key(py_func) -> str:
    """The hash of a kernel's code and closure by value."""
    return hashlib.sha256(_function(py_func, set()).encode()).hexdigest()


def kernel_key(py_func, targetoptions) -> str:
    """closure_key with the options the dispatcher compiles with (cuda.jit's launch_bounds,
    fastmath, ...). Why: a factory may pass its argument only as an option (the RMSNorm
    kernel's threads a block as its launch bound), and then two kernels share one closure;
    keyed by the closure alone, the one compiled for 256 threads was loaded for a
    1024-thread launch, which the driver refused (CUDA_ERROR_INVALID_VALUE; H200, a
    Gemma-shaped test after a Qwen-shaped one in one process). An option that cannot be
    described and is set leaves the kernel uncached (Undescribable)."""
    parts = []
    for k in sorted(targetoptions or {}):
        v = targetoptions[k]
        try:
            parts.append(f"{k}={describe(v)}")
        except Undescribable:
            if v:
                raise
            parts.append(f"{k}=<empty {type(v).__name__}>")
    return hashlib.sha256((_function(py_func, set()) + "|" + ";".join(parts)).encode()).hexdigest()


if not SIM:
    from numba.cuda.core.caching import _CacheLocator
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class _Locator(_CacheLocator):
        def __init__(self, py_func):
            self._path = str(cache_dir())
            self._lineno = py_func.__code__.co_firstlineno

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return stamp()

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            return cls(py_func)

    class _Impl(CUDACacheImpl):
        _locator_classes = [_Locator]

    class KernelCache(CUDACache):
        """numba's CUDA cache with the closure described by value (closure_key)."""
        _impl_class = _Impl

        def __init__(self, py_func, key: str):
            self._closure_key = key
            super().__init__(py_func)

        def load_overload(self, sig, target_context):
            # numba rebuilds a cached kernel without the attributes its compiled form has;
            # luce reads py_func at launch (cuda_graph records which launches are PDL-ready:
            # without it every capture failed and decode ran eagerly, H200: 7 tok/s)
            try:
                kernel = super().load_overload(sig, target_context)
            except Exception as e:  # a damaged file (numba re-raises unpickling errors): compile
                warnings.warn(f"luce: a cached kernel in {self._cache_path} could not be read ({e!r}); compiling it")
                return None
            if kernel is not None:
                kernel.py_func = self._py_func
                kernel.argtypes = tuple(kernel.signature.args)
            return kernel

        def save_overload(self, sig, data):
            try:
                super().save_overload(sig, data)
            except Exception as e:  # a full disk: the kernel is compiled, only not kept
                warnings.warn(f"luce: a compiled kernel could not be saved in {self._cache_path} ({e!r})")

        def _index_key(self, sig, codegen):
            import numba_cuda
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, self._closure_key)
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key


@functools.lru_cache(maxsize=None)
def _writable(path: Path) -> bool:
    """numba's save raises where the directory cannot be made or written (a read-only home):
    then kernels compile as without a cache."""
    import tempfile
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def enable(kernel):
    """Give a numba kernel dispatcher the disk cache, where there is one to give (a GPU
    build, a kernel of luce.kernels, LUCE_KERNEL_CACHE not 0 and writable, a closure this
    module can describe). Returns the kernel."""
    py_func = getattr(kernel, "py_func", None)
    # the stamp covers luce.kernels' sources only: a plugin's kernel, whose device
    # functions may live anywhere, compiles as before
    if SIM or not isinstance(py_func, types.FunctionType) or not py_func.__module__.startswith(__package__ + "."):
        return kernel
    where = cache_dir()
    if where is None or not _writable(where):
        return kernel
    try:
        key = kernel_key(kernel.py_func, getattr(kernel, "targetoptions", None))
    except Undescribable:
        return kernel
    kernel._cache = KernelCache(kernel.py_func, key)
    return kernel


def counts() -> tuple[int, int]:
    """(kernels loaded from the disk cache, kernels compiled) in this process so far, over
    the dispatchers that have the cache."""
    import gc
    hits = misses = 0
    for o in gc.get_objects():
        cache = getattr(o, "_cache", None) if type(o).__name__ == "CUDADispatcher" else None
        if cache is not None and type(cache).__name__ == "KernelCache":
            hits += sum(o._cache_hits.values())
            misses += sum(o._cache_misses.values())
    return hits, misses
