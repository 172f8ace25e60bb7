"""OpenAI's Responses API: POST /v1/responses (streamed or not), stateless.

Requests are mapped onto the chat route's request (responses_protocol.py) and run through the shared Generation
(generation.py): the same template, tool plans, grammar, limits and disconnect handling as /v1/chat/completions.
Errors leave in OpenAI's shape with the Responses field named in `param` (openai_api.build_app maps it); in a
stream, an `error` event then `response.failed`.
"""
from __future__ import annotations

import functools
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request

from ..device.streams import now
from ..replicas.engine_client import EngineError
from . import responses_protocol as R
from .generation import Choice, Generation, Streamed, cached_tokens
from .protocol import APIError, check_model
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


class _Items:
    """The streamed reasoning and message items, in output order: an item opens (output_item.added,
    content_part.added) with its first delta and closes (its text's done, content_part.done, output_item.done)
    when the next one opens or the output ends. A reasoning item always comes before the message."""
    PART = {"reasoning": "reasoning_text", "content": "output_text"}

    def __init__(self) -> None:
        self.text = {"reasoning": "", "content": ""}
        self.opened: str | None = None          # the kind of the item now open
        self.ids: dict[str, str] = {}
        self.output: list[dict] = []            # closed items

    def _part(self, kind: str) -> dict:
        text = self.text[kind]
        return {"type": self.PART[kind], "text": text, **({"annotations": []} if kind == "content" else {})}

    def _item(self, kind: str, status: str, text: str | None) -> dict:
        if kind == "reasoning":
            return R.reasoning_item(self.ids[kind], text, status)
        return R.message_item(self.ids[kind], text, status)

    def delta(self, ev: _Events, kind: str, piece: str) -> str:
        out = ""
        if self.opened != kind:
            out += self.close(ev, "completed")
            self.opened, self.ids[kind] = kind, R.new_id("rs" if kind == "reasoning" else "msg")
            where = {"item_id": self.ids[kind], "output_index": len(self.output), "content_index": 0}
            out += ev("response.output_item.added", output_index=len(self.output),
                      item=self._item(kind, "in_progress", None)) + \
                ev("response.content_part.added", **where, part={**self._part(kind), "text": ""})
        if not piece:
            return out
        self.text[kind] += piece
        where = {"item_id": self.ids[kind], "output_index": len(self.output), "content_index": 0}
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return out + ev(name, **where, delta=piece, **({"logprobs": []} if kind == "content" else {}))

    def close(self, ev: _Events, status: str) -> str:
        """Close the open item (none: nothing to send)."""
        kind, self.opened = self.opened, None
        if kind is None:
            return ""
        text, where = self.text[kind], {"item_id": self.ids[kind], "output_index": len(self.output),
                                        "content_index": 0}
        done = ev("response.reasoning_text.done", **where, text=text) if kind == "reasoning" else \
            ev("response.output_text.done", **where, text=text, logprobs=[])
        item = self._item(kind, status, text)
        out = done + ev("response.content_part.done", **where, part=self._part(kind)) + \
            ev("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        return out


class ResponsesServer:
    def __init__(self, gen: Generation, model: str) -> None:
        self.gen, self.fe, self.model = gen, gen.fe, model

    @staticmethod
    def _finish(body: ResponsesRequest, out: Streamed) -> list[dict]:
        """The tool calls of a finished output; one call at most with parallel_tool_calls=false."""
        return out.calls[:1] if body.parallel_tool_calls is False else out.calls

    async def create(self, body: ResponsesRequest, request: Request):
        arrival = now()
        check_model(body.model, self.model, required=True)
        chat = body.to_chat()
        # parallel_tool_calls=false caps a required tool choice at one call through the grammar
        plan, ids = await self.gen.chat_prompt(chat, body.parallel_tool_calls is False)
        _, choices = await self.gen.submit(chat, [ids], "resp", arrival, None, plan, chat=True)
        rid, created, c = R.new_id("resp"), int(time.time()), choices[0]
        if body.stream:
            ev = _Events()
            return self.gen.stream(self._events(ev, body, rid, created, plan, c, len(ids)), choices,
                                   functools.partial(self._failed, ev, body, rid, created))
        await self.gen.read(request, choices, plan)
        out, calls = c.out, self._finish(body, c.out)
        status = _status(out.reason)
        # as the stream sends them: a reasoning item closed by the message is completed, else it has the status
        message = bool(out.content) or not (calls or out.reasoning)
        output = [R.reasoning_item(R.new_id("rs"), out.reasoning, "completed" if message else status)] \
            if out.reasoning else []
        if message:
            output.append(R.message_item(R.new_id("msg"), out.content or "", status))
        output += R.call_items(calls)
        return R.response(body, rid, created, status, output, self._usage(len(ids), c))

    @staticmethod
    def _usage(n_prompt: int, c: Choice) -> dict:
        out = c.out
        return R.usage(n_prompt, out.n_out, cached_tokens([c]), out.n_reasoning if out.reasoning is not None else 0)

    async def _events(self, ev: _Events, body: ResponsesRequest, rid: str, created: int, plan: ToolPlan, c: Choice,
                      n_prompt: int) -> AsyncIterator[str]:
        """response.created / in_progress; a reasoning item (its reasoning_text deltas as they come) when the
        output thinks; the message item (its text deltas as they come: under a tool plan, while the text surely
        is content); function_call items (arguments in one delta, when the output is complete);
        response.completed or response.incomplete with the whole response."""
        items = _Items()
        started = R.response(body, rid, created, "in_progress", [], None)
        yield ev("response.created", response=started) + ev("response.in_progress", response=started)
        rest = ""
        async for _, kind, piece in self.gen.content_deltas([c], plan):
            if kind == "end":
                rest = piece            # the content not yet sent, if any
            else:
                yield items.delta(ev, kind, piece)
        calls, status = self._finish(body, c.out), _status(c.out.reason)
        if rest or items.text["content"] or not (calls or items.opened):
            yield items.delta(ev, "content", rest)
        yield items.close(ev, status)
        for item in R.call_items(calls):
            yield self._call_events(ev, item, len(items.output))
            items.output.append(item)
        final = R.response(body, rid, created, status, items.output, self._usage(n_prompt, c))
        yield ev(f"response.{status}", response=final)

    @staticmethod
    def _failed(ev: _Events, body: ResponsesRequest, rid: str, created: int, e: APIError | EngineError) -> str:
        """An `error` event, then response.failed: the end of a stream its request could not finish."""
        return ev("error", code=getattr(e, "code", None) or str(e.status), message=e.message,
                  param=R.param_name(getattr(e, "param", None))) + \
            ev("response.failed", response=R.response(body, rid, created, "failed", [], None,
                                                       {"code": "server_error", "message": e.message}))

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
