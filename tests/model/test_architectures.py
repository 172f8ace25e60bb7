"""Every architecture (llama, qwen2, qwen3, mistral, gemma3) as a tiny random model, from its safetensors folder
and from a GGUF the test writes: greedy parity with transformers on the same weights, through both loops, with
prompts that cross the sliding window (8 keys) in prefill and in decode, chunked prefill across the window
boundary (16-token chunks), and a second run whose prompts all hit the radix prefix cache."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_checks import assert_no_leaks, run_with
from tandem import SamplingParams
from tests.model.test_parity import assert_parity, hf_greedy, prompts_for
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

MAX_NEW = 12
_MODELS: dict = {}
_REFS: dict = {}


def tiny(arch: str, tmp_path_factory, **overrides) -> dict:
    """The arch's HF folder, its GGUF (F32) and transformers' model on it, made once per session."""
    key = (arch, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        from transformers import AutoModelForCausalLM
        root = tmp_path_factory.mktemp(f"tiny-{arch}")
        hf = make_tiny_model(root / "hf", arch, seed=TINY_ARCHS.index(arch) + 10, **overrides)
        gguf = write_tiny_gguf(root / f"{arch}.gguf", hf, with_tokenizer=False)
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        _MODELS[key] = dict(hf=hf, gguf=gguf, ref=ref)
    return _MODELS[key]


def prompts(vocab: int) -> list[list[int]]:
    """Random prompts of 1-39 tokens, and three that share a 30-token prefix (radix hits past the window)."""
    ps = prompts_for(vocab, n=7, seed=3)
    base = prompts_for(vocab, n=1, seed=4)[0] * 3
    return ps + [base[:30] + [5, 6, 7], base[:30] + [9] * 10, base[:34]]


def reference(key, model, ps) -> list[tuple[list[int], list[torch.Tensor]]]:
    if key not in _REFS:
        _REFS[key] = [hf_greedy(model, p, MAX_NEW) for p in ps]
    return _REFS[key]


# llama and qwen2 from safetensors: test_parity.py; from GGUF: test_loader.py (and one case here).
CASES = [(arch, source, "native") for arch in ("qwen3", "mistral", "gemma3") for source in ("hf", "gguf")] + [
    ("llama", "gguf", "native"), ("gemma3", "hf", "torch"), ("mistral", "gguf", "torch"), ("qwen3", "gguf", "torch")]


@pytest.mark.parametrize("arch, source, kernels", CASES)
def test_tiny_arch_parity_both_loops(arch, source, kernels, tmp_path_factory, tmp_path, monkeypatch):
    from tandem import LLM
    m = tiny(arch, tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    llm = LLM(m[source], kv_cache_tokens=4096, max_running_requests=16, poison_future_map=True, kernels=kernels,
              max_prefill_tokens=16, cache_dir=str(tmp_path / "cache"))
    try:
        c = llm.engine.config
        assert llm.engine.model_config.architecture == ("llama" if (arch, source) == ("mistral", "gguf") else arch)
        ps = prompts(m["ref"].config.vocab_size)
        refs = reference(arch, m["ref"], ps)
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        for scheduler in ("serial", "overlap"):       # the second run's prompts are all in the prefix cache
            outs = run_with(llm, scheduler, ps, params)
            for p, o, (ref_ids, scores) in zip(ps, outs, refs):
                assert_parity(o.token_ids, ref_ids, scores)
        assert llm.stats()["cached_kv_slots"] > 0 and c.prefix_cache
    finally:
        assert_no_leaks(llm)
        llm.shutdown()


def test_config_switches_from_hf_and_gguf(tmp_path_factory):
    """What each architecture's file says reaches ModelConfig the same way from both sources."""
    from tandem.model.config import ModelConfig
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    for arch in TINY_ARCHS:
        m = tiny(arch, tmp_path_factory)
        import json
        import os
        with open(os.path.join(m["hf"], "config.json")) as f:
            hf = ModelConfig.from_hf_dict(json.load(f))
        gg = read_gguf_config(GGUFFile(m["gguf"]))
        fields = ("qk_norm", "sliding_window", "layer_types", "rope_local_theta", "norm_offset", "sandwich_norm",
                  "hidden_act", "embed_scale", "head_dim", "num_kv_heads", "tie_word_embeddings", "attention_bias",
                  "rope_theta")
        for f in fields:
            if arch == "mistral" and f == "layer_types":
                continue
            assert getattr(hf, f) == getattr(gg, f), (arch, f, getattr(hf, f), getattr(gg, f))
        assert hf.attn_scale == pytest.approx(gg.attn_scale)
        from tandem.bench.vllm_peer import hf_config_dict           # the config other engines get (bench peers)
        back = ModelConfig.from_hf_dict(hf_config_dict(gg))
        assert {f: getattr(back, f) for f in fields} == {f: getattr(gg, f) for f in fields}, arch
    g = ModelConfig.from_hf_dict(json.load(open(os.path.join(tiny("gemma3", tmp_path_factory)["hf"], "config.json"))))
    assert g.is_sliding(0) and not g.is_sliding(1) and g.window(2) == 8 and g.window(1) == 0
    assert g.rope_local_theta == 100.0 and g.rope_theta == 10000.0 and g.norm_offset == 1.0


def test_gemma3_query_pre_attn_scalar_and_untied_llama3(tmp_path_factory, make_llm):
    """query_pre_attn_scalar other than head_dim (HF only: GGUF has no key for it), and Llama 3.x's llama3 RoPE
    scaling with untied embeddings: parity on both loops."""
    from transformers import AutoModelForCausalLM
    cases = [("gemma3", dict(query_pre_attn_scalar=64)),
             ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                            tie_word_embeddings=False))]
    for arch, ov in cases:
        root = tmp_path_factory.mktemp(f"tiny-{arch}-variant")
        hf = make_tiny_model(root, arch, seed=21, **ov)
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        llm = make_llm(hf)
        if arch == "gemma3":
            assert llm.engine.model_config.attn_scale == pytest.approx(64 ** -0.5)
        else:
            assert llm.engine.model_config.rope_scaling["rope_type"] == "llama3"
        ps = prompts(ref.config.vocab_size)
        refs = [hf_greedy(ref, p, MAX_NEW) for p in ps]
        for scheduler in ("serial", "overlap"):
            outs = run_with(llm, scheduler, ps, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
            for o, (ref_ids, scores) in zip(outs, refs):
                assert_parity(o.token_ids, ref_ids, scores)


@pytest.mark.parametrize("d, why", [
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "Gemma2ForCausalLM"),
    ({"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
      "intermediate_size": 8, "num_hidden_layers": 1, "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
      "num_hidden_layers": 1}, "intermediate_size"),
])
def test_unsupported_or_incomplete_config_is_one_clear_error(d, why):
    from tandem.model.config import ModelConfig
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(d)
    assert why in str(e.value)
    if why == "Gemma2ForCausalLM":
        for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM"):
            assert name in str(e.value)
