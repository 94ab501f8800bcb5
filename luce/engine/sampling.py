"""Sampling parameters and the host-side sampler.

The sampler's `distribution` is the exact distribution a token is drawn from, so that
speculative sampling can accept or reject draft tokens against it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off (llama.cpp semantics, over the last repeat_last_n tokens)
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        problems = []
        if self.temperature < 0:
            problems.append("temperature must be >= 0")
        if self.top_k < 0:
            problems.append("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            problems.append("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append("min_p must be in [0, 1]")
        if self.repeat_penalty <= 0:
            problems.append("repeat_penalty must be > 0")
        if self.max_tokens < 0:
            problems.append("max_tokens must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_(self, **changes) -> "SamplingParams":
        names = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in changes.items() if k in names and v is not None})


def apply_penalties(logits: np.ndarray, history: list[int] | np.ndarray, p: SamplingParams) -> np.ndarray:
    if not len(history) or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
        return logits
    logits = logits.astype(np.float32, copy=True)
    hist = np.asarray(history, dtype=np.int64)
    if p.repeat_penalty != 1.0:
        recent = np.unique(hist[-p.repeat_last_n:]) if p.repeat_last_n > 0 else np.unique(hist)
        vals = logits[recent]
        logits[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    if p.presence_penalty or p.frequency_penalty:
        ids, counts = np.unique(hist, return_counts=True)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def distribution(logits: np.ndarray, history, p: SamplingParams) -> np.ndarray:
    """Probabilities after penalties, temperature, top-k, top-p and min-p (float64, sums to 1).
    Greedy is a one-hot at the argmax."""
    logits = apply_penalties(np.asarray(logits, dtype=np.float32), history, p)
    probs = np.zeros(logits.shape[-1], dtype=np.float64)
    if p.greedy:
        probs[int(np.argmax(logits))] = 1.0
        return probs
    z = logits.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    if p.top_k > 0:
        order = order[:p.top_k]
    zs = z[order]
    ps = np.exp(zs - zs[0])
    ps /= ps.sum()
    keep = len(ps)
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = min(keep, int(np.searchsorted(np.cumsum(ps), p.top_p) + 1))
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(ps >= p.min_p * ps[0]))))
    ps = ps[:keep] / ps[:keep].sum()
    probs[order[:keep]] = ps
    return probs


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history) -> int:
        if self.params.greedy and not (self.params.repeat_penalty != 1.0 or self.params.presence_penalty
                                       or self.params.frequency_penalty):
            return int(np.argmax(logits))
        probs = distribution(logits, history, self.params)
        return int(self.draw(probs))

    def draw(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs))
