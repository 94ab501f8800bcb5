"""Greedy speculative decoding on SmolLM2-135M is token-for-token the plain greedy output,
with a perfect draft (the model itself), a random-weight draft whose guesses are almost
all wrong, and prompt lookup, under chain and DDTree verification."""
from __future__ import annotations

import numpy as np
import pytest

import luce.spec as spec
from luce.spec import DraftModel, PromptLookup, SpecOptions

N_CTX = 256
MAX_TOKENS = 16
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def random_draft_path(tmp_path_factory, smollm2_path):
    import gguf

    from luce.bench.synthetic import tiny, write_gguf
    path = tmp_path_factory.mktemp("draft") / "random-draft.gguf"
    return write_gguf(path, tiny("llama", 49152), types=lambda name: gguf.GGMLQuantizationType.F32, seed=3,
                      tokenizer_from=smollm2_path)


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return smollm2.tokenize(PROMPT)


@pytest.fixture(scope="module")
def plain(smollm2, prompt_ids):
    return _run(smollm2, prompt_ids, SpecOptions(), None)[0]


def _run(model, ids, opts, drafter, **params):
    out, stats = [], None
    for d in spec.stream(model, ids, opts, drafter, session=model.new_session(N_CTX), temperature=0,
                         max_tokens=MAX_TOKENS, **params):
        out += d.token_ids
        stats = d.stats or stats
    return out, stats


def test_plain_output_is_long_enough(plain):
    assert len(plain) == MAX_TOKENS  # otherwise the comparisons below prove little


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_perfect_draft(smollm2, prompt_ids, plain, mode):
    out, stats = _run(smollm2, prompt_ids, SpecOptions(mode=mode, draft_max=6), DraftModel(smollm2, n_ctx=N_CTX))
    assert out == plain
    # a draft identical to the target is accepted all the way: 1 + draft_max per forward
    assert stats.acceptance_length > 4
    assert stats.draft_s > 0 and stats.verify_s > 0


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_draft_queued_ahead(smollm2, prompt_ids, plain, mode):
    """--draft-ahead: the next draft guessed beside each verification; a perfect draft's
    guesses hold, and the output is still the plain one."""
    d = DraftModel(smollm2, n_ctx=N_CTX)
    out, stats = _run(smollm2, prompt_ids, SpecOptions(mode=mode, draft_max=4, draft_p_min=0.0, draft_ahead=3), d)
    assert out == plain
    assert d.ahead_tries >= 2 and d.ahead_hits >= 1 and stats.acceptance_length > 3


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_draft_p_min(smollm2, prompt_ids, plain, mode):
    """--draft-p-min: drafts end where the draft's chain gets unlikely (the position that
    crosses the line still proposed), and the output is still the plain one."""
    import math
    d = DraftModel(smollm2, n_ctx=N_CTX, p_min=0.5)
    full = DraftModel(smollm2, n_ctx=N_CTX).propose(prompt_ids, 8)
    cut = d.propose(prompt_ids, 8)
    chain = np.cumsum(full.topk_logp[:, 0])
    stop = next((i for i, c in enumerate(chain) if c < math.log(0.5)), len(chain) - 1)
    assert cut.tokens == full.tokens[:stop + 1]
    assert stop < 7, "the prompt should hold an unsure position within 8 tokens"
    out, stats = _run(smollm2, prompt_ids, SpecOptions(mode=mode, draft_max=6), DraftModel(smollm2, n_ctx=N_CTX,
                                                                                           p_min=0.5))
    assert out == plain
    assert stats.acceptance_length > 1


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_random_draft(smollm2, prompt_ids, plain, random_draft_path, mode):
    import luce
    draft = luce.load(random_draft_path, backend="cpu", n_ctx=N_CTX)
    out, stats = _run(smollm2, prompt_ids, SpecOptions(mode=mode, draft_max=4, ddtree_budget=8),
                      DraftModel(draft, n_ctx=N_CTX))
    assert out == plain
    assert stats.target_forwards >= MAX_TOKENS - 2  # wrong guesses cost nothing but time


@pytest.mark.parametrize("mode", ["lookup", "ddtree"])
def test_prompt_lookup(smollm2, prompt_ids, plain, mode):
    out, stats = _run(smollm2, prompt_ids, SpecOptions(mode=mode, draft_max=6), PromptLookup())
    assert out == plain
    assert stats.target_forwards <= MAX_TOKENS


