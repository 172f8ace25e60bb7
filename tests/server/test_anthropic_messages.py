"""Anthropic's Messages API on the real default model (SmolLM2-135M-Instruct), through the official anthropic
client: messages.create and messages.stream equal the offline LLM's greedy chat output, count_tokens the prompt
length; tool_choice any / tool give a tool_use block that fits the schema; stop_sequences give "stop_sequence";
bad requests get Anthropic-shaped errors naming the problem; a client that leaves mid-stream aborts its request.
"""
from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers.server_utils import ServerProcess, assert_leaving_aborts, default_model_server, offline_greedy_chat

KV = 4096
SYSTEM = "You are a helpful assistant. Answer briefly."
USER = "What is the capital of France?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
MESSAGES = [{"role": "user", "content": USER}]
MAX_TOKENS = 12
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                             "required": ["zone"], "additionalProperties": False}}
GREEDY = {"temperature": 0}   # sampling fields the API still takes; this SDK's typed arguments no longer name them
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
              "message_stop"}


@pytest.fixture(scope="module")
def reference():
    return offline_greedy_chat(CHAT, MAX_TOKENS, KV)


@pytest.fixture(scope="module")
def server(reference, tmp_path_factory):
    yield from default_model_server(tmp_path_factory, KV)


@pytest.fixture(scope="module")
def client(server):
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120,
                            http_client=anthropic.DefaultHttpxClient(trust_env=False))
    yield c
    c.close()


def test_create_and_stream_equal_offline_greedy(client, reference):
    ref, name = reference["chat"], reference["name"]
    kw = dict(model=name, system=SYSTEM, messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body=GREEDY,
              metadata={"user_id": "u1"})
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == name
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref.text
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
    assert msg.stop_sequence is None

    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream if e.type in RAW_EVENTS]
        final = stream.get_final_message()
    assert final.content[0].text == ref.text and final.stop_reason == msg.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (msg.usage.input_tokens, msg.usage.output_tokens)
    deltas = events[2:-3]
    assert events[:2] == ["message_start", "content_block_start"] and deltas and \
        set(deltas) == {"content_block_delta"}, events
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"], events


def test_count_tokens_is_the_prompt_length(client, reference):
    n = client.messages.count_tokens(model=reference["name"], system=SYSTEM, messages=MESSAGES)
    assert n.input_tokens == len(reference["chat"].prompt_token_ids)
    blocks = client.messages.count_tokens(model=reference["name"], system=[{"type": "text", "text": SYSTEM}],
                                          messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}])
    assert blocks.input_tokens == n.input_tokens


