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
