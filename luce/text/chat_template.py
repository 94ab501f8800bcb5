"""Chat templates: the Jinja program a GGUF carries to turn messages into a prompt.

A template comes from the model file, so it is untrusted code. It runs in jinja2's
immutable sandbox, and on top of that:
- attribute or item names starting with "_" are refused when the template compiles, so a
  template that reaches for Python internals (``''.__class__.__mro__``) fails before any
  of it runs; names built at run time hit the sandbox and fail the render;
- ``*`` and ``**`` are bounded and the output has a size limit, so a template cannot make
  the server allocate gigabytes.

The environment mirrors the one Hugging Face transformers renders with (trim_blocks,
lstrip_blocks, loopcontrols, ``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII text), because templates are written and tested against that.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import LuceError

__all__ = ["ChatTemplate", "TemplateError", "CHATML_TEMPLATE", "normalize_messages", "normalize_tools",
           "read_gguf_chat_metadata"]

# Bounds on what one render may build; real templates stay far below them.
MAX_OUTPUT_CHARS = 16 * 1024 * 1024
MAX_REPEAT_CHARS = 1024 * 1024
MAX_POW_BITS = 4096


class TemplateError(LuceError, ValueError):
    """A chat template that cannot compile, refuses the messages, or breaks the sandbox."""


class _RaisedByTemplate(Exception):
    # Distinct from jinja's errors so a template's own raise_exception() message is
    # reported verbatim rather than as a template bug.
    pass


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant spans with it
    for training masks; for rendering a prompt the body is output unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                    if len(seq) * max(n, 0) > MAX_REPEAT_CHARS:
                        raise SecurityError("chat template builds a sequence that is too large")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                if max(abs(left), 2).bit_length() * right > MAX_POW_BITS:
                    raise SecurityError("chat template computes a number that is too large")
        return super().call_binop(context, operator, left, right)

    def unsafe_undefined(self, obj, attribute):
        # The stock sandbox returns an Undefined that only fails when used, so
        # `{{ x.__class__ }}` would render as "" and hide the attempt.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja's own tojson HTML-escapes <, >, & and ', which would put
    # \u003c into prompts where the model was trained on plain text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_json_default)


def _json_default(value):
    if isinstance(value, jinja2.Undefined):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _raise_exception(message):
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt):
    return datetime.now().strftime(str(fmt))


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    if _version_tuple(jinja2.__version__) < (3, 1, 6):
        # earlier releases have published sandbox escapes (through str.format and |attr)
        raise TemplateError(f"jinja2 {jinja2.__version__} is too old to run untrusted chat templates; "
                            "pip install 'jinja2>=3.1.6'")
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                   extensions=[jinja2.ext.loopcontrols, _GenerationTag],
                   undefined=jinja2.Undefined)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    # The stock globals are the real `dict` type and jinja's Namespace; like transformers,
    # hand templates stand-ins that do the same jobs and expose nothing else.
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing "_" names, which could shadow its internals."""

    def __init__(*args, **kwargs):  # same signature trick as Namespace: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed")


def _check_static(ast: jinja2.nodes.Template) -> None:
    for node in ast.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.NSRef)):
        if isinstance(node, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)):
            name = node.attr
        elif isinstance(node.arg, jinja2.nodes.Const) and isinstance(node.arg.value, str):
            name = node.arg.value
        else:
            continue
        if name.startswith("_"):
            raise TemplateError(f"chat template line {node.lineno}: access to {name!r} is not allowed "
                                "(templates may not reach Python internals)")
    # `x|attr('__class__')` names the attribute as a filter argument
    for node in ast.find_all(jinja2.nodes.Filter):
        if node.name == "attr":
            for arg in node.args:
                if isinstance(arg, jinja2.nodes.Const) and str(arg.value).startswith("_"):
                    raise TemplateError(f"chat template line {node.lineno}: access to {arg.value!r} "
                                        "is not allowed (templates may not reach Python internals)")


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    env = _environment()
    try:
        ast = env.parse(source)
    except TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from None
    _check_static(ast)
    try:
        return env.from_string(ast)
    except TemplateSyntaxError as e:  # pragma: no cover - parse already succeeded
        raise TemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from None


