"""The three APIs on SmolLM2-135M (CPU backend) behind a live loopback server, driven by
the official openai and anthropic SDKs: generation, streaming, sampling parameters,
errors in each API's format, and many concurrent clients."""
import json

import anthropic
import httpx
import openai
import pytest

from helpers_models import LiveServer

MODEL = "smollm2"
HI = [{"role": "user", "content": "Say hello."}]
# SmolLM2 on a shared CPU can be slow: every test asks for as few tokens as it can
N = 4
GREEDY: dict[str, str] = {}  # greedy outputs later tests reuse


@pytest.fixture(scope="module")
def server(smollm2):
    from luce.server.app import create_app
    app = create_app(smollm2, model_name=MODEL, max_queue=32)
    with LiveServer(app) as srv:
        yield srv
    # the model is shared with other test files: leave its cache as we found it, empty
    smollm2.session.cache.truncate(0)
    smollm2.session.tokens.clear()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


# -- the small endpoints -------------------------------------------------------------------
def test_health_models_props_metrics(server, oai, smollm2):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    (card,) = oai.models.list().data
    assert card.id == MODEL and card.owned_by == "luce" and card.context_length == smollm2.n_ctx
    props = httpx.get(server.url + "/props").json()
    assert props["model"] == MODEL and props["n_ctx"] == smollm2.n_ctx and props["backend"] == "cpu"
    assert props["draft"] is None and "ddtree_budget" in props["optimizations"]
    assert props["runtime"]["max_queue"] == 32
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "luce_queue_depth" in metrics.text


# -- OpenAI ---------------------------------------------------------------------------------
def test_chat_completion_and_its_stream_agree(oai):
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=N, temperature=0)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens > 5
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == N and timings["predicted_per_second"] > 0
    GREEDY["chat"] = text
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=N, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    # the prefix cache served the repeated prompt
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert "Paris" in r.choices[0].text and r.usage.completion_tokens == 2
    parts = list(oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts[:-1]) == r.choices[0].text
    assert parts[-2].choices[0].finish_reason == "length"
    assert not parts[-1].choices and parts[-1].usage.completion_tokens == 2  # the usage chunk comes last


def test_sampling_parameters_are_honoured(oai):
    kw = dict(model=MODEL, messages=HI, max_tokens=3, temperature=1.5, top_p=0.99, seed=7,
              extra_body={"top_k": 200, "min_p": 0.0})
    a = oai.chat.completions.create(**kw).choices[0].message.content
    assert oai.chat.completions.create(**kw).choices[0].message.content == a
    full = GREEDY.get("chat") or oai.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=N,
                                                              temperature=0).choices[0].message.content
    cut = full.split()[1]
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=N, temperature=0, stop=[cut])
    assert r.choices[0].finish_reason == "stop" and cut not in r.choices[0].message.content
    assert full.startswith(r.choices[0].message.content)
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2 and full.startswith(r.choices[0].message.content)
    # penalties move greedy decoding off the token the prompt repeats
    rep = dict(model=MODEL, prompt="one, two, one, two, one, two, one,", max_tokens=1, temperature=0)
    plain = oai.completions.create(**rep).choices[0].text
    penalized = oai.completions.create(**rep, frequency_penalty=2.0, presence_penalty=2.0,
                                       extra_body={"repeat_penalty": 2.0}).choices[0].text
    assert plain == " one" and penalized != plain


@pytest.mark.parametrize("extra,name", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                        ({"response_format": {"type": "json_object"}}, "response_format"),
                                        ({"tool_choice": "required"}, "tool_choice"),
                                        ({"logit_bias": {"42": 5}}, "logit_bias"),
                                        ({"extra_body": {"mirostat": 2}}, "mirostat")])
def test_unsupported_parameters_are_rejected(oai, extra, name):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **extra)
    assert name in e.value.message and e.value.body["param"] == name


def test_openai_errors(server, oai):
    raw = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HI, temperature="hot")
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages="hello")
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=0)
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-9", messages=HI)
    assert "gpt-9" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=100_000)
    assert e.value.status_code == 413 and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(model=MODEL, prompt="word " * 5000, max_tokens=1)
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="hi", echo=True)
    assert "echo" in e.value.message
    # and the server still serves
    assert oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices[0].message.content


# -- Anthropic ---------------------------------------------------------------------------
def test_anthropic_messages(ant):
    m = ant.messages.create(model=MODEL, max_tokens=N, messages=HI, system="Be brief.",
                            extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens == N
    with ant.messages.stream(model=MODEL, max_tokens=N, messages=HI, system="Be brief.",
                             extra_body={"temperature": 0}) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    # the same prompt again: message_start already says how much of it the cache held, as
    # message_delta's final usage does
    start = events[0].message.usage
    assert start.cache_read_input_tokens > 0
    assert start.input_tokens + start.cache_read_input_tokens == m.usage.input_tokens + \
        (m.usage.cache_read_input_tokens or 0)
    assert start.cache_read_input_tokens == final.usage.cache_read_input_tokens
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == m.content[0].text
    cut = m.content[0].text.split()[1]
    s = ant.messages.create(model=MODEL, max_tokens=N, messages=HI, system="Be brief.", stop_sequences=[cut],
                            extra_body={"temperature": 0})
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == cut
    n = ant.messages.count_tokens(model=MODEL, messages=HI, system="Be brief.")
    assert n.input_tokens > 5
    # SmolLM2's template drops tools: the server writes them into the system prompt
    tool = {"name": "get_weather", "description": "Weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    with_tool = ant.messages.count_tokens(model=MODEL, messages=HI, system="Be brief.", tools=[tool])
    assert with_tool.input_tokens > n.input_tokens + 30


def test_anthropic_errors(server, ant):
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.create(model="claude-opus-4", max_tokens=5, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=5, messages=HI, extra_body={"max_tokens": "five"})
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    with pytest.raises(anthropic.APIStatusError) as e:
        ant.messages.create(model=MODEL, max_tokens=5000, messages=HI)
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"
    raw = httpx.post(server.url + "/v1/messages", content=b"[1, 2", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["type"] == "error"


# -- Responses ---------------------------------------------------------------------------
def test_responses(oai):
    r = oai.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=N,
                             temperature=0)
    assert r.output_text and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == N
    with oai.responses.stream(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=N,
                              temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == r.output_text == final.output_text
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in e.value.message
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-5-codex", input="hi")


# -- many clients --------------------------------------------------------------------------
def test_16_concurrent_streaming_clients(server):
    # one asyncio loop drives all 16 (threads would fight the engine for the GIL)
    import asyncio
    n = 16

    async def client(api, i):
        text, finish, usage = "", None, None
        stream = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=2, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            else:
                usage = c.usage
        return {"text": text, "finish": finish, "usage": usage}

    async def main():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=400)
        try:
            return await asyncio.gather(*(client(api, i) for i in range(n)))
        finally:
            await api.close()

    out = asyncio.run(main())
    assert len(out) == n
    for i, r in enumerate(out):
        assert r["finish"] in ("length", "stop"), (i, r)
        assert r["usage"] is not None and 1 <= r["usage"].completion_tokens <= 2
        assert r["text"]
    assert httpx.get(server.url + "/health").json()["queue_depth"] == 0


def test_raw_sse_format(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
