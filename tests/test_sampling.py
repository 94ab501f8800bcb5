"""Sampling distributions against direct computations, and stop-string streaming."""
import numpy as np
import pytest

from luce.engine.sampling import Sampler, SamplingParams, apply_penalties, distribution
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
