"""Verification: follow the target down a draft tree (a chain is a tree with one child
per node) and decide which nodes it keeps.

Greedy: a child is accepted when it is the target's argmax at its parent, so the output
is the target's greedy output whatever the draft proposed.

Sampling, lossless in distribution:
- Drafted tokens that were sampled from a known draft distribution q (a sampled chain)
  go through standard speculative sampling: accept x with probability min(1, p(x)/q(x));
  on rejection the next token is drawn from max(0, p - q), normalized.
- Deterministic proposals (DDTree's branches, greedy drafts, lookup) are a point-mass q,
  handled by recursive rejection over a node's children in rank order: child c is
  accepted with probability r(c)/sum(r) where r starts as p and loses each rejected
  child's mass; if every child is rejected the next token is drawn from r. The token
  that comes out at each depth is distributed exactly as p, so whole paths are too.
A rejection's replacement token has no K/V or logits yet: the verdict hands it back as
`next_token` and the stepper emits it first in the next step, whose forward computes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine.sampling import SamplingParams, draw, kept
from .ddtree import Tree


@dataclass
class Verdict:
    nodes: list[int]  # accepted tree nodes, root to leaf
    tokens: list[int]  # their tokens
    next_token: int | None  # drawn from a rejection's residual; None: sample the last node's logits as usual


def plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and not params.penalized


def verify(tree: Tree, logits: np.ndarray, history: list[int], params: SamplingParams, rng,
           q: list[np.ndarray] | None = None) -> Verdict:
    """Walk `tree` from the root. logits[0] are the target's logits after the root (the
    last token of `history`), logits[i + 1] after node i. `q[d]`: the distribution the
    depth-(d+1) chain token was sampled from, (ids, probabilities) over its support
    (chains only)."""
    nodes: list[int] = []
    toks: list[int] = []
    node = -1
    fast = plain_greedy(params)
    ids = getattr(logits, "ids", None)  # GreedyRows (luce.backends): argmaxes without the rows
    while True:
        children = tree.children(node)
        if not children:
            return Verdict(nodes, toks, None)
        hist = history + toks
        if fast:
            best = int(ids[node + 1]) if ids is not None else int(np.argmax(logits[node + 1]))
            nxt = next((c for c in children if tree.tokens[c] == best), None)
            if nxt is None:
                return Verdict(nodes, toks, None)
        elif params.greedy:
            best = int(kept(logits[node + 1], hist, params)[0][0])
            nxt = next((c for c in children if tree.tokens[c] == best), None)
            if nxt is None:
                return Verdict(nodes, toks, None)
        else:
            # p over its support (ascending ids): no vocabulary-sized arrays a node
            ids, ps = kept(logits[node + 1], hist, params)
            nz, p = ids[ps > 0], ps[ps > 0]
            if q is not None:
                nxt, replacement = _accept_sampled(children, tree, nz, p, q[len(toks)], rng)
            else:
                nxt, replacement = _accept_points(children, tree, nz, p, rng)
            if nxt is None:
                return Verdict(nodes, toks, replacement)
        nodes.append(nxt)
        toks.append(int(tree.tokens[nxt]))
        node = nxt


def _at(nz: np.ndarray, x: int) -> int:
    """x's index in the ascending ids nz, or -1 where x is not among them."""
    j = int(np.searchsorted(nz, x))
    return j if j < len(nz) and nz[j] == x else -1


def _values_at(ids: np.ndarray, vals: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """vals at the tokens xs (one or an array) of a distribution over its support
    (ascending ids), 0 elsewhere."""
    j = np.minimum(np.searchsorted(ids, xs), len(ids) - 1)
    return np.where(ids[j] == xs, vals[j], 0.0)


def _accept_sampled(children, tree: Tree, nz: np.ndarray, p: np.ndarray, q, rng):
    """p: the target's probabilities of the ids nz (its support, ascending); q: the draft's,
    (ids, probabilities) over its own support."""
    c = children[0]
    x = int(tree.tokens[c])
    px, qx = float(_values_at(nz, p, x)), float(_values_at(*q, x))
    if qx > 0 and rng.random() < min(1.0, px / qx):
        return c, None
    # the residual lives where p does; its mass is 0 where p == q, where rejection has
    # probability 0: only rounding gets there
    return None, _draw_residual(rng, nz, np.maximum(p - _values_at(q[0], q[1], nz), 0.0), p)


def _accept_points(children, tree: Tree, nz: np.ndarray, p: np.ndarray, rng):
    r = p.copy()  # r lives where p does
    for c in children:
        j = _at(nz, int(tree.tokens[c]))  # -1: outside p's support, r(x) = 0
        s = r.sum()
        if s <= 1e-12:
            break
        if j >= 0 and r[j] > 0 and rng.random() < r[j] / s:
            return c, None
        if j >= 0:
            r[j] = 0.0
    return None, _draw_residual(rng, nz, r, p)


def _draw_residual(rng, nz, r, p) -> int:
    """A token from the residual r over the ids nz (ascending: the draw is the one over the
    whole vocabulary), normalized; from p (over the same ids) where r has no mass left."""
    s = r.sum()
    return draw(rng, nz, r / s if s > 1e-12 else p)
