"""Split a model's streamed output into content, reasoning and tool calls.

The parser is fed decoded text in whatever pieces the detokenizer produces and returns
typed events. The result does not depend on how the text was cut: feeding it one
character at a time gives the same events, once adjacent deltas are joined (`coalesce`),
as feeding it whole.

Formats read:
- reasoning: ``<think>...</think>`` at the start of the output, or from the first token
  when the prompt already opened ``<think>`` (``starts_in_reasoning``);
- Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- Qwen3-Coder: ``<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>``,
  also without the ``<tool_call>`` wrapper, which that model sometimes drops;
- Llama 3.x: the whole output (optionally after ``<|python_tag|>``) is
  ``{"name": ..., "parameters"|"arguments": {...}}``, a list of them, or several
  separated by ``;``; also inside a ```json fence, as small Qwen2.5-Coder models write it.

Rules, so that clients never see half a tag and never lose a real answer:
- Text that might be the start of a tag is held back until the next piece decides it.
- A ``<tool_call>`` block that does not parse is dropped from the content and reported as
  `InvalidToolCall` (the model meant to call a tool; echoing the markup to the user helps
  no one). A block still open when the output ends is parsed as if it were closed.
- A block ends where its structure ends (the JSON object, or ``</parameter>`` ...
  ``</function>``), not at the first ``</tool_call>``: arguments are free text, and a
  file being written may well contain that tag. Only a block with no such structure is
  cut at the first closing tag.
- Bare JSON has no tag to announce it, so it counts as a tool call only when it parses
  completely into the tool-call shape and (when tools were given) names one of them;
  anything else is content. Once its first key shows it cannot be a call (e.g.
  ``{"answer": ...}``) it streams as content at once.
- Whitespace that separates content from markup (before a tag, after ``</think>`` or
  ``</tool_call>``, at the very start and end of the output) is not content; whitespace
  inside content is kept. Reasoning is trimmed the same way.
- ``<think>`` opens reasoning only at the start of the output (after whitespace); later
  it is content, since models that reason do so first and prose may mention the tag.
- A ``<tool_call>`` naming a tool that was not offered is still a `ToolCall`: the client
  answers it with an error the model can recover from, where dropping it would not.
- An output that ends inside reasoning (no ``</think>``, e.g. cut by max_tokens) stays
  reasoning: it has already been streamed as such.
- Arguments are coerced to the tool's JSON schema: ``"5"`` becomes ``5`` for an integer,
  ``"true"`` becomes ``True`` for a boolean, JSON text becomes an object or array where
  the schema asks for one. Values that do not convert are left as they are.
- Tool calls are emitted whole (`ToolCall`), never as `ToolCallDelta` pieces: the
  arguments can only be coerced once they are complete.
"""
from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Callable, Union

__all__ = [
    "TextDelta", "ReasoningDelta", "ToolCall", "ToolCallDelta", "InvalidToolCall", "Event",
    "OutputParser", "parse_output", "coalesce", "coerce_arguments", "TOOL_FORMATS",
]


@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict
    index: int = 0  # position among this output's tool calls (OpenAI streaming needs it)

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ToolCallDelta:
    """A streamed piece of a tool call. Defined for adapters; OutputParser emits whole
    `ToolCall`s instead (see the module notes)."""
    index: int
    id: str | None
    name: str | None
    arguments_delta: str


@dataclass
class InvalidToolCall:
    """Tool-call markup that did not parse: `text` is the whole block as the model wrote
    it, `error` says what was wrong. Not content; the server should log it."""
    text: str
    error: str


Event = Union[TextDelta, ReasoningDelta, ToolCall, ToolCallDelta, InvalidToolCall]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
PYTHON_TAG = "<|python_tag|>"

# tool_format values and their aliases
TOOL_FORMATS = {
    "auto": "auto",
    "hermes": "hermes", "qwen": "hermes", "qwen2.5": "hermes", "qwen3": "hermes",
    "qwen3_coder": "qwen3_coder", "qwen3-coder": "qwen3_coder", "xml": "qwen3_coder",
    "json": "json", "llama3": "json", "llama3_json": "json",
}

# first keys a bare-JSON tool call can start with
_CALL_KEYS = ("name", "type", "function", "arguments", "parameters")

_CONTENT, _REASONING, _TOOL, _FUNCTION, _JSON = range(5)
_INVALID = "invalid"


