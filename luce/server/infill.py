"""llama.cpp's /infill: code completion between the text before the cursor and the text
after it, as editor plugins (llama.vscode, llama.vim) call it, answered in llama.cpp's
/completion format ("content", "stop", "timings"; streamed as one JSON object an event).
Errors come in the OpenAI shape, as llama.cpp's server sends them."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from ..engine.request import Done, Request
from . import schema
from .app import read_json, text_reply
from .errors import APIError

# llama.cpp's stop_type: "eos" (an end-of-generation token), "word" (a stop string), "limit"
STOP_TYPE = {"stop": "eos", "length": "limit", "timeout": "limit", "cancelled": "none"}


def parse_infill(body: dict, state) -> Request:
    if body.get("model") is not None:  # llama.cpp's clients send none: there is one model
        state.check_model(body["model"])
    prefix = schema.get(body, "input_prefix", "str", "")
    suffix = schema.get(body, "input_suffix", "str", "")
    prompt = schema.get(body, "prompt", "str", "")
    extra = []
    for i, chunk in enumerate(schema.get(body, "input_extra", "list", [])):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise APIError(400, f"'{where}' must be an object with 'filename' and 'text'", param=where)
        extra.append((schema.get(chunk, "filename", "str", "tmp", where=where + "."),
                      schema.get(chunk, "text", "str", "", where=where + ".")))
    samp = schema.sampling(body, ("max_tokens",))
    stream = schema.get(body, "stream", "bool", False)
    # fitted into the context less max tokens (413 where even the markers do not fit)
    ids = schema.infill_ids(state, prefix, suffix, extra, prompt, samp.get("max_tokens"), param="input_suffix")
    return Request(prompt_ids=ids, sampling=samp, raw=True, stream=stream, api="infill",
                   model=state.model_name, timeout_s=state.request_timeout)


def _final(done: Done, model: str, content: str) -> dict:
    u = done.usage
    return {"index": 0, "content": content, "stop": True, "model": model,
            "stop_type": "word" if done.stop_sequence else STOP_TYPE.get(done.finish_reason, "eos"),
            "stopping_word": done.stop_sequence or "", "tokens_predicted": u.completion_tokens,
            "tokens_evaluated": u.prompt_tokens, "tokens_cached": u.cached_tokens,
            "timings": done.timings.to_json()}


async def infill(request, state):
    body = await read_json(request)
    req = await run_in_threadpool(parse_infill, body, state)
    return await text_reply(request, state, req, lambda text: {"index": 0, "content": text, "stop": False},
                            lambda done, text: [_final(done, state.model_name, text or "")])
