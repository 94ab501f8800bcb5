"""The persistent decode kernel (luce.kernels.persistent_decode) against the CUDA backend's
launch chain on a synthetic model's one-token step, on the GPU:

    python -m luce.bench.persistent_decode [SHAPE] [--prompt N] [--float-x] [--variants | --variants-only] [--no-record]

SHAPE defaults to qwen3-0.6b (a draft's shape). After an N-token prompt (512), it checks
the kernel's logits against the backend's forward for the same token, times the kernel
alone (launches between two CUDA events, the same position each time), reads its phase
stamps, then times the backend's decode with the next token on the device (as `luce
bench` does) through the launch chain and with the kernel switched on (a new cache, so a
new model state and graphs). With --float-x the kernel is also timed with its rows over
float x; with --variants, with PersistentDecode's choices (attention's pages an item)
against the default, each once as it compiles (printed at once) and once more
(--variants-only: that table and nothing after it, for a short GPU call). Figures
go to docs/benchmarks.md unless --no-record."""
from __future__ import annotations

import sys


def run(shape: str = "qwen3-0.6b", n_prompt: int = 512, n_steps: int = 64, reps: int = 50,
        record: bool = True, float_x: bool = False, variants: bool = False,
        variants_only: bool = False) -> tuple[list[dict], list[dict]]:
    from ..backends import cuda as cuda_backend

    n_ctx = max(2048, n_prompt + n_steps + 64)
    default = cuda_backend.PERSISTENT_DECODE
    cuda_backend.PERSISTENT_DECODE = False  # the backend's caches below run the launch chain
    try:
        return _run(cuda_backend, n_ctx, shape, n_prompt, n_steps, reps, record, float_x, variants, variants_only)
    finally:
        cuda_backend.PERSISTENT_DECODE = default


