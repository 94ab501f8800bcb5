"""Anthropic Messages (/v1/messages, /v1/messages/count_tokens), as Claude Code uses it."""
from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from ..engine.request import Done, Error, ReasoningDelta, Request, Started, TextDelta, ToolCall
from . import schema
from .app import KEEPALIVE_S, collect, raise_error_event, read_json, stream_response, submit
from .errors import APIError, anthropic_body, sse

# Clients send thinking blocks back verbatim with their signature; ours only marks the
# block as luce's (there is nothing to verify on a local server).
SIGNATURE = "luce"


def stop_reason(done: Done) -> str:
    if done.stop_sequence:
        return "stop_sequence"
    return {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "timeout": "max_tokens",
            "cancelled": "end_turn"}.get(done.finish_reason, "end_turn")


def _text_blocks(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{where}' must be a string or an array of content blocks", param=where)
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise APIError(400, f"'{where}[{j}]': block of type {kind!r} is not supported here (text only)",
                           param=f"{where}[{j}]")
        if not isinstance(b.get("text"), str):
            raise APIError(400, f"'{where}[{j}].text' must be a string", param=f"{where}[{j}].text")
        out.append(b["text"])
    return "\n".join(out)


def convert_messages(body: dict) -> list[dict]:
    """Anthropic system + messages as template messages (OpenAI roles, tool messages)."""
    out = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array", param="messages")
    names = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"'{where}.role' must be 'user' or 'assistant'", param=f"{where}.role")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"'{where}.content' must be a string or an array of blocks", param=f"{where}.content")
        texts, calls, thinking, results = [], [], [], []
        for j, b in enumerate(content):
            bw = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise APIError(400, f"'{bw}.text' must be a string", param=f"{bw}.text")
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str):
                    raise APIError(400, f"'{bw}.name' is required", param=f"{bw}.name")
                inp = b.get("input", {})
                if not isinstance(inp, dict):
                    raise APIError(400, f"'{bw}.input' must be an object", param=f"{bw}.input")
                names[b.get("id")] = b["name"]
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(inp, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                res = b.get("content", "")
                text = _text_blocks(res, f"{bw}.content") if res is not None else ""
                if b.get("is_error"):
                    text = f"Error: {text}"
                tid = b.get("tool_use_id")
                results.append({"role": "tool", "tool_call_id": tid, "content": text,
                                **({"name": names[tid]} if tid in names else {})})
            elif kind == "thinking" and role == "assistant":
                if isinstance(b.get("thinking"), str):
                    thinking.append(b["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                pass  # opaque by definition: nothing of it can be rendered
            else:
                raise APIError(400, f"'{bw}': block of type {kind!r} is not supported in a {role} message",
                               param=f"{bw}.type")
        out.extend(results)
        if role == "assistant":
            msg = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def convert_tools(body: dict) -> list[dict] | None:
    tools = schema.get(body, "tools", "list")
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise APIError(400, f"'tools[{i}]' must be an object", param=f"tools[{i}]")
        if t.get("type") not in (None, "custom"):
            raise APIError(400, f"'tools[{i}]': tool type {t['type']!r} is not supported (only custom tools with an "
                                "input_schema)", param=f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"'tools[{i}].name' is required", param=f"tools[{i}].name")
        params = t.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"'tools[{i}].input_schema' must be an object", param=f"tools[{i}].input_schema")
        fn = {"name": t["name"], "parameters": params}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def parse(body: dict, state, count_only: bool = False) -> Request:
    state.check_model(body.get("model"))
    schema.unsupported(body, {
        "tool_choice": lambda v: isinstance(v, dict) and (v.get("type") in ("auto", "none", "any") or (
            v.get("type") == "tool" and isinstance(v.get("name"), str))),
        "mcp_servers": lambda v: not v,
        "container": lambda v: False,
        "output_config": lambda v: isinstance(v, dict) and not v.get("format"),
    })
    messages = convert_messages(body)
    tools = convert_tools(body)
    choice = body.get("tool_choice") or {}
    if choice.get("type") == "none":
        tools = None
    force = None
    if choice.get("type") in ("any", "tool"):
        force = schema.forced_tool(tools, "forced", choice.get("name"), "tool_choice")
    if not count_only:
        schema.get(body, "max_tokens", "int", required=True)
    samp = schema.sampling(body, ("max_tokens",), stop_name="stop_sequences")
    stream = schema.get(body, "stream", "bool", False)
    thinking = schema.get(body, "thinking", "dict")
    budget = enable = None
    if thinking is not None:
        kind = thinking.get("type")
        if kind == "enabled":
            budget = schema.get(thinking, "budget_tokens", "int", where="thinking.")
            enable = True
        elif kind == "disabled":
            budget, enable = 0, False
        elif kind not in ("adaptive", "between_tools"):
            raise APIError(400, "'thinking.type' must be 'enabled', 'disabled' or 'adaptive'", param="thinking.type")
    effort = schema.get(schema.get(body, "output_config", "dict") or {}, "effort", "str", where="output_config.")
    if effort is not None and budget is None and enable is not False:
        levels = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
        if effort not in levels:
            raise APIError(400, f"'output_config.effort' must be one of {', '.join(levels)}", param="output_config.effort")
        budget, _ = schema.effort_budget(levels[effort], "output_config.effort")
    if count_only:
        samp.pop("max_tokens", None)
    if force is not None and enable:
        raise APIError(400, "thinking cannot be enabled when tool_choice forces a tool call", param="thinking")
    return schema.build_chat_request(state, "anthropic", messages, tools, samp, stream=stream,
                                     reasoning_budget=budget, enable_thinking=enable, force_tool=force,
                                     parallel_tool_calls=not choice.get("disable_parallel_tool_use"))


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _usage_json(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def _usage(done: Done, req: Request) -> dict:
    u = done.usage
    return _usage_json(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


async def count_tokens(request, state):
    body = await read_json(request)
    req = await run_in_threadpool(parse, body, state, True)
    return JSONResponse({"input_tokens": len(req.prompt_ids)})


async def messages(request, state):
    body = await read_json(request)
    req = await run_in_threadpool(parse, body, state)
    mid = "msg_" + req.id
    job = submit(state, req)
    if req.stream:
        return stream_response(job, _stream(job, req, mid, state.model_name))
    events = await collect(request, job)
    raise_error_event(events)
    blocks: list[dict] = []
    done = None
    for ev in events:
        if isinstance(ev, ReasoningDelta):
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += ev.text
            else:
                blocks.append({"type": "thinking", "thinking": ev.text, "signature": SIGNATURE})
        elif isinstance(ev, TextDelta):
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += ev.text
            else:
                blocks.append({"type": "text", "text": ev.text})
        elif isinstance(ev, ToolCall):
            blocks.append({"type": "tool_use", "id": _tool_id(ev), "name": ev.name, "input": ev.arguments})
        elif isinstance(ev, Done):
            done = ev
    return JSONResponse({
        "id": mid, "type": "message", "role": "assistant", "model": state.model_name, "content": blocks,
        "stop_reason": stop_reason(done), "stop_sequence": done.stop_sequence, "usage": _usage(done, req),
        "timings": done.timings.to_json(),
    })


async def _stream(job, req: Request, mid: str, model_name: str):
    def message_start(cached: int) -> str:
        return sse({"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model_name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": _usage_json(len(req.prompt_ids), cached, 0)}}, "message_start")

    begun = False
    index = -1
    open_kind = None

    def start(kind: str, block: dict):
        nonlocal index, open_kind
        index += 1
        open_kind = kind
        return sse({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")

    def stop():
        nonlocal open_kind
        frames = ""
        if open_kind == "thinking":
            frames += sse({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": SIGNATURE}}, "content_block_delta")
        if open_kind is not None:
            frames += sse({"type": "content_block_stop", "index": index}, "content_block_stop")
        open_kind = None
        return frames

    def delta(d: dict):
        return sse({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")

    async for ev in job.events(KEEPALIVE_S):
        if not begun:
            # message_start waits for the scheduler's Started, which says how much of the
            # prompt the cache holds; anything else first (a keep-alive while queued, an
            # error) starts the message without that split (message_delta's usage has it)
            begun = True
            yield message_start(ev.cached_tokens if isinstance(ev, Started) else 0)
        if isinstance(ev, Started):
            continue
        if ev is None:
            yield sse({"type": "ping"}, "ping")
        elif isinstance(ev, ReasoningDelta):
            if open_kind != "thinking":
                yield stop() + start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield delta({"type": "thinking_delta", "thinking": ev.text})
        elif isinstance(ev, TextDelta):
            if open_kind != "text":
                yield stop() + start("text", {"type": "text", "text": ""})
            yield delta({"type": "text_delta", "text": ev.text})
        elif isinstance(ev, ToolCall):
            yield stop() + start("tool_use", {"type": "tool_use", "id": _tool_id(ev), "name": ev.name, "input": {}})
            yield delta({"type": "input_json_delta", "partial_json": ev.arguments_json})
            yield stop()
        elif isinstance(ev, Error):
            yield stop() + sse(anthropic_body(APIError(ev.status, ev.message)), "error")
            return
        elif isinstance(ev, Done):
            yield stop()
            usage = _usage(ev, req)
            yield sse({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason(ev), "stop_sequence": ev.stop_sequence},
                       "usage": usage, "timings": ev.timings.to_json()}, "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