def test_repeat_penalty_greedy(smollm2, prompt_ids):
    # penalties make the greedy choice depend on each node's own path
    base, _ = _run(smollm2, prompt_ids, SpecOptions(), None, repeat_penalty=1.3)
    out, _ = _run(smollm2, prompt_ids, SpecOptions(mode="ddtree", draft_max=4), PromptLookup(), repeat_penalty=1.3)
    assert out == base


def test_tree_commit_matches_sequential_decode(smollm2, prompt_ids):
    """Verify a branching tree, commit a path that skips rows, then decode: the logits
    match a cache that decoded the same path token by token."""
    from luce.spec.ddtree import Tree
    m = smollm2
    ref = m.new_session(N_CTX)
    logits, _ = ref.prefill(prompt_ids)
    path = []
    for _ in range(3):
        path.append(int(np.argmax(logits)))
        logits = ref.decode(path[-1])
    ref_next = ref.decode(7)

    s = m.new_session(N_CTX)
    s.prefill(prompt_ids)
    # root = path[0]; the accepted path goes through nodes 1 and 4, decoys elsewhere
    tree = Tree(tokens=np.array([11, path[1], 13, 14, path[2]]), parents=np.array([-1, -1, 0, 1, 1]),
                depth=np.array([1, 1, 2, 2, 2]))
    tokens, positions, mask = tree.forward_inputs(path[0], s.cache.n_past)
    tree_logits = m.forward(s.cache, tokens, positions, mask=mask)
    np.testing.assert_allclose(tree_logits[5], logits, rtol=1e-3, atol=1e-3)
    s.cache.commit([0, 2, 5])
    s.tokens += path
    got = s.decode(7)
    np.testing.assert_allclose(got, ref_next, rtol=1e-3, atol=1e-3)


def test_auto_draft_without_a_declared_model_falls_back_to_lookup(smollm2):
    from luce.spec import make_drafter
    assert isinstance(make_drafter(smollm2, SpecOptions(mode="ddtree", draft="auto")), PromptLookup)


def test_cli_generate_spec_flags(smollm2_path):
    from click.testing import CliRunner

    from luce.cli import main
    args = ["generate", str(smollm2_path), "def add(a, b):", "--backend", "cpu", "-n", "8", "--temp", "0"]
    plain = CliRunner().invoke(main, args)
    assert plain.exit_code == 0, plain.output
    r = CliRunner().invoke(main, args + ["--spec", "lookup", "--draft-max", "4"])
    assert r.exit_code == 0, r.output
    assert "acceptance length" in r.stderr
    assert r.stdout == plain.stdout


def test_stepper_factory_for_the_engine(smollm2, prompt_ids, plain):
    # the server engine builds a stepper per request from (session, params)
    factory = spec.stepper_factory(smollm2, SpecOptions(mode="lookup"))
    assert spec.stepper_factory(smollm2, SpecOptions()) is None
    session = smollm2.new_session(N_CTX)
    stepper = factory(session, smollm2.sampling_params(temperature=0, max_tokens=MAX_TOKENS))
    out = [t for d in smollm2.stream(prompt_ids, session=session, stepper=stepper, temperature=0,
                                     max_tokens=MAX_TOKENS) for t in d.token_ids]
    assert out == plain
    assert stepper.counters.steps > 0 and stepper.counters.acceptance_length >= 1


def test_bench_run_on_the_prompt_set(smollm2, tmp_path):
    import json

    from luce.bench.spec import load_prompts, run, summary
    rows = load_prompts()
    assert {r["category"] for r in rows} == {"code", "math", "chat", "edit"} and len(rows) >= 13
    out = tmp_path / "spec.jsonl"
    results = run(smollm2, None, modes=("lookup", "off"), categories=("code",), limit=1, max_tokens=6,
                  n_ctx=N_CTX, out=out, echo=lambda s: None)
    assert [r.mode for r in results] == ["off", "lookup"]
    assert results[1].matches_plain is True and results[0].matches_plain is None
    assert len(out.read_text().splitlines()) == 2 and json.loads(out.read_text().splitlines()[1])["tokens"]
    assert "| lookup | code |" in summary(results)


