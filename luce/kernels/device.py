"""`device`: numba's `cuda.jit(device=True)`, except in the CUDA simulator for functions
that never name the `cuda` module: there they stay plain Python functions.

Why: the simulator runs every device-function call inside a swap of its module's `cuda`
global, taking a global lock and a per-module lock on each call. The kernels here make
millions of such calls from 32-256 simulated threads (one OS thread each), and each lock
hand-off waits for the GIL: the same test ran 10 s one time and past its 600 s timeout
the next, and a test killed by its timeout left threads holding those locks, so every
later kernel of the module hung (a fresh-clone CI run ended that way). A function that
never reads `cuda.*` needs no swap; the ones that do (thread indices, barriers, shared
memory) keep numba's wrapper. On a GPU nothing changes.
"""
from __future__ import annotations

import types

from numba import cuda

SIM = bool(cuda.config.ENABLE_CUDASIM)


def _names_cuda(code: types.CodeType) -> bool:
    return "cuda" in code.co_names or any(
        _names_cuda(c) for c in code.co_consts if isinstance(c, types.CodeType))


def device(fn=None, *, inline: bool = False):
    """As a decorator, bare or as `device(inline=True)` (inlined in numba's IR: a local
    array passed in then stays in registers when the caller's indices are constants)."""
    if fn is None:
        return lambda f: device(f, inline=inline)
    if SIM and not _names_cuda(fn.__code__):
        return fn
    return cuda.jit(device=True, inline=inline)(fn) if inline else cuda.jit(device=True)(fn)


if SIM:
    def fma(a, b, c):
        """a * b + c (the simulator's cuda.fma, without the module swap)."""
        return a * b + c
else:
    @cuda.jit(device=True)
    def fma(a, b, c):
        # numba types cuda.fma only as an attribute of the cuda module, not under another name
        return cuda.fma(a, b, c)


SMEM_STATIC = 48 * 1024  # shared memory a launch gets without opting in
_OPTED_IN: set = set()  # ids of compiled kernels whose dynamic shared memory limit is raised


def _opt_in(nbytes: int):
    """A pre-launch callback raising a kernel's dynamic shared memory limit to nbytes, once a
    compiled kernel (cuKernelSetAttribute: numba does not)."""
    def callback(kern, _config):
        if id(kern) in _OPTED_IN:
            return
        from numba.cuda.cudadrv.driver import binding, driver
        f = kern._codelibrary.get_cufunc()
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, nbytes, f.handle, f.device.id)
        _OPTED_IN.add(id(kern))
    return callback


def with_shared(kernel, grid, block, stream, nbytes: int):
    """kernel[grid, block, stream, nbytes], opted into nbytes of dynamic shared memory where
    that passes the 48 KB a launch gets by default."""
    cfg = kernel[grid, block, stream, nbytes]
    if nbytes > SMEM_STATIC and not SIM:
        cfg.pre_launch_callbacks.append(_opt_in(nbytes))
    return cfg
