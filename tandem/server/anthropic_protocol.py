"""Anthropic Messages API request models and response shapes (POST /v1/messages, /v1/messages/count_tokens).

A Messages request becomes a ChatCompletionRequest (the chat route's own model), so it is rendered by the same
chat template, checked by the same frontend and sampled by the same engine path: `system` is the first system
message; a user turn's tool_result blocks become tool messages (before its text); an assistant turn's tool_use
blocks become tool_calls; a final assistant turn is a prefill the reply continues (continue_final_message);
`tools` / `tool_choice` become OpenAI's (`any` is "required", `tool` a named function).
Unknown fields are refused (400 naming them), as are content blocks tandem cannot read (image, document ...); an assistant turn's thinking blocks are its reasoning_content.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from .protocol import ChatCompletionRequest, Int64, _Strict, refuse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
# Block types the API defines that tandem does not read: a request holding one is refused, naming it.
REFUSED_BLOCKS = ("image", "document", "search_result", "redacted_thinking", "server_tool_use",
                  "web_search_tool_result", "container_upload")
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


def is_anthropic_path(path: str) -> bool:
    """Whether a request path is one of the Anthropic routes (their errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


PARAMS = {"stop": "stop_sequences"}      # the chat request's field names that differ from the Messages API's


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """Anthropic's error shape; its message starts with the field it is about (there is no `param`)."""
    param = PARAMS.get(param, param)
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None   # accepted, no effect: the prefix cache is automatic


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Strict):
    """An earlier reply's thinking sent back (assistant turns): the turn's reasoning_content, which the chat template
    renders or drops as the model's own template does; the signature is not checked."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(b.text for b in self.content)
        return f"Error: {body or ''}" if self.is_error else (body or "")


class RefusedBlock(_Strict):
    """A block type the API has and tandem does not read; its fields are not looked at."""
    model_config = _Strict.model_config | {"extra": "allow"}
    type: Literal[REFUSED_BLOCKS]


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RefusedBlock],
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    model_config = _Strict.model_config | {"extra": "allow"}    # a server tool's own fields: refused below
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None      # required of a client tool (checked in refused())
    type: str | None = None                          # "custom" (a client tool) or a server tool's type
    cache_control: dict[str, Any] | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        if self.type not in (None, "custom"):
            return f"{where}.type", f"{where}.type: server tools ({self.type}) are not supported; give client " \
                                    f"tools (name, description, input_schema)"
        if self.model_extra:
            field = next(iter(self.model_extra))
            return f"{where}.{field}", f"unrecognized request argument supplied: {where}.{field}"
        if self.input_schema is None:
            return f"{where}.input_schema", f"missing required field: {where}.input_schema"
        return None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # an extra (vLLM's): to the chat template

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a block or option tandem does not serve, else None."""
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                where = f"messages[{i}].content[{j}]"
                if isinstance(b, RefusedBlock):
                    return where, f"{where}: {b.type} content blocks are not supported (text, tool_use, " \
                                  f"tool_result and thinking are)"
                if isinstance(b, (ToolUseBlock, ThinkingBlock)) and m.role != "assistant":
                    return where, f"{where}: {b.type} blocks belong to assistant messages"
                if isinstance(b, ToolResultBlock) and m.role != "user":
                    return where, f"{where}: tool_result blocks belong to user messages"
        for i, t in enumerate(self.tools or []):
            bad = t.refused(f"tools[{i}]")
            if bad is not None:
                return bad
        tc = self.tool_choice
        if tc is not None:
            if (tc.type == "tool") != (tc.name is not None):
                return "tool_choice", "tool_choice.name is given with (and only with) type \"tool\""
            if tc.disable_parallel_tool_use and tc.type == "auto":
                return "tool_choice.disable_parallel_tool_use", ("tool_choice.disable_parallel_tool_use is not "
                                                                 "supported with type \"auto\"")
        return None

    def chat_messages(self) -> list[dict]:
        """The conversation as OpenAI chat messages, the shape the chat template is given."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": self.system if isinstance(self.system, str)
                        else "".join(b.text for b in self.system)})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            if m.role == "assistant":
                calls = [{"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                         for b in m.content if isinstance(b, ToolUseBlock)]
                thought = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
                out.append({"role": "assistant", "content": text if text or not calls else None,
                            **({"tool_calls": calls} if calls else {}),
                            **({"reasoning_content": thought} if thought else {})})
                continue
            results = [b for b in m.content if isinstance(b, ToolResultBlock)]
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in results]
            if text or not results:
                out.append({"role": "user", "content": text})
        return out

    def openai_tools(self) -> tuple[list[dict] | None, str | dict | None]:
        """(tools, tool_choice) in OpenAI's shape, for tools.plan."""
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in self.tools or []]
        tc = self.tool_choice
        choice = None if tc is None else {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
        return tools or None, choice

    def chat_request(self, **sampling) -> ChatCompletionRequest:
        """The equivalent chat request (sampling fields in the chat route's names); APIError(400) if refused."""
        refuse(self.refused())
        tools, choice = self.openai_tools()
        kwargs = dict(self.chat_template_kwargs or {})
        if self.messages[-1].role == "assistant":     # a prefill: the reply continues it (no new turn)
            sampling["add_generation_prompt"] = False
            kwargs["continue_final_message"] = True
        if kwargs:
            sampling["chat_template_kwargs"] = kwargs
        chat = ChatCompletionRequest.model_validate({"messages": self.chat_messages(), "tools": tools,
                                                     "tool_choice": choice, **sampling})
        refuse(chat.unsupported())
        return chat


class MessagesRequest(CountTokensRequest):
    max_tokens: Int64 = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None     # user_id (a string): the tenant (--scheduling-policy fair); else no effect
    cache_control: dict[str, Any] | None = None  # accepted, no effect: the prefix cache is automatic

    def to_chat(self) -> ChatCompletionRequest:
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                sampling[name] = getattr(self, name)
        user = (self.metadata or {}).get("user_id")
        if isinstance(user, str):
            sampling["user"] = user
        return self.chat_request(**sampling)


# ---- responses --------------------------------------------------------------------------------------------
def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def thinking_block(text: str) -> dict:
    """The thinking (--reasoning-parser) as a thinking block; the signature is empty (nothing to verify)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_blocks(calls: list[dict]) -> list[dict]:
    """OpenAI tool_calls (as tools.parse gives them) as tool_use blocks."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = {}
        out.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
                    "name": c["function"]["name"], "input": args if isinstance(args, dict) else {"value": args}})
    return out


def stop_reason(finish_reason: str | None, stop_sequence: str | None, tool_use: bool) -> str | None:
    """A tool call cut by max_tokens (a harmony call's arguments as far as written) stops at max_tokens."""
    if tool_use and finish_reason != "length":
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "", finish_reason)


def message(mid: str, model: str, content: list[dict], reason: str | None, stop_sequence: str | None,
            input_tokens: int, output_tokens: int) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def event(name: str, data: dict) -> str:
    """One SSE event in Anthropic's framing: an `event:` line naming the type, then the JSON."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"
