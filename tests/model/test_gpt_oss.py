"""gpt-oss from transformers' checkpoints (tiny random models): attention sinks, q / k / v / o biases, sliding and
full layers alternating, YaRN, a biased router softmaxed over its top-k, biased experts with the clamped SwiGLU.
Greedy parity with transformers in the exact mode on both loops and both kernel sets; YaRN's frequencies and
attention factor as transformers computes them; what is not served yet refused by name."""
from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tests.helpers.tiny_gpt_oss import make_tiny_gpt_oss
from tests.model.test_parity import assert_greedy_parity, hf_greedy, prompts_for

MAX_NEW = 10
_MODELS: dict = {}


def tiny(tmp_path_factory) -> dict:
    if not _MODELS:
        from transformers import AutoModelForCausalLM
        hf = make_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss") / "hf", seed=17)
        _MODELS.update(hf=hf, ref=AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval())
    return _MODELS


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_parity_with_transformers_both_loops(kernels, tmp_path_factory, make_llm):
    """Prompts of 1-40 tokens over an 8-token window, prefilled in 16-token chunks (sliding and full layers,
    chunks across the window's edge), then decoded."""
    m = tiny(tmp_path_factory)
    llm = make_llm(m["hf"], kv_cache_tokens=4096, max_running_requests=16, kernels=kernels, max_prefill_tokens=16)
    c = llm.engine.model_config
    assert c.architecture == "gpt_oss" and c.attention_sinks and c.moe_routing == "topk_softmax"
    assert [c.window(i) for i in range(c.num_layers)] == [8, 0, 8, 0]
    ps = prompts_for(m["ref"].config.vocab_size, n=6, seed=7)
    refs = [hf_greedy(m["ref"], p, MAX_NEW) for p in ps]
    assert_greedy_parity(llm, ps, refs, MAX_NEW)


def test_yarn_and_the_clamped_swiglu_as_transformers():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from tandem.model.config import ModelConfig
    from tandem.model.moe import swiglu_oai
    from tandem.model.rope import rope_attention_factor, rope_inv_freq
    for rope in ({"truncate": False}, {"truncate": True}, {"attention_factor": 1.5},
                 {"mscale": 1.0, "mscale_all_dim": 0.5}):
        params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 4096, "rope_theta": 150000.0, **rope}
        hf = GptOssConfig(hidden_size=64, head_dim=64, num_attention_heads=1, num_key_value_heads=1, rope_parameters=params,
                          max_position_embeddings=131072)
        ours = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["GptOssForCausalLM"]})
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        assert torch.allclose(rope_inv_freq(ours), inv, rtol=1e-6) and rope_attention_factor(ours) == pytest.approx(factor)
    hf = GptOssConfig(hidden_size=8, intermediate_size=4, num_local_experts=1)
    gu = torch.randn(5, 8) * 6                           # past the limit of 7 on both sides
    inter = torch.stack([gu[:, :4], gu[:, 4:]], dim=-1).reshape(5, 8)        # transformers' interleaved columns
    assert torch.allclose(swiglu_oai(gu, 1.702, 7.0), GptOssExperts(hf)._apply_gate(inter), atol=1e-6)


def test_refusals():
    from tandem.model.config import ModelConfig
    d = {"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
         "num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2}
    assert ModelConfig.from_hf_dict(d).layer_types == ("sliding_attention", "full_attention")
    with pytest.raises(ValueError, match="attention_bias=False"):
        ModelConfig.from_hf_dict({**d, "attention_bias": False})
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "num_local_experts"})


def _mxfp4_reference(model):
    """A copy of transformers' model whose experts hold the values MXFP4 gives them."""
    import copy
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for layer in ref.model.layers:
            for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                w.copy_(_mxfp4_round_trip(w))
    return ref


def _mxfp4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """An expert weight [E, in, out] as MXFP4 holds it (blocks of 32 along `in`), back in fp32."""
    import gguf
    a = w.transpose(1, 2).contiguous().numpy()
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.MXFP4)
    back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).reshape(a.shape)
    return torch.from_numpy(back).transpose(1, 2)


def test_gguf_with_mxfp4_experts(tmp_path_factory, tmp_path, make_llm):
    """The file as llama.cpp's converter writes it, experts in MXFP4 (blocks on the native path), a tokenizer in its
    metadata: the tokens of transformers' model holding the same MXFP4 values, both kernel sets, the exact mode."""
    from tests.helpers.tiny_gpt_oss import write_gpt_oss_gguf
    m = tiny(tmp_path_factory)
    path = write_gpt_oss_gguf(tmp_path / "tiny-gpt-oss.gguf", m["hf"], mxfp4=True, with_tokenizer=True)
    ref = _mxfp4_reference(m["ref"])
    ps = prompts_for(ref.config.vocab_size, n=4, seed=9)
    refs = [hf_greedy(ref, p, MAX_NEW) for p in ps]
    for kernels in ("torch", "native"):
        llm = make_llm(path, kernels=kernels, kernels_act="fp32", max_prefill_tokens=16,     # the exact mode
                       cache_dir=str(tmp_path / "cache"))
        c = llm.engine.model_config
        assert c.architecture == "gpt_oss" and c.rope_scaling["truncate"] is False and c.layer_types[:2] == (
            "sliding_attention", "full_attention")
        assert_greedy_parity(llm, ps, refs, MAX_NEW, loops=("overlap",))
        llm.shutdown()


