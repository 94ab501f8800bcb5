"""How deep to draft: `--draft-max auto`.

The best depth is where one more drafted token stops paying for its draft step, which
depends on the ratio of a target forward to a draft step (the target's size, the
machine) and on how often the target agrees with the draft (the prompt). On an H100 the
Qwen2.5-Coder pair's acceptance with the GPU's costs puts it at 6 for the Qwen3-8B shape
and 10 for the 32B (docs/benchmarks.md, forty-fourth session), so no fixed default fits
both.

The model behind the choice: each drafted token is kept with probability alpha given
that the ones before it were (geometric), so a step drafting D tokens keeps
a(D) = (1 - alpha^(D+1)) / (1 - alpha) tokens, the target's own included, and costs
fixed + D * step. alpha is the censored maximum-likelihood estimate over the steps so far
(a step that kept all D drafted tokens says nothing about the next one), so depths never
drafted are extrapolated from the ones that were. The pair's DDTree acceptance at depths 4
to 10 fits it within 5% (alpha ~0.905 from depth 8). Older steps count less (weights
decay by `decay` a step) so that a change of prompt moves the choice.
"""
from __future__ import annotations

import math


def kept_tokens(alpha: float, depth: int) -> float:
    """Expected tokens a step keeps at this depth under the geometric model."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


class DepthController:
    """Picks each step's draft depth in [lo, hi] from the steps before it: `depth()` to
    ask, `update(...)` after a step. Until `warmup` steps are in, it answers `start`."""

    def __init__(self, lo: int = 2, hi: int = 12, start: int = 8, warmup: int = 4, decay: float = 0.95):
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= lo <= hi, not {lo}, {hi}")
        self.lo, self.hi, self.start = lo, hi, min(max(start, lo), hi)
        self.warmup, self.decay = warmup, decay
        self.steps = 0
        self.kept = 0.0  # drafted tokens the target kept (decayed)
        self.misses = 0.0  # steps that ended on a rejected drafted token (decayed)
        self.step_s: float | None = None  # a draft step's time (decayed mean)
        self.fixed_s: float | None = None  # the rest of a target forward's time

    @property
    def alpha(self) -> float:
        n = self.kept + self.misses
        return self.kept / n if n > 0 else 0.0

    def update(self, depth: int, kept_drafted: int, draft_s: float, verify_s: float) -> None:
        """A step drafted `depth` tokens, of which the target kept `kept_drafted` (its own
        token not counted), in draft_s of drafting and verify_s for the rest."""
        if depth <= 0:  # nothing drafted (no room, or no draft): says nothing of either
            return
        d = self.decay
        self.kept = self.kept * d + kept_drafted
        self.misses = self.misses * d + (1.0 if kept_drafted < depth else 0.0)
        step, fixed = draft_s / depth, verify_s
        self.step_s = step if self.step_s is None else self.step_s * d + step * (1 - d)
        self.fixed_s = fixed if self.fixed_s is None else self.fixed_s * d + fixed * (1 - d)
        self.steps += 1

    def depth(self) -> int:
        if self.steps < self.warmup or not self.step_s or self.fixed_s is None:
            return self.start
        a = self.alpha
        best, best_rate = self.start, -math.inf
        for n in range(self.lo, self.hi + 1):
            rate = kept_tokens(a, n) / (self.fixed_s + n * self.step_s)
            if rate > best_rate + 1e-12:
                best, best_rate = n, rate
        return best
