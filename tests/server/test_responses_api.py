"""OpenAI's Responses API on the real default model (SmolLM2-135M-Instruct), through the official openai client:
responses.create and its stream equal the offline LLM's greedy chat output, with OpenAI's event order; tool_choice
required / named give function_call items whose arguments fit the schema, and the calls go back as input items;
text.format json_schema output parses; max_output_tokens gives status incomplete; bad requests get OpenAI-shaped
errors naming the Responses field; a client that leaves mid-stream aborts its request.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.server_utils import (ServerProcess, assert_error, assert_leaving_aborts,
                                        default_model_server, offline_greedy_chat)

KV = 4096
SYSTEM = "You are a helpful assistant. Answer briefly."
USER = "What is the capital of France?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
MAX_TOKENS = 12
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                          "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def reference():
    return offline_greedy_chat(CHAT, MAX_TOKENS, KV)


@pytest.fixture(scope="module")
def server(reference, tmp_path_factory):
    yield from default_model_server(tmp_path_factory, KV)


@pytest.fixture(scope="module")
def client(server):
    c = server.openai_client()
    yield c
    c.close()


def test_create_and_stream_equal_offline_greedy(client, reference):
    ref, name = reference["chat"], reference["name"]
    kw = dict(model=name, instructions=SYSTEM, input=USER, max_output_tokens=MAX_TOKENS, temperature=0,
              metadata={"k": "v"}, store=False)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == name and r.output_text == ref.text
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed"), r
    assert [o.type for o in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == SYSTEM and r.metadata == {"k": "v"} and r.max_output_tokens == MAX_TOKENS
    # the same conversation as input items (a developer message is a system message)
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}]
    assert client.responses.create(**{**kw, "instructions": None, "input": items}).output_text == ref.text

    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    end = "response.incomplete" if r.status == "incomplete" else "response.completed"
    assert types[:4] == TEXT_EVENTS and types[-4:] == [*TEXT_END, end], types
    assert set(types[4:-4]) == {"response.output_text.delta"}, types
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ref.text
    final = events[-1].response
    assert final.output_text == ref.text and final.usage.output_tokens == r.usage.output_tokens
    with client.responses.stream(**kw) as s:          # the SDK's accumulating helper
        assert s.get_final_response().output_text == ref.text


def test_max_output_tokens_is_incomplete(client, reference):
    kw = dict(model=reference["name"], input=USER, max_output_tokens=2, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"
    last = list(client.responses.create(**kw, stream=True))[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_constrained_function_call(client, reference, choice, stream):
    kw = dict(model=reference["name"], input="Weather in Paris?", tools=[WEATHER, TIME], tool_choice=choice,
              max_output_tokens=80, temperature=0)
    if stream:
        events = list(client.responses.create(**kw, stream=True))
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed", types
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed", r
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        assert c.id.startswith("fc_") and c.call_id and c.name in schemas
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])
    if choice != "required":
        assert [c.name for c in calls] == ["get_time"]
    assert r.tool_choice == choice or r.tool_choice.name == "get_time"
    # the calls go back with their output: the conversation renders and generates
    follow = client.responses.create(model=reference["name"], tools=[WEATHER, TIME], max_output_tokens=4,
                                     temperature=0, input=[{"role": "user", "content": "Weather in Paris?"},
                                                           *r.output,     # the SDK's own output objects
                                                           {"type": "function_call_output",
                                                            "call_id": calls[0].call_id, "output": "12:00"}])
    assert follow.usage.output_tokens > 0 and follow.output_text is not None


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema(client, reference, stream):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    kw = dict(model=reference["name"], input="Is Paris in France? Answer as JSON.", temperature=0,
              max_output_tokens=40, text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                     "strict": True}})
    r = list(client.responses.create(**kw, stream=True))[-1].response if stream else client.responses.create(**kw)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_bad_requests_get_openai_errors(server, reference, client):
    ok = {"model": reference["name"], "input": USER, "max_output_tokens": 4}
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as h:
        for body, param, words in [
            ({**ok, "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
            ({**ok, "bogus": 1}, "bogus", "unrecognized"),
            ({**ok, "tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
            ({**ok, "input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "input_image"),
            ({**ok, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
             "input[0].content[0].type", "input_text"),
            ({**ok, "reasoning": {"effort": "low"}}, "reasoning.effort", "does not read reasoning_effort"),
            ({**ok, "reasoning": {"summary": "auto"}}, "reasoning.summary", "reasoning.summary"),
            ({**ok, "truncation": "auto"}, "truncation", "disabled"),
            ({**ok, "max_output_tokens": 10 ** 7}, "max_output_tokens", "context length"),
            ({**ok, "tool_choice": "required"}, "tool_choice", "tools"),
            ({**ok, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
            ({k: v for k, v in ok.items() if k != "input"}, "input", "missing"),
        ]:
            err = assert_error(h.post("/v1/responses", json=body), 400, param)
            assert err["type"] == "invalid_request_error" and words in err["message"], err
        err = assert_error(h.post("/v1/responses", json={**ok, "model": "gpt-nope"}), 404, "model")
        assert err["code"] == "model_not_found" and "gpt-nope" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**ok, previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**{**ok, "model": "gpt-nope"})


def test_mapping_onto_the_chat_request():
    """Without a server: instructions, message items (developer as system), function_call items (joining the
    assistant turn before them) and function_call_output items become the chat route's messages; flat tools, the
    named tool choice and text.format map onto the chat route's; parallel_tool_calls=false keeps one call."""
    from tandem.server import tools
    from tandem.server.generation import Streamed
    from tandem.server.protocol import APIError
    from tandem.server.responses_api import ResponsesServer
    from tandem.server.responses_protocol import ResponsesRequest, param_name
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "S", "max_output_tokens": 5, "parallel_tool_calls": False,
        "input": [{"role": "developer", "content": "D"}, {"role": "user", "content": "hi"},
                  {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                   "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "utc"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": "9"}],
        "tools": [TIME], "tool_choice": {"type": "function", "name": "get_time"},
        "text": {"format": {"type": "json_object"}}})
    chat = body.to_chat()
    assert [m.role for m in chat.messages] == ["system", "system", "user", "assistant", "tool"]
    assert chat.messages[3].content == "Let me see." and chat.messages[3].model_extra["tool_calls"] == \
        [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]
    assert chat.messages[4].content == "9" and chat.messages[4].model_extra["tool_call_id"] == "call_1"
    assert chat.max_tokens == 5 and chat.tools[0]["function"]["name"] == "get_time"
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert chat.response_format.type == "json_object"
    auto = tools.plan(chat.tools, "auto")
    two = '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>' * 2
    out = Streamed(text=two)
    out.finish(auto, "stop")
    assert len(ResponsesServer._finish(body, out)) == 1
    assert param_name("max_tokens") == "max_output_tokens" and param_name("messages[2].content") == "input"
    for extra, param in [({"tools": [{"type": "file_search"}]}, "tools[0].type"),
                         ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
                          "input[0].encrypted_content"),
                         ({"input": [{"type": "function_call_output", "call_id": "a"}]}, "input[0].output")]:
        with pytest.raises(APIError) as e:
            ResponsesRequest.model_validate({"model": "m", "input": "x", **extra}).to_chat()
        assert e.value.status == 400 and e.value.param == param, e.value.message


