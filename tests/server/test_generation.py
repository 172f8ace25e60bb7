"""The one generation core (tandem/server/generation.py) under every route, without an engine: a scripted
client hands out token ids a few at a time. A chat stream's pieces over n choices (reasoning, content, tool
calls) add up to the non-streamed answer; an engine failure mid-stream ends chat, Messages and Responses streams
in each API's error event, and every request of a response is aborted however it ends; embeddings map an engine
failure as the generation routes do."""
from __future__ import annotations

import asyncio
import json

import pytest

OUTPUTS = ['<think>let me see</think>\n\nIt is <tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}'
           '</tool_call>', "<think>hm</think>\n\nNo tool needed here."]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}


class ScriptedClient:
    """A ReplicaSet's surface: sample k of a response writes OUTPUTS[k % 2], in pieces of 1-3 tokens; a prompt
    that says FAIL fails on its third step (503 where it says QUEUE)."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.aborted = tokenizer, []

    def refusal(self):
        return None

    async def submit(self, rid, ids, params, arrival):
        from tandem.replicas.engine_client import RequestStream
        st = RequestStream(rid, arrival, asyncio.get_running_loop().create_future())
        st.prompt, st.embed = self.tok.decode(ids), params.get("embed")
        return st

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def outputs(self, st):
        from tandem.request import StepOutput
        if "FAIL" in st.prompt:
            yield StepOutput(st.rid, [1], num_output_tokens=1)
            yield StepOutput(st.rid, [], True, "error", error="boom",
                             error_status=503 if "QUEUE" in st.prompt else None)
            return
        if st.embed:
            yield StepOutput(st.rid, [], True, "stop", embedding=b"\0" * 16)
            return
        sample = int(st.rid.rsplit("-", 1)[1]) if st.rid.count("-") > 1 else 0
        ids = self.tok.encode(OUTPUTS[sample % 2], add_special_tokens=False)
        i = k = 0
        while i < len(ids):
            new, i, k = ids[i:i + 1 + k % 3], i + 1 + k % 3, k + 1
            await asyncio.sleep(0)
            yield StepOutput(st.rid, new, i >= len(ids), "stop" if i >= len(ids) else None,
                             num_output_tokens=min(i, len(ids)))


@pytest.fixture(scope="module")
def app(tiny_llama):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer
    from tandem.server.frontend import Frontend
    from tandem.server.limits import ServerLimits
    from tandem.server.metrics import ServerMetrics
    from tandem.server.openai_api import build_app
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    client = ScriptedClient(tok)
    fe = Frontend(tok, 2048, len(tok))
    with TestClient(build_app(client, fe, "tiny", ServerMetrics("tiny", None), ServerLimits(1 << 20), None, "qwen3"),
                    raise_server_exceptions=False) as http:
        yield http, client
    fe.close()


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_chat_stream_adds_up_to_the_whole_answer(app):
    http, client = app
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2, "tools": [TIME]}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"]
    client.aborted.clear()
    text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert text.endswith("data: [DONE]\n\n") and len(client.aborted) == 2
    for choice in whole:
        deltas = [e["choices"][0] for e in _events(text)
                  if e["choices"] and e["choices"][0]["index"] == choice["index"]]
        got = {k: "".join(d["delta"].get(k) or "" for d in deltas) for k in ("reasoning_content", "content")}
        msg = choice["message"]
        # the stream sends the content before a tool call as it comes; the whole answer strips it
        assert got["reasoning_content"] == msg["reasoning_content"], (got, msg)
        assert got["content"].strip() == (msg["content"] or ""), (got, msg)
        calls = [c["function"] for d in deltas for c in d["delta"].get("tool_calls", [])]
        assert calls == [c["function"] for c in msg.get("tool_calls", [])]
        assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    assert {c["finish_reason"] for c in whole} == {"tool_calls", "stop"}
    assert whole[0]["message"]["reasoning_content"] == "let me see" and whole[0]["message"]["content"] == "It is"


@pytest.mark.parametrize("path, body, event", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL"}]}, 'engine failed'),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "FAIL"}]}, "event: error\n"),
    ("/v1/responses", {"input": "FAIL"}, "event: response.failed\n"),
])
def test_a_failure_mid_stream_ends_in_the_routes_error_event(app, path, body, event):
    http, client = app
    client.aborted.clear()
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 500 and len(client.aborted) == 1, r.text
    client.aborted.clear()
    text = http.post(path, json={"model": "tiny", "stream": True, **body}).text
    assert event in text and len(client.aborted) == 1, text


def test_embeddings_map_engine_failures_as_generation_does(app):
    http, client = app
    assert http.post("/v1/embeddings", json={"model": "tiny", "input": ["a", "b"]}).status_code == 200
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": ["a", "FAIL QUEUE"]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "503", r.text
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": "FAIL"})
    assert r.status_code == 500 and "engine failed" in r.json()["error"]["message"], r.text
