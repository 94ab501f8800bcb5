"""A paged KV cache with speculative commit and host offload: the CUDA backend's cache.

Same interface and semantics as luce.kv.cache.KVCache (reserve, write, committed,
commit(accepted), truncate, n_past), stored as 64-token blocks of a slot pool
(layout: luce.kernels.paging). `device=False` keeps the pool in numpy and runs the
paging references, `device=True` keeps it on the GPU and runs the kernels; both pass
the same tests (tests/kernels/test_paging.py).

evict(blocks) copies blocks to pinned host memory on a side stream and frees their
slots; restore(blocks) copies them back, bit-exact, into whatever slots are free.
Callers must not run attention over evicted blocks; `wait(stream)` orders a compute
stream after pending restores.
"""
from __future__ import annotations

import numpy as np

from ..kernels.paging import (BLOCK, compact_cuda, compact_ref, gather_kv_cuda, gather_kv_ref, write_kv_cuda,
                              write_kv_ref)


class PagedKVCache:
    def __init__(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, dtype=np.float16, *,
                 device: bool = False, n_slots: int | None = None, stream=None):
        self.n_layers, self.n_ctx, self.n_kv_heads, self.head_dim = n_layers, n_ctx, n_kv_heads, head_dim
        self.dtype = np.dtype(dtype)
        self.device = device
        self.max_blocks = -(-n_ctx // BLOCK)
        self.n_slots = self.max_blocks if n_slots is None else n_slots
        shape = (self.n_slots, n_layers, n_kv_heads, BLOCK, head_dim)
        self.table = np.full(self.max_blocks, -1, np.int32)  # logical block -> slot
        self.free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out low slots first
        self.host = {}  # logical block -> (k, v) host copies of evicted blocks
        self.n_past = 0
        self.n_pending = 0
        if device:
            from numba import cuda
            self._cuda = cuda
            self.stream = stream if stream is not None else cuda.default_stream()
            self.side = cuda.stream()  # evict/restore copies overlap compute
            self.k_pool = cuda.device_array(shape, dtype=self.dtype)
            self.v_pool = cuda.device_array(shape, dtype=self.dtype)
            self.table_d = cuda.to_device(self.table)
            self.pos_d = cuda.to_device(np.zeros(n_ctx, np.int32))
            # meta[0] = n_past, meta[1] = rows of the pending forward: what kernels read
            # instead of launch arguments, so a captured graph stays valid
            self.meta = cuda.to_device(np.zeros(4, np.int32))
            self._side_event = None
            self._dirty_slots = []  # slots freed by an eviction still copying out
        else:
            self.k_pool = np.zeros(shape, dtype=self.dtype)
            self.v_pool = np.zeros(shape, dtype=self.dtype)
            self.pos = np.zeros(n_ctx, np.int64)

    # ------------------------------------------------------------------ bookkeeping
    def _sync_meta(self) -> None:
        if self.device:
            self.meta.copy_to_device(np.array([self.n_past, self.n_pending, 0, 0], np.int32), stream=self.stream)

    def _sync_table(self) -> None:
        if self.device:
            self.table_d.copy_to_device(self.table, stream=self.stream)

    def _alloc(self) -> int:
        if not self.free and self.device and self._dirty_slots:
            self.side.synchronize()  # an eviction's copy must finish before its slot is reused
            self.free.extend(self._dirty_slots)
            self._dirty_slots = []
        if not self.free:
            raise MemoryError("KV pool out of blocks: evict or truncate first")
        return self.free.pop()

    def _map_rows(self, end: int) -> None:
        changed = False
        for b in range(-(-end // BLOCK)):
            if self.table[b] < 0:
                if b in self.host:
                    raise RuntimeError(f"block {b} is evicted: restore it first")
                self.table[b] = self._alloc()
                changed = True
        if changed:
            self._sync_table()

    def _unmap_from(self, n_rows: int) -> None:
        keep = -(-n_rows // BLOCK)
        changed = False
        for b in range(keep, self.max_blocks):
            self.host.pop(b, None)
            if self.table[b] >= 0:
                self.free.append(int(self.table[b]))
                self.table[b] = -1
                changed = True
        if changed:
            self._sync_table()

    @property
    def blocks_in_use(self) -> int:
        return int((self.table >= 0).sum())

    # ------------------------------------------------------------------ KVCache interface
    def reserve(self, n_new: int) -> None:
        if self.n_past + n_new > self.n_ctx:
            raise ValueError(f"context full: {self.n_past} + {n_new} tokens > n_ctx {self.n_ctx}")
        self._map_rows(self.n_past + n_new)
        self.n_pending = n_new
        self._sync_meta()

    def write(self, layer: int, k_new, v_new, positions) -> None:
        """K/V of the pending tokens ([N, Hkv, D]; device arrays or numpy) at rows n_past..."""
        if self.device:
            cuda = self._cuda
            dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a, dtype=dt), stream=self.stream) \
                if isinstance(a, np.ndarray) else a
            write_kv_cuda(self.k_pool, self.v_pool, self.table_d, layer, self.meta, dev(k_new, self.dtype),
                          dev(v_new, self.dtype), dev(np.asarray(positions), np.int32), self.pos_d, self.stream)
        else:
            write_kv_ref(self.k_pool, self.v_pool, self.table, layer, self.n_past, k_new, v_new)
            self.pos[self.n_past:self.n_past + len(k_new)] = positions

    def committed(self, layer: int):
        """(k, v, pos) of the committed rows as host arrays ([n_past, Hkv, D] in the cache
        dtype, int64 [n_past]): for the CPU path and tests; attention reads the pool."""
        n = self.n_past
        if self.device:
            k = gather_kv_cuda(self.k_pool, self.table_d, layer, 0, n, stream=self.stream).copy_to_host(
                stream=self.stream)
            v = gather_kv_cuda(self.v_pool, self.table_d, layer, 0, n, stream=self.stream).copy_to_host(
                stream=self.stream)
            pos = self.pos_d.copy_to_host(stream=self.stream)[:n].astype(np.int64)
            self.stream.synchronize()
            return k, v, pos
        return (gather_kv_ref(self.k_pool, self.table, layer, 0, n),
                gather_kv_ref(self.v_pool, self.table, layer, 0, n), self.pos[:n].copy())

    def commit(self, accepted=None) -> None:
        """Keep the pending rows `accepted` (indices into the last forward's tokens, in
        the order they become committed); None keeps them all."""
        if accepted is None:
            self.n_past += self.n_pending
        else:
            idx = np.asarray(accepted, dtype=np.int64)
            if len(idx) and (idx.min() < 0 or idx.max() >= self.n_pending):
                raise IndexError("accepted row outside the last forward")
            if not np.array_equal(idx, np.arange(len(idx))):
                first = int(np.argmax(idx != np.arange(len(idx))))  # rows before it stay put
                if len(idx) - first > 64 and np.any(np.diff(idx[first:]) <= 0):
                    raise ValueError("more than 64 rows to move must be in increasing order")
                if self.device:
                    acc = self._cuda.to_device(idx.astype(np.int32), stream=self.stream)
                    compact_cuda(self.k_pool, self.v_pool, self.table_d, self.meta, acc, len(idx), self.pos_d,
                                 stream=self.stream, first=first)
                else:
                    compact_ref(self.k_pool, self.v_pool, self.table, self.n_past, idx, self.pos)
            self.n_past += len(idx)
        self.n_pending = 0
        self._unmap_from(self.n_past)
        self._sync_meta()

    def truncate(self, n: int) -> None:
        """Forget everything after the first n committed rows (prefix reuse, rollback)."""
        self.n_past = min(self.n_past, n)
        self.n_pending = 0
        self._unmap_from(self.n_past)
        self._sync_meta()

    # ------------------------------------------------------------------ offload
    def evict(self, blocks=None) -> list[int]:
        """Copy logical blocks (default: every mapped one) to host memory and free their
        slots. On the device the copies run on a side stream after the compute stream's
        pending work; returns the evicted block numbers."""
        blocks = [b for b in (range(self.max_blocks) if blocks is None else blocks) if self.table[b] >= 0]
        if self.device:
            cuda = self._cuda
            ev = cuda.event()
            ev.record(self.stream)
            ev.wait(self.side)  # the rows being copied out may still be written by compute
        for b in blocks:
            s = int(self.table[b])
            if self.device:
                k = cuda.pinned_array(self.k_pool.shape[1:], self.dtype)
                v = cuda.pinned_array(self.v_pool.shape[1:], self.dtype)
                self.k_pool[s].copy_to_host(k, stream=self.side)
                self.v_pool[s].copy_to_host(v, stream=self.side)
                self._dirty_slots.append(s)
            else:
                k, v = self.k_pool[s].copy(), self.v_pool[s].copy()
                self.free.append(s)
            self.host[b] = (k, v)
            self.table[b] = -1
        self._sync_table()
        return blocks

    def restore(self, blocks=None) -> list[int]:
        """Copy evicted blocks (default: all) back into free slots; on the device the
        copies are asynchronous on the side stream: call wait() before reading them."""
        blocks = sorted(self.host) if blocks is None else list(blocks)
        if self.device:
            self.side.synchronize()  # the evictions' copies into these host buffers are done
            self.free.extend(self._dirty_slots)
            self._dirty_slots = []
        for b in blocks:
            k, v = self.host.pop(b)
            s = self._alloc()
            if self.device:
                self.k_pool[s].copy_to_device(k, stream=self.side)
                self.v_pool[s].copy_to_device(v, stream=self.side)
            else:
                self.k_pool[s] = k
                self.v_pool[s] = v
            self.table[b] = s
        if self.device:
            self._side_event = self._cuda.event()
            self._side_event.record(self.side)
        self._sync_table()
        return blocks

    def wait(self, stream=None) -> None:
        """Make `stream` (default: the compute stream) wait for pending restores."""
        if self.device and self._side_event is not None:
            self._side_event.wait(self.stream if stream is None else stream)

    def synchronize(self) -> None:
        if self.device:
            self.side.synchronize()
            self.stream.synchronize()
