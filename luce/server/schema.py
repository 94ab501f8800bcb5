"""Request parsing shared by the three APIs: typed field access that fails with a 400
naming the field, sampling parameters, and the one place a conversation becomes an
internal `Request` (template, tokens, context check, reasoning settings)."""
from __future__ import annotations

import json
from typing import Any

from ..engine.request import EFFORT_BUDGETS, Request
from .errors import APIError

_KINDS = {
    "str": ((str,), "a string"),
    "int": ((int,), "an integer"),
    "number": ((int, float), "a number"),
    "bool": ((bool,), "a boolean"),
    "list": ((list,), "an array"),
    "dict": ((dict,), "an object"),
}


def get(body: dict, name: str, kind: str | tuple[str, ...], default: Any = None, *, required: bool = False,
        where: str = "") -> Any:
    """`body[name]` checked against `kind` ("str", "int", "number", "bool", "list", "dict",
    or a tuple of them); None and absent give `default`."""
    label = f"{where}{name}"
    if name not in body or body[name] is None:
        if required:
            raise APIError(400, f"'{label}' is required", param=label)
        return default
    v = body[name]
    kinds = (kind,) if isinstance(kind, str) else kind
    for k in kinds:
        types, _ = _KINDS[k]
        if isinstance(v, bool) and k != "bool":
            continue
        if isinstance(v, types):
            return v
        if k == "int" and isinstance(v, float) and v.is_integer():
            return int(v)
    want = " or ".join(_KINDS[k][1] for k in kinds)
    raise APIError(400, f"'{label}' must be {want}, got {_json_type(v)}", param=label)


