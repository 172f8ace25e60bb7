"""gpt-oss's harmony format on every chat route, through the official openai and anthropic SDKs: the app (the
gpt-oss parser chosen for a tokenizer that speaks harmony) over a scripted engine that writes harmony outputs
(tests/helpers/tiny_harmony.py) with the real tokenizer, so the text goes through detokenization with the special
tokens kept. A stream adds up to the whole answer; <|return|> and <|call|> stop the output, <|end|> does not;
reasoning_effort reaches the template; a tool-call history renders back in harmony; a structured output starts at
the final channel."""
from __future__ import annotations

import json

import pytest

from tests.helpers.tiny_harmony import ScriptedEngine, harmony_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def app():
    import anthropic
    import openai
    from fastapi.testclient import TestClient
    from tests.helpers.tiny_models import smollm2_tokenizer
    from tandem.server.cli import reasoning_parser
    from tandem.server.frontend import Frontend
    from tandem.server.limits import ServerLimits
    from tandem.server.metrics import ServerMetrics
    from tandem.server.openai_api import build_app
    tok = harmony_tokenizer(smollm2_tokenizer())
    engine, fe = ScriptedEngine(tok), Frontend(tok, 4096, len(tok))
    parser = reasoning_parser(None, tok)                   # chosen: the tokenizer and template speak harmony
    assert parser == "gpt-oss" and reasoning_parser(None, smollm2_tokenizer()) is None
    with TestClient(build_app(engine, fe, "oss", ServerMetrics("oss", None), ServerLimits(1 << 20), None, parser),
                    raise_server_exceptions=False) as http:
        yield (engine, http, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http),
               anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http))
    fe.close()


