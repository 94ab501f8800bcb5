"""`luce bench`: prefill, decode, long-context decode, time to first token, memory, and
decode as a fraction of the bandwidth limit; tree-verification cost by width."""
from __future__ import annotations

import time

import numpy as np

from ..engine.generator import prefill_pieces
from ..kernels.attention import tree_mask


def _load(model_arg, synthetic, backend_name, n_ctx):
    from ..backends import get_backend
    from ..models.transformer import build_weights
    from ..plugins import families
    be = get_backend(backend_name) if isinstance(backend_name, str) else backend_name
    if synthetic:
        from .synthetic import SyntheticFile, synthetic_loader
        f = SyntheticFile(synthetic)
        cfg = f.config()
        fam = families()[cfg.arch]
        t0 = time.perf_counter()
        if hasattr(be, "plan_weights"):
            be.plan_weights(f.tensors, cfg.tied_output)
        weights = build_weights(cfg, f, synthetic_loader(be))
        return be, fam, cfg, weights, f.weight_bytes_per_token, f"synthetic {f.name}", time.perf_counter() - t0
    from ..model import load
    m = load(model_arg, backend=be, n_ctx=n_ctx)
    emb = m.file.tensors["token_embd.weight"].n_bytes
    wbytes = sum(t.n_bytes for t in m.file.tensors.values()) - (0 if m.config.tied_output else emb)
    return be, m.family, m.config, m.weights, wbytes, m.path.name, m.load_s


