"""One internal request, whatever API it came from, and the events its generation yields.

The three HTTP adapters parse into `Request` and turn the event stream back into their
own JSON; nothing below the adapters knows which API a request used.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# The parser's events are the stream's events: adapters see exactly what it produced.
from ..text.output_parser import InvalidToolCall, ReasoningDelta, TextDelta, ToolCall  # noqa: F401

# Reasoning budgets for the named effort levels (OpenAI reasoning_effort /
# reasoning.effort). None: no budget.
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": None, "xhigh": None}


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: dict = field(default_factory=dict)  # SamplingParams keywords
    tools: list[dict] | None = None  # OpenAI form; None: tool-call text is plain text
    parse_reasoning: bool = False
    starts_in_reasoning: bool = False  # the prompt already opened <think>
    reasoning_budget: int | None = None  # tokens of reasoning before </think> is forced
    raw: bool = False  # /v1/completions: text out as generated, no parsing
    prefill: str = ""  # the start of the answer, already in prompt_ids (a forced tool call's opening)
    single_tool_call: bool = False  # parallel tool calls not wanted: stop after the first call
    stream: bool = False
    timeout_s: float | None = None
    api: str = ""
    model: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: float = field(default_factory=time.time)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    queued_ms: float = 0.0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    ttft_ms: float = 0.0
    acceptance_length: float = 0.0
    draft_ms: float = 0.0  # speculative decoding: time in the drafter, and in target verification
    verify_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # llama.cpp's field names, which Open WebUI and other clients already display
        return {
            "queued_ms": round(self.queued_ms, 3),
            "prompt_n": self.prompt_n, "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(self.prompt_n / self.prompt_ms * 1000, 3) if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n, "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": round(self.predicted_n / self.predicted_ms * 1000, 3)
            if self.predicted_ms > 0 else 0.0,
            "ttft_ms": round(self.ttft_ms, 3),
            **({"acceptance_length": round(self.acceptance_length, 3), "draft_ms": round(self.draft_ms, 3),
                "verify_ms": round(self.verify_ms, 3)} if self.acceptance_length else {}),
        }


@dataclass
class Started:
    """The request got the model: how many prompt tokens its prefill takes from the KV
    cache (emitted once, before the prefill), for an API that reports them up front."""
    cached_tokens: int


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "tool_calls" | "cancelled" | "timeout"
    usage: Usage
    timings: Timings
    stop_sequence: str | None = None


@dataclass
class Error:
    """Generation failed after the request was accepted."""
    message: str
    status: int = 500
    kind: str = "server_error"
