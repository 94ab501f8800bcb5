"""Speculative decoding: drafters (a same-tokenizer draft model, prompt lookup), chain
and DDTree tree verification, lossless greedy and sampled acceptance.

    model = luce.load(target)
    opts = SpecOptions(mode="ddtree", draft="auto")
    drafter = make_drafter(model, opts)
    for delta in luce.spec.stream(model, "def quicksort(", opts, drafter, temperature=0): ...
"""
from __future__ import annotations

from typing import Iterator

from .ddtree import Tree, build_tree, chain_tree
from .drafters import Draft, DraftModel, PromptLookup
from .options import SPEC_MODES, SpecOptions, make_drafter, spec_options
from .stepper import SpecCounters, SpeculativeStepper, auto_depth
from .verify import Verdict, verify

__all__ = ["Tree", "build_tree", "chain_tree", "Draft", "DraftModel", "PromptLookup", "SPEC_MODES",
           "SpecOptions", "make_drafter", "spec_options", "SpecCounters", "SpeculativeStepper", "Verdict",
           "verify", "make_stepper", "stepper_factory", "stream"]


def make_stepper(session, params, opts: SpecOptions, drafter, depth=None):
    """A SpeculativeStepper for one generation on `session` with SamplingParams `params`
    (None when opts is off); depth: a DepthController shared across generations (draft
    max auto: what the earlier ones learned carries over)."""
    from ..engine.sampling import Sampler
    if not opts.enabled:
        return None
    return SpeculativeStepper(session, Sampler(params), drafter, method=opts.method,
                              draft_max=opts.draft_max, budget=opts.ddtree_budget, depth=depth, ahead=opts.draft_ahead)


def stepper_factory(model, opts: SpecOptions, drafter=None):
    """`(session, params) -> stepper` for the server engine's stepper_factory; None when
    opts is off. One drafter serves every request (the draft model re-syncs its cache
    to each request's context), so requests must not run concurrently on it. Each
    stepper's `counters` hold its draft_s, verify_s and acceptance length."""
    if not opts.enabled:
        return None
    drafter = drafter or make_drafter(model, opts)
    depth = auto_depth(opts.method, opts.ddtree_budget) if opts.draft_max == 0 else None
    return lambda session, params: make_stepper(session, params, opts, drafter, depth)


def stream(model, prompt, opts: SpecOptions, drafter=None, session=None, **params) -> Iterator:
    """Model.stream with speculative decoding. The last Delta's stats carry draft_s and
    verify_s; its target_forwards already counts one per step."""
    from ..engine.generator import generate
    ids = model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    session = session or model.session
    sp = model.sampling_params(**params)
    if opts.enabled and drafter is None:
        drafter = make_drafter(model, opts)
    stepper = make_stepper(session, sp, opts, drafter)
    for d in generate(session, ids, sp, stepper=stepper):
        if d.stats is not None and stepper is not None:
            d.stats.draft_s = stepper.counters.draft_s
            d.stats.verify_s = stepper.counters.verify_s
            d.stats.spec_phases = dict(stepper.counters.phases)
        yield d
