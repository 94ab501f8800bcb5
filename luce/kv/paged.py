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

dtype "q8_0" stores K and V as ggml Q8_0 (int8 values + an f16 scale per 32): about half
the bytes of f16; committed() then returns the dequantized float32 rows.
"""
from __future__ import annotations

import numpy as np

from ..kernels.paging import (BLOCK, Q8, compact_cuda, compact_ref, dequantize_q8_0_ref, gather_kv_cuda,
                              gather_kv_ref, quantize_q8_0_ref, write_kv_cuda, write_kv_q8_cuda, write_kv_ref)
from .cache import accepted_rows


class PagedKVCache:
    def __init__(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, dtype=np.float16, *,
                 device: bool = False, n_slots: int | None = None, stream=None):
        self.n_layers, self.n_ctx, self.n_kv_heads, self.head_dim = n_layers, n_ctx, n_kv_heads, head_dim
        self.quant = isinstance(dtype, str) and dtype.lower() == "q8_0"
        self.dtype = np.dtype(np.int8 if self.quant else dtype)
        if self.quant and head_dim % Q8:
            raise ValueError(f"q8_0 KV needs head_dim a multiple of {Q8}")
        self.device = device
        self.max_blocks = -(-n_ctx // BLOCK)
        self.n_slots = self.max_blocks if n_slots is None else n_slots
        shape = (self.n_slots, n_layers, n_kv_heads, BLOCK, head_dim)
        scale_shape = (self.n_slots, n_layers, n_kv_heads, BLOCK, head_dim // Q8)
        self.k_scale = self.v_scale = None
        self.table = np.full(self.max_blocks, -1, np.int32)  # logical block -> slot
        self.free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out low slots first
        self.host = {}  # logical block -> host copies of its pools' slots (evicted)
        self.n_past = 0
        self.n_pending = 0
        if device:
            from numba import cuda
            self._cuda = cuda
            self.stream = stream if stream is not None else cuda.default_stream()
            self.side = cuda.stream()  # evict/restore copies overlap compute
            self.k_pool = cuda.device_array(shape, dtype=self.dtype)
            self.v_pool = cuda.device_array(shape, dtype=self.dtype)
            if self.quant:
                self.k_scale = cuda.device_array(scale_shape, dtype=np.float16)
                self.v_scale = cuda.device_array(scale_shape, dtype=np.float16)
            self.table_d = cuda.to_device(self.table)
            self.pos_d = cuda.to_device(np.zeros(n_ctx, np.int32))
            # meta[0] = n_past, meta[1] = rows of the pending forward: what kernels read
            # instead of launch arguments, so a captured graph stays valid
            self.meta = cuda.to_device(np.zeros(4, np.int32))
            self._meta_host = np.zeros(4, np.int32)
            self._acc = None  # _accepted_d's (device, host) buffers, made at the first commit that moves rows
            self._side_event = None
            self._dirty_slots = []  # slots freed by an eviction still copying out
        else:
            self.k_pool = np.zeros(shape, dtype=self.dtype)
            self.v_pool = np.zeros(shape, dtype=self.dtype)
            if self.quant:
                self.k_scale = np.zeros(scale_shape, dtype=np.float16)
                self.v_scale = np.zeros(scale_shape, dtype=np.float16)
            self.pos = np.zeros(n_ctx, np.int64)

    def _pairs(self):
        """(K, V) pool pairs that every row operation must touch."""
        return [(self.k_pool, self.v_pool)] + ([(self.k_scale, self.v_scale)] if self.quant else [])

    def _pools(self):
        return [p for pair in self._pairs() for p in pair]

    # ------------------------------------------------------------------ bookkeeping
    def _sync_meta(self) -> None:
        if self.device:
            from ..backends.cuda_copy import h2d  # twice a decode step: one driver call, not numba's copy
            m = self._meta_host  # reused: pageable, so the driver has staged it when h2d returns
            m[0], m[1] = self.n_past, self.n_pending
            h2d(self.meta, m, self.stream)

    def _sync_table(self) -> None:
        if self.device:
            from ..backends.cuda_copy import h2d
            h2d(self.table_d, self.table, self.stream)

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
        for b in [b for b in self.host if b >= keep]:
            del self.host[b]
        mapped = np.flatnonzero(self.table[keep:] >= 0) + keep  # every commit: no Python loop over the table
        if len(mapped):
            self.free.extend(int(s) for s in self.table[mapped])
            self.table[mapped] = -1
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
            # host ints are uploaded; a device array is used where it lies (np.asarray on it
            # would copy it to the host and back)
            pos = dev(np.asarray(positions) if isinstance(positions, (list, tuple)) else positions, np.int32)
            if self.quant:
                write_kv_q8_cuda(self.k_pool, self.k_scale, self.v_pool, self.v_scale, self.table_d, layer, self.meta,
                                 dev(k_new, np.float32), dev(v_new, np.float32), pos, self.pos_d, self.stream)
            else:
                write_kv_cuda(self.k_pool, self.v_pool, self.table_d, layer, self.meta, dev(k_new, self.dtype),
                              dev(v_new, self.dtype), pos, self.pos_d, self.stream)
        else:
            if self.quant:
                (kq, kd), (vq, vd) = quantize_q8_0_ref(k_new), quantize_q8_0_ref(v_new)
                write_kv_ref(self.k_pool, self.v_pool, self.table, layer, self.n_past, kq, vq)
                write_kv_ref(self.k_scale, self.v_scale, self.table, layer, self.n_past, kd, vd)
            else:
                write_kv_ref(self.k_pool, self.v_pool, self.table, layer, self.n_past, k_new, v_new)
            self.pos[self.n_past:self.n_past + len(k_new)] = positions

    def committed(self, layer: int):
        """(k, v, pos) of the committed rows as host arrays ([n_past, Hkv, D] in the cache
        dtype, int64 [n_past]): for the CPU path and tests; attention reads the pool."""
        n = self.n_past
        if self.device:
            def get(pool):
                return gather_kv_cuda(pool, self.table_d, layer, 0, n, stream=self.stream).copy_to_host(
                    stream=self.stream)
            pos = self.pos_d.copy_to_host(stream=self.stream)[:n].astype(np.int64)
        else:
            def get(pool):
                return gather_kv_ref(pool, self.table, layer, 0, n)
            pos = self.pos[:n].copy()
        k, v = get(self.k_pool), get(self.v_pool)
        if self.quant:
            k, v = dequantize_q8_0_ref(k, get(self.k_scale)), dequantize_q8_0_ref(v, get(self.v_scale))
        if self.device:
            self.stream.synchronize()
        return k, v, pos

    def commit(self, accepted=None) -> None:
        """Keep the pending rows `accepted` (indices into the last forward's tokens, in
        the order they become committed); None keeps them all."""
        if accepted is None:
            self.n_past += self.n_pending
        else:
            idx = accepted_rows(accepted, self.n_pending)
            if not np.array_equal(idx, np.arange(len(idx))):
                first = int(np.argmax(idx != np.arange(len(idx))))  # rows before it stay put
                if len(idx) - first > 64 and np.any(np.diff(idx[first:]) <= 0):
                    raise ValueError("more than 64 rows to move must be in increasing order")
                if self.device:
                    acc = self._accepted_d(idx)
                    for n_pair, (kp, vp) in enumerate(self._pairs()):
                        compact_cuda(kp, vp, self.table_d, self.meta, acc, len(idx), self.pos_d, stream=self.stream,
                                     first=first, with_pos=n_pair == 0)
                else:
                    for n_pair, (kp, vp) in enumerate(self._pairs()):
                        compact_ref(kp, vp, self.table, self.n_past, idx, self.pos if n_pair == 0 else None)
            self.n_past += len(idx)
        self.n_pending = 0
        self._unmap_from(self.n_past)
        self._sync_meta()

    def _accepted_d(self, idx: np.ndarray):
        """idx on the device, in a buffer kept across commits (a fresh device array each
        commit was an allocation on the host's path between verification and the draft)."""
        buf = self._acc
        if buf is None or buf[1].shape[0] < len(idx):
            n = max(64, 1 << (len(idx) - 1).bit_length())
            buf = self._acc = (self._cuda.device_array(n, np.int32), np.zeros(n, np.int32))
        dev, host = buf
        host[:len(idx)] = idx
        from ..backends.cuda_copy import h2d
        h2d(dev, host, self.stream)  # staged before it returns: host may change after
        return dev

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
                copies = []
                for pool in self._pools():
                    h = cuda.pinned_array(pool.shape[1:], pool.dtype)
                    pool[s].copy_to_host(h, stream=self.side)
                    copies.append(h)
                self._dirty_slots.append(s)
            else:
                copies = [pool[s].copy() for pool in self._pools()]
                self.free.append(s)
            self.host[b] = copies
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
            # a free slot may still be read by queued compute work (rows a commit just
            # dropped): the copies into it start after that work
            ev = self._cuda.event()
            ev.record(self.stream)
            ev.wait(self.side)
        for b in blocks:
            copies = self.host.pop(b)
            s = self._alloc()
            for pool, h in zip(self._pools(), copies):
                if self.device:
                    pool[s].copy_to_device(h, stream=self.side)
                else:
                    pool[s] = h
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
