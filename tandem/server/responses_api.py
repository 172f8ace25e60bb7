"""OpenAI's Responses API: POST /v1/responses (streamed or not), stateless.

Requests are mapped onto the chat route's request (responses_protocol.py) and run through the shared Generation
(generation.py): the same template, tool plans, grammar, limits and disconnect handling as /v1/chat/completions.
Errors leave in OpenAI's shape with the Responses field named in `param` (openai_api.build_app maps it); in a
stream, an `error` event then `response.failed`.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ..device.streams import now
from ..replicas.engine_client import EngineError
from . import responses_protocol as R
from . import tools
from .generation import Choice, Generation, Streamed, cached_tokens
from .protocol import APIError, ChatCompletionRequest, check_model
from .responses_protocol import ResponsesRequest
from .tools import ToolPlan


class _Events:
    """SSE events numbered in the order they are sent (`sequence_number`)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, /, **data) -> str:      # positional: a function call's data has a `name`
        self.seq += 1
        return R.event(kind, self.seq - 1, data)


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


class ResponsesServer:
    def __init__(self, gen: Generation, model: str) -> None:
        self.gen, self.fe, self.model = gen, gen.fe, model

    def _prompt(self, body: ResponsesRequest, chat: ChatCompletionRequest) -> tuple[ToolPlan, list[int]]:
        """The tool plan and prompt ids (runs on the tokenizer pool); parallel_tool_calls=false caps a required
        tool choice at one call through the grammar."""
        plan = tools.plan(chat.tools, chat.tool_choice)
        if plan.mode == "required" and body.parallel_tool_calls is False:
            plan.schema = {**plan.schema, "maxItems": 1}
        return plan, self.fe.chat_ids(chat, plan)

    @staticmethod
    def _finish(body: ResponsesRequest, plan: ToolPlan, text: str, reason: str | None) -> tuple[str | None, list]:
        """(text content, tool calls) of a finished output; one call at most with parallel_tool_calls=false."""
        if plan.mode == "none":
            return text, []
        content, calls, _ = tools.parse(plan, text, reason)
        return content, calls[:1] if body.parallel_tool_calls is False else calls

    async def create(self, body: ResponsesRequest, request: Request):
        arrival = now()
        check_model(body.model, self.model, required=True)
        chat = body.to_chat()
        plan, ids = await self.fe.off_loop(self._prompt, body, chat)
        _, choices = await self.gen.submit(chat, [ids], "resp", arrival, None, plan)
        rid, created = R.new_id("resp"), int(time.time())
        if body.stream:
            return StreamingResponse(self._stream(body, rid, created, plan, choices[0], len(ids)),
                                     media_type="text/event-stream")
        done = await self.gen.unless_disconnected(request, choices)
        if done is None:
            return Response(status_code=499)
        text, reason, n_out = done[0]
        content, calls = self._finish(body, plan, text, reason)
        status = _status(reason)
        output = [R.message_item(R.new_id("msg"), content or "", status)] if content or not calls else []
        output += R.call_items(calls)
        return R.response(body, rid, created, status, output, R.usage(len(ids), n_out, cached_tokens(choices)))

    async def _stream(self, body: ResponsesRequest, rid: str, created: int, plan: ToolPlan, c: Choice,
                      n_prompt: int):
        """response.created / in_progress; the message item (its text deltas as they come: under a tool plan,
        while the text surely is content); function_call items (arguments in one delta, when the output is
        complete); response.completed or response.incomplete with the whole response."""
        ev, mid = _Events(), R.new_id("msg")
        shown = ""
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}

        def text_delta(piece: str) -> str:
            nonlocal shown
            start = "" if shown else ev("response.output_item.added", output_index=0,
                                        item=R.message_item(mid, None, "in_progress")) + \
                ev("response.content_part.added", **where, part=part)
            shown += piece
            return start + ev("response.output_text.delta", **where, delta=piece, logprobs=[])
        try:
            started = R.response(body, rid, created, "in_progress", [], None)
            yield ev("response.created", response=started) + ev("response.in_progress", response=started)
            out = Streamed()
            async for piece in self.gen.content_deltas(c, plan, out):
                yield text_delta(piece)
            text, n_out, reason = out.text, out.n_out, out.reason
            content, calls = self._finish(body, plan, text, reason)
            status, output = _status(reason), []
            rest = (content or "")[len(shown):] if not calls or content else ""
            if rest or shown or not calls:
                yield (text_delta(rest) if rest or not shown else "") + self._close_message(ev, mid, shown, status)
                output.append(R.message_item(mid, shown, status))
            for item in R.call_items(calls):
                yield self._call_events(ev, item, len(output))
                output.append(item)
            final = R.response(body, rid, created, status, output, R.usage(n_prompt, n_out, cached_tokens([c])))
            yield ev(f"response.{status}", response=final)
        except (EngineError, APIError) as e:
            yield ev("error", code=getattr(e, "code", None) or str(e.status), message=e.message,
                     param=R.param_name(getattr(e, "param", None)))
            yield ev("response.failed", response=R.response(body, rid, created, "failed", [], None,
                                                            {"code": "server_error", "message": e.message}))
        finally:
            self.gen.abort([c])          # a client that left mid-stream: free its KV (no-op if finished)

    @staticmethod
    def _close_message(ev: _Events, mid: str, text: str, status: str) -> str:
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        return ev("response.output_text.done", **where, text=text, logprobs=[]) + \
            ev("response.content_part.done", **where, part=part) + \
            ev("response.output_item.done", output_index=0, item=R.message_item(mid, text, status))

    @staticmethod
    def _call_events(ev: _Events, item: dict, index: int) -> str:
        where = {"item_id": item["id"], "output_index": index}
        return ev("response.output_item.added", output_index=index,
                  item={**item, "arguments": "", "status": "in_progress"}) + \
            ev("response.function_call_arguments.delta", **where, delta=item["arguments"]) + \
            ev("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]) + \
            ev("response.output_item.done", output_index=index, item=item)


def add_routes(app: FastAPI, gen: Generation, model: str) -> None:
    server = ResponsesServer(gen, model)

    @app.post(R.PATH)
    async def responses(body: ResponsesRequest, request: Request):
        return await server.create(body, request)
