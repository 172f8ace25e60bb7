"""Gemma 4 GGUF files as llama.cpp writes them: tandem reads their config and every tensor into the Gemma 4
contract (model/gemma4_config.py's ModelConfig fields, the decoder's state-dict names) exactly as from the
transformers checkpoint, and the test writer (tests/helpers/tiny_gemma4.py) matches llama.cpp's own converter."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from tests.helpers.tiny_gemma4 import (LLAMA_CPP, contract_state_dict, convert_with_llama_cpp, make_tiny_gemma4,
                                       write_gemma4_gguf)

# What a gemma4 GGUF cannot carry: the per-layer table's rows when the model has no per-layer inputs
# (transformers' config keeps vocab_size_per_layer_input all the same).
NOT_IN_GGUF_WITHOUT_PLE = ("per_layer_vocab_size",)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma4")
    return {"dense": make_tiny_gemma4(root / "dense", moe=False), "moe": make_tiny_gemma4(root / "moe", moe=True)}


def _hf(hf_dir: str):
    from safetensors.torch import load_file

    from tandem.model.config import ModelConfig

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    return config, contract_state_dict(load_file(os.path.join(hf_dir, "model.safetensors")))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_config_matches_hf(models, kind, tmp_path):
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile

    path = write_gemma4_gguf(tmp_path / "m.gguf", models[kind], with_tokenizer=False)
    got, (want, _) = read_gguf_config(GGUFFile(str(path))), _hf(models[kind])
    skip = NOT_IN_GGUF_WITHOUT_PLE if not want.per_layer_input_size else ()
    diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(got)
            if f.name not in skip and getattr(got, f.name) != getattr(want, f.name)}
    assert not diff
    assert got.architecture == "gemma4" and (got.num_experts > 0) == (kind == "moe")
    assert got.attention_k_eq_v == (kind == "moe") and got.double_wide_mlp == (kind == "dense")


@pytest.mark.parametrize("kind,quant", [("dense", "F32"), ("moe", "F16")])
def test_weights_match_hf(models, kind, quant, tmp_path):
    """Every contract tensor, dequantized, equals transformers' (to fp16 rounding in an F16 file); nothing more."""
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.weights import gguf_weights
    from tandem.model.weights import expected_weight_shapes

    path = str(write_gemma4_gguf(tmp_path / "m.gguf", models[kind], quant=quant, with_tokenizer=False))
    config, want = _hf(models[kind])
    got = gguf_weights(path, read_gguf_config(GGUFFile(path)))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        ref = t.half().float() if quant == "F16" and t.dim() >= 2 and ".moe.gate." not in name else t
        assert got[name].shape == ref.shape, name
        assert torch.equal(got[name], ref), name


