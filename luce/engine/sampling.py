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

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def device_draw(self) -> tuple[float, int]:
        """(temperature, top_k) of the device draw: greedy with penalties is a top-1 draw."""
        return (1.0, 1) if self.greedy else (self.temperature, self.top_k)

    def with_(self, **changes) -> "SamplingParams":
        names = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in changes.items() if k in names and v is not None})


def apply_penalties(logits: np.ndarray, history: list[int] | np.ndarray, p: SamplingParams) -> np.ndarray:
    if not len(history) or not p.penalized:
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


def top_k_ties(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids (ascending) of the logits at least the k-th largest. A partition of the whole
    vocabulary took ~2.5 ms at 152K; the k-th largest of the maxima of 64-logit runs is a
    floor below which none of the top k lies (k runs hold a logit above it), and only the
    few logits over it are partitioned."""
    v = logits.shape[-1]
    if v >= 64 * 4 * k:  # runs outnumber k well: the floor leaves few candidates
        runs = np.maximum.reduceat(logits, np.arange(0, v, 64))
        floor = np.partition(runs, len(runs) - k)[len(runs) - k]
        cand = np.flatnonzero(logits >= floor)
    else:
        cand = np.arange(v)
    vals = logits[cand]
    kth = np.partition(vals, len(vals) - k)[len(vals) - k]  # the k-th largest
    return cand[vals >= kth]


def top_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, log-probabilities) of the k most likely tokens of a logits row, most likely
    first (ties: the lower id first). What a draft proposes from at each position: a
    log-softmax and a partition of the whole vocabulary took ~10 ms a position at 152K on
    the CI machine, more than the draft's forward; here only the normalizer touches every
    logit (float32 exp, float64 sum)."""
    x = np.asarray(logits, dtype=np.float32)
    k = min(k, x.shape[-1])
    cand = top_k_ties(x, k)
    ids = cand[np.argsort(-x[cand], kind="stable")[:k]]
    m = x.max()
    log_z = np.float64(m) + np.log(np.exp(x - m).sum(dtype=np.float64))
    return ids.astype(np.int64), x[ids].astype(np.float64) - log_z


def draw(rng, ids: np.ndarray, probs: np.ndarray) -> int:
    """A token from a distribution over its support (ascending ids, their probabilities):
    the token rng.choice over the whole vocabulary's vector draws for the same generator
    state (zeros add nothing to the cumulative sums), without a vector of 152K entries."""
    return int(ids[rng.choice(len(ids), p=probs)])


def kept(logits: np.ndarray, history, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, ascending; their probabilities, float64, summing to 1): the tokens that
    penalties, temperature, top-k, top-p and min-p leave (greedy: the argmax alone).

    Why not sort the vocabulary: a stable argsort of 152K logits took ~37 ms on this
    project's 2-core CI machine, a whole sampled token of a chat at 300 tok/s many times
    over (and speculative sampling makes one distribution a tree node). Only the tokens
    that can be kept are sorted: top-k's candidates are top_k_ties' (every logit tied with
    the k-th kept, so the stable order's first k are the same); without top-k,
    min-p bounds the kept set by a logit threshold, and top-p alone by the highest tokens
    that hold more than its mass; with none of them nothing is sorted. The normalizations
    are those of the sorted computation (top-k: over the same k values, in the same
    order; else over the whole vocabulary, summed in id order)."""
    logits = apply_penalties(np.asarray(logits, dtype=np.float32), history, p)
    if p.greedy:
        return np.array([int(np.argmax(logits))]), np.ones(1)
    v = logits.shape[-1]
    total = None  # the normalization over the tokens top-k leaves, where not the candidates'
    if 0 < p.top_k < v:
        cand = top_k_ties(logits, p.top_k)
    elif p.min_p > 0.0 or p.top_p < 1.0:
        top = np.float64(logits.max())
        e = np.exp(logits.astype(np.float64) / p.temperature - top / p.temperature)
        total = e.sum()
        if p.min_p > 0.0:
            # the kept tokens have exp(z - z0) >= min_p: a threshold on the logits, loosened
            # well past rounding so that the exact test below decides
            cand = np.flatnonzero(logits >= top + p.temperature * np.log(p.min_p) - 1e-3 * (1.0 + abs(top)))
        else:
            # top-p alone: the highest tokens holding a little more than top_p of the mass
            # contain the prefix it keeps; widen the bound until they do
            cand = None
            for gap in (4.0, 8.0, 16.0, 32.0):
                above = e >= np.exp(-gap)
                if e[above].sum() >= min(1.0, p.top_p * 1.001) * total:
                    cand = np.flatnonzero(above)
                    break
            if cand is None:
                cand = np.arange(v)
        if len(cand) == v:
            total = None  # the sorted sum, as without a bound
    else:  # every token kept: no order needed
        z = logits.astype(np.float64) / p.temperature
        e = np.exp(z - z.max())
        return np.arange(v), e / e.sum()
    z = logits[cand].astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")  # cand is ascending: ties keep the lower id first
    if p.top_k > 0:
        order = order[:p.top_k]
    zs = z[order]
    ps = np.exp(zs - zs[0])
    ps /= ps.sum() if total is None else total
    keep = len(ps)
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = min(keep, int(np.searchsorted(np.cumsum(ps), p.top_p) + 1))
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(ps >= p.min_p * ps[0]))))
    ids = cand[order[:keep]]
    ps = ps[:keep] / ps[:keep].sum()
    asc = np.argsort(ids)
    return ids[asc], ps[asc]


def distribution(logits: np.ndarray, history, p: SamplingParams) -> np.ndarray:
    """Probabilities after penalties, temperature, top-k, top-p and min-p (float64, sums to 1)
    over the whole vocabulary: `kept`'s, zeros elsewhere. Greedy is a one-hot at the argmax."""
    ids, ps = kept(logits, history, p)
    probs = np.zeros(np.shape(logits)[-1], dtype=np.float64)
    probs[ids] = ps
    return probs


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The index Generator.choice(len(probs), p=probs) picks when its uniform is u: the
    device draw takes the host generator's uniforms, so both draw the same tokens."""
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return min(len(probs) - 1, int(np.searchsorted(cdf, u, side="right")))


def draw_params(logits: np.ndarray, sp: np.ndarray, history=(), repeat_last_n: int = 64) -> int:
    """The token the device draw (luce.kernels.sampling.sample_cuda) takes from a logits
    row with its parameter vector (penalties over `history`), on the host."""
    from ..kernels import sampling as S
    p = SamplingParams(temperature=float(sp[S.SP_TEMPERATURE]), top_k=int(sp[S.SP_TOP_K]),
                       top_p=float(sp[S.SP_TOP_P]), min_p=float(sp[S.SP_MIN_P]),
                       repeat_penalty=float(sp[S.SP_REPEAT]), presence_penalty=float(sp[S.SP_PRESENCE]),
                       frequency_penalty=float(sp[S.SP_FREQUENCY]), repeat_last_n=repeat_last_n)
    ids, ps = kept(logits, history, p)
    return int(ids[inverse_cdf(ps, float(sp[S.SP_U]))])


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history) -> int:
        if self.params.greedy and not self.params.penalized:
            return int(np.argmax(logits))
        # over the kept tokens in id order: the same draw as from `distribution`'s whole
        # vector for the same generator state (zeros add nothing to its cumulative sums)
        ids, ps = kept(logits, history, self.params)
        return int(ids[self.draw(ps)])

    def draw(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs))

    def device_params(self) -> np.ndarray:
        """The next draw's uniform (the one `draw` would take) with the parameters, as the
        device draw reads them (luce.kernels.sampling.sample_params); greedy (with
        penalties: without, nothing is drawn) as a top-1 draw."""
        from ..kernels.sampling import sample_params
        p = self.params
        return sample_params(*p.device_draw, p.top_p, p.min_p, self.rng.random(), p.repeat_penalty,
                             p.presence_penalty, p.frequency_penalty)
