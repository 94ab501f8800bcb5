"""The generation loop: prefill, then decode steps, sampling, stops, streaming text.

A step produces one or more tokens (more when a speculative decoder is plugged in as
`stepper`); everything after the step (stop tokens, stop strings, max tokens,
detokenization) is shared.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..text.detokenizer import StreamingDetokenizer
from .sampling import Sampler, SamplingParams
from .stops import StopMatcher

PREFILL_CHUNK = 512


def prefill_pieces(n: int, chunk: int = PREFILL_CHUNK, pow2: bool = False) -> list[int]:
    """Sizes of the forwards a prefill of n tokens runs: chunks of `chunk`, then the rest.
    With pow2 the rest goes in descending powers of two (300 -> 256, 32, 8, 4), so that a
    backend replaying a CUDA graph per forward width meets a bounded set of widths, each
    captured once, whatever the prompt's length."""
    sizes = [chunk] * (n // chunk)
    rest = n % chunk
    if rest and not pow2:
        return sizes + [rest]
    while rest:
        p = 1 << (rest.bit_length() - 1)
        sizes.append(p)
        rest -= p
    return sizes


@dataclass
class Delta:
    """A piece of a streamed generation. `finish_reason` is set on the last one."""
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length"
    stats: "GenerationStats | None" = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    target_forwards: int = 0  # decode forwards; tokens per forward = acceptance length
    draft_s: float = 0.0
    verify_s: float = 0.0
    spec_phases: dict | None = None  # SpecCounters.phases

    @property
    def prefill_tok_s(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        return self.completion_tokens / self.target_forwards if self.target_forwards else 0.0


class Session:
    """A model plus one KV cache. Reuses the cache's longest common prefix with the
    next prompt, so a chat that grows turn by turn only prefills the new turn."""

    def __init__(self, model, n_ctx: int):
        self.model = model
        self.n_ctx = n_ctx
        self.cache = model.backend.new_cache(model.config, n_ctx)
        self.tokens: list[int] = []  # tokens whose K/V are committed in the cache

    def forward(self, tokens, mask=None, logits_rows=None) -> np.ndarray:
        n0 = self.cache.n_past
        positions = np.arange(n0, n0 + len(tokens))
        return self.model.forward(self.cache, tokens, positions, mask=mask, logits_rows=logits_rows)

    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, int]:
        """Bring the cache to `prompt`; returns the logits after its last token and how many
        tokens came from the cache."""
        common = self.rewind(prompt)
        rest = prompt[common:]
        logits = None
        pow2 = getattr(getattr(self.model, "backend", None), "graph_prefill", False)
        s = 0
        for size in prefill_pieces(len(rest), pow2=pow2):
            chunk = rest[s:s + size]
            s += size
            logits = self.forward(chunk, logits_rows=[len(chunk) - 1])
            self.cache.commit()
            self.tokens.extend(chunk)
        return logits[-1], common

    def rewind(self, prompt: list[int]) -> int:
        """Drop the rows past the longest common prefix of the cache and `prompt` minus
        its last token (always recomputed: its logits are what a caller wants); returns
        that prefix's length."""
        common = 0
        for a, b in zip(self.tokens, prompt[:-1]):
            if a != b:
                break
            common += 1
        self.cache.truncate(common)
        self.tokens = self.tokens[:common]
        return common

    def reset(self) -> None:
        """Forget every row; the cache itself (and on the GPU the graphs captured for it) stays."""
        self.cache.truncate(0)
        self.tokens = []

    def decode(self, token: int) -> np.ndarray:
        logits = self.forward([token])
        self.cache.commit()
        self.tokens.append(token)
        return logits[-1]

    def queue_decode(self, token: int | None, sample=None):
        """Queue a decode step of `token` (None: the previous queued step's next token,
        still on the device) and commit its row; returns its pending next token (greedy,
        or drawn with `sample`: Sampler.device_params). The caller appends the token to
        `tokens` once it knows it."""
        pending = self.model.forward_next_token(self.cache, token, self.cache.n_past, sample=sample)
        self.cache.commit()
        return pending

    def queue_topk(self, token, k: int, rows: int = 1):
        """queue_decode for a draft: the pending result is the step's k best candidates
        and their log-probabilities (Model.forward_topk); its greedy token (the first
        candidate) is what a following queue_topk(None) consumes on the device. token: an
        int, None, or a list of tokens (one forward over them all, the candidates those
        after the last, or with rows > 1 after each of the last `rows`: result(row))."""
        pending = self.model.forward_topk(self.cache, token, self.cache.n_past, k, rows)
        self.cache.commit()
        return pending

    def begin_chain(self, k: int, log_p_min: float) -> bool:
        """Model.begin_chain on this session's cache: whether the queue_topk steps that
        follow stop on the device once the chain's probability falls below exp(log_p_min)."""
        return self.model.begin_chain(self.cache, k, log_p_min)


class PlainStepper:
    """One target forward per token: the baseline every speculative stepper must match."""

    def __init__(self, session: Session, sampler: Sampler):
        self.session, self.sampler = session, sampler

    def step(self, last_logits: np.ndarray, history: list[int]) -> list[int]:
        """The next tokens: here one, sampled from the logits after the last one."""
        return [self.sampler.sample(last_logits, history)]

    def advance(self, tokens: list[int]) -> np.ndarray:
        """Commit the tokens `step` returned (those the caller kept) and return the logits after them."""
        for t in tokens[:-1]:
            self.session.decode(t)
        return self.session.decode(tokens[-1])


class DeviceStepper:
    """Decoding with the target's next forward already queued on the GPU.

    Each step's next token is computed inside the decode graph (the argmax of its logits,
    or with a sampler the token drawn with the sampler's next uniform: the same tokens as
    the host sampler for the same seed), and the forward after it takes that token on the
    device, so it is queued before the host has read the token: while the host
    detokenizes, checks stops and streams token t, the GPU computes the step after it.
    (With the logits sampled on the host the GPU waits for all of that, plus the logits
    copy and the sampler, every token: Qwen3-8B shape on the H200, 10644a2: 276.7 tok/s
    sampled on the host against 320.9 greedy this way.) The queued step past the last kept
    token is discarded by `close`. Same tokens as PlainStepper for the same seed, penalties
    included (the device keeps the history's counts: set_penalty_history, once).
    """

    def __init__(self, session: Session, limit: int, sampler: Sampler | None = None):
        self.session = session
        self.limit = limit  # tokens the generation may produce
        # plain greedy needs no draw; greedy with penalties is a top-1 draw
        drawn = sampler is not None and (not sampler.params.greedy or sampler.params.penalized)
        self.sampler = sampler if drawn else None
        self.produced = 0
        self.queue: deque = deque()  # pending next tokens of queued forwards, in order
        self.history = None  # generate's history (prompt and output): what penalties read

    def step(self, last_logits: np.ndarray, history: list[int]) -> list[int]:
        self.produced += 1
        self.history = history
        if not self.queue:  # the first token: from the prefill's logits
            if self.sampler is not None:
                return [self.sampler.sample(last_logits, history)]
            return [int(np.argmax(last_logits))]
        return [self.queue.popleft().result()]

    def _queue(self, token: int | None) -> None:
        s = self.session
        sample = None
        if self.sampler is not None:
            if not self.queue and self.sampler.params.penalized:  # the device's history, once (then it adds its draws)
                s.model.set_penalty_history(s.cache, self.history, self.sampler.params.repeat_last_n)
            sample = self.sampler.device_params()
        self.queue.append(s.queue_decode(token, sample=sample))

    def advance(self, tokens: list[int]):
        (t,) = tokens
        s = self.session
        if not self.queue:  # nothing queued consumes t yet
            self._queue(t)
        s.tokens.append(t)  # the queued forward at the head of the queue consumes it
        if self.produced + 1 < self.limit and s.cache.n_past < s.n_ctx:
            # the token after the next one, from the next one still on the device
            self._queue(None)
        return None  # no logits: step reads the queued token

    def close(self) -> None:
        """Drop the rows of queued steps past the kept tokens."""
        self.queue.clear()
        self.session.cache.truncate(len(self.session.tokens))


def device_steps(session: Session, params: SamplingParams) -> bool:
    """Whether generate decodes through DeviceStepper: greedy, or with parameters the
    device draw takes (luce.kernels.sampling.sample_applies; penalties included), on a
    backend that computes the next token on the device and opts in."""
    backend = getattr(session.model, "backend", None)
    if not (getattr(backend, "pipelined_greedy", False) and hasattr(session.model, "forward_next_token")):
        return False
    if params.greedy and not params.penalized:
        return True
    from ..kernels.sampling import sample_applies
    vocab = getattr(getattr(session.model, "config", None), "vocab_size", 0)
    return (bool(getattr(backend, "device_sampling", False)) and hasattr(session.model, "set_penalty_history")
            and sample_applies(*params.device_draw, vocab, params.repeat_last_n))


def generate(session: Session, prompt: list[int], params: SamplingParams, stepper=None) -> Iterator[Delta]:
    model = session.model
    tok = model.tokenizer
    if len(prompt) == 0:
        prompt = [tok.bos_id] if tok.bos_id is not None else prompt
    if len(prompt) + params.max_tokens > session.n_ctx and len(prompt) >= session.n_ctx:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {session.n_ctx}")
    stats = GenerationStats(prompt_tokens=len(prompt))
    sampler = Sampler(params)
    t0 = time.perf_counter()
    logits, stats.cached_tokens = session.prefill(list(prompt))
    stats.prefill_s = time.perf_counter() - t0
    max_total = min(params.max_tokens, session.n_ctx - len(prompt))
    if stepper is None:
        stepper = (DeviceStepper(session, max_total, sampler) if device_steps(session, params)
                   else PlainStepper(session, sampler))
    try:
        yield from _decode(session, prompt, params, stats, stepper, logits, max_total)
    finally:  # also when the consumer stops early (a client that disconnects)
        close = getattr(stepper, "close", None)
        if close is not None:
            close()


def _decode(session, prompt, params, stats, stepper, logits, max_total) -> Iterator[Delta]:
    tok = session.model.tokenizer

    detok = StreamingDetokenizer(tok)
    stopper = StopMatcher(params.stop)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tok.eog_ids))
    history = list(prompt)
    t0 = time.perf_counter()
    while True:
        finish = "length" if stats.completion_tokens >= max_total else None
        ids, text = [], ""
        if finish is None:
            new = stepper.step(logits, history)
            stats.target_forwards += 1
            for t in new:
                if t in stop_ids:
                    finish = "stop"
                    break
                stats.completion_tokens += 1
                ids.append(t)
                history.append(t)
                piece, stopped = stopper.push(detok.push(t))
                text += piece
                if stopped:
                    finish = "stop"
                    break
                if stats.completion_tokens >= max_total:
                    finish = "length"
                    break
        if finish is not None:
            if finish == "length":
                # nothing more will come: what was held back for a possible stop is text
                tail, _ = stopper.push(detok.flush())
                text += tail + stopper.flush()
            stats.decode_s = time.perf_counter() - t0
            yield Delta(text, ids, finish, stats)
            return
        if text or ids:
            yield Delta(text, ids)
        logits = stepper.advance(ids)