def test_disconnect_mid_stream_aborts(server, reference):
    body = {"model": reference["name"], "max_output_tokens": 2000, "temperature": 0, "stream": True,
            "input": "Count from 1 to 1000, one number per line."}
    assert_leaving_aborts(server, reference["name"], "/v1/responses", body, "event: response.output_text.delta")


def test_engine_failure_is_an_error(server, reference, tmp_path):
    """A request the engine fails (an injected fault keyed on its prompt's first ids) is a 500 in OpenAI's shape,
    or an `error` event then `response.failed` mid-stream; the next request is served."""
    faulty = [{"role": "system", "content": "Fault now."}, {"role": "user", "content": USER}]
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as h:
        ids = h.post("/tokenize", json={"messages": faulty}).json()["tokens"][:6]
    srv = ServerProcess(["--kv-cache-tokens", str(KV)], str(tmp_path / "server.log"),
                        env={"TANDEM_INJECT_FAULT": "process:" + ",".join(map(str, ids))})
    try:
        body = {"model": reference["name"], "max_output_tokens": 4, "instructions": "Fault now.", "input": USER}
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as h:
            err = assert_error(h.post("/v1/responses", json=body), 500)
            assert "engine failed" in err["message"]
            text = h.post("/v1/responses", json={**body, "stream": True}).text
            assert text.startswith("event: response.created") and "event: error\ndata: " in text, text
            assert "event: response.failed" in text and "response.completed" not in text, text
            ok = h.post("/v1/responses", json={**body, "instructions": SYSTEM})
            assert ok.status_code == 200 and ok.json()["output"], ok.text
    finally:
        assert srv.stop() == 0, srv.log()
