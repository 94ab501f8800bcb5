"""Speculative sampling keeps the target's distribution: checked exactly on a toy
trigram target whose sequence probabilities we can enumerate.

The toy model goes through the same KVCache, tree mask, positions and commit as a real
one: it stores token ids as its K rows and reads a token's predecessor from its
ancestor in the mask (or the last committed row), so a wrong mask, position or KV
compaction changes the distribution and fails the test.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from luce.engine.generator import Session
from luce.engine.sampling import Sampler, SamplingParams, distribution
from luce.kernels.attention import causal_mask
from luce.kv.cache import KVCache
from luce.spec import DraftModel, PromptLookup, SpeculativeStepper

V = 5


class TrigramModel:
    """logits after token t with predecessor s: table[s, t] (s = V for "none")."""

    def __init__(self, seed: int, scale: float = 1.5):
        self.table = np.random.default_rng(seed).standard_normal((V + 1, V, V)).astype(np.float32) * scale
        self.config = SimpleNamespace(n_layers=1)
        self.backend = SimpleNamespace(new_cache=lambda cfg, n_ctx: KVCache(1, n_ctx, 1, 1))

    def new_session(self, n_ctx=None):
        return Session(self, n_ctx or 64)

    def forward(self, cache, tokens, positions, mask=None, logits_rows=None):
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        n = len(tokens)
        mask = causal_mask(n) if mask is None else mask
        cache.reserve(n)
        cache.write(0, tokens.reshape(n, 1, 1).astype(np.float32), tokens.reshape(n, 1, 1).astype(np.float32),
                    positions)
        ctx, _, ctx_pos = cache.committed(0)
        out = np.empty((n, V), dtype=np.float32)
        for i in range(n):
            prev = V
            anc = [j for j in range(n) if mask[i, j] and positions[j] == positions[i] - 1]
            if anc:
                prev = int(tokens[anc[0]])
            elif len(ctx):
                assert ctx_pos[-1] == positions[i] - 1, "node not placed right after the committed context"
                prev = int(ctx[-1, 0, 0])
            out[i] = self.table[prev, tokens[i]]
        return out if logits_rows is None else out[logits_rows]


def exact_probs(model: TrigramModel, prompt, T: int, params: SamplingParams) -> dict:
    probs = {}
    for seq in itertools.product(range(V), repeat=T):
        hist, pr, prev, cur = list(prompt), 1.0, (prompt[-2] if len(prompt) > 1 else V), prompt[-1]
        for t in seq:
            pr *= distribution(model.table[prev, cur], hist, params)[t]
            hist.append(t)
            prev, cur = cur, t
        probs[seq] = pr
    return probs


def sample_sequences(target, drafter, method, prompt, T, params, trials, draft_max=3, budget=6):
    session = target.new_session(64)
    sampler = Sampler(params)
    counts: dict = {}
    stats = []
    for _ in range(trials):
        stepper = SpeculativeStepper(session, sampler, drafter, method=method, draft_max=draft_max, budget=budget)
        logits, _ = session.prefill(list(prompt))
        hist, out = list(prompt), []
        while True:
            new = stepper.step(logits, hist)[:T - len(out)]
            out += new
            hist += new
            if len(out) >= T:
                break
            logits = stepper.advance(new)
        stats.append(stepper.counters.acceptance_length)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts, float(np.mean(stats))


def chi2_ok(counts: dict, probs: dict, trials: int) -> tuple[bool, float, float]:
    """Pearson's chi-square with cells of expected count < 5 pooled; threshold at p = 1e-4
    (Wilson-Hilferty), so a correct sampler fails about once in 10,000 runs."""
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for k, p in probs.items():
        e = p * trials
        if e < 5:
            pool_o += counts.get(k, 0)
            pool_e += e
        else:
            obs.append(counts.get(k, 0))
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs, exp = np.array(obs), np.array(exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    k = len(obs) - 1
    z = 3.719  # one-sided 1e-4
    crit = k * (1 - 2 / (9 * k) + z * np.sqrt(2 / (9 * k))) ** 3
    return stat < crit, stat, crit


PARAMS = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
PROMPT = [1, 3, 0, 2]
T = 3


@pytest.fixture(scope="module")
def target():
    return TrigramModel(seed=0)


@pytest.fixture(scope="module")
def exact(target):
    return exact_probs(target, PROMPT, T, PARAMS)


@pytest.mark.parametrize("method,draft", [
    ("chain", "other"),  # sampled chain, p/q acceptance
    ("chain", "same"),  # q == p: nearly everything accepted
    ("ddtree", "other"),  # deterministic branches, recursive rejection
    ("ddtree", "same"),
    ("chain", "lookup"),  # deterministic chain
    ("ddtree", "lookup"),
])
def test_sampling_preserves_target_distribution(target, exact, method, draft):
    trials = 3000
    drafter = (PromptLookup() if draft == "lookup" else
               DraftModel(target if draft == "same" else TrigramModel(seed=7), n_ctx=64, top_k=3))
    counts, acc = sample_sequences(target, drafter, method, PROMPT, T, PARAMS, trials)
    ok, stat, crit = chi2_ok(counts, exact, trials)
    assert ok, f"{method}/{draft}: chi2 {stat:.1f} >= {crit:.1f}"
    if draft == "same":
        assert acc > 2.0  # the draft does its job: steps commit several tokens


def test_sampling_with_penalties_preserves_distribution(target):
    # penalties make each node's distribution depend on its own path's history
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5,
                            presence_penalty=0.3, seed=99)
    exact = exact_probs(target, PROMPT, T, params)
    counts, _ = sample_sequences(target, DraftModel(TrigramModel(seed=3), n_ctx=64, top_k=3), "ddtree",
                                 PROMPT, T, params, 3000)
    ok, stat, crit = chi2_ok(counts, exact, 3000)
    assert ok, f"chi2 {stat:.1f} >= {crit:.1f}"


def test_detects_a_biased_sampler(target, exact):
    # the check has teeth: sampling from the draft's distribution instead fails it
    other = TrigramModel(seed=7)
    counts, _ = sample_sequences(other, PromptLookup(), "chain", PROMPT, T, PARAMS, 3000)
    assert not chi2_ok(counts, exact, 3000)[0]


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_greedy_toy_matches_plain(target, method):
    params = SamplingParams(temperature=0.0, seed=0)
    plain = []
    session = target.new_session(64)
    logits, _ = session.prefill(PROMPT)
    for _ in range(12):
        t = int(np.argmax(logits))
        plain.append(t)
        logits = session.decode(t)
    counts, _ = sample_sequences(target, DraftModel(TrigramModel(seed=5), n_ctx=64, top_k=3), method, PROMPT, 12,
                                 params, 1)
    assert list(counts) == [tuple(plain)]
