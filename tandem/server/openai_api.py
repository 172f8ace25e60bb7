"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every error leaves as {"error": {"message", "type", "param", "code"}}: 400 for anything invalid (FastAPI's
422 folded in, the field named in `param`), 503 when the engine is down, its queue is full or the server is
stopping. A client that goes away mid-request aborts it, so its KV is freed.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..device.streams import now
from ..request import StepOutput
from . import protocol as P
from .client import EngineClient, EngineError, RequestStream
from .frontend import Frontend, TextStream
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body

DONE = "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(status: int, message: str, type: str, param: str | None = None, code: str | None = None):
    return JSONResponse(error_body(message, type, param, code), status_code=status)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    def __init__(self, client: EngineClient, frontend: Frontend, model_name: str, metrics: ServerMetrics) -> None:
        self.client, self.fe, self.model, self.metrics = client, frontend, model_name, metrics

    # ---- shared steps --------------------------------------------------------------------------------------
    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model not in (None, "", self.model):
            raise APIError(400, f"The model `{body.model}` does not exist; this server serves `{self.model}`.",
                           "model", "model_not_found")
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], bad[0])

    async def _submit(self, body, prompt_ids: list[int], kind: str, arrival: float,
                      default_max_tokens: int | None) -> tuple[RequestStream, TextStream]:
        params = self.fe.sampling_params(body, len(prompt_ids), default_max_tokens)
        st = await self.client.submit(f"{kind}-{uuid.uuid4().hex}", prompt_ids, self.fe.params_dict(params), arrival)
        return st, self.fe.text_stream(prompt_ids, params)

    async def _deltas(self, st: RequestStream, ts: TextStream) -> AsyncIterator[tuple[str, StepOutput]]:
        """(text delta, output) per engine output; the last one is finished."""
        async for o in self.client.outputs(st):
            st.num_cached_tokens = o.num_cached_tokens
            yield (ts.finish(o.new_token_ids, o.text) if o.finished else ts.add(o.new_token_ids)), o

    async def _collect(self, st: RequestStream, ts: TextStream) -> tuple[str, str | None, int]:
        parts, reason, n_out = [], None, 0
        async for delta, o in self._deltas(st, ts):
            parts.append(delta)
            reason, n_out = o.finish_reason, max(n_out, o.num_output_tokens)
        return "".join(parts), reason, n_out

    async def _unless_disconnected(self, request: Request, st: RequestStream, ts: TextStream):
        """Collect a whole response, aborting the request if the client leaves first."""
        task = asyncio.ensure_future(self._collect(st, ts))
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            return task.result() if task.done() else None
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                self.client.abort(st.rid)

    # ---- endpoints -----------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        arrival = now()
        self._check(body)
        ids = self.fe.completion_prompt(body.prompt)
        return await self._respond(body, request, ids, arrival, "cmpl", 16, self._stream_completion,
                                   P.completion)

    async def _respond(self, body, request: Request, ids: list[int], arrival: float, kind: str,
                       default_max: int | None, stream, build):
        """Submit, then stream SSE chunks or answer once; the shared tail of both endpoints."""
        st, ts = await self._submit(body, ids, kind, arrival, default_max)
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(stream(st, ts, len(ids), created, include_usage), media_type="text/event-stream")
        done = await self._unless_disconnected(request, st, ts)
        if done is None:
            return Response(status_code=499)
        text, reason, n_out = done
        return build(st.rid, self.model, created, text, reason, P.usage(len(ids), n_out, st.num_cached_tokens))

    async def _stream_completion(self, st, ts, n_prompt: int, created: int, include_usage: bool):
        n_out = 0
        try:
            async for delta, o in self._deltas(st, ts):
                n_out = max(n_out, o.num_output_tokens)
                if delta or o.finished:
                    yield _sse(P.completion_chunk(st.rid, self.model, created, delta,
                                                  o.finish_reason if o.finished else None, None, include_usage))
            if include_usage:
                yield _sse(P.completion_chunk(st.rid, self.model, created, None, None, P.usage(n_prompt, n_out, st.num_cached_tokens), True))
        except EngineError as e:
            yield _sse(error_body(e.message, "service_unavailable"))
        finally:
            self.client.abort(st.rid)         # a client that left mid-stream: free its KV (no-op if finished)
        yield DONE

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        arrival = now()
        self._check(body)
        ids = self.fe.chat_prompt(body)
        return await self._respond(body, request, ids, arrival, "chatcmpl", None, self._stream_chat,
                                   P.chat_completion)

    async def _stream_chat(self, st, ts, n_prompt: int, created: int, include_usage: bool):
        n_out = 0

        def chunk(delta: dict | None, reason: str | None = None, use: dict | None = None) -> str:
            return _sse(P.chat_chunk(st.rid, self.model, created, delta, reason, use, include_usage))
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for delta, o in self._deltas(st, ts):
                n_out = max(n_out, o.num_output_tokens)
                if o.finished:
                    yield chunk({"content": delta} if delta else {}, o.finish_reason)
                elif delta:
                    yield chunk({"content": delta})
            if include_usage:
                yield chunk(None, None, P.usage(n_prompt, n_out, st.num_cached_tokens))
        except EngineError as e:
            yield _sse(error_body(e.message, "service_unavailable"))
        finally:
            self.client.abort(st.rid)
        yield DONE

    def health(self) -> Response:
        if self.client.dead is not None:
            return _error(503, f"the engine is down: {self.client.dead}", "service_unavailable")
        if self.client.closing:
            return _error(503, "the server is shutting down", "service_unavailable")
        return Response(status_code=200)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return _error(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                      "invalid_request_error")
    loc = [str(x) for x in first["loc"]]
    param = loc[1] if len(loc) > 1 and loc[0] == "body" else None
    if param is None:
        return _error(400, f"the request body must be a JSON object: {first['msg']}", "invalid_request_error")
    if first["type"] == "missing":
        return _error(400, f"missing required field: {param}", "invalid_request_error", param)
    msgs = list(dict.fromkeys(e["msg"] for e in errs if len(e["loc"]) > 1 and str(e["loc"][1]) == param))
    return _error(400, f"invalid value for {param}: {'; or '.join(msgs)}"[:1000], "invalid_request_error", param)


def build_app(client: EngineClient, frontend: Frontend, model_name: str, metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(title="tandem", description="OpenAI-compatible server of the tandem engine")
    api = OpenAIServer(client, frontend, model_name, metrics)
    app.state.api = api

    app.exception_handler(RequestValidationError)(lambda _r, e: _validation_error(e))
    app.exception_handler(APIError)(lambda _r, e: JSONResponse(e.body(), status_code=e.status))
    app.exception_handler(EngineError)(lambda _r, e: _error(
        e.status, e.message, "invalid_request_error" if e.status == 400 else "service_unavailable"))
    app.exception_handler(StarletteHTTPException)(lambda _r, e: _error(
        e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"))
    app.exception_handler(Exception)(lambda _r, e: _error(500, f"internal error: {type(e).__name__}: {e}",
                                                           "server_error"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat_completions(body, request)

    @app.get("/v1/models")
    async def models():
        return P.model_list(model_name, frontend.max_context)

    @app.get("/health")
    async def health():
        return api.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
