"""Speculative decoding on the CUDA backend is lossless: SmolLM2's greedy output with a
perfect draft (the model itself, so whole trees are accepted and KV rows compacted every
step) and with prompt lookup, under chain and DDTree verification (graph-replayed tree
widths), equals its plain greedy output token for token."""
import pytest

pytestmark = pytest.mark.gpu

N_CTX = 512
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def gpu_model(smollm2_path):
    import luce
    return luce.load(smollm2_path, backend="cuda", n_ctx=N_CTX)


def _run(model, opts, drafter):
    import luce.spec as spec
    ids = model.tokenize(PROMPT)
    out, stats = [], None
    for d in spec.stream(model, ids, opts, drafter, session=model.new_session(N_CTX), temperature=0, max_tokens=48,
                         ignore_eos=True):
        out += d.token_ids
        stats = d.stats or stats
    return out, stats


@pytest.mark.parametrize("mode,drafter", [("chain", "self"), ("ddtree", "self"), ("ddtree", "lookup"),
                                          ("lookup", "lookup")])
def test_spec_lossless_on_cuda(gpu_model, mode, drafter):
    from luce.spec import DraftModel, PromptLookup, SpecOptions
    plain, _ = _run(gpu_model, SpecOptions(), None)
    assert len(plain) == 48
    d = DraftModel(gpu_model, n_ctx=N_CTX) if drafter == "self" else PromptLookup()
    out, stats = _run(gpu_model, SpecOptions(mode=mode, draft_max=6), d)
    assert out == plain
    if drafter == "self":
        assert stats.acceptance_length > 4


# A random-weight Q4_K_M qwen3 (Q4_K and Q6_K matrices, head dim 128): the types a real
# Q4_K_M model takes through the GPU's kernels (decode: matvec_fast and the one-query
# attention kernel; verification: matvec_mma and the tensor-core attention), where
# SmolLM2 (Q4_1 / Q8_0) takes other paths. A random model's greedy choices are close
# calls far more often than a trained model's, so any disagreement between the decode
# and the verification forwards shows up as a different token.
@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    import luce
    from luce.bench.synthetic import tiny, write_gguf
    shape = tiny("qwen3", 4096, n_layers=4, n_embd=1024, n_ff=2048, n_heads=8, n_kv_heads=2, head_dim=128)
    path = write_gguf(tmp_path_factory.mktemp("q4km") / "q4km.gguf", shape, seed=11)
    return luce.load(path, backend="cuda", n_ctx=N_CTX)


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_spec_lossless_on_cuda_q4_k_m(q4k_model, mode):
    import numpy as np
    import luce.spec as spec
    from luce.spec import DraftModel, SpecOptions
    rng = np.random.default_rng(3)
    diverged = []
    for p in range(4):
        prompt = [int(t) for t in rng.integers(0, 4000, 20 + 7 * p)]

        def run(opts, drafter):
            out = []
            for d in spec.stream(q4k_model, prompt, opts, drafter, session=q4k_model.new_session(N_CTX),
                                 temperature=0, max_tokens=64, ignore_eos=True):
                out += d.token_ids
            return out
        plain = run(SpecOptions(), None)
        got = run(SpecOptions(mode=mode, draft_max=6), DraftModel(q4k_model, n_ctx=N_CTX))
        if got != plain:
            diverged.append((p, next(i for i, (a, b) in enumerate(zip(got, plain)) if a != b)))
    assert not diverged, f"prompts (index, first differing token) that left plain greedy: {diverged}"


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_sampled_spec_on_cuda_q4_k_m(q4k_model, mode):
    """Sampled speculative decoding on the GPU (verification rows fetched on demand, the
    drafter and the accept/reject walk over the distribution's support): with the target as
    its own draft, a chain's drafted tokens are drawn from (within the GPU's arithmetic) the
    distributions verification accepts them by, so nearly all are accepted; a seed gives
    the same tokens twice; every token is in the vocabulary."""
    import numpy as np
    import luce.spec as spec
    from luce.spec import DraftModel, SpecOptions
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 4000, 24)]

    def run():
        out, stats = [], None
        for d in spec.stream(q4k_model, prompt, SpecOptions(mode=mode, draft_max=6), DraftModel(q4k_model, n_ctx=N_CTX),
                             session=q4k_model.new_session(N_CTX), temperature=0.8, top_k=40, seed=7, max_tokens=64,
                             ignore_eos=True):
            out += d.token_ids
            stats = d.stats or stats
        return out, stats
    a, stats = run()
    b, _ = run()
    assert len(a) == 64 and a == b
    assert all(0 <= t < 4096 for t in a)
    assert stats.acceptance_length >= 1
    if mode == "chain":
        assert stats.acceptance_length > 5, stats.acceptance_length


