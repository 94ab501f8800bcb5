"""OpenAI Chat Completions (/v1/chat/completions) and Completions (/v1/completions)."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from ..engine.request import Done, Error, ReasoningDelta, Request, TextDelta, ToolCall
from . import schema
from .app import KEEPALIVE_S, collect, raise_error_event, read_json, stream_response, submit, text_reply
from .errors import APIError, openai_body, sse

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "timeout": "length", "cancelled": "stop"}
FINGERPRINT = "luce"

_TEXT_PARTS = {"text", "input_text"}


def _unsupported_common(body: dict):
    schema.unsupported(body, {
        "n": lambda v: v == 1,
        "best_of": lambda v: v == 1,
        "logprobs": lambda v: v is False or v == 0,
        "top_logprobs": lambda v: v == 0,
        "logit_bias": lambda v: not v,
        "functions": lambda v: False,
        "function_call": lambda v: False,
        "audio": lambda v: False,
        "modalities": lambda v: v == ["text"],
        "prediction": lambda v: False,
        "web_search_options": lambda v: False,
        "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
        "tool_choice": lambda v: v in ("auto", "none", "required") or (
            isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)
            and isinstance(v["function"].get("name"), str)),
    })


def content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PARTS or kind == "refusal":
                text = part.get("text", part.get("refusal"))
                if not isinstance(text, str):
                    raise APIError(400, f"'{where}[{j}].text' must be a string", param=f"{where}[{j}].text")
                out.append(text)
            else:
                raise APIError(400, f"'{where}[{j}]': content of type {kind!r} is not supported (text only)",
                               param=f"{where}[{j}].type")
        return "\n".join(out)
    raise APIError(400, f"'{where}' must be a string or an array of content parts", param=where)


def chat_messages(messages) -> list[dict]:
    """OpenAI chat messages as the template messages (string content, parsed tool calls)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array", param="messages")
    out, names = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise APIError(400, f"'{where}.role' must be system, developer, user, assistant or tool, got {role!r}",
                           param=f"{where}.role")
        msg = {"role": "system" if role == "developer" else "tool" if role == "function" else role,
               "content": content_text(m.get("content"), f"{where}.content")}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise APIError(400, f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
                norm = []
                for j, c in enumerate(calls):
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise APIError(400, f"'{where}.tool_calls[{j}].function.name' is required",
                                       param=f"{where}.tool_calls[{j}]")
                    args = schema.arguments_text(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments")
                    cid = c.get("id") or f"call_{i}_{j}"
                    names[cid] = fn["name"]
                    norm.append({"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
                if norm:
                    msg["tool_calls"] = norm
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
        if msg["role"] == "tool":
            cid = m.get("tool_call_id")
            if cid is not None:
                msg["tool_call_id"] = cid
            name = m.get("name") or names.get(cid)
            if name:
                msg["name"] = name
        elif m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def usage_json(done: Done) -> dict:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


def tool_call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


# -- /v1/chat/completions --------------------------------------------------------------
def parse_chat(body: dict, state) -> Request:
    state.check_model(body.get("model"))
    _unsupported_common(body)
    messages = chat_messages(body.get("messages"))
    tool_choice = body.get("tool_choice")
    tools = schema.check_tools(schema.get(body, "tools", "list"))
    if tool_choice == "none":
        tools = None
    force = None
    if tool_choice == "required" or isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        force = schema.forced_tool(tools, "forced", name, "tool_choice")
    samp = schema.sampling(body, ("max_tokens", "max_completion_tokens"))
    stream = schema.get(body, "stream", "bool", False)
    schema.get(body, "stream_options", "dict")
    parallel = schema.get(body, "parallel_tool_calls", "bool", True)
    effort = schema.get(body, "reasoning_effort", "str")
    budget, enable = schema.effort_budget(effort, "reasoning_effort")
    tkw = schema.get(body, "chat_template_kwargs", "dict")
    return schema.build_chat_request(state, "openai", messages, tools, samp, stream=stream, reasoning_budget=budget,
                                     enable_thinking=enable, template_kwargs=tkw, force_tool=force,
                                     parallel_tool_calls=parallel)


async def chat_completions(request, state):
    body = await read_json(request)
    req = await run_in_threadpool(parse_chat, body, state)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    cid = "chatcmpl-" + req.id
    created = int(req.created)
    job = submit(state, req)
    if req.stream:
        return stream_response(job, _chat_stream(job, cid, created, state.model_name, include_usage))
    events = await collect(request, job)
    raise_error_event(events)
    text, reasoning, calls, done = [], [], [], None
    for ev in events:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ToolCall):
            calls.append(tool_call_json(ev))
        elif isinstance(ev, Done):
            done = ev
    msg = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": FINISH[done.finish_reason]}],
        "usage": usage_json(done), "timings": done.timings.to_json(),
    })


async def _chat_stream(job, cid, created, model_name, include_usage):
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
            "system_fingerprint": FINGERPRINT}
    if include_usage:
        base["usage"] = None

    def chunk(delta, finish=None, **extra):
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                    **extra})

    yield chunk({"role": "assistant", "content": ""})
    async for ev in job.events(KEEPALIVE_S):
        if ev is None:
            yield ": keep-alive\n\n"
        elif isinstance(ev, TextDelta):
            yield chunk({"content": ev.text})
        elif isinstance(ev, ReasoningDelta):
            yield chunk({"reasoning_content": ev.text})
        elif isinstance(ev, ToolCall):
            yield chunk({"tool_calls": [{"index": ev.index, **tool_call_json(ev)}]})
        elif isinstance(ev, Error):
            yield sse(openai_body(APIError(ev.status, ev.message, code=ev.kind)))
        elif isinstance(ev, Done):
            yield chunk({}, FINISH[ev.finish_reason], timings=ev.timings.to_json())
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage_json(ev)})
    yield "data: [DONE]\n\n"


