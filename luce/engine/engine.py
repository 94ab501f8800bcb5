"""The request queue: one worker thread runs generations one at a time, in arrival order.

The model and its KV cache are not thread-safe, so exactly one thread touches them; HTTP
handlers live on an asyncio loop and receive their request's events through an
asyncio.Queue fed with `call_soon_threadsafe`. A cancelled request (its client went
away) is dropped while it waits, or stopped at its next token once running.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import AsyncIterator

from ..text.output_parser import InvalidToolCall, OutputParser, ReasoningDelta, TextDelta, ToolCall
from .request import Done, Error, Request, Started, Timings, Usage

log = logging.getLogger("luce.engine")


class QueueFull(Exception):
    pass


class Job:
    """A submitted request: its events arrive on `events()`; `cancel()` stops it."""

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop):
        self.req = req
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.finished = False

    def cancel(self):
        self.cancelled.set()

    def emit(self, event):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            self.cancelled.set()

    async def events(self, idle_s: float | None = None) -> AsyncIterator:
        """Events until (and including) Done or Error; with `idle_s`, None after every
        idle_s seconds without one (a stream sends a keep-alive then)."""
        while True:
            if idle_s is None:
                ev = await self.queue.get()
            else:
                try:
                    ev = await asyncio.wait_for(self.queue.get(), idle_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
            yield ev
            if isinstance(ev, (Done, Error)):
                return


class Engine:
    def __init__(self, model, max_queue: int = 64, request_timeout: float | None = 600.0,
                 stepper_factory=None, metrics=None, kv_slots: int = 1):
        self.model = model
        # One KV cache per conversation kept warm. Clients such as Claude Code interleave
        # a long conversation with short side requests; with one cache each switch would
        # prefill the whole conversation again. Each slot costs a full context of KV memory.
        self.kv_slots = max(1, kv_slots)
        self._sessions: list = []  # most recently used last
        self.max_queue = max_queue  # waiting requests, the running one not counted
        self.request_timeout = request_timeout
        self.stepper_factory = stepper_factory  # (session, params) -> stepper, for speculative decoding
        self.metrics = metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        cf = model.family.chat_format
        self.reasoning_markers = tuple(cf.reasoning_markers)

    # -- lifecycle --------------------------------------------------------------------
    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="luce-engine", daemon=True)
            self._thread.start()

    def close(self):
        with self._cv:
            self._stop = True
            for job in self._waiting:
                job.cancel()
            if self._running:
                self._running.cancel()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    # -- the asyncio side -------------------------------------------------------------
    def submit(self, req: Request, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        job = Job(req, loop or asyncio.get_running_loop())
        with self._cv:
            if self._stop:
                raise QueueFull("the server is shutting down")
            # a request is only refused when it would have to wait behind a full queue
            if len(self._waiting) >= self.max_queue and (self._running is not None or self._waiting):
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            self._waiting.append(job)
            self._cv.notify()
        self._gauge()
        return job

    def _gauge(self):
        if self.metrics:
            self.metrics.queue(len(self._waiting), 1 if self._running else 0)

    # -- the worker thread --------------------------------------------------------------
    def _worker(self):
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self._waiting.popleft()
                self._running = job
            self._gauge()
            try:
                self._run(job)
            except Exception as e:  # a failed generation must not take the server down
                log.exception("generation failed")
                job.emit(Error(f"generation failed: {type(e).__name__}: {e}"))
            finally:
                with self._cv:
                    self._running = None
                self._gauge()

    def _run(self, job: Job):
        req = job.req
        model = self.model
        t_start = time.perf_counter()
        timings = Timings(queued_ms=(t_start - job.submitted) * 1000)
        usage = Usage(prompt_tokens=len(req.prompt_ids))
        timeout = req.timeout_s if req.timeout_s is not None else self.request_timeout
        deadline = job.submitted + timeout if timeout else None
        if job.cancelled.is_set():
            job.emit(Done("cancelled", usage, timings))
            return
        if deadline is not None and t_start >= deadline:
            job.emit(Error(f"request timed out after {timeout:g} s waiting in the queue", 503, "timeout"))
            return

        parser = None
        if not req.raw:
            parser = OutputParser(reasoning=req.parse_reasoning, tool_format="auto" if req.tools else None,
                                  tools=req.tools, starts_in_reasoning=req.starts_in_reasoning)
        sampling = dict(req.sampling)
        max_tokens = sampling.pop("max_tokens", None)
        if max_tokens is None:
            max_tokens = max(0, model.n_ctx - len(req.prompt_ids))
        budget = req.reasoning_budget if req.parse_reasoning else None
        in_reasoning = req.starts_in_reasoning
        reasoning_open = in_reasoning or req.parse_reasoning  # reasoning may still start
        generated: list[int] = []
        n_calls = 0
        first_token_at = None
        finish = "stop"
        stop_sequence = None
        prompt = list(req.prompt_ids)
        session = self._session_for(prompt)
        job.emit(Started(_common_prefix(session.tokens, prompt[:-1])))

        def forward_events(events):
            nonlocal in_reasoning, n_calls, reasoning_open
            for ev in events:
                if isinstance(ev, ReasoningDelta):
                    in_reasoning = True
                    if req.reasoning_budget == 0:
                        # thinking was turned off: what the model began anyway is not shown
                        continue
                elif isinstance(ev, (TextDelta, ToolCall)):
                    in_reasoning = reasoning_open = False
                    if isinstance(ev, ToolCall):
                        if req.single_tool_call and n_calls:
                            continue  # a second call the client said it cannot take
                        n_calls += 1
                elif isinstance(ev, InvalidToolCall):
                    log.warning("dropped a tool call that does not parse (%s): %.200r", ev.error, ev.text)
                job.emit(ev)

        if parser and req.prefill:
            # the answer's opening was written into the prompt; the parser must read it as
            # the model's own words
            forward_events(parser.feed(req.prefill))
        forced_close = budget == 0 and in_reasoning
        phase = 0
        while True:
            if forced_close:
                # The budget is spent: close the reasoning the way the model would, and
                # continue from there (the cached prefix makes this a small prefill).
                close = "\n" + self.reasoning_markers[1] + "\n\n"
                ids = model.tokenize(close, add_special=False)
                generated.extend(ids)
                usage.completion_tokens += len(ids)
                if parser:
                    forward_events(parser.feed(close))
                in_reasoning = reasoning_open = False
                budget = None
                forced_close = False
            remaining = max_tokens - usage.completion_tokens
            if remaining <= 0:
                finish = "length"
                break
            params = dict(sampling, max_tokens=remaining)
            full = prompt + generated
            stepper = None
            if self.stepper_factory is not None:
                stepper = self.stepper_factory(session, model.sampling_params(**params))
            if phase == 0:
                # what prefill will take from the cache, known even if the stats never come
                usage.cached_tokens = _common_prefix(session.tokens, full[:-1])
            gen = model.stream(full, session=session, stepper=stepper, **params)
            phase_finish = None
            phase_t0, phase_stats = time.perf_counter(), False
            try:
                for d in gen:
                    if d.token_ids and first_token_at is None:
                        first_token_at = time.perf_counter()
                        timings.ttft_ms = (first_token_at - t_start) * 1000
                        if self.metrics:
                            self.metrics.first_token(first_token_at - job.submitted)
                    generated.extend(d.token_ids)
                    usage.completion_tokens += len(d.token_ids)
                    if in_reasoning:
                        usage.reasoning_tokens += len(d.token_ids)
                    if d.text:
                        if parser:
                            forward_events(parser.feed(d.text))
                        else:
                            job.emit(TextDelta(d.text))
                    if d.stats is not None:
                        self._account(d.stats, timings, usage, first_phase=phase == 0)
                        phase_stats = True
                    if d.finish_reason:
                        phase_finish = d.finish_reason
                        break
                    if job.cancelled.is_set():
                        phase_finish = "cancelled"
                        break
                    if deadline is not None and time.perf_counter() >= deadline:
                        phase_finish = "timeout"
                        break
                    if budget is not None and in_reasoning and usage.reasoning_tokens >= budget:
                        phase_finish = "budget"
                        break
                    if req.single_tool_call and n_calls:
                        phase_finish = "stop"
                        break
            finally:
                gen.close()
            if stepper is not None:  # speculative decoding: this phase's draft and verify time
                timings.draft_ms += stepper.counters.draft_s * 1000
                timings.verify_ms += stepper.counters.verify_s * 1000
            if not phase_stats:
                # stopped early: the generator's own stats never came, so measure the wall time
                elapsed = (time.perf_counter() - phase_t0) * 1000
                if phase == 0 and first_token_at is not None:
                    timings.prompt_ms = timings.ttft_ms
                    timings.prompt_n = len(prompt) - usage.cached_tokens
                    elapsed -= timings.ttft_ms
                timings.predicted_ms += max(0.0, elapsed)
            phase += 1
            if phase_finish == "budget":
                forced_close = True
                continue
            finish = phase_finish or "stop"
            break

        if parser:
            forward_events(parser.finish())
        if finish == "stop" and req.sampling.get("stop"):
            text = model.detokenize(generated)
            hits = [(text.find(s), s) for s in req.sampling["stop"] if s and s in text]
            if hits:
                stop_sequence = min(hits)[1]
        if finish == "stop" and n_calls:
            finish = "tool_calls"
        timings.predicted_n = usage.completion_tokens
        if self.metrics:
            self.metrics.done(req.api, usage, timings, finish)
        job.emit(Done(finish, usage, timings, stop_sequence))

    def _session_for(self, prompt: list[int]):
        """The cache sharing the longest prefix with `prompt`; a fresh one while slots are
        free and no cache shares even half of it; else the least recently used."""
        if not self._sessions:
            self._sessions.append(self.model.session)
        best = max(self._sessions, key=lambda s: _common_prefix(s.tokens, prompt))
        shared = _common_prefix(best.tokens, prompt)
        if shared * 2 < len(prompt):
            empty = next((s for s in self._sessions if not s.tokens), None)
            if empty is not None:
                best = empty
            elif len(self._sessions) < self.kv_slots:
                best = self.model.new_session()
                self._sessions.append(best)
            elif shared == 0:
                best = self._sessions[0]
        self._sessions.remove(best)
        self._sessions.append(best)
        return best

    def _account(self, stats, timings: Timings, usage: Usage, first_phase: bool):
        # a generation may run in phases (reasoning budget); the first one saw the prompt
        if first_phase:
            usage.cached_tokens = stats.cached_tokens
            timings.prompt_n = stats.prompt_tokens - stats.cached_tokens
            timings.prompt_ms = stats.prefill_s * 1000
        else:
            timings.predicted_ms += stats.prefill_s * 1000
        timings.predicted_ms += stats.decode_s * 1000
        if stats.acceptance_length and self.stepper_factory is not None:
            timings.acceptance_length = stats.acceptance_length


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
