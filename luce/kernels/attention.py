"""Attention over a KV cache: decode, causal prefill and tree verification are one
operation that differs only in the mask among the new tokens."""
from __future__ import annotations

import numpy as np


def attention_ref(q: np.ndarray, k_ctx: np.ndarray, v_ctx: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                  new_mask: np.ndarray, *, q_pos: np.ndarray | None = None, ctx_pos: np.ndarray | None = None,
                  window: int | None = None) -> np.ndarray:
    """Grouped-query attention of N new queries.

    q: [N, Hq, D]; k_ctx, v_ctx: [C, Hkv, D] committed rows (seen by every query);
    k_new, v_new: [N, Hkv, D]; new_mask[i, j]: query i sees new key j (a chain is
    lower-triangular, a tree is the ancestor-or-self relation). With `window`, a query
    at position p only sees keys at positions > p - window (q_pos, ctx_pos needed).
    Returns [N, Hq, D].
    """
    n, hq, d = q.shape
    hkv = k_new.shape[1]
    group = hq // hkv
    k = np.concatenate([k_ctx, k_new], axis=0)  # [C+N, Hkv, D]
    v = np.concatenate([v_ctx, v_new], axis=0)
    c = k_ctx.shape[0]
    allowed = np.concatenate([np.ones((n, c), dtype=bool), np.asarray(new_mask, dtype=bool)], axis=1)
    if window is not None:
        key_pos = np.concatenate([ctx_pos, q_pos])
        allowed &= key_pos[None, :] > (q_pos[:, None] - window)
    qg = q.reshape(n, hkv, group, d).astype(np.float32)
    scores = np.einsum("nhgd,khd->hgnk", qg, k.astype(np.float32)) / np.sqrt(d)
    scores = np.where(allowed[None, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("hgnk,khd->nhgd", p, v.astype(np.float32))
    return out.reshape(n, hq, d)


def causal_mask(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


def tree_mask(parents: np.ndarray) -> np.ndarray:
    """Ancestor-or-self mask from parent indices (-1 for children of the committed
    context); parents must precede their children."""
    n = len(parents)
    m = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError("a node's parent must come before it")
            m[i] |= m[p]
    return m
