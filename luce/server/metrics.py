"""Prometheus metrics. Each app has its own registry, so several servers (tests) can live
in one process without their counters colliding."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("luce_requests", "HTTP requests by API, path and status code",
                                ["api", "path", "status"], registry=r)
        self.generations = Counter("luce_generations", "Finished generations by API and finish reason",
                                   ["api", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("luce_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("luce_prompt_cached_tokens", "Prompt tokens served from the KV cache",
                                     registry=r)
        self.completion_tokens = Counter("luce_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("luce_time_to_first_token_seconds", "Time from arrival to the first generated token "
                              "(queue wait included)", buckets=_TIME_BUCKETS, registry=r)
        self.decode_rate = Histogram("luce_decode_tokens_per_second", "Decode speed of each generation",
                                     buckets=_RATE_BUCKETS, registry=r)
        self.prefill_rate = Histogram("luce_prefill_tokens_per_second", "Prefill speed of each generation",
                                      buckets=_RATE_BUCKETS, registry=r)
        self.last_decode_rate = Gauge("luce_last_decode_tokens_per_second", "Decode speed of the last generation",
                                      registry=r)
        self.queue_depth = Gauge("luce_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("luce_requests_running", "Requests generating now (0 or 1)", registry=r)
        self.acceptance = Gauge("luce_speculative_acceptance_length",
                                "Tokens per target forward in the last speculative generation", registry=r)
        self.draft_seconds = Counter("luce_speculative_draft_seconds", "Time spent drafting", registry=r)
        self.verify_seconds = Counter("luce_speculative_verify_seconds", "Time spent in target verification",
                                      registry=r)

    def request(self, api: str, path: str, status: int):
        self.requests.labels(api, path, str(status)).inc()

    def queue(self, waiting: int, running: int):
        self.queue_depth.set(waiting)
        self.running.set(running)

    def first_token(self, seconds: float):
        self.ttft.observe(seconds)

    def done(self, api: str, usage, timings, finish: str):
        self.generations.labels(api or "unknown", finish).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        if timings.predicted_ms > 0 and usage.completion_tokens:
            rate = usage.completion_tokens / timings.predicted_ms * 1000
            self.decode_rate.observe(rate)
            self.last_decode_rate.set(rate)
        if timings.prompt_ms > 0 and timings.prompt_n:
            self.prefill_rate.observe(timings.prompt_n / timings.prompt_ms * 1000)
        if timings.acceptance_length:
            self.acceptance.set(timings.acceptance_length)
        self.draft_seconds.inc(timings.draft_ms / 1000)
        self.verify_seconds.inc(timings.verify_ms / 1000)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
