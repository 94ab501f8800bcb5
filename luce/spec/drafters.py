"""Drafters: what proposes the tokens the target verifies.

Every drafter answers `propose(context, n, params, rng, sample)` with a `Draft`: a chain
of up to n tokens continuing `context` and, per position, its top-K candidates with
log-probabilities (what DDTree builds its tree from). A drafter keeps whatever state it
likes between calls; `context` is always the full committed history plus the target's
next token, so a drafter can bring its state in line by itself.
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..engine.generator import prefill_pieces
from ..engine.sampling import SamplingParams, draw, kept, top_logprobs


@dataclass
class Draft:
    tokens: list[int]
    topk_ids: np.ndarray  # int64 [len(tokens), K]; rank 0 is tokens[i] unless sampled
    topk_logp: np.ndarray  # float [len(tokens), K]; -inf pads
    # The distribution each token was sampled from when the drafter sampled, over its
    # support: (ascending token ids, their probabilities); None when the tokens are
    # deterministic proposals (greedy draft, lookup). Verification needs it for the p/q
    # acceptance rule.
    q: list[tuple[np.ndarray, np.ndarray]] | None = None

    @staticmethod
    def empty() -> "Draft":
        return Draft([], np.zeros((0, 1), dtype=np.int64), np.zeros((0, 1)))


class DraftModel:
    """A small autoregressive model sharing the target's tokenizer, on its own KV cache.

    Drafting n tokens costs n forwards: one that catches the cache up with the context
    (the tokens the target accepted since the last call, usually one to three; the whole
    prompt the first time) and n - 1 single-token decodes.

    p_min > 0 stops a draft early: at the first position where the chain's probability
    under the draft (the product of its tokens' probabilities so far) falls below p_min.
    That position is still proposed, with its candidates (a tree branches where the draft
    is unsure); the forwards past it, whose tokens the target would rarely accept, are
    not run.
    """

    name = "draft-model"

    def __init__(self, model, n_ctx: int | None = None, top_k: int = 8, on_device: bool | None = None,
                 p_min: float = 0.0):
        if not 0.0 <= p_min < 1.0:
            raise ValueError(f"p_min must be in [0, 1), not {p_min}")
        self.model = model
        self.session = model.new_session(n_ctx)
        self.top_k = top_k
        self.log_p_min = math.log(p_min) if p_min > 0 else -math.inf
        # greedy drafts on a backend that takes each step's candidates on the device
        # (forward_topk): the steps queue back to back and only the candidates come back.
        # LUCE_DRAFT_ON_DEVICE=0: the host loop over whole logits rows (to compare)
        if on_device is None:
            on_device = os.environ.get("LUCE_DRAFT_ON_DEVICE", "1") != "0" and \
                hasattr(getattr(model, "backend", None), "forward_topk")
        self.on_device = on_device
        # a p_min cut-off taken on the device where the backend can (begin_chain);
        # LUCE_DRAFT_DEVICE_STOP=0: on the host, one step queued past the stop (to compare)
        self.device_stop = os.environ.get("LUCE_DRAFT_DEVICE_STOP", "1") != "0"
        # queue_ahead: the last draft, when the session is exactly its context and chain
        # but the chain's last token (no cut-off, no sampling), and the steps queued past it
        self._last: tuple[list[int], list[int]] | None = None
        self._ahead = None
        self.ahead_tries = 0  # drafts queued ahead
        self.ahead_hits = 0  # ... that the next propose used
        self.forwards = 0  # the draft model's forwards, each a step's cost (catch-ups included)
        # drafts the cut-off ended before their length (on a device without the stop taken
        # there, each also ran one forward past it)
        self.cut_offs = 0

    @classmethod
    def load(cls, path, backend="cpu", n_ctx: int | None = None, top_k: int = 8, p_min: float = 0.0) -> "DraftModel":
        from ..model import load
        return cls(load(path, backend=backend, n_ctx=n_ctx), n_ctx=n_ctx, top_k=top_k, p_min=p_min)

    def reset(self) -> None:
        """Drop the draft's cached context (the next propose prefills from the start)."""
        self.session.reset()
        self._last = self._ahead = None

    def queue_ahead(self, m: int) -> None:
        """Start the next draft before the target has judged this one: m steps past the
        last chain (its last token, then the draft's own next token g, then g's
        continuation), as if the target will accept the whole chain and then take g. On a
        device backend they queue on the draft's stream and run beside the target's
        verification forward; the next propose uses them when its context is the last one
        plus the chain plus g, and otherwise drops them (rewinding the rows they wrote).
        Nothing the target commits depends on them: a wrong guess costs only their time.
        Not with a p_min cut-off (its loop reads each step before queuing far ahead)."""
        last, self._last = self._last, None
        self._ahead = None
        if m < 2 or last is None or self.log_p_min > -math.inf:
            return
        context, toks = last
        if len(context) + len(toks) + m > self.session.n_ctx:
            return
        self.ahead_tries += 1
        base = context + toks
        if self.on_device:
            k = min(self.top_k, self.model.config.vocab_size)
            # the first feeds the chain's last token, still on the device as the last
            # step's argmax; each later one the argmax before it
            pending = [self.session.queue_topk(None, k) for _ in range(min(m, self.model.backend.readback_slots))]
            self.forwards += len(pending)
            self.session.tokens.append(toks[-1])
            self._ahead = (base, pending, None)
            return
        k = self.top_k
        logits = self.session.decode(toks[-1])
        results = [top_logprobs(logits, min(k, len(logits)))]
        self.forwards += m
        for _ in range(m - 1):
            logits = self.session.decode(int(results[-1][0][0]))
            results.append(top_logprobs(logits, min(k, len(logits))))
        self._ahead = (base, results, logits)

    def _ahead_hit(self, ahead, context: list[int]):
        """The candidates queue_ahead computed past `context`'s last token, when context is
        what it guessed ([(ids, logp)] for depths 1.., each pending on a device), else None
        (the session's tokens then end where its rows are known)."""
        if ahead is None:
            return None
        base, res, _ = ahead
        first = res[0].result() if self.on_device else res[0]
        g = int(first[0][0])
        if len(context) == len(base) + 1 and context[-1] == g and context[:-1] == base:
            self.ahead_hits += 1
            return res[1:]
        return None

    def propose(self, context, n: int, params: SamplingParams | None = None, rng=None,
                sample: bool = False) -> Draft:
        ahead, self._ahead = self._ahead, None
        self._last = None
        if n <= 0:
            return Draft.empty()
        context = list(context)
        room = self.session.n_ctx - len(context)
        n = min(n, room + 1)
        if n <= 0:
            return Draft.empty()
        hit = None if sample else self._ahead_hit(ahead, context)
        if self.on_device and not sample:
            return self._propose_on_device(context, n, min(self.top_k, self.model.config.vocab_size), hit)
        toks, ids, lps, qs = [], [], [], []
        if hit:  # the session already holds context and the queued steps' tokens but the last
            ids = [r[0] for r in hit]
            lps = [r[1] for r in hit]
            toks = [int(i[0]) for i in ids]
            logits = ahead[2]
        else:
            # prefill reuses the longest common prefix: after an accepted path that left the
            # draft's own chain, the rows past the divergence are dropped and recomputed
            logits, _ = self.session.prefill(context)
            self.forwards += 1  # a catch-up of a few tokens; a whole prompt the first time
        k = min(self.top_k, len(logits))
        logp = float(sum(float(l[0]) for l in lps))  # the chain's log-probability under the draft
        for i in range(len(toks), n):
            if toks:
                logits = self.session.decode(toks[-1])
                self.forwards += 1
            top_i, top_l = top_logprobs(logits, k)
            if sample:
                # over its support: no vocabulary-sized array a position
                q_ids, q_ps = kept(logits, context + toks, params)
                q_ids, q_ps = q_ids[q_ps > 0], q_ps[q_ps > 0]
                t = draw(rng, q_ids, q_ps)
                qs.append((q_ids, q_ps))
                logp += math.log(float(q_ps[np.searchsorted(q_ids, t)]))
            else:
                t = int(top_i[0])
                logp += float(top_l[0])
            toks.append(t)
            ids.append(top_i)
            lps.append(top_l)
            if logp < self.log_p_min:
                self.cut_offs += len(toks) < n
                break
        if not sample and len(toks) <= n and logp >= self.log_p_min:
            self._last = (context, toks)
        toks, ids, lps = toks[:n], ids[:n], lps[:n]
        return Draft(toks, np.stack(ids), np.stack(lps), qs if sample else None)

    def _propose_on_device(self, context: list[int], n: int, k: int, hit=None) -> Draft:
        """The greedy chain with every forward queued on the device as soon as the one
        before: the first ones catch the cache up with the context (the tokens the target
        accepted since the last call, in the pieces a prefill takes, so that their rows
        are the host loop's), each later one takes the argmax the one before left on the
        device. Only the candidates come back, and the host waits for nothing before the
        whole draft is queued. The same Draft as the host loop, up to the
        log-probabilities' float rounding. hit: the first steps' pending candidates, queued
        by queue_ahead (the session holds context but its last token, which the first of
        them consumed)."""
        slots = self.model.backend.readback_slots
        cut = self.log_p_min > -math.inf
        device_stop = False  # the cut-off taken on the device, where the steps past it do nothing
        toks, ids, lps = [], [], []
        logp = 0.0
        if hit:
            pending: deque = deque(hit)
            self.session.tokens.append(context[-1])
        else:
            common = self.session.rewind(context)
            rest = context[common:]
            pieces = prefill_pieces(len(rest), pow2=getattr(self.model.backend, "graph_prefill", False))
            s = 0
            for size in pieces[:-1]:  # only their rows count: their candidates are never read
                self.session.queue_topk(rest[s:s + size], k)
                s += size
            self.session.tokens.extend(rest[:s])
            rest = rest[s:]
            # after the pieces: their top-1s are not the chain's
            device_stop = cut and self.device_stop and self.session.begin_chain(k, self.log_p_min)
            pending = deque([self.session.queue_topk(rest, k)])
            self.forwards += 1
            self.session.tokens.extend(rest)
        queued = len(pending)  # forwards: the catch-up, then one a drafted token
        # every step queued at once where nothing depends on reading them; with a cut-off
        # the host takes, each read as soon as the one after it is queued (at most that one
        # runs past the stop)
        cap = min(2, slots) if cut and not device_stop else slots  # forwards in flight at most
        stopped = False
        while pending:
            while queued < n and len(pending) < cap:
                pending.append(self.session.queue_topk(None, k))
                self.forwards += 1
                queued += 1
            step = pending.popleft()
            ti, tl = step.result()
            toks.append(int(ti[0]))
            ids.append(ti)
            lps.append(tl)
            logp += float(tl[0])
            # the device's sum is the host's, bit for bit; its word decides what ran there
            stopped = step.stopped if device_stop else logp < self.log_p_min
            if stopped:
                self.cut_offs += len(toks) < n
                break
        if device_stop and stopped:
            if len(toks) < queued:
                # the forwards past the stop did nothing: the rows are those up to its input
                self.forwards -= queued - len(toks)
                queued = len(toks)
                self.session.cache.truncate(len(self.session.tokens) + queued - 1)
            self.session.begin_chain(k, -math.inf)  # leave no stopped chain to later steps
        # the rows the later forwards committed: each one's input token (a forward past
        # the stop ran on the last token read, so these are all known)
        assert len(toks) >= queued - 1
        self.session.tokens.extend(toks[:queued - 1])
        if len(toks) == queued <= n and logp >= self.log_p_min:
            self._last = (context, toks)  # the device's last argmax is the chain's last token
        toks, ids, lps = toks[:n], ids[:n], lps[:n]
        width = max(len(r) for r in ids)
        ids_a = np.zeros((len(ids), width), dtype=np.int64)
        lps_a = np.full((len(ids), width), -np.inf)
        for r, (a, b) in enumerate(zip(ids, lps)):
            ids_a[r, :len(a)], lps_a[r, :len(b)] = a, b
        return Draft(toks, ids_a, lps_a)


class PromptLookup:
    """N-gram lookup in the context (prompt and output so far): no model.

    The longest suffix n-gram (max_ngram down to min_ngram tokens) that occurred before
    proposes what followed its most recent earlier occurrence. Per position, the
    candidates are the tokens that followed all its occurrences (up to `max_matches`),
    ranked by count, so DDTree can branch where earlier occurrences disagree.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, top_k: int = 4, max_matches: int = 16):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.top_k, self.max_matches = top_k, max_matches

    def propose(self, context, n: int, params=None, rng=None, sample: bool = False) -> Draft:
        ctx = np.asarray(context, dtype=np.int64)
        if n <= 0:
            return Draft.empty()
        for g in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            pattern = ctx[-g:]
            # candidate starts j with a continuation: j + g < len(ctx)
            win = np.lib.stride_tricks.sliding_window_view(ctx[:-1], g)
            hits = np.flatnonzero((win == pattern).all(axis=1))[::-1][:self.max_matches]
            if len(hits):
                return self._draft(ctx, hits + g, n)
        return Draft.empty()

    def _draft(self, ctx: np.ndarray, starts: np.ndarray, n: int) -> Draft:
        chain = ctx[starts[0]:starts[0] + n]
        L, K = len(chain), self.top_k
        ids = np.zeros((L, K), dtype=np.int64)
        lps = np.full((L, K), -np.inf)
        for i in range(L):
            follow = [int(ctx[s + i]) for s in starts if s + i < len(ctx)]
            vals, counts = np.unique(follow, return_counts=True)
            freq = dict(zip(vals.tolist(), counts.tolist()))
            top = int(chain[i])
            # the chain's token ranks first (most recent match), the rest by count
            others = sorted((t for t in freq if t != top), key=lambda t: -freq[t])[:K - 1]
            total = len(follow)
            for r, t in enumerate([top] + others):
                ids[i, r] = t
                lps[i, r] = np.log(freq[t] / total)
        return Draft([int(t) for t in chain], ids, lps)