class ToolParseError(ValueError):
    pass


class OutputParser:
    """Incremental parser of one model output. `feed` each decoded piece, then `finish`."""

    def __init__(self, reasoning: bool = True, tool_format: str | None = "auto",
                 tools: list[dict] | None = None, starts_in_reasoning: bool = False,
                 id_factory: Callable[[], str] | None = None):
        if tool_format in (None, "none", ""):
            fmt = None
        elif tool_format in TOOL_FORMATS:
            fmt = TOOL_FORMATS[tool_format]
        else:
            raise ValueError(f"unknown tool_format {tool_format!r} (one of {sorted(TOOL_FORMATS)} or None)")
        self.tool_format = fmt
        self.reasoning = reasoning
        self._schemas = _tool_schemas(tools)
        self._markers: tuple[str, ...] = {
            None: (), "json": (), "hermes": (TOOL_OPEN,),
            "qwen3_coder": (TOOL_OPEN, FUNCTION_OPEN), "auto": (TOOL_OPEN, FUNCTION_OPEN),
        }[fmt]
        # Bare JSON is only worth holding output back for when the caller offered tools
        # (or asked for that format by name).
        self._bare_json = fmt == "json" or (fmt == "auto" and bool(self._schemas))
        self._new_id = id_factory or _new_call_id
        self._buf = ""
        self._mode = _REASONING if starts_in_reasoning else _CONTENT
        self._start = True        # at the start of a content segment
        self._first = True        # nothing decided yet: <think> may still open
        self._reopen = starts_in_reasoning  # a model may repeat the <think> its prompt opened
        self._r_start = True      # at the start of reasoning text
        self._ws = ""             # content's trailing whitespace, held until it proves inner
        self._rws = ""            # the same for reasoning
        self._after_json = False  # just after a bare-JSON call: ';' separates calls
        self._swallow_close = False  # after a bare <function=...>: a stray </tool_call> may follow
        self._scan = 0            # where the search for a closing tag resumes
        self._xscan = 0           # how far a structural scan has looked for a new ">"
        self._jscan: _JsonScanner | None = None  # bare JSON being read
        self._jstart = 0          # where that JSON starts (after a ``` fence)
        self._jend: int | None = None
        self._jcalls = None
        self._tscan: _JsonScanner | None = None  # a JSON object inside <tool_call>
        self._tnext = -1          # where the <tool_call> walk resumes
        self._tcount = 0          # objects seen in the current <tool_call>
        self._n_calls = 0
        self._done = False

    # -- public -------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        if self._done:
            raise RuntimeError("OutputParser.feed after finish")
        if not text:
            return []
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        if self._done:
            return []
        events = self._run(final=True)
        self._done = True
        return events

    @property
    def n_tool_calls(self) -> int:
        return self._n_calls

    # -- machinery ----------------------------------------------------------------
    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        step = {_CONTENT: self._content, _REASONING: self._reasoning_step, _TOOL: self._tool,
                _FUNCTION: self._function, _JSON: self._json}
        while step[self._mode](final, events):
            pass
        return events

    def _content(self, final: bool, ev: list[Event]) -> bool:
        buf = self._buf
        if self._start:
            head = buf.lstrip()
            if self._after_json:
                head = head.lstrip("; \t\r\n")
            if not head:
                if final:
                    self._buf = ""
                return False
            if self._swallow_close:
                if head.startswith(TOOL_CLOSE):
                    self._buf = head[len(TOOL_CLOSE):]
                    self._swallow_close = False
                    return True
                if TOOL_CLOSE.startswith(head) and not final:
                    return False
                self._swallow_close = False
            openers = []
            if self._first and self.reasoning:
                openers.append(THINK_OPEN)
            if self._bare_json:
                openers.append(PYTHON_TAG)
            for tag in openers:
                if head.startswith(tag):
                    self._buf = head[len(tag):]
                    if tag == THINK_OPEN:
                        self._mode, self._first = _REASONING, False
                    else:
                        self._enter_json()
                    return True
            if not final and any(tag.startswith(head) for tag in openers):
                return False
            fence = 0
            if self._bare_json and head[0] == "`":
                # Small models (Qwen2.5-Coder-0.5B) put the call in a ```json block.
                m = _FENCE_OPEN.match(head)
                if m and m.end() < len(head):
                    fence = m.end() if head[m.end()] in "{[" else 0
                elif not final and (m or _FENCE_PARTIAL.fullmatch(head)):
                    return False
            self._buf = head
            self._start = self._first = self._after_json = False
            if self._bare_json and (fence or head[0] in "{["):
                self._enter_json(fence)
            return True

        hit = None
        for tag in self._markers:
            p = buf.find(tag)
            if p >= 0 and (hit is None or p < hit[0]):
                hit = (p, tag)
        if hit is not None:
            p, tag = hit
            self._text(buf[:p], ev)
            self._ws = ""  # whitespace before markup is not content
            self._buf = buf[p + len(tag):]
            self._mode = _TOOL if tag == TOOL_OPEN else _FUNCTION
            self._begin_block()
            return True
        if final:
            self._text(buf, ev)
            self._ws = self._buf = ""
            return False
        keep = _partial_tag_len(buf, self._markers)
        self._text(buf[:len(buf) - keep], ev)
        self._buf = buf[len(buf) - keep:]
        return False

    def _reasoning_step(self, final: bool, ev: list[Event]) -> bool:
        buf = self._buf
        if self._r_start:
            head = buf.lstrip()
            if not head:
                if final:
                    self._buf = ""
                return False
            if self._reopen:
                if head.startswith(THINK_OPEN):
                    self._buf = head[len(THINK_OPEN):]
                    self._reopen = False
                    return True
                if THINK_OPEN.startswith(head) and not final:
                    return False
            self._buf = buf = head
            self._r_start = self._reopen = False
        p = buf.find(THINK_CLOSE)
        if p >= 0:
            self._reasoning_text(buf[:p], ev)
            self._rws = ""
            self._buf = buf[p + len(THINK_CLOSE):]
            self._mode, self._start, self._first = _CONTENT, True, False
            return True
        if final:
            self._reasoning_text(buf, ev)
            self._rws = self._buf = ""
            return False
        keep = _partial_tag_len(buf, (THINK_CLOSE,))
        self._reasoning_text(buf[:len(buf) - keep], ev)
        self._buf = buf[len(buf) - keep:]
        return False

    def _begin_block(self):
        self._scan = self._xscan = self._tcount = 0
        self._tscan, self._tnext = None, -1

    def _tool(self, final: bool, ev: list[Event]) -> bool:
        buf = self._buf
        head = buf.lstrip()
        if not final and len(head) < len(FUNCTION_OPEN) and FUNCTION_OPEN.startswith(head):
            return False  # JSON or XML is not decided yet
        # Arguments are free text (a file being written may contain "</tool_call>"), so
        # the block's end is found by walking its structure; only text that has no
        # structure falls back to the first closing tag.
        if head.startswith(FUNCTION_OPEN):
            end = self._xml_end(buf, len(buf) - len(head), final)
        elif head.startswith("{"):
            end = self._json_block_end(buf, len(buf) - len(head))
        else:
            end = _INVALID
        if end is None and not final:
            return False
        if end is not None and end != _INVALID:
            inner_end, after, reopened = end
            if reopened:  # the model forgot </tool_call> and opened the next call
                self._block(buf[:inner_end], TOOL_OPEN + buf[:inner_end], ev)
                self._buf = buf[after:]
                self._begin_block()
            else:
                self._block(buf[:inner_end], TOOL_OPEN + buf[:after], ev)
                self._buf = buf[after:]
                self._mode, self._start = _CONTENT, True
            return True
        # unstructured, or unfinished at the end of the output (a dropped </parameter>)
        close = buf.find(TOOL_CLOSE, self._scan)
        reopen = buf.find(TOOL_OPEN, self._scan)
        if reopen >= 0 and (close < 0 or reopen < close):
            self._block(buf[:reopen], TOOL_OPEN + buf[:reopen], ev)
            self._buf = buf[reopen + len(TOOL_OPEN):]
            self._begin_block()
            return True
        if close >= 0:
            self._block(buf[:close], TOOL_OPEN + buf[:close + len(TOOL_CLOSE)], ev)
            self._buf = buf[close + len(TOOL_CLOSE):]
            self._mode, self._start = _CONTENT, True
            return True
        if final:
            self._block(buf, TOOL_OPEN + buf, ev)
            self._buf = ""
            self._mode, self._start = _CONTENT, True
            return False
        self._scan = max(0, len(buf) - max(len(TOOL_CLOSE), len(TOOL_OPEN)) + 1)
        return False

    def _json_block_end(self, buf: str, start: int):
        """Like _xml_end, for JSON objects: (end of inner text, end of block, whether the
        block ended by opening another <tool_call>), None, or _INVALID."""
        pos = start if self._tnext < 0 else self._tnext
        n = len(buf)
        while True:
            if self._tscan is not None:
                end = self._tscan.end(buf)
                if end is None:
                    return None
                self._tscan, self._tcount = None, self._tcount + 1
                pos = end
            while pos < n and (buf[pos].isspace() or (self._tcount and buf[pos] in ",;")):
                pos += 1
            self._tnext = pos
            if pos < n and buf[pos] == "{":
                self._tscan = _JsonScanner(pos)
                continue
            if self._tcount:
                if buf.startswith(TOOL_CLOSE, pos):
                    return pos, pos + len(TOOL_CLOSE), False
                if buf.startswith(TOOL_OPEN, pos):
                    return pos, pos + len(TOOL_OPEN), True
            if _could_become(buf, pos, TOOL_CLOSE, TOOL_OPEN):
                return None
            return _INVALID

    def _function(self, final: bool, ev: list[Event]) -> bool:
        buf = FUNCTION_OPEN + self._buf  # the marker was consumed in content mode
        end = self._xml_end(buf, 0, final, wrapped=False)
        if end is None and not final:
            return False
        if end is None or end == _INVALID:
            close = buf.find(FUNCTION_CLOSE)
            if close < 0 and not final:
                return False
            after = close + len(FUNCTION_CLOSE) if close >= 0 else len(buf)
            end = (after, after, False)
        self._block(buf[:end[0]], buf[:end[1]], ev)
        self._buf = buf[end[1]:]
        self._mode, self._start, self._swallow_close = _CONTENT, True, True
        return True

    def _xml_end(self, buf: str, pos: int, final: bool, wrapped: bool = True):
        """Where the ``<function=...>`` elements starting at `pos` end: (end of the inner
        text, end of the block including its closing tag, whether that "closing tag"
        opened the next call), None when more text is needed, or _INVALID when the
        text is not of that shape."""
        if not final:
            # every tag that can end a step ends in ">": no new ">", no new answer
            if ">" not in buf[self._xscan:]:
                return None
            self._xscan = len(buf)
        n = len(buf)

        def ws(i):
            while i < n and buf[i].isspace():
                i += 1
            return i

        n_functions = 0
        while True:
            pos = ws(pos)
            if n_functions:
                if not wrapped:
                    return pos_after_function, pos_after_function, False
                if buf.startswith(TOOL_CLOSE, pos):
                    return pos, pos + len(TOOL_CLOSE), False
                if buf.startswith(TOOL_OPEN, pos):
                    return pos, pos + len(TOOL_OPEN), True
                if _could_become(buf, pos, TOOL_CLOSE, TOOL_OPEN, FUNCTION_OPEN):
                    return None
            if not buf.startswith(FUNCTION_OPEN, pos):
                return None if _could_become(buf, pos, FUNCTION_OPEN) else _INVALID
            gt = buf.find(">", pos)
            if gt < 0:
                return None
            pos = gt + 1
            while True:
                pos = ws(pos)
                if buf.startswith(PARAM_OPEN, pos):
                    span = _value_span(buf, pos + len(PARAM_OPEN), final=False)
                    if span is None:
                        return None
                    pos = span[1]
                elif buf.startswith(FUNCTION_CLOSE, pos):
                    pos = pos_after_function = pos + len(FUNCTION_CLOSE)
                    n_functions += 1
                    break
                elif _could_become(buf, pos, PARAM_OPEN, FUNCTION_CLOSE):
                    return None
                else:
                    return _INVALID

    def _enter_json(self, start: int = 0):
        self._mode = _JSON
        self._jscan, self._jstart, self._jend, self._jcalls = None, start, None, None

    def _json(self, final: bool, ev: list[Event]) -> bool:
        if self._jscan is None and not self._jstart:
            self._buf = self._buf.lstrip()  # after <|python_tag|>
        buf, start = self._buf, self._jstart
        if len(buf) <= start:
            if final:
                self._mode, self._start = _CONTENT, False
            return False
        calls, after = None, None
        verdict = _json_head_verdict(buf[start:])
        if verdict:
            if self._jscan is None:
                self._jscan = _JsonScanner(start)
            if self._jend is None:
                self._jend = self._jscan.end(buf)
                if self._jend is not None:
                    self._jcalls = self._json_calls(buf[start:self._jend])
            if self._jend is None:
                if not final:
                    return False
            elif self._jcalls is not None:
                calls, after = self._jcalls, self._jend
                if start:  # the closing fence must follow
                    k = len(buf) - len(buf[after:].lstrip())
                    if buf.startswith("```", k):
                        after = k + 3
                    elif not final and _could_become(buf, k, "```"):
                        return False
                    else:
                        calls = None
        if calls is None:
            # not a tool call after all: the held text (fence included) is content
            self._mode, self._start = _CONTENT, False
            return True
        for name, args in calls:
            ev.append(self._call(name, args))
        self._buf = buf[after:]
        self._mode, self._start, self._after_json = _CONTENT, True, True
        return True

    def _json_calls(self, text: str):
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return None
        items = value if isinstance(value, list) else [value]
        if not items:
            return None
        calls = []
        for item in items:
            try:
                name, args = _call_from_json(item)
            except ToolParseError:
                return None
            if self._schemas and name not in self._schemas:
                return None
            calls.append((name, args))
        return calls

    def _block(self, inner: str, raw: str, ev: list[Event]):
        try:
            calls = parse_tool_block(inner)
        except ToolParseError as e:
            ev.append(InvalidToolCall(raw, str(e)))
            return
        for name, args in calls:
            ev.append(self._call(name, args))

    def _call(self, name: str, args: dict) -> ToolCall:
        schema = self._schemas.get(name)
        if schema:
            args = coerce_arguments(args, schema)
        call = ToolCall(id=self._new_id(), name=name, arguments=args, index=self._n_calls)
        self._n_calls += 1
        return call

    def _text(self, text: str, ev: list[Event]):
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        out, self._ws = self._ws + body, text[len(body):]
        self._first = False
        ev.append(TextDelta(out))

    def _reasoning_text(self, text: str, ev: list[Event]):
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._rws += text
            return
        out, self._rws = self._rws + body, text[len(body):]
        ev.append(ReasoningDelta(out))


