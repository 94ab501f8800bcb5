"""Chat templates: real templates render like transformers would, tool calls round-trip
through the output parser, and templates cannot escape the sandbox."""
from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from luce.errors import LuceError
from luce.text.chat_format import (default_template_kwargs, detect_chat_format, make_output_parser,
                                   prompt_opens_reasoning, supports_tools)
from luce.text.chat_template import CHATML_TEMPLATE, ChatTemplate, TemplateError
from luce.text.output_parser import ReasoningDelta, TextDelta, ToolCall, coalesce

TEMPLATES = Path(__file__).parent / "data" / "templates"

SMOLLM2 = "HuggingFaceTB-SmolLM2-135M-Instruct.jinja"
QWEN25_CODER = "Qwen-Qwen2.5-Coder-0.5B-Instruct.jinja"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
QWEN3_CODER = "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja"
LLAMA33 = "meta-llama-Llama-3.3-70B-Instruct.jinja"
DEEPSEEK_R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"


def fixture(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def template(name: str, **kw) -> ChatTemplate:
    return ChatTemplate(fixture(name), **kw)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"},
                           "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]

# OpenAI wire form: arguments as JSON text, content null
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, é?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


# -- real templates from the model files ------------------------------------------
def _gguf(getter_module: str, getter: str):
    import importlib
    # the models are test requirements (the dev extra): a missing one fails the test
    return getattr(importlib.import_module(getter_module), getter)()


@pytest.mark.parametrize("module,getter,name", [
    ("luce.models.bundled", "smollm2_path", SMOLLM2),
    ("luce.models.test_models", "qwen_coder_05b_path", QWEN25_CODER),
])
def test_fixture_is_the_gguf_template(module, getter, name):
    path = _gguf(module, getter)
    t = ChatTemplate.from_gguf(path)
    assert t.source == fixture(name)
    assert t.eos_token == "<|im_end|>"


def test_from_gguf_renders_smollm2():
    t = ChatTemplate.from_gguf(_gguf("luce.models.bundled", "smollm2_path"))
    out = t.render([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                   "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_fixture():
    t = template(SMOLLM2)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert t.render(msgs) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                              "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert t.render(msgs, add_generation_prompt=False).endswith("Bye<|im_end|>\n")
    # a plain-ChatML template has no tool syntax; null content still renders
    assert "<|im_start|>assistant\n<|im_end|>" in t.render(ROUND_TRIP, tools=TOOLS)


def test_qwen25_coder_tools_and_round_trip():
    out = template(QWEN25_CODER).render(ROUND_TRIP, tools=TOOLS)
    assert out == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with "
        "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Current '
        'weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": '
        '"string", "description": "City name"}, "days": {"type": "integer"}}, "required": ["city"]}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris, é?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")
    # without tools: the default system prompt and no tool block
    plain = template(QWEN25_CODER).render([{"role": "user", "content": "Hi"}])
    assert plain.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert "<tools>" not in plain


def test_qwen3_thinking_switch():
    t = template(QWEN3)
    msgs = [{"role": "user", "content": "2+2?"}]
    assert t.render(msgs).endswith("<|im_start|>assistant\n")
    assert t.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert t.render(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_round_trip_with_null_content_and_reasoning():
    # Qwen3's template does `'</think>' in message.content`: null content must not crash it
    out = template(QWEN3).render(ROUND_TRIP, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in out
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in out
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "A", "reasoning_content": "thought"}]
    assert "<think>\nthought\n</think>\n\nA<|im_end|>" in template(QWEN3).render(history, add_generation_prompt=False)


def test_qwen3_coder_xml_tools():
    out = template(QWEN3_CODER).render(ROUND_TRIP, tools=TOOLS)
    assert "<function>\n<name>get_weather</name>\n<description>Current weather for a city</description>" in out
    assert "<required>[`city`]</required>" in out
    assert ("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>") in out
    assert out.endswith("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<|im_end|>\n"
                        "<|im_start|>assistant\n")


def test_llama33_tools_and_raise_exception():
    t = template(LLAMA33, bos_token="<|begin_of_text|>")
    out = t.render(ROUND_TRIP, tools=TOOLS, date_string="01 Dec 2026")
    assert out.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                          "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 01 Dec 2026")
    assert '    "type": "function",\n    "function": {\n        "name": "get_weather",' in out  # tojson(indent=4)
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
            '{"city": "Paris", "days": 2}}<|eot_id|>') in out
    # tools=None and tools=[] both mean "no tools" to this template
    for tools in (None, []):
        assert "Environment: ipython" not in t.render([{"role": "user", "content": "hi"}], tools=tools)
    two = dict(ROUND_TRIP[2], tool_calls=[CALL, CALL])
    with pytest.raises(TemplateError, match="only supports single tool-calls"):
        t.render([ROUND_TRIP[1], two], tools=TOOLS)


def test_deepseek_r1_string_arguments_and_open_think():
    # This template concatenates arguments as text; the others need a dict. One value serves both.
    t = template(DEEPSEEK_R1, bos_token="<｜begin▁of▁sentence｜>")
    out = t.render(ROUND_TRIP[:3] + [{"role": "user", "content": "thanks"}])
    assert '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "days": 2}\n```' in out
    assert out.endswith("<｜User｜>thanks<｜Assistant｜><think>\n")
    assert prompt_opens_reasoning(out)
    assert not prompt_opens_reasoning(template(QWEN3).render([{"role": "user", "content": "x"}],
                                                             enable_thinking=False))


def test_chatml_fallback():
    t = ChatTemplate.chatml()
    assert t.render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = t.render(ROUND_TRIP, tools=TOOLS)
    # the same shape as Qwen2.5's, so the Hermes parser reads what it asks for
    assert out == template(QWEN25_CODER).render(ROUND_TRIP, tools=TOOLS)
    assert ChatTemplate(CHATML_TEMPLATE)._template is t._template


# -- tool calls round-trip: what a template writes for a call, the parser reads back --
ROUND_TRIP_CASES = [
    (QWEN25_CODER, "<|im_end|>\n", {}),
    (QWEN3, "<|im_end|>\n", {}),
    (QWEN3_CODER, "<|im_end|>\n", {}),
    (LLAMA33, "<|eot_id|>", {}),
    ("chatml", "<|im_end|>\n", {}),
]


@pytest.mark.parametrize("name,end,extra", ROUND_TRIP_CASES, ids=[c[0] for c in ROUND_TRIP_CASES])
def test_tool_call_round_trip_through_parser(name, end, extra):
    t = ChatTemplate.chatml() if name == "chatml" else template(name)
    source = CHATML_TEMPLATE if name == "chatml" else fixture(name)
    convo = ROUND_TRIP[:3]
    prompt = t.render(convo[:2], tools=TOOLS, **extra)
    full = t.render(convo, tools=TOOLS, add_generation_prompt=False, **extra)
    assert full.startswith(prompt), "the generation prompt should be a prefix of the assistant turn"
    output = full[len(prompt):]
    assert output.endswith(end)
    output = output[:-len(end)]
    ids = iter(range(10))
    parser = make_output_parser(source, prompt, tools=TOOLS, id_factory=lambda: f"call_{next(ids)}")
    events = []
    for ch in output:  # streamed one character at a time
        events += parser.feed(ch)
    events = coalesce(events + parser.finish())
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert not [e for e in events if isinstance(e, TextDelta)]
    assert all(isinstance(e, (ToolCall, ReasoningDelta)) for e in events)


def test_detect_chat_format():
    expect = {SMOLLM2: ("chatml", "auto", False), QWEN25_CODER: ("hermes", "hermes", False),
              QWEN3: ("hermes", "hermes", True), QWEN3_CODER: ("qwen3_coder", "qwen3_coder", False),
              LLAMA33: ("llama3", "json", False), DEEPSEEK_R1: ("generic", "auto", True)}
    for name, (fmt, tool_format, reasoning) in expect.items():
        f = detect_chat_format(fixture(name))
        assert (f.name, f.tool_format, f.reasoning) == (fmt, tool_format, reasoning), name
    assert detect_chat_format(None).name == "generic"
    assert [supports_tools(fixture(n)) for n in (SMOLLM2, QWEN25_CODER, QWEN3_CODER, LLAMA33)] == [False, True, True, True]
    assert default_template_kwargs(fixture(LLAMA33), datetime.datetime(2026, 3, 5)) == {"date_string": "05 Mar 2026"}
    assert default_template_kwargs(fixture(QWEN3)) == {}


def test_make_output_parser_without_tools_leaves_markup_as_content():
    p = make_output_parser(fixture(QWEN25_CODER), "<|im_start|>assistant\n", tools=None)
    text = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    assert coalesce(p.feed(text) + p.finish()) == [TextDelta(text)]


# -- the HF environment -----------------------------------------------------------
def render_src(src: str, messages=(), **kw) -> str:
    return ChatTemplate(src).render(list(messages), **kw)


def test_tojson_hf_semantics():
    msgs = [{"role": "user", "content": "é <b> & 'q'"}]
    assert render_src("{{ messages[0].content|tojson }}", msgs) == '"é <b> & \'q\'"'
    assert render_src("{{ {'a': [1, 2]}|tojson(indent=2) }}") == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert render_src("{{ {'a': 1, 'b': 2}|tojson(separators=(',', ':')) }}") == '{"a":1,"b":2}'
    assert render_src("{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}") == '{"a": 2, "b": 1}'


def test_helpers_and_extensions():
    assert render_src("{{ strftime_now('%Y') }}") == str(datetime.datetime.now().year)
    assert render_src("{% for i in [1, 2, 3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}") == "13"
    assert render_src("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "1"
    # trim_blocks and lstrip_blocks, as transformers sets them
    assert render_src("  {% if true %}\nx\n  {% endif %}\ny") == "x\ny"
    assert render_src("{% generation %}kept{% endgeneration %}") == "kept"
    assert render_src("{{ bos_token }}|{{ eos_token }}") == "|"
    assert ChatTemplate("{{ bos_token }}{{ eos_token }}", bos_token="<s>", eos_token="</s>").render([]) == "<s></s>"
    assert render_src("{{ foo }}", foo="bar") == "bar"
    assert render_src("{{ add_generation_prompt }}", add_generation_prompt=False) == "False"
    with pytest.raises(TemplateError, match="refused the conversation: no system"):
        render_src("{{ raise_exception('no system') }}")


def test_message_normalisation():
    src = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_src(src, parts) == "[user:a\nb]"
    with pytest.raises(TemplateError, match="image_url"):
        render_src(src, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(TemplateError, match="not valid JSON"):
        render_src(src, [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(TemplateError, match="role"):
        render_src(src, [{"content": "no role"}])
    # arguments as a dict (what transformers takes) and as JSON text give the same prompt
    as_text = template(QWEN25_CODER).render(ROUND_TRIP, tools=TOOLS)
    as_dict = [dict(m) for m in ROUND_TRIP]
    as_dict[2] = dict(as_dict[2], tool_calls=[{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}])
    assert template(QWEN25_CODER).render(as_dict, tools=TOOLS) == as_text
    # tools given as bare functions or with Anthropic's input_schema are wrapped
    bare = [{"name": "get_weather", "description": "Current weather for a city",
             "input_schema": WEATHER["function"]["parameters"]}]
    assert template(QWEN25_CODER).render(ROUND_TRIP, tools=bare) == as_text


def test_errors_are_clear():
    assert issubclass(TemplateError, ValueError) and issubclass(TemplateError, LuceError)
    with pytest.raises(TemplateError, match="does not compile.*line 2"):
        ChatTemplate("ok\n{% for x in %}")
    with pytest.raises(TemplateError, match="empty"):
        ChatTemplate("")
    with pytest.raises(TemplateError, match="may not replace"):
        ChatTemplate("x").render([], bos_token="a")
    with pytest.raises(TemplateError, match="failed"):
        render_src("{{ messages[0].content + 1 }}", [{"role": "user", "content": "a"}])


def test_compiled_once():
    src = "{{ messages|length }}"
    assert ChatTemplate(src)._template is ChatTemplate(src, bos_token="<s>")._template


# -- sandbox ----------------------------------------------------------------------
STATIC_ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ self._TemplateReference__context }}",
    "{{ ''['__class__'] }}",
    "{{ messages|attr('__class__') }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = [].__class__ %}",
]


@pytest.mark.parametrize("src", STATIC_ESCAPES)
def test_reaching_python_internals_fails_before_running(src):
    # the leading raise_exception would fire first if any of the template ran
    with pytest.raises(TemplateError, match="not allowed") as e:
        ChatTemplate("{{ raise_exception('it ran') }}" + src).render([])
    assert "it ran" not in str(e.value)


DYNAMIC_ESCAPES = [
    "{% set n = '__cla' ~ 'ss__' %}{{ ''|attr(n) }}",
    "{% set n = '__cla' ~ 'ss__' %}{{ ''[n] }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ messages.append(1) }}",
    "{{ {'a': 1}.update({'b': 2}) }}",
    "{{ 'a' * 100000000 }}",
    "{{ [0] * 100000000 }}",
    "{{ 9 ** 999999 }}",
    "{{ range(10 ** 7)|list }}",
    "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
]


@pytest.mark.parametrize("src", DYNAMIC_ESCAPES)
def test_sandbox_blocks_at_run_time(src):
    with pytest.raises(TemplateError):
        ChatTemplate(src).render([{"role": "user", "content": "hi"}])


def test_make_output_parser_reads_drifting_formats_and_open_think():
    tools = TOOLS
    p = make_output_parser(fixture(QWEN25_CODER), "<|im_start|>assistant\n", tools=tools)
    events = p.feed('{"name": "get_weather", "arguments": {"city": "Oslo", "days": "1"}}') + p.finish()
    assert [(e.name, e.arguments) for e in events] == [("get_weather", {"city": "Oslo", "days": 1})]
    p = make_output_parser(fixture(DEEPSEEK_R1), "<｜Assistant｜><think>\n", tools=None)
    assert coalesce(p.feed("hmm\n</think>\n\nYes.") + p.finish()) == [ReasoningDelta("hmm"), TextDelta("Yes.")]


def test_namespace_and_dict_stand_ins():
    assert render_src("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}") == "2"
    assert render_src("{{ dict(a=1)|tojson }}|{{ dict.fromkeys(['k'], 0)|tojson }}") == '{"a": 1}|{"k": 0}'
    with pytest.raises(TemplateError, match="not allowed"):
        ChatTemplate("{% set ns = namespace() %}{% set ns.__dict__ = 1 %}")
    with pytest.raises(TemplateError, match="sandbox"):
        render_src("{% set ns = namespace(_x=1) %}")
    with pytest.raises(TemplateError):
        render_src("{{ dict.mro() }}")


def test_caller_objects_reach_templates_as_plain_data():
    fired = []

    class Tool:
        def run(self):
            fired.append(1)
            return "ran"

    with pytest.raises(TemplateError):
        render_src("{{ thing.run() }}", thing=Tool())
    assert render_src("{{ thing }}", thing=Tool()) == "<Tool>"
    assert not fired


def test_reasoning_field_aliases():
    for key in ("reasoning_content", "reasoning", "thinking"):
        history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A", key: "thought"}]
        out = template(QWEN3).render(history, add_generation_prompt=False)
        assert "<think>\nthought\n</think>\n\nA<|im_end|>" in out, key


HF_CONVERSATIONS = [
    [{"role": "user", "content": "Hi é"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
     {"role": "assistant", "content": "It is 21."}, {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA"},
     {"role": "user", "content": "again"}],
]


@pytest.mark.parametrize("name", [SMOLLM2, QWEN25_CODER, QWEN3, QWEN3_CODER, LLAMA33])
def test_same_prompt_as_transformers(name):
    # transformers' own renderer is the reference these templates were written against
    from transformers.utils import chat_template_utils as hf  # a dev requirement
    src = fixture(name)
    for conv in HF_CONVERSATIONS:
        for tools in (None, TOOLS):
            for extra in ({}, {"enable_thinking": False}):
                want = hf.render_jinja_template([conv], tools=tools, chat_template=src, add_generation_prompt=True,
                                                bos_token="<s>", eos_token="</s>", **extra)[0][0]
                got = ChatTemplate(src, bos_token="<s>", eos_token="</s>").render(conv, tools=tools, **extra)
                assert got == want
