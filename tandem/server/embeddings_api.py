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

import base64
import dataclasses
import uuid
from typing import Literal

from fastapi import FastAPI, Request

from ..device.embed import vector
from ..device.streams import now
from ..replicas.engine_client import RequestStream
from ..request import StepOutput
from ..sampling_params import SamplingParams
from .frontend import MAX_PROMPTS, Frontend, find_bad_text
from .generation import Generation
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


async def _vectors(gen: Generation, streams: list[RequestStream]) -> list[StepOutput]:
    """The finished output of each embeddings request (its engine errors raised as the generation routes')."""
    outs = []
    for st in streams:
        o = None
        async for o in gen.outputs(st):
            if o.finished:
                break
        if o is None or not o.finished or o.embedding is None:
            raise APIError(500, "the engine ended this request without its vector", type="server_error")
        outs.append(o)
    return outs


async def embeddings(gen: Generation, served: str, body: EmbeddingRequest, request: Request):
    arrival = now()
    check(body, served)
    prompts = await gen.fe.off_loop(prompts_of, gen.fe, body)
    rid = f"embd-{uuid.uuid4().hex}"
    params = gen.fe.params_dict(dataclasses.replace(EMBED_PARAMS, pooling=body.pooling))
    streams = await gen.submit_all([(f"{rid}-{k}", ids, params) for k, ids in enumerate(prompts)], arrival)
    outs = await gen.unless_disconnected(request, streams, _vectors(gen, streams))
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(o.embedding).decode() if body.encoding_format == "base64"
             else vector(o.embedding)} for i, o in enumerate(outs)]
    n = sum(len(ids) for ids in prompts)
    return {"object": "list", "data": data, "model": served, "usage": {"prompt_tokens": n, "total_tokens": n}}


def add_routes(app: FastAPI, gen: Generation, served: str) -> None:
    @app.post("/v1/embeddings")
    async def embeddings_route(body: EmbeddingRequest, request: Request):
        return await embeddings(gen, served, body, request)
