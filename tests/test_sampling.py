"""Sampling distributions against direct computations, and stop-string streaming."""
import numpy as np
import pytest

from luce.engine.sampling import Sampler, SamplingParams, apply_penalties, distribution, draw, kept, top_logprobs
from luce.engine.stops import StopMatcher


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.fixture
def logits():
    return np.random.default_rng().standard_normal(50).astype(np.float32) * 3


def test_greedy_is_argmax(logits):
    p = distribution(logits, [], SamplingParams(temperature=0))
    assert p[np.argmax(logits)] == 1.0 and p.sum() == 1.0


def test_temperature_only_is_softmax(logits):
    p = distribution(logits, [], SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0))
    np.testing.assert_allclose(p, softmax(logits.astype(np.float64) / 0.7), rtol=1e-6)


def test_top_k_keeps_k_largest(logits):
    p = distribution(logits, [], SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0))
    top5 = np.argsort(-logits)[:5]
    assert set(np.nonzero(p)[0]) == set(top5)
    np.testing.assert_allclose(p[top5], softmax(logits[top5].astype(np.float64)), rtol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_mass(logits):
    q = softmax(logits.astype(np.float64))
    order = np.argsort(-q)
    p = distribution(logits, [], SamplingParams(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0))
    kept = np.count_nonzero(p)
    assert q[order[:kept]].sum() >= 0.6 - 1e-9
    assert q[order[:kept - 1]].sum() < 0.6
    np.testing.assert_allclose(p.sum(), 1.0)


def test_min_p_drops_tokens_below_fraction_of_top(logits):
    q = softmax(logits.astype(np.float64))
    p = distribution(logits, [], SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert set(np.nonzero(p)[0]) == set(np.nonzero(q >= 0.2 * q.max())[0])


def test_penalties():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_penalties(logits, [0, 1, 0], SamplingParams(repeat_penalty=2.0))
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.5])
    out = apply_penalties(logits, [0, 1, 0], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    np.testing.assert_allclose(out, [2.0 - 0.5 - 0.5, -2.0 - 0.5 - 0.25, 1.0, 0.5])


def test_seed_reproduces_and_sampling_follows_distribution(logits):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a = [Sampler(params).sample(logits, []) for _ in range(3)]
    assert len(set(a)) == 1
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=1))
    draws = np.bincount([s.sample(logits, []) for _ in range(4000)], minlength=50) / 4000
    expect = distribution(logits, [], s.params)
    assert np.abs(draws - expect).max() < 0.04


def test_invalid_params_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_stop_strings_hold_back_only_possible_prefixes(split):
    text = "Hello wor<ld> and END more"
    m = StopMatcher(["END", "<stop>"])
    out, stopped = "", False
    for i in range(0, len(text), split):
        piece, stopped = m.push(text[i:i + split])
        out += piece
        if stopped:
            break
    assert stopped and out == "Hello wor<ld> and "
    m = StopMatcher(["END"])
    piece, stopped = m.push("the EN")
    assert piece == "the " and not stopped
    assert m.flush() == "EN"


def _sorted_distribution(logits, history, p):
    """The distribution by a stable sort of the whole vocabulary (luce's before `kept`)."""
    logits = apply_penalties(np.asarray(logits, dtype=np.float32), history, p)
    z = logits.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    if p.top_k > 0:
        order = order[:p.top_k]
    ps = np.exp(z[order] - z[order][0])
    ps /= ps.sum()
    keep = len(ps)
    if p.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(ps), p.top_p) + 1))
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(ps >= p.min_p * ps[0]))))
    probs = np.zeros(len(logits))
    probs[order[:keep]] = ps[:keep] / ps[:keep].sum()
    return probs


@pytest.mark.parametrize("case", range(40))
def test_kept_tokens_match_a_sort_of_the_vocabulary(case):
    """`kept` sorts only the tokens that can be kept; against a stable sort of the whole
    vocabulary: the same tokens, the same probabilities (top-k: bit for bit), ties at the
    top-k boundary included (logits rounded to a coarse grid), with penalties."""
    rng = np.random.default_rng(case)
    v = int(rng.choice([50, 1000, 20000]))
    logits = (rng.standard_normal(v) * rng.choice([0.5, 3.0, 8.0])).astype(np.float32)
    if case % 3 == 0:
        logits = np.round(logits * 2) / 2  # many ties
    params = SamplingParams(temperature=float(rng.choice([0.3, 0.8, 1.5])), top_k=int(rng.choice([0, 1, 5, 40, v])),
                            top_p=float(rng.choice([1.0, 0.95, 0.5])), min_p=float(rng.choice([0.0, 0.05, 0.3])),
                            repeat_penalty=float(rng.choice([1.0, 1.3])),
                            presence_penalty=float(rng.choice([0.0, 0.5])))
    hist = list(rng.integers(0, v, 30))
    want = _sorted_distribution(logits, hist, params)
    ids, ps = kept(logits, hist, params)
    assert np.all(np.diff(ids) > 0)
    assert set(ids.tolist()) == set(np.flatnonzero(want).tolist()), params
    if 0 < params.top_k < v:
        assert np.array_equal(ps, want[ids]), params
    np.testing.assert_allclose(ps, want[ids], rtol=1e-12)
    d = distribution(logits, hist, params)  # the same, over the whole vocabulary
    np.testing.assert_array_equal(np.flatnonzero(d), ids)
    np.testing.assert_array_equal(d[ids], ps)


def test_sampler_draws_as_from_the_whole_distribution():
    """Drawing among the kept tokens gives the token a draw from `distribution`'s whole
    vector gives for the same generator state (a seed's output is what it was)."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(5000) * 2).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=7)
    s, ref = Sampler(params), np.random.default_rng(7)
    probs = distribution(logits, [], params)
    for _ in range(200):
        assert s.sample(logits, []) == int(ref.choice(len(probs), p=probs))


@pytest.mark.parametrize("v,k", [(50, 8), (1000, 8), (20000, 8), (20000, 40), (5, 8)])
def test_top_logprobs_match_a_log_softmax(v, k):
    """A draft's per-position candidates: the k largest logits (ties: the lower id first, as
    a stable sort of the whole row puts them) with their log-softmax values."""
    rng = np.random.default_rng(v + k)
    x = np.round(rng.standard_normal(v) * 4).astype(np.float32)  # integers: many ties
    ids, lp = top_logprobs(x, k)
    x64 = x.astype(np.float64)
    ref = x64 - x64.max() - np.log(np.exp(x64 - x64.max()).sum())
    order = np.argsort(-ref, kind="stable")[:min(k, v)]
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_allclose(lp, ref[order], rtol=0, atol=1e-6)


def test_draw_among_nonzero_entries_is_the_whole_vector_draw():
    rng = np.random.default_rng(3)
    probs = np.zeros(30000)
    probs[rng.choice(30000, 50, replace=False)] = rng.random(50)
    probs /= probs.sum()
    a, b = np.random.default_rng(11), np.random.default_rng(11)
    nz = np.flatnonzero(probs)  # the support, ascending
    assert [draw(a, nz, probs[nz]) for _ in range(300)] == [int(b.choice(len(probs), p=probs)) for _ in range(300)]