def test_stop_sequence(client, reference):
    text = reference["chat"].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = text.index(stop)
    for stream in (False, True):
        kw = dict(model=reference["name"], system=SYSTEM, messages=MESSAGES, max_tokens=MAX_TOKENS,
                  extra_body=GREEDY, stop_sequences=["zzzz", stop])
        if stream:
            with client.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kw)
        assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop, msg
        assert msg.content[0].text == text[:cut]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_constrained_tool_use(client, reference, choice, stream):
    kw = dict(model=reference["name"], messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80, extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and msg.stop_reason == "tool_use", msg
    schemas = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
    for b in uses:
        assert b.id.startswith("toolu_") and b.name in schemas
        jsonschema.validate(b.input, schemas[b.name])
    if choice["type"] == "tool":
        assert [b.name for b in uses] == ["get_time"]
    # the tool_use goes back with its result: the conversation renders and generates
    follow = client.messages.create(model=reference["name"], max_tokens=4, extra_body=GREEDY,
                                    tools=[WEATHER, TIME],
                                    messages=[*kw["messages"], {"role": "assistant", "content": msg.content},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": [{"type": "text", "text": "12:00"}]}]}])
    assert follow.usage.output_tokens > 0


def anthropic_error(resp: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and all(w in body["error"]["message"] for w in words), body


def test_bad_requests_get_anthropic_errors(server, reference, client):
    ok = {"model": reference["name"], "max_tokens": 4, "messages": MESSAGES}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as h:
        for path, body, words in [
            ("/v1/messages", {k: v for k, v in ok.items() if k != "max_tokens"}, ("missing", "max_tokens")),
            ("/v1/messages", {**ok, "messages": [{"role": "user", "content": [image]}]}, ("image",)),
            ("/v1/messages", {**ok, "bogus": 1}, ("bogus",)),
            ("/v1/messages", {**ok, "thinking": {"type": "enabled", "budget_tokens": 1024}}, ("thinking",)),
            ("/v1/messages", {**ok, "max_tokens": 10 ** 7}, ("max_tokens",)),
            ("/v1/messages", {**ok, "tool_choice": {"type": "any"}}, ("tool_choice",)),
            ("/v1/messages/count_tokens", ok, ("max_tokens",)),
        ]:
            anthropic_error(h.post(path, json=body), 400, "invalid_request_error", *words)
        anthropic_error(h.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error", "JSON")
        huge = {**ok, "system": "a" * (8 << 20)}
        anthropic_error(h.post("/v1/messages", json=huge), 413, "request_too_large", "larger than the limit")
        anthropic_error(h.post("/v1/messages", json={**ok, "tools": [{"type": "web_search_20250305",
                                                                       "name": "web_search"}]}),
                        400, "invalid_request_error", "tools[0].type", "web_search_20250305")
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {**ok, "model": "claude-nope"} if path == "/v1/messages" else \
                {"model": "claude-nope", "messages": MESSAGES}
            anthropic_error(h.post(path, json=body), 404, "not_found_error", "claude-nope")
        # the OpenAI routes keep OpenAI's shape
        r = h.post("/v1/chat/completions", json={"model": "claude-nope", "messages": MESSAGES})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=reference["name"], max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=MESSAGES)


def test_disconnect_mid_stream_aborts(server, reference):
    body = {"model": reference["name"], "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]}
    assert_leaving_aborts(server, reference["name"], "/v1/messages", body, "event: content_block_delta")



def test_assistant_prefill_is_continued(client, server, reference):
    """A final assistant turn is a prefill: the prompt ends inside it (no new turn), as /tokenize renders it with
    continue_final_message."""
    convo = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    n = client.messages.count_tokens(model=reference["name"], system=SYSTEM, messages=convo).input_tokens
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as h:
        ids = h.post("/tokenize", json={"messages": [{"role": "system", "content": SYSTEM}, *convo],
                                        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert n == ids["count"] < len(reference["chat"].prompt_token_ids) + 8
    msg = client.messages.create(model=reference["name"], system=SYSTEM, messages=convo, max_tokens=4,
                                 extra_body=GREEDY)
    assert msg.usage.input_tokens == n and msg.content and msg.content[0].text


def test_mapping_onto_the_chat_request():
    """Without a server: system, tool_use and tool_result blocks become the chat route's messages; tool_choice
    maps onto OpenAI's; a Hermes tool call parses into a tool_use block; refused blocks name themselves."""
    from tandem.server import tools
    from tandem.server.anthropic_api import AnthropicServer
    from tandem.server.anthropic_protocol import MessagesRequest
    from tandem.server.generation import Streamed
    from tandem.server.protocol import APIError
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S"}], "stop_sequences": ["x"],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_time",
                                                        "input": {"zone": "utc"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "9",
                                                   "is_error": True}, {"type": "text", "text": "and?"}]}],
        "tools": [TIME], "tool_choice": {"type": "tool", "name": "get_time"}})
    chat = body.to_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2].content is None and chat.messages[2].model_extra["tool_calls"][0]["function"] == \
        {"name": "get_time", "arguments": '{"zone": "utc"}'}
    assert chat.messages[3].content == "Error: 9" and chat.messages[3].model_extra["tool_call_id"] == "toolu_1"
    assert chat.stop == ["x"] and chat.max_tokens == 5 and chat.add_generation_prompt
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    auto = tools.plan(chat.tools, "auto")
    out = Streamed(text='Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>')
    out.finish(auto, "stop")
    text, uses = out.content, AnthropicServer._finish(out)
    assert text == "Sure." and [(u["type"], u["name"], u["input"]) for u in uses] == \
        [("tool_use", "get_time", {"zone": "cet"})]
    for block, words in [({"type": "document", "source": {}}, "document"),
                         ({"type": "tool_result", "tool_use_id": "a"}, "user messages")]:
        bad = body.model_copy(update={"messages": [MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 1, "messages": [{"role": "assistant", "content": [block]}]}).messages[0]]})
        with pytest.raises(APIError) as e:
            bad.to_chat()
        assert words in e.value.message and e.value.param == "messages[0].content[0]"


def test_engine_failure_is_an_api_error(server, reference, tmp_path):
    """A request the engine fails (an injected fault, keyed on its prompt's first ids: a system prompt no other
    request has) is a 500 api_error, or an `error` event mid-stream; the next request is served."""
    faulty = [{"role": "system", "content": "Fault now."}, *MESSAGES]
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as h:
        ids = h.post("/tokenize", json={"messages": faulty}).json()["tokens"][:6]
    srv = ServerProcess(["--kv-cache-tokens", str(KV)], str(tmp_path / "server.log"),
                        env={"TANDEM_INJECT_FAULT": "process:" + ",".join(map(str, ids))})
    try:
        body = {"model": reference["name"], "max_tokens": 4, "system": "Fault now.", "messages": MESSAGES}
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as h:
            anthropic_error(h.post("/v1/messages", json=body), 500, "api_error", "engine failed")
            text = h.post("/v1/messages", json={**body, "stream": True}).text
            assert text.startswith("event: message_start") and "event: error\ndata: " in text, text
            assert "message_stop" not in text and '"type": "api_error"' in text, text
            ok = h.post("/v1/messages", json={**body, "system": SYSTEM})
            assert ok.status_code == 200 and ok.json()["content"], ok.text
    finally:
        assert srv.stop() == 0, srv.log()