class _Arguments(dict):
    """Tool-call arguments as a dict, which is what transformers-era templates expect
    (``arguments|tojson``, ``arguments|items``), that still concatenates as the JSON text
    older templates expect (``'...' + tool['function']['arguments']``)."""

    def __str__(self):
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        if isinstance(other, str):
            return str(self) + other
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, str):
            return other + str(self)
        return NotImplemented


_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


def _content_text(content, role: str):
    if content is None:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") in _TEXT_PART_TYPES:
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TemplateError(f"{role} message: content part of type {kind!r} is not supported "
                                    "(only text)")
        return "\n".join(texts)
    if isinstance(content, dict):
        # tool results are sometimes objects; templates print them
        return json.dumps(content, ensure_ascii=False)
    return str(content)


def _arguments(value, where: str):
    if isinstance(value, dict):
        return _Arguments(value)
    if value is None or value == "":
        return _Arguments()
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            raise TemplateError(f"{where}: arguments are not valid JSON: {value[:80]!r}") from None
        if isinstance(parsed, dict):
            return _Arguments(parsed)
        raise TemplateError(f"{where}: arguments must be a JSON object, got {type(parsed).__name__}")
    raise TemplateError(f"{where}: arguments must be an object or a JSON string")


def _tool_call(call: dict, where: str) -> dict:
    if not isinstance(call, dict):
        raise TemplateError(f"{where}: a tool call must be an object")
    fn = call.get("function")
    if isinstance(fn, dict):
        fn = dict(fn)
    else:
        # flat form {"name", "arguments"} as some clients send it
        fn = {"name": call.get("name"), "arguments": call.get("arguments", call.get("input"))}
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise TemplateError(f"{where}: tool call without a function name")
    fn["arguments"] = _arguments(fn.get("arguments"), f"{where} ({fn['name']})")
    out = {k: v for k, v in call.items() if k not in ("name", "arguments", "input")}
    out["type"] = call.get("type") or "function"
    out["function"] = fn
    return out


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value):
    """`value` rebuilt from plain JSON types. Templates are untrusted and the sandbox only
    knows the methods of builtin types; an object from a caller (an enum, a pydantic
    model, an array) could offer a method that does harm, so it becomes a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: list[dict], none_content: str | None = None) -> list[dict]:
    """Copies of the messages in the shape templates are written for: string content
    (text-part lists joined; a missing or null content becomes `none_content`) and tool
    calls as ``{"id", "type": "function", "function": {"name", "arguments": dict}}`` with
    arguments parsed from JSON text."""
    if not isinstance(messages, (list, tuple)):
        raise TemplateError("messages must be a list")
    out = []
    for i, m in enumerate(_plain(list(messages))):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TemplateError(f"message {i}: must be an object with a string 'role'")
        msg = dict(m)
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            # clients name it differently; Qwen3-style templates read reasoning_content, gpt-oss thinking
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        content = _content_text(m.get("content"), m["role"])
        msg["content"] = none_content if content is None else content
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [_tool_call(c, f"message {i} tool call {j}") for j, c in enumerate(calls)]
        elif "tool_calls" in msg:
            # Llama 3 tests `'tool_calls' in message`; an empty list must not take that branch
            del msg["tool_calls"]
        out.append(msg)
    return out


def normalize_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tools in the OpenAI form ``{"type": "function", "function": {name, description,
    parameters}}``; bare function objects and Anthropic's ``input_schema`` are wrapped."""
    if not tools:
        # None, not []: Llama 3 templates test `tools is not none` to enable tool use
        return None
    out = []
    for i, t in enumerate(_plain(list(tools))):
        if not isinstance(t, dict):
            raise TemplateError(f"tool {i}: must be an object")
        if isinstance(t.get("function"), dict):
            out.append(t if t.get("type") else {"type": "function", **t})
            continue
        if not isinstance(t.get("name"), str):
            raise TemplateError(f"tool {i}: needs a function name")
        fn = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        params = t.get("parameters", t.get("input_schema"))
        fn["parameters"] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplate:
    """A compiled chat template. Compilation is cached by source, so building one per
    request is cheap."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("chat template is empty")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._template = _compile(source)

    @classmethod
    def chatml(cls, bos_token: str = "", eos_token: str = "<|im_end|>") -> "ChatTemplate":
        """The fallback for a model file without a template: ChatML, with tools offered and
        called in the Hermes ``<tool_call>`` format that the output parser reads."""
        return cls(CHATML_TEMPLATE, bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def from_gguf(cls, path, name: str | None = None) -> "ChatTemplate":
        """The template stored in a GGUF file (``tokenizer.chat_template``, or
        ``tokenizer.chat_template.<name>``), falling back to ChatML when there is none."""
        key = f"tokenizer.chat_template.{name}" if name else "tokenizer.chat_template"
        meta = read_gguf_chat_metadata(path, key)
        source = meta.get(key)
        if not source:
            return cls.chatml(bos_token=meta.get("bos_token", ""))
        return cls(source, bos_token=meta.get("bos_token", ""), eos_token=meta.get("eos_token", ""))

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **extra) -> str:
        clash = _RESERVED & extra.keys()
        if clash:
            raise TemplateError(f"extra template variables may not replace {sorted(clash)}")
        variables: dict[str, Any] = _plain(dict(extra))
        variables.update(messages=normalize_messages(messages), tools=normalize_tools(tools),
                         add_generation_prompt=bool(add_generation_prompt),
                         bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return self._generate(variables)
        except TemplateError as first:
            # An assistant turn with only tool calls has content null. Some templates test
            # `content is not none` and need the null; others do `'</think>' in content`
            # and crash on it. Try the faithful form first, then an empty string (what
            # llama.cpp does for templates that need non-null content).
            if getattr(first, "_template_bug", False) and any(
                    m.get("content") is None for m in variables["messages"]):
                variables["messages"] = normalize_messages(messages, none_content="")
                return self._generate(variables)
            raise

    def _generate(self, variables: dict[str, Any]) -> str:
        try:
            size = 0
            pieces = []
            for piece in self._template.generate(**variables):
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateError("chat template output exceeds the size limit")
                pieces.append(piece)
            return "".join(pieces)
        except TemplateError:
            raise
        except _RaisedByTemplate as e:
            raise TemplateError(f"chat template refused the conversation: {e}") from None
        except SecurityError as e:
            raise TemplateError(f"chat template broke the sandbox: {e}") from None
        except jinja2.TemplateError as e:
            raise _bug(f"chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
                OverflowError, RecursionError) as e:
            # A template that assumed a shape these messages don't have.
            raise _bug(f"chat template failed: {type(e).__name__}: {e}") from None

    def __repr__(self):
        return f"ChatTemplate({len(self.source)} chars)"


def _bug(message: str) -> TemplateError:
    err = TemplateError(message)
    err._template_bug = True
    return err


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_chat_metadata(path, template_key: str = "tokenizer.chat_template") -> dict:
    """`template_key`'s value and the BOS/EOS token texts of a GGUF, read from its header
    alone. gguf.GGUFReader would build objects for every token and tensor first, which
    takes seconds on a 150k-token vocabulary."""
    import struct

    def scalar(f, fmt):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string(f):
        return f.read(scalar(f, "<Q")).decode("utf-8", errors="replace")

    def skip(f, vtype):
        if vtype == _GGUF_STRING:
            f.seek(scalar(f, "<Q"), 1)
        elif vtype == _GGUF_ARRAY:
            etype, n = scalar(f, "<I"), scalar(f, "<Q")
            if etype in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[etype]) * n, 1)
            else:
                for _ in range(n):
                    skip(f, etype)
        elif vtype in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[vtype]), 1)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    out: dict = {}
    ids: dict[str, int] = {}
    tokens_at = None
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = scalar(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        scalar(f, "<Q")  # tensor count
        for _ in range(scalar(f, "<Q")):
            key, vtype = string(f), scalar(f, "<I")
            if key == template_key and vtype == _GGUF_STRING:
                out[key] = string(f)
            elif key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id") \
                    and vtype in _GGUF_SCALARS:
                ids[key.split(".")[-1]] = int(scalar(f, _GGUF_SCALARS[vtype]))
            else:
                if key == "tokenizer.ggml.tokens" and vtype == _GGUF_ARRAY:
                    tokens_at = f.tell()
                skip(f, vtype)
        if tokens_at is not None and ids:
            f.seek(tokens_at)
            etype, n = scalar(f, "<I"), scalar(f, "<Q")
            wanted = {v: k[:-len("_id")] for k, v in ids.items()}  # -> "bos_token", "eos_token"
            for i in range(min(n, max(wanted) + 1) if etype == _GGUF_STRING else 0):
                text = string(f)
                if i in wanted:
                    out[wanted[i]] = text
    return out


CHATML_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{% endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}
"""
