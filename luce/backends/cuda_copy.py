"""Host <-> device copies on the per-token path of the CUDA backend, one driver call each.

numba's copy_to_device / copy_to_host and device-array slicing cost tens of microseconds
of Python apiece (context checks, array wrappers; H200 machine: ~2.8 ms of host time
around a 8.3 ms Qwen3-8B decode graph). A decode step makes a handful of copies, so they
go straight to cuMemcpy*Async here. The simulator keeps numba's methods.
"""
from __future__ import annotations

import os
import threading
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


class Ring:
    """Round-robin byte ranges of a fixed buffer. `take(n)` returns (offset, wrapped):
    wrapped says the range starts a new lap, so whatever read the previous lap's bytes
    must be finished before they are overwritten."""

    ALIGN = 16

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.off = 0

    def take(self, n: int) -> tuple[int, bool]:
        if n > self.nbytes:
            raise ValueError(f"{n} bytes do not fit a ring of {self.nbytes}")
        wrapped = self.off + n > self.nbytes
        if wrapped:
            self.off = 0
        start = self.off
        self.off += -(-n // self.ALIGN) * self.ALIGN
        return start, wrapped


class _Staging:
    """Pinned host memory that small host-to-device copies go through. From pageable memory
    the driver stages each copy itself (~20 us of host time a call on the H200 machine)
    and may wait for the stream first, which would stall a host that queues work ahead;
    from pinned memory cuMemcpyHtoDAsync only queues the copy. The source bytes are copied
    into the ring when h2d is called, so the caller may change its array at once. Before a
    lap overwrites bytes that queued copies may still read, every stream that copied from
    the ring in the previous lap is synchronized (a 1 MiB lap is thousands of decode steps)."""

    def __init__(self, nbytes: int = 1 << 20):
        from numba import cuda
        self.buf = cuda.pinned_array(nbytes, np.uint8)
        self.ring = Ring(nbytes)
        self.streams: dict = {}  # streams that read this lap's bytes
        self.lock = threading.Lock()

    def copy(self, dst_ptr: int, src: np.ndarray, stream) -> None:
        from cuda.bindings import driver
        n = src.nbytes
        with self.lock:
            start, wrapped = self.ring.take(n)
            if wrapped:
                for s in self.streams.values():
                    s.synchronize()
                self.streams.clear()
            self.streams[id(stream)] = stream
            self.buf[start:start + n] = src.reshape(-1).view(np.uint8)
            _check(driver.cuMemcpyHtoDAsync(dst_ptr, self.buf.ctypes.data + start, n, stream.handle))


_STAGING: list = []  # made at the first staged copy (it needs a CUDA context)
STAGE_MAX = 4096  # bytes: larger copies (prompts, tables of long contexts) go directly


# Small host-to-device copies through the pinned ring, and greedy decoding with the next
# step queued on the device (engine.generator.DeviceStepper); LUCE_ASYNC_HOST=0 turns
# both off. H200, Qwen3-8B shape, 3000fcd: 236.8 decode tok/s this way, 230.3 with the host
# reading logits and taking the argmax every step (the graph alone: 242.7).
ASYNC_HOST = os.environ.get("LUCE_ASYNC_HOST", "1") == "1"


def h2d(dst, src, stream) -> None:
    """dst (device, contiguous) <- src (host array of the same byte size). src may be
    changed or freed as soon as this returns."""
    if not src.flags.c_contiguous:
        src = np.ascontiguousarray(src)
    if SIM:
        dst.copy_to_device(src.reshape(dst.shape), stream=stream)
        return
    if src.nbytes <= STAGE_MAX and ASYNC_HOST:
        if not _STAGING:
            _STAGING.append(_Staging())
        _STAGING[0].copy(dev_ptr(dst), src, stream)
        return
    from cuda.bindings import driver  # pageable: the driver stages it before returning
    _check(driver.cuMemcpyHtoDAsync(dev_ptr(dst), src.ctypes.data, src.nbytes, stream.handle))


def d2d(dst, src, stream) -> None:
    """dst <- src, both device arrays of the same byte size, queued on stream."""
    if SIM:
        dst.copy_to_device(src, stream=stream)
        return
    from cuda.bindings import driver
    _check(driver.cuMemcpyDtoDAsync(dev_ptr(dst), dev_ptr(src), src.nbytes, stream.handle))


def d2h_async(dst: np.ndarray, src, stream) -> None:
    """dst (host, pinned) <- src (device), queued on stream: read dst after an event
    recorded behind it has completed."""
    if SIM:
        src.copy_to_host(dst.reshape(src.shape), stream=stream)
        return
    from cuda.bindings import driver
    _check(driver.cuMemcpyDtoHAsync(dst.ctypes.data, dev_ptr(src), dst.nbytes, stream.handle))


def d2h_sync(dst: np.ndarray, src, stream) -> None:
    """dst (host, ideally pinned) <- src (device), then wait for the stream."""
    if SIM:
        src.copy_to_host(dst.reshape(src.shape), stream=stream)
        stream.synchronize()
        return
    from cuda.bindings import driver
    _check(driver.cuMemcpyDtoHAsync(dst.ctypes.data, dev_ptr(src), dst.nbytes, stream.handle))
    _check(driver.cuStreamSynchronize(stream.handle))
