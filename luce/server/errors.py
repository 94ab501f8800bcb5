"""Errors in each API's own JSON shape, so every SDK raises its own typed exception."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 503: "server_error", 504: "timeout_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}


def openai_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": _OPENAI_TYPES.get(e.status, "server_error"),
                      "param": e.param, "code": e.code}}


def anthropic_body(e: APIError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message}}


def error_response(api: str, e: APIError) -> JSONResponse:
    body = anthropic_body(e) if api == "anthropic" else openai_body(e)
    headers = {"retry-after": "1"} if e.status in (429, 503) else None
    return JSONResponse(body, status_code=e.status, headers=headers)


def sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
