"""OpenAI request models (pydantic, strict types) and the response shapes, with OpenAI's field names.

Types are checked strictly ("0.5" is not a number, 1 is not a boolean); ranges are checked by SamplingParams
and the frontend, so every invalid value surfaces as a 400 that names its field in `param`.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64 = 2 ** 63


class APIError(Exception):
    """An error the client sees as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 404: "not_found_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send extras such as `user`); known ones are type-checked strictly.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a value tandem does not implement, else None."""
        if self.n != 1:
            return "n", "only n=1 is supported"
        if self.presence_penalty != 0 or self.frequency_penalty != 0:
            return ("presence_penalty" if self.presence_penalty else "frequency_penalty"), "penalties are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
                              "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                              "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16              # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo=true is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.suffix is not None:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")   # name, tool_call_id ... reach the template
    role: str
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    add_generation_prompt: bool = True       # extra (vLLM)

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs are not supported"
        return super().unsupported()

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        kw = super().sampling_kwargs(default_max_tokens)
        if self.max_tokens is None and self.max_completion_tokens is not None:
            kw["max_tokens"] = self.max_completion_tokens
        return kw


# ---- responses (plain dicts: they are built per token, so no validation cost) --------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}    # served from the prefix cache


def completion(rid: str, model: str, created: int, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish_reason: str | None,
                     use: dict | None = None, include_usage: bool = False) -> dict:
    """text None: the usage-only chunk (choices []) that ends a stream with include_usage."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if include_usage:
        out["usage"] = use
    return out


def chat_completion(rid: str, model: str, created: int, text: str, finish_reason: str | None, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish_reason: str | None,
               use: dict | None = None, include_usage: bool = False) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if include_usage:
        out["usage"] = use
    return out


def model_list(name: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                        "owned_by": "tandem", "root": name, "max_model_len": max_model_len}]}
