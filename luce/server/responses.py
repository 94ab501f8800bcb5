"""OpenAI Responses (/v1/responses), as Codex uses it: instructions, input items,
function_call / function_call_output items, reasoning.effort, max_output_tokens.

Nothing is stored: a client sends the whole conversation each time (Codex does, with
store=false), so previous_response_id is refused."""
from __future__ import annotations

import base64

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from ..engine.request import Done, Error, ReasoningDelta, Request, TextDelta, ToolCall
from . import schema
from .app import KEEPALIVE_S, collect, raise_error_event, read_json, stream_response, submit
from .errors import APIError, sse
from .openai import content_text

_ENCRYPTED_PREFIX = "luce:"


def _reasoning_text(item: dict) -> str:
    parts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
    if not parts:
        enc = item.get("encrypted_content")
        # our own "encrypted" reasoning is base64 text; anyone else's is opaque
        if isinstance(enc, str) and enc.startswith(_ENCRYPTED_PREFIX):
            try:
                return base64.b64decode(enc[len(_ENCRYPTED_PREFIX):]).decode()
            except ValueError:
                return ""
        parts = [s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict)]
    return "\n".join(p for p in parts if isinstance(p, str))


def convert_input(body: dict) -> list[dict]:
    out: list[dict] = []
    instructions = schema.get(body, "instructions", "str")
    if instructions:
        out.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        out.append({"role": "user", "content": inp})
        return out
    if not isinstance(inp, list) or not inp:
        raise APIError(400, "'input' must be a string or a non-empty array of items", param="input")
    pending_reasoning = None

    def assistant() -> dict:
        # function calls and reasoning attach to the assistant turn they belong to
        nonlocal pending_reasoning
        if not out or out[-1]["role"] != "assistant" or out[-1].get("_closed"):
            out.append({"role": "assistant", "content": ""})
        if pending_reasoning:
            out[-1]["reasoning_content"] = pending_reasoning
            pending_reasoning = None
        return out[-1]

    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"'{where}.role' must be user, system, developer or assistant", param=f"{where}.role")
            text = content_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] = (msg["content"] + "\n" + text) if msg["content"] else text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise APIError(400, f"'{where}.name' is required", param=f"{where}.name")
            args = schema.arguments_text(item.get("arguments"), f"{where}.arguments")
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item.get("call_id") or item.get("id"), "type": "function",
                 "function": {"name": item["name"], "arguments": args}})
        elif kind == "custom_tool_call":
            if not isinstance(item.get("name"), str):
                raise APIError(400, f"'{where}.name' is required", param=f"{where}.name")
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item.get("call_id") or item.get("id"), "type": "function",
                 "function": {"name": item["name"], "arguments": {"input": str(item.get("input", ""))}}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"{where}.output")
            if out and out[-1]["role"] == "assistant":
                out[-1]["_closed"] = True
            cid = item.get("call_id")
            name = next((c["function"]["name"] for m in out for c in m.get("tool_calls", []) if c["id"] == cid), None)
            out.append({"role": "tool", "tool_call_id": cid, "content": text, **({"name": name} if name else {})})
        elif kind == "reasoning":
            pending_reasoning = _reasoning_text(item) or None
        else:
            raise APIError(400, f"'{where}': input item of type {kind!r} is not supported", param=f"{where}.type")
    for m in out:
        m.pop("_closed", None)
    return out


def _custom_parameters(t: dict) -> dict:
    # A custom tool takes free text. Models are trained on JSON-argument tools, so it is
    # offered as a function of one string; its grammar, if any, becomes a hint.
    desc = "The tool's input, as free text."
    fmt = t.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        desc += f" It must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return {"type": "object", "properties": {"input": {"type": "string", "description": desc}}, "required": ["input"]}


