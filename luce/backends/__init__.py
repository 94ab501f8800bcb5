"""Backends run a family's forward on a device. `get_backend` picks one."""
from __future__ import annotations

from ..errors import LuceError

BACKENDS = ("auto", "cuda", "cpu")


def cuda_available() -> bool:
    try:
        from numba import cuda
        return bool(cuda.is_available()) and not cuda.config.ENABLE_CUDASIM
    except Exception:  # no driver, no libcuda: that is the CPU machine's normal case
        return False


def get_backend(name: str = "auto"):
    if name not in BACKENDS:
        raise LuceError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
    if name == "cuda":
        if not cuda_available():
            raise LuceError("--backend cuda: no CUDA GPU is available on this machine")
        from .cuda import CUDABackend
        return CUDABackend()
    from .cpu import CPUBackend
    return CPUBackend()
