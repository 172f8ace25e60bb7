"""Hybrid linear-attention models (Qwen3.5, Qwen3.5-MoE with its shared expert, Qwen3-Next) as tiny random models
built by transformers: greedy parity with transformers in the exact mode on both loops; a prompt in one chunk or many,
a row alone or among others, the same bits; a vision-language checkpoint's text model served; the state pool counted;
the prefix cache reusing a finished turn from its state checkpoint, the same bits as computed from scratch."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tandem import SamplingParams
from tests.helpers.engine_checks import run_with
from tests.helpers.tiny_hybrid import write_hybrid_gguf
from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build
from tests.model.test_parity import assert_greedy_parity, assert_parity, hf_greedy, prompts_for

MAX_NEW = 10
_MODELS: dict = {}


def tiny_hybrid(arch: str, tmp_path_factory) -> dict:
    """The arch's HF folder, transformers' model, and its GGUF files as llama.cpp writes them (F32, and Q8_0: the
    native int8 kernels, whose rows are the same bits at any row count), made once a session."""
    if arch not in _MODELS:
        from transformers import AutoModelForCausalLM
        root = tmp_path_factory.mktemp(f"tiny-{arch}")
        hf = make_tiny_model(root / "hf", arch, seed=31)
        _MODELS[arch] = dict(hf=hf, ref=AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval(),
                             f32=write_hybrid_gguf(root / "f32.gguf", hf),
                             q8=write_hybrid_gguf(root / "q8_0.gguf", hf, quant="Q8_0"))
    return _MODELS[arch]


@pytest.mark.parametrize("arch, source, kernels", [
    ("qwen3_5", "hf", "torch"), ("qwen3_5_moe", "hf", "native"), ("qwen3_next", "hf", "native"),
    ("qwen3_5", "f32", "native"), ("qwen3_5_moe", "f32", "torch"), ("qwen3_next", "f32", "native")])
def test_hybrid_parity_both_loops(arch, source, kernels, tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """From safetensors and from GGUF as llama.cpp's converter writes it (Qwen3.5's value heads tiled)."""
    m = tiny_hybrid(arch, tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    llm = make_llm(m[source], kv_cache_tokens=4096, max_running_requests=16, kernels=kernels, max_prefill_tokens=16,
                   cache_dir=str(tmp_path / "cache"))
    c = llm.engine.model_config
    assert c.architecture == arch and c.linear_layers == (0, 1, 2) and c.rotary_dim == 8
    assert c.shared_expert_intermediate_size == (0 if arch == "qwen3_5" else 64)
    assert c.linear_value_heads_tiled == (source != "hf" and arch != "qwen3_next")
    ps = prompts_for(m["ref"].config.vocab_size, n=6, seed=7)
    refs = [hf_greedy(m["ref"], p, MAX_NEW) for p in ps]
    assert_greedy_parity(llm, ps, refs, MAX_NEW)


def test_chunks_and_batch_mates_change_no_bit(tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """Q8_0 blocks on the int8 kernels: a prompt's state carried over 16-token chunks gives the bits of one chunk,
    alone or among other prompts, in both loops (tokens and logprobs)."""
    m = tiny_hybrid("qwen3_5_moe", tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    ps = prompts_for(m["ref"].config.vocab_size, n=6, seed=3) + [list(range(5, 90))]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    kw = dict(prefix_cache=False, cache_dir=str(tmp_path / "cache"))
    whole = make_llm(m["q8"], max_prefill_tokens=512, **kw)
    one = [run_with(whole, "serial", [p], params)[0] for p in ps]
    whole.shutdown()
    chunked = make_llm(m["q8"], max_prefill_tokens=16, **kw)
    for scheduler in ("serial", "overlap"):
        for a, o in zip(one, run_with(chunked, scheduler, ps, params)):
            assert o.token_ids == a.token_ids and o.outputs[0].logprobs == a.outputs[0].logprobs


def test_state_carries_bit_for_bit():
    """The conv and the delta rule of one request: its tokens in one piece or cut anywhere, the same bits (the state
    carried between pieces), whatever else the call holds."""
    from tandem.model.linear_attention import causal_conv, delta_rule_reference, l2norm
    g = torch.Generator().manual_seed(0)
    n, c, width, h, dk, dv = 23, 24, 4, 4, 8, 8
    x, w = torch.randn(n, c, generator=g), torch.randn(c, width, generator=g)
    q, k = l2norm(torch.randn(n, h, dk, generator=g)), l2norm(torch.randn(n, h, dk, generator=g))
    v, gate, beta = torch.randn(n, h, dv, generator=g), -torch.rand(n, h, generator=g), torch.rand(n, h, generator=g)
    conv0, s0 = torch.zeros(c, width - 1), torch.zeros(h, dk, dv)
    whole = causal_conv(x, w, conv0.clone(), True), delta_rule_reference(q, k, v, gate, beta, s0.clone())
    for cuts in ([1], [7, 8], [16], [1, 2, 3, 20]):
        conv, s, ys, os_ = conv0.clone(), s0.clone(), [], []
        for a, b in zip([0] + cuts, cuts + [n]):
            ys.append(causal_conv(x[a:b], w, conv, a == 0))
            os_.append(delta_rule_reference(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], s))
        assert torch.equal(torch.cat(ys), whole[0]) and torch.equal(torch.cat(os_), whole[1]), cuts


@pytest.mark.parametrize("native", [False, True])
def test_mixer_rows_stand_alone(native, tmp_path_factory):
    """A linear layer's mixing (conv, rule, gated norm: the projections aside) of a step's rows: a row the same bits
    alone or among others, in one step or cut over two beside another row, its state left the same."""
    import numpy as np
    from tandem.kernels import available
    from tandem.model.linear_attention import GatedDeltaNet
    from tandem.model.loader import load_weights, resolve_model
    from tandem.model.recurrent_state import RecurrentState
    if native and not available():
        pytest.skip("native kernels not built")
    src = resolve_model(tiny_hybrid("qwen3_5", tmp_path_factory)["hf"])
    sd = load_weights(src)

    class Reader:                   # the state dict as the model reads it (llama._StateReader's two calls)
        def w(self, name):
            return sd[name]

        def lin(self, w):
            return lambda x: x @ w.t()

    mixer = GatedDeltaNet(Reader(), src.config, 0, 0, native)
    lens = [9, 1, 17, 4]
    proj = torch.randn(sum(lens), 2 * mixer.key_dim + 2 * mixer.value_dim + 2 * mixer.heads_v,
                       generator=torch.Generator().manual_seed(2))
    pool = RecurrentState(src.config, 1, 8, torch.device("cpu"))

    def step(rows, extend, seq, x):
        return mixer.mix(x, pool.rows_of(np.array(rows), np.array(extend), np.array(seq)))

    together = step([1, 2, 3, 4], lens, lens, proj)
    assert torch.equal(step([5], [9], [9], proj[:9]), together[:9])
    assert torch.equal(pool.ssm[0, 5], pool.ssm[0, 1]) and torch.equal(pool.conv[0, 5], pool.conv[0, 1])
    first = step([6], [5], [5], proj[10:15])                       # row 3's 17 tokens: 5, then 12 beside a row
    second = step([7, 6], [1, 12], [1, 17], torch.cat([proj[:1], proj[15:27]]))
    assert torch.equal(torch.cat([first, second[1:]]), together[10:27])
    assert torch.equal(pool.ssm[0, 6], pool.ssm[0, 3]) and torch.equal(pool.conv[0, 6], pool.conv[0, 3])
    pool.ssm[0, 7], pool.conv[0, 7] = pool.ssm[0, 1], pool.conv[0, 1]        # a decode step (every row one token:
    x = proj[30:31]                                                          # the conv of all rows at once) ==
    decoded = step([1, 2], [1, 1], [10, 2], torch.cat([x, proj[9:10]]))      # the row by row path of a mixed step
    mixed = step([7, 4], [1, 2], [10, 6], torch.cat([x, proj[:2]]))
    assert torch.equal(decoded[:1], mixed[:1]) and torch.equal(pool.ssm[0, 1], pool.ssm[0, 7])
    assert torch.equal(pool.conv[0, 1], pool.conv[0, 7])


def test_vision_language_checkpoint_serves_its_text_model(tmp_path_factory, tmp_path, make_llm):
    """A Qwen3_5ForConditionalGeneration folder (text_config, model.language_model.* weights, a vision tower and an
    MTP head to skip) serves the same tokens as the text model's own folder."""
    from safetensors.torch import load_file, save_file
    m = tiny_hybrid("qwen3_5", tmp_path_factory)
    with open(os.path.join(m["hf"], "config.json")) as f:
        text = json.load(f)
    wrapped = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1},
               "tie_word_embeddings": False}
    sd = load_file(os.path.join(m["hf"], "model.safetensors"))
    sd = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v for k, v in sd.items()}
    sd.update({"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)})
    for name in os.listdir(m["hf"]):
        if name not in ("config.json", "model.safetensors"):
            with open(os.path.join(m["hf"], name), "rb") as src, open(tmp_path / name, "wb") as dst:
                dst.write(src.read())
    save_file(sd, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(wrapped, f)
    llm = make_llm(str(tmp_path), max_running_requests=4)
    assert llm.engine.model_config.architecture == "qwen3_5"
    p = prompts_for(m["ref"].config.vocab_size, n=1, seed=5)[0]
    ref_ids, scores = hf_greedy(m["ref"], p, MAX_NEW)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0]
    assert_parity(out.token_ids, ref_ids, scores)


def test_hybrid_config_errors_and_state_size():
    """A hybrid config without its linear heads is refused by name; the state a row holds is what its tensors take."""
    from tandem.model.config import ModelConfig
    from tandem.model.recurrent_state import RecurrentState, state_bytes_per_row
    d = {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
         "num_hidden_layers": 4, "intermediate_size": 32}
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        ModelConfig.from_hf_dict(d)
    c = ModelConfig.from_hf_dict({**d, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                  "linear_key_head_dim": 8, "linear_value_head_dim": 8, "head_dim": 16})
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) and c.rotary_dim == 4
    pool = RecurrentState(c, len(c.linear_layers), 5, torch.device("cpu"))
    assert pool.nbytes == 5 * state_bytes_per_row(c, 3) == 5 * 3 * 4 * ((2 * 16 + 32) * 3 + 4 * 8 * 8)


def test_pp2_and_tp2_equal_one_device_and_refusals(tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """Pipeline stages hold their own layers' states (stage 0 has linear layers only: no KV at all); tp ranks hold
    their key heads' q / k and the value heads they serve (HF's grouped order, and the tiled order of llama.cpp's
    Qwen3.5 files), out_proj's partial sums all-reduced, and a slice of the shared expert."""
    from tandem.model.shard import TPLayout
    m = tiny_hybrid("qwen3_5_moe", tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    ps = prompts_for(m["ref"].config.vocab_size, n=4, seed=9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for source, split in (("hf", "pp_size"), ("hf", "tp_size"), ("q8", "tp_size")):
        outs = {}
        for n in (1, 2):
            llm = make_llm(m[source], max_running_requests=8, max_prefill_tokens=16, device_threads=1,
                           cache_dir=str(tmp_path / "cache"), **{split: n})
            outs[n] = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
            if n == 2 and split == "tp_size":
                c = llm.engine.model_config
                assert [TPLayout.of(c, 2, r).local(c).linear_num_value_heads for r in (0, 1)] == [2, 2]
            llm.shutdown()
        assert outs[1] == outs[2], (source, split)


def test_chat_turns_resume_from_state_checkpoints(tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """Each turn of a chat resumes from the previous turn's state checkpoint (its whole history a hit), and requests
    on one prefix share a chunk-end checkpoint; every token and logprob the bits computed from scratch in one chunk,
    in both loops; a retracted request (the KV cache too small for all) resumes from its own checkpoint."""
    m = tiny_hybrid("qwen3_5_moe", tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    base = prompts_for(m["ref"].config.vocab_size, n=1, seed=4)[0] + list(range(100, 140))

    def chat(llm, scheduler):
        llm.engine.config = llm.engine.config.replace(scheduler=scheduler)
        p, turns = base, []
        for extra in ([], list(range(200, 215)), [7, 8, 9]):
            p = p + (turns[-1].token_ids if turns else []) + extra
            turns.append(llm.generate([p], params, use_tqdm=False)[0])
        return turns + llm.generate([p + [5], p + [6, 7]], params, use_tqdm=False)

    kw = dict(cache_dir=str(tmp_path / "cache"), max_running_requests=8)
    cold = make_llm(m["q8"], max_prefill_tokens=512, prefix_cache=False, **kw)
    ref = chat(cold, "serial")
    cold.shutdown()
    llm = make_llm(m["q8"], max_prefill_tokens=16, hybrid_checkpoint_tokens=32, **kw)
    for scheduler in ("serial", "overlap"):
        llm.engine.scheduler.memory.reset_prefix_cache()
        before = llm.stats()
        outs = chat(llm, scheduler)
        assert [(o.token_ids, o.outputs[0].logprobs) for o in outs] == \
            [(o.token_ids, o.outputs[0].logprobs) for o in ref]
        s = llm.stats()
        assert s["state_checkpoints_restored"] - before["state_checkpoints_restored"] >= 4, s
        assert s["state_bytes"] == s["held_state_checkpoints"] * llm.engine.scheduler.memory.recurrent > 0
        # turn 2's hit: turn 1's prompt and all of its answer but (serial) the last token, whose state is not computed
        assert outs[1].num_cached_tokens >= len(base) + 8 - 1
    llm.shutdown()
    small = make_llm(m["q8"], max_prefill_tokens=16, kv_cache_tokens=300, **kw)
    ps = [base[:30] + [i] * 20 for i in range(6)]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    got = run_with(small, "overlap", ps, long)
    assert small.stats()["num_preemptions"] > 0 and small.stats()["state_checkpoints_restored"] > 0
    small.shutdown()
    want = run_with(make_llm(m["q8"], max_prefill_tokens=512, prefix_cache=False, **kw), "overlap", ps, long)
    assert [(o.token_ids, o.outputs[0].logprobs) for o in got] == [(o.token_ids, o.outputs[0].logprobs) for o in want]


def test_states_fit_their_memory_share():
    """Where max_running_requests' states and the checkpoints would not fit state_memory_fraction of free memory,
    fewer requests run and the checkpoints keep a third at most; where they fit, nothing changes."""
    from tandem.config import EngineConfig
    from tandem.engine import fit_hybrid_state
    from tandem.model.config import ModelConfig
    from tandem.model.recurrent_state import state_bytes_per_row
    d = {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
         "num_hidden_layers": 40, "intermediate_size": 32, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "head_dim": 16}
    c = ModelConfig.from_hf_dict(d)
    assert round(state_bytes_per_row(c, len(c.linear_layers)) / 1e6) == 66           # Qwen3.6-35B-A3B's
    big = fit_hybrid_state(c, EngineConfig(max_running_requests=128, state_memory_fraction=0.01))
    assert big.max_running_requests < 128 and big.state_checkpoints <= (big.max_running_requests + 5 +
                                                                         big.state_checkpoints) // 3 + 1
    small = ModelConfig.from_hf_dict({**d, "num_hidden_layers": 4, "linear_key_head_dim": 8,
                                      "linear_value_head_dim": 8})
    assert fit_hybrid_state(small, EngineConfig(max_running_requests=4)) == EngineConfig(max_running_requests=4)


def test_a_rerendered_answer_resumes_from_the_prompts_end(tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """Chats that share a system prompt with batch mates (their prompts' KV private until they leave) and whose next
    turn re-renders the previous answer (its first tokens dropped, as templates drop reasoning): each next turn
    resumes from its own previous prompt's end, saved when that prompt's last chunk ran; the bits of a cold run."""
    m = tiny_hybrid("qwen3_5_moe", tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    system = list(range(300, 340))

    def chats(llm):
        hist, last, outs = [list(system) for _ in range(3)], None, []
        for t in range(3):
            prompts = [h + [400 + 10 * i + t] * 5 for i, h in enumerate(hist)]
            outs = llm.generate(prompts, params, use_tqdm=False)
            if last is not None:
                assert all(o.num_cached_tokens >= n for o, n in zip(outs, last)), [o.num_cached_tokens for o in outs]
            last = [len(p) for p in prompts] if llm.engine.config.prefix_cache else [0, 0, 0]
            hist = [p + o.token_ids[2:] for p, o in zip(prompts, outs)]
        return [(o.token_ids, o.outputs[0].logprobs) for o in outs]

    kw = dict(cache_dir=str(tmp_path / "cache"), max_running_requests=8, max_prefill_tokens=16)
    cold = make_llm(m["q8"], prefix_cache=False, **kw)
    ref = chats(cold)
    cold.shutdown()
    assert chats(make_llm(m["q8"], **kw)) == ref