def test_draft_on_device_matches_the_host_draft(q4k_model):
    """forward_topk on the GPU (top-k and log-sum-exp inside the graph, steps queued back to
    back) proposes what the host loop over full logits rows proposes, for more steps than
    its readback slots."""
    import numpy as np
    from luce.spec import DraftModel
    ids = q4k_model.tokenize(PROMPT)
    host = DraftModel(q4k_model, n_ctx=N_CTX, on_device=False)
    dev = DraftModel(q4k_model, n_ctx=N_CTX)
    assert dev.on_device
    # the prompt (prefilled, then its last token), one new token after an accepted path,
    # then three the draft never saw (one catch-up forward over them)
    for n, more in ((12, None), (5, [11, 12, 13]), (6, None)):
        a, b = host.propose(ids, n), dev.propose(ids, n)
        assert b.tokens == a.tokens
        np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
        np.testing.assert_allclose(b.topk_logp, a.topk_logp, rtol=0, atol=1e-4)
        assert dev.session.tokens == host.session.tokens == ids + a.tokens[:-1]
        ids = ids + (more or a.tokens[:3] + [7])


def test_draft_cut_off_taken_on_the_device(q4k_model):
    """A draft with a p_min cut-off whose steps go through the persistent kernel: the device
    takes the stop (every step queued at once, those past it doing nothing), and the draft,
    the rows kept and the forwards run are the host loop's."""
    import math

    import numpy as np
    from luce.spec import DraftModel
    ids = q4k_model.tokenize(PROMPT)
    host = DraftModel(q4k_model, n_ctx=N_CTX, on_device=False)
    dev = DraftModel(q4k_model, n_ctx=N_CTX)
    full = host.propose(ids, 12)
    # a fresh prefill on both sides: a warm host session would recompute the prompt's last
    # token in a one-token forward (matvec_fast over int8 x) where the device's prefill piece
    # takes the tensor-core products: logits ~0.5% apart at the tail (H100, 1c20b3b)
    host.reset()
    chain = np.cumsum(full.topk_logp[:, 0])
    host.log_p_min = dev.log_p_min = math.log(float(np.exp((chain[3] + chain[4]) / 2)))  # stops at the 5th
    assert dev.session.begin_chain(min(dev.top_k, q4k_model.config.vocab_size), -math.inf)  # the persistent kernel's
    stops = 0
    for _ in range(4):
        f_host, f_dev = host.forwards, dev.forwards
        a, b = host.propose(ids, 12), dev.propose(ids, 12)
        assert b.tokens == a.tokens
        np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
        np.testing.assert_allclose(b.topk_logp, a.topk_logp, rtol=0, atol=1e-4)
        assert dev.session.tokens == host.session.tokens == ids + a.tokens[:-1]
        assert dev.forwards - f_dev == host.forwards - f_host
        stops += len(a.tokens) < 12
        ids = ids + a.tokens[:3] + [7]
    assert stops


def test_draft_seeded_on_the_device(q4k_model):
    """A lookup guess carried by the device's catch-up forward (every row's candidates, padded
    to the seed width): where it is the draft's own chain the draft comes from that forward,
    where it leaves it the one-token steps go on; the host loop's draft either way."""
    import numpy as np
    from luce.spec import DraftModel
    from luce.spec.drafters import Draft
    ids = q4k_model.tokenize(PROMPT)
    host = DraftModel(q4k_model, n_ctx=N_CTX, on_device=False)
    dev = DraftModel(q4k_model, n_ctx=N_CTX)
    full = host.propose(ids, 6)
    host.reset()
    assert dev.propose(ids, 6).tokens == full.tokens  # the prompt: too long a catch-up to seed
    ctx = ids + full.tokens[:2] + [7]
    full = host.propose(ctx, 6)
    for guess, forwards in ((full.tokens[:5], 1), (full.tokens[:2] + [(full.tokens[2] + 1) % 4096], 4)):
        dev.lookup = type("Guess", (), {"propose": lambda self, c, m, g=guess: Draft(g[:m], None, None)})()
        before = dev.forwards
        b = dev.propose(ctx, 6)
        assert b.tokens == full.tokens and dev.forwards - before == forwards
        np.testing.assert_array_equal(b.topk_ids, full.topk_ids)
        # the wide forward's tensor-core products against one-token steps: logits ~0.5% apart
        # at the tail (see test_draft_cut_off_taken_on_the_device)
        np.testing.assert_allclose(b.topk_logp, full.topk_logp, rtol=1e-2, atol=1e-3)
        assert dev.session.tokens == ctx + full.tokens[:-1] and dev.session.cache.n_past == len(ctx) + 5
