"""CUDA graphs of numba launches: capture a forward once, replay it every step.

A numba launch costs 20-50 us on the host; a replayed graph ~0.5-0.9 us a kernel
(shared/gpu/NOTES.md). Everything a captured forward reads must sit at a fixed address
(inputs are copied into fixed buffers before replay), and everything that changes per
step (context length, block table, positions) must be read from device memory.
"""
from __future__ import annotations


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        from cuda.bindings import driver
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA graph call failed: {name.decode() if isinstance(name, bytes) else name}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


class Graph:
    """The launches `fn()` makes on `stream` (a numba stream), captured for replay."""

    def __init__(self, stream, fn):
        from cuda.bindings import driver
        self.stream = stream
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _check(driver.cuStreamBeginCapture(stream.handle, mode))
        try:
            fn()
        finally:
            graph = _check(driver.cuStreamEndCapture(stream.handle))
        self._graph = graph
        self._exec = _check(driver.cuGraphInstantiate(graph, 0))

    def replay(self) -> None:
        from cuda.bindings import driver
        _check(driver.cuGraphLaunch(self._exec, self.stream.handle))

    def __del__(self):
        try:
            from cuda.bindings import driver
            driver.cuGraphExecDestroy(self._exec)
            driver.cuGraphDestroy(self._graph)
        except Exception:  # interpreter shutdown: the driver frees them with the context
            pass
