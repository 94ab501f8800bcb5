"""Tool calls, reasoning and the queue, through a live server and the official SDKs.

The model is the hand-built script model (tests/helpers_models.py): its greedy output
is a known tool call, reasoning block, bad markup or endless loop, chosen by its own
chat template from the conversation, so these tests are exact.
"""
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from helpers_models import ANSWER, TEXT, WEATHER_TOOL, LiveServer, script_model_path

MODEL = "script"
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather forecast for a city",
                  "input_schema": WEATHER_TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
                  "parameters": WEATHER_TOOL["function"]["parameters"]}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_path):
    import luce
    from luce.server.app import create_app

    model = luce.load(script_model_path(smollm2_path), backend="cpu", n_ctx=2048)
    app = create_app(model, model_name=MODEL, max_queue=2, request_timeout=60.0)
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


# -- OpenAI chat ----------------------------------------------------------------------
def test_openai_tool_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    # the model wrote "days": "3"; the schema says integer
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r2 = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0)
    assert r2.choices[0].message.content == ANSWER
    assert r2.choices[0].finish_reason == "stop"
    assert r2.usage.completion_tokens > 0 and r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_openai_tool_call_streamed(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                         tools=[WEATHER_TOOL], temperature=0, stream=True)
    calls, content, finish = {}, "", None
    for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == ""
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("prompt,args", [("[xml] weather", {"city": "Lyon"}),
                                         ("[json] weather", {"city": "Nice", "days": 5})])
def test_other_tool_call_formats(oai, prompt, args):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                    tools=[WEATHER_TOOL], temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == args
    assert r.choices[0].finish_reason == "tool_calls"


def test_unparsable_tool_call_is_not_leaked(oai):
    msgs = [{"role": "user", "content": "[bad] weather"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], temperature=0)
    assert r.choices[0].message.content == "Checking."
    assert not r.choices[0].message.tool_calls
    text = "".join(c.choices[0].delta.content or "" for c in
                   oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], temperature=0,
                                               stream=True))
    assert text == "Checking."


def test_without_tools_tool_text_is_content(oai):
    # no tools offered: nothing is parsed out of the text
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert r.choices[0].message.content == TEXT


def test_openai_reasoning_split(oai):
    msgs = [{"role": "user", "content": "[think] hello"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0)
    m = r.choices[0].message
    assert m.reasoning_content == "The user greets me. I should greet back."
    assert m.content == "Hi there, friend!"
    assert r.usage.completion_tokens_details.reasoning_tokens > 5
    reasoning, content = "", ""
    for chunk in oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, stream=True):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)


def test_reasoning_effort_none_closes_thinking_at_once(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[ponder] hello"}],
                                    temperature=0, max_tokens=200, reasoning_effort="none")
    assert r.choices[0].message.content == TEXT
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens <= 2
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


# -- Anthropic --------------------------------------------------------------------------
def test_anthropic_tool_round_trip(ant):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = ant.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[ANTHROPIC_TOOL],
                            extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris", "days": 3}
    messages += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                               "content": "sunny, 24 C"}]}]
    m2 = ant.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[ANTHROPIC_TOOL],
                             extra_body=GREEDY)
    assert m2.stop_reason == "end_turn"
    assert [b.type for b in m2.content] == ["text"] and m2.content[0].text == ANSWER


