"""Backends run a family's forward on a device. `get_backend` picks one."""
from __future__ import annotations

from ..errors import LuceError

BACKENDS = ("auto", "cuda", "cpu")


class GreedyRows:
    """What verification needs of a forward: each logits row's argmax (`ids`), and a row's
    logits on demand (`rows[i]`, copied once), so that n argmaxes come back from the GPU
    instead of n x vocab floats (23 rows of a 151,936-token vocabulary: 14 MB a step), and
    sampled verification copies only the rows its walk down the tree visits."""

    def __init__(self, ids, fetch):
        self.ids = ids
        self._fetch = fetch
        self._rows = {}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        i = int(i)
        if i not in self._rows:
            self._rows[i] = self._fetch(i)
        return self._rows[i]


def greedy_rows(logits) -> GreedyRows:
    """GreedyRows over host logits (backends without an on-device form)."""
    import numpy as np
    return GreedyRows(np.argmax(logits, axis=-1), lambda i: logits[i])


def tile_runs(pool_rows: int, rows: int, start: int = 0):
    """(row, pool row, count) runs filling `rows` rows with a pool's rows from `start` on,
    wrapping: a random-weight model's matrices (tiled_weight)."""
    r, s = 0, start % pool_rows
    while r < rows:
        n = min(pool_rows - s, rows - r)
        yield r, s, n
        r, s = r + n, 0


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
