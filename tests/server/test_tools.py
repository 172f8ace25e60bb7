"""Tool calling through the openai client: constrained calls ("required", a named function) always parse,
"auto" is parsed from the Hermes format, streaming included; bad tool specs are 400s."""
from __future__ import annotations

import json

import pytest

from tests.helpers.server_utils import assert_error
from tandem.server import tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_constrained_tool_calls_round_trip(client, choice, stream):
    kw = dict(model="tiny", messages=MSGS, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80,
              temperature=1.0, seed=2)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        names = [tc.function.name for tc in calls]
        args = [tc.function.arguments for tc in calls]
    else:
        msg = client.chat.completions.create(**kw).choices[0]
        reason, names = msg.finish_reason, [tc.function.name for tc in msg.message.tool_calls]
        args = [tc.function.arguments for tc in msg.message.tool_calls]
        assert msg.message.content is None and all(tc.id.startswith("call_") for tc in msg.message.tool_calls)
    assert names and reason == ("tool_calls" if choice == "required" else "stop")
    for name, a in zip(names, args):
        params = json.loads(a)
        if name == "get_time" or choice != "required":
            assert name == "get_time" and params["zone"] in ("utc", "cet")
        else:
            assert name == "get_weather" and params["unit"] in ("c", "f")


def test_a_tool_call_history_renders(client):
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], tool_choice="none",
                                         max_tokens=4)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


def test_auto_parses_hermes_calls_and_streams_content_before_them():
    plan = tools.plan([WEATHER], "auto")
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n' \
           '</tool_call>'
    content, calls, reason = tools.parse(plan, text, "stop")
    assert content == "Let me check." and reason == "tool_calls"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert tools.content_prefix(plan, "Let me check. <tool") == len("Let me check. ")
    assert tools.content_prefix(plan, "Plain text") == len("Plain text")
    assert tools.parse(plan, "no calls here", "stop") == ("no calls here", [], "stop")
    messages, extra = tools.render_messages(MSGS, plan, "{{ messages }}")       # a template without tools
    assert extra == {} and "<tools>" in messages[0]["content"] and messages[0]["role"] == "system"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_are_400(server, body, param):
    assert_error(server.http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body}),
                 400, param)
