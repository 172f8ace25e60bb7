"""`tandem serve --model PATH` on the new architectures: a base model (no chat template: tiny Gemma 3 as a GGUF
and as safetensors) answers /v1/completions with the offline greedy output and refuses /v1/chat/completions with
a clear 400 that says what to do; a model whose file carries a chat template (tiny Qwen3) chats with it."""
from __future__ import annotations

import glob
import json
import os

import httpx
import pytest

from tests.helpers.server_utils import ServerProcess, assert_error
from tests.helpers.tiny_models import make_tiny_model

PROMPT = "The three primary colors are"


def strip_chat_template(d: str) -> str:
    """A base model's folder: its tokenizer files carry no chat template."""
    for p in glob.glob(os.path.join(d, "chat_template.*")):
        os.remove(p)
    cfg = os.path.join(d, "tokenizer_config.json")
    with open(cfg) as f:
        c = json.load(f)
    c.pop("chat_template", None)
    with open(cfg, "w") as f:
        json.dump(c, f)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    return {"base": strip_chat_template(make_tiny_model(root / "gemma3", "gemma3", seed=31)),
            "chat": make_tiny_model(root / "qwen3", "qwen3", seed=32)}


def offline(path: str, chat: bool):
    from tandem import LLM, SamplingParams
    llm = LLM(path, kv_cache_tokens=2048, max_running_requests=4)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        if chat:
            return llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False)[0].text
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False)
        return llm.generate([PROMPT], greedy, use_tqdm=False)[0].text
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["base", "chat"])
def test_serve_model_path(kind, models, tmp_path):
    path = models[kind]
    ref = offline(path, chat=kind == "chat")
    srv = ServerProcess(["--model", path, "--kv-cache-tokens", "2048", "--device-threads", "1",
                         "--served-model-name", kind], str(tmp_path / "server.log"))
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as c:
            chat = c.post("/v1/chat/completions", json={"model": kind, "max_tokens": 6, "temperature": 0,
                                                        "ignore_eos": True,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
            if kind == "base":
                err = assert_error(chat, 400, "messages")
                assert "no chat template" in err["message"] and "/v1/completions" in err["message"]
                r = c.post("/v1/completions", json={"model": kind, "prompt": PROMPT, "max_tokens": 6,
                                                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == ref
            else:
                assert chat.status_code == 200, chat.text
                assert chat.json()["choices"][0]["message"]["content"] == ref
            assert c.get("/health").status_code == 200          # the refused request cost the engine nothing
    finally:
        assert srv.stop() == 0, srv.log()
