"""SpeculativeStepper: the generator's stepper interface, one target forward per step.

A step takes the target's next token t0 (sampled from the logits it was handed, or the
replacement token a rejection drew last step), asks the drafter for a continuation of
history + [t0], and verifies t0 plus the draft (a chain, or a DDTree tree) in a single
target forward: t0 at position n_past, each node at n_past + depth, each attending to
the committed context and its own ancestors. It returns t0 and the accepted path; the
target's logits after the last accepted node come from that same forward, so `advance`
commits the path's K/V rows (compacted to their final positions) without computing
anything. Tokens per step, i.e. per target forward, is the acceptance length.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..backends import GreedyRows
from ..engine.generator import Session
from ..engine.sampling import Sampler
from .ddtree import Tree, build_tree, chain_tree, empty_tree
from .depth import DepthController
from .options import DEFAULT_DRAFT_MAX
from .verify import plain_greedy, verify

METHODS = ("chain", "ddtree")
PHASES = ("propose", "propose wait", "tree", "forward", "forward wait", "walk", "commit")


@dataclass
class SpecCounters:
    steps: int = 0  # target forwards
    tokens: int = 0  # tokens committed by those forwards
    drafted: int = 0  # nodes sent to the target
    draft_s: float = 0.0
    verify_s: float = 0.0
    # where a step's wall time goes (seconds, summed): the draft's propose, the tree's
    # build, the target forward, the walk down the tree, advance's commit; "... wait" is
    # the part of the one before it the host spent blocked on the GPU (backends that say)
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def acceptance_length(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


class SpeculativeStepper:
    def __init__(self, session: Session, sampler: Sampler, drafter, method: str = "ddtree",
                 draft_max: int = 8, budget: int = 22, depth: DepthController | None = None, ahead: int = 0):
        """draft_max 0: each step's depth from `depth` (a new auto_depth(method, budget)
        when None; pass one to carry what it learned across generations). ahead: the
        draft's steps queued beside each verification forward (DraftModel.queue_ahead),
        0 for none."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, not {method!r}")
        self.session, self.sampler, self.drafter = session, sampler, drafter
        self.method, self.draft_max, self.budget = method, draft_max, budget
        self.ahead = ahead if hasattr(drafter, "queue_ahead") else 0
        self.depth = (depth or auto_depth(method, budget)) if draft_max == 0 else None
        self.counters = SpecCounters()
        self._next: int | None = None
        self._rows: list[int] = []
        self._logits: np.ndarray | None = None

    @property
    def model(self):
        return self.session.model

    def step(self, last_logits: np.ndarray, history: list[int]) -> list[int]:
        params = self.sampler.params
        t0 = self._next if self._next is not None else self.sampler.sample(last_logits, history)
        self._next = None
        cache = self.session.cache
        # every node needs a row, and an accepted path must still fit the context
        room = self.session.n_ctx - cache.n_past - 1
        waited = self._waited
        t, w = time.perf_counter(), waited()
        context = history + [t0]
        depth = min(self.depth.depth() if self.depth else self.draft_max, room)
        sample = self.method == "chain" and not params.greedy
        draft = self.drafter.propose(context, depth, params, self.sampler.rng, sample=sample)
        tp, wp = time.perf_counter(), waited()
        tree = self._tree(draft, room)
        t1 = time.perf_counter()
        tokens, positions, mask = tree.forward_inputs(t0, cache.n_past)
        if hasattr(self.model, "queue_greedy"):
            # argmaxes; the logits rows stay on the device until verification asks for one
            # (sampled: the rows its walk visits, not all of them: H200, Qwen3-8B shape, a
            # 23-node tree's forward 6.04 ms, 8.35 with every row copied to the host)
            pending = self.model.queue_greedy(cache, tokens, positions, mask=mask)
            if self.ahead:  # the next draft, guessed, beside the verification
                self.drafter.queue_ahead(self.ahead)
            logits = pending.result()
        else:
            logits = self.model.forward(cache, tokens, positions, mask=mask)
        tf, wf = time.perf_counter(), waited()
        verdict = verify(tree, logits, context, params, self.sampler.rng,
                         q=draft.q if self.method == "chain" else None)
        t2 = time.perf_counter()
        if self.depth is not None:
            self.depth.update(int(tree.depth.max()) if len(tree) else 0, len(verdict.nodes), t1 - t, t2 - t1)
        c = self.counters
        c.steps += 1
        c.tokens += 1 + len(verdict.nodes)
        c.drafted += len(tree)
        c.draft_s += t1 - t
        c.verify_s += t2 - t1
        ph = c.phases
        ph["propose"] += tp - t
        ph["propose wait"] += wp - w
        ph["tree"] += t1 - tp
        ph["forward"] += tf - t1
        ph["forward wait"] += wf - wp
        ph["walk"] += t2 - tf
        self._rows = [0] + [n + 1 for n in verdict.nodes]
        self._logits = logits
        self._next = verdict.next_token
        return [t0] + verdict.tokens

    def _waited(self) -> float:
        """Seconds blocked on the GPU so far (the backend's wait_s; 0 where it has none)."""
        return getattr(self.model.backend, "wait_s", 0.0)

    def _tree(self, draft, room: int) -> Tree:
        if not draft.tokens or room <= 0:
            return empty_tree()
        if self.method == "chain":
            return chain_tree(draft.tokens[:room])
        return build_tree(draft.topk_ids, draft.topk_logp, min(self.budget, room))

    def advance(self, tokens: list[int]) -> np.ndarray | None:
        n = len(tokens)
        if n < len(self._rows):
            # the caller stopped early: a pending replacement belongs after tokens it dropped
            self._next = None
        rows = self._rows[:n]
        t = time.perf_counter()
        self.session.cache.commit(rows)
        self.counters.phases["commit"] += time.perf_counter() - t
        self.session.tokens.extend(tokens)
        self.counters.tokens -= len(self._rows) - n
        if isinstance(self._logits, GreedyRows) and plain_greedy(self.sampler.params):
            # plain greedy: the next token is the kept row's argmax, already on the host, so
            # the row itself never leaves the device
            self._next = int(self._logits.ids[rows[-1]])
            return None
        return self._logits[rows[-1]]


def auto_depth(method: str, budget: int) -> DepthController:
    """The depth controller for --draft-max auto. DDTree's depth stops at half its node
    budget: past that the budget, not the depth, bounds what is kept (the Qwen2.5-Coder
    pair at budget 22: depth 12 kept exactly what 10 did)."""
    hi = 12 if method == "chain" else max(2, min(12, budget // 2))
    return DepthController(lo=2, hi=hi, start=DEFAULT_DRAFT_MAX)  # start is clamped to hi there
