"""OpenAI Responses API request model and response shapes (POST /v1/responses), stateless.

A Responses request becomes a ChatCompletionRequest (the chat route's own model), so it is rendered by the same
chat template, checked by the same frontend and sampled by the same engine path: `instructions` is the first
system message; a string `input` is one user message; input items map onto chat messages (a `developer` message
is a system message, `function_call` items become an assistant turn's tool_calls, `function_call_output` items
tool messages); flat function `tools` become the chat route's, `text.format` its `response_format`.
Nothing is stored: `previous_response_id` is refused, `store` is accepted and answered `false`. Unknown fields,
input items and tools tandem cannot serve (images, files, web_search ...) are refused with a 400 naming them.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import Field, ValidationError

from .protocol import APIError, ChatCompletionRequest, Int64, _Strict, refuse

PATH = "/v1/responses"
# The chat request's field names that differ from this API's: an error about one names the Responses field.
PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
          "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def is_responses_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def param_name(param: str | None) -> str | None:
    """The Responses field a chat-request field (as the shared layers name it) stands for."""
    if param is None:
        return None
    base = re.split(r"[.\[]", param, maxsplit=1)[0]
    return PARAMS.get(base, param)


# ---- request ---------------------------------------------------------------------------------------------
class TextContent(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None      # an output_text part sent back: accepted, not read
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = None                     # an output message sent back as input carries these
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier output's reasoning sent back: the reasoning_content of the assistant turn it precedes (the chat
    template renders or drops it as the model's own does). Encrypted reasoning cannot be read: refused."""
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None     # the only one a model without the option has


class ReasoningConfig(_Strict):
    """`reasoning`: the effort goes to the chat template (the chat route's reasoning_effort); no summaries are
    written (the reasoning item holds the reasoning itself)."""
    effort: Literal["low", "medium", "high"] | None = None
    summary: None = None
    generate_summary: None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None        # accepted: no obfuscation padding is sent


def _parse(model, value: Any, where: str):
    """`value` as `model`, or APIError(400) naming the path of its first bad field under `where`."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))      # of a union's branches, the one that got furthest
        path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]
                               if isinstance(p, int) or (str(p).isidentifier() and p not in ("str", "list")))
        words = {"missing": "missing required field", "extra_forbidden": "unrecognized argument"}
        raise APIError(400, f"{words.get(err['type'], 'invalid value for')} {path}"
                            + ("" if err["type"] in words else f": {err['msg']}"), path) from None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None                  # accepted; nothing is stored (the response says store: false)
    previous_response_id: str | None = None    # refused: stateless
    metadata: dict[str, str] | None = None     # echoed; no effect on generation
    user: str | None = None                    # the tenant (--scheduling-policy fair), as on the chat route
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None   # effort: the chat route's reasoning_effort
    include: list[str] | None = None           # refused unless empty
    # extras the chat route takes (vLLM's names)
    seed: Int64 | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # to the chat template, e.g. {"enable_thinking": false}

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for an option a stateless server without reasoning does not serve, else None."""
        if self.previous_response_id is not None:
            return "previous_response_id", ("previous_response_id is not supported: this server stores no "
                                            "responses; send the whole conversation in `input`")
        if self.truncation == "auto":
            return "truncation", "truncation \"auto\" is not supported (only \"disabled\": an over-long input is a 400)"
        if self.include:
            return "include", f"include is not supported ({self.include[0]!r})"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if isinstance(self.input, list) and not self.input:
            return "input", "input must be a string or a non-empty list of items"
        return None

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        out = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind not in ITEMS:
                raise APIError(400, f"input[{i}].type: {kind!r} input items are not supported (message, "
                                    f"function_call, function_call_output and reasoning are)", f"input[{i}].type")
            out.append(_parse(ITEMS[kind], item, f"input[{i}]"))
        return out

    def chat_messages(self) -> list[dict]:
        """The conversation as OpenAI chat messages: consecutive function_call items join one assistant turn
        (the one just before them, when it is an assistant message)."""
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        thought = ""                      # reasoning items' text, for the assistant turn that follows them
        for item in self.items():
            if isinstance(item, ReasoningItem):
                thought += item.text()
            elif isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not (out and out[-1]["role"] == "assistant") or thought:
                    out.append({"role": "assistant", "content": None})
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            if thought and not isinstance(item, ReasoningItem) and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], thought = thought, ""
        return out

    def chat_tools(self) -> list[dict] | None:
        tools = []
        for i, t in enumerate(self.tools or []):
            if t.get("type") != "function":
                raise APIError(400, f"tools[{i}].type: {t.get('type')!r} tools are not supported; give function "
                                    f"tools ({{\"type\": \"function\", \"name\", \"parameters\"}})",
                               f"tools[{i}].type")
            f = _parse(FunctionTool, t, f"tools[{i}]")
            tools.append({"type": "function", "function": {
                "name": f.name, "description": f.description or "",
                "parameters": f.parameters if f.parameters is not None else {"type": "object", "properties": {}}}})
        return tools or None

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        if fmt.schema_ is None:
            raise APIError(400, "text.format json_schema needs schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "description": fmt.description,
                                                       "schema": fmt.schema_, "strict": fmt.strict}}

    def to_chat(self) -> ChatCompletionRequest:
        """The equivalent chat request; APIError(400) naming the Responses field if refused."""
        refuse(self.refused())
        tc = self.tool_choice
        choice = {"type": "function", "function": {"name": tc.name}} if isinstance(tc, NamedToolChoice) else tc
        fields: dict[str, Any] = {"messages": self.chat_messages(), "tools": self.chat_tools(), "tool_choice": choice,
                                  "response_format": self.response_format(), "stream": self.stream,
                                  "max_tokens": self.max_output_tokens, "stop": self.stop, "seed": self.seed,
                                  "chat_template_kwargs": self.chat_template_kwargs,
                                  "reasoning_effort": self.reasoning.effort if self.reasoning else None}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "user"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        chat = ChatCompletionRequest.model_validate(fields)
        refuse(chat.unsupported(), param_name)
        return chat


# ---- responses -------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(mid: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}


def reasoning_item(rid: str, text: str | None, status: str) -> dict:
    """The thinking (--reasoning-parser) as a reasoning item: its text one reasoning_text part, no summary."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": rid, "summary": [], "content": content, "status": status}


def call_items(calls: list[dict], status: str = "completed") -> list[dict]:
    """tool_calls (as tools.parse gives them) as function_call output items."""
    return [{"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
             "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": status}
            for c in calls]


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


def echo_tools(body: ResponsesRequest) -> list[dict]:
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in body.tools or []]


def response(body: ResponsesRequest, rid: str, created_at: int, status: str, output: list[dict],
             use: dict | None, error: dict | None = None) -> dict:
    """The response object, its request's settings echoed as OpenAI does."""
    tc = body.tool_choice
    return {"id": rid, "object": "response", "created_at": created_at, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False,
            "reasoning": {"effort": body.reasoning.effort, "summary": None} if body.reasoning else None,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "tool_choice": tc.model_dump() if isinstance(tc, NamedToolChoice) else tc or "auto",
            "tools": echo_tools(body), "truncation": "disabled", "usage": use, "user": body.user,
            "metadata": body.metadata or {}}


def event(name: str, seq: int, data: dict) -> str:
    """One SSE event in OpenAI's Responses framing: an `event:` line, then the JSON with its sequence number."""
    return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': seq, **data}, ensure_ascii=False)}\n\n"