def convert_tools(body: dict) -> tuple[list[dict] | None, set[str]]:
    """The tools in the chat form, and the names of the custom (free-text) ones."""
    tools = schema.get(body, "tools", "list")
    if not tools:
        return None, set()
    out, custom = [], set()
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in ("function", "custom"):
            raise APIError(400, f"'tools[{i}]': tool type {kind!r} is not supported (only 'function' and 'custom')",
                           param=f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise APIError(400, f"'tools[{i}].name' is required", param=f"tools[{i}].name")
        if kind == "custom":
            custom.add(t["name"])
            params = _custom_parameters(t)
        else:
            params = t.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise APIError(400, f"'tools[{i}].parameters' must be an object", param=f"tools[{i}].parameters")
        fn = {"name": t["name"], "parameters": params}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out, custom


def parse(body: dict, state) -> Request:
    state.check_model(body.get("model"))
    schema.unsupported(body, {
        "previous_response_id": lambda v: False,
        "conversation": lambda v: False,
        "background": lambda v: v is False,
        "top_logprobs": lambda v: v == 0,
        "tool_choice": lambda v: v in ("auto", "none", "required") or (
            isinstance(v, dict) and v.get("type") in ("function", "custom") and isinstance(v.get("name"), str)),
        "text": lambda v: isinstance(v, dict) and (v.get("format") or {"type": "text"}).get("type") == "text",
        "prompt": lambda v: False,
        "max_tool_calls": lambda v: False,
        # "auto" would drop the start of a conversation that does not fit; luce answers 413
        "truncation": lambda v: v == "disabled",
    })
    messages = convert_input(body)
    tools, custom = convert_tools(body)
    choice = body.get("tool_choice")
    if choice == "none":
        tools, custom = None, set()
    force = None
    if choice == "required" or isinstance(choice, dict):
        force = schema.forced_tool(tools, "forced", choice.get("name") if isinstance(choice, dict) else None,
                                   "tool_choice")
    samp = schema.sampling(body, ("max_output_tokens",))
    stream = schema.get(body, "stream", "bool", False)
    reasoning = schema.get(body, "reasoning", "dict") or {}
    budget, enable = schema.effort_budget(schema.get(reasoning, "effort", "str", where="reasoning."),
                                          "reasoning.effort")
    parallel = schema.get(body, "parallel_tool_calls", "bool", True)
    req = schema.build_chat_request(state, "responses", messages, tools, samp, stream=stream,
                                    reasoning_budget=budget, enable_thinking=enable, force_tool=force,
                                    parallel_tool_calls=parallel)
    return req, custom


class _Output:
    """Builds the output items from the event stream, and the SSE events on the way."""

    def __init__(self, req: Request, include_encrypted: bool, custom: set[str] = frozenset()):
        self.req = req
        self.custom = custom
        self.items: list[dict] = []
        self.open: dict | None = None
        self.seq = 0
        self.include_encrypted = include_encrypted
        self.n = 0

    def _id(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.req.id}{self.n:03d}"

    def ev(self, kind: str, **payload) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq, **payload}

    def close(self) -> list:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = len(self.items) - 1
        item["status"] = "completed"
        if item["type"] == "message":
            text = item["content"][0]["text"]
            return [self.ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=text, logprobs=[]),
                    self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                            part=item["content"][0]),
                    self.ev("response.output_item.done", output_index=idx, item=item)]
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if self.include_encrypted:
                item["encrypted_content"] = _ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()
            return [self.ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=text),
                    self.ev("response.output_item.done", output_index=idx, item=item)]
        return []

    def feed(self, e) -> list:
        frames = []
        if isinstance(e, ReasoningDelta):
            if self.open is None or self.open["type"] != "reasoning":
                frames += self.close()
                item = {"type": "reasoning", "id": self._id("rs"), "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
                self.items.append(item)
                self.open = item
                frames.append(self.ev("response.output_item.added", output_index=len(self.items) - 1,
                                      item={**item, "content": []}))
            self.open["content"][0]["text"] += e.text
            frames.append(self.ev("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=e.text))
        elif isinstance(e, TextDelta):
            if self.open is None or self.open["type"] != "message":
                frames += self.close()
                item = {"type": "message", "id": self._id("msg"), "status": "in_progress", "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
                self.items.append(item)
                self.open = item
                idx = len(self.items) - 1
                frames.append(self.ev("response.output_item.added", output_index=idx, item={**item, "content": []}))
                frames.append(self.ev("response.content_part.added", item_id=item["id"], output_index=idx,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            self.open["content"][0]["text"] += e.text
            frames.append(self.ev("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=e.text, logprobs=[]))
        elif isinstance(e, ToolCall) and e.name in self.custom:
            frames += self.close()
            text = e.arguments.get("input")
            text = text if isinstance(text, str) else e.arguments_json
            frames += self._tool_call(e, "custom_tool_call", "ctc", "custom_tool_call_input", "input", text)
        elif isinstance(e, ToolCall):
            frames += self.close()
            frames += self._tool_call(e, "function_call", "fc", "function_call_arguments", "arguments",
                                      e.arguments_json, name=e.name)
        return frames

    def _tool_call(self, e, kind, prefix, events, field, value, **done):
        """Tool call e as a whole item of type kind (a call arrives whole): added, its one
        delta of field, done."""
        item = {"type": kind, "id": self._id(prefix), "call_id": e.id, "name": e.name, field: "",
                "status": "in_progress"}
        self.items.append(item)
        idx = len(self.items) - 1
        frames = [self.ev("response.output_item.added", output_index=idx, item=dict(item)),
                  self.ev(f"response.{events}.delta", item_id=item["id"], output_index=idx, delta=value)]
        item.update({field: value, "status": "completed"})
        frames.append(self.ev(f"response.{events}.done", item_id=item["id"], output_index=idx, **done, **{field: value}))
        frames.append(self.ev("response.output_item.done", output_index=idx, item=item))
        return frames


def _response(req: Request, body: dict, state, status: str, items: list, done: Done | None) -> dict:
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    out = {
        "id": "resp_" + req.id, "object": "response", "created_at": int(req.created), "status": status,
        "model": state.model_name, "output": items, "error": None,
        "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "text": {"format": {"type": "text"}}, "store": False, "metadata": body.get("metadata") or {},
        "previous_response_id": None, "truncation": "disabled", "usage": None,
    }
    if done is not None:
        u = done.usage
        out["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                        "output_tokens": u.completion_tokens,
                        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                        "total_tokens": u.total_tokens}
        out["timings"] = done.timings.to_json()
        if done.finish_reason in ("length", "timeout"):
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
    return out


async def create(request, state):
    body = await read_json(request)
    req, custom = await run_in_threadpool(parse, body, state)
    include = schema.get(body, "include", "list") or []
    build = _Output(req, "reasoning.encrypted_content" in include, custom)
    job = submit(state, req)
    if req.stream:
        async def frames():
            def frame(kind_payload):
                kind, payload = kind_payload
                return sse(payload, kind)
            yield frame(build.ev("response.created", response=_response(req, body, state, "in_progress", [], None)))
            yield frame(build.ev("response.in_progress", response=_response(req, body, state, "in_progress", [], None)))
            async for e in job.events(KEEPALIVE_S):
                if e is None:
                    yield ": keep-alive\n\n"
                    continue
                if isinstance(e, Error):
                    resp = _response(req, body, state, "failed", build.items, None)
                    resp["error"] = {"code": e.kind, "message": e.message}
                    yield frame(build.ev("response.failed", response=resp))
                    return
                if isinstance(e, Done):
                    for f in build.close():
                        yield frame(f)
                    resp = _response(req, body, state, "completed", build.items, e)
                    # response.completed even when incomplete (the status says so): Codex and the
                    # SDK's stream helper treat a stream without it as broken
                    yield frame(build.ev("response.completed", response=resp))
                    return
                for f in build.feed(e):
                    yield frame(f)
        return stream_response(job, frames())
    events = await collect(request, job)
    raise_error_event(events)
    done = None
    for e in events:
        if isinstance(e, Done):
            done = e
        else:
            build.feed(e)
    build.close()
    return JSONResponse(_response(req, body, state, "completed", build.items, done))



