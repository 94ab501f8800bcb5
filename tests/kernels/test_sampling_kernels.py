"""Device sampling kernels against their numpy references, in the CUDA simulator
(shared-memory argmax reduction, one-warp blocks). The shuffle path and the real
vocabulary size (151936) are covered by tests/gpu/test_kernels_gpu.py."""
import numpy as np
import pytest
from numba import cuda

from luce.engine.sampling import SamplingParams, apply_penalties
from luce.kernels.sampling import (MAX_REPEAT_WINDOW, MAX_TOP_K, apply_penalties_cuda, apply_penalties_ref,
                                   argmax_cuda, argmax_ref, logsumexp_cuda, logsumexp_ref, penalty_state,
                                   sample_applies, sample_cuda, sample_params,
                                   sample_ref, token_counts, topk_cuda, topk_ref, topk_scratch_shape)

rng = np.random.default_rng()


def test_penalties_ref_matches_engine():
    vocab = 300
    logits = rng.standard_normal(vocab).astype(np.float32)
    hist = rng.integers(0, vocab, 100)
    p = SamplingParams(repeat_penalty=1.3, repeat_last_n=20, presence_penalty=0.4, frequency_penalty=0.2)
    counts, recent = token_counts(hist, vocab, p.repeat_last_n)
    got = apply_penalties_ref(logits, counts, recent, p.repeat_penalty, p.presence_penalty, p.frequency_penalty)
    np.testing.assert_allclose(got, apply_penalties(logits, hist, p), rtol=1e-6, atol=1e-6)


def test_penalties_cuda():
    vocab = 500
    logits = rng.standard_normal((2, vocab)).astype(np.float32)
    counts, recent = token_counts(rng.integers(0, vocab, 80), vocab, 30)
    d = cuda.to_device(logits)
    apply_penalties_cuda(d, cuda.to_device(counts), cuda.to_device(recent), 1.2, 0.5, 0.1)
    np.testing.assert_allclose(d.copy_to_host(), apply_penalties_ref(logits, counts, recent, 1.2, 0.5, 0.1),
                               rtol=1e-6, atol=1e-6)


def test_argmax():
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    x[1, 5] = x[1, 900] = 10.0  # a tie: the smaller id wins
    x[2, 3] = np.nan
    out = cuda.to_device(np.full(3, -7, np.int32))
    argmax_cuda(cuda.to_device(x), out=out)
    np.testing.assert_array_equal(out.copy_to_host(), argmax_ref(x))
    assert out.copy_to_host()[1] == 5


def test_argmax_over_several_blocks():
    """A row longer than ARGMAX_CHUNK is split over blocks whose last reduces their partials:
    a tie across blocks goes to the smaller id, a maximum in the last block is found, a NaN
    is never picked, and a second launch (its counters left at zero) agrees again."""
    from luce.kernels.sampling import ARGMAX_CHUNK
    v = 2 * ARGMAX_CHUNK + 900
    x = rng.standard_normal((3, v)).astype(np.float32)
    x[0, 100] = x[0, v - 50] = 9.0
    x[1, v - 1] = 8.0
    x[2, ARGMAX_CHUNK + 1] = np.nan
    x[2, ARGMAX_CHUNK + 2] = 7.0
    d = cuda.to_device(x)
    for _ in range(2):
        out = argmax_cuda(d)
        np.testing.assert_array_equal(out.copy_to_host(), argmax_ref(x))
    assert list(out.copy_to_host()) == [100, v - 1, ARGMAX_CHUNK + 2]


@pytest.mark.parametrize("vocab,k", [(1100, 6), (40, 5)])  # two-phase (several chunks), single chunk
def test_topk(vocab, k):
    x = rng.standard_normal((2, vocab)).astype(np.float32)
    x[0, 10:14] = 3.5  # ties are ordered by id
    x[1, 0] = np.nan
    ov = cuda.to_device(np.full((2, k), np.nan, np.float32))
    oi = cuda.to_device(np.full((2, k), -7, np.int32))
    shape = topk_scratch_shape(2, vocab, k)
    scratch = (cuda.to_device(np.full(shape, np.nan, np.float32)), cuda.to_device(np.full(shape, -7, np.int32)))
    topk_cuda(cuda.to_device(x), k, ov, oi, scratch=scratch)
    rv, ri = topk_ref(x, k)
    np.testing.assert_array_equal(oi.copy_to_host(), ri)
    np.testing.assert_array_equal(ov.copy_to_host(), rv)


