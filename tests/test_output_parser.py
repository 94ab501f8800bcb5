"""The streaming output parser: the same events however the text is cut, for every
tool-call format, with reasoning, and with malformed or partial markup."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from luce.text.output_parser import (InvalidToolCall, OutputParser, ReasoningDelta, TextDelta, ToolCall,
                                     coalesce, coerce_arguments, parse_output)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                   "scale": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"}},
    "required": ["city"]}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
TOOLS = [WEATHER, WRITE]


def counter():
    ids = itertools.count()
    return lambda: f"call_{next(ids)}"


def call(name, args, index=0):
    return ToolCall(f"call_{index}", name, args, index)


def parse(text, **kw):
    kw.setdefault("tools", TOOLS)
    return coalesce(parse_output(text, id_factory=counter(), **kw))


def streamed(pieces, **kw):
    kw.setdefault("tools", TOOLS)
    p = OutputParser(id_factory=counter(), **kw)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    return coalesce(events + p.finish())


HERMES_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>'
XML_1 = ("<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
         "<parameter=content>\ndef f():\n    return '<tool_call>'\n\n</parameter>\n</function>\n</tool_call>")

# name -> (output, parser kwargs, expected events after coalesce)
CASES = {
    "plain": ("Hello, world!", {}, [TextDelta("Hello, world!")]),
    "unicode": ("Grüße 🌍 — 你好 <b>bold</b> a<b", {}, [TextDelta("Grüße 🌍 — 你好 <b>bold</b> a<b")]),
    "angle brackets": ("if a < b and c <tools> <tool <think", {}, [TextDelta("if a < b and c <tools> <tool <think")]),
    "trailing partial tag is content": ("see <tool_ca", {}, [TextDelta("see <tool_ca")]),
    "whitespace trimmed at the edges": ("\n\n  Hi\n  there \n\n", {}, [TextDelta("Hi\n  there")]),
    "reasoning": ("<think>\nLet me think.\nStep 2.\n</think>\n\nThe answer is 4.", {},
                  [ReasoningDelta("Let me think.\nStep 2."), TextDelta("The answer is 4.")]),
    "empty reasoning": ("<think>\n\n</think>\n\nOK", {}, [TextDelta("OK")]),
    "reasoning cut off": ("<think>still going", {}, [ReasoningDelta("still going")]),
    "reasoning off": ("<think>x</think>y", {"reasoning": False}, [TextDelta("<think>x</think>y")]),
    "think only at start": ("A <think>b</think>", {}, [TextDelta("A <think>b</think>")]),
    "starts in reasoning": ("I should check.\n</think>\n\nDone.", {"starts_in_reasoning": True},
                            [ReasoningDelta("I should check."), TextDelta("Done.")]),
    "starts in reasoning, model repeats <think>": ("<think>\nhm</think>ok", {"starts_in_reasoning": True},
                                                   [ReasoningDelta("hm"), TextDelta("ok")]),
    "hermes": (HERMES_1, {}, [call("get_weather", {"city": "Paris", "days": 3})]),
    "hermes text before and after": ("Let me look.\n\n" + HERMES_1 + "\n\nDone, 🌦.", {},
                                     [TextDelta("Let me look."), call("get_weather", {"city": "Paris", "days": 3}),
                                      TextDelta("Done, 🌦.")]),
    "hermes two calls": (HERMES_1 + "\n" + HERMES_1.replace("Paris", "Nice"), {},
                         [call("get_weather", {"city": "Paris", "days": 3}),
                          call("get_weather", {"city": "Nice", "days": 3}, 1)]),
    "hermes parameters alias, string arguments": (
        '<tool_call>{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\", \\"metric\\": \\"true\\"}"}'
        "</tool_call>", {}, [call("get_weather", {"city": "Oslo", "metric": True})]),
    "hermes unicode arguments": ('<tool_call>{"name":"get_weather","arguments":{"city":"Zürich 🌧 東京"}}</tool_call>',
                                 {}, [call("get_weather", {"city": "Zürich 🌧 東京"})]),
    "hermes unknown tool still a call": ('<tool_call>{"name": "other", "arguments": {"x": "1"}}</tool_call>', {},
                                         [call("other", {"x": "1"})]),
    "hermes unclosed at end": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n', {},
                               [call("get_weather", {"city": "Rome"})]),
    "hermes forgotten close before next call": (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}\n<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "B"}}</tool_call>', {},
        [call("get_weather", {"city": "A"}), call("get_weather", {"city": "B"}, 1)]),
    "malformed json": ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nSorry.', {},
                       [TextDelta("Checking."),
                        InvalidToolCall('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
                                        "invalid JSON: Expecting value at char 46"),
                        TextDelta("Sorry.")]),
    "malformed: no name": ('<tool_call>{"arguments": {}}</tool_call>', {},
                           [InvalidToolCall('<tool_call>{"arguments": {}}</tool_call>', 'tool call has no "name"')]),
    "malformed: unclosed garbage": ("<tool_call>get_weather(city='x')", {},
                                    [InvalidToolCall("<tool_call>get_weather(city='x')",
                                                     "expected a JSON object or <function=...>, got \"get_weather(city='x')\"")]),
    "reasoning then tool call": ("<think>Need weather.</think>\n" + HERMES_1, {},
                                 [ReasoningDelta("Need weather."), call("get_weather", {"city": "Paris", "days": 3})]),
    "qwen3-coder xml": (XML_1, {}, [call("write_file", {"path": "/tmp/a.py",
                                                        "content": "def f():\n    return '<tool_call>'\n"})]),
    "qwen3-coder coerced": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
                            "<parameter=days>\n2\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
                            "<parameter=scale>\n1.5\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n"
                            "<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n</function>\n</tool_call>", {},
                            [call("get_weather", {"city": "San Francisco", "days": 2, "metric": False, "scale": 1.5,
                                                  "opts": {"a": [1]}, "tags": ["x", "y"]})]),
    "qwen3-coder without <tool_call>, missing </parameter>": (
        "Writing.\n<function=write_file>\n<parameter=path>\nx.txt\n<parameter=content>\nhi\n</function>\n</tool_call>\nok",
        {}, [TextDelta("Writing."), call("write_file", {"path": "x.txt", "content": "hi"}), TextDelta("ok")]),
    "qwen3-coder malformed": ("<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>\nAfter.", {},
                              [InvalidToolCall("<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
                                               "unexpected text in 'get_weather': 'Paris\\n</function>'"), TextDelta("After.")]),
    "qwen3-coder value holding closing tags": (
        "<tool_call>\n<function=write_file>\n<parameter=content>\na</function></tool_call>b\n</parameter>\n"
        "</function>\n</tool_call>", {}, [call("write_file", {"content": "a</function></tool_call>b"})]),
    "qwen3-coder two functions in one block": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n"
        "<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>", {},
        [call("get_weather", {"city": "A"}), call("get_weather", {"city": "B"}, 1)]),
    "llama3 bare json": ('{"name": "get_weather", "parameters": {"city": "Rome", "days": "4"}}', {},
                         [call("get_weather", {"city": "Rome", "days": 4})]),
    "llama3 python_tag, two calls": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "A"}}; '
        '{"name": "get_weather", "parameters": {"city": "B"}}', {},
        [call("get_weather", {"city": "A"}), call("get_weather", {"city": "B"}, 1)]),
    "bare json list": ('[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "write_file", '
                       '"arguments": {"path": "p"}}]', {},
                       [call("get_weather", {"city": "A"}), call("write_file", {"path": "p"}, 1)]),
    "fenced json call (Qwen2.5-Coder-0.5B)": (
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "days": 3\n  }\n}\n```',
        {}, [call("get_weather", {"city": "Paris", "days": 3})]),
    "fenced call, then text": ('```\n{"name": "get_weather", "arguments": {"city": "A"}}\n```\nDone.', {},
                               [call("get_weather", {"city": "A"}), TextDelta("Done.")]),
    "fenced json answer is content": ('```json\n{"city": "A"}\n```', {}, [TextDelta('```json\n{"city": "A"}\n```')]),
    "fenced call without closing fence is content": (
        '```json\n{"name": "get_weather", "arguments": {}} trailing', {},
        [TextDelta('```json\n{"name": "get_weather", "arguments": {}} trailing')]),
    "python fence is content": ("```python\nprint({'a': 1})\n```", {}, [TextDelta("```python\nprint({'a': 1})\n```")]),
    "fence without tools is content": ('```json\n{"name": "get_weather", "arguments": {}}\n```', {"tools": None},
                                       [TextDelta('```json\n{"name": "get_weather", "arguments": {}}\n```')]),
    "json answer is content": ('{"answer": 42, "name": "x"}', {}, [TextDelta('{"answer": 42, "name": "x"}')]),
    "json with unknown tool name is content": ('{"name": "rm_rf", "parameters": {}}', {},
                                              [TextDelta('{"name": "rm_rf", "parameters": {}}')]),
    "json, not a call shape": ('{"name": "get_weather", "parameters": [1]}', {},
                               [TextDelta('{"name": "get_weather", "parameters": [1]}')]),
    "truncated json is content": ('{"name": "get_weather", "parameters": {"city": "Par', {},
                                  [TextDelta('{"name": "get_weather", "parameters": {"city": "Par')]),
    "json then text": ('{"name": "get_weather", "parameters": {"city": "A"}}\nHope that helps', {},
                       [call("get_weather", {"city": "A"}), TextDelta("Hope that helps")]),
    "json without tools is content": ('{"name": "get_weather", "parameters": {}}', {"tools": None},
                                      [TextDelta('{"name": "get_weather", "parameters": {}}')]),
    "json format, no tools": ('{"name": "anything", "parameters": {"a": "1"}}', {"tools": None, "tool_format": "json"},
                              [call("anything", {"a": "1"})]),
    "hermes format ignores bare json": ('{"name": "get_weather", "parameters": {}}', {"tool_format": "hermes"},
                                       [TextDelta('{"name": "get_weather", "parameters": {}}')]),
    "tool parsing off": (HERMES_1, {"tool_format": None}, [TextDelta(HERMES_1)]),
    "json format ignores tags": (HERMES_1, {"tool_format": "llama3"}, [TextDelta(HERMES_1)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_shot(name):
    text, kw, expected = CASES[name]
    assert parse(text, **kw) == expected


@pytest.mark.parametrize("name", list(CASES))
def test_any_cut_gives_the_same_events(name):
    text, kw, expected = CASES[name]
    assert streamed(list(text), **kw) == expected
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]], **kw) == expected, f"cut at {i}: {text[:i]!r}|{text[i:]!r}"
    rng = random.Random(name)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert streamed(pieces, **kw) == expected, pieces


def test_streams_early_and_holds_only_possible_markup():
    p = OutputParser(tools=TOOLS)
    assert p.feed("Hello <tool") == [TextDelta("Hello")]     # the space might precede a tag
    assert p.feed("s> and more") == [TextDelta(" <tools> and more")]
    assert p.feed("\n\n<tool_call>") == []
    assert p.feed('{"name": "get_weather", "arguments": {}}') == []
    events = p.feed("</tool_call>")
    assert [type(e) for e in events] == [ToolCall] and events[0].id.startswith("call_")
    assert p.finish() == []
    assert p.n_tool_calls == 1

    p = OutputParser(tools=TOOLS)
    assert p.feed("<thi") == []
    assert p.feed("nk>Plan") == [ReasoningDelta("Plan")]
    assert p.feed(" more</th") == [ReasoningDelta(" more")]
    assert p.feed("ink>Answer") == [TextDelta("Answer")]


def test_bare_json_answer_streams_once_its_first_key_rules_out_a_call():
    p = OutputParser(tools=TOOLS)
    assert p.feed('{"na') == []
    assert p.feed('me') == []
    assert p.feed('s": [') == [TextDelta('{"names": [')]


def test_feed_after_finish_and_bad_format():
    p = OutputParser()
    p.finish()
    assert p.finish() == []
    with pytest.raises(RuntimeError):
        p.feed("x")
    with pytest.raises(ValueError, match="tool_format"):
        OutputParser(tool_format="yaml")


def test_ids_unique_and_arguments_json():
    events = parse_output(HERMES_1 + HERMES_1, tools=TOOLS)
    assert len({e.id for e in events}) == 2 and [e.index for e in events] == [0, 1]
    assert events[0].arguments_json == '{"city": "Paris", "days": 3}'


def test_long_output_is_linear():
    body = "x" * 20000
    text = ("<think>" + "r" * 20000 + "</think>" + body + '<tool_call>{"name": "write_file", "arguments": '
            '{"content": "' + "y" * 20000 + '"}}</tool_call>')
    t0 = time.perf_counter()
    events = streamed(list(text))
    assert time.perf_counter() - t0 < 3
    assert events[1] == TextDelta(body) and events[2].arguments["content"] == "y" * 20000


SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "s": {"type": "string"},
    "o": {"type": "object", "properties": {"k": {"type": "integer"}}}, "a": {"type": "array", "items": {"type": "integer"}},
    "opt": {"type": ["integer", "null"]}, "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "z": {"type": "null"}}}


@pytest.mark.parametrize("given,expected", [
    ({"n": "5"}, {"n": 5}), ({"n": " -12 "}, {"n": -12}), ({"n": "5.0"}, {"n": 5}), ({"n": 5.0}, {"n": 5}),
    ({"n": "five"}, {"n": "five"}), ({"n": "5.5"}, {"n": "5.5"}), ({"n": True}, {"n": True}),
    ({"x": "2.5"}, {"x": 2.5}), ({"x": "3"}, {"x": 3}), ({"x": "nan"}, {"x": "nan"}),
    ({"b": "true"}, {"b": True}), ({"b": "False"}, {"b": False}), ({"b": "yes"}, {"b": "yes"}),
    ({"s": 5}, {"s": "5"}), ({"s": {"a": 1}}, {"s": '{"a": 1}'}), ({"s": "5"}, {"s": "5"}), ({"s": None}, {"s": None}),
    ({"o": '{"k": "7"}'}, {"o": {"k": 7}}), ({"o": "{'k': 1}"}, {"o": {"k": 1}}), ({"o": "nope"}, {"o": "nope"}),
    ({"a": "[1, \"2\"]"}, {"a": [1, 2]}), ({"a": ["3"]}, {"a": [3]}),
    ({"opt": "null"}, {"opt": None}), ({"opt": "4"}, {"opt": 4}),
    ({"u": "4"}, {"u": "4"}), ({"u": 4}, {"u": 4}),
    ({"z": "null"}, {"z": None}),
    ({"extra": "5"}, {"extra": "5"}),
])
def test_coerce_arguments(given, expected):
    assert coerce_arguments(given, SCHEMA) == expected


def test_coerce_without_schema_keeps_values():
    assert coerce_arguments({"a": "1"}, {}) == {"a": "1"}
    assert coerce_arguments({"a": "1"}, {"type": "object"}) == {"a": "1"}


@pytest.mark.parametrize("text,expected", [
    # closing tags inside a JSON string argument do not end the block
    ('<tool_call>{"name": "write_file", "arguments": {"content": "a</tool_call><tool_call>\\"}{b"}}</tool_call>ok',
     [call("write_file", {"content": 'a</tool_call><tool_call>"}{b'}), TextDelta("ok")]),
    # two objects in one block
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}\n{"name": "get_weather", "arguments": '
     '{"city": "B"}}</tool_call>',
     [call("get_weather", {"city": "A"}), call("get_weather", {"city": "B"}, 1)]),
    # XML block whose closing tag is forgotten before the next one
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n<tool_call>\n"
     "<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>",
     [call("get_weather", {"city": "A"}), call("get_weather", {"city": "B"}, 1)]),
    # unbalanced JSON: the first closing tag ends it once the output is over
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}</tool_call> then',
     [InvalidToolCall('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}</tool_call>',
                      "invalid JSON: Expecting ',' delimiter at char 50"), TextDelta("then")]),
])
def test_block_structure(text, expected):
    assert parse(text) == expected
    assert streamed(list(text)) == expected
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]]) == expected


FUZZ_PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "</function>",
               "<parameter=days>", "</parameter>", '{"name": "get_weather", "arguments": {"days": "1"}}',
               '{"name": "write_file", "parameters": {"path": 2}}', "{", "}", "[", "]", '"', "\\", ";", " ", "\n",
               "hello", "é🌍", "<", "<t", "<|python_tag|>", "x", '{"answer": 1}', "<think", "</th", "```json\n", "```"]


@pytest.mark.parametrize("kw", [{}, {"starts_in_reasoning": True}, {"tool_format": "json"},
                                {"tool_format": "qwen3_coder", "reasoning": False}, {"tool_format": None, "tools": None}],
                         ids=["auto", "in-reasoning", "json", "xml", "off"])
def test_random_outputs_any_cut(kw):
    # outputs stitched from markup fragments: cut anywhere, the events must not change
    rng = random.Random(str(kw))
    for _ in range(300):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 10)))
        whole = streamed([text], **kw)
        cuts = sorted({rng.randint(0, len(text)) for _ in range(rng.randint(1, 6))})
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert streamed(pieces, **kw) == whole, pieces
        assert streamed(list(text), **kw) == whole, text
