"""Attention kernel benchmark rows for `luce bench kernels`: decode vs tree verification
(23 nodes) over an 8K paged context at Qwen3-8B shapes (32 q heads, 8 kv heads, head_dim
128), timed with CUDA events.

Eager numba launches cost 20-80 us of host time each (shared/gpu/NOTES.md), more than a
decode attention kernel, so each timing replays the launches from a captured CUDA graph
when cuda.bindings allows it ("mode": "graph") and falls back to back-to-back eager
launches ("mode": "eager", an upper bound) otherwise.
"""
from __future__ import annotations

import math

import numpy as np

QWEN3_8B = dict(n_heads=32, n_kv_heads=8, head_dim=128)
QWEN3_32B = dict(n_heads=64, n_kv_heads=8, head_dim=128)


def _ptr(handle) -> int:
    if hasattr(handle, "value"):  # ctypes handle
        return handle.value or 0
    return int(handle)


def _time_graph(launch, stream, reps: int) -> float:
    """Mean us per launch() replayed from one captured graph of `reps` launches."""
    from cuda.bindings import driver as drv
    from numba import cuda
    h = drv.CUstream(_ptr(stream.handle))

    def check(res):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    check(drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    try:
        for _ in range(reps):
            launch()
    finally:
        graph = check(drv.cuStreamEndCapture(h))
    gexec = check(drv.cuGraphInstantiate(graph, 0))
    check(drv.cuGraphLaunch(gexec, h))  # warm
    stream.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    check(drv.cuGraphLaunch(gexec, h))
    end.record(stream)
    end.synchronize()
    ms = start.elapsed_time(end)
    drv.cuGraphExecDestroy(gexec)
    drv.cuGraphDestroy(graph)
    return ms * 1e3 / reps


def time_launch(launch, stream, reps: int) -> tuple[float, str]:
    """(us per launch, "graph" | "eager"): graph replay where cuda.bindings allows it,
    back-to-back eager launches (an upper bound) otherwise. Compiles first."""
    launch()
    stream.synchronize()
    try:
        return _time_graph(launch, stream, reps), "graph"
    except Exception:  # no cuda.bindings driver API, or capture refused
        return _time_eager(launch, stream, reps), "eager"


def _time_eager(launch, stream, reps: int) -> float:
    from numba import cuda
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(reps):
        launch()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


CHUNKS = (8, 16, 32)  # keys a warp's step of the decode kernel, timed against each other
PER_TRIP = (2, 4, 8)  # splits a trip of the decode kernel's merge, timed against each other
TARGET_WARPS = (1024, 2048)  # the decode grid's warps, against attention.DECODE_TARGET_WARPS
DECODE_MMA_BLOCKS = (264, 528, 792, 1056)  # blocks of decode on the tensor-core kernel (LUCE_DECODE_ATTN=mma)
TREE_TILE_WARPS = (2, 3, 4)  # warps a query tile of the tensor-core kernel, against its plan
SHORT = 640  # keys of the short-context decode row (the 8B bench's decode step sees ~640)


def selected(name: str, only: str) -> bool:
    """Whether row `name` is one of `only`'s comma-separated prefixes; a pattern ending in
    "$" names one row exactly (each variant compiles its own kernels: on the GPU machine a
    prefix such as "decode" takes every decode variant, ~1 min)."""
    pats = [p.strip() for p in only.split(",") if p.strip()]
    return any(name == p[:-1] if p.endswith("$") else name.startswith(p) for p in pats)


def against_decode(rows: list[dict]) -> list[dict]:
    """Adds "x decode" to each row: its time over the decode row's at the same context
    (attention_decode, or attention_decode{SHORT}_in_grid for the _in_grid rows; the
    kernels issue's tree target is <= 2x); None for combine-only rows and where that decode
    row was not run."""
    base = {grid: next((r["time_us"] for r in rows if r["name"] == name), None)
            for grid, name in ((False, "attention_decode"), (True, f"attention_decode{SHORT}_in_grid"))}
    for r in rows:
        b = base["_in_grid" in r["name"]]
        r["x decode"] = round(r["time_us"] / b, 2) if b and not r["name"].endswith("_combine_only") else None
    return rows


def bench_attention(context: int = 8192, tree_nodes: int = 23, reps: int = 50, shape: dict | None = None,
                    prefill: int = 512, seed: int = 0, only: str | None = None) -> list[dict]:
    """Rows {name, shape, time_us, GB/s, mode, n_splits, x decode}: decode (1 query), decode without
    sequence splits, decode and the tree over SHORT keys in a grid sized for the context
    (as a captured graph runs early in a conversation), the split combine of those rows
    alone, tree verification (tree_nodes queries, a random tree; with two waves of blocks
    and with 8 splits too), a causal prefill chain of `prefill` tokens, decode / tree over
    q8_0 KV, and the tree through the one-query kernel's structure (not yet the default),
    over `context` committed rows unless SHORT; GB/s counts the K/V bytes the kernel must
    read (K and V of every visible row, once: f16, or q8_0 for the *_q8_0 rows). only: the
    rows that `selected` picks ("tree23$,decode$": those two rows)."""
    from numba import cuda

    from ..kernels import attention as A
    from ..kernels import attention_mma as M
    from ..kernels.attention import attention_plan, paged_attention_cuda, tree_mask, tree_mask_bits
    from ..kernels.paging import BLOCK

    sh = dict(QWEN3_8B if shape is None else shape)
    hq, hkv, d = sh["n_heads"], sh["n_kv_heads"], sh["head_dim"]
    rng = np.random.default_rng(seed)
    max_new = max(prefill, tree_nodes)
    n_blocks = math.ceil((context + max_new) / BLOCK)
    stream = cuda.stream()
    pool_shape = (n_blocks, 1, hkv, BLOCK, d)
    k_pool = cuda.to_device(rng.standard_normal(pool_shape).astype(np.float16), stream=stream)
    v_pool = cuda.to_device(rng.standard_normal(pool_shape).astype(np.float16), stream=stream)
    # q8_0 pools: int8 values and an f16 scale per 32
    k_q8 = cuda.to_device(rng.integers(-127, 128, pool_shape).astype(np.int8), stream=stream)
    v_q8 = cuda.to_device(rng.integers(-127, 128, pool_shape).astype(np.int8), stream=stream)
    scale_shape = pool_shape[:-1] + (d // 32,)
    k_sc = cuda.to_device(rng.uniform(0.001, 0.02, scale_shape).astype(np.float16), stream=stream)
    v_sc = cuda.to_device(rng.uniform(0.001, 0.02, scale_shape).astype(np.float16), stream=stream)
    table = cuda.to_device(rng.permutation(n_blocks).astype(np.int32), stream=stream)  # scattered slots
    kv_pos = cuda.to_device(np.arange(context + max_new, dtype=np.int32), stream=stream)

    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, tree_nodes)])
    tree = tree_mask(parents)
    one = np.ones((1, 1), bool)
    # (name, queries, mask, max_splits, q8, variant): "rowkernel" takes a tree through the
    # one-query kernel's structure (not the default: attention.py), "two_waves" plans the
    # tensor-core kernel's splits for two waves of blocks, "chunkN" gives the decode kernel
    # N keys a warp's step, "tripN" N splits a trip of its merge, "warpsN" N warps its grid,
    # "shortplan" the kernel and plan of a short context; names with _in_grid attend over
    # SHORT keys
    cases = [("decode", 1, one, None, False, None),
             ("decode_shortplan", 1, one, None, False, "shortplan"),
             ("decode_nosplit", 1, one, 1, False, None),
             (f"decode{SHORT}_in_grid", 1, one, None, False, None)]
    # the decode kernel's keys a step against this shape's default (attention.decode_chunk)
    cases += [(f"decode{s}_chunk{c}", 1, one, None, False, f"chunk{c}") for c in CHUNKS
              if c != A.decode_chunk(d, hq // hkv)
              for s in ("", f"{SHORT}_in_grid")]
    default_trip = A.decode_per_trip(d, hq // hkv)
    cases += [(f"decode{s}_trip{t}", 1, one, None, False, f"trip{t}") for t in PER_TRIP if t != default_trip
              for s in ("", f"{SHORT}_in_grid")]
    cases += [(f"decode{s}_warps{w}", 1, one, None, False, f"warps{w}") for w in TARGET_WARPS
              if w != A.DECODE_TARGET_WARPS for s in ("", f"{SHORT}_in_grid")]
    cases += [(f"decode{s}_mma{b}", 1, one, None, False, f"mma{b}") for b in DECODE_MMA_BLOCKS
              for s in ("", f"{SHORT}_in_grid")]
    cases += [
             (f"tree{tree_nodes}", tree_nodes, tree, None, False, None),
             (f"tree{tree_nodes}_{SHORT}_in_grid", tree_nodes, tree, None, False, None),
             # against the default splits (one wave of one-block-an-SM blocks): two waves, and fewer
             (f"tree{tree_nodes}_two_waves", tree_nodes, tree, None, False, "two_waves"),
             (f"tree{tree_nodes}_{SHORT}_in_grid_two_waves", tree_nodes, tree, None, False, "two_waves"),
             (f"tree{tree_nodes}_splits8", tree_nodes, tree, 8, False, None)]
    # Q's fragments in registers (attention_mma.Q_SHARED off), and with Q in shared memory
    # splits for one wave of blocks (attention_mma.TREE_WAVES 1) instead of two
    cases += [(f"tree{tree_nodes}{s}_{v}", tree_nodes, tree, None, False, v)
              for v in ("qreg", "waves1") for s in ("", f"_{SHORT}_in_grid")]
    # the tree's query rows in tiles of N warps (N x 16 rows; attention_mma.TILE_WARPS): more
    # blocks, each a shorter chain of mma over a page, the K/V pages read once a tile
    cases += [(f"tree{tree_nodes}{s}_tilewarps{w}", tree_nodes, tree, None, False, f"tilewarps{w}")
              for w in TREE_TILE_WARPS for s in ("", f"_{SHORT}_in_grid")]
    cases += [
             (f"prefill{prefill}", prefill, None, None, False, None),
             ("decode_q8_0", 1, one, None, True, None),
             (f"tree{tree_nodes}_q8_0", tree_nodes, tree, None, True, None),
             (f"tree{tree_nodes}_rowkernel", tree_nodes, tree, None, False, "rowkernel")]
    cases = [c for c in cases if only is None or selected(c[0], only)]
    rows = []
    default_rows, default_target = A.ROW_KERNEL_MAX_QUERIES, M.TARGET_BLOCKS
    default_tile = M.MAX_WARPS, M.TILE_WARPS
    default_chunks, default_warps = (A.DECODE_CHUNK, A.DECODE_CHUNK_WIDE), A.DECODE_TARGET_WARPS
    default_mma = M.DECODE, M.DECODE_TARGET_BLOCKS
    default_qsh = M.Q_SHARED, M.TREE_WAVES

    def number(prefix):  # of a variant named prefix + N, or None
        return int(variant[len(prefix):]) if variant and variant.startswith(prefix) else None
    try:
        for name, n, mask, max_splits, q8, variant in cases:
            A.ROW_KERNEL_MAX_QUERIES = 64 if variant == "rowkernel" else default_rows
            M.TARGET_BLOCKS = 2 * default_target if variant == "two_waves" else default_target
            # chunkN: N keys a step whatever the block's rows
            A.DECODE_CHUNK, A.DECODE_CHUNK_WIDE = (number("chunk"),) * 2 if number("chunk") else default_chunks
            A.DECODE_MERGE_PER_TRIP = number("trip")
            A.DECODE_TARGET_WARPS = number("warps") or default_warps
            M.MAX_WARPS, M.TILE_WARPS = (number("tilewarps"),) * 2 if number("tilewarps") else default_tile
            M.DECODE, M.DECODE_TARGET_BLOCKS = ("mma", number("mma")) if number("mma") else default_mma
            M.Q_SHARED = default_qsh[0] and variant != "qreg"
            M.TREE_WAVES = number("waves") or default_qsh[1]
            kp, vp, ks, vs = (k_q8, v_q8, k_sc, v_sc) if q8 else (k_pool, v_pool, None, None)
            q = cuda.to_device(rng.standard_normal((n, hq, d)).astype(np.float32), stream=stream)
            # decode over SHORT keys in a grid planned for the whole context, as a captured
            # decode graph runs early in a long conversation
            now = min(SHORT, context) if "_in_grid" in name else context
            q_pos = cuda.to_device(np.arange(now, now + n, dtype=np.int32), stream=stream)
            meta = cuda.to_device(np.array([now, n, 0, 0], np.int32), stream=stream)
            bits = None if mask is None else cuda.to_device(tree_mask_bits(mask), stream=stream)
            out = cuda.device_array((n, hq, d), np.float32, stream=stream)
            # the kernel and plan a backend takes at this context (attention_plan's long); the
            # one-query kernel's variants and "shortplan" as over a short one
            long = now >= M.DECODE_LONG_KEYS and not (variant or "").startswith(("chunk", "trip", "warps", "shortplan"))
            plan = attention_plan(n, hq, hkv, d, context + n, max_splits, q8=q8, long=long)
            ns = plan["n_splits"]
            scratch = (cuda.device_array((ns, n, hq, d), np.float32, stream=stream),
                       cuda.device_array((ns, n, hq, 2), np.float32, stream=stream))

            def launch():
                paged_attention_cuda(q, kp, vp, table, 0, meta, kv_pos, q_pos, bits, n_keys=context + n, out=out,
                                     scratch=scratch, max_splits=max_splits, k_scale=ks, v_scale=vs, long=long,
                                     stream=stream)

            us, mode = time_launch(launch, stream, reps)
            kv_bytes = (now + n) * hkv * (d + d // 16 if q8 else 2 * d) * 2
            rows.append(dict(name=f"attention_{name}", shape=f"q{n}x{hq}x{d} kv{now}+{n}x{hkv}",
                             time_us=round(us, 2), **{"GB/s": round(kv_bytes / (us * 1e-6) / 1e9, 1)}, mode=mode,
                             n_splits=ns))
            if (name.startswith("decode") or "_in_grid" in name) and ns > 1 and not q8 and plan.get("kind") != "row":
                # the split combine alone, on the partials the launch above left (the row
                # kernel merges its own)
                def combine():
                    A.combine_splits(scratch[0], scratch[1], ns, meta, out, stream)
                us, mode = time_launch(combine, stream, reps)
                rows.append(dict(name=f"attention_{name}_combine_only", shape=f"{ns} splits x{n}x{hq}x{d}",
                                 time_us=round(us, 2), **{"GB/s": None}, mode=mode, n_splits=ns))
    finally:  # the module-wide defaults, whatever happened
        A.ROW_KERNEL_MAX_QUERIES, M.TARGET_BLOCKS = default_rows, default_target
        A.DECODE_CHUNK, A.DECODE_CHUNK_WIDE = default_chunks
        A.DECODE_MERGE_PER_TRIP, A.DECODE_TARGET_WARPS = None, default_warps
        M.MAX_WARPS, M.TILE_WARPS = default_tile
        M.DECODE, M.DECODE_TARGET_BLOCKS = default_mma
        M.Q_SHARED, M.TREE_WAVES = default_qsh
    return against_decode(rows)


if __name__ == "__main__":
    import sys
    args = sys.argv[1:]  # [32b] [name prefixes, comma-separated]
    shape = QWEN3_32B if args and args[0] == "32b" else None
    only = next((a for a in args if a != "32b"), None)
    for row in bench_attention(shape=shape, only=only):
        print(row)
