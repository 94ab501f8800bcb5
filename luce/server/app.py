"""The Starlette application: routes, API keys, the engine's lifetime, and the plumbing
every API shares (JSON bodies, submitting to the queue, streaming with cancellation).

Handlers render the chat template and tokenize in a worker thread, so a long prompt does
not stall every other client's stream; the tokenizer is safe to share between threads."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.engine import Engine, Job, QueueFull
from ..engine.request import Done, Error, Request, TextDelta
from ..text.chat_format import detect_chat_format
from .errors import APIError, error_response, openai_body, sse
from .metrics import Metrics
from .schema import template_renders_tools

log = logging.getLogger("luce.server")


class ServerState:
    def __init__(self, model, *, model_name: str | None = None, api_key: str | None = None,
                 max_queue: int = 64, request_timeout: float | None = 600.0, draft: dict | None = None,
                 stepper_factory=None, accept_any_model: bool = False, settings: dict | None = None,
                 kv_slots: int = 1):
        self.model = model
        self.model_name = model_name or model.path.stem
        self.aliases = {self.model_name, model.path.name, model.path.stem}
        self.api_key = api_key
        self.accept_any_model = accept_any_model
        self.request_timeout = request_timeout
        self.draft = draft
        self.settings = dict(settings or {})
        self.metrics = Metrics()
        self.engine = Engine(model, max_queue=max_queue, request_timeout=request_timeout,
                             stepper_factory=stepper_factory, metrics=self.metrics, kv_slots=kv_slots)
        self.template_source = getattr(model.chat_template, "source", "") or ""
        # the family may say so, or the model's own template (it knows the <think> markers)
        self.supports_reasoning = bool(model.family.chat_format.reasoning
                                       or detect_chat_format(self.template_source).reasoning)
        self.template_renders_tools = template_renders_tools(model)
        self.started = time.time()

    def check_model(self, name):
        if name is None:
            raise APIError(400, "'model' is required", param="model")
        if not isinstance(name, str):
            raise APIError(400, "'model' must be a string", param="model")
        if name not in self.aliases and not self.accept_any_model:
            raise APIError(404, f"model {name!r} is not served here (this server serves {self.model_name!r}; "
                                "see GET /v1/models)", param="model", code="model_not_found")


def state_of(request: HTTPRequest) -> ServerState:
    return request.app.state.luce


async def read_json(request: HTTPRequest) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def check_key(state: ServerState, request: HTTPRequest, api: str):
    if not state.api_key:
        return
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    if given is None:
        raise APIError(401, "missing API key (send 'Authorization: Bearer KEY'"
                            + (" or 'x-api-key: KEY')" if api == "anthropic" else ")"), code="invalid_api_key")
    if not hmac.compare_digest(given.encode(), state.api_key.encode()):
        raise APIError(401, "invalid API key", code="invalid_api_key")


def submit(state: ServerState, req: Request) -> Job:
    try:
        job = state.engine.submit(req)
    except QueueFull as e:
        raise APIError(429, str(e), code="queue_full") from None
    return job


async def _watch_disconnect(request: HTTPRequest, job: Job):
    # after the body is read, the next ASGI message is the client going away
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            return


async def collect(request: HTTPRequest, job: Job) -> list:
    """All of a job's events, cancelling it if the client disconnects meanwhile."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    events = []
    try:
        async for ev in job.events():
            events.append(ev)
    finally:
        watcher.cancel()
        job.cancel()  # no-op when finished; stops the generation if this task was cancelled
    return events


def raise_error_event(events: list):
    for ev in events:
        if isinstance(ev, Error):
            raise APIError(ev.status, ev.message, code=ev.kind)


# A stream quiet for this long (a long prefill in the queue, a tool call the parser holds
# until it is complete) gets a keep-alive, so proxies and clients do not drop it.
KEEPALIVE_S = 10.0


def stream_response(job: Job, frames: AsyncIterator[str]) -> StreamingResponse:
    async def body():
        try:
            async for frame in frames:
                yield frame
        finally:
            # the client went away (or the stream ended): stop the generation at its next token
            job.cancel()
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def text_reply(request: HTTPRequest, state, req: Request, piece: Callable, last: Callable, end: str = ""):
    """A raw-text generation's answer in an API that sends OpenAI-shaped errors: streamed,
    an SSE event `piece(text)` a text piece, the events `last(done, None)` after them, then
    `end`; else the one JSON object `last(done, text)[0]`."""
    job = submit(state, req)
    if req.stream:
        async def frames():
            async for ev in job.events(KEEPALIVE_S):
                if ev is None:
                    yield ": keep-alive\n\n"
                elif isinstance(ev, TextDelta):
                    yield sse(piece(ev.text))
                elif isinstance(ev, Error):
                    yield sse(openai_body(APIError(ev.status, ev.message, code=ev.kind)))
                elif isinstance(ev, Done):
                    for body in last(ev, None):
                        yield sse(body)
            if end:
                yield end
        return stream_response(job, frames())
    events = await collect(request, job)
    raise_error_event(events)
    return JSONResponse(last(events[-1], "".join(ev.text for ev in events if isinstance(ev, TextDelta)))[0])


