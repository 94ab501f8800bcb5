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


# A seeded catch-up is one forward of (catch-up + guess) tokens: only where the catch-up is
# the few tokens a verification accepted, not a prompt's prefill
SEED_MAX_CATCHUP = 12
# On a device the seeded catch-up is padded to this many tokens: one captured graph for all
SEED_WIDTH = 16
SEED_MAX = 16


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

    lookup (a PromptLookup) guesses the draft's own next tokens from the context: the
    catch-up forward carries the guess, and the positions where the draft's greedy chain
    is the guess come out of that one forward (code being copied or edited, where prompt
    lookup is right for long stretches). The draft is the one the steps would make, so
    the target accepts the same; a confirmed guess may carry it past n, up to seed_max.
    """

    name = "draft-model"

    def __init__(self, model, n_ctx: int | None = None, top_k: int = 8, on_device: bool | None = None,
                 p_min: float = 0.0, lookup: "PromptLookup | None" = None):
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
        # lookup: a guess at the draft's own chain (prompt n-grams) rides on the catch-up
        # forward (_seed_forward, _seed_on_device); the draft tokens it confirmed (no forward
        # of their own), and the drafts it was tried on
        self.lookup = lookup
        self.seed_width = SEED_WIDTH  # a device's seeded forward: catch-up and guess padded to this
        # the longest draft a confirmed guess makes (past the n asked for: the tree's budget
        # and the context's room still bound what is verified)
        self.seed_max = SEED_MAX
        self.seeded = 0
        self.seed_tries = 0

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
        pre: deque = deque()  # (guessed token, the logits after it) from a seeded catch-up
        guess = None
        if hit:  # the session already holds context and the queued steps' tokens but the last
            ids = [r[0] for r in hit]
            lps = [r[1] for r in hit]
            toks = [int(i[0]) for i in ids]
            logits = ahead[2]
        elif guess := (None if sample else self._guess(context, n)):
            rows = self._seed_forward(context, guess)
            logits = rows[0]
            pre.extend(zip(guess, rows[1:]))
        else:
            # prefill reuses the longest common prefix: after an accepted path that left the
            # draft's own chain, the rows past the divergence are dropped and recomputed
            logits, _ = self.session.prefill(context)
            self.forwards += 1  # a catch-up of a few tokens; a whole prompt the first time
        k = min(self.top_k, len(logits))
        logp = float(sum(float(l[0]) for l in lps))  # the chain's log-probability under the draft
        # a guess the draft's chain confirms may take it past n (up to seed_max): those
        # tokens cost nothing more
        while len(toks) < n or (toks and pre and pre[0][0] == toks[-1]):
            if toks:
                if pre and pre[0][0] == toks[-1]:  # the guess was the draft's chain so far
                    logits = pre.popleft()[1]
                    self.seeded += 1
                else:
                    pre.clear()
                    self._trim(len(context) + len(toks) - 1)
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
        if guess:
            self._trim(len(context) + len(toks) - 1)  # the guess's rows past the chain's last input
        if not sample and len(toks) <= n and logp >= self.log_p_min:
            self._last = (context, toks)
        keep = max(n, len(toks)) if guess else n
        toks, ids, lps = toks[:keep], ids[:keep], lps[:keep]
        return Draft(toks, np.stack(ids), np.stack(lps), qs if sample else None)

    # -- a lookup guess at the draft's chain ------------------------------------------
    def _guess(self, context: list[int], n: int, width: int | None = None) -> list[int]:
        """Up to max(n, seed_max) - 1 tokens that prompt lookup expects to follow `context`,
        when this draft is to be seeded (a lookup, a short catch-up), else []. width: the
        seeded forward's tokens, catch-up and guess together (then the guess fits beside it)."""
        if self.lookup is None or n < 2:
            return []
        common = 0
        for a, b in zip(self.session.tokens, context[:-1]):
            if a != b:
                break
            common += 1
        catch_up = len(context) - common
        most = max(n, self.seed_max) - 1 if width is None else min(max(n, self.seed_max) - 1, width - catch_up)
        if catch_up > SEED_MAX_CATCHUP or most < 1 or common + (width or catch_up + most) > self.session.n_ctx:
            return []
        guess = [int(t) for t in self.lookup.propose(context, most).tokens]
        self.seed_tries += bool(guess)
        return guess

    def _seed_forward(self, context: list[int], guess: list[int]) -> list[np.ndarray]:
        """The catch-up forward with `guess` appended: the logits after context, then after
        each guessed token. Where the draft's own greedy chain is the guess, its next
        positions are already computed (one forward for what would take one a token);
        where it leaves the guess, the rows past that point are trimmed and it goes on
        step by step. The draft is the same either way, up to the float rounding of a wider
        forward. The session holds context + guess after it."""
        common = self.session.rewind(context)
        rest = context[common:]
        seq = rest + guess
        out = self.session.forward(seq, logits_rows=list(range(len(rest) - 1, len(seq))))
        self.session.cache.commit()
        self.session.tokens.extend(seq)
        self.forwards += 1
        return list(out)

    def _trim(self, n_rows: int) -> None:
        """Drop the session's rows past n_rows (a seeded forward's guesses the chain left)."""
        if len(self.session.tokens) > n_rows:
            self.session.cache.truncate(n_rows)
            del self.session.tokens[n_rows:]

    def _propose_on_device(self, context: list[int], n: int, k: int, hit=None) -> Draft:
        """The greedy chain with every forward queued on the device as soon as the one
        before: the first ones catch the cache up with the context (the tokens the target
        accepted since the last call, in the pieces a prefill takes, so that their rows
        are the host loop's), each later one takes the argmax the one before left on the
        device. Only the candidates come back, and the host waits for nothing before the
        whole draft is queued. The same Draft as the host loop, up to the
        log-probabilities' float rounding. hit: the first steps' pending candidates, queued
        by queue_ahead (the session holds context but its last token, which the first of
        them consumed). With a lookup guess, the catch-up forward carries it (_seed_on_device)
        and the steps go on from where the draft's chain left it."""
        slots = self.model.backend.readback_slots
        cut = self.log_p_min > -math.inf
        device_stop = False  # the cut-off taken on the device, where the steps past it do nothing
        toks, ids, lps = [], [], []
        logp = 0.0
        base = 0  # the chain's tokens before the first forward of `pending`'s (a seeded catch-up's)
        guess = None if hit else self._guess(context, n, self.seed_width)
        if guess:
            toks, ids, lps, logp, stopped = self._seed_on_device(context, guess, k, n)
            base = len(toks)
            if stopped or base >= n:
                return self._device_draft(toks, ids, lps, max(n, base))
            device_stop = cut and self.device_stop and self.session.begin_chain(k, self.log_p_min - logp)
            pending = deque([self.session.queue_topk(toks[-1], k)])
            self.forwards += 1
            self.session.tokens.append(toks[-1])
        elif hit:
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
        queued = len(pending)  # forwards: the catch-up (or a seeded chain's next), then one a drafted token
        # every step queued at once where nothing depends on reading them; with a cut-off,
        # each read as soon as the one after it is queued: at most that one is queued past
        # the stop (where the device takes the stop, it does nothing there). Queuing all of
        # them at once with the device's stop kept the GPU's time but cost ~0.35 ms of host
        # time a step queued past it (H100, 1c20b3b: 4.3 ms of host time a 12-step draft
        # against 3.0 with one queued past the stop, the same ~9.9 ms a target forward)
        cap = min(2, slots) if cut else slots  # forwards in flight at most
        stopped = False
        while pending:
            while base + queued < n and len(pending) < cap:
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
        ran = len(toks) - base  # of the queued forwards, those whose candidates were read
        if device_stop and stopped:
            if ran < queued:
                # the forwards past the stop did nothing: the rows are those up to its input
                self.forwards -= queued - ran
                queued = ran
                self.session.cache.truncate(len(self.session.tokens) + queued - 1)
            self.session.begin_chain(k, -math.inf)  # leave no stopped chain to later steps
        # the rows the later forwards committed: each one's input token (a forward past
        # the stop ran on the last token read, so these are all known)
        assert ran >= queued - 1
        self.session.tokens.extend(toks[base:base + queued - 1])
        if not base and len(toks) == queued <= n and logp >= self.log_p_min:
            self._last = (context, toks)  # the device's last argmax is the chain's last token
        return self._device_draft(toks, ids, lps, n)

    def _seed_on_device(self, context: list[int], guess: list[int], k: int, n: int):
        """_seed_forward on the device: one forward of the catch-up, the guess and padding to
        seed_width tokens (one captured graph for every seeded catch-up), candidates for
        every row; the chain read from them up to where it leaves the guess (or the cut-off
        ends it). Returns (tokens, candidates, log-probabilities, chain log-probability,
        cut off); the session then holds context and the chain but its last token."""
        common = self.session.rewind(context)
        rest = context[common:]
        seq = rest + guess
        seq += [seq[-1]] * (self.seed_width - len(seq))  # rows nobody reads, trimmed below
        pend = self.session.queue_topk(seq, k, rows=len(seq))  # every row: the same graph whatever the catch-up
        self.forwards += 1
        self.session.tokens.extend(seq)
        toks, ids, lps = [], [], []
        logp, stopped = 0.0, False
        for i in range(len(guess) + 1):
            ti, tl = pend.result(len(rest) - 1 + i)
            toks.append(int(ti[0]))
            ids.append(ti)
            lps.append(tl)
            logp += float(tl[0])
            if logp < self.log_p_min:
                stopped = True
                self.cut_offs += len(toks) < n
                break
            if i == len(guess) or toks[-1] != guess[i]:
                break
        self.seeded += len(toks) - 1
        self._trim(len(context) + len(toks) - 1)
        return toks, ids, lps, logp, stopped

    @staticmethod
    def _device_draft(toks, ids, lps, n: int) -> Draft:
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