def test_quantized_experts_stay_blocks(models, tmp_path):
    """Q8_0 matrices load as GGUF blocks, the fused gate_up split into each expert's gate and up rows."""
    from tandem.kernels.quant import QuantWeight
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.weights import gguf_weights
    from tandem.model.weights import expected_weight_shapes

    path = str(write_gemma4_gguf(tmp_path / "m.gguf", models["moe"], quant="Q8_0", with_tokenizer=False))
    _, want = _hf(models["moe"])
    got = gguf_weights(path, read_gguf_config(GGUFFile(path)), quantized=True)
    for name in ("model.layers.1.moe.experts.3.gate_proj.weight", "model.layers.1.moe.experts.3.up_proj.weight",
                 "model.layers.2.moe.experts.7.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert isinstance(got[name], QuantWeight), name
        torch.testing.assert_close(got[name].dequantize().float(), want[name], atol=0.02 * want[name].abs().max(),
                                   rtol=0)
    assert got["model.layers.1.moe.gate.weight"].dtype == torch.float32       # the router stays F32


@pytest.mark.skipif(not os.path.exists(os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py")),
                    reason="llama.cpp's converter is not here")
def test_writer_matches_llama_cpp_converter(models, tmp_path):
    """The test writer's file and llama.cpp's convert_hf_to_gguf.py's hold the same keys and tensors, bit for bit
    (the tokenizer's and general.* keys aside)."""
    import gguf

    ref = gguf.GGUFReader(convert_with_llama_cpp(models["moe"], str(tmp_path / "ref.gguf"), "f16"))
    mine = gguf.GGUFReader(write_gemma4_gguf(tmp_path / "mine.gguf", models["moe"], quant="F16", with_tokenizer=False))

    def keys(r):
        return {k: f.contents() for k, f in r.fields.items() if not k.startswith(("general.", "GGUF.", "tokenizer."))}
    assert keys(mine) == keys(ref)
    tensors = {t.name: t for t in ref.tensors}
    assert sorted(t.name for t in mine.tensors) == sorted(tensors)
    for t in mine.tensors:
        r = tensors[t.name]
        assert (list(t.shape), t.tensor_type) == (list(r.shape), r.tensor_type), t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(r.data)), t.name


def test_unsupported_features_are_named():
    from tandem.model.gguf.config import gguf_to_hf_name
    from tandem.model.gguf.gemma4 import gemma4_switches

    with pytest.raises(ValueError, match="fused attn_qkv"):
        gguf_to_hf_name("blk.0.attn_qkv.weight", "gemma4")
    keys = {"attention.sliding_window_pattern": [True, False], "attention.key_length_swa": 16,
            "attention.key_length": 32, "attention.head_count_kv": 2, "feed_forward_length": 96,
            "attention.sliding_window": 8}
    tensors = {f"blk.{i}.attn_{p}.weight": None for i in range(2) for p in "kv"}

    def switches(**over):
        kv = {**keys, **over}
        return gemma4_switches(lambda k, d=None: kv.get(k, d), tensors, 2, np.array([1.0] * 4 + [1e30] * 12))
    assert switches()["rope_proportion"] == 0.25
    with pytest.raises(ValueError, match="partial RoPE"):
        switches(**{"rope.dimension_count_swa": 8})
    with pytest.raises(ValueError, match="proportional"):
        switches(**{"rope.dimension_count": 16})
    with pytest.raises(ValueError, match="feed_forward_length"):
        switches(feed_forward_length=[96, 128])


def test_synthetic_26b_a4b_table():
    """The full shape's table: Gemma-4-26B-A4B's dims, V only on the 25 sliding layers, llama.cpp's fallbacks for
    rows of 2112 and 704 (not whole super-blocks)."""
    from tandem.model.gguf.synthetic import Q5_0, Q6_K, Q8_0, SHAPES, tensor_types

    t = tensor_types(SHAPES["gemma-4-26b-a4b"])
    assert t["token_embd.weight"] == ((262144, 2816), Q6_K) and "output.weight" not in t
    assert sum(n.endswith("attn_v.weight") for n in t) == 25 and "blk.5.attn_v.weight" not in t
    assert t["blk.5.attn_k.weight"][0] == (2 * 512, 2816) and t["blk.0.attn_q.weight"][0] == (16 * 256, 2816)
    assert t["blk.0.ffn_gate_up_exps.weight"][0] == (128, 2 * 704, 2816)
    assert t["blk.0.ffn_down_exps.weight"] == ((128, 2816, 704), Q8_0)          # use_more_bits: Q6_K -> Q8_0
    assert t["blk.4.ffn_down.weight"] == ((2816, 2112), Q5_0)                    # Q4_K -> Q5_0
    assert t["rope_freqs.weight"][0] == (256,)


def test_synthetic_gemma4_reads_into_the_contract(tmp_path):
    """A shrunk synthetic Gemma 4 file: tandem reads its config and every contract tensor as GGUF blocks."""
    from tandem.kernels.quant import QuantWeight
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.synthetic import SHAPES, write_synthetic_gguf
    from tandem.model.gguf.weights import gguf_weights
    from tandem.model.weights import expected_weight_shapes

    shape = dataclasses.replace(SHAPES["gemma-4-26b-a4b"], layers=6, hidden=256, intermediate=320, heads=4,
                                kv_heads=2, head_dim=64, full_attention=(128, 1), experts=4, experts_used=2,
                                expert_width=96, vocab=49152)
    path = write_synthetic_gguf(str(tmp_path / "g4.gguf"), shape)
    c = read_gguf_config(GGUFFile(path))
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (c.head_dim, c.num_kv_heads, c.global_head_dim, c.global_kv_heads) == (64, 2, 128, 1)
    assert c.attention_k_eq_v and c.moe_beside_mlp and c.rope_proportion == 0.25
    assert (c.rope_theta, c.rope_local_theta, c.final_logit_softcapping, c.sliding_window) == (1e6, 1e4, 30.0, 1024)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.intermediate_size) == (4, 2, 96, 320)
    w = gguf_weights(path, c, quantized=True)
    shapes = expected_weight_shapes(c)
    assert sorted(w) == sorted(shapes)
    assert all(tuple(w[n].shape) == s for n, s in shapes.items())
    assert isinstance(w["model.layers.5.moe.experts.3.up_proj.weight"], QuantWeight)


def test_resolve_model_reads_config_and_tokenizer(models, tmp_path):
    """The loader's path (resolve_model, load_tokenizer): the tokenizer is built from the file without transformers
    parsing gemma4's per-layer keys as its config."""
    from transformers import AutoTokenizer

    from tandem.model.loader import load_tokenizer, resolve_model

    path = write_gemma4_gguf(tmp_path / "m.gguf", models["dense"])
    src = resolve_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert src.config == _hf(models["dense"])[0]
    text = "Gemma 4 reads GGUF, twice."
    assert load_tokenizer(src)(text).input_ids == AutoTokenizer.from_pretrained(models["dense"])(text).input_ids
