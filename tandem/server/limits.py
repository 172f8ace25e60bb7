"""Limits the frontend enforces before any work: request body size and chat message count, checked on the raw
bytes so that an oversized request is refused without parsing it on the event loop."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .anthropic_protocol import error_body as anthropic_error_body, is_anthropic_path
from .responses_protocol import is_responses_path
from .protocol import error_body

MIB = 1 << 20
DRAIN_BYTES = 64 * MIB     # an oversized body is read and dropped up to this, then the connection closes


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int        # request bodies above this get 413 (--max-request-bytes)
    max_messages: int = 2048      # chat requests with more messages get 400 (--max-messages; OpenAI's limit too)
    health_timeout_s: float = 30.0  # /health is 503 when the engine has sent nothing for this long

    @staticmethod
    def default_request_bytes(max_context: int) -> int:
        """1 MiB plus 32 bytes per context token: room for a full-context prompt as text (~4-5 bytes a token)
        or as JSON token ids (~7), with margin; 1.25 MiB for an 8k context."""
        return MIB + 32 * max_context


class BodyLimitMiddleware:
    """Reads each POST body up to the limit (Content-Length is checked before reading anything) and refuses
    chat bodies that name more roles than the message limit allows, then replays the body to the app."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = self.limits.max_request_bytes
        too_large = f"the request body is larger than the limit of {limit} bytes (--max-request-bytes)"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _refuse(scope, receive, send, 413, too_large, None)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _refuse(scope, receive, send, 413, too_large, None)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        # Every message has a "role" key, so this count bounds the message count from above (it can only
        # over-count when content nests objects with a "role" key): a huge chat is refused before parsing.
        path = scope["path"]
        chat = path.endswith("/chat/completions") or is_responses_path(path) or is_anthropic_path(path)
        if chat and body.count(b'"role"') > self.limits.max_messages:
            return await _reply(scope, send, 400, f"too many messages: the limit is {self.limits.max_messages} "
                                           f"(--max-messages)", "input" if is_responses_path(path) else "messages")
        done = False

        async def replay():
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(scope, receive, send, status: int, message: str, param: str | None) -> None:
    """Discard the rest of an oversized body (up to DRAIN_BYTES: a client still sending would otherwise see
    a broken pipe instead of the answer), keeping none of it, then answer."""
    drained = 0
    while drained < DRAIN_BYTES:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        drained += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    await _reply(scope, send, status, message, param)


async def _reply(scope, send, status: int, message: str, param: str | None) -> None:
    """An error in the route's shape (Anthropic's on /v1/messages, else OpenAI's), sent before FastAPI sees the
    request; the connection closes after it."""
    body = json.dumps(anthropic_error_body(status, message) if is_anthropic_path(scope["path"])
                      else error_body(message, "invalid_request_error", param)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