def test_mxfp4_experts_are_held_once(tmp_path_factory, tmp_path, make_llm, monkeypatch):
    """The default (int8) mode: every MXFP4 expert keeps only its packed copy, which takes every row count (its
    bits are the GEMM's at any count), so a file's experts are held once; the same tokens and logprobs as with the
    row layout kept beside it (a prompt of 300 tokens: chunks past the packed copy's usual 256 rows on AMX)."""
    from tandem.model.linear import QLinear
    from tests.helpers.tiny_gpt_oss import write_gpt_oss_gguf
    m = tiny(tmp_path_factory)
    path = write_gpt_oss_gguf(tmp_path / "tiny-gpt-oss.gguf", m["hf"], mxfp4=True, with_tokenizer=True)
    ps = prompts_for(m["ref"].config.vocab_size, n=3, seed=4) + [list(range(3, 303))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = []
    for keep_rows in (False, True):
        if keep_rows:
            monkeypatch.setattr(QLinear, "release_rows", lambda self, packed_only=False: None)
        llm = make_llm(path, max_prefill_tokens=512, device_backend="inline", cache_dir=str(tmp_path / "cache"))
        lins = [lin for layer in llm.engine.executor.model_runner.model.layers for pair in layer["moe"].experts
                for lin in pair]
        if lins[0].packed is None:
            pytest.skip("no packed MXFP4 body on this CPU")
        assert all(lin.holds_rows == keep_rows for lin in lins)
        runs.append([(o.token_ids, o.outputs[0].logprobs) for o in llm.generate(ps, params, use_tqdm=False)])
        llm.shutdown()
    assert runs[0] == runs[1]


def test_tp2_pp2_and_speculation_change_no_token(tmp_path_factory, monkeypatch, make_llm):
    """tp 2 (whole experts a rank; sinks, q / k / v biases by heads; o's and the experts' biases added once) and pp 2
    (each stage its layers' sinks and windows) give one device's tokens; speculation (drafts that are mostly right,
    some not: verify rows through the sinks) changes none."""
    import tandem.scheduler.speculative as spec_mod
    from tests.scheduler.test_speculative import Oracle, pin_row_cost
    m = tiny(tmp_path_factory)
    ps = prompts_for(m["ref"].config.vocab_size, n=4, seed=13)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, kw in (("tp1", {}), ("tp2", dict(tp_size=2)), ("pp2", dict(pp_size=2)),
                     ("spec", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}))):
        llm = make_llm(m["hf"], device_threads=1, max_prefill_tokens=16, **kw)
        if name == "spec":
            pin_row_cost(llm, monkeypatch)
            monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle({tuple(p): o for p, o in zip(ps, outs["tp1"])}, wrong=0.6))
        outs[name] = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        if name == "spec":
            assert 0 < llm.stats()["spec_accepted_tokens"] < llm.stats()["spec_draft_tokens"]
        llm.shutdown()
    assert outs["tp2"] == outs["tp1"] and outs["pp2"] == outs["tp1"] and outs["spec"] == outs["tp1"]


def test_mxfp4_checkpoint_as_openai_ships_it(tmp_path_factory, tmp_path, make_llm):
    """`*_blocks` / `*_scales` experts load as MXFP4 blocks (never a dense copy on the native path): the tokens of
    transformers' model holding the same values, both kernel sets."""
    from tandem.kernels.quant import MXFP4
    from tests.helpers.tiny_gpt_oss import save_mxfp4_checkpoint
    m = tiny(tmp_path_factory)
    path = save_mxfp4_checkpoint(m["hf"], tmp_path / "mxfp4")
    ref = _mxfp4_reference(m["ref"])
    ps = prompts_for(ref.config.vocab_size, n=4, seed=21)
    refs = [hf_greedy(ref, p, MAX_NEW) for p in ps]
    for kernels in ("torch", "native"):
        llm = make_llm(path, kernels=kernels, kernels_act="fp32", max_prefill_tokens=16, device_backend="inline")
        if kernels == "native":
            gate = llm.engine.executor.model_runner.model.layers[0]["moe"].experts[0][0]
            assert {p.qtype for p in gate.parts} == {MXFP4}
        assert_greedy_parity(llm, ps, refs, MAX_NEW, loops=("serial",))
        llm.shutdown()