# -- helpers ----------------------------------------------------------------------
def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _tool_schemas(tools) -> dict[str, dict]:
    out = {}
    for t in tools or ():
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if isinstance(name, str):
            params = fn.get("parameters", fn.get("input_schema"))
            out[name] = params if isinstance(params, dict) else {}
    return out


_FENCE_OPEN = re.compile(r"```(?:json|JSON)?[ \t]*\n\s*")
_FENCE_PARTIAL = re.compile(r"`{1,3}|```(?:j(?:s(?:o(?:n)?)?)?|J(?:S(?:O(?:N)?)?)?)?[ \t]*")
_JSON_STRUCT = re.compile(r'["{}\[\]]')
_JSON_STRING_STOP = re.compile(r'["\\]')


class _JsonScanner:
    """Finds where the JSON value opening at `start` ({ or [) closes, resuming where it
    left off as the text grows. It balances brackets outside strings and does not
    validate; json.loads judges the result."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_str = start, 0, False

    def end(self, s: str) -> int | None:
        pos, n = self.pos, len(s)
        while True:
            if self.in_str:
                m = _JSON_STRING_STOP.search(s, pos)
                if m is None:
                    self.pos = n
                    return None
                if m.group() == "\\":
                    if m.end() >= n:  # the escaped character has not arrived yet
                        self.pos = m.start()
                        return None
                    pos = m.end() + 1
                    continue
                self.in_str, pos = False, m.end()
                continue
            m = _JSON_STRUCT.search(s, pos)
            if m is None:
                self.pos = n
                return None
            c, pos = m.group(), m.end()
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = pos
                    return pos


def _could_become(buf: str, pos: int, *tags: str) -> bool:
    """Whether the text from `pos` on is short enough to still grow into one of `tags`."""
    rest = buf[pos:]
    return any(len(rest) < len(t) and t.startswith(rest) for t in tags)


def _partial_tag_len(buf: str, tags) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def _json_head_verdict(buf: str) -> bool:
    """False once the start of `buf` shows it is not a tool-call object (or a list of
    them); True while it still may be. Only ever turns from True to False as text grows,
    which keeps the parse independent of how the text was cut."""
    n, i = len(buf), 0
    if buf[0] == "[":
        i = 1
        while i < n and buf[i].isspace():
            i += 1
        if i == n:
            return True
    if buf[i] != "{":
        return False
    i += 1
    while i < n and buf[i].isspace():
        i += 1
    if i == n:
        return True
    if buf[i] != '"':
        return False
    j = buf.find('"', i + 1)
    key = buf[i + 1:] if j < 0 else buf[i + 1:j]
    if j < 0:
        return any(k.startswith(key) for k in _CALL_KEYS)
    return key in _CALL_KEYS


def _call_from_json(obj) -> tuple[str, dict]:
    if not isinstance(obj, dict):
        raise ToolParseError(f"expected a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolParseError('tool call has no "name"')
    if "arguments" in obj:
        args = obj["arguments"]
    else:
        args = obj.get("parameters", {})
    if args is None or args == "":
        args = {}
    if isinstance(args, str):
        # double-encoded arguments, as OpenAI's wire format has them
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ToolParseError(f"arguments of {name!r} are a string that is not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise ToolParseError(f"arguments of {name!r} must be an object, got {type(args).__name__}")
    return name.strip(), args


def parse_tool_block(inner: str) -> list[tuple[str, dict]]:
    """The calls in the text of one tool-call block: JSON objects (Hermes) or
    ``<function=...>`` elements (Qwen3-Coder). Raises ToolParseError."""
    s = inner.strip()
    if not s:
        raise ToolParseError("empty tool call")
    if s.startswith(FUNCTION_OPEN):
        return _parse_functions(s)
    if not s.startswith("{"):
        raise ToolParseError(f"expected a JSON object or <function=...>, got {s[:40]!r}")
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(s):
        try:
            obj, end = decoder.raw_decode(s, pos)
        except json.JSONDecodeError as e:
            raise ToolParseError(f"invalid JSON: {e.msg} at char {e.pos}") from None
        except RecursionError:
            raise ToolParseError("invalid JSON: nested too deeply") from None
        calls.append(_call_from_json(obj))
        pos = end
        while pos < len(s) and (s[pos].isspace() or s[pos] in ",;"):
            pos += 1
    return calls


def _parse_functions(s: str) -> list[tuple[str, dict]]:
    calls, pos, n = [], 0, len(s)
    while True:
        while pos < n and s[pos].isspace():
            pos += 1
        if pos >= n:
            return calls
        if not s.startswith(FUNCTION_OPEN, pos):
            raise ToolParseError(f"unexpected text in tool call: {s[pos:pos + 40]!r}")
        gt = s.find(">", pos)
        if gt < 0:
            raise ToolParseError("unterminated <function=...> tag")
        name = s[pos + len(FUNCTION_OPEN):gt].strip()
        if not name or any(c in name for c in "<\n\"'"):
            raise ToolParseError(f"bad function name {name!r}")
        args, pos = {}, gt + 1
        while True:
            while pos < n and s[pos].isspace():
                pos += 1
            if pos >= n:
                break  # </function> dropped at the end of the output
            if s.startswith(FUNCTION_CLOSE, pos):
                pos += len(FUNCTION_CLOSE)
                break
            if not s.startswith(PARAM_OPEN, pos):
                raise ToolParseError(f"unexpected text in {name!r}: {s[pos:pos + 40]!r}")
            gt = s.find(">", pos)
            if gt < 0:
                raise ToolParseError(f"unterminated <parameter=...> tag in {name!r}")
            pname = s[pos + len(PARAM_OPEN):gt].strip()
            if not pname:
                raise ToolParseError(f"parameter without a name in {name!r}")
            value_end, pos = _value_span(s, gt + 1, final=True)
            value = s[gt + 1:value_end]
            # the template writes "<parameter=p>\nvalue\n</parameter>": one newline each side is format
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            args[pname] = value
        calls.append((name, args))


def _value_span(s: str, start: int, final: bool):
    """(end of a parameter's value, where parsing resumes). Values are free text, so
    only </parameter> ends one; a <parameter= before it means the model dropped the
    close. With neither in sight the answer waits for more text, or, at the end of the
    output, the value runs to </function> or the end."""
    close = s.find(PARAM_CLOSE, start)
    nxt = s.find(PARAM_OPEN, start)
    if close >= 0 and (nxt < 0 or close < nxt):
        return close, close + len(PARAM_CLOSE)
    if nxt >= 0:
        return nxt, nxt
    if not final:
        return None
    fn = s.find(FUNCTION_CLOSE, start)
    end = fn if fn >= 0 else len(s)
    return end, end


# -- schema coercion --------------------------------------------------------------
_INT_RE = re.compile(r"[+-]?\d+")


def coerce_arguments(args: dict, schema: dict) -> dict:
    """`args` with each value converted to what the tool's JSON schema asks for, where a
    conversion exists ("5" -> 5 for integer, "true" -> True, JSON text -> object/array);
    values that do not convert are kept, so the client's own validation reports them."""
    if not isinstance(args, dict) or not isinstance(schema, dict):
        return args
    out = _deep(args, schema)
    return out if isinstance(out, dict) else args


def _is(value, ty) -> bool:
    if ty == "string":
        return isinstance(value, str)
    if ty == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if ty == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ty == "boolean":
        return isinstance(value, bool)
    if ty == "null":
        return value is None
    if ty == "object":
        return isinstance(value, dict)
    if ty == "array":
        return isinstance(value, list)
    return False


def _types(schema: dict) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if isinstance(schema.get("properties"), dict):
        return ["object"]
    if isinstance(schema.get("items"), dict):
        return ["array"]
    return []


def _coerce(value, schema):
    if not isinstance(schema, dict):
        return value
    for key in ("anyOf", "oneOf"):
        subs = [s for s in schema.get(key) or () if isinstance(s, dict)]
        if subs:
            for sub in subs:
                if any(_is(value, t) for t in _types(sub)):
                    return _deep(value, sub)
            for sub in subs:
                converted = _coerce(value, sub)
                if any(_is(converted, t) for t in _types(sub)):
                    return converted
            return value
    types = _types(schema)
    if not types or any(_is(value, t) for t in types):
        return _deep(value, schema)
    for t in types:
        ok, converted = _convert(value, t)
        if ok:
            return _deep(converted, schema)
    return value


def _deep(value, schema):
    if isinstance(value, dict):
        props = schema.get("properties")
        if isinstance(props, dict):
            return {k: _coerce(v, props[k]) if k in props else v for k, v in value.items()}
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            return [_coerce(v, items) for v in value]
    return value


def _convert(value, ty):
    if isinstance(value, str):
        s = value.strip()
        if ty == "integer":
            if _INT_RE.fullmatch(s):
                return True, int(s)
            f = _float(s)
            if f is not None and f.is_integer():
                return True, int(f)
        elif ty == "number":
            if _INT_RE.fullmatch(s):
                return True, int(s)
            f = _float(s)
            if f is not None:
                return True, f
        elif ty == "boolean":
            if s.lower() in ("true", "false"):
                return True, s.lower() == "true"
        elif ty == "null":
            if s.lower() in ("null", "none"):
                return True, None
        elif ty in ("object", "array"):
            parsed = _structured(s)
            if _is(parsed, ty):
                return True, parsed
        return False, None
    if ty == "integer" and isinstance(value, float) and value.is_integer():
        return True, int(value)
    if ty == "string" and value is not None:
        # an object where a string belongs: the JSON text is what the tool can use
        return True, json.dumps(value, ensure_ascii=False)
    return False, None


def _float(s: str):
    try:
        f = float(s)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def _structured(s: str):
    try:
        return json.loads(s)
    except (json.JSONDecodeError, RecursionError):
        pass
    if len(s) > 100_000:
        return None
    try:
        # models sometimes write Python literals ({'a': True}); literal_eval runs no code
        return ast.literal_eval(s)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


# -- conveniences -----------------------------------------------------------------
def parse_output(text: str, **kwargs) -> list[Event]:
    """One-shot parse of a complete output."""
    parser = OutputParser(**kwargs)
    return parser.feed(text) + parser.finish()


def coalesce(events: list[Event]) -> list[Event]:
    """Join adjacent TextDeltas and adjacent ReasoningDeltas: the form in which a
    streamed parse and a one-shot parse are equal."""
    out: list[Event] = []
    for e in events:
        if out and type(e) in (TextDelta, ReasoningDelta) and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out
