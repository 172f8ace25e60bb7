"""Mixtures of experts (Qwen3-MoE, Mixtral) as tiny random models built by transformers: greedy parity with
transformers in the exact mode on both loops from safetensors and from GGUF (3-D expert blocks and the older
per-expert layout), quantized GGUF experts (Q8_0, Q5_1, F16, Q4_K_M, every K-quant) on the native kernels, the
router against transformers' own, a row's tokens and logprobs the same alone and in a batch, whole experts a tp
rank, and a grammar and the trace on an MoE model."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tandem import SamplingParams
from tandem.kernels import available
from tandem.model.numerics import Numerics
from tests.helpers.engine_checks import assert_grammar_row_and_trace, run_with
from tests.helpers.isa import runnable
from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf
from tests.model.test_parity import assert_greedy_parity, hf_greedy, prompts_for

NATIVE_INT8 = Numerics(native=True, int8_act=True)     # the native ops, int8 activations

MAX_NEW = 10
_MODELS: dict = {}


def tiny_moe(arch: str, tmp_path_factory, **overrides) -> dict:
    """The arch's HF folder, its F32 GGUF (Mixtral's in the older per-expert layout) and transformers' model."""
    key = (arch, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        from transformers import AutoModelForCausalLM
        root = tmp_path_factory.mktemp(f"tiny-{arch}")
        hf = make_tiny_model(root / "hf", arch, seed=31, **overrides)
        gguf = write_tiny_gguf(root / f"{arch}.gguf", hf, with_tokenizer=False, split_experts=arch == "mixtral")
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        _MODELS[key] = dict(hf=hf, gguf=gguf, ref=ref)
    return _MODELS[key]


@pytest.mark.parametrize("arch, source, kernels", [
    ("qwen3_moe", "hf", "native"), ("mixtral", "hf", "native"), ("qwen3_moe", "gguf", "native"),
    ("mixtral", "gguf", "torch")])
def test_moe_parity_both_loops(arch, source, kernels, tmp_path_factory, tmp_path, monkeypatch, make_llm):
    m = tiny_moe(arch, tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    llm = make_llm(m[source], kv_cache_tokens=4096, max_running_requests=16, kernels=kernels,
                   max_prefill_tokens=16, cache_dir=str(tmp_path / "cache"))
    c = llm.engine.model_config
    assert c.num_experts == 8 and c.num_experts_per_tok == 2
    assert c.architecture == ("llama" if (arch, source) == ("mixtral", "gguf") else arch)
    assert c.mlp_only_layers == ((1,) if arch == "qwen3_moe" else ())
    ps = prompts_for(m["ref"].config.vocab_size, n=6, seed=7)
    refs = [hf_greedy(m["ref"], p, MAX_NEW) for p in ps]
    assert_greedy_parity(llm, ps, refs, MAX_NEW)


def test_expert_config_the_same_from_hf_and_gguf(tmp_path_factory):
    from tandem.model.config import ModelConfig
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
              "qk_norm", "intermediate_size", "head_dim")
    for arch in ("qwen3_moe", "mixtral"):
        m = tiny_moe(arch, tmp_path_factory)
        with open(os.path.join(m["hf"], "config.json")) as f:
            hf = ModelConfig.from_hf_dict(json.load(f))
        gg = read_gguf_config(GGUFFile(m["gguf"]))
        assert {f: getattr(hf, f) for f in fields} == {f: getattr(gg, f) for f in fields}, arch
        assert [hf.is_moe(i) for i in range(hf.num_layers)] == [gg.is_moe(i) for i in range(gg.num_layers)]
        assert ModelConfig.from_dict(hf.to_dict()) == hf
        from tandem.device.ranks import num_params           # every expert and router: the threads default
        assert num_params(hf) == sum(p.numel() for n, p in m["ref"].named_parameters() if "norm" not in n)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_router_matches_transformers_and_its_rows_stand_alone(arch, tmp_path_factory):
    """The router's choices and weights against transformers' router module on the same weights; a row's logits,
    choices and weights the same bits alone and among others (1 and 2 threads)."""
    from tandem.model.moe import route, router_logits
    ref = tiny_moe(arch, tmp_path_factory)["ref"]
    gate = ref.model.layers[0].mlp.gate
    x = torch.randn(37, ref.config.hidden_size, generator=torch.Generator().manual_seed(1))
    _, ref_w, ref_ids = gate(x)
    w = gate.weight.detach().float().contiguous()
    weights, ids = route(router_logits(x, w), ref.config.num_experts_per_tok, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w.float(), rtol=1e-5, atol=1e-6)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i in (0, 5, 36):
                assert torch.equal(router_logits(x[i:i + 1], w)[0], router_logits(x, w)[i])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not available(), reason="native kernels not built")
