"""/v1/embeddings through `tandem serve` with the official openai client: every input shape, float and base64 (the
same float32 bits), unit vectors, the usage, `pooling: "mean"` (the transformers model's mean hidden state);
OpenAI-shaped 400s for dimensions, an unknown pooling, unknown fields and bad inputs; on a quantized model (the
batch-invariant mode), the same vectors (last and mean pooling) alone and while other clients generate, and the
generated outputs unchanged by the embeddings beside them.
"""
from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import openai
import pytest

from tandem.kernels import available
from tests.helpers.server_utils import ServerProcess, assert_error
from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf

HIDDEN = 64         # the tiny Llama's hidden size (tests/helpers/tiny_models.py)
TEXTS = ["the quick brown fox", "a b c d e f g h i j k l m n o p", "z"]


def _unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    assert abs(np.linalg.norm(v) - 1) < 1e-5
    return v


def test_every_input_shape(client, server):
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    one = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == "tiny" and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0 and len(one.data[0].embedding) == HIDDEN
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])
    many = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    single_ids = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    for a, b in zip(many.data, by_ids.data):          # text and its token ids: the same prompt
        np.testing.assert_allclose(_unit(a.embedding), _unit(b.embedding), atol=1e-5)
    np.testing.assert_allclose(_unit(single_ids.data[0].embedding), _unit(many.data[1].embedding), atol=1e-5)
    np.testing.assert_allclose(_unit(one.data[0].embedding), _unit(many.data[0].embedding), atol=1e-5)
    assert not np.allclose(many.data[0].embedding, many.data[1].embedding)


def test_base64_decodes_to_the_same_floats(client, server):
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    raw = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS,
                                                          "encoding_format": "base64", "user": "u1"}).json()
    for f, d in zip(floats.data, raw["data"]):
        v = np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
        assert v.tolist() == f.embedding                # float32 bits, both ways
    auto = client.embeddings.create(model="tiny", input=TEXTS)   # the client asks base64 and decodes it itself
    assert [d.embedding for d in auto.data] == [d.embedding for d in floats.data]


def test_mean_pooling_is_the_models_mean_hidden_state(client, server, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    mean = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float", extra_body={"pooling": "mean"})
    last = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert mean.usage.prompt_tokens == sum(len(i) for i in ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    for i, d, lst in zip(ids, mean.data, last.data):
        with torch.no_grad():
            h = model(torch.tensor([i]), output_hidden_states=True).hidden_states[-1][0].double().mean(0).numpy()
        np.testing.assert_allclose(_unit(d.embedding), h / np.linalg.norm(h), atol=2e-4)
        assert len(i) == 1 or not np.allclose(d.embedding, lst.embedding)


def test_prompt_tokens_counted_in_metrics(client, server):
    before = server.metrics()["tandem:prompt_tokens_total"]
    r = client.embeddings.create(model="tiny", input=TEXTS)
    assert server.metrics()["tandem:prompt_tokens_total"] == before + r.usage.prompt_tokens


def test_refusals_are_openai_shaped(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hi", dimensions=16)
    assert e.value.status_code == 400 and "dimensions" in str(e.value)

    def post(body):
        return httpx.post(server.url + "/v1/embeddings", json=body)
    assert_error(post({"input": "hi", "dimensions": 16}), 400, "dimensions")
    assert_error(post({"input": "hi", "pooling": "max"}), 400, "pooling")
    assert_error(post({"input": "hi", "bogus": 1}), 400)
    assert_error(post({"input": []}), 400, "input")
    assert_error(post({"input": ""}), 400, "input")
    assert_error(post({"input": ["a", ""]}), 400, "input[1]")
    assert_error(post({"input": [[1, 2], [10 ** 9]]}), 400, "input[1]")
    assert_error(post({"input": "hi", "encoding_format": "int8"}), 400)
    assert_error(post({"input": "hi", "model": "other"}), 404, "model")
    assert_error(post({"input": [1] * 100_000}), 400, "input")
    assert len(client.embeddings.create(model="tiny", input="still serving").data) == 1


@pytest.fixture(scope="module")
def q8_server(tmp_path_factory):
    if not available():
        pytest.skip("native kernels not built")
    d = tmp_path_factory.mktemp("emb-q8")
    hf = make_tiny_model(d / "hf", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    gguf = str(write_tiny_gguf(d / "q8.gguf", hf, quant="Q8_0"))
    srv = ServerProcess(["--model", gguf, "--served-model-name", "tiny", "--max-prefill-tokens", "64",
                         "--kv-cache-tokens", "4096"], str(d / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


def test_same_vector_alone_and_beside_generation(q8_server):
    client = q8_server.openai_client()
    words = "alpha beta gamma delta river stone cloud light table seven open north".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(n)) for i, n in enumerate((2, 90, 30))]
    prompts = [" ".join(words[(i * 5 + j) % len(words)] for j in range(n)) for i, n in enumerate((4, 70, 120))]

    def embed():
        return [d.embedding for pooling in ("last", "mean")
                for d in client.embeddings.create(model="tiny", input=texts, extra_body={"pooling": pooling}).data]

    def generate(p):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0, logprobs=2)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs

    try:
        alone = [client.embeddings.create(model="tiny", input=t, extra_body={"pooling": pooling}).data[0].embedding
                 for pooling in ("last", "mean") for t in texts]      # 90 words: mean pooling over several chunks
        assert embed() == alone                                   # batched together: the same bits
        gen_alone = [generate(p) for p in prompts]
        stop, seen, got = threading.Event(), [], {}

        def embedder():
            while not stop.is_set():
                seen.append(embed())

        def generator(i):
            got[i] = [generate(prompts[i]) for _ in range(2)]
        emb = threading.Thread(target=embedder, daemon=True)
        gens = [threading.Thread(target=generator, args=(i,), daemon=True) for i in range(len(prompts))]
        emb.start()
        for t in gens:
            t.start()
        for t in gens:
            t.join(timeout=300)
        stop.set()
        emb.join(timeout=300)
        assert seen and all(s == alone for s in seen)
        assert [got[i] for i in range(len(prompts))] == [[g, g] for g in gen_alone]
    finally:
        client.close()
