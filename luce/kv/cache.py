"""A contiguous host KV cache with speculative commit: the CPU backend's cache.

Rows [0, n_past) are committed. A forward over N new tokens writes their K/V at rows
n_past .. n_past+N-1 (the scratch rows); `commit(accepted)` moves the accepted rows
down to follow the committed ones, in order, and discards the rest. Plain decode and
prefill commit everything; a rollback is a commit of fewer rows.
"""
from __future__ import annotations

import numpy as np


def accepted_rows(accepted, n_pending: int) -> np.ndarray:
    """A commit's accepted rows as int64 indices, each inside the last forward's n_pending."""
    idx = np.asarray(accepted, dtype=np.int64)
    if len(idx) and (idx.min() < 0 or idx.max() >= n_pending):
        raise IndexError("accepted row outside the last forward")
    return idx


class KVCache:
    def __init__(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, dtype=np.float32):
        self.n_ctx = n_ctx
        self.k = np.zeros((n_layers, n_ctx, n_kv_heads, head_dim), dtype=dtype)
        self.v = np.zeros_like(self.k)
        self.pos = np.zeros(n_ctx, dtype=np.int64)  # rope position of each row
        self.n_past = 0
        self.n_pending = 0

    def reserve(self, n_new: int) -> None:
        if self.n_past + n_new > self.n_ctx:
            raise ValueError(f"context full: {self.n_past} + {n_new} tokens > n_ctx {self.n_ctx}")
        self.n_pending = n_new

    def write(self, layer: int, k_new: np.ndarray, v_new: np.ndarray, positions: np.ndarray) -> None:
        s, n = self.n_past, len(k_new)
        self.k[layer, s:s + n] = k_new
        self.v[layer, s:s + n] = v_new
        self.pos[s:s + n] = positions

    def committed(self, layer: int):
        return self.k[layer, :self.n_past], self.v[layer, :self.n_past], self.pos[:self.n_past]

    def commit(self, accepted=None) -> None:
        """Keep the scratch rows `accepted` (indices into the last forward's tokens,
        in the order they become committed); None keeps them all."""
        s = self.n_past
        if accepted is None:
            self.n_past += self.n_pending
        else:
            idx = accepted_rows(accepted, self.n_pending)
            if not np.array_equal(idx, np.arange(len(idx))):
                self.k[:, s:s + len(idx)] = self.k[:, s + idx]
                self.v[:, s:s + len(idx)] = self.v[:, s + idx]
                self.pos[s:s + len(idx)] = self.pos[s + idx]
            self.n_past += len(idx)
        self.n_pending = 0

    def truncate(self, n: int) -> None:
        """Forget everything after the first n committed rows (prefix reuse, rollback)."""
        self.n_past = min(self.n_past, n)
        self.n_pending = 0
