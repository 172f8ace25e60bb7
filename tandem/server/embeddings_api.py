"""OpenAI's embeddings route: POST /v1/embeddings, for the decoder models tandem serves.

Each input is a prefill-only request through the same engine queue and scheduler as generation
(SamplingParams.embed): it never decodes, and its vector is its last token's final-normed hidden state
(`last` pooling, the default for causal LMs) or the mean of every prompt position's (`pooling: "mean"`, tandem's
field, SamplingParams.pooling), L2-normalized, the same bits alone or batched (device/embed.py).
`input` is a string, a list of strings, a list of token ids or a list of token-id lists; `encoding_format` "float"
or "base64" (little-endian float32, as OpenAI); `user` is accepted; `dimensions` is refused (the model's width is
fixed). Unknown fields are refused, as on every route.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..device.embed import vector
from ..device.streams import now
from ..replicas.engine_client import EngineError, RequestStream
from ..request import StepOutput
from ..sampling_params import SamplingParams
from .frontend import MAX_PROMPTS, Frontend, find_bad_text
from .generation import Generation, wait_disconnect
from .protocol import APIError, Int64, _Strict, check_model

EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, embed=True)


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[Int64] | list[list[Int64]]   # one prompt or a batch (text or token ids)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"      # base64: little-endian float32 bytes
    dimensions: Int64 | None = None     # refused: a decoder's hidden width is fixed (no Matryoshka truncation)
    user: str | None = None             # accepted and unused, as OpenAI's end-user id
    pooling: Literal["last", "mean"] = "last"   # extra: the last token's hidden state, or the mean of all positions


def prompts_of(fe: Frontend, body: EmbeddingRequest) -> list[list[int]]:
    """The token ids of each input, validated (APIError 400 naming input or input[i])."""
    bad = find_bad_text(body.input, "input")
    if bad is not None:
        raise APIError(400, f"{bad} is not valid Unicode text (it holds a lone UTF-16 surrogate)", bad)
    inp = body.input
    batch = isinstance(inp, list) and bool(inp) and isinstance(inp[0], (str, list))
    items = inp if batch else [inp]
    if isinstance(inp, list) and not inp:
        raise APIError(400, "input is empty: give a string, token ids, or a non-empty list of either", "input")
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"too many inputs: {len(items)}, the limit is {MAX_PROMPTS}", "input")
    out = []
    for i, item in enumerate(items):
        param = f"input[{i}]" if batch else "input"
        ids = fe.completion_prompt(item, param)
        if len(ids) + 1 > fe.max_context:       # the engine's rule: room for one (dropped) sampled token
            raise APIError(400, f"This model's maximum context length is {fe.max_context} tokens; {param} has "
                                f"{len(ids)} tokens (at most {fe.max_context - 1} can be embedded).", param,
                           "context_length_exceeded")
        out.append(ids)
    return out


def check(body: EmbeddingRequest, served: str) -> None:
    check_model(body.model, served)
    if body.dimensions is not None:
        raise APIError(400, "dimensions is not supported: this model's embeddings have a fixed width (its hidden "
                            "size); leave dimensions out", "dimensions")


async def _vector(gen: Generation, st: RequestStream) -> StepOutput:
    """The finished output of one embeddings request (its engine errors raised as the generation routes do)."""
    async for o in gen.client.outputs(st):
        if o.finish_reason == "error":
            if o.error_status in (408, 503):
                raise EngineError(o.error_status, o.error or "the request's deadline passed")
            raise APIError(500, f"the engine failed this request: {o.error}", type="server_error")
        if o.finished and o.embedding is not None:
            return o
        if o.finished:
            break
    raise APIError(500, "the engine ended this request without its vector", type="server_error")


async def _vectors(gen: Generation, streams: list[RequestStream]) -> list[StepOutput]:
    return [await _vector(gen, st) for st in streams]


async def embeddings(gen: Generation, served: str, body: EmbeddingRequest, request: Request):
    arrival = now()
    check(body, served)
    prompts = await gen.fe.off_loop(prompts_of, gen.fe, body)
    rid = f"embd-{uuid.uuid4().hex}"
    params = gen.fe.params_dict(dataclasses.replace(EMBED_PARAMS, pooling=body.pooling))
    subs = await asyncio.gather(*(gen.client.submit(f"{rid}-{k}", ids, params, arrival)
                                  for k, ids in enumerate(prompts)), return_exceptions=True)
    streams = [st for st in subs if isinstance(st, RequestStream)]
    task = watch = None
    try:
        failed = [e for e in subs if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        task = asyncio.ensure_future(_vectors(gen, streams))     # a task: cancelled quietly if the client leaves
        watch = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            return Response(status_code=499)        # the client left: its requests are aborted below
        outs = task.result()
    finally:
        for fut in (task, watch):
            if fut is not None and not fut.done():
                fut.cancel()
        for st in streams:
            gen.client.abort(st.rid)                # a no-op for finished ones; frees the rest
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(o.embedding).decode() if body.encoding_format == "base64"
             else vector(o.embedding)} for i, o in enumerate(outs)]
    n = sum(len(ids) for ids in prompts)
    return {"object": "list", "data": data, "model": served, "usage": {"prompt_tokens": n, "total_tokens": n}}


def add_routes(app: FastAPI, gen: Generation, served: str) -> None:
    @app.post("/v1/embeddings")
    async def embeddings_route(body: EmbeddingRequest, request: Request):
        return await embeddings(gen, served, body, request)
