"""The small per-layer ops of a decode step for `luce bench --kernels`: RMSNorm of the
hidden state, the fused q/k norm + RoPE against its unfused parts (two per-head norms and
two RoPE launches), at the Qwen3-8B shape for one token (decode) and 512 (a prefill piece);
and once a decode step, the next token from 151,936 logits: the argmax, the draw with the
default sampling parameters, and with penalties (luce.kernels.sampling.sample_cuda); a
draft step's 8 candidates with their log-sum-exp, fused against four launches.
Each is a few microseconds of latency, not bandwidth: the rows say what one launch costs
inside a CUDA graph, which is what the decode step pays per call."""
from __future__ import annotations

import numpy as np

from .kernels_attention import QWEN3_8B, time_launch

N_EMBD = 4096


def bench_small_ops(tokens=(1, 512), reps: int = 50, seed: int = 0) -> list[dict]:
    """Rows {name, tokens, time_us, mode}."""
    from numba import cuda

    from ..kernels.norm import rms_norm_cuda
    from ..kernels.qk_rope import qk_rope_cuda
    from ..kernels.rope import rope_cuda

    hq, hkv, d = QWEN3_8B["n_heads"], QWEN3_8B["n_kv_heads"], QWEN3_8B["head_dim"]
    rng = np.random.default_rng(seed)
    stream = cuda.stream()
    rows = []
    for n in tokens:
        x = cuda.to_device(rng.standard_normal((n, N_EMBD)).astype(np.float32), stream=stream)
        w = cuda.to_device(rng.uniform(0.5, 1.5, N_EMBD).astype(np.float32), stream=stream)
        out = cuda.device_array((n, N_EMBD), np.float32, stream=stream)
        q = cuda.to_device(rng.standard_normal((n, hq, d)).astype(np.float32), stream=stream)
        k = cuda.to_device(rng.standard_normal((n, hkv, d)).astype(np.float32), stream=stream)
        qn = cuda.device_array((n, hq, d), np.float32, stream=stream)
        kn = cuda.device_array((n, hkv, d), np.float32, stream=stream)
        hw = cuda.to_device(rng.uniform(0.5, 1.5, d).astype(np.float32), stream=stream)
        pos = cuda.to_device(np.arange(8000, 8000 + n, dtype=np.int32), stream=stream)

        def unfused():
            rms_norm_cuda(q, hw, 1e-6, out=qn, stream=stream)
            rms_norm_cuda(k, hw, 1e-6, out=kn, stream=stream)
            rope_cuda(qn, pos, d, 1e6, "halves", stream=stream)
            rope_cuda(kn, pos, d, 1e6, "halves", stream=stream)

        cases = [("rms_norm (hidden state)", lambda: rms_norm_cuda(x, w, 1e-6, out=out, stream=stream)),
                 ("qk_rope (fused q/k norm + rope)",
                  lambda: qk_rope_cuda(q, k, pos, hw, hw, 1e-6, d, 1e6, "halves", stream=stream)),
                 ("q/k norm + rope, unfused (4 launches)", unfused)]
        if n == 1:
            cases += _next_token_cases(rng, stream)
        for name, launch in cases:
            us, mode = time_launch(launch, stream, reps)
            rows.append(dict(name=name, tokens=n, time_us=round(us, 2), mode=mode))
    return rows


VOCAB = 151_936


def _next_token_cases(rng, stream) -> list:
    from numba import cuda

    from ..kernels.sampling import argmax_cuda, penalty_state, sample_cuda, sample_params, sample_scratch
    logits = cuda.to_device((rng.standard_normal((1, VOCAB)) * 3).astype(np.float32), stream=stream)
    tok = cuda.device_array(1, np.int32, stream=stream)
    scratch = sample_scratch(VOCAB)
    plain = cuda.to_device(sample_params(0.8, 40, 0.95, 0.05, 0.5), stream=stream)
    pen_sp = cuda.to_device(sample_params(0.8, 40, 0.95, 0.05, 0.5, repeat_penalty=1.1, presence_penalty=0.2),
                            stream=stream)
    state = tuple(cuda.to_device(a, stream=stream) for a in penalty_state(rng.integers(0, VOCAB, 600), VOCAB, 64))
    from ..kernels.sampling import (logsumexp_cuda, topk_cuda, topk_logsumexp_cuda, topk_lse_scratch,
                                    topk_scratch_shape)
    k = 8  # the draft's top-k
    ov, oi, lz = (cuda.device_array((1, k), np.float32), cuda.device_array((1, k), np.int32),
                  cuda.device_array(1, np.float64))
    shape = topk_scratch_shape(1, VOCAB, k)
    tk_scratch = (cuda.device_array(shape, np.float32), cuda.device_array(shape, np.int32))
    lse_scratch = topk_lse_scratch(1, VOCAB, k)

    def separate():
        argmax_cuda(logits, out=tok, stream=stream)
        topk_cuda(logits, k, ov, oi, scratch=tk_scratch, stream=stream)
        logsumexp_cuda(logits, ov, lz, stream=stream)

    return [("draft candidates: argmax, top-8 (2 phases), log-sum-exp: 4 launches", separate),
            ("draft candidates: fused (topk_logsumexp_cuda)",
             lambda: topk_logsumexp_cuda(logits, k, ov, oi, lz, tok, scratch=lse_scratch, stream=stream)),
            ("next token: argmax", lambda: argmax_cuda(logits, out=tok, stream=stream)),
            ("next token: draw (default sampling)",
             lambda: sample_cuda(logits, plain, tok, scratch=scratch, stream=stream, state=state)),
            ("next token: draw with penalties",
             lambda: sample_cuda(logits, pen_sp, tok, scratch=scratch, stream=stream, state=state))]


if __name__ == "__main__":
    for row in bench_small_ops():
        print(row)