# -- /v1/completions ------------------------------------------------------------------
def parse_completion(body: dict, state) -> Request:
    state.check_model(body.get("model"))
    _unsupported_common(body)
    schema.unsupported(body, {"echo": lambda v: v is False})
    suffix = schema.get(body, "suffix", "str", "")
    samp = schema.sampling(body, ("max_tokens",))
    samp.setdefault("max_tokens", 16)  # the OpenAI default for this endpoint
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if suffix:  # fill in the middle: the prompt is what comes before the cursor
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string when 'suffix' is given", param="prompt")
        ids = schema.infill_ids(state, prompt, suffix, max_tokens=samp["max_tokens"])
    elif isinstance(prompt, str):
        ids = state.model.tokenize(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = state.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"'prompt' has token ids outside the vocabulary (0..{vocab - 1})", param="prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, "unsupported parameter(s): prompt (several prompts in one request; send one at a time)",
                       param="prompt", code="unsupported_parameter")
    else:
        raise APIError(400, "'prompt' must be a string or an array of token ids", param="prompt")
    stream = schema.get(body, "stream", "bool", False)
    schema.get(body, "stream_options", "dict")
    schema.check_context(state, len(ids), samp["max_tokens"])
    return Request(prompt_ids=ids, sampling=samp, raw=True, stream=stream, api="completions",
                   model=state.model_name, timeout_s=state.request_timeout)


async def completions(request, state):
    body = await read_json(request)
    req = await run_in_threadpool(parse_completion, body, state)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    base = {"id": "cmpl-" + req.id, "object": "text_completion", "created": int(req.created),
            "model": state.model_name, "system_fingerprint": FINGERPRINT}

    def piece(text):
        return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}

    def last(done, text):
        end = {**base, "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                    "finish_reason": FINISH[done.finish_reason]}], "timings": done.timings.to_json()}
        if text is not None:  # the whole answer
            return [{**end, "usage": usage_json(done)}]
        return [end] + ([{**base, "choices": [], "usage": usage_json(done)}] if include_usage else [])
    return await text_reply(request, state, req, piece, last, "data: [DONE]\n\n")

