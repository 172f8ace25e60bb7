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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..device.streams import now
from . import protocol as P
from . import tools
from ..replicas.engine_client import EngineError
from .errors import engine_error, error, sse, stream_error, validation_error
from .frontend import Frontend
from .generation import Choice, Generation, cached_tokens
from .limits import BodyLimitMiddleware, ServerLimits
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from ..replicas.replica_set import ReplicaSet
from .tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .tools import ToolPlan
from .anthropic_api import add_routes, anthropic_error, is_anthropic_path
from . import embeddings_api, responses_api
from .reasoning import ReasoningSplitter, split as reasoning_split
from .responses_protocol import is_responses_path, param_name

DONE = "data: [DONE]\n\n"


def _tool_choice_builder(plan: ToolPlan):
    """chat_choice with the tool calls parsed out of the text."""
    def build(index: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict:
        content, calls, reason = tools.parse(plan, text, reason)
        return P.chat_choice(index, content, reason, logprobs, calls)
    return build


def _with_reasoning(parser: str, prompt_tail: str, build, index: int, text: str, reason: str | None,
                    logprobs: dict | None = None) -> dict:
    """`build`'s chat choice of the content, with the reasoning part as message.reasoning_content."""
    reasoning, content = reasoning_split(parser, prompt_tail, text)
    choice = build(index, content, reason, logprobs)
    if reasoning is not None:
        choice["message"]["reasoning_content"] = reasoning
    return choice


class OpenAIServer:
    def __init__(self, client: ReplicaSet, frontend: Frontend, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits, fingerprint: str | None = None, reasoning_parser: str | None = None) -> None:
        self.client, self.fe, self.model, self.metrics, self.limits = client, frontend, model_name, metrics, limits
        self.fingerprint = fingerprint                 # system_fingerprint of every response (fingerprint.py)
        self.reasoning_parser = reasoning_parser       # chat: <think> text into reasoning_content (reasoning.py)
        self.gen = Generation(client, frontend, reasoning_parser)    # submit, read, collect, abort: every route
        self.probe_ids = frontend.tokenizer.encode("hi", add_special_tokens=False) or [0]

    # ---- shared steps --------------------------------------------------------------------------------------
    def _check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        P.check_model(body.model, self.model)
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], bad[0])

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

    # ---- endpoints -----------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        arrival = now()
        self._check(body)
        prompts = await self.fe.off_loop(self.fe.completion_ids, body)
        return await self._respond(body, request, prompts, arrival, "cmpl", 16, self._stream_completion,
                                   P.completion, P.completion_choice, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        arrival = now()
        self._check(body)
        plan = tools.plan(body.tools, body.tool_choice)
        ids = await self.fe.off_loop(self.fe.chat_ids, body, plan)
        # With a reasoning parser: does the rendered prompt leave the thinking open? (its last tokens' text)
        tail = self.fe.tokenizer.decode(ids[-16:]) if self.reasoning_parser is not None else None
        return await self._respond(body, request, [ids], arrival, "chatcmpl", None, self._stream_chat,
                                   P.chat_completion, P.chat_choice, chat=True, tool_plan=plan, reasoning_tail=tail)

    async def _respond(self, body, request: Request, prompts: list[list[int]], arrival: float, kind: str,
                       default_max: int | None, stream, build, build_choice, chat: bool,
                       tool_plan: ToolPlan | None = None, reasoning_tail: str | None = None):
        """Submit, then stream SSE chunks or answer once; the shared tail of both endpoints."""
        rid, choices = await self.gen.submit(body, prompts, kind, arrival, default_max, tool_plan, chat=chat)
        if tool_plan is not None and tool_plan.mode != "none":
            build_choice = _tool_choice_builder(tool_plan)
            stream = functools.partial(stream, tool_plan=tool_plan)
        if reasoning_tail is not None:                 # the reasoning split first; tool calls from the content
            build_choice = functools.partial(_with_reasoning, self.reasoning_parser, reasoning_tail, build_choice)
            stream = functools.partial(stream, splitter=functools.partial(
                ReasoningSplitter.for_prompt, self.reasoning_parser, reasoning_tail))
        created = int(time.time())
        n_prompt = sum(len(ids) for ids in prompts)        # each prompt counts once, whatever n
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return StreamingResponse(stream(rid, choices, n_prompt, created, include_usage),
                                     media_type="text/event-stream")
        done = await self.gen.unless_disconnected(request, choices)
        if done is None:
            return Response(status_code=499)

        def render() -> JSONResponse:
            # Off the event loop: with echo and logprobs a body holds 20 alternatives per prompt token (an
            # 8,000-token prompt: ~4 MB of JSON), which would stall every other stream and /health meanwhile.
            return JSONResponse(self._signed(build(
                rid, self.model, created, [build_choice(c.index, text, reason, self._take_logprobs(c, chat))
                                           for c, (text, reason, _) in zip(choices, done)],
                P.usage(n_prompt, sum(n for _, _, n in done), cached_tokens(choices)))))
        return await self.fe.off_loop(render)

    async def _stream_completion(self, rid: str, choices: list[Choice], n_prompt: int, created: int,
                                 include_usage: bool):
        n_out: dict[int, int] = {}

        def chunk(c: Choice, text: str, reason: str | None = None, echo: bool = False) -> str:
            return sse(self._signed(P.completion_chunk(rid, self.model, created, text, reason, None, include_usage,
                                                       c.index, None if echo else self._take_logprobs(c, False))))
        try:
            for c in choices:
                if c.echo:
                    yield chunk(c, c.echo, echo=True)
            async for c, delta, o in self.gen.merged(choices):
                n_out[c.index] = o.num_output_tokens
                if delta or o.finished:
                    yield chunk(c, delta, o.finish_reason if o.finished else None)
            if include_usage:
                yield sse(self._signed(P.completion_chunk(
                    rid, self.model, created, None, None, P.usage(n_prompt, sum(n_out.values()),
                                                                  cached_tokens(choices)), True)))
        except (EngineError, APIError) as e:
            yield stream_error(e)
        finally:
            self.gen.abort(choices)              # a client that left mid-stream: free its KV (no-op if finished)
        yield DONE

    async def _stream_chat(self, rid: str, choices: list[Choice], n_prompt: int, created: int,
                           include_usage: bool, tool_plan: ToolPlan | None = None, splitter=None):
        n_out: dict[int, int] = {}
        text: dict[int, str] = {c.index: "" for c in choices}      # all text so far (tool calls)
        sent: dict[int, int] = {c.index: 0 for c in choices}       # how much of it went out as content

        def chunk(c: Choice | None, delta: dict | None, reason: str | None = None, use: dict | None = None) -> str:
            return sse(self._signed(P.chat_chunk(rid, self.model, created, delta, reason, use, include_usage,
                                     c.index if c is not None else 0,
                                     self._take_logprobs(c, True) if c is not None and delta is not None
                                     and "role" not in delta else None)))
        try:
            for c in choices:
                yield chunk(c, {"role": "assistant", "content": ""})
            split = {c.index: splitter() for c in choices} if splitter is not None else None
            async for c, delta, o in self.gen.merged(choices):
                n_out[c.index] = o.num_output_tokens
                if split is not None:                  # reasoning goes out as it becomes certain; content below
                    thought, delta = split[c.index].feed(delta)
                    if o.finished:
                        more, rest = split[c.index].finish()
                        thought, delta = thought + more, delta + rest
                    if thought:
                        yield chunk(c, {"reasoning_content": thought})
                if tool_plan is not None and tool_plan.mode != "none":
                    # Tool calls: content goes out while it surely is content; the rest at the end.
                    text[c.index] += delta
                    if o.finished:
                        content, calls, reason = tools.parse(tool_plan, text[c.index], o.finish_reason)
                        rest = (content or "")[sent[c.index]:] if not calls or content else ""
                        d: dict = {"content": rest} if rest else {}
                        if calls:
                            d["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                        yield chunk(c, d, reason)
                        continue
                    safe = tools.content_prefix(tool_plan, text[c.index])
                    if safe > sent[c.index]:
                        part, sent[c.index] = text[c.index][sent[c.index]:safe], safe
                        yield chunk(c, {"content": part})
                    continue
                if o.finished:
                    yield chunk(c, {"content": delta} if delta else {}, o.finish_reason)
                elif delta:
                    yield chunk(c, {"content": delta})
            if include_usage:
                yield chunk(None, None, None, P.usage(n_prompt, sum(n_out.values()), cached_tokens(choices)))
        except (EngineError, APIError) as e:
            yield stream_error(e)
        finally:
            self.gen.abort(choices)
        yield DONE

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
