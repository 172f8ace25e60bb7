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
        _, choices = await self.gen.submit(chat, [ids], "msg", arrival, None, plan)
        mid = A.message_id()
        if body.stream:
            return StreamingResponse(self._stream(mid, chat, plan, choices[0], len(ids)),
                                     media_type="text/event-stream")
        done = await self.gen.unless_disconnected(request, choices)
        if done is None:
            return Response(status_code=499)
        text, reason, n_out = done[0]
        stop = matched_stop(choices[0].ts, chat.stop, reason)
        content, calls = self._finish(plan, text, reason)
        blocks = ([{"type": "text", "text": content}] if content else []) + calls
        return A.message(mid, self.model, blocks, A.stop_reason(reason, stop, bool(calls)), stop, len(ids), n_out)

    @staticmethod
    def _finish(plan: ToolPlan, text: str, reason: str | None) -> tuple[str | None, list[dict]]:
        """(text content, tool_use blocks) of a finished output."""
        if plan.mode == "none":
            return text, []
        content, calls, _ = tools.parse(plan, text, reason)
        return content, A.tool_use_blocks(calls)

    async def _stream(self, mid: str, chat: ChatCompletionRequest, plan: ToolPlan, c: Choice, n_prompt: int):
        """message_start, then content blocks (text deltas as they come; tool_use blocks, each one input_json
        delta, at the end), message_delta (stop reason, output tokens) and message_stop."""
        sent, opened = 0, False

        def text_delta(part: str) -> str:
            nonlocal opened
            start = "" if opened else A.event("content_block_start",
                                              {"index": 0, "content_block": {"type": "text", "text": ""}})
            opened = True
            return start + A.event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": part}})
        try:
            yield A.event("message_start", {"message": A.message(mid, self.model, [], None, None, n_prompt, 0)})
            out = Streamed()
            async for part in self.gen.content_deltas(c, plan, out):
                sent += len(part)
                yield text_delta(part)
            text, n_out, reason = out.text, out.n_out, out.reason
            content, blocks = self._finish(plan, text, reason)
            rest = (content or "")[sent:] if not blocks or content else ""
            if rest:
                yield text_delta(rest)
            if opened:
                yield A.event("content_block_stop", {"index": 0})
            for i, b in enumerate(blocks, start=int(opened)):
                yield A.event("content_block_start", {"index": i, "content_block": {**b, "input": {}}})
                yield A.event("content_block_delta", {"index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
                yield A.event("content_block_stop", {"index": i})
            stop = matched_stop(c.ts, chat.stop, reason)
            yield A.event("message_delta", {"delta": {"stop_reason": A.stop_reason(reason, stop, bool(blocks)),
                                                      "stop_sequence": stop}, "usage": {"output_tokens": n_out}})
            yield A.event("message_stop", {})
        except (EngineError, APIError) as e:
            yield A.event("error", {"error": A.error_body(e.status, e.message, getattr(e, "param", None))["error"]})
        finally:
            self.gen.abort([c])          # a client that left mid-stream: free its KV (no-op if finished)


def add_routes(app: FastAPI, gen: Generation, model: str) -> None:
    server = AnthropicServer(gen, model)

    @app.post(PREFIX)
    async def messages(body: MessagesRequest, request: Request):
        return await server.messages(body, request)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return await server.count_tokens(body)
