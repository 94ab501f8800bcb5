"""Where a CUDA forward's time goes: every op of one forward, timed on its own.

One eager forward runs with its ops recorded (name, weight type and shape, and a closure
that repeats the call); each closure is then captured `reps` times into a CUDA graph and
replayed between cuda events, so a row is GPU time without launch cost, as in the decode
graph. Rows are grouped by op and weight (the 36 layers' q projections are one row).
The whole forward's graph is timed the same way: the difference to the sum of the rows is
the gaps between kernels; the difference to the measured decode step is host work (input
copies, the logits copy, argmax).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

# ops that only reshape or slice: no kernel to time
_VIEWS = {"split_heads", "merge_heads", "take_rows", "new_layer"}


class _Recorder:
    """Stands in for the backend's op object: runs each op and keeps a closure of it."""

    def __init__(self, ops, calls):
        self._ops, self._calls = ops, calls

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn) or name in _VIEWS or name.startswith("_"):
            return fn

        state = getattr(self._ops, "layer_state", None)

        def call(*args, **kwargs):
            # replayed alone, the op runs in the layer state it was recorded in (the fused
            # K/V write checks its layer)
            pre = state() if state else None

            def again():
                if state:
                    self._ops.set_layer_state(pre)
                return fn(*args, **kwargs)
            self._calls.append((_label(name, args), again))
            return fn(*args, **kwargs)
        return call


def _label(name, args) -> str:
    def is_w(a):
        return hasattr(a, "qtype") and hasattr(a, "shape") and hasattr(a, "raw")

    def desc(w):
        return f"{getattr(w.qtype, 'name', w.qtype)} {w.shape[0]}x{w.shape[1]}"
    groups = [a for a in args if isinstance(a, (tuple, list)) and a and all(is_w(w) for w in a)]
    if groups:  # linears: every projection it runs
        return f"{name} " + " + ".join(desc(w) for w in groups[0])
    ws = [a for a in args if is_w(a)]
    if not ws:
        return name
    return f"{name} {desc(ws[0])}" + (f" (+{len(ws) - 1})" if len(ws) > 1 else "")


def _time_graph(be, fn, reps: int, arena) -> float:
    """Microseconds per call of fn, from a graph of `reps` calls (arena allocations of
    each call reuse the same memory)."""
    import time

    from numba import cuda

    from ..backends.cuda_graph import Graph
    off, persist = arena.off, arena.persist

    def body():
        for _ in range(reps):
            arena.off, arena.persist = off, persist
            fn()
    t0 = time.perf_counter()
    body()  # eager once: compiles, and a failing op fails here, not in capture
    be.stream.synchronize()
    if not be.use_graphs:  # the simulator: no graphs, host time of eager calls
        arena.off, arena.persist = off, persist
        return (time.perf_counter() - t0) * 1e6 / reps
    g = Graph(be.stream, body)
    g.replay()
    start, end = cuda.event(), cuda.event()
    start.record(be.stream)
    g.replay()
    end.record(be.stream)
    end.synchronize()
    arena.off, arena.persist = off, persist
    return start.elapsed_time(end) * 1e3 / reps


def profile_forward(be, fam, cfg, weights, kv, n_tokens: int = 1, reps: int = 20, mask=None) -> dict:
    """Per-op GPU times of one forward over n_tokens new tokens (decode: 1) at the cache's
    current length. mask: an ancestor mask (n_tokens x n_tokens, luce.kernels.attention.
    tree_mask) to profile a tree verification as it runs (its attention reads the mask's
    bits; the positions are the context's length plus each node's depth); None: causal.
    Returns {"rows": [...], "sum_us", "graph_us"}; the cache is left as it was (nothing
    committed)."""
    n_past = kv.n_past
    tokens = np.zeros(n_tokens, np.int64)
    if mask is None:
        positions = np.arange(n_past, n_past + n_tokens)
    else:
        mask = np.asarray(mask, bool)
        if mask.shape != (n_tokens, n_tokens):
            raise ValueError(f"profile_forward: a mask of {n_tokens} x {n_tokens} nodes, got {mask.shape}")
        positions = n_past + mask.sum(1) - 1
    # the arena and inputs for this width (and the mask's bits, for a tree)
    be.forward(fam, cfg, weights, kv, tokens, positions, mask)
    st = be._model_state(fam, cfg, weights, kv)
    ops = st["ops"]
    tok_d, pos_d, mask_d = st["inputs"]["views"][n_tokens]  # the input buffers that forward just filled
    from ..backends.cuda import _is_causal
    mask_d = None if mask is None or _is_causal(mask) else mask_d
    rows_out = [n_tokens - 1]

    calls: list = []
    ops.begin_forward(mask_d)
    fam.run_forward(cfg, weights, _Recorder(st["run_ops"], calls), kv, tok_d, pos_d, None, rows_out)
    be.stream.synchronize()

    per = defaultdict(lambda: {"calls": 0, "us": 0.0})
    for label, fn in calls:
        us = _time_graph(be, fn, reps, ops.arena)
        per[label]["calls"] += 1
        per[label]["us"] += us

    def whole():
        ops.begin_forward(mask_d)
        fam.run_forward(cfg, weights, st["run_ops"], kv, tok_d, pos_d, None, rows_out)
    graph_us = _time_graph(be, whole, max(2, reps // 4), ops.arena)
    kv.commit([])  # drop the rows the timing runs wrote

    total = sum(v["us"] for v in per.values())
    rows = sorted(({"op": k, "calls": v["calls"], "us per forward": v["us"], "us per call": v["us"] / v["calls"],
                    "% of ops": 100 * v["us"] / total} for k, v in per.items()), key=lambda r: -r["us per forward"])
    return {"rows": rows, "sum_us": total, "graph_us": graph_us}


def host_profile(step, n_steps: int = 16, top: int = 12) -> list[dict]:
    """The host functions that take the time of `step()` (a decode step, or an eager
    prefill), by own time per call of step: what Python does around the GPU's work."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n_steps):
        step()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{fn} ({file.rsplit('/', 2)[-1] if '/' in file else file}:{line})",
                     "calls per step": nc / n_steps, "own us per step": tt / n_steps * 1e6,
                     "cum us per step": ct / n_steps * 1e6})
    rows.sort(key=lambda r: -r["own us per step"])
    return rows[:top]
