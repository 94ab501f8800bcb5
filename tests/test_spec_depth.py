"""--draft-max auto: the depth controller's choices from costs and acceptance (no model),
and a greedy run with it on SmolLM2 that is still the plain output."""
from __future__ import annotations

import numpy as np
import pytest

from luce.spec.depth import DepthController, kept_tokens


def test_kept_tokens_is_the_geometric_mean_length():
    # by summation: 1 + alpha + ... + alpha^D
    for a in (0.0, 0.5, 0.9):
        for d in (1, 4, 10):
            assert kept_tokens(a, d) == pytest.approx(sum(a ** i for i in range(d + 1)))
    assert kept_tokens(1.0, 6) == 7.0


def _feed(ctl, alpha, step_s, fixed_s, steps=200, seed=0):
    """Steps of a draft whose tokens the target keeps with probability alpha each."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        d = ctl.depth()
        kept = 0
        while kept < d and rng.random() < alpha:
            kept += 1
        ctl.update(d, kept, d * step_s, fixed_s)
    return ctl.depth()


def test_depth_follows_the_cost_of_a_target_forward():
    # verification and the rest of a step at 3, ~7 (the 8B shape on an H100) and ~23 draft
    # steps (the 32B); under the model at alpha 0.9 the best depths are 4-5, 8 and past 11
    cheap = _feed(DepthController(hi=11), 0.9, 1.0, 3.0)
    mid = _feed(DepthController(hi=11), 0.9, 1.0, 6.9)
    large = _feed(DepthController(hi=11), 0.9, 1.0, 23.0)
    assert 3 <= cheap <= 6 and 7 <= mid <= 10 and large == 11
    assert cheap < mid < large
    # what the estimate converged to: close to the process's alpha
    ctl = DepthController(hi=11)
    _feed(ctl, 0.9, 1.0, 6.9, steps=400)
    assert abs(ctl.alpha - 0.9) < 0.05


def test_a_useless_draft_drafts_the_least():
    assert _feed(DepthController(lo=2, hi=12), 0.05, 1.0, 6.9) == 2
    # a draft the target always agrees with drafts the most: no step ever ends on a miss
    assert _feed(DepthController(lo=2, hi=12), 1.0, 1.0, 6.9) == 12


def test_start_until_warm_and_steps_without_a_draft():
    ctl = DepthController(lo=2, hi=12, start=8, warmup=3)
    ctl.update(0, 0, 0.0, 5.0)  # nothing drafted: no evidence
    assert ctl.steps == 0 and ctl.depth() == 8
    for _ in range(2):
        ctl.update(8, 0, 8.0, 6.9)
    assert ctl.depth() == 8  # two steps: still warming up
    ctl.update(8, 0, 8.0, 6.9)
    assert ctl.depth() == 2  # three misses at the first token
    with pytest.raises(ValueError):
        DepthController(lo=5, hi=4)


def test_options_parse_auto():
    from luce.errors import LuceError
    from luce.spec import SpecOptions
    from luce.spec.options import DEFAULT_DRAFT_MAX, DEFAULT_P_MIN, DRAFT_MAX_AUTO, parse_draft_max
    assert parse_draft_max("auto") == parse_draft_max("AUTO") == DRAFT_MAX_AUTO
    assert parse_draft_max("6") == 6 and parse_draft_max(None) == DEFAULT_DRAFT_MAX
    # p-min: the default when not given, an explicit 0 kept (no cut-off)
    assert SpecOptions.from_cli("ddtree", None).draft_p_min == DEFAULT_P_MIN > 0
    assert SpecOptions.from_cli("ddtree", None, None, None, 0.0).draft_p_min == 0.0
    # a draft queued ahead only without a cut-off (which reads each step before queuing more)
    assert SpecOptions.from_cli("ddtree", None, None, None, 0.0, 3).draft_ahead == 3
    with pytest.raises(LuceError, match="--draft-ahead needs --draft-p-min 0"):
        SpecOptions.from_cli("ddtree", None, None, None, None, 3)
    with pytest.raises(LuceError, match="--draft-ahead must be >= 0"):
        SpecOptions.from_cli("ddtree", None, None, None, 0.0, -1)
    for bad in ("0", "-2", "deep"):
        with pytest.raises(LuceError, match="--draft-max"):
            parse_draft_max(bad)
    o = SpecOptions.from_cli("ddtree", None, None, "auto")
    assert o.draft_max == DRAFT_MAX_AUTO and o.draft_max_label == "auto"
    assert SpecOptions.from_cli("ddtree", None, None, 5).draft_max_label == 5


def test_auto_depth_is_lossless_and_moves(smollm2):
    """With the model as its own draft every drafted token is kept, so the controller goes
    to its deepest; the output is the plain greedy one."""
    import luce.spec as spec
    from luce.spec import DraftModel, SpecOptions
    ids = smollm2.tokenize("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")

    def run(opts, drafter, depth=None):
        session = smollm2.new_session(256)
        params = smollm2.sampling_params(temperature=0, max_tokens=32)
        stepper = spec.make_stepper(session, params, opts, drafter, depth) if opts.enabled else None
        out = [t for d in smollm2.stream(ids, session=session, stepper=stepper, temperature=0, max_tokens=32)
               for t in d.token_ids]
        return out, stepper

    plain, _ = run(SpecOptions(), None)
    opts = SpecOptions(mode="ddtree", draft_max=0)
    # the stepper's own controller is auto_depth's (warm after 4 steps); a shorter warm-up
    # here keeps the run short
    auto = spec.auto_depth("ddtree", opts.ddtree_budget)
    # up to half DDTree's budget of 22, from the default depth (12) clamped to that
    assert (auto.lo, auto.hi, auto.start) == (2, 11, 11)
    ctl = DepthController(lo=2, hi=11, start=8, warmup=2)
    out, stepper = run(opts, DraftModel(smollm2, n_ctx=256), ctl)
    assert out == plain
    assert stepper.depth is ctl and ctl.steps >= 3
    assert ctl.misses == 0 and ctl.depth() == 11  # every drafted token kept: deeper than the start
    assert spec.auto_depth("chain", 22).hi == 12 and spec.auto_depth("ddtree", 3).hi == 2
