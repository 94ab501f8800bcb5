"""DDTree construction, tree forward inputs, prompt lookup and the spec options."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from luce.spec import PromptLookup, SpecOptions, build_tree, chain_tree
from luce.spec.ddtree import empty_tree


def _random_topk(L, K, seed):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(100)[:K] for _ in range(L)])
    logp = np.log(np.sort(rng.dirichlet(np.ones(K) * 0.5, size=L), axis=-1)[..., ::-1] * 0.9)
    return ids.astype(np.int64), logp


def _paths(tree):
    out = []
    for i in range(len(tree)):
        path, n = [], i
        while n >= 0:
            path.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_tree_is_the_best_paths(seed):
    L, K, budget = 5, 4, 22
    ids, logp = _random_topk(L, K, seed)
    tree = build_tree(ids, logp, budget, seed_chain=False)
    assert len(tree) == budget
    # brute force: every prefix of every rank sequence, scored as a sum of log-probs
    scored = {}
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            scored[tuple(ids[i, r] for i, r in enumerate(ranks))] = sum(logp[i, r] for i, r in enumerate(ranks))
    best = sorted(scored, key=lambda p: -scored[p])[:budget]
    assert set(_paths(tree)) == set(best)


@pytest.mark.parametrize("seed", range(3))
def test_tree_seeds_the_chain_and_is_closed(seed):
    L, K, budget = 8, 4, 22
    ids, logp = _random_topk(L, K, seed)
    tree = build_tree(ids, logp, budget)
    assert len(tree) == budget
    paths = _paths(tree)
    assert len(set(paths)) == budget
    chain = tuple(int(t) for t in ids[:, 0])
    assert all(chain[:d] in paths for d in range(1, L + 1))
    for i, p in enumerate(tree.parents):
        assert p < i
        assert tree.depth[i] == (1 if p < 0 else tree.depth[p] + 1)


def test_tree_small_budget_and_missing_candidates():
    ids, logp = _random_topk(6, 3, 0)
    assert len(build_tree(ids, logp, 3)) == 3  # the budget cuts the seeded chain
    logp[:, 1:] = -np.inf
    assert len(build_tree(ids, logp, 22)) == 6  # only the chain exists
    assert len(build_tree(np.zeros((0, 1), dtype=np.int64), np.zeros((0, 1)), 22)) == 0


def test_forward_inputs_positions_and_mask():
    ids = np.array([[10, 11], [20, 21]])
    logp = np.log(np.array([[0.6, 0.4], [0.7, 0.3]]))
    tree = build_tree(ids, logp, 4)
    tokens, positions, mask = tree.forward_inputs(5, n_past=100)
    assert tokens[0] == 5 and positions[0] == 100
    assert list(positions[1:]) == [100 + d for d in tree.depth]
    assert mask[:, 0].all()  # everyone sees the root
    for i, p in enumerate(tree.parents):
        row = mask[i + 1]
        anc, n = {0, i + 1}, p
        while n >= 0:
            anc.add(n + 1)
            n = tree.parents[n]
        assert set(np.flatnonzero(row)) == anc
    t, pos, m = chain_tree([7, 8, 9]).forward_inputs(1, 10)
    assert list(pos) == [10, 11, 12, 13] and np.array_equal(m, np.tril(np.ones((4, 4), bool)))
    t, pos, m = empty_tree().forward_inputs(1, 10)
    assert list(t) == [1] and list(pos) == [10]


def test_prompt_lookup():
    lk = PromptLookup(max_ngram=3)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    d = lk.propose(ctx, 4)
    assert d.tokens == [7, 8, 1, 2]  # the most recent earlier "1 2 3" was followed by 7 8 ...
    assert d.topk_ids[0, 0] == 7 and 4 in d.topk_ids[0]  # the older match branches
    assert np.all(d.topk_logp <= 0)
    assert lk.propose([1, 2, 3], 4).tokens == []
    assert lk.propose([5, 6, 5], 3).tokens == [6, 5]  # falls back to shorter n-grams, stops at the end
    assert lk.propose(ctx, 0).tokens == []


def test_spec_options():
    assert SpecOptions.from_cli(None, None).mode == "off"
    assert SpecOptions.from_cli(None, "auto").mode == "ddtree"
    o = SpecOptions.from_cli("chain", "x.gguf", 10, 4)
    assert (o.method, o.ddtree_budget, o.draft_max) == ("chain", 10, 4)
    assert SpecOptions(mode="lookup").method == "chain"
    from luce.errors import LuceError
    with pytest.raises(LuceError):
        SpecOptions(mode="medusa")
    with pytest.raises(LuceError):
        SpecOptions(mode="ddtree", ddtree_budget=0)