@pytest.mark.parametrize("experts,k", [(8, 2), (70, 6), (128, 8)])
def test_native_router_matches_torch_and_its_rows_stand_alone(experts, k):
    """tandem.moe_route (the native path's router) against route(router_logits()) in torch: the same experts and
    weights within fp32 rounding; each ISA body (scalar, AVX2, AVX-512) the same bits; a row's result the same
    bits alone and among 37 (1 and 2 threads); bad arguments refused."""
    import torch.nn.functional as F
    from tandem.model.moe import route, router_logits
    g = torch.Generator().manual_seed(experts)
    x, w = torch.randn(37, 96, generator=g), torch.randn(experts, 96, generator=g) / 8
    wt = F.pad(w.t(), (0, -experts % 64)).contiguous()
    ops = torch.ops.tandem
    for renorm in (True, False):
        ref_w, ref_ids = route(router_logits(x, w), k, renorm)
        got_w, got_ids = ops.moe_route(x, wt, experts, k, renorm)
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
        for isa in runnable():
            bw, bids = ops.moe_route(x, wt, experts, k, renorm, isa)
            assert torch.equal(bw, got_w) and torch.equal(bids, got_ids), isa
    threads, (all_w, all_ids) = torch.get_num_threads(), ops.moe_route(x, wt, experts, k, True)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i in (0, 5, 36):
                one = ops.moe_route(x[i:i + 1], wt, experts, k, True)
                assert torch.equal(one[0][0], all_w[i]) and torch.equal(one[1][0], all_ids[i])
    finally:
        torch.set_num_threads(threads)
    tie_w, tie_ids = ops.moe_route(torch.zeros(1, 96), wt, experts, k, True)   # all logits 0: the lowest ids
    assert tie_ids[0].tolist() == list(range(k)) and torch.allclose(tie_w, torch.full((1, k), 1 / k))
    with pytest.raises(RuntimeError, match="top_k"):
        ops.moe_route(x, wt, experts, experts + 1, True)
    with pytest.raises(RuntimeError, match="router_t"):
        ops.moe_route(x, w, experts, k, True)          # not transposed