def test_bench_summary_per_forward_costs():
    from luce.bench.spec import Result, summary
    rs = [Result("ddtree", "a", "code", 10, 30, 6, 1.5, 0.012, 0.030, True),
          Result("ddtree", "b", "code", 10, 10, 4, 0.5, 0.008, 0.020, False)]
    row = next(line for line in summary(rs).splitlines() if line.startswith("| ddtree | code |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 40 tokens over 10 forwards in 2 s; 20 ms of drafting and 50 of verifying over 10 forwards
    assert cells[2:] == ["2", "40", "10", "4.00", "20.00", "0.0", "0.1", "2.00", "5.00", "-", "1/2", "-"]
    # a config with the next draft queued ahead: how many of its guesses the next draft used
    rs = [Result("ddtree", "a", "code", 10, 30, 6, 1.5, 0.012, 0.030, True, 6, "ddtree+ahead7", None, 7, 5, 3),
          Result("ddtree", "b", "code", 10, 10, 4, 0.5, 0.008, 0.020, True, 6, "ddtree+ahead7", None, 7, 3, 0)]
    row = next(line for line in summary(rs).splitlines() if line.startswith("| ddtree+ahead7 | code |"))
    assert [c.strip() for c in row.strip("|").split("|")][-2:] == ["2/2", "3/8"]


def test_cost_line_and_policy_projection():
    """A target forward's time as a line in the draft forwards it took, fitted over a run's
    DDTree depths, projects a drafting policy's acceptance and draft forwards to tok/s."""
    from luce.bench.spec import Result, cost_line, policy_projection

    def res(depth, ms, forwards=10, **kw):  # depth D: D draft forwards a target forward
        return Result("ddtree", "a", "code", 10, forwards, forwards, forwards * ms / 1e3, 0.0, 0.0, True, depth,
                      f"ddtree@{depth}", draft_forwards=depth * forwards, **kw)
    # 6.5 ms + 1 ms a draft forward; a queued-ahead config and a chain stay out of the fit
    rs = [res(4, 10.5), res(8, 14.5), res(6, 30.0, draft_ahead=7),
          Result("off", "a", "code", 10, 31, 31, 0.1, 0.0, 0.0, None)]
    fixed, slope = cost_line(rs)
    assert abs(fixed - 6.5) < 1e-9 and abs(slope - 1.0) < 1e-9
    assert cost_line(rs[:1]) is None  # one depth: no line
    table = policy_projection(rs, {"p-min 0.2": {("ddtree", "code"): (7.0, 7.5)}})
    row = next(line for line in table.splitlines() if line.startswith("| p-min 0.2 |"))
    # 7 tokens in 6.5 + 7.5 = 14 ms: 500 tok/s against plain 310 (31 tokens in 0.1 s)
    assert [c.strip() for c in row.strip("|").split("|")][2:] == ["7.00", "7.50", "14.00", "500.0", "310.0", "1.61x"]


def test_draft_seeded_by_lookup(smollm2, prompt_ids, plain):
    """A draft model whose chain prompt lookup guesses (DraftModel.lookup): the catch-up
    forward carries the guess, and the draft tokens it confirms take no forward of their own.
    The same draft as without the guess (to float rounding), and the output stays plain's."""
    d = DraftModel(smollm2, n_ctx=N_CTX, lookup=PromptLookup())
    assert _run(smollm2, prompt_ids, SpecOptions(mode="ddtree", draft_max=6), d)[0] == plain
    text = ("def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
            "        if a[i] <= b[j]:\n            out.append(a[i])\n")
    ids = smollm2.tokenize(text + "\n\n" + text[:40], add_special=False)  # the model goes on copying
    seeded, unseeded = DraftModel(smollm2, n_ctx=N_CTX, lookup=PromptLookup()), DraftModel(smollm2, n_ctx=N_CTX)
    first = unseeded.propose(ids, 8)
    assert seeded.propose(ids, 8).tokens == first.tokens  # a whole prompt's catch-up: not seeded
    ctx = ids + first.tokens[:3]
    f0, f1 = seeded.forwards, unseeded.forwards
    a, b = seeded.propose(ctx, 8), unseeded.propose(ctx, 8)
    # where the draft confirms the guess past the 8 asked for, it goes on (up to seed_max)
    assert a.tokens[:8] == b.tokens and 8 <= len(a.tokens) <= seeded.seed_max
    np.testing.assert_array_equal(a.topk_ids[:8], b.topk_ids)
    np.testing.assert_allclose(a.topk_logp[:8], b.topk_logp, rtol=0, atol=1e-3)
    assert unseeded.forwards - f1 == 8 and seeded.forwards - f0 < 8
    assert seeded.seeded == len(a.tokens) - (seeded.forwards - f0)  # the rest took a forward each
    assert unseeded.session.tokens == ctx + b.tokens[:-1] and seeded.session.tokens == ctx + a.tokens[:-1]
    assert seeded.session.cache.n_past == len(ctx) + len(a.tokens) - 1
