"""What a model's chat template implies for reading its output.

The template a GGUF carries shows which tool-call syntax the model was trained on and
whether it thinks in ``<think>`` blocks; the rendered prompt shows whether the template
already opened one. This module turns those into `OutputParser` settings, so the server
need not know model families by name. (A family's declared format lives in
`luce.models.family.ChatFormat`; this reads what the model file itself says.)
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .output_parser import OutputParser

__all__ = ["DetectedFormat", "detect_chat_format", "prompt_opens_reasoning", "make_output_parser",
           "default_template_kwargs", "supports_tools"]


@dataclass(frozen=True)
class DetectedFormat:
    name: str                 # "qwen3_coder", "hermes", "llama3", "chatml", "generic"
    tool_format: str | None   # OutputParser's tool_format
    reasoning: bool           # the model may open <think> blocks


def detect_chat_format(template_source: str | None) -> DetectedFormat:
    src = template_source or ""
    reasoning = "<think>" in src or "</think>" in src
    if "<function=" in src and "<parameter=" in src:
        return DetectedFormat("qwen3_coder", "qwen3_coder", reasoning)
    if "<tool_call>" in src:
        return DetectedFormat("hermes", "hermes", reasoning)
    if "<|start_header_id|>" in src and ("ipython" in src or '"parameters"' in src):
        return DetectedFormat("llama3", "json", reasoning)
    if "<|im_start|>" in src:
        # plain ChatML (SmolLM2): no trained tool syntax; luce's ChatML fallback offers
        # tools in the Hermes format, and "auto" reads that as well as the others
        return DetectedFormat("chatml", "auto", reasoning)
    return DetectedFormat("generic", "auto", reasoning)


def supports_tools(template_source: str | None) -> bool:
    """Whether the template shows tools to the model at all. SmolLM2's does not: a
    request with tools would reach the model without them, so a server may prefer
    `ChatTemplate.chatml()`, which offers them in the Hermes format, for such requests."""
    return bool(template_source) and "tools" in template_source


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` (DeepSeek-R1 distills,
    Qwen3 thinking models): the output then starts as reasoning without a tag of its own."""
    tail = prompt.rstrip()
    return tail.endswith("<think>")


def make_output_parser(template_source: str | None, prompt: str, tools: list[dict] | None = None,
                       **kwargs) -> OutputParser:
    """An OutputParser set up for this template and this rendered prompt.

    With tools offered it reads every format ("auto"), not only the family's own: small
    models drift (Qwen2.5 answers with bare JSON, Qwen3-Coder with Hermes JSON), and a
    bare JSON object only counts when it names an offered tool. With no tools offered,
    tool-call markup is not parsed: a client that sent no tools cannot take calls back,
    and the text is more use to it as content."""
    fmt = detect_chat_format(template_source)
    kwargs.setdefault("reasoning", fmt.reasoning or prompt_opens_reasoning(prompt))
    kwargs.setdefault("tool_format", "auto" if tools else None)
    kwargs.setdefault("starts_in_reasoning", prompt_opens_reasoning(prompt))
    return OutputParser(tools=tools, **kwargs)


def default_template_kwargs(template_source: str | None, now: datetime | None = None) -> dict:
    """Variables some templates read but nobody passes: Llama 3.x prints `date_string` as
    "Today Date" and otherwise shows a fixed date from 2024."""
    src = template_source or ""
    out = {}
    if "date_string" in src:
        out["date_string"] = (now or datetime.now()).strftime("%d %b %Y")
    return out