def _run(cuda_backend, n_ctx, shape, n_prompt, n_steps, reps, record, float_x, variants, variants_only):
    import numpy as np
    from numba import cuda

    from ..kernels.persistent_decode import PersistentDecode
    from .e2e import _decode_pipelined, _load
    from .report import append_to_docs, print_table

    be, fam, cfg, w, _wbytes, label, _ = _load(None, shape, "cuda", n_ctx)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, min(1000, cfg.vocab_size), n_prompt)]
    token = 7

    def new_cache():
        kv = be.new_cache(cfg, n_ctx)
        be.forward(fam, cfg, w, kv, prompt, np.arange(n_prompt), None, [n_prompt - 1])
        kv.commit()
        return kv

    kv = new_cache()
    ref = np.asarray(be.forward(fam, cfg, w, kv, [token], [n_prompt], None, [0])).reshape(-1)
    kv.truncate(n_prompt)
    pd = PersistentDecode(cfg, w, kv)
    tok = cuda.to_device(np.array([token], np.int32))
    pos = cuda.to_device(np.array([n_prompt], np.int32))
    kv.reserve(1)
    got = pd.forward(tok, pos).copy_to_host().reshape(-1)
    diff = float(np.abs(got - ref).max())

    def time_alone(k):
        """us a launch of k's kernel: three to warm, then reps between two CUDA events."""
        for _ in range(3):
            k.forward(tok, pos)
        ev0, ev1 = cuda.event(), cuda.event()
        ev0.record()
        for _ in range(reps):
            k.forward(tok, pos)
        ev1.record()
        ev1.synchronize()
        return cuda.event_elapsed_time(ev0, ev1) * 1e3 / reps

    alone = time_alone(pd)
    alone_float = None
    if pd.x8 and float_x:  # the same kernel with its rows over float x, for the comparison
        alone_float = time_alone(PersistentDecode(cfg, w, kv, packed=pd.pk, x8=False))
    var_rows = []
    if variants:
        # attention's pages an item against the default's (as many as spread the items
        # over the grid); the options measured here before are gone (docs/benchmarks.md,
        # thirty-ninth session: two made the default, the rest removed)
        choices = [{}, {"pages_an_item": 1}, {"pages_an_item": 2}, {"pages_an_item": 4}]
        ks, diffs, times = [], [], []
        for c in choices:  # each timed once as it compiles, its line printed at once (a call cut short keeps them)
            k = PersistentDecode(cfg, w, kv, packed=pd.pk, **c)
            ks.append(k)
            diffs.append(float(np.abs(k.forward(tok, pos).copy_to_host().reshape(-1) - ref).max()))
            times.append([time_alone(k)])
            print(f"variant {c or '(the default)'}: {times[-1][0]:,.1f} us, logits within {diffs[-1]:.2e}", flush=True)
        for i, k in enumerate(ks):
            times[i].append(time_alone(k))
        var_rows = [{"options": ", ".join(f"{k}={v}" for k, v in c.items()) or "(the default)",
                     "us (two runs)": " / ".join(f"{t:,.1f}" for t in ts), "logits within": f"{d:.2e}"}
                    for c, ts, d in zip(choices, times, diffs)]
    title = f"persistent decode, {label}, {n_prompt}-token prompt"
    cols_v = ["options", "us (two runs)", "logits within"]
    if var_rows:  # printed at once: the backend's timings below take the longest
        print_table(f"{title}: the kernel alone by variant", var_rows, cols_v)
    if variants_only:  # a short GPU call: no backend graphs to build
        return [], []
    pd.forward(tok, pos)  # its stamps are the ones read below
    cuda.synchronize()
    emb, per_layer, head = pd.phase_times()
    item = pd.attention_item_times()
    detail, (head_norm, head_rows) = pd.phase_detail()
    kv.truncate(n_prompt)

    chain = _decode_pipelined(be, fam, cfg, w, kv, token, n_steps) / n_steps * 1e6
    cuda_backend.PERSISTENT_DECODE = True  # run() puts the caller's setting back
    kv2 = new_cache()
    if be._model_state(fam, cfg, w, kv2)["persistent"] is None:
        raise RuntimeError(f"the backend did not take the persistent kernel for {label}")
    through = _decode_pipelined(be, fam, cfg, w, kv2, token, n_steps) / n_steps * 1e6

    steps = [
        {"step": f"kernel alone (CUDA events), rows over {'int8' if pd.x8 else 'float'} x", "us": alone, "tok/s": 1e6 / alone, "vs launch chain": alone / chain},
        *([{"step": "kernel alone, rows over float x", "us": alone_float, "tok/s": 1e6 / alone_float,
            "vs launch chain": alone_float / chain}] if alone_float else []),
        {"step": "backend, launch chain (graph, next token on the device)", "us": chain, "tok/s": 1e6 / chain,
         "vs launch chain": 1.0},
        {"step": "backend through the kernel (the default; LUCE_PERSISTENT_DECODE=0: the chain)", "us": through, "tok/s": 1e6 / through,
         "vs launch chain": through / chain},
    ]
    m = per_layer.mean(axis=0)
    phases = [{"phase": name, "us": float(v), "a step": float(v) * (cfg.n_layers if i < 5 else 1)}
              for i, (name, v) in enumerate(zip(("q/k/v", "attention", "o", "gate/up", "down", "embedding", "head"),
                                                list(m) + [emb, head]))]
    phases += [{"phase": f"attention item: {name}", "us": float(v), "a step": None}
               for name, v in zip(("q norm and rotation", "new k and the keys", "partials written"), item)]
    for name, (staged, rows, rest) in zip(("q/k/v", "o", "gate/up", "down"), detail):
        phases += [{"phase": f"{name}: x staged (and normed)", "us": float(staged), "a step": None},
                   {"phase": f"{name}: block 0's rows", "us": float(rows), "a step": None},
                   {"phase": f"{name}: waiting and the barrier", "us": float(rest), "a step": None}]
    phases += [{"phase": "head: x normed", "us": float(head_norm), "a step": None},
               {"phase": "head: rows, to the last block's end", "us": float(head_rows), "a step": None}]
    cols_s, cols_p = ["step", "us", "tok/s", "vs launch chain"], ["phase", "us", "a step"]
    print_table(f"{title}: a decode step (logits within {diff:.2e} of the backend's)", steps, cols_s)
    print_table(f"{title}: phase stamps of the kernel's last step (us a layer, mean over layers; block 0's "
                "view, each phase ending in its grid barrier)", phases, cols_p)
    if record:
        append_to_docs(f"luce.bench.persistent_decode {shape}",
                       [("a decode step", steps, cols_s), ("phase stamps (us a layer; head and embedding a step)",
                                                           phases, cols_p)]
                       + ([("the kernel alone by variant", var_rows, cols_v)] if var_rows else []),
                       notes=f"{n_prompt}-token prompt, {reps} kernel launches, {n_steps} backend steps; largest "
                             f"logit difference to the backend's forward {diff:.2e}")
    return steps, phases


if __name__ == "__main__":
    args = sys.argv[1:]
    record = "--no-record" not in args
    n = 512
    if "--prompt" in args:
        n = int(args[args.index("--prompt") + 1])
    names = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--prompt")]
    run(names[0] if names else "qwen3-0.6b", n, record=record, float_x="--float-x" in args,
        variants="--variants" in args or "--variants-only" in args, variants_only="--variants-only" in args)
