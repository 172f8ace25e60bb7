"""The model's sampling defaults (`tandem serve --generation-config auto`): read from a Hugging Face folder's
generation_config.json and a GGUF's general.sampling.* keys, values of the wrong type or out of range left out,
taken by the fields a request omits (its own fields win), and shown in /v1/models."""
from __future__ import annotations

import json

import pytest

from tandem.model.loader import ModelSource
from tandem.model.sampling_defaults import sampling_defaults
from tandem.server import protocol as P


def test_from_generation_config_json(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
         "min_p": "high", "eos_token_id": [1, 2]}))
    src = ModelSource("m", None, (str(tmp_path / "model.safetensors"),), str(tmp_path))
    assert sampling_defaults(src) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").unlink()
    assert sampling_defaults(src) == {}


def test_from_gguf_sampling_keys(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_float32("general.sampling.temp", 0.7)
    w.add_float32("general.sampling.top_p", 0.8)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.penalty_repeat", 1.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = ModelSource("m", None, (path,), "", gguf_file=path)
    assert sampling_defaults(src) == {"temperature": 0.7, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.1}


def test_requests_take_the_defaults_they_omit():
    from tests.helpers.tiny_models import smollm2_tokenizer
    from tandem.server.frontend import Frontend
    tok = smollm2_tokenizer()
    fe = Frontend(tok, 512, len(tok), defaults={"temperature": 0.6, "top_k": 20, "top_p": -3.0})
    try:
        assert fe.defaults == {"temperature": 0.6, "top_k": 20}           # top_p out of range: left out
        omitted = fe.sampling_params(P.CompletionRequest(prompt="hi"), 1, 16)
        assert (omitted.temperature, omitted.top_k, omitted.top_p) == (0.6, 20, 1.0)
        own = fe.sampling_params(P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                                         temperature=0.0, top_k=5), 3, None)
        assert (own.temperature, own.top_k) == (0.0, 5)
        entry = P.model_list("m", 512, fe.defaults)["data"][0]
        assert entry["sampling_defaults"] == {"temperature": 0.6, "top_k": 20}
    finally:
        fe.close()


def test_the_flag():
    from tandem.cli import build_parser
    args = build_parser().parse_args(["serve", "--generation-config", "none"])
    assert args.generation_config == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--generation-config", "bogus"])
