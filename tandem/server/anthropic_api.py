"""Anthropic's Messages API: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

Requests are mapped onto the chat route's request (anthropic_protocol.py) and run through the OpenAI server's
own submit / collect / abort machinery: the same template, tool plans, grammar, limits and disconnect handling.
Errors on these paths leave in Anthropic's shape, {"type": "error", "error": {"type", "message"}}, with the
status the OpenAI routes would give (400, 404, 413, 500, 503 with Retry-After); in a stream, an `error` event.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..device.streams import now
from ..replicas.engine_client import EngineError
from . import anthropic_protocol as A
from .anthropic_protocol import CountTokensRequest, MessagesRequest, is_anthropic_path
from .errors import error_response
from .frontend import TextStream
from .generation import Choice, Generation, Streamed
from .protocol import APIError, ChatCompletionRequest
from .tools import ToolPlan


PREFIX = "/v1/messages"


def anthropic_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return error_response(A.error_body(status, message, param), status)


def matched_stop(ts: TextStream, stops: list[str] | None, finish_reason: str | None) -> str | None:
    """The stop sequence that ended a finished output, else None: the detokenizer holds the whole text, the
    stop string included, and the stream handed out the text before it."""
    if finish_reason != "stop" or not stops:
        return None
    tail = ts.detok.text[ts.sent:]
    return next((s for s in stops if tail.startswith(s)), None)


class AnthropicServer:
    def __init__(self, gen: Generation, model: str) -> None:
        self.gen, self.fe, self.model = gen, gen.fe, model

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise APIError(404, f"model: the model `{model}` does not exist; this server serves `{self.model}`.",
                           "model")

    def _prompt(self, body: CountTokensRequest, chat: ChatCompletionRequest) -> Awaitable[tuple[ToolPlan, list[int]]]:
        """The tool plan and prompt ids; disable_parallel_tool_use caps a required tool choice at one call."""
        return self.gen.chat_prompt(chat, bool(body.tool_choice and body.tool_choice.disable_parallel_tool_use))

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        self._check_model(body.model)
        chat = body.chat_request()
        _, ids = await self._prompt(body, chat)
        return {"input_tokens": len(ids)}

    async def messages(self, body: MessagesRequest, request: Request):
        arrival = now()
        self._check_model(body.model)
        chat = body.to_chat()
        plan, ids = await self._prompt(body, chat)
        _, choices = await self.gen.submit(chat, [ids], "msg", arrival, None, plan, chat=True)
        mid, c = A.message_id(), choices[0]
        if body.stream:
            return self.gen.stream(self._events(mid, chat, plan, c, len(ids)), choices, _error_event)
        await self.gen.read(request, choices, plan)
        out, uses = c.out, self._finish(c.out)
        stop = matched_stop(c.ts, chat.stop, out.reason)
        blocks = ([A.thinking_block(out.reasoning)] if out.reasoning else []) + \
            ([{"type": "text", "text": out.content}] if out.content else []) + uses
        return A.message(mid, self.model, blocks, A.stop_reason(out.reason, stop, bool(uses)), stop, len(ids),
                         out.n_out)

    @staticmethod
    def _finish(out: Streamed) -> list[dict]:
        """The tool_use blocks of a finished output."""
        return A.tool_use_blocks(out.calls)

    async def _events(self, mid: str, chat: ChatCompletionRequest, plan: ToolPlan, c: Choice,
                      n_prompt: int) -> AsyncIterator[str]:
        """message_start, then content blocks (a thinking block's thinking deltas, then the text block's deltas,
        as they come; tool_use blocks, each one input_json delta, at the end), message_delta (stop reason,
        output tokens) and message_stop. A block starts with its first delta and stops when the next starts."""
        blocks = _Blocks()
        yield A.event("message_start", {"message": A.message(mid, self.model, [], None, None, n_prompt, 0)})
        async for _, kind, part in self.gen.content_deltas([c], plan):
            if part:                        # the end's content not yet sent, if any
                yield blocks.delta("reasoning" if kind == "reasoning" else "content", part)
        out, tool_uses = c.out, self._finish(c.out)
        yield blocks.stop()
        for i, b in enumerate(tool_uses, start=blocks.index):
            yield A.event("content_block_start", {"index": i, "content_block": {**b, "input": {}}})
            yield A.event("content_block_delta", {"index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
            yield A.event("content_block_stop", {"index": i})
        stop = matched_stop(c.ts, chat.stop, out.reason)
        yield A.event("message_delta", {"delta": {"stop_reason": A.stop_reason(out.reason, stop, bool(tool_uses)),
                                                  "stop_sequence": stop}, "usage": {"output_tokens": out.n_out}})
        yield A.event("message_stop", {})


def _error_event(e: APIError | EngineError) -> str:
    """The `error` event that ends a stream its request could not finish."""
    return A.event("error", {"error": A.error_body(e.status, e.message, getattr(e, "param", None))["error"]})


class _Blocks:
    """The streamed thinking and text blocks: `index` is the next block's."""

    def __init__(self) -> None:
        self.index, self.open = 0, None

    def delta(self, kind: str, part: str) -> str:
        out = ""
        if self.open != kind:
            out = self.stop()
            self.open = kind
            block = A.thinking_block("") if kind == "reasoning" else {"type": "text", "text": ""}
            out += A.event("content_block_start", {"index": self.index, "content_block": block})
        delta = {"type": "thinking_delta", "thinking": part} if kind == "reasoning" else \
            {"type": "text_delta", "text": part}
        return out + A.event("content_block_delta", {"index": self.index, "delta": delta})

    def stop(self) -> str:
        """Stop the open block (none: nothing to send)."""
        if self.open is None:
            return ""
        self.open, self.index = None, self.index + 1
        return A.event("content_block_stop", {"index": self.index - 1})


def add_routes(app: FastAPI, gen: Generation, model: str) -> None:
    server = AnthropicServer(gen, model)

    @app.post(PREFIX)
    async def messages(body: MessagesRequest, request: Request):
        return await server.messages(body, request)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return await server.count_tokens(body)
