"""Draft trees: the chain a verifier checks, and DDTree's best-first tree.

A tree is a list of nodes in an order where every parent precedes its children; node
i holds `tokens[i]`, `parents[i]` (-1: a child of the root, the token the target
already chose) and `depth[i]` (1 for children of the root). The verifier puts the root
at row 0 of its forward and node i at row i + 1.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from ..kernels.attention import tree_mask


@dataclass
class Tree:
    tokens: np.ndarray  # int64 [N]
    parents: np.ndarray  # int64 [N]
    depth: np.ndarray  # int64 [N], >= 1
    _children: list[list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1: the root), in the order they were added: best first."""
        if self._children is None:
            ch: list[list[int]] = [[] for _ in range(len(self) + 1)]
            for i, p in enumerate(self.parents):
                ch[int(p) + 1].append(i)
            self._children = ch
        return self._children[node + 1]

    def forward_inputs(self, root_token: int, n_past: int):
        """tokens, positions and mask of the one target forward that verifies the tree,
        root first. A node sits at committed + depth, where it lands if accepted."""
        tokens = np.concatenate([[root_token], self.tokens]).astype(np.int64)
        positions = n_past + np.concatenate([[0], self.depth]).astype(np.int64)
        parents = np.concatenate([[-1], self.parents + 1]).astype(np.int64)
        parents[0] = -1
        return tokens, positions, tree_mask(parents)


def empty_tree() -> Tree:
    z = np.zeros(0, dtype=np.int64)
    return Tree(z, z.copy(), z.copy())


def chain_tree(tokens) -> Tree:
    t = np.asarray(tokens, dtype=np.int64)
    n = len(t)
    return Tree(t, np.arange(-1, n - 1, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64))


def build_tree(topk_ids: np.ndarray, topk_logp: np.ndarray, budget: int, seed_chain: bool = True) -> Tree:
    """DDTree: the `budget` most likely paths under the draft's per-position distributions.

    topk_ids, topk_logp: [L, K], rank 0 the draft's top-1 (-inf pads missing candidates).
    A path's score is the sum of its tokens' log-probabilities at their depths, as if the
    positions were independent; since every log-probability is <= 0 a child never
    outscores its parent, so adding nodes best-first keeps the tree closed under
    ancestors. The top-1 chain goes in first so that the tree never does worse than the
    chain the drafter spent its forwards on.
    """
    L, K = topk_ids.shape if topk_ids.size else (0, 0)
    # Python lists and floats: numpy scalar indexing made this ~4x slower, host time the
    # GPU waits through between the draft and the target's forward
    ids_l, lp_l = topk_ids.tolist(), np.asarray(topk_logp, dtype=np.float64).tolist()
    finite = math.isfinite
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    next_rank: dict[int, int] = {}
    heap: list = []
    counter = 0

    def add(parent: int, rank: int) -> int:
        d = depths[parent] if parent >= 0 else 0
        tokens.append(ids_l[d][rank])
        parents.append(parent)
        depths.append(d + 1)
        scores.append((scores[parent] if parent >= 0 else 0.0) + lp_l[d][rank])
        next_rank[parent] = rank + 1
        return len(tokens) - 1

    def offer(n: int) -> None:
        # at most one pending candidate per node: its best child not yet in the tree;
        # the next-best is offered once that one is taken
        nonlocal counter
        d, r = (depths[n] if n >= 0 else 0), next_rank.get(n, 0)
        if d < L and r < K and finite(lp_l[d][r]):
            counter += 1
            heapq.heappush(heap, (-((scores[n] if n >= 0 else 0.0) + lp_l[d][r]), counter, n, r))

    if seed_chain:
        parent = -1
        for d in range(min(L, budget)):
            if not finite(lp_l[d][0]):
                break
            parent = add(parent, 0)
    for n in range(-1, len(tokens)):
        offer(n)
    while len(tokens) < budget and heap:
        _, _, parent, rank = heapq.heappop(heap)
        n = add(parent, rank)
        offer(parent)
        offer(n)
    return Tree(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64),
                np.asarray(depths, dtype=np.int64))