@pytest.mark.parametrize("vocab,k,launches", [(600, 4, 2), (40, 3, 1)])  # three chunks merged by the last block; one
def test_topk_logsumexp_in_one_launch(vocab, k, launches):
    """The draft step's fused form: top-k, log-sum-exp and argmax as the three kernels'
    references give them, over poisoned outputs and scratch; launched again, the block
    counter has reset itself."""
    from luce.kernels.sampling import _topk_lse_chunks, topk_logsumexp_cuda, topk_lse_scratch
    x = (4 * rng.standard_normal((2, vocab))).astype(np.float32)
    x[0, 10:14] = 30.0  # ties are ordered by id
    x[0] -= 80.0  # far below 0
    x[1, : vocab // 2] = -np.inf  # whole chunks of -inf: their sums add nothing
    x[1, vocab - 1] = np.nan  # never a candidate; the row's sum is NaN, as logsumexp_ref's
    assert _topk_lse_chunks(vocab, k)[0] == (1 if vocab < 100 else 3)
    d = cuda.to_device(x)
    scratch = topk_lse_scratch(2, vocab, k)
    scratch[0].copy_to_device(np.full(scratch[0].shape, np.nan, np.float32))
    scratch[1].copy_to_device(np.full(scratch[1].shape, -7, np.int32))
    scratch[2].copy_to_device(np.full(scratch[2].shape, np.nan))
    for _ in range(launches):
        ov = cuda.to_device(np.full((2, k), np.nan, np.float32))
        oi = cuda.to_device(np.full((2, k), -7, np.int32))
        lz = cuda.to_device(np.full(2, np.nan))
        am = cuda.to_device(np.full(2, -7, np.int32))
        topk_logsumexp_cuda(d, k, ov, oi, lz, am, scratch=scratch)
        rv, ri = topk_ref(x, k)
        np.testing.assert_array_equal(oi.copy_to_host(), ri)
        np.testing.assert_array_equal(ov.copy_to_host(), rv)
        np.testing.assert_array_equal(am.copy_to_host(), argmax_ref(x))
        got, want = lz.copy_to_host(), logsumexp_ref(x)
        assert np.isnan(got[1]) and np.isnan(want[1])
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)
    # without the NaN: the -inf chunks add nothing to the sum
    x[1, vocab - 1] = 1.0
    topk_logsumexp_cuda(cuda.to_device(x), k, ov, oi, lz, am, scratch=scratch)
    np.testing.assert_allclose(lz.copy_to_host(), logsumexp_ref(x), rtol=0, atol=1e-5)


def test_topk_logsumexp_chain_stops_on_the_device():
    """A draft's chain on the device (scratch's last buffer): each launch adds the row's
    top-1 log-probability exactly as the host sums it (float64(value) - lz, in order: the
    draft loop trusts the device's word), sets the stop where the sum falls below the
    cut-off, and a stopped row's later launches leave its outputs and chain alone while
    the other row goes on."""
    from luce.kernels.sampling import CHAIN_CUT, CHAIN_LOGP, CHAIN_STOPPED, chain_state, topk_logsumexp_cuda, \
        topk_lse_scratch
    vocab, k = 600, 3
    x = (2 * rng.standard_normal((2, vocab))).astype(np.float32)
    d, scratch = cuda.to_device(x), topk_lse_scratch(2, vocab, k)
    assert not scratch[4].copy_to_host()[:, CHAIN_STOPPED].any()  # made never to stop
    lp0 = float(np.sort(x[0])[-1]) - float(np.log(np.exp(x[0].astype(np.float64)).sum()))
    ch = chain_state(2)
    ch[0, CHAIN_CUT] = 1.5 * lp0  # row 0: above it after one launch, below after two
    scratch[4].copy_to_device(ch)
    sums = np.zeros(2)
    for launch in range(3):
        ov = cuda.to_device(np.full((2, k), np.nan, np.float32))
        oi = cuda.to_device(np.full((2, k), -7, np.int32))
        lz = cuda.to_device(np.full(2, np.nan))
        am = cuda.to_device(np.full(2, -7, np.int32))
        topk_logsumexp_cuda(d, k, ov, oi, lz, am, scratch=scratch)
        v, z, chain = ov.copy_to_host(), lz.copy_to_host(), scratch[4].copy_to_host()
        for r in range(2):
            if r == 0 and launch == 2:  # stopped by the launch before
                assert np.isnan(v[0]).all() and np.isnan(z[0]) and am.copy_to_host()[0] == -7
                continue
            sums[r] += float(np.float64(v[r, 0]) - float(z[r]))  # PendingTopK's log-probability
        np.testing.assert_array_equal(chain[:, CHAIN_LOGP], sums)
        assert chain[0, CHAIN_STOPPED] == (launch >= 1) and chain[1, CHAIN_STOPPED] == 0
        assert not np.isnan(v[1]).any()