def endpoint(api: str, handler: Callable, auth: bool = True):
    """Wrap a handler: API key, the API's error format, request metrics."""
    async def route(request: HTTPRequest) -> Response:
        route_path = request.scope.get("luce.route", request.url.path)
        state = state_of(request)
        status = 200
        try:
            if auth:
                check_key(state, request, api)
            resp = await handler(request, state)
            status = resp.status_code
            return resp
        except APIError as e:
            status = e.status
            if e.status >= 500:
                log.error("%s %s: %s", request.method, request.url.path, e.message)
            return error_response(api, e)
        except Exception as e:
            status = 500
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(api, APIError(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            state.metrics.request(api, route_path, status)
    return route


# -- small endpoints -----------------------------------------------------------------------
async def health(request, state):
    return JSONResponse({"status": "ok", "model": state.model_name, "queue_depth": state.engine.queue_depth,
                         "busy": state.engine.busy})


def _model_card(state: ServerState) -> dict:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.started))
    return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "luce",
            "context_length": state.model.n_ctx,
            # Anthropic's /v1/models shape, for clients that list models that way
            "type": "model", "display_name": state.model_name, "created_at": created,
            "max_input_tokens": state.model.n_ctx, "max_tokens": state.model.n_ctx}


async def models(request, state):
    return JSONResponse({"object": "list", "data": [_model_card(state)], "has_more": False,
                         "first_id": state.model_name, "last_id": state.model_name})


async def model_info(request, state):
    name = request.path_params["name"]
    state.check_model(name)
    return JSONResponse(_model_card(state))


async def props(request, state):
    m = state.model
    fam = m.family
    opt = fam.optimizations
    opts = opt.as_dict() if hasattr(opt, "as_dict") else dict(opt)
    cf = fam.chat_format
    defaults = m.sampling_params()
    return JSONResponse({
        "model": state.model_name,
        "model_path": str(m.path),
        "family": fam.name,
        "architecture": m.config.arch,
        "backend": m.backend.name,
        "n_ctx": m.n_ctx,
        "n_ctx_train": m.config.n_ctx_train,
        "draft": state.draft,
        "optimizations": {k: list(v) if isinstance(v, tuple) else v for k, v in opts.items()},
        "chat_format": {"tool_call_format": cf.tool_call_format, "reasoning": state.supports_reasoning},
        "chat_template": getattr(m.chat_template, "source", None),
        "default_sampling": {k: (list(v) if isinstance(v, tuple) else v) for k, v in defaults.__dict__.items()},
        "runtime": {"max_queue": state.engine.max_queue, "request_timeout_s": state.request_timeout,
                    "kv_slots": state.engine.kv_slots,
                    "api_key_required": bool(state.api_key), "accept_any_model": state.accept_any_model,
                    "load_s": round(getattr(m, "load_s", 0.0), 3), **state.settings},
        "queue_depth": state.engine.queue_depth,
    })


async def metrics(request, state):
    body, ctype = state.metrics.render()
    return Response(body, media_type=ctype)


def create_app(model, **kw) -> Starlette:
    """The ASGI app serving `model` (a loaded luce Model). Keywords: see ServerState."""
    from . import anthropic, infill, openai, responses

    state = ServerState(model, **kw)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.close()

    def labelled(path, fn):
        # metrics are labelled by route, not by URL: /v1/models/{name} must not mint a label per name
        async def call(request):
            request.scope["luce.route"] = path
            return await fn(request)
        return call

    routes = [
        Route("/health", endpoint("openai", health, auth=False), methods=["GET"]),
        Route("/v1/health", endpoint("openai", health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint("openai", metrics, auth=False), methods=["GET"]),
        Route("/props", endpoint("openai", props), methods=["GET"]),
        Route("/v1/models", endpoint("openai", models), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint("openai", model_info), methods=["GET"]),
        Route("/v1/chat/completions", endpoint("openai", openai.chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("openai", openai.completions), methods=["POST"]),
        Route("/v1/messages", endpoint("anthropic", anthropic.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint("anthropic", anthropic.count_tokens), methods=["POST"]),
        Route("/v1/responses", endpoint("openai", responses.create), methods=["POST"]),
        Route("/infill", endpoint("openai", infill.infill), methods=["POST"]),  # llama.cpp's, for editors
    ]
    # the same routes without /v1, for clients configured with a bare base URL
    routes += [Route(r.path[3:], r.endpoint, methods=r.methods) for r in list(routes) if r.path.startswith("/v1/")
               and r.path not in ("/v1/health",)]
    routes = [Route(r.path, labelled(r.path, r.endpoint), methods=r.methods) for r in routes]
    async def not_found(request, exc):
        # unknown routes answer in JSON too, so an SDK pointed at the wrong path says why
        api = "anthropic" if request.url.path.endswith(("/messages", "/count_tokens")) else "openai"
        status = getattr(exc, "status_code", 404)
        what = "no such route" if status == 404 else f"method {request.method} not allowed"
        return error_response(api, APIError(status, f"{what}: {request.method} {request.url.path}"))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.luce = state
    return app


__all__ = ["create_app", "ServerState"]
