"""What a model family declares: data, validated when it is registered."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..gguf_file import GGUFFile
from .config import ModelConfig


@dataclass(frozen=True)
class DraftSpec:
    """A draft a family pairs with: `kind` is "model" (same-tokenizer autoregressive
    draft; `model` is a path, `repo:file`, or a callable returning a path) or "lookup"
    (prompt n-gram lookup, no model)."""
    kind: str
    model: Any = None
    description: str = ""


@dataclass(frozen=True)
class ChatFormat:
    tool_call_format: str | None = "auto"  # "hermes", "qwen-xml", "json", None
    reasoning: bool = False  # emits <think>...</think>
    reasoning_markers: tuple[str, str] = ("<think>", "</think>")


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    read_config: Callable[[GGUFFile], ModelConfig]
    forward: Callable = None  # defaults to models.transformer.forward
    chat_format: ChatFormat = field(default_factory=ChatFormat)
    sampling_defaults: dict = field(default_factory=dict)
    drafts: tuple[DraftSpec, ...] = ()
    optimizations: dict = field(default_factory=dict)
    plugin: str = "luce"  # the plugin/distribution that registered it

    def run_forward(self, *args, **kwargs):
        from . import transformer
        return (self.forward or transformer.forward)(*args, **kwargs)
