"""The CPU backend: the numpy references of luce.kernels, run as a model.

Weights are dequantized to float32 at load: 4 bytes a parameter (SmolLM2-135M: 0.54 GB,
Qwen2.5-Coder-0.5B: 2.0 GB, 1.5B: 6.2 GB), traded for matmuls at BLAS speed instead of a
dequantization per token.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..kernels.activation import geglu_ref, swiglu_ref
from ..kernels.attention import attention_ref, causal_mask
from ..kernels.dequant import dequantize
from ..kernels.embedding import embed_ref
from ..kernels.norm import rms_norm_ref
from ..kernels.qk_rope import qk_rope_ref
from ..kernels.rope import rope_ref
from ..kv.cache import KVCache
from . import tile_runs


class NumpyOps:
    """The op interface of models.transformer, on numpy arrays."""

    embed = staticmethod(embed_ref)
    rms_norm = staticmethod(rms_norm_ref)
    rope = staticmethod(rope_ref)
    qk_rope = staticmethod(qk_rope_ref)
    swiglu = staticmethod(swiglu_ref)

    @staticmethod
    def linear(x, w, bias=None, residual=None):
        y = x @ w.T
        if bias is not None:
            y += bias
        if residual is not None:
            y += residual
        return y

    def linears(self, x, ws, biases):
        """linear(x, w, b) for each (w, b): several projections of one x."""
        return [self.linear(x, w, b) for w, b in zip(ws, biases)]

    def linear_norm(self, x, w, residual, norm_w, eps):
        """The residual stream's update and the RMSNorm after it: (residual + x W^T, its norm)."""
        residual = self.linear(x, w, residual=residual)
        return residual, self.rms_norm(residual, norm_w, eps)

    def post_norm_residual(self, y, x, w_post, w_next, eps):
        """Gemma's residual step and the next norm: (x + RMSNorm(y) w_post, its RMSNorm)."""
        x = self.add(x, self.rms_norm(y, w_post, eps))
        return x, self.rms_norm(x, w_next, eps)

    @staticmethod
    def new_layer():
        pass

    def gated_linear(self, x, w_gate, w_up, act="silu"):
        if act == "gelu_tanh":
            return geglu_ref(x @ w_gate.T, x @ w_up.T)
        if act != "silu":
            raise ValueError(f"gated_linear: unknown activation {act!r}")
        return self.swiglu(x @ w_gate.T, x @ w_up.T)

    @staticmethod
    def scale(x, s):
        return x * np.float32(s)

    @staticmethod
    def add(x, y):
        """x + y (the residual stream plus a normed output)."""
        x += y
        return x

    @staticmethod
    def split_heads(x, n_heads, head_dim):
        return x.reshape(x.shape[0], n_heads, head_dim)

    @staticmethod
    def merge_heads(x):
        return x.reshape(x.shape[0], -1)

    @staticmethod
    def take_rows(x, rows):
        return x[rows]

    @staticmethod
    def attention(kv: KVCache, layer, q, k, v, positions, mask, window):
        kv.write(layer, k, v, positions)
        k_ctx, v_ctx, ctx_pos = kv.committed(layer)
        return attention_ref(q, k_ctx, v_ctx, k, v, mask, q_pos=positions, ctx_pos=ctx_pos, window=window)


class CPUBackend:
    name = "cpu"
    # generate's DeviceStepper gains nothing here: the host computes every step anyway
    pipelined_greedy = False
    device_sampling = True

    def load_tensor(self, info) -> np.ndarray:
        return dequantize(info.data, info.qtype, info.shape)

    def tiled_weight(self, pool: np.ndarray, qtype, rows: int, cols: int, name: str | None = None,
                     start: int = 0) -> np.ndarray:
        """A random-weight matrix made by repeating the raw rows of `pool` from row `start`
        on, wrapping (benchmarks)."""
        raw = np.concatenate([pool[s:s + n] for _, s, n in tile_runs(pool.shape[0], rows, start)])
        return dequantize(raw.reshape(-1), qtype, (rows, cols))

    def new_cache(self, cfg, n_ctx: int) -> KVCache:
        return KVCache(cfg.n_layers, n_ctx, cfg.n_kv_heads, cfg.head_dim)

    def __init__(self):
        self._ops = {}
        self._next_token = weakref.WeakKeyDictionary()  # cache -> its last forward_next_token's token
        self._history = weakref.WeakKeyDictionary()  # cache -> (tokens its draws penalize, repeat_last_n)

    def ops_for(self, family):
        """NumpyOps with any kernels plugins registered for this family swapped in."""
        if family.name not in self._ops:
            from ..plugins import ops_with_overrides
            self._ops[family.name] = ops_with_overrides(NumpyOps(), family, self.name)
        return self._ops[family.name]

    def forward(self, family, cfg, weights, kv: KVCache, tokens, positions, mask=None,
                logits_rows=None) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        if mask is None:
            mask = causal_mask(len(tokens))
        kv.reserve(len(tokens))
        return family.run_forward(cfg, weights, self.ops_for(family), kv, tokens, positions, mask, logits_rows)

    def forward_next_token(self, family, cfg, weights, kv: KVCache, token, position, sample=None) -> "ReadyToken":
        """CUDABackend.forward_next_token's contract, computed at once: a one-token decode
        step whose greedy (or with `sample`, drawn) next token is returned; token None
        takes the previous call's next token on this cache."""
        if token is None:
            if kv not in self._next_token:
                raise RuntimeError("forward_next_token(None) needs a forward_next_token before it")
            token = self._next_token[kv]
        logits = self.forward(family, cfg, weights, kv, [token], [position])
        if sample is None:
            nxt = int(np.argmax(logits[-1]))
        else:
            from ..engine.sampling import draw_params
            from ..kernels.sampling import SP_PENALIZE
            history, n = self._history.get(kv, ([], 0))
            nxt = draw_params(logits[-1], sample, history, n)
            if sample[SP_PENALIZE]:
                history.append(nxt)
        self._next_token[kv] = nxt
        return ReadyToken(nxt)

    def set_penalty_history(self, family, cfg, weights, kv: KVCache, history, repeat_last_n: int) -> None:
        """CUDABackend.set_penalty_history's contract: the history the next draws penalize."""
        self._history[kv] = (list(history), repeat_last_n)


class ReadyToken:
    """A next token already known (the CPU backend's PendingToken)."""

    def __init__(self, token: int):
        self.token = token

    def result(self) -> int:
        return self.token
