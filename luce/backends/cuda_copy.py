"""Host <-> device copies on the per-token path of the CUDA backend, one driver call each.

numba's copy_to_device / copy_to_host and device-array slicing cost tens of microseconds
of Python apiece (context checks, array wrappers; H200 machine: ~2.8 ms of host time
around a 8.3 ms Qwen3-8B decode graph). A decode step makes a handful of copies, so they
go straight to cuMemcpy*Async here. The simulator keeps numba's methods.
"""
from __future__ import annotations

import weakref

import numpy as np
from numba import cuda

from .cuda_graph import _check

SIM = bool(cuda.config.ENABLE_CUDASIM)


_PTRS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def dev_ptr(a) -> int:
    """The device address of `a`, remembered while `a` lives: numba computes
    __cuda_array_interface__ afresh on every access (~8 us of Python with its contiguity
    check), and a decode step copies into the same few buffers every time."""
    if type(a).__eq__ is not object.__eq__:  # torch-like elementwise ==: a weak-key lookup would call it
        return a.__cuda_array_interface__["data"][0]
    try:
        return _PTRS[a]
    except KeyError:
        ptr = _PTRS[a] = a.__cuda_array_interface__["data"][0]
        return ptr


def h2d(dst, src, stream) -> None:
    """dst (device, contiguous) <- src (host array of the same byte size). A pageable src
    is staged by the driver before the call returns, so it may be reused at once."""
    if not src.flags.c_contiguous:
        src = np.ascontiguousarray(src)
    if SIM:
        dst.copy_to_device(src.reshape(dst.shape), stream=stream)
        return
    from cuda.bindings import driver
    _check(driver.cuMemcpyHtoDAsync(dev_ptr(dst), src.ctypes.data, src.nbytes, stream.handle))


def d2h_sync(dst: np.ndarray, src, stream) -> None:
    """dst (host, ideally pinned) <- src (device), then wait for the stream."""
    if SIM:
        src.copy_to_host(dst.reshape(src.shape), stream=stream)
        stream.synchronize()
        return
    from cuda.bindings import driver
    _check(driver.cuMemcpyDtoHAsync(dst.ctypes.data, dev_ptr(src), dst.nbytes, stream.handle))
    _check(driver.cuStreamSynchronize(stream.handle))
