"""Anthropic's Messages API: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

Requests are mapped onto the chat route's request (anthropic_protocol.py) and run through the OpenAI server's
own submit / collect / abort machinery: the same template, tool plans, grammar, limits and disconnect handling.
Errors on these paths leave in Anthropic's shape, {"type": "error", "error": {"type", "message"}}, with the
status the OpenAI routes would give (400, 404, 413, 500, 503 with Retry-After); in a stream, an `error` event.
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..device.streams import now
from ..replicas.engine_client import EngineError
from . import anthropic_protocol as A
from . import tools
from .anthropic_protocol import CountTokensRequest, MessagesRequest, is_anthropic_path
from .errors import ErrorResponse
from .frontend import TextStream
from .generation import Choice, Generation, Streamed
from .protocol import RETRY_AFTER_S, APIError, ChatCompletionRequest
from .reasoning import ReasoningSplitter
from .tools import ToolPlan


PREFIX = "/v1/messages"


def anthropic_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return ErrorResponse(A.error_body(status, message, param), status_code=status, headers=headers)


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

    def _prompt(self, body: CountTokensRequest, chat: ChatCompletionRequest) -> tuple[ToolPlan, list[int]]:
        """The tool plan and prompt ids (runs on the tokenizer pool)."""
        plan = tools.plan(chat.tools, chat.tool_choice)
        if plan.mode == "required" and body.tool_choice.disable_parallel_tool_use:
            plan.schema = {**plan.schema, "maxItems": 1}
        return plan, self.fe.chat_ids(chat, plan)

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        self._check_model(body.model)
        chat = body.chat_request()
        _, ids = await self.fe.off_loop(self._prompt, body, chat)
        return {"input_tokens": len(ids)}

    async def messages(self, body: MessagesRequest, request: Request):
        arrival = now()
        self._check_model(body.model)
        chat = body.to_chat()
        plan, ids = await self.fe.off_loop(self._prompt, body, chat)
        _, choices = await self.gen.submit(chat, [ids], "msg", arrival, None, plan, chat=True)
        mid, split = A.message_id(), self.gen.splitter(ids)
        if body.stream:
            return StreamingResponse(self._stream(mid, chat, plan, choices[0], len(ids), split),
                                     media_type="text/event-stream")
        out = await self.gen.unless_disconnected(request, choices,
                                                 self.gen.read(choices[0], plan, Streamed(), split))
        if out is None:
            return Response(status_code=499)
        stop = matched_stop(choices[0].ts, chat.stop, out.reason)
        content, calls = self._finish(plan, out.text, out.reason)
        blocks = ([A.thinking_block(out.reasoning)] if out.reasoning else []) + \
            ([{"type": "text", "text": content}] if content else []) + calls
        return A.message(mid, self.model, blocks, A.stop_reason(out.reason, stop, bool(calls)), stop, len(ids),
                         out.n_out)

    @staticmethod
    def _finish(plan: ToolPlan, text: str, reason: str | None) -> tuple[str | None, list[dict]]:
        """(text content, tool_use blocks) of a finished output."""
        if plan.mode == "none":
            return text, []
        content, calls, _ = tools.parse(plan, text, reason)
        return content, A.tool_use_blocks(calls)

    async def _stream(self, mid: str, chat: ChatCompletionRequest, plan: ToolPlan, c: Choice, n_prompt: int,
                      split: ReasoningSplitter | None):
        """message_start, then content blocks (a thinking block's thinking deltas, then the text block's deltas,
        as they come; tool_use blocks, each one input_json delta, at the end), message_delta (stop reason,
        output tokens) and message_stop. A block starts with its first delta and stops when the next starts."""
        blocks = _Blocks()
        try:
            yield A.event("message_start", {"message": A.message(mid, self.model, [], None, None, n_prompt, 0)})
            out = Streamed()
            async for kind, part in self.gen.content_deltas(c, plan, out, split):
                yield blocks.delta(kind, part)
            content, tool_uses = self._finish(plan, out.text, out.reason)
            rest = (content or "")[blocks.sent:] if not tool_uses or content else ""
            if rest:
                yield blocks.delta("content", rest)
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
        except (EngineError, APIError) as e:
            yield A.event("error", {"error": A.error_body(e.status, e.message, getattr(e, "param", None))["error"]})
        finally:
            self.gen.abort([c])          # a client that left mid-stream: free its KV (no-op if finished)


class _Blocks:
    """The streamed thinking and text blocks: `index` is the next block's; `sent` the text block's length."""

    def __init__(self) -> None:
        self.index, self.open, self.sent = 0, None, 0

    def delta(self, kind: str, part: str) -> str:
        out = ""
        if self.open != kind:
            out = self.stop()
            self.open = kind
            block = A.thinking_block("") if kind == "reasoning" else {"type": "text", "text": ""}
            out += A.event("content_block_start", {"index": self.index, "content_block": block})
        if kind == "content":
            self.sent += len(part)
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
