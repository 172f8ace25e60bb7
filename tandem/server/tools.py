"""Tool calling in chat (`tools`, `tool_choice`), through the grammar machinery.

- "none": the tools are not shown to the model; plain text comes back.
- "required" / a named function: the output is constrained by a JSON schema (structured output), so it always
  parses: a list of {"name", "arguments"} for "required" (vLLM's schema), the arguments object for a named
  function.
- "auto": the tools go to the chat template (`tools=`); a template that does not render tools gets them in
  the Hermes format that Qwen2 and many Llama fine-tunes use, as a system block, and the output is parsed for
  <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks; text outside them stays content.
Responses carry OpenAI's tool_calls; finish_reason is "tool_calls" (OpenAI's "stop" for a named function).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .protocol import APIError

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
OPEN = "<tool_call>"
HERMES_SYSTEM = ("You may call one or more functions to assist with the user query. Function signatures are "
                 "within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\nFor each function call, return a "
                 "json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
                 "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass
class ToolPlan:
    mode: str                                        # "none" | "auto" | "required" | "named"
    tools: list[dict] = field(default_factory=list)  # the functions ({"name", "description", "parameters"})
    named: str | None = None
    schema: dict | None = None                       # structured output of "required" / "named"


NO_TOOLS = ToolPlan("none")       # a completion's: plain text (never changed)


def plan(tools: list[dict] | None, tool_choice: str | dict | None) -> ToolPlan:
    """Validate `tools` / `tool_choice` (APIError 400 naming the field) and decide how to serve them."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    funcs = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) or \
                not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, "each tool is {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": "
                                "{...}}}", f"tools[{i}]")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, "function parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        funcs.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", funcs)
    if choice == "auto":
        return ToolPlan("auto", funcs)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
        return ToolPlan("required", funcs, schema={"type": "array", "minItems": 1, "items": {"anyOf": items}})
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    match = [f for f in funcs if f["name"] == name]
    if not match:
        raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": <one of tools>}}", "tool_choice")
    return ToolPlan("named", funcs, named=name, schema=match[0]["parameters"])


def render_messages(messages: list[dict], p: ToolPlan, template: str | None) -> tuple[list[dict], dict]:
    """Messages and extra template kwargs: tools for "auto" (and the constrained modes, so the model knows
    them), in the Hermes system block when the template does not render `tools` itself."""
    if p.mode == "none":
        return messages, {}
    specs = [{"type": "function", "function": f} for f in p.tools]
    if template and "tools" in template:
        return messages, {"tools": specs}
    block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(s) for s in specs))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{block}"}, *messages[1:]], {}
    return [{"role": "system", "content": block}, *messages], {}


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def parse(p: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of a finished output."""
    if p.mode in ("required", "named") and finish_reason == "stop":
        try:
            args = json.loads(text)          # the grammar completed (a user's stop string may have cut it)
        except ValueError:
            return text, [], finish_reason
        if p.mode == "named":
            return None, [_call(p.named, args)], finish_reason
        return None, [_call(c["name"], c["arguments"]) for c in args], "tool_calls"
    if p.mode == "auto" and OPEN in text:
        calls = []
        for m in CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append(_call(obj["name"], obj.get("arguments", {})))
        if calls:
            content = CALL.sub("", text).strip()
            return content or None, calls, "tool_calls"
    return text, [], finish_reason


def content_prefix(p: ToolPlan, text: str) -> int:
    """Streaming: how much of the text so far is surely content (the rest may belong to a tool call and is
    held until the end): none under a constrained tool choice; under "auto", up to a <tool_call> tag or a
    tail that may start one."""
    if p.mode in ("required", "named"):
        return 0
    if p.mode == "auto":
        i = text.find(OPEN)
        if i >= 0:
            return i
        for k in range(len(OPEN) - 1, 0, -1):
            if text.endswith(OPEN[:k]):
                return len(text) - k
    return len(text)
