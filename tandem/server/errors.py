"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for responses, for streams, and
for FastAPI's validation errors (folded into 400s that name the field's path, e.g. `messages[1].role`)."""
from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .protocol import APIError, error_body, error_code, retry_after


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: a message that quotes client text holding a lone surrogate still renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True).encode()


def error_response(body: dict, status: int) -> ErrorResponse:
    """An error body (any API's shape) with its status and headers (Retry-After on a 503)."""
    return ErrorResponse(body, status_code=status, headers=retry_after(status))


def error(status: int, message: str, type: str, param: str | None = None, code: str | None = None):
    return error_response(error_body(message, type, param, error_code(status, code)), status)


def engine_error_body(e) -> dict:
    """An EngineError (engine down or stopping, or the request failed) in one shape, the JSON body's and the
    stream's alike, and the same as a refusal's or /health's 503 (protocol.error_code)."""
    return error_body(e.message, {503: "service_unavailable", 400: "invalid_request_error", 408: "timeout"}
                      .get(e.status, "server_error"), None, error_code(e.status))


def engine_error(e) -> ErrorResponse:
    return error_response(engine_error_body(e), e.status)


def stream_error(e: Exception) -> str:
    """The SSE event that ends a stream its request could not finish (engine down or stopping, or failed)."""
    if isinstance(e, APIError):
        return sse(e.body())
    return sse(engine_error_body(e))


def _param_path(loc) -> str | None:
    """The field a validation error is about, as `messages[0].role`: body fields and list indices, up to
    the first union branch pydantic adds to the location (`str`, `list[int]` ...)."""
    if len(loc) < 2 or loc[0] != "body":
        return None
    path = str(loc[1])
    for part in loc[2:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            path += f".{part}"
        else:
            break
    return path


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(exc: RequestValidationError, render=error) -> JSONResponse:
    """A 400 naming the field, rendered by `render(status, message, type, param)` (the route's error shape)."""
    errs = exc.errors()
    first = errs[0] if errs else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return render(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                      "invalid_request_error")
    param = _param_path(first["loc"])
    if param is None:
        return render(400, f"the request body must be a JSON object: {first['msg']}", "invalid_request_error")
    if first["type"] == "missing":
        return render(400, f"missing required field: {param}", "invalid_request_error", param)
    if first["type"] == "extra_forbidden":
        return render(400, f"unrecognized request argument supplied: {param}", "invalid_request_error", param)
    msgs = list(dict.fromkeys(e["msg"] for e in errs if _param_path(e["loc"]) == param))
    return render(400, f"invalid value for {param}: {'; or '.join(msgs)}"[:1000], "invalid_request_error", param)