def _say(t0: float, what: str) -> None:
    """A progress line on stderr as each phase ends: a run cut short (a time limit on a
    lent GPU) still shows what it measured and where the time went."""
    import sys
    print(f"[luce bench {time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def _sync(be):
    if be.name == "cuda":
        be.stream.synchronize()


def run(model=None, synthetic=None, backend="auto", n_prompt=512, n_gen=128, long_ctx=8192, n_long=32,
        verify_widths=(1, 2, 4, 8, 16, 23, 32, 64), record=True, per_op=True):
    n_ctx = max(long_ctx, n_prompt) + n_gen + 128
    t_start = time.perf_counter()
    be, fam, cfg, w, wbytes, label, load_s = _load(model, synthetic, backend, n_ctx)
    _say(t_start, f"loaded {label} on {be.name} in {load_s:.2f} s")
    kv = be.new_cache(cfg, n_ctx)
    rng = np.random.default_rng(0)
    vocab = cfg.vocab_size
    prompt = rng.integers(0, vocab, n_prompt)

    def forward(tokens, positions, mask=None, rows=None):
        return be.forward(fam, cfg, w, kv, tokens, positions, mask, rows)

    def prefill(tokens, start=0):  # as the engine does it (Session.prefill)
        logits = None
        s = 0
        for size in prefill_pieces(len(tokens), pow2=getattr(be, "graph_prefill", False)):
            c = tokens[s:s + size]
            logits = forward(c, np.arange(start + s, start + s + len(c)), rows=[len(c) - 1])
            kv.commit()
            s += size
        return logits

    def decode(n, first, pick=lambda row: int(np.argmax(row))):
        tok, pos = first, kv.n_past
        for i in range(n):
            logits = forward([tok], [pos + i])
            kv.commit()
            tok = pick(logits[-1])
        return tok

    # warm-up: compile kernels, capture the decode graph. The full prompt, so that the
    # workspace reaches its size now: growing it later drops the captured graphs, and the
    # timed decode would pay an eager step and a re-capture (2026-11-30 H200 runs: ~3 ms a
    # token of the 128, on top of the graph's time).
    t0 = time.perf_counter()
    prefill(prompt)
    decode(4, 1)
    kv.truncate(0)
    warmup_s = time.perf_counter() - t0
    _say(t_start, "warm-up done (kernels compiled; on CUDA, the decode graph captured)")

    best_prefill = float("inf")
    for _ in range(3 if be.name == "cuda" else 1):
        kv.truncate(0)
        t0 = time.perf_counter()
        logits = prefill(prompt)
        first = int(np.argmax(logits[-1]))
        best_prefill = min(best_prefill, time.perf_counter() - t0)
    ttft = best_prefill
    _say(t_start, f"prefill {n_prompt / best_prefill:,.0f} tok/s")

    def eager_prefill():  # a prompt's first sight: no graphs, every launch is a Python call
        kv.truncate(0)
        be.use_graphs = False
        try:
            prefill(prompt)
        finally:
            be.use_graphs = True

    eager_prefill_s = None
    if getattr(be, "use_graphs", False):
        t0 = time.perf_counter()
        eager_prefill()
        eager_prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    decode(n_gen, first)
    decode_s = time.perf_counter() - t0
    _say(t_start, f"decode {n_gen / decode_s:,.1f} tok/s")
    pipelined_s = _decode_pipelined(be, fam, cfg, w, kv, first, n_gen) if be.name == "cuda" else None
    if pipelined_s:
        _say(t_start, f"decode, next token on device: {n_gen / pipelined_s:,.1f} tok/s")
    host_sampled_s = _decode_sampled(decode, kv, first, n_gen)
    _say(t_start, f"decode, sampled on the host: {n_gen / host_sampled_s:,.1f} tok/s")
    sampled_s = host_sampled_s  # what generate runs: the device draw where the backend has one
    if be.name == "cuda" and getattr(be, "device_sampling", False):
        from ..engine.sampling import Sampler, SamplingParams
        sampled_s = _decode_pipelined(be, fam, cfg, w, kv, first, n_gen, Sampler(SamplingParams(seed=0)))
        _say(t_start, f"decode, sampled on the device: {n_gen / sampled_s:,.1f} tok/s")
    breakdown = host = prefill_host = verify_ops = prefill_ops = None
    if be.name == "cuda" and per_op:
        from .profile import host_profile
        state = {"tok": first}

        def step():
            state["tok"] = decode(1, state["tok"])
        host = host_profile(step)
        breakdown = _by_op(be, fam, cfg, w, kv, 1, 20) + [
            {"op": "decode step measured (with host work)", "us per forward": decode_s / n_gen * 1e6}]
        prefill_host = host_profile(eager_prefill, n_steps=2, top=15)
        _say(t_start, "decode breakdown done")

    def verify_costs(where):
        """Tree verification over what the cache holds now: per width N two chains of N nodes
        from the context, rolled back each time; ms and x one node."""
        rows = []
        for n in verify_widths:
            if n > 64:
                continue
            mask = two_chains(n)
            depth = mask.sum(1) - 1
            toks = rng.integers(0, vocab, n)
            pos = kv.n_past + depth
            for _ in range(2):  # first sight runs eagerly, the second records the width's graph
                forward(toks, pos, mask)
                kv.commit([])
            reps = 20 if be.name == "cuda" else 2
            t0 = time.perf_counter()
            for _ in range(reps):
                forward(toks, pos, mask)
                kv.commit([])
            full_ms = (time.perf_counter() - t0) / reps * 1e3
            greedy = getattr(be, "forward_greedy", None)  # what greedy speculative decoding runs
            ms = None
            if greedy is not None:
                for i in range(reps + 2):  # two to record its graph
                    if i == 2:
                        t0 = time.perf_counter()
                    greedy(fam, cfg, w, kv, toks, pos, mask)
                    kv.commit([])
                ms = (time.perf_counter() - t0) / reps * 1e3
            rows.append({"nodes": n, "ms": ms if ms is not None else full_ms, "ms, all logits to host": full_ms})
            _say(t_start, f"verify {n} nodes{where}: {rows[-1]['ms']:.3f} ms ({rows[-1]['ms'] / rows[0]['ms']:.2f}x)")
        for r in rows:
            r["x decode step"] = r["ms"] / rows[0]["ms"]
        return rows

    long_tok_s = None
    verify_long = []
    if long_ctx and n_ctx >= long_ctx + n_long:
        kv.truncate(0)
        prefill(rng.integers(0, vocab, long_ctx))
        decode(2, 1)
        t0 = time.perf_counter()
        decode(n_long, 1)
        long_tok_s = n_long / (time.perf_counter() - t0)
        _say(t_start, f"decode @{long_ctx}: {long_tok_s:,.1f} tok/s ({long_tok_s * decode_s / n_gen:.1%} of short)")
        # the verify widths over the long context (attention's plan for it: attention_plan's long)
        verify_long = verify_costs(f" @{long_ctx}")

    kv.truncate(0)
    prefill(prompt)
    verify = verify_costs("")
    if be.name == "cuda" and per_op:
        if 23 in verify_widths:
            verify_ops = _by_op(be, fam, cfg, w, kv, 23, 20, mask=two_chains(23))
        kv.truncate(0)
        prefill_ops = _by_op(be, fam, cfg, w, kv, n_prompt, 4)

    bw = mem = None
    if be.name == "cuda":
        from numba import cuda
        from .ceilings import copy_bandwidth_gbs
        bw = copy_bandwidth_gbs()
        free, total = cuda.current_context().get_memory_info()
        mem = (total - free) / 2**30
    decode_tok_s = n_gen / decode_s
    limit = bw * 1e9 / wbytes if bw else None
    summary = [{
        "model": label, "backend": be.name, "load s": load_s,
        # the first prefill and decode steps: kernels compiled (or read from numba's cache) and
        # graphs captured; luce.load's own warm-up, in its load time, does this for a model file
        "first prefill + 4 decode steps s": warmup_s,
        "kernels from the disk cache / compiled": "{} / {}".format(*_kernel_counts()) if be.name == "cuda" else None,
        "prefill tok/s": n_prompt / best_prefill,
        "prefill tok/s eager": n_prompt / eager_prefill_s if eager_prefill_s else None,
        "decode tok/s": decode_tok_s,
        "decode tok/s, next token on device": n_gen / pipelined_s if pipelined_s else None,
        "decode tok/s, sampled (default sampling)": n_gen / sampled_s,
        "decode tok/s, sampled on the host": n_gen / host_sampled_s if sampled_s != host_sampled_s else None,
        f"decode tok/s @{long_ctx}": long_tok_s,
        "long/short": (long_tok_s / decode_tok_s) if long_tok_s else None,
        "TTFT ms": ttft * 1e3, "GPU mem GiB": mem, "copy GB/s": bw,
        "limit tok/s": limit, "% of limit": 100 * decode_tok_s / limit if limit else None,
    }]
    from ..kernels import pdl
    if pdl.ENABLED:  # LUCE_PDL: how many of the captured graphs' edges became programmatic
        from ..backends import cuda_graph
        summary[0]["programmatic edges (LUCE_PDL)"] = f"{cuda_graph.STATS['programmatic']} in " \
                                                      f"{cuda_graph.STATS['graphs']} graphs"
    from .report import append_to_docs, print_table
    table = [{"metric": k, "value": v} for k, v in summary[0].items()]
    print_table(f"luce bench: {label}", table)
    print_table(f"tree verification cost ({n_prompt} tokens in context)", verify)
    if verify_long:
        print_table(f"tree verification cost ({long_ctx} tokens in context)", verify_long)
    cols = ["op", "calls", "us per forward", "us per call", "% of ops"]
    host_cols = ["function", "calls per step", "own us per step", "cum us per step"]
    if breakdown:
        print_table(f"decode step by op ({n_prompt + n_gen} tokens in context)", breakdown, cols)
        print_table("host time of a decode step (cProfile, top functions by own time)", host, host_cols)
    if verify_ops:
        print_table(f"23-node verification forward by op (a tree of two chains, {n_prompt} tokens in context)", verify_ops, cols)
    if prefill_ops:
        print_table(f"{n_prompt}-token prefill forward by op", prefill_ops, cols)
    if prefill_host:
        print_table(f"host time of an eager {n_prompt}-token prefill (cProfile)", prefill_host, host_cols)
    if record:
        append_to_docs(f"luce bench {label} [{be.name}]",
                       [("end to end", table, ["metric", "value"]),
                        ("verification width (ms: argmaxes on the device, as greedy speculative decoding runs it)", verify,
                         ["nodes", "ms", "x decode step", "ms, all logits to host"])]
                       + ([(f"verification width at {long_ctx} tokens of context", verify_long,
                            ["nodes", "ms", "x decode step", "ms, all logits to host"])] if verify_long else [])
                       + ([("decode step by op (GPU time of each op, graph-replayed)", breakdown, cols),
                           ("host time of a decode step (cProfile; own time includes waits on the GPU)", host,
                            host_cols)] if breakdown else [])
                       + ([("23-node verification forward by op (a tree of two chains)", verify_ops, cols)] if verify_ops else [])
                       + ([(f"{n_prompt}-token prefill forward by op", prefill_ops, cols)] if prefill_ops else [])
                       + ([(f"host time of an eager {n_prompt}-token prefill (cProfile; profiler overhead "
                            "included)", prefill_host, host_cols)] if prefill_host else []),
                       notes=f"prefill {n_prompt} tokens, decode {n_gen} tokens greedy; weights read per token "
                             f"{wbytes / 2**30:.2f} GiB" + _routing_note())
    return summary, verify, breakdown


def _decode_pipelined(be, fam, cfg, w, kv, first: int, n: int, sampler=None, topk: int = 0,
                      in_flight: int = 2) -> float:
    """Seconds for n decode steps as DeviceStepper runs them (the argmax, or with a sampler
    its draw, in the graph; the next step queued before the host reads a token), from where
    the cache is; the cache is put back afterwards. topk > 0: a device draft's steps
    instead (forward_topk: the candidates' top-k too), up to `in_flight` of them queued
    before the oldest is read, as its loop reads them."""
    from collections import deque
    n0 = kv.n_past
    q = deque()

    def queue(tok):
        if topk:
            q.append(be.forward_topk(fam, cfg, w, kv, tok, kv.n_past, topk))
        else:
            sample = None if sampler is None else sampler.device_params()
            q.append(be.forward_next_token(fam, cfg, w, kv, tok, kv.n_past, sample=sample))
        kv.commit()
    try:
        for _pass in range(2):  # the first compiles and records the graph; the second is timed
            kv.truncate(n0)
            t0 = time.perf_counter()
            queue(first)
            for _ in range(n - 1):
                if len(q) >= in_flight:
                    q.popleft().result()
                queue(None)
            while q:
                q.popleft().result()
            dt = time.perf_counter() - t0
    finally:
        kv.truncate(n0)
    return dt


def _decode_sampled(decode, kv, first: int, n: int) -> float:
    """Seconds for n decode steps sampled on the host with the default sampling parameters
    (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05: what a chat client without its
    own settings gets), as PlainStepper runs them: the logits row to the host, then the
    sampler; the cache is put back afterwards."""
    from ..engine.sampling import Sampler, SamplingParams
    sampler = Sampler(SamplingParams(seed=0))  # no penalties: the history is not read
    n0 = kv.n_past
    try:
        t0 = time.perf_counter()
        decode(n, first, pick=lambda row: sampler.sample(row, []))
        return time.perf_counter() - t0
    finally:
        kv.truncate(n0)


def _kernel_counts() -> tuple[int, int]:
    from ..kernels.disk_cache import counts
    return counts()


def _routing_note() -> str:
    """Kernel routing set through the environment changes what a run measures: say so in the record."""
    import os
    keys = ("LUCE_MATVEC_MMA_ROWS", "LUCE_ASYNC_HOST", "LUCE_MATVEC_X8", "LUCE_PAIR_PROJECTIONS", "LUCE_FUSED_NORM")
    return "".join(f"; {k}={os.environ[k]}" for k in keys if os.environ.get(k))


def two_chains(n: int) -> np.ndarray:
    """The ancestor mask of the tree the bench verifies: two chains from the context, nodes
    0..h-1 and h..n-1 (h = ceil(n / 2))."""
    h = (n + 1) // 2
    return tree_mask(np.array([i - 1 if i < h else i - h - 1 for i in range(n)]))


def _by_op(be, fam, cfg, w, kv, n_tokens: int, reps: int, mask=None) -> list[dict]:
    """profile_forward's rows for a forward of n_tokens (a tree with mask), then its sum and
    whole-graph time."""
    from .profile import profile_forward
    p = profile_forward(be, fam, cfg, w, kv, n_tokens=n_tokens, reps=reps, mask=mask)
    return p["rows"] + [{"op": "sum of ops", "us per forward": p["sum_us"]},
                        {"op": "graph (whole forward)", "us per forward": p["graph_us"]}]
