"""The server on the real default model (SmolLM2-135M-Instruct): chat and completions through the official
openai client, streamed and not, equal to the offline LLM's greedy output.
"""
from __future__ import annotations

import httpx
import pytest

from tests.helpers.server_utils import default_model_server

KV = 4096
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference():
    from tandem import LLM, SamplingParams
    llm = LLM(None, kv_cache_tokens=KV)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        return {"chat": llm.chat(CHAT, greedy, use_tqdm=False)[0],
                "completion": llm.generate([PROMPT], greedy, use_tqdm=False)[0],
                "name": llm.engine.model_name}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def server(reference, tmp_path_factory):
    yield from default_model_server(tmp_path_factory, KV)


def test_real_model_chat_and_completion(server, reference):
    client = server.openai_client()
    name = client.models.list().data[0].id
    assert name == reference["name"]

    ref = reference["chat"]
    out = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == ref.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    stream = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text

    ref = reference["completion"]
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == ref.text
    stream = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == ref.text
    client.close()


def test_tokenize_and_detokenize(server, reference):
    """vLLM's /tokenize and /detokenize: a prompt's ids are the ones /v1/completions generates from, chat messages'
    the ones /v1/chat/completions does; the ids read back as the text; bad requests are clear 400s / a 404."""
    c = httpx.Client(base_url=server.url, trust_env=False, timeout=60)
    chat = c.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    ids = reference["chat"].prompt_token_ids
    assert chat["tokens"] == ids and chat["count"] == len(ids) and chat["max_model_len"] > 0
    assert len(chat["token_strs"]) == len(ids) and all(isinstance(s, str) for s in chat["token_strs"])
    plain = c.post("/tokenize", json={"prompt": PROMPT, "model": reference["name"]}).json()
    assert plain["tokens"] == reference["completion"].prompt_token_ids and plain["token_strs"] is None
    assert c.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": PROMPT}
    no_gen = c.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == ids[:no_gen["count"]] and no_gen["count"] < len(ids)
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ]:
        r = c.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = c.post("/tokenize", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    c.close()