def _chat_stream(oai, **kw) -> tuple[str, str, list, str]:
    reasoning = content = ""
    calls, reason = [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        calls += [(c.function.name, c.function.arguments) for c in d.tool_calls or []]
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, content, calls, reason


def test_chat_reasoning_then_answer(app):
    engine, _, oai, _ = app
    kw = dict(model="oss", messages=user("hello"))
    m = oai.chat.completions.create(**kw).choices[0]
    assert (m.message.reasoning_content, m.message.content) == ("The user greets me. Greet back.",
                                                                "Hello! How can I help?")
    assert m.finish_reason == "stop" and m.message.tool_calls is None
    prompt, params = engine.requests[-1]
    assert prompt.endswith("<|start|>user<|message|>hello<|end|><|start|>assistant") and "Reasoning: medium" in prompt
    assert params["skip_special_tokens"] is False        # the parser reads the markers
    assert _chat_stream(oai, **kw) == (m.message.reasoning_content, m.message.content, [], "stop")


@pytest.mark.parametrize("script,calls,content", [
    ("weather", [("get_weather", '{"city": "Paris"}')], None),      # <|call|> stops it: nothing after is read
    ("time", [("get_time", '{"zone": "cet"}')], "Let me look."),    # a preamble, then the call
])
def test_chat_tool_calls(app, script, calls, content):
    _, _, oai, _ = app
    kw = dict(model="oss", messages=user(script), tools=[WEATHER, TIME])
    m = oai.chat.completions.create(**kw).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content == content
    assert [(c.function.name, c.function.arguments) for c in m.message.tool_calls] == calls
    assert all(c.id.startswith("call_") for c in m.message.tool_calls)
    assert _chat_stream(oai, **kw) == (m.message.reasoning_content, content or "", calls, "tool_calls")


def test_cut_by_max_tokens(app):
    """<|end|> does not stop the output (it goes on into the answer); max_tokens cuts it, finish "length"."""
    from tests.helpers.tiny_harmony import SCRIPTS
    engine, _, oai, _ = app
    cut = len(engine.tok.encode(SCRIPTS["hello"].split(" How")[0], add_special_tokens=False))
    m = oai.chat.completions.create(model="oss", messages=user("hello"), max_tokens=cut).choices[0]
    assert m.finish_reason == "length" and m.message.reasoning_content == "The user greets me. Greet back."
    assert m.message.content == "Hello!"


def test_reasoning_effort_reaches_the_template(app):
    engine, http, oai, _ = app
    oai.chat.completions.create(model="oss", messages=user("hello"), reasoning_effort="high")
    assert "Reasoning: high" in engine.requests[-1][0]
    oai.responses.create(model="oss", input="hello", reasoning={"effort": "low"})
    assert "Reasoning: low" in engine.requests[-1][0]
    r = http.post("/v1/chat/completions", json={"messages": user("hello"), "reasoning_effort": "max"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    assert "'low', 'medium' or 'high'" in r.json()["error"]["message"]
    r = http.post("/v1/responses", json={"model": "oss", "input": "hello", "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text


def test_a_tool_history_renders_back_in_harmony(app):
    """The assistant's call (its arguments an object, its reasoning as `thinking`) and the tool's result."""
    engine, _, oai, _ = app
    msgs = user("weather") + [
        {"role": "assistant", "content": None, "reasoning_content": "Call it.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}] + user("hello")
    oai.chat.completions.create(model="oss", messages=msgs, tools=[WEATHER])
    prompt = engine.requests[-1][0]
    assert "<|start|>assistant<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions." \
           'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in prompt, prompt
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>' in prompt
    assert "type get_weather" in prompt


def test_structured_output_starts_at_the_final_channel(app):
    engine, http, oai, _ = app
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    m = oai.chat.completions.create(model="oss", messages=user("json"), response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).choices[0]
    assert json.loads(m.message.content) == {"answer": 42} and m.message.reasoning_content == "Answer in JSON."
    params = engine.requests[-1][1]
    assert engine.tok.decode(params["reasoning_end_ids"], skip_special_tokens=False) == "<|channel|>final<|message|>"
    assert params["reasoning_start_id"] is None
    r = http.post("/v1/chat/completions", json={"messages": user("hello"), "tools": [WEATHER],
                                                "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_responses_with_a_function_tool(app):
    _, _, oai, _ = app
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = oai.responses.create(model="oss", input="weather", tools=[tool], reasoning={"effort": "medium"})
    assert [o.type for o in r.output] == ["reasoning", "function_call"] and r.status == "completed", r
    assert r.output[0].content[0].text == "They want Paris's weather: call get_weather."
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == ("get_weather", {"city": "Paris"})
    assert r.reasoning.effort == "medium"
    events = list(oai.responses.create(model="oss", input="weather", tools=[tool], stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed" and [o.type for o in final.output] == ["reasoning", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == r.output[0].content[0].text
    assert final.output[1].arguments == r.output[1].arguments
    r = oai.responses.create(model="oss", input="hello")
    assert r.output_text == "Hello! How can I help?" and [o.type for o in r.output] == ["reasoning", "message"]


def test_messages_with_a_tool(app):
    _, _, _, ant = app
    tool = {"name": "get_time", "input_schema": TIME["function"]["parameters"]}
    kw = dict(model="oss", max_tokens=200, messages=user("time"), tools=[tool])
    m = ant.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use", m
    assert (m.content[0].thinking, m.content[1].text) == ("Need the time.", "Let me look.")
    assert (m.content[2].name, m.content[2].input) == ("get_time", {"zone": "cet"})
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.stop_reason == "tool_use"
    assert (final.content[0].thinking, final.content[1].text, final.content[2].input) == \
        ("Need the time.", "Let me look.", {"zone": "cet"})
    m = ant.messages.create(model="oss", max_tokens=20, messages=user("weather"), tools=[tool])
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["thinking"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tandem serve` on a tiny random model whose tokenizer and template speak harmony, no --reasoning-parser:
    the gpt-oss parser is chosen for it."""
    from tests.helpers.server_utils import ServerProcess
    from tests.helpers.tiny_harmony import make_harmony_model
    path = make_harmony_model(tmp_path_factory.mktemp("tiny-harmony"))
    srv = ServerProcess(["--model", path, "--served-model-name", "oss", "--kv-cache-tokens", "4096",
                         "--device-threads", "1"], str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


def test_the_engine_stops_at_return_and_call_not_at_end(served):
    """A logit bias makes the real engine write one marker over and over: <|return|> and <|call|> end the
    output at once, <|end|> (it only closes a message) runs to max_tokens; a structured output is free until
    the final channel's header, so tokens its grammar forbids are written before it."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(served.proc.args[served.proc.args.index("--model") + 1]).get_added_vocab()
    client = served.openai_client(timeout=60)
    try:
        for marker, n, reason in [("<|return|>", 1, "stop"), ("<|call|>", 1, "stop"), ("<|end|>", 4, "length")]:
            r = client.chat.completions.create(model="oss", messages=user("hi"), max_tokens=4, temperature=0,
                                               logit_bias={str(ids[marker]): 100})
            assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (n, reason), (marker, r)
            assert r.choices[0].message.content == "" and r.choices[0].message.tool_calls is None
        r = client.chat.completions.create(model="oss", messages=user("hi"), max_tokens=3, temperature=0,
                                           logit_bias={str(ids["<|channel|>"]): 100},
                                           response_format={"type": "json_object"})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length", r
    finally:
        client.close()
