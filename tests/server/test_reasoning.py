"""Reasoning parsers (tandem/server/reasoning.py, --reasoning-parser): <think> text into reasoning_content.

The splitter on scripted outputs fed in every two pieces and one character at a time gives the whole text's
split (tags cut across pieces, whitespace before the tag, a prompt that opens the thinking, a missing end, a
lookalike tag); through `tandem serve` with the openai client, a stream's reasoning and content deltas add up
to the non-streamed message."""
from __future__ import annotations

import pytest

from tandem.server.reasoning import ReasoningSplitter, split

CASES = [
    ("qwen3", "user: hi", "<think>let me see\nok</think>\n\nThe answer.", ("let me see\nok", "The answer.")),
    ("qwen3", "user: hi", "  <think>a</think>b", ("a", "b")),
    ("qwen3", "user: hi", "Plain answer, no thinking.", (None, "Plain answer, no thinking.")),
    ("qwen3", "user: hi", "<thinking> is not the tag", (None, "<thinking> is not the tag")),
    ("qwen3", "assistant:\n<think>\n", "reasons</think>\nAnswer", ("reasons", "Answer")),
    ("qwen3", "user: hi", "<think>cut off by max_tokens </thi", ("cut off by max_tokens </thi", "")),
    ("qwen3", "user: hi", "<thi", (None, "<thi")),
    ("deepseek_r1", "user: hi", "thinking without an end", ("thinking without an end", "")),
    ("deepseek_r1", "user: hi", "<think>x</think>y</think>z", ("x", "y</think>z")),
    ("deepseek_r1", "user: hi", "a</think>\n\n\nb\n", ("a", "b\n")),
    ("deepseek_r1", "user: hi", "\n <think>r</think>c", ("r", "c")),
]


def _streamed(parser, prompt, pieces):
    s = ReasoningSplitter.for_prompt(parser, prompt)
    r = c = ""
    for p in pieces:
        dr, dc = s.feed(p)
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    return (r + dr if s.thought else None), c + dc


@pytest.mark.parametrize("parser,prompt,text,want", CASES)
def test_whole_and_every_cut_agree(parser, prompt, text, want):
    assert split(parser, prompt, text) == want
    assert _streamed(parser, prompt, list(text)) == want
    for i in range(len(text) + 1):
        assert _streamed(parser, prompt, [text[:i], text[i:]]) == want, i


def test_reasoning_sent_back_is_the_turns_reasoning_content():
    """A reasoning item (Responses) or thinking block (Messages) sent back with the conversation becomes the
    assistant turn's reasoning_content, which the chat template renders or drops as the model's own does."""
    from tandem.server.anthropic_protocol import MessagesRequest
    from tandem.server.protocol import APIError
    from tandem.server.responses_protocol import ResponsesRequest
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "1"}]
    chat = ResponsesRequest.model_validate({"model": "m", "input": items}).to_chat()
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].model_extra["reasoning_content"] == "hm"
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "a"}]},
        {"role": "user", "content": "more"}]
    chat = MessagesRequest.model_validate({"model": "m", "max_tokens": 2, "messages": turns}).to_chat()
    assert chat.messages[1].content == "a" and chat.messages[1].model_extra["reasoning_content"] == "hm"
    turns[0]["content"] = [{"type": "thinking", "thinking": "x"}]
    with pytest.raises(APIError, match="belong to assistant"):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 2, "messages": turns}).to_chat()


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningSplitter.for_prompt("o1", "")


@pytest.fixture(scope="module")
def r1_server(tiny_llama, tmp_path_factory):
    """`tandem serve --reasoning-parser deepseek_r1` on the tiny model, which never writes </think>: every output
    token is reasoning."""
    from tests.helpers.server_utils import ServerProcess
    srv = ServerProcess(["--model", tiny_llama, "--served-model-name", "tiny", "--device-threads", "1",
                         "--reasoning-parser", "deepseek_r1"], str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def r1_client(r1_server):
    c = r1_server.openai_client(timeout=60)
    yield c
    c.close()


MSGS = [{"role": "user", "content": "think about it"}]


def test_server_splits_alike_streamed_and_not(r1_client):
    """Chat: the reasoning in reasoning_content, content empty; the stream's reasoning deltas add up to it."""
    whole = r1_client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10, temperature=0)
    m = whole.choices[0].message
    assert m.reasoning_content and not m.content
    reasoning = content = ""
    for chunk in r1_client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10, temperature=0,
                                                   stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
    assert (reasoning, content) == (m.reasoning_content, "")


def test_responses_give_a_reasoning_item(r1_client):
    """Responses: the thinking is a reasoning item (one reasoning_text part) counted in reasoning_tokens; the
    stream sends it with reasoning_text deltas, which the SDK's streaming helper accepts."""
    chat = r1_client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10, temperature=0)
    want = chat.choices[0].message.reasoning_content
    kw = dict(model="tiny", input=MSGS[0]["content"], max_output_tokens=10, temperature=0)
    r = r1_client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete", r
    assert r.output[0].content[0].text == want and r.output[0].summary == [] and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 10
    events = list(r1_client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"], types
    assert set(types[4:-4]) == {"response.reasoning_text.delta"}, types
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want
    final = events[-1].response
    assert final.output[0].content[0].text == want and final.usage.output_tokens_details.reasoning_tokens == 10
    with r1_client.responses.stream(**kw) as s:          # the SDK's accumulator takes the reasoning events
        assert [e.type for e in s][-1] == "response.incomplete"     # (get_final_response wants "completed")


def test_messages_give_a_thinking_block(r1_server, r1_client):
    """Messages: the thinking is a thinking block, streamed as thinking_delta in a thinking content block."""
    import anthropic
    want = r1_client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10,
                                             temperature=0).choices[0].message.reasoning_content
    c = anthropic.Anthropic(base_url=r1_server.url, api_key="none", max_retries=0, timeout=60,
                            http_client=anthropic.DefaultHttpxClient(trust_env=False))
    try:
        kw = dict(model="tiny", messages=MSGS, max_tokens=10, extra_body={"temperature": 0})
        m = c.messages.create(**kw)
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == want, m
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 10
        with c.messages.stream(**kw) as s:
            events = list(s)
            final = s.get_final_message()
        assert final.content[0].type == "thinking" and final.content[0].thinking == want
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert {d.type for d in deltas} == {"thinking_delta"} and "".join(d.thinking for d in deltas) == want
    finally:
        c.close()


def test_a_grammar_leaves_the_thinking_free(r1_client):
    """The grammar starts after the reasoning (tandem/grammar/after_reasoning.py): the tiny model never ends its
    thinking, so a JSON constraint leaves its reasoning exactly the unconstrained one, on chat and Responses."""
    kw = dict(model="tiny", messages=MSGS, max_tokens=10, temperature=0)
    free = r1_client.chat.completions.create(**kw).choices[0].message
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}):
        m = r1_client.chat.completions.create(**kw, response_format=fmt).choices[0].message
        assert (m.reasoning_content, m.content) == (free.reasoning_content, ""), fmt
    r = r1_client.responses.create(model="tiny", input=MSGS[0]["content"], max_output_tokens=10, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert r.output[0].content[0].text == free.reasoning_content