def test_logsumexp_after_topk():
    from luce.engine.sampling import top_logprobs
    x = (4 * rng.standard_normal((3, 1300))).astype(np.float32)
    x[1] -= 80.0  # far below 0: exp(x) alone would underflow to a zero sum
    ov, oi = topk_cuda(cuda.to_device(x), 4)
    out = cuda.to_device(np.full(3, np.nan, np.float64))
    logsumexp_cuda(cuda.to_device(x), ov, out)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, logsumexp_ref(x), rtol=0, atol=1e-6)  # float32 exps
    # what the draft's host path takes: the same log-probabilities of the same candidates
    for r in range(3):
        ids, lp = top_logprobs(x[r], 4)
        np.testing.assert_array_equal(oi.copy_to_host()[r], ids)
        np.testing.assert_allclose(ov.copy_to_host()[r] - got[r], lp, rtol=0, atol=1e-6)


DRAW_CASES = [(0.8, 40, 0.95, 0.05), (1.5, 64, 1.0, 0.0), (0.3, 5, 0.5, 0.0), (1.0, 1, 1.0, 0.0),
              (2.0, 20, 0.9, 0.2)]


@pytest.mark.parametrize("vocab,run", [(1200, 8), (300, 64)])
def test_sample_draws_the_reference_token(vocab, run):
    """Runs of 8 over 1,200 logits: 150 run maxima, more than SAMPLE_MAX_RUNS, so the
    floor's radix search runs; 300 logits in runs of 64: every run a candidate. The second
    row has many equal logits (order: the smaller id first)."""
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((2, vocab)) * 3).astype(np.float32)
    logits[1] = np.round(logits[1])
    d = cuda.to_device(logits)
    out = cuda.to_device(np.full(1, -7, np.int32))
    picks = set()
    for row in range(2):
        for case in DRAW_CASES:
            sp = sample_params(*case, u=rng.random())
            sample_cuda(d, cuda.to_device(sp), out, row=row, run=run)
            got = int(out.copy_to_host()[0])
            assert got == sample_ref(logits[row], sp), (row, case)
            picks.add(got)
    assert len(picks) > 5  # the draws depend on u and the parameters, not one fixed token


def test_sample_ref_is_the_engine_sampler():
    """sample_ref (a sort of the whole row) draws what the host sampler (kept: no sort;
    Generator.choice) draws for the same generator state, which is what lets the device
    draw take the host's uniforms."""
    from luce.engine.sampling import Sampler, SamplingParams
    rng = np.random.default_rng(3)
    for seed in range(40):
        logits = (rng.standard_normal(20_000) * rng.uniform(0.5, 4)).astype(np.float32)
        t, k, p, m = DRAW_CASES[seed % len(DRAW_CASES)]
        s = Sampler(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed))
        u = np.random.default_rng(seed).random()
        assert s.sample(logits, []) == sample_ref(logits, sample_params(t, k, p, m, u)), seed


@pytest.mark.parametrize("window", [4, 0])
def test_sample_with_penalties_draws_and_keeps_the_history(window):
    """Repeat, presence and frequency penalties over a history the draw itself extends:
    each token is the reference's over the penalties of the history so far, and after
    each draw the device's counts are those of the history with it (window 4: the ring
    wraps, tokens leave the repeat window; 0: the whole history)."""
    rng = np.random.default_rng(11 + window)
    vocab = 300
    logits = (rng.standard_normal((1, vocab)) * 1.5).astype(np.float32)
    logits[0, :6] += 4.0  # a few likely tokens, so that the history repeats and penalties bite
    history = list(rng.integers(0, 6, 7))
    pen, ring = penalty_state(history, vocab, window)
    state = cuda.to_device(pen), cuda.to_device(ring)
    d = cuda.to_device(logits)
    out = cuda.to_device(np.full(1, -7, np.int32))
    for step in range(6):
        sp = sample_params(1.0, 20, 0.98, 0.0, rng.random(), repeat_penalty=1.6, presence_penalty=0.4,
                           frequency_penalty=0.3)
        want = sample_ref(logits[0], sp, penalty_state(history, vocab, window)[0])
        sample_cuda(d, cuda.to_device(sp), out, run=64, state=state)
        got = int(out.copy_to_host()[0])
        assert got == want, step
        history.append(got)
        np.testing.assert_array_equal(state[0].copy_to_host(), penalty_state(history, vocab, window)[0])
    assert len(set(history[7:])) > 1


def test_sample_applies_only_where_top_k_bounds_the_kept_set():
    assert sample_applies(0.8, 40, 151_936)
    assert not sample_applies(0.0, 40, 151_936)  # greedy: the argmax kernel
    assert not sample_applies(0.8, 0, 151_936)  # no top-k: the whole row's normalizer
    assert not sample_applies(0.8, MAX_TOP_K + 1, 151_936)
    assert not sample_applies(0.8, 40, 40)
    assert not sample_applies(0.8, 40, 151_936, repeat_last_n=MAX_REPEAT_WINDOW + 1)
