"""Gemma 4 text models from transformers' checkpoints (tiny random models): full layers with their own head dim and
KV heads in a KV cache of two shapes, V as K's projection, v_norm, proportional RoPE, soft-capped logits, the
layer scalar, experts beside the dense MLP, per-layer inputs and KV-shared layers. Greedy parity with transformers
in the exact mode on both loops and both kernel sets; the branches (speculation, a grammar row, the trace, the
prefix cache); the configuration's two written forms; what is not served yet refused by name."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tandem.scheduler.speculative as spec_mod
from tandem import SamplingParams
from tests.helpers.engine_checks import assert_grammar_row_and_trace
from tests.helpers.tiny_gemma4 import BASE, MOE, make_tiny_gemma4
from tests.model.test_parity import assert_greedy_parity, hf_greedy, prompts_for, run_with
from tests.scheduler.test_speculative import Oracle, configure, pin_row_cost

MAX_NEW = 8
_MODELS: dict = {}
_PLAIN = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)
# (moe, overrides) of tests/helpers/tiny_gemma4.py's models. dense: full layers of their own head dim; kv: V as K's
# projection with one global KV head; moe: that and experts beside the MLP; ple: per-layer inputs, KV-shared layers.
VARIANTS = {"dense": (False, _PLAIN), "kv": (False, dict(_PLAIN, attention_k_eq_v=True, num_global_key_value_heads=1)),
            "moe": (True, {}), "ple": (False, {})}


def tiny(variant: str, tmp_path_factory) -> dict:
    if variant not in _MODELS:
        from transformers import AutoModelForCausalLM
        moe, overrides = VARIANTS[variant]
        hf = make_tiny_gemma4(tmp_path_factory.mktemp(f"tiny-gemma4-{variant}") / "hf", moe, seed=3, **overrides)
        _MODELS[variant] = dict(hf=hf, ref=AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval())
    return _MODELS[variant]


@pytest.mark.parametrize("variant, kernels", [("dense", "torch"), ("kv", "native"), ("moe", "native"),
                                              ("ple", "native"), ("ple", "torch")])
def test_parity_with_transformers_both_loops(variant, kernels, tmp_path_factory, make_llm):
    """Prompts of 1-40 tokens over an 8-token window, prefilled in 16-token chunks (sliding and full layers, chunks
    across the window's edge), then decoded."""
    m = tiny(variant, tmp_path_factory)
    llm = make_llm(m["hf"], kv_cache_tokens=4096, max_running_requests=16, kernels=kernels, max_prefill_tokens=16)
    c = llm.engine.model_config
    assert c.architecture == "gemma4" and c.final_logit_softcapping == 30.0 and c.global_head_dim == 32
    assert [c.layer_head_dim(i) for i in range(c.num_layers)] == [16 if t == "sliding_attention" else 32
                                                                  for t in c.layer_types]
    ps = prompts_for(m["ref"].config.vocab_size, n=5, seed=7)
    refs = [hf_greedy(m["ref"], p, MAX_NEW) for p in ps]
    assert_greedy_parity(llm, ps, refs, MAX_NEW)


def test_kv_cache_of_two_shapes_and_shared_layers(tmp_path_factory, make_llm):
    """The "ple" model: sliding layers' 2 x 16 and full layers' 2 x 32 in two caches over the same slots; its two
    KV-shared layers (one sliding, one full) hold no KV."""
    from tandem.model.kv_cache import GroupedKVCache
    m = tiny("ple", tmp_path_factory)
    llm = make_llm(m["hf"], kv_cache_tokens=512, max_running_requests=4, device_backend="inline")
    c, runner = llm.engine.model_config, llm.engine.executor.model_runner
    assert [c.kv_source(i) for i in range(c.num_layers)] == [0, 1, 2, 2, 1]
    cache = runner.kv_cache
    assert isinstance(cache, GroupedKVCache) and cache.where == [(0, 0), (1, 0), (0, 1)]
    assert [tuple(k.data.shape[1:4]) for k in cache.caches] == [(2, 2, 2), (1, 2, 2)]
    assert [k.data.shape[-1] for k in cache.caches] in ([16, 32], [18, 36])       # elements, or q8_0 bytes a row
    assert cache.caches[0].num_slots == cache.caches[1].num_slots == 512


def test_the_branches_keep_working(tmp_path_factory, make_llm, monkeypatch):
    """On the model with per-layer inputs and KV-shared layers (native kernels): speculation changes no token in
    either loop; a prompt served from the prefix cache gets the tokens it gets cold; a grammar row beside free rows
    and the trace."""
    m = tiny("ple", tmp_path_factory)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    llm = make_llm(m["hf"], kv_cache_tokens=4096, max_running_requests=8, max_prefill_tokens=24,
                   speculative_config=spec)
    pin_row_cost(llm, monkeypatch)
    prompts = prompts_for(m["ref"].config.vocab_size, n=4, seed=11) + [list(range(5, 60))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for loop in ("serial", "overlap"):
        configure(llm, loop, False)
        plain = [o.token_ids for o in run_with(llm, loop, prompts, params)]
        again = [o.token_ids for o in run_with(llm, loop, [p + t[:3] for p, t in zip(prompts, plain)], params)]
        fresh = [o.token_ids for o in run_with(llm, loop, [p + t[:3] for p, t in zip(prompts, plain)], params)]
        assert again == fresh                                   # the second from the prefix cache
        monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle({tuple(p): t for p, t in zip(prompts, plain)},
                                                             wrong=0.4, seed=len(loop)))
        configure(llm, loop, True, spec)
        before = llm.stats()
        assert [o.token_ids for o in run_with(llm, loop, prompts, params)] == plain, loop
        after = llm.stats()
        assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    configure(llm, "serial", False)
    assert_grammar_row_and_trace(llm, prompts[:3])


def test_config_forms_rope_and_refusals():
    """transformers' per_layer_config (what it writes back) and the release's global_head_dim /
    num_global_key_value_heads give one config; full layers' proportional RoPE as transformers computes it; tensor
    parallelism where a full layer's own KV heads do not split, and a KV-shared layer without a producer, refused by
    name."""
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tandem.model.config import ModelConfig
    from tandem.model.rope import rope_inv_freq
    from tandem.model.shard import check_tp_size
    hf = Gemma4TextConfig(**{**BASE, **MOE, "vocab_size": 300})
    written = {**hf.to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    assert "per_layer_config" in written and "global_head_dim" not in written
    release = {k: v for k, v in written.items() if k != "per_layer_config"}
    release.update(global_head_dim=32, num_global_key_value_heads=1)
    ours = ModelConfig.from_hf_dict(written)
    assert ours == ModelConfig.from_hf_dict(release)
    assert (ours.global_head_dim, ours.global_kv_heads, ours.attention_k_eq_v, ours.moe_beside_mlp) == (32, 1, True, True)
    assert (ours.rope_theta, ours.rope_local_theta, ours.rope_proportion) == (10000.0, 100.0, 0.25)
    wrapped = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": written, "tie_word_embeddings": True}
    assert ModelConfig.from_hf_dict(wrapped) == ours
    inv, _ = ROPE_INIT_FUNCTIONS["proportional"](hf, layer_type="full_attention")
    assert torch.equal(rope_inv_freq(ours), inv.float())
    assert torch.equal(rope_inv_freq(ours, local=True)[:4],
                       1.0 / (100.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))[:4])
    check_tp_size(ours, 2)                               # the full layers' one KV head replicated
    with pytest.raises(ValueError, match="full layers' 3 KV heads"):
        check_tp_size(dataclasses.replace(ours, num_heads=12, global_kv_heads=3), 2)
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        ModelConfig.from_hf_dict({**release, "num_hidden_layers": 5, "num_kv_shared_layers": 3,
                                  "layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 3})
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_hf_dict({**release, "use_bidirectional_attention": "all"})


@pytest.mark.parametrize("variant, splits", [("moe", ("tp_size", "pp_size")), ("ple", ("tp_size",))])
def test_tp2_and_pp2_give_one_devices_tokens(variant, splits, tmp_path_factory, make_llm):
    """tp 2: each rank its heads of each layer's own shape (the full layers' one KV head replicated), whole experts
    beside a split dense MLP, the double-wide MLP split as wide, the per-layer inputs whole on every rank; pp 2 where
    no layer reads another stage's KV. The per-layer inputs and KV-shared layers under pp are refused by name."""
    m = tiny(variant, tmp_path_factory)
    ps = prompts_for(m["ref"].config.vocab_size, n=3, seed=13)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for name, kw in [("one", {})] + [(s, {s: 2}) for s in splits]:
        llm = make_llm(m["hf"], device_threads=1, max_prefill_tokens=16, **kw)
        outs[name] = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        llm.shutdown()
    assert all(outs[s] == outs["one"] for s in splits)
    if variant == "ple":
        with pytest.raises(Exception, match="pipeline stages"):
            make_llm(m["hf"], pp_size=2)