def test_anthropic_streamed_tool_call_and_thinking(ant):
    with ant.messages.stream(model=MODEL, max_tokens=200, tools=[ANTHROPIC_TOOL], extra_body=GREEDY,
                             messages=[{"role": "user", "content": "weather?"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris", "days": 3}

    with ant.messages.stream(model=MODEL, max_tokens=200, extra_body=GREEDY,
                             messages=[{"role": "user", "content": "[think] hi"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user greets me. I should greet back."
    assert final.content[0].signature
    assert final.content[1].text == "Hi there, friend!"


def test_anthropic_thinking_budget(ant):
    m = ant.messages.create(model=MODEL, max_tokens=300, extra_body=GREEDY,
                            thinking={"type": "enabled", "budget_tokens": 12},
                            messages=[{"role": "user", "content": "[ponder] think hard"}])
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking.startswith("hmm, let me ponder")
    assert m.content[1].text == TEXT
    assert m.stop_reason == "end_turn"
    # 12 reasoning tokens, then the closing tag and the answer
    assert m.usage.output_tokens < 12 + 20


def test_anthropic_thinking_disabled(ant):
    m = ant.messages.create(model=MODEL, max_tokens=300, extra_body=GREEDY, thinking={"type": "disabled"},
                            messages=[{"role": "user", "content": "[ponder] think hard"}])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == TEXT


def test_anthropic_thinking_blocks_round_trip(ant):
    # Claude Code sends earlier thinking blocks (with their signature) back
    m = ant.messages.create(model=MODEL, max_tokens=100, extra_body=GREEDY, messages=[
        {"role": "user", "content": "[think] hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet", "signature": "luce"},
                                          {"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "and now?"}])
    assert m.content[-1].text == TEXT


# -- Responses ---------------------------------------------------------------------------
def test_responses_tool_round_trip(oai):
    r = oai.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[RESPONSES_TOOL],
                             temperature=0, store=False)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
    r2 = oai.responses.create(model=MODEL, tools=[RESPONSES_TOOL], temperature=0, store=False,
                              instructions="You are a weather bot.", input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r2.output_text == ANSWER
    assert r2.status == "completed" and r2.usage.output_tokens > 0


def test_responses_streamed_tool_call_and_reasoning(oai):
    with oai.responses.stream(model=MODEL, input="weather?", tools=[RESPONSES_TOOL], temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert final.output[0].type == "function_call"
    assert json.loads(final.output[0].arguments) == {"city": "Paris", "days": 3}

    with oai.responses.stream(model=MODEL, input="[think] hi", temperature=0,
                              include=["reasoning.encrypted_content"]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "The user greets me. I should greet back."
    assert final.output_text == "Hi there, friend!"
    assert final.usage.output_tokens_details.reasoning_tokens > 5
    # the reasoning item goes back as input, as Codex sends it
    r = oai.responses.create(model=MODEL, temperature=0, input=[
        {"role": "user", "content": "[think] hi"}, final.output[0].model_dump(exclude_none=True),
        {"role": "assistant", "content": "Hi there, friend!"}, {"role": "user", "content": "thanks"}])
    assert r.output_text == TEXT


def test_responses_reasoning_effort_minimal(oai):
    r = oai.responses.create(model=MODEL, input="[ponder] go", temperature=0, max_output_tokens=200,
                             reasoning={"effort": "minimal"})
    assert r.output_text == TEXT


# -- the queue -------------------------------------------------------------------------------
def _health(server):
    return httpx.get(server.url + "/health").json()


def _wait(cond, timeout=10.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out waiting"
        time.sleep(0.05)


def _metric(server, name, **labels):
    text = httpx.get(server.url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_queue_limit_429_then_everything_completes(server, oai, ant):
    tick = {"model": MODEL, "messages": [{"role": "user", "content": "[tick]"}], "max_tokens": 2000,
            "temperature": 0, "stream": True}
    results = []
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=tick) as running:
            lines = running.iter_lines()
            next(x for x in lines if x.startswith("data:"))  # generating now
            waiters = [threading.Thread(target=lambda: results.append(oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0))) for _ in range(2)]
            for t in waiters:
                t.start()
            _wait(lambda: _health(server)["queue_depth"] == 2)
            with pytest.raises(openai.RateLimitError) as e:
                oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert "queue" in e.value.message
            with pytest.raises(anthropic.RateLimitError) as e:
                ant.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
            assert e.value.body["error"]["type"] == "rate_limit_error"
        # leaving the stream disconnects: the running generation stops, the queued ones run
        for t in waiters:
            t.join(timeout=90)
    assert [r.choices[0].message.content for r in results] == [TEXT, TEXT]
    _wait(lambda: _metric(server, "luce_generations_total", api="openai", finish_reason="cancelled") >= 1)


def test_client_disconnect_cancels_non_streaming(server):
    before = _metric(server, "luce_generations_total", api="openai", finish_reason="cancelled")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "[tick]"}], "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
    _wait(lambda: _metric(server, "luce_generations_total", api="openai", finish_reason="cancelled") > before,
          timeout=3)
    assert not _health(server)["busy"]


def test_request_timeout_ends_generation(server):
    # a second server on the same model, with a 3 s timeout (waiting included): the
    # running request stops at it, and the one queued behind it is served next, in what
    # is left of its own 3 s
    from luce.server.app import create_app

    with LiveServer(create_app(server.state.model, model_name=MODEL, request_timeout=3.0)) as short:
        api = openai.OpenAI(base_url=short.url + "/v1", api_key="none", max_retries=0)
        out = {}

        def run():
            out["r"] = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[tick]"}],
                                                   max_tokens=2000, temperature=0)
        t0 = time.time()
        first = threading.Thread(target=run)
        first.start()
        time.sleep(1.0)
        after = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            temperature=0)
        first.join()
    assert after.choices[0].message.content and TEXT.startswith(after.choices[0].message.content)
    assert time.time() - t0 < 15
    r = out["r"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens < 2000
    assert r.choices[0].message.content.startswith("tick tock tick tock")


def test_metrics_after_traffic(server):
    assert _metric(server, "luce_completion_tokens_total") > 50
    assert _metric(server, "luce_time_to_first_token_seconds_count") > 5
    assert _metric(server, "luce_requests_total", api="openai", path="/v1/chat/completions", status="200") > 5
    assert _metric(server, "luce_requests_total", api="anthropic", path="/v1/messages", status="429") >= 1


def test_responses_bad_input(server):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": 42})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_responses_custom_tool_round_trip(oai):
    # Codex offers apply_patch as a free-text "custom" tool
    tool = {"type": "custom", "name": "get_weather", "description": "Weather, free text"}
    r = oai.responses.create(model=MODEL, input="weather?", tools=[tool], temperature=0)
    (call,) = r.output
    assert call.type == "custom_tool_call" and call.name == "get_weather"
    assert json.loads(call.input) == {"city": "Paris", "days": "3"}
    with oai.responses.stream(model=MODEL, input="weather?", tools=[tool], temperature=0) as s:
        events = list(s)
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == call.input and s.get_final_response().output[0].input == call.input
    assert "response.function_call_arguments.delta" not in [e.type for e in events]
    r2 = oai.responses.create(model=MODEL, tools=[tool], temperature=0, input=[
        {"role": "user", "content": "weather?"},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name, "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r2.output_text == ANSWER
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert "web_search" in e.value.message


def test_unknown_routes_answer_in_json(server):
    r = httpx.post(server.url + "/v1/nothing", json={})
    assert r.status_code == 404 and "no such route" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]



def test_queue_wait_timeout(server):
    # straight to the live server's engine, to give two requests different timeouts: the
    # second expires while the first generates, and is answered 503 without running
    import asyncio

    from luce.engine.request import Done, Error, Request

    model, engine = server.state.model, server.state.engine
    tick = model.chat_prompt_ids([{"role": "user", "content": "[tick]"}])
    hi = model.chat_prompt_ids([{"role": "user", "content": "hi"}])

    async def run():
        first = engine.submit(Request(prompt_ids=tick, sampling={"max_tokens": 1500, "temperature": 0}, timeout_s=2.0))
        second = engine.submit(Request(prompt_ids=hi, sampling={"max_tokens": 20}, timeout_s=0.5))
        return [e async for e in first.events()], [e async for e in second.events()]

    a, b = asyncio.run(run())
    assert isinstance(a[-1], Done) and a[-1].finish_reason == "timeout"
    assert len(b) == 1 and isinstance(b[0], Error) and b[0].status == 503


def test_keepalive_while_a_stream_waits(server, oai, monkeypatch):
    import luce.server.anthropic
    import luce.server.openai
    monkeypatch.setattr(luce.server.openai, "KEEPALIVE_S", 0.1)
    monkeypatch.setattr(luce.server.anthropic, "KEEPALIVE_S", 0.1)
    busy = threading.Thread(target=lambda: oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "[tick]"}], max_tokens=200, temperature=0))
    busy.start()
    _wait(lambda: _health(server)["busy"])
    lines = {}

    def wait_in_line(path, body):
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
            lines[path] = [x for x in r.iter_lines() if x]
    hi = [{"role": "user", "content": "hi"}]
    waiters = [threading.Thread(target=wait_in_line, args=args) for args in (
        ("/v1/chat/completions", {"model": MODEL, "messages": hi, "stream": True}),
        ("/v1/messages", {"model": MODEL, "messages": hi, "max_tokens": 20, "stream": True}))]
    for t in waiters:
        t.start()
    for t in [busy, *waiters]:
        t.join(timeout=90)
    assert ": keep-alive" in lines["/v1/chat/completions"] and lines["/v1/chat/completions"][-1] == "data: [DONE]"
    assert "event: ping" in lines["/v1/messages"] and lines["/v1/messages"][-2] == "event: message_stop"


def test_forced_tool_choice(oai, ant):
    # the forced call's opening is written after the generation prompt, and the model
    # goes on from it: the parser must read opening + continuation as one call
    msgs = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], tool_choice=choice,
                                        temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    m = ant.messages.create(model=MODEL, max_tokens=100, messages=msgs, tools=[ANTHROPIC_TOOL], extra_body=GREEDY,
                            tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and m.content[0].input == {"city": "Paris", "days": 3}
    r = oai.responses.create(model=MODEL, input="weather?", tools=[RESPONSES_TOOL], temperature=0,
                             tool_choice={"type": "function", "name": "get_weather"})
    assert r.output[0].type == "function_call" and json.loads(r.output[0].arguments)["city"] == "Paris"
    # the opening is part of the prompt
    auto = ant.messages.count_tokens(model=MODEL, messages=msgs, tools=[ANTHROPIC_TOOL])
    forced = ant.messages.count_tokens(model=MODEL, messages=msgs, tools=[ANTHROPIC_TOOL],
                                       tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.input_tokens > auto.input_tokens + 5
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in e.value.message
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=MODEL, max_tokens=10, messages=msgs, tool_choice={"type": "any"})


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                              "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def test_parallel_tool_calls(oai, ant):
    msgs = [{"role": "user", "content": "[two] weather and time"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].function.arguments) == {"zone": "CET"}
    # a client that cannot take two calls gets the first, and generation stops there
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0,
                                    parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"
    time_tool = {"name": "get_time", "input_schema": TIME_TOOL["function"]["parameters"]}
    m = ant.messages.create(model=MODEL, max_tokens=100, messages=msgs, tools=[ANTHROPIC_TOOL, time_tool],
                            extra_body=GREEDY, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.name for b in m.content] == ["get_weather"] and m.stop_reason == "tool_use"
