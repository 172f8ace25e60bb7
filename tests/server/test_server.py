"""The OpenAI-compatible server on a tiny model: a real `tandem serve` process, real clients (openai, httpx).

Greedy outputs are compared with the offline LLM on the same weights; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.helpers.server_utils import assert_error, sse_events

KV = "8192"
PROMPTS = [f"Request {i}: the quick brown fox" + " jumps over" * (i % 5) for i in range(32)]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about tandem bikes."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def reference(model_dir):
    """Offline greedy outputs: the 32 prompts, one longer run (for stop strings) and the chat."""
    from tandem import LLM, SamplingParams
    llm = LLM(model_dir, kv_cache_tokens=int(KV), device_threads=1)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        long = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)[0]
        chat = llm.chat(CHAT, greedy, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return {"outs": outs, "long": long, "chat": chat}


def test_models_and_health(server):
    assert server.http.get("/health").status_code == 200
    models = server.http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 512


def test_completion_stream_equals_nonstream_and_offline(client, reference):
    ref = reference["outs"][0]
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompt(client, reference):
    ref = reference["outs"][3]
    out = client.completions.create(model="tiny", prompt=ref.prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == ref.text


def test_chat_stream_equals_nonstream_and_offline(client, reference):
    ref = reference["chat"]
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_string_is_held_back_in_stream(client, reference):
    text = reference["long"].text
    k = len(text) // 2
    stop = text[k:k + 3]
    expected = text[:text.find(stop)]
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    deltas = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
    assert "".join(deltas) == expected
    assert all(stop not in d for d in deltas)


def test_32_concurrent_streams_match_offline(server, reference):
    async def one(c: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120,
                                      http_client=httpx.AsyncClient(trust_env=False)) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in PROMPTS)), 300)

    results = asyncio.run(run())
    assert results == [(r.text, r.finish_reason) for r in reference["outs"]]


def test_disconnect_mid_stream_frees_kv(server):
    aborted = server.metrics().get('tandem:request_success_total{finished_reason="abort",model_name="tiny"}', 0.0)
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as h:
        with h.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            got = 0
            for line in resp.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break                      # leave mid-stream: closing the connection aborts the request
    server.wait_metric('tandem:request_success_total{finished_reason="abort",model_name="tiny"}',
                       lambda v: v == aborted + 1)
    assert server.wait_metric("tandem:kv_cache_usage_perc", lambda v: v == 0.0) == 0.0
    assert server.wait_metric("tandem:num_requests_running", lambda v: v == 0.0) == 0.0


def test_metrics_names(server):
    text = server.http.get("/metrics").text
    for name in ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
                 "tandem:prompt_tokens_total", "tandem:generation_tokens_total",
                 "tandem:time_to_first_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
                 "tandem:device_idle_fraction"):
        assert name in text, name
    m = server.metrics()
    assert m["tandem:generation_tokens_total"] > 0 and m["tandem:prompt_tokens_total"] > 0
    assert 0.0 <= m["tandem:device_idle_fraction"] <= 1.0


def test_prefix_cache_usage_and_counters(client, server):
    prompt = "A prompt long enough to be worth caching, said twice " * 3
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1   # last one computed
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    m = server.metrics()
    assert m["tandem:prefix_cache_hits_total"] >= again.usage.prompt_tokens - 1
    assert m["tandem:prefix_cache_queries_total"] >= m["tandem:prefix_cache_hits_total"]


CMPL, CHAT_URL = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
BAD = [  # (id, path, raw body or dict, param)
    ("malformed-json", CMPL, '{"prompt": "a", ', None),
    ("not-an-object", CMPL, "[1, 2]", None),
    ("missing-prompt", CMPL, {"model": "tiny"}, "prompt"),
    ("missing-messages", CHAT_URL, {"model": "tiny"}, "messages"),
    ("empty-messages", CHAT_URL, {"messages": []}, "messages"),
    ("message-content-type", CHAT_URL, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("prompt-type", CMPL, {"prompt": 5}, "prompt"),
    ("temperature-type", CMPL, {**OK, "temperature": "hot"}, "temperature"),
    ("max-tokens-type", CMPL, {**OK, "max_tokens": "5"}, "max_tokens"),
    ("stream-type", CMPL, {**OK, "stream": "yes"}, "stream"),
    ("stop-type", CMPL, {**OK, "stop": 5}, "stop"),
    ("temperature-range", CMPL, {**OK, "temperature": -1}, "temperature"),
    ("top-p-zero", CMPL, {**OK, "top_p": 0}, "top_p"),
    ("top-p-range", CMPL, {**OK, "top_p": 1.5}, "top_p"),
    ("top-k-range", CMPL, {**OK, "top_k": -5}, "top_k"),
    ("min-p-range", CMPL, {**OK, "min_p": 2}, "min_p"),
    ("max-tokens-zero", CMPL, {**OK, "max_tokens": 0}, "max_tokens"),
    ("max-tokens-negative", CMPL, {**OK, "max_tokens": -3}, "max_tokens"),
    ("huge-max-tokens", CMPL, {**OK, "max_tokens": 10 ** 9}, "max_tokens"),
    ("giant-max-tokens", CMPL, {**OK, "max_tokens": 10 ** 30}, "max_tokens"),
    ("chat-huge-max-tokens", CHAT_URL, {"messages": CHAT, "max_tokens": 10 ** 9}, "max_tokens"),
    ("stop-token-id-negative", CMPL, {**OK, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop-token-id-vocab", CMPL, {**OK, "stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ("seed-too-big", CMPL, {**OK, "seed": 2 ** 70}, "seed"),
    ("empty-prompt", CMPL, {**OK, "prompt": ""}, "prompt"),
    ("token-id-out-of-vocab", CMPL, {**OK, "prompt": [1, 10 ** 6]}, "prompt"),
    ("token-id-negative", CMPL, {**OK, "prompt": [-1]}, "prompt"),
    ("n-zero", CMPL, {**OK, "n": 0}, "n"),
    ("n-too-many", CMPL, {**OK, "n": 129}, "n"),
    ("best-of-not-n", CMPL, {**OK, "n": 2, "best_of": 3}, "best_of"),
    ("empty-second-prompt", CMPL, {**OK, "prompt": ["a", ""]}, "prompt[1]"),
    ("token-id-out-of-vocab-in-batch", CMPL, {**OK, "prompt": [[1, 2], [10 ** 6]]}, "prompt[1]"),
    ("over-long-prompt", CMPL, {**OK, "prompt": "hello " * 2000}, "prompt"),
    ("over-long-token-prompt", CMPL, {**OK, "prompt": [42] * 600}, "prompt"),
    ("over-long-chat", CHAT_URL, {"messages": [{"role": "user", "content": "hi " * 2000}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gives_400_then_normal_request_works(server, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    resp = server.http.post(path, content=content, headers={"content-type": "application/json"})
    assert_error(resp, 400, param)
    ok = server.http.post(CMPL, json=OK)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path,body", [(CMPL, {**OK, "model": "gpt-4"}),
                                       (CHAT_URL, {"model": "gpt-4", "messages": CHAT})])
def test_unknown_model_is_404_model_not_found(server, path, body):
    assert assert_error(server.http.post(path, json=body), 404, "model")["code"] == "model_not_found"


def test_unknown_route_is_404_in_error_shape(server):
    assert_error(server.http.get("/v1/nothing"), 404)


def test_stream_events_are_well_formed(server):
    body = {**OK, "max_tokens": 5, "stream": True}
    with server.http.stream("POST", CMPL, json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_list_of_prompts_answers_one_choice_per_prompt_in_order(client, reference):
    refs = reference["outs"][:5]
    out = client.completions.create(model="tiny", prompt=PROMPTS[:5], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in out.choices] == list(range(5))
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[:5], max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(5)]
    assert texts == [r.text for r in refs]


def test_n_samples_are_distinct_and_reproducible(client):
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3
    assert a.usage.completion_tokens == 3 * MAX_TOKENS
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, seed=7, n=2,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    streamed = list(client.completions.create(stream=True, **kw))
    assert ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(3)] == \
        [c.text for c in a.choices]


def test_echo_prepends_the_prompt(client, reference):
    ref = reference["outs"][0]
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert out.choices[0].text == PROMPTS[0] + ref.text


def test_include_stop_str_in_output(client, reference):
    text = reference["long"].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop])
    out = client.completions.create(extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, **kw)
    assert out.choices[0].text == text[:text.find(stop) + len(stop)] and out.choices[0].finish_reason == "stop"


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
                                                                                   "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    import jsonschema
    kw = dict(model="tiny", messages=CHAT, max_tokens=40, seed=3, temperature=1.0,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        out = client.chat.completions.create(**kw)
        text, reason = out.choices[0].message.content, out.choices[0].finish_reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_choice_and_structured_outputs_on_completions(client):
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=1, n=3,
                                    extra_body={"guided_choice": ["red", "green"]})
    assert {c.text for c in out.choices} <= {"red", "green"} and all(c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(out.choices[0].text) == 4 and out.choices[0].text.isdigit()


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_structured_output_and_unsupported_fields_are_400(server, body, param):
    resp = server.http.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 4, **body})
    assert_error(resp, 400, param)
    assert server.http.post(CMPL, json=OK).status_code == 200


def test_logprobs_over_http_equal_offline(client, model_dir):
    from tandem import LLM, SamplingParams
    llm = LLM(model_dir, kv_cache_tokens=int(KV), device_threads=1)
    try:
        ref = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw).choices[0].logprobs
    assert out.token_logprobs == pytest.approx([d[t] for d, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4)
    assert all(len(top) == 2 for top in out.top_logprobs) and out.text_offset[0] == 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [lp for s in streamed if s for lp in s.token_logprobs] == pytest.approx(out.token_logprobs, abs=1e-6)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(chat.content) == 4 and all(len(c.top_logprobs) == 3 for c in chat.content)
    assert all(c.logprob <= 0 for c in chat.content)


def test_echo_with_logprobs_scores_the_prompt(client, model_dir):
    from tandem import LLM, SamplingParams
    llm = LLM(model_dir, kv_cache_tokens=int(KV), device_threads=1)
    try:
        ref = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1,
                                                        ignore_eos=True), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    kw = dict(model="tiny", prompt=PROMPTS[3], max_tokens=3, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw).choices[0]
    n = len(ref.prompt_token_ids)
    assert out.text.startswith(PROMPTS[3])
    lps = out.logprobs.token_logprobs
    assert len(lps) == n + 3 and lps[0] is None and out.logprobs.top_logprobs[0] is None
    expected = [d[t] for d, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])]
    assert lps[1:n] == pytest.approx(expected, abs=1e-4)
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [lp for s in streamed if s for lp in s.token_logprobs] == pytest.approx(lps, abs=1e-6)
