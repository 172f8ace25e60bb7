"""OpenAI request models (pydantic, strict types) and the response shapes, with OpenAI's field names.

Types are checked strictly ("0.5" is not a number, 1 is not a boolean); ranges are checked by SamplingParams
and the frontend, so every invalid value surfaces as a 400 that names its field in `param`.
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64 = 2 ** 63
Int64 = Annotated[int, Field(ge=-INT64, lt=INT64)]   # every integer field: nothing past int64 reaches the engine
ROLES = ("system", "developer", "user", "assistant", "tool", "function")   # OpenAI's message roles
RETRY_AFTER_S = 1          # Retry-After of every 503 (a full queue drains, a restarted server comes back)
STATUS_CODES = (408, 503)  # their errors carry the status as `code` ("503"), in a JSON body and a stream alike
MAX_MESSAGE_CHARS = 1000   # an error message's length at most: a quoted value never makes it long


class APIError(Exception):
    """An error the client sees as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, error_code(status, code)
        self.type = type or {400: "invalid_request_error", 404: "invalid_request_error",
                             413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str] | None:
        return retry_after(self.status)


def retry_after(status: int) -> dict[str, str] | None:
    """The headers of an error response: Retry-After on every 503."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None


def refuse(bad: tuple[str, str] | None, name: Callable[[str], str | None] | None = None) -> None:
    """APIError(400) for a refusal, (field, why) as unsupported() and refused() give it, naming the field
    (as `name` renames it for the route's API); nothing when `bad` is None."""
    if bad is not None:
        raise APIError(400, bad[1], bad[0] if name is None else name(bad[0]))


def check_model(model: str | None, served: str, required: bool = False) -> None:
    """APIError 404 naming `model` unless it is the model this server serves; where the field is optional
    (not `required`), absent or empty means the served one."""
    if model == served or (not required and model in (None, "")):
        return
    raise APIError(404, f"The model `{model}` does not exist; this server serves `{served}`.", "model",
                   "model_not_found")


def error_code(status: int, code: str | None = None) -> str | None:
    """An error's `code`: the one given, else the status as a string for 408 and 503, whose errors a stream (no
    status line) must still tell apart from a 500; null otherwise. One rule for every route and for streams."""
    return str(status) if code is None and status in STATUS_CODES else code


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """Every error's shape. Values are quoted short where they are quoted (sampling_params.quote); this cap
    holds for any message, whatever quoted it (a grammar compiler's error, a field path)."""
    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]}... (message cut at {MAX_MESSAGE_CHARS} of {len(message)} characters)"
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    # Unknown fields are refused (OpenAI: "Unrecognized request argument"): none is silently ignored. Known
    # ones are type-checked strictly.
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None                  # the tenant: --scheduling-policy fair shares by it (else no effect)
    metadata: dict[str, str] | None = None   # likewise
    store: bool | None = None                # likewise (nothing is stored)
    service_tier: str | None = None          # likewise (one tier)
    response_format: ResponseFormat | None = None
    # extras (vLLM's names)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    top_k: Int64 | None = None
    min_p: float | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    timeout: float | None = None             # seconds; then the request ends wherever it is (408 `timeout`)
    priority: Int64 = 0                      # --scheduling-policy priority: lower goes first (vLLM's field)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a value tandem does not implement or a combination OpenAI refuses, else None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options", "continuous_usage_stats is not supported"

        return None

    def structured(self) -> tuple[str, dict[str, Any]] | None:
        """(field, StructuredOutputsParams fields) from whichever field asks for structured output; APIError(400)
        if more than one does."""
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            rf = self.response_format
            if rf.type == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            else:
                asked.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if len(asked) > 1:
            raise APIError(400, f"ask for one structured output at a time, got {', '.join(a for a, _ in asked)}",
                           asked[1][0])
        return asked[0] if asked else None

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
                              "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                              "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
                              "include_stop_str_in_output": self.include_stop_str_in_output, "n": self.n,
                              "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                              "logit_bias": self.logit_bias, "min_tokens": self.min_tokens, "timeout": self.timeout,
                              "priority": self.priority, "user": self.user}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw


class CompletionRequest(_SamplingFields):
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    max_tokens: Int64 | None = 16            # OpenAI's default for completions
    echo: bool = False
    logprobs: Int64 | None = None
    suffix: str | None = None
    best_of: Int64 | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix is not None:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, self.n):
            return "best_of", "best_of must equal n (ranking extra samples by log probability is not supported)"
        return super().unsupported()

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        return {**super().sampling_kwargs(default_max_tokens), "logprobs": self.logprobs,
                "prompt_logprobs": self.logprobs if self.echo else None}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")   # name, tool_call_id ... reach the template
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None

    def shape_error(self) -> tuple[str, str] | None:
        """(field, why) where the message breaks OpenAI's rules for its role, else None. content is required
        and not null for every role but an assistant turn that calls tools (and the deprecated function
        role, whose result may be null); a tool result names the call it answers; only assistants call."""
        extra = self.model_extra or {}
        calls = extra.get("tool_calls")
        if self.content is None and not (self.role == "assistant" and calls) and self.role != "function":
            return "content", (f"a {self.role} message needs content (a string or a list of text parts); null "
                               "or a missing content is allowed only on an assistant message with tool_calls")
        if isinstance(self.content, list) and not self.content:
            return "content", "content must be a string or a non-empty list of text parts"
        if calls is not None and (self.role != "assistant" or not isinstance(calls, list)):
            return "tool_calls", "tool_calls is a list, and only assistant messages carry it"
        if self.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
            return "tool_call_id", "a tool message needs tool_call_id (a string: the id of the call it answers)"
        if self.role == "function" and not isinstance(extra.get("name"), str):
            return "name", "a function message needs name (a string)"
        return None

    def as_template_dict(self) -> dict:
        """The message as chat templates read it (vLLM's shape): a tool call's JSON arguments as an object
        (templates write `arguments|tojson`; a string would come out quoted), and an assistant turn's
        reasoning_content also as `thinking` (gpt-oss's template reads that name)."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        d.setdefault("content", "")           # an assistant turn that only called tools
        if isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_object_arguments(c) for c in d["tool_calls"]]
        if self.role == "assistant" and isinstance(d.get("reasoning_content"), str):
            d.setdefault("thinking", d["reasoning_content"])
        return d


def _object_arguments(call: Any) -> Any:
    """A tool call whose function.arguments is a JSON object's text, with the object instead (else as it is)."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("arguments"), str):
        return call
    try:
        args = json.loads(f["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**f, "arguments": args}} if isinstance(args, dict) else call


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True       # extra (vLLM)
    chat_template_kwargs: dict[str, Any] | None = None   # extra (vLLM): passed to the chat template
    # to the chat template as `reasoning_effort` (gpt-oss's writes it into its system message); refused by a
    # template that does not read it (Frontend.chat_prompt), never silently dropped
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            bad = m.shape_error()
            if bad is not None:
                return f"messages[{i}].{bad[0]}", bad[1]
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.functions or self.function_call not in (None, "none"):
            return ("functions" if self.functions else "function_call"), "functions are not supported (use tools)"
        return super().unsupported()

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        kw = super().sampling_kwargs(default_max_tokens)
        if self.max_completion_tokens is not None:       # OpenAI's current name wins over the deprecated one (vLLM)
            kw["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return kw


# ---- responses (plain dicts: they are built per token, so no validation cost) --------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}    # served from the prefix cache


MIN_LOGPROB = -9999.0       # a token the grammar or logit_bias ruled out has log p = -inf: JSON has no such number


def _finite(lp: float | None) -> float | None:
    return lp if lp is None or lp >= MIN_LOGPROB else MIN_LOGPROB    # vLLM's clamp, for the same reason


def completion_logprobs(entries: list, decode, offset: int) -> dict:
    """Completions' logprobs shape for (token id, logprob, [[top id, top logprob], ...]) entries; `offset`:
    where the first token's text starts in the choice's text."""
    tokens = [decode(t) for t, _, _ in entries]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [_finite(lp) for _, lp, _ in entries],
            "top_logprobs": [None if lp is None else {decode(a): _finite(b) for a, b in top} for _, lp, top in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list, decode) -> dict:
    """Chat's logprobs shape for (token id, logprob, [[top id, top logprob], ...]) entries."""
    def item(t: int, lp: float) -> dict:
        text = decode(t)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8", "replace"))}
    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish_reason: str | None,
                     use: dict | None = None, include_usage: bool = False, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    """text None: the usage-only chunk (choices []) that ends a stream with include_usage."""
    choices = [] if text is None else [completion_choice(index, text, finish_reason, logprobs)]
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if include_usage:
        out["usage"] = use
    return out


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish_reason: str | None,
               use: dict | None = None, include_usage: bool = False, index: int = 0,
               logprobs: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if include_usage:
        out["usage"] = use
    return out


def model_list(name: str, max_model_len: int, sampling_defaults: dict | None = None) -> dict:
    """sampling_defaults: what omitted sampling fields take (the model's, `--generation-config auto`)."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                        "owned_by": "tandem", "root": name, "max_model_len": max_model_len,
                                        "sampling_defaults": sampling_defaults or {}}]}