def _json_type(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def unsupported(body: dict, checks: dict[str, Any]):
    """400 for parameters set to a value the server cannot honour. `checks` maps a name
    to a predicate that is true when the value is acceptable."""
    bad = [name for name, ok in checks.items() if body.get(name) is not None and not ok(body[name])]
    if bad:
        raise APIError(400, f"unsupported parameter(s): {', '.join(bad)} (luce cannot honour "
                            f"{'it' if len(bad) == 1 else 'them'}; leave {'it' if len(bad) == 1 else 'them'} out)",
                       param=bad[0], code="unsupported_parameter")


def stop_list(body: dict, name: str) -> tuple[str, ...]:
    v = get(body, name, ("str", "list"))
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if not all(isinstance(s, str) for s in v):
        raise APIError(400, f"'{name}' must be a string or an array of strings", param=name)
    return tuple(s for s in v if s)


# llama.cpp sampler settings clients such as Open WebUI pass through, that luce's sampler
# does not have: refused unless they are at their "off" value.
_SAMPLERS_OFF = {
    "mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "typical_p": 1.0, "tfs_z": 1.0, "top_a": 0.0,
    "dry_multiplier": 0.0, "xtc_probability": 0.0, "xtc_threshold": None, "dynatemp_range": 0.0,
    "n_probs": 0, "min_tokens": 0, "grammar": "", "json_schema": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}


def sampling(body: dict, max_tokens_names: tuple[str, ...], stop_name: str = "stop") -> dict:
    """SamplingParams keywords from the fields every API shares (OpenAI names, plus the
    llama.cpp extensions top_k, min_p, repeat_penalty, repeat_last_n, ignore_eos, n_predict)."""
    unsupported(body, {k: (lambda v, off=off: off is not None and v == off) for k, off in _SAMPLERS_OFF.items()})
    out: dict[str, Any] = {}
    for name, kind in (("temperature", "number"), ("top_p", "number"), ("top_k", "int"), ("min_p", "number"),
                       ("presence_penalty", "number"), ("frequency_penalty", "number"),
                       ("repeat_penalty", "number"), ("repeat_last_n", "int"), ("seed", "int"),
                       ("ignore_eos", "bool")):
        v = get(body, name, kind)
        if v is not None:
            out[name] = v
    if out.get("repeat_last_n", 0) < 0:
        raise APIError(400, "'repeat_last_n' must be >= 0", param="repeat_last_n")
    # llama.cpp's seed -1 and vLLM's top_k -1 mean "random" and "off"
    if out.get("seed", 0) < 0:
        del out["seed"]
    if out.get("top_k", 0) < 0:
        out["top_k"] = 0
    max_tokens_names = max_tokens_names + ("n_predict",)
    for name, lo, hi in (("temperature", 0, None), ("top_p", 0, 1), ("min_p", 0, 1),
                         ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
        v = out.get(name)
        if v is not None and (v < lo or (hi is not None and v > hi)):
            rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise APIError(400, f"'{name}' must be {rng}, got {v}", param=name)
    if out.get("top_p") == 0:
        raise APIError(400, "'top_p' must be greater than 0", param="top_p")
    if "repeat_penalty" in out and out["repeat_penalty"] <= 0:
        raise APIError(400, "'repeat_penalty' must be > 0", param="repeat_penalty")
    given = [n for n in max_tokens_names if body.get(n) is not None]
    for n in given:
        v = get(body, n, "int")
        if v < 1:
            raise APIError(400, f"'{n}' must be at least 1, got {v}", param=n)
        # when a client sends several spellings, the tightest limit wins
        out["max_tokens"] = min(v, out.get("max_tokens", v))
    stops = stop_list(body, stop_name)
    if stops:
        out["stop"] = stops
    from ..engine.sampling import SamplingParams
    try:
        SamplingParams().with_(**out)  # the sampler's own checks, before the request queues
    except (ValueError, TypeError) as e:
        raise APIError(400, f"bad sampling parameters: {e}") from None
    return out


def check_context(state, n_prompt: int, max_tokens: int | None):
    n_ctx = state.model.n_ctx
    if n_prompt >= n_ctx:
        raise APIError(413, f"the prompt is {n_prompt} tokens, over the context of {n_ctx} tokens",
                       code="context_length_exceeded")
    if max_tokens is not None and n_prompt + max_tokens > n_ctx:
        raise APIError(413, f"the prompt ({n_prompt} tokens) plus max tokens ({max_tokens}) is over the "
                            f"context of {n_ctx} tokens", param="max_tokens", code="context_length_exceeded")


def infill_ids(state, prefix: str, suffix: str, extra=(), prompt: str = "", max_tokens: int | None = None,
               param: str = "suffix") -> list[int]:
    """A fill-in-the-middle prompt for the served model (luce.text.fim), fitted into the
    context less max_tokens the way editors' plugins expect (far context dropped first);
    400 where the model has no FIM tokens."""
    from ..text.fim import fim_tokens, infill_ids as build
    fim = fim_tokens(state.model.tokenizer)
    if fim is None:
        raise APIError(400, f"'{param}': {state.model_name} has no fill-in-the-middle tokens (a code model such "
                            "as Qwen2.5-Coder, StarCoder or CodeLlama has them)", param=param,
                       code="unsupported_parameter")
    # with no max tokens (llama.cpp's n_predict -1) a quarter of the context, up to 256
    # tokens, stays free for the answer: a prompt that filled it could not be answered
    n_ctx = state.model.n_ctx
    budget = n_ctx - (max_tokens or min(256, n_ctx // 4))
    try:
        return build(state.model.tokenizer, fim, prefix, suffix, extra, prompt, budget=budget)
    except ValueError as e:
        raise APIError(413, f"{e} (the context is {state.model.n_ctx} tokens)", param="max_tokens",
                       code="context_length_exceeded") from None


def check_tools(tools) -> list[dict] | None:
    """Tools in the OpenAI chat form, validated."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise APIError(400, f"'tools[{i}]' must be an object", param=f"tools[{i}]")
        if t.get("type", "function") != "function":
            raise APIError(400, f"'tools[{i}]': tool type {t.get('type')!r} is not supported (only 'function')",
                           param=f"tools[{i}].type")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"'tools[{i}].function.name' is required", param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"'tools[{i}].function.parameters' must be an object",
                           param=f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out or None


def arguments_text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "{}"
    raise APIError(400, f"'{where}' must be a JSON string or an object", param=where)


def effort_budget(effort: str | None, where: str) -> tuple[int | None, bool | None]:
    """(reasoning budget, enable_thinking) for an effort level."""
    if effort is None:
        return None, None
    if effort not in EFFORT_BUDGETS:
        raise APIError(400, f"'{where}' must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}", param=where)
    budget = EFFORT_BUDGETS[effort]
    return budget, budget != 0


def forced_tool(tools: list[dict] | None, choice: str | None, name: str | None, where: str) -> str | None:
    """Check a tool_choice that forces a call: "" for any tool, the tool's name, or None
    when nothing is forced."""
    if choice is None:
        return None
    if not tools:
        raise APIError(400, f"'{where}' asks for a tool call but no tools were given", param=where)
    if name is None:
        return ""
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"'{where}' names {name!r}, which is not among the tools", param=where)
    return name


def tool_call_opening(state, name: str) -> str:
    """The start of a tool call in the model's own syntax, written after the generation
    prompt so that the model can only go on with a call (to `name`, when given)."""
    from ..text.chat_format import detect_chat_format

    fmt = detect_chat_format(state.template_source).name if state.template_renders_tools else "hermes"
    if fmt == "qwen3_coder":
        return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")
    if fmt == "llama3":
        return '{"name": "' + (f'{name}", "parameters":' if name else "")
    # Hermes JSON; the opening ends on a token boundary ("arguments": then " {")
    return "<tool_call>\n" + (f'{{"name": "{name}", "arguments":' if name else "")


def build_chat_request(state, api: str, messages: list[dict], tools: list[dict] | None, samp: dict, *,
                       stream: bool, reasoning_budget: int | None = None, enable_thinking: bool | None = None,
                       template_kwargs: dict | None = None, force_tool: str | None = None,
                       parallel_tool_calls: bool = True) -> Request:
    """Render the conversation with the model's chat template, tokenize, check the context.
    `force_tool` (see forced_tool) makes the answer start with a tool call."""
    from ..text.chat_template import TemplateError

    from ..text.chat_format import default_template_kwargs, prompt_opens_reasoning

    model = state.model
    extra = {**default_template_kwargs(state.template_source), **(template_kwargs or {})}
    if enable_thinking is not None:
        extra.setdefault("enable_thinking", enable_thinking)
    if tools and not state.template_renders_tools:
        messages = tools_in_messages(messages, tools)
    if force_tool is not None:
        enable_thinking = False  # a forced call comes first, as with Anthropic's API
    try:
        text = model.render_chat(messages, tools=tools, add_generation_prompt=True, **extra)
    except TemplateError as e:
        raise APIError(400, str(e)) from None
    starts = prompt_opens_reasoning(text)
    reasoning = state.supports_reasoning or starts
    prefill = ""
    if force_tool is not None:
        prefill = ("\n</think>\n\n" if starts else "") + tool_call_opening(state, force_tool)
    ids = model.tokenizer.encode(text + prefill, add_special=False, parse_special=True)
    check_context(state, len(ids), samp.get("max_tokens"))
    if enable_thinking is False and reasoning_budget is None:
        reasoning_budget = 0
    return Request(prompt_ids=ids, sampling=samp, tools=tools, parse_reasoning=reasoning, prefill=prefill,
                   single_tool_call=not parallel_tool_calls,
                   starts_in_reasoning=starts, reasoning_budget=reasoning_budget if reasoning else None,
                   stream=stream, api=api, model=state.model_name, timeout_s=state.request_timeout)


_TOOLS_NOTE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_renders_tools(model) -> bool:
    """Whether the chat template shows the model the tools it is given (many small
    models' templates drop them)."""
    probe = [{"type": "function", "function": {"name": "luce_probe_tool", "parameters": {"type": "object"}}}]
    try:
        return "luce_probe_tool" in model.render_chat([{"role": "user", "content": "x"}], tools=probe)
    except Exception:  # a template that cannot render the probe: leave its tool handling alone
        return True


def tools_in_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with tools, calls and results written into the text in the Hermes
    format the output parser reads, for a template that would drop them."""
    note = _TOOLS_NOTE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m.pop("tool_calls"):
                args = c["function"]["arguments"]
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                calls.append("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": args},
                                                          ensure_ascii=False) + "\n</tool_call>")
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + calls)
        elif m["role"] == "tool":
            text = "<tool_response>\n" + str(m.get("content", "")) + "\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text
                continue
            m = {"role": "user", "content": text, "_results": True}
        out.append(m)
    for m in out:
        m.pop("_results", None)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
    else:
        out.insert(0, {"role": "system", "content": note})
    return out

