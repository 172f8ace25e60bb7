"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health,
/health_generate, /metrics; /tokenize and /detokenize (tokenize_api.py); Anthropic's /v1/messages and
/v1/messages/count_tokens (anthropic_api.py, errors in Anthropic's shape there); OpenAI's /v1/responses
(responses_api.py, its errors naming the Responses field); /v1/embeddings (embeddings_api.py).

Every error leaves as {"error": {"message", "type", "param", "code"}}: 400 for anything invalid (FastAPI's
422 folded in, the field named in `param`), 404 for an unknown model, 413 for an oversized body, 408 `timeout`
when the request's own `timeout` passed, 500 when the engine failed that one request, 503 (with Retry-After)
when the engine is down or stuck, its queue is full, the request waited past --max-queue-time or the server is
stopping; a stream already open ends with the same error as an event, then [DONE]. A client that goes away
mid-request aborts it, so its KV is freed.
"""
from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..device.streams import now
from . import protocol as P
from ..replicas.engine_client import EngineError
from .errors import engine_error, error, sse, stream_error, validation_error
from .frontend import Frontend
from .generation import CLIENT_LEFT, Choice, ClientLeft, Generation, cached_tokens
from .limits import BodyLimitMiddleware, ServerLimits
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, refuse
from ..replicas.replica_set import ReplicaSet
from .tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .tools import ToolPlan
from .anthropic_api import add_routes, anthropic_error, is_anthropic_path
from . import embeddings_api, responses_api
from .responses_protocol import is_responses_path, param_name

DONE = "data: [DONE]\n\n"


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


class OpenAIServer:
    def __init__(self, client: ReplicaSet, frontend: Frontend, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits, fingerprint: str | None = None, reasoning_parser: str | None = None) -> None:
        self.client, self.fe, self.model, self.metrics, self.limits = client, frontend, model_name, metrics, limits
        self.fingerprint = fingerprint                 # system_fingerprint of every response (fingerprint.py)
        # submit, read, collect, stream, abort: every route; with a reasoning parser, chat's <think> text goes
        # into reasoning_content (reasoning.py)
        self.gen = Generation(client, frontend, reasoning_parser)
        self.probe_ids = frontend.tokenizer.encode("hi", add_special_tokens=False) or [0]

    # ---- shared steps --------------------------------------------------------------------------------------
    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        P.check_model(body.model, self.model)
        refuse(body.unsupported())

    def _signed(self, body: dict) -> dict:
        """A response or chunk with OpenAI's system_fingerprint: the same fingerprint and the same request (seed
        included) give the same tokens and logprobs (fingerprint.py)."""
        if self.fingerprint is not None:
            body["system_fingerprint"] = self.fingerprint
        return body

    def _take_logprobs(self, c: Choice, chat: bool) -> dict | None:
        """The choice's logprobs not yet sent, in the endpoint's shape (None if it did not ask)."""
        if not c.want_logprobs:
            return None
        entries, c.lps = c.lps, []
        if chat:
            return P.chat_logprobs(entries, self.fe.token_text)
        out = P.completion_logprobs(entries, self.fe.token_text, c.offset)
        c.offset += sum(len(t) for t in out["tokens"])
        return out

    async def _render(self, build: Callable[[], dict]) -> JSONResponse:
        """A whole response, built and rendered off the event loop: with echo and logprobs a body holds 20
        alternatives per prompt token (an 8,000-token prompt: ~4 MB of JSON), which would stall every other
        stream and /health meanwhile."""
        return await self.fe.off_loop(lambda: JSONResponse(self._signed(build())))

    # ---- endpoints -----------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        arrival = now()
        self._check(body)
        prompts = await self.fe.off_loop(self.fe.completion_ids, body)
        rid, choices = await self.gen.submit(body, prompts, "cmpl", arrival, 16)
        created = int(time.time())
        n_prompt = sum(len(ids) for ids in prompts)        # each prompt counts once, whatever n
        if body.stream:
            return self.gen.stream(self._completion_chunks(rid, choices, n_prompt, created, _include_usage(body)),
                                   choices, stream_error, DONE)
        await self.gen.read(request, choices)
        return await self._render(lambda: P.completion(
            rid, self.model, created, [P.completion_choice(c.index, c.echo + c.out.text, c.out.reason,
                                                           self._take_logprobs(c, False)) for c in choices],
            P.usage(n_prompt, sum(c.out.n_out for c in choices), cached_tokens(choices))))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        arrival = now()
        self._check(body)
        plan, ids = await self.gen.chat_prompt(body)
        rid, choices = await self.gen.submit(body, [ids], "chatcmpl", arrival, None, plan, chat=True)
        created = int(time.time())
        if body.stream:
            return self.gen.stream(self._chat_chunks(rid, choices, plan, len(ids), created, _include_usage(body)),
                                   choices, stream_error, DONE)
        await self.gen.read(request, choices, plan)
        return await self._render(lambda: P.chat_completion(
            rid, self.model, created, [self._chat_choice(c) for c in choices],
            P.usage(len(ids), sum(c.out.n_out for c in choices), cached_tokens(choices))))

    def _chat_choice(self, c: Choice) -> dict:
        """A whole chat choice: the content, its tool calls and the reasoning part as message.reasoning_content."""
        choice = P.chat_choice(c.index, c.out.content, c.out.finish_reason, self._take_logprobs(c, True),
                               c.out.calls)
        if c.out.reasoning is not None:
            choice["message"]["reasoning_content"] = c.out.reasoning
        return choice

    async def _completion_chunks(self, rid: str, choices: list[Choice], n_prompt: int, created: int,
                                 include_usage: bool) -> AsyncIterator[str]:
        def chunk(c: Choice, text: str, reason: str | None = None, echo: bool = False) -> str:
            return sse(self._signed(P.completion_chunk(rid, self.model, created, text, reason, None, include_usage,
                                                       c.index, None if echo else self._take_logprobs(c, False))))
        for c in choices:
            if c.echo:
                yield chunk(c, c.echo, echo=True)
        async for c, kind, piece in self.gen.content_deltas(choices):
            yield chunk(c, piece, c.out.reason if kind == "end" else None)
        if include_usage:
            yield sse(self._signed(P.completion_chunk(
                rid, self.model, created, None, None, P.usage(n_prompt, sum(c.out.n_out for c in choices),
                                                              cached_tokens(choices)), True)))

    async def _chat_chunks(self, rid: str, choices: list[Choice], plan: ToolPlan, n_prompt: int, created: int,
                           include_usage: bool) -> AsyncIterator[str]:
        """The role chunk of each choice, then its reasoning_content and content deltas as they come (under a tool
        plan, while the text surely is content), and a last chunk with the rest, the tool calls and the finish
        reason; the usage chunk at the end."""
        def chunk(c: Choice | None, delta: dict | None, reason: str | None = None, use: dict | None = None) -> str:
            return sse(self._signed(P.chat_chunk(rid, self.model, created, delta, reason, use, include_usage,
                                     c.index if c is not None else 0,
                                     self._take_logprobs(c, True) if c is not None and delta is not None
                                     and "role" not in delta else None)))
        for c in choices:
            yield chunk(c, {"role": "assistant", "content": ""})
        async for c, kind, piece in self.gen.content_deltas(choices, plan):
            if kind != "end":
                yield chunk(c, {"reasoning_content" if kind == "reasoning" else "content": piece})
                continue
            d: dict = {"content": piece} if piece else {}
            if c.out.calls:
                d["tool_calls"] = [{"index": i, **call} for i, call in enumerate(c.out.calls)]
            yield chunk(c, d, c.out.finish_reason)
        if include_usage:
            yield chunk(None, None, None, P.usage(n_prompt, sum(c.out.n_out for c in choices),
                                                  cached_tokens(choices)))

    def health(self) -> Response:
        """200 while the engine is alive and its loop turns; 503 once it died, stopped making progress for
        health_timeout_s (a stuck step: the device hung or was stopped), or the server is stopping. New
        requests get the same 503 at once meanwhile (ReplicaSet.refusal); in-flight ones wait. With --dp:
        200 while one replica can take requests (the router skips dead and stuck ones)."""
        why = self.client.refusal()
        if why is not None:
            return error(503, why, "service_unavailable")
        return Response(status_code=200)

    async def health_generate(self) -> Response:
        """Generate one real token (SGLang's /health_generate): 200 once it comes back within the health
        timeout, 503 otherwise."""
        bad = self.health()
        if bad.status_code != 200:
            return bad
        rid = f"health-{uuid.uuid4().hex}"

        async def probe() -> bool:
            st = await self.client.submit(rid, self.probe_ids, {"max_tokens": 1, "temperature": 0.0}, now())
            async for o in self.client.outputs(st):
                if o.finished:
                    return o.finish_reason != "error" and o.num_output_tokens == 1
            return False
        try:
            if await asyncio.wait_for(probe(), self.limits.health_timeout_s):
                return Response(status_code=200)
            return error(503, "the probe request did not produce a token", "service_unavailable")
        except asyncio.TimeoutError:
            self.client.abort(rid)
            return error(503, f"no token within {self.limits.health_timeout_s:g} s", "service_unavailable")
        except EngineError as e:
            return error(503, f"the probe request failed: {e.message}", "service_unavailable")


def build_app(client: ReplicaSet, frontend: Frontend, model_name: str, metrics: ServerMetrics,
              limits: ServerLimits, fingerprint: str | None = None, reasoning_parser: str | None = None) -> FastAPI:
    app = FastAPI(title="tandem", description="OpenAI-compatible server of the tandem engine")
    api = OpenAIServer(client, frontend, model_name, metrics, limits, fingerprint, reasoning_parser)
    app.state.api = api
    app.add_middleware(BodyLimitMiddleware, limits=limits)

    def reply(request: Request, status: int, message: str, type: str, param: str | None = None,
              code: str | None = None) -> Response:
        """An error in the shape of the route's API: Anthropic's on /v1/messages, OpenAI's elsewhere (naming the
        Responses field on /v1/responses, where the chat request's layers named theirs)."""
        if is_anthropic_path(request.url.path):
            return anthropic_error(status, message, param)
        if is_responses_path(request.url.path):
            param = param_name(param)
        return error(status, message, type, param, code)

    app.exception_handler(RequestValidationError)(lambda r, e: validation_error(e, functools.partial(reply, r)))
    app.exception_handler(APIError)(lambda r, e: reply(r, e.status, e.message, e.type, e.param, e.code))
    app.exception_handler(EngineError)(lambda r, e: anthropic_error(e.status, e.message)
                                       if is_anthropic_path(r.url.path) else engine_error(e))
    app.exception_handler(StarletteHTTPException)(lambda r, e: reply(
        r, e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"))
    app.exception_handler(ClientLeft)(lambda r, e: Response(status_code=CLIENT_LEFT))   # its requests aborted
    app.exception_handler(Exception)(lambda r, e: reply(r, 500, f"internal error: {type(e).__name__}: {e}",
                                                          "server_error"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat_completions(body, request)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return await frontend.off_loop(tokenize, frontend, model_name, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return await frontend.off_loop(detokenize, frontend, model_name, body)

    add_routes(app, api.gen, model_name)
    responses_api.add_routes(app, api.gen, model_name)
    embeddings_api.add_routes(app, api.gen, model_name)

    @app.get("/v1/models")
    async def models():
        return P.model_list(model_name, frontend.max_context, frontend.defaults)

    @app.get("/health")
    async def health():
        return api.health()

    @app.get("/health_generate")
    async def health_generate():
        return await api.health_generate()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