def test_config_errors_are_clear():
    from tandem.model.config import ModelConfig
    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
            "num_hidden_layers": 1, "intermediate_size": 32}
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_dict(base)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**base, "num_experts": 4, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="shared experts"):
        ModelConfig.from_hf_dict({**base, "num_experts": 4, "num_experts_per_tok": 2,
                                  "shared_expert_intermediate_size": 16})
    from tandem.bench.vllm_peer import hf_config_dict        # the peers' export: refused, not a dense config
    with pytest.raises(ValueError, match="MoE model for the peers"):
        hf_config_dict(ModelConfig.from_hf_dict({**base, "num_experts": 4, "num_experts_per_tok": 2}))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A Qwen3-MoE of K-quant rows (hidden and expert width 256) as Q8_0, Q4_K_M and K_MIX files."""
    d = tmp_path_factory.mktemp("moe-q")
    hf = make_tiny_model(d / "hf", "qwen3_moe", seed=32, hidden_size=256, moe_intermediate_size=256,
                         intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return hf, {q: write_tiny_gguf(d / f"{q}.gguf", hf, quant=q, with_tokenizer=False)
                for q in ("Q8_0", "Q4_K_M", "K_MIX", "Q5_1", "F16")}


@pytest.mark.skipif(not available(), reason="native kernels not built")
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M", "K_MIX", "Q5_1", "F16"])
def test_quantized_experts_run_on_their_blocks(quant, quantized):
    """Every expert a QLinear over its own slice of the 3-D block (Q6_K ffn_down_exps in layer 0 of Q4_K_M), and
    the expert layer's output near the dequantized torch reference's; a row's bits the same alone and among 40
    (integer types: F16 keeps fp32 activations, whose GEMM past small_m() rows follows the row count)."""
    from tandem.model.config import ModelConfig
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.weights import gguf_weights
    from tandem.model.linear import QLinear
    from tandem.model.llama import LlamaModel
    path = quantized[1][quant]
    c = read_gguf_config(GGUFFile(path))
    assert isinstance(c, ModelConfig) and c.is_moe(0) and not c.is_moe(1)
    native = LlamaModel(c, gguf_weights(path, c, quantized=True), 64, numerics=NATIVE_INT8)
    ref = LlamaModel(c, gguf_weights(path, c, quantized=False), 64)
    moe, moe_ref = native.layers[0]["moe"], ref.layers[0]["moe"]
    assert all(isinstance(lin, QLinear) for lin in moe.linears())
    if quant == "Q4_K_M":
        assert moe.experts[3][1].parts[0].qtype == 14 and moe.experts[3][0].parts[0].qtype == 12
    x = torch.randn(40, c.hidden_size, generator=torch.Generator().manual_seed(2))
    y, y_ref = moe(x), moe_ref(x)
    assert float((y - y_ref).norm() / y_ref.norm()) < 0.05
    for i in (0, 17, 39) if quant != "F16" else ():     # a row's bits alone = among 40 (decode GEMV, prefill GEMM)
        assert torch.equal(moe(x[i:i + 1])[0], y[i])
    # A decode row takes the one-op path (csrc/moe_experts.cpp) where every expert is one packed part: its bits are
    # the op-by-op path's just above; the op's own row loop gives three rows those bits too.
    assert (moe._one_op is not None) == (quant not in ("F16", "Q5_1"))     # no packed copy of these types
    if moe._one_op is not None:
        gus, gu_type, downs, down_type, inter, act = moe._one_op
        w, ids = torch.ops.tandem.moe_route(x[:3], moe.router_t, c.num_experts, c.num_experts_per_tok,
                                            moe.renormalize)
        assert torch.equal(torch.ops.tandem.moe_experts(x[:3], gus, gu_type, downs, down_type, inter, ids, w, act),
                           y[:3])
        with pytest.raises(RuntimeError, match="out of"):
            torch.ops.tandem.moe_experts(x[:1], gus, gu_type, downs, down_type, inter, ids[:1] + 1000, w[:1], act)
    calls = []                                          # only the chosen experts run, each once on its rows

    def counted(e, lin):
        return lambda rows: (calls.append((e, rows.shape[0])), lin(rows))[1]
    moe.experts = [(counted(e, gate_up), down) for e, (gate_up, down) in enumerate(moe.experts)]
    moe._one_op = moe._plan_one_op()                    # wrapped experts: the op-by-op path, counted
    moe(x[:1])
    assert len(calls) == c.num_experts_per_tok and {n for _, n in calls} == {1}
    calls.clear()
    moe(x)
    assert len({e for e, _ in calls}) == len(calls) and sum(n for _, n in calls) == 40 * c.num_experts_per_tok


@pytest.mark.skipif(not available(), reason="native kernels not built")
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_moe_experts_op_on_every_isa_body(quant, quantized):
    """tandem.moe_experts on each ISA body of the packed GEMV (AVX2, AVX-512 where the CPU has it; none is scalar,
    and the op says so) against its composition
    from the single ops on that body (each chosen expert's packed GEMVs and SiLU x up, summed in rank order),
    bit for bit, and against the dequantized torch experts."""
    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.weights import gguf_weights
    from tandem.model.llama import LlamaModel
    path = quantized[1][quant]
    c = read_gguf_config(GGUFFile(path))
    moe = LlamaModel(c, gguf_weights(path, c, quantized=True), 64, numerics=NATIVE_INT8).layers[0]["moe"]
    ref = LlamaModel(c, gguf_weights(path, c, quantized=False), 64).layers[0]["moe"]
    gus, gu_type, downs, down_type, inter, act = moe._one_op
    x = torch.randn(3, c.hidden_size, generator=torch.Generator().manual_seed(5))
    w, ids = torch.ops.tandem.moe_route(x, moe.router_t, c.num_experts, c.num_experts_per_tok, moe.renormalize)
    ops, h = torch.ops.tandem, c.hidden_size
    with pytest.raises(RuntimeError, match="needs AVX2"):
        ops.moe_experts(x, gus, gu_type, downs, down_type, inter, ids, w, act, 0)
    for isa in runnable((1, 2)):
        got = ops.moe_experts(x, gus, gu_type, downs, down_type, inter, ids, w, act, isa)
        for t in range(3):
            row, out = x[t:t + 1], None
            for r, e in enumerate(ids[t].tolist()):
                gu = ops.gemv_packed_q8act(row, gus[e], gu_type, h, 2 * inter, None, isa)
                a = ops.silu_mul(gu, isa)
                y = ops.gemv_packed_q8act(a, downs[e], down_type, inter, h, None, isa) * w[t:t + 1, r:r + 1]
                out = y if out is None else out + y
            assert torch.equal(got[t], out[0]), (isa, t)
        expect = ref(x)
        assert float((got - expect).norm() / expect.norm()) < 0.05, isa
    threads, outs = torch.get_num_threads(), []
    try:        # its GEMVs' thread split (steal.h): the same bits whichever thread takes a piece, oversubscribed too
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(ops.moe_experts(x, gus, gu_type, downs, down_type, inter, ids, w, act))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.skipif(not available(), reason="native kernels not built")
def test_a_row_is_the_same_alone_and_in_a_batch(quantized, tmp_path, monkeypatch, make_llm):
    """Default int8 kernels on Q4_K_M experts: a target's greedy tokens and logprobs the same bits alone and among
    other prompts, in both loops (chunked: 16-token steps)."""
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    llm = make_llm(quantized[1]["Q4_K_M"], max_prefill_tokens=16, cache_dir=str(tmp_path / "cache"),
                   prefix_cache=False)
    ps = prompts_for(1000, n=8, seed=11)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    alone = [run_with(llm, "serial", [p], params)[0] for p in ps[:2]]
    assert all(a.outputs[0].logprobs for a in alone)
    for scheduler in ("serial", "overlap"):
        outs = run_with(llm, scheduler, ps, params)
        for a, o in zip(alone, outs):
            assert o.token_ids == a.token_ids and o.outputs[0].logprobs == a.outputs[0].logprobs


def test_tp_layout_holds_whole_experts_where_the_count_divides():
    """Expert parallelism where tp_size divides the expert count; else each expert split by its width; else refused."""
    from tandem.model.config import ModelConfig
    from tandem.model.shard import TPLayout
    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
            "num_hidden_layers": 1, "intermediate_size": 32, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    c = ModelConfig.from_hf_dict({**base, "num_experts": 8})
    assert [(lay.expert_start, lay.experts, lay.moe_inter) for lay in (TPLayout.of(c, 4, r) for r in range(4))] == [
        (0, 2, 48), (2, 2, 48), (4, 2, 48), (6, 2, 48)]
    c = ModelConfig.from_hf_dict({**base, "num_experts": 6})
    assert [(lay.experts, lay.moe_inter, lay.moe_inter_start) for lay in (TPLayout.of(c, 4, r) for r in range(4))] == [
        (6, 12, 0), (6, 12, 12), (6, 12, 24), (6, 12, 36)]
    c = ModelConfig.from_hf_dict({**base, "num_experts": 6, "moe_intermediate_size": 50})
    with pytest.raises(ValueError, match="neither its 6 experts nor their width 50 are divisible by 4"):
        TPLayout.of(c, 4, 0)


@pytest.mark.skipif(not available(), reason="native kernels not built")
def test_expert_parallel_ranks_add_up_to_the_layer(quantized):
    """tp 2 over 8 experts (shard.py): each rank holds 4 whole experts, their blocks as the file has them, and adds
    the chosen ones it holds in rank order. Top-2, so the two ranks' outputs add up to the whole layer's bit for
    bit; on each rank a decode row's one op gives the row its batch path's bits, and zeros where the rank holds
    neither of its experts."""
    from types import SimpleNamespace

    from tandem.model.gguf.config import read_gguf_config
    from tandem.model.gguf.file import GGUFFile
    from tandem.model.gguf.weights import gguf_weights
    from tandem.model.llama import LlamaModel
    from tandem.model.shard import TPLayout, shard_state
    path = quantized[1]["Q4_K_M"]
    c = read_gguf_config(GGUFFile(path))
    whole = LlamaModel(c, gguf_weights(path, c, quantized=True), 64, numerics=NATIVE_INT8).layers[0]["moe"]
    x = torch.randn(40, c.hidden_size, generator=torch.Generator().manual_seed(7))
    _, ids = torch.ops.tandem.moe_route(x, whole.router_t, c.num_experts, c.num_experts_per_tok, whole.renormalize)
    outs = []
    for r in range(2):
        lay = TPLayout.of(c, 2, r)
        assert (lay.expert_start, lay.experts, lay.moe_inter) == (4 * r, 4, c.moe_intermediate_size)
        state = shard_state(gguf_weights(path, c, quantized=True), c, lay)
        assert not any(f".experts.{e}." in k for k in state for e in range(4 - 4 * r, 8 - 4 * r))
        moe = LlamaModel(c, state, 64, numerics=NATIVE_INT8, tp=SimpleNamespace(size=2, rank=r)).layers[0]["moe"]
        assert moe.held == range(4 * r, 4 * r + 4) and moe._one_op is not None and len(moe.linears()) == 8
        y = moe(x)
        for i in range(40):
            alone = moe(x[i:i + 1])[0]
            assert torch.equal(alone, y[i]), (r, i)
            if not ((ids[i] >= 4 * r) & (ids[i] < 4 * r + 4)).any():
                assert not alone.any()
        outs.append(y)
    assert torch.equal(outs[0] + outs[1], whole(x))


@pytest.mark.skipif(not available(), reason="native kernels not built")
def test_synthetic_qwen3_moe_file(tmp_path, monkeypatch, make_llm):
    """The writer's Qwen3-30B-A3B shape keeps every layer's real shapes and llama.cpp's Q4_K_M types (Q6_K
    ffn_down_exps on use_more_bits layers, an F32 router); a small shape of the same layout loads and decodes."""
    import dataclasses

    from tandem.model.gguf.synthetic import SHAPES, Shape, tensor_types, write_synthetic_gguf
    real = tensor_types(dataclasses.replace(SHAPES["qwen3-30b-a3b"], layers=6))
    assert real["blk.0.ffn_gate_exps.weight"] == ((128, 768, 2048), 12)
    assert real["blk.2.ffn_down_exps.weight"] == ((128, 2048, 768), 14)         # use_more_bits(2, 6)
    assert real["blk.1.ffn_down_exps.weight"] == ((128, 2048, 768), 12)
    assert real["blk.3.ffn_gate_inp.weight"] == ((128, 2048), 0) and real["blk.3.attn_k.weight"][0] == (512, 2048)
    small = Shape("qwen3moe", 2, 256, 512, 4, 2, 49152, False, 1e6, head_dim=64, context=512, experts=8,
                  experts_used=2, expert_width=256, qk_norm=True)
    path = write_synthetic_gguf(str(tmp_path / "moe.gguf"), small)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    llm = make_llm(path, cache_dir=str(tmp_path / "cache"), kv_cache_tokens=1024)
    c = llm.engine.model_config
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("qwen3_moe", 8, 2, 256)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    # the roofline's bound counts the active bytes: of each 3-D expert block only top-k / experts (2 of 8)
    import gguf

    from tandem.bench.roofline import decode_bytes_per_token, quantized_bytes
    exps = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps." in t.name)
    every = quantized_bytes(path, tied=False)["total"]
    assert every - decode_bytes_per_token(path, c, context=0)["weights"] == pytest.approx(exps * 6 / 8, abs=8)


def test_grammar_and_trace_on_an_moe_model(tmp_path_factory, make_llm):
    """A regex-constrained request on the tiny Qwen3-MoE through both loops (the grammar's masks on the logits
    of a model whose MLPs are expert layers), the free rows beside it unchanged, and the trace recorder's device
    spans: one per step, prefill and decode, with every kept token counted."""
    m = tiny_moe("qwen3_moe", tmp_path_factory)
    assert_grammar_row_and_trace(make_llm(m["hf"], device_threads=1), prompts_for(1000, n=3, seed=4))


@pytest.mark.skipif(not available(), reason="native kernels not built")
def test_speculation_changes_no_output(quantized, tmp_path, monkeypatch, make_llm):
    """n-gram speculation on Q4_K_M experts: verify rows route as plain decode rows, so the tokens are the same."""
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    path = quantized[1]["Q4_K_M"]
    ps = [p * 4 for p in prompts_for(1000, n=4, seed=13)]           # repeated text: the n-gram finds drafts
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = make_llm(path, cache_dir=str(tmp_path / "cache"), kv_cache_tokens=2048)
    spec = make_llm(path, cache_dir=str(tmp_path / "cache"), kv_cache_tokens=2048,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    for loop in ("serial", "overlap"):
        want = [o.token_ids for o in run_with(plain, loop, ps, params)]
        assert [o.token_ids for o in run_with(spec, loop, ps, params)] == want, loop
    assert spec.stats()["spec_draft_tokens"] > 0
