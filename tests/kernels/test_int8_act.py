"""The int8-activation decode path (kernels_act="int8", the default): every integer block type on every ISA body
this CPU runs against a float64 reference of the same rounding, the dispatch (F16 / BF16 and prefill-sized
inputs keep fp32 activations), the config reaching every quantized linear, and the accuracy gate: next-token
distributions over real text close to the exact mode's (kernels_act="fp32"), and no further from them than
llama.cpp's own on the same GGUF where llama-cpp-python is installed."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.isa import isas
from tests.kernels.test_kernels import assert_close_sum, blocks
from tests.kernels.test_quant_types import weights, whole

from tandem import kernels
from tandem.kernels.quant import (F16, INT8_ACT_QTYPES, MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K,
                                  Q6_K, Q8_0, dequantize_ref, gemm_rows, linear_rows, linear_rows_q8act_ref,
                                  quantize_act_ref,
                                  small_m)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels not built: "
                                f"{kernels.unavailable_reason()}")
TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q8_0": Q8_0, "Q2_K": Q2_K, "Q3_K": Q3_K,
         "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K, "MXFP4": MXFP4}


def test_every_integer_type_reads_int8():
    assert INT8_ACT_QTYPES == frozenset(TYPES.values())


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", isas(vnni=True))
@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (1, 7, 576), (2, 5, 64), (3, 33, 96), (4, 9, 608), (5, 4, 160),
                                     (17, 6, 224), (64, 13, 1536), (200, 3, 512)])
def test_linear_rows_int8_act_equals_reference(name, isa, m, n, k):
    """x rounded to int8 blocks (the reference's rounding, bit for bit), integer block dot products (Q5: the
    fifth bits joined to the nibbles first; K-quants: their 16- or 32-weight sub-block scales); equal to the
    float64 product of the dequantized operands up to fp32 summation order. K covers whole 4-block groups and
    their 2- and 1-block tails (K-quants: K rounded up to whole super-blocks, 256 to 1536). The Python entry
    point takes the same op up to small_m() rows."""
    qtype = TYPES[name]
    k = whole(k, qtype)
    q = blocks(n, k, qtype, seed=m + n) if qtype in (Q4_K, Q6_K) else weights(n, k, qtype, seed=m + n)
    x, bias = torch.randn(m, k) * 3, torch.randn(n)
    x[0, : k // 2] *= 0                                                    # a zero block: dx = 0
    xq, d = quantize_act_ref(x, qtype)
    xd, w = (xq.float() * d).reshape(m, k), dequantize_ref(q.data, q.qtype, k)
    for b in (None, bias):
        y = torch.ops.tandem.linear_rows_q8act(x, q.data, q.qtype, k, b, isa)
        assert y.shape == (m, n)
        assert_close_sum(y, xd, w, linear_rows_q8act_ref(x, q, b))
    if m <= small_m():
        assert torch.equal(linear_rows(x, q, int8_act=True), torch.ops.tandem.linear_rows_q8act(x, q.data, q.qtype, k))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", isas((1, 2), vnni=True))
def test_a_row_is_the_same_at_any_row_count(name, isa):
    """Batch invariance: row r of a 37-row call equals, bit for bit, row r alone and in a 3-row call (the bodies
    pair weight rows and tile rows of x by the call's size; each output's operations stay the same)."""
    qtype = TYPES[name]
    k = whole(608, qtype)
    q = blocks(7, k, qtype, seed=3) if qtype in (Q4_K, Q6_K) else weights(7, k, qtype, seed=3)
    x, bias = torch.randn(37, k), torch.randn(7)
    full = torch.ops.tandem.linear_rows_q8act(x, q.data, q.qtype, k, bias, isa)
    for r in (0, 5, 36):
        assert torch.equal(torch.ops.tandem.linear_rows_q8act(x[r:r + 1], q.data, q.qtype, k, bias, isa), full[r:r + 1])
    assert torch.equal(torch.ops.tandem.linear_rows_q8act(x[4:7], q.data, q.qtype, k, bias, isa), full[4:7])


def test_linear_rows_int8_act_dispatch():
    """int8 activations where the op reads the type: up to small_m() rows by linear_rows_q8act, past gemm_rows() by
    the int8 GEMM where this CPU has its body (else fp32 activations past small_m()); F16 / BF16 weights keep
    fp32."""
    q8, qk, half = blocks(9, 256, Q8_0), blocks(9, 256, Q4_K), weights(9, 256, F16)
    x = torch.randn(3, 256)
    for q in (q8, qk):
        assert torch.equal(linear_rows(x, q, int8_act=True), torch.ops.tandem.linear_rows_q8act(x, q.data, q.qtype, 256))
        assert not torch.equal(linear_rows(x, q, int8_act=True), linear_rows(x, q))
    assert torch.equal(linear_rows(x, half, int8_act=True), linear_rows(x, half))
    big = torch.randn(small_m() + 1, 256)
    gemm = torch.ops.tandem.gemm_rows_q8act(big, q8.data, Q8_0, 256) if big.shape[0] > gemm_rows(Q8_0) else linear_rows(big, q8)
    assert torch.equal(linear_rows(big, q8, int8_act=True), gemm)
    with pytest.raises(RuntimeError, match="int8 activations support"):
        torch.ops.tandem.linear_rows_q8act(x, half.data, F16, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.tandem.linear_rows_q8act(torch.randn(1, 96), blocks(2, 256, Q6_K).data, Q6_K, 96)


def _tiny_gguf(tmp_path, monkeypatch, quant: str) -> str:
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf
    skip_gguf_tokenizer_build(monkeypatch)
    hf = make_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512)
    return str(write_tiny_gguf(tmp_path / f"t-{quant}.gguf", hf, quant=quant, with_tokenizer=False))


@pytest.mark.parametrize("quant", ["Q4_K_M", "K_MIX", "Q8_0"])
def test_default_reaches_every_quantized_linear(tmp_path, make_llm, monkeypatch, quant):
    """The default config builds every quantized linear (every part of a fused one) with int8 activations and
    decodes; kernels_act="fp32" builds none; a bad value is refused."""
    from tandem import SamplingParams
    from tandem.config import EngineConfig
    assert EngineConfig().kernels_act == "int8"
    path = _tiny_gguf(tmp_path, monkeypatch, quant)
    for act in ("int8", "fp32"):
        kw = {} if act == "int8" else {"kernels_act": "fp32"}
        llm = make_llm(path, cache_dir=str(tmp_path / "cache"), device_backend="inline", **kw)
        model = llm.engine.executor.model_runner.model
        linears = [model.lm_head] + [layer[k] for layer in model.layers for k in ("qkv", "o", "gate_up", "down")]
        assert all(lin.int8_act == (act == "int8") for lin in linears)
        assert {p.qtype for lin in linears for p in lin.parts} <= INT8_ACT_QTYPES
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 4
        llm.shutdown()
    with pytest.raises(ValueError, match="kernels_act"):
        EngineConfig(kernels_act="int4")


def _text_ids(tok, n: int) -> list[int]:
    from tandem.bench.accuracy import real_text
    ids: list[int] = []
    for doc in real_text(6 * n):
        ids += tok.encode(doc)
        if len(ids) >= n:
            return ids[:n]
    raise AssertionError("not enough text")


def test_accuracy_gate_on_a_tiny_k_quant_model(tmp_path, make_llm, monkeypatch):
    """The gate's measurement on a tiny model written with every K-quant: teacher-forced over real text, the
    default's next-token distributions differ from the exact mode's (the rounding is really there) by a small
    KL divergence, and the rounding-free exact mode measured against itself gives zero."""
    from tandem.bench.accuracy import divergence, teacher_forced_logprobs
    path = _tiny_gguf(tmp_path, monkeypatch, "K_MIX")
    lp = {}
    for act in ("fp32", "int8"):
        llm = make_llm(path, kernels_act=act, cache_dir=str(tmp_path / "cache"), device_backend="inline",
                       max_prefill_tokens=min(64, small_m()))
        ids = _text_ids(llm.tokenizer, 300)
        lp[act] = teacher_forced_logprobs(llm, ids)
        if act == "fp32":
            assert divergence(lp[act], teacher_forced_logprobs(llm, ids)).kl_mean == 0.0
        llm.shutdown()
    d = divergence(lp["fp32"], lp["int8"])
    assert d.tokens == 299
    assert 0.0 < d.kl_mean < 1e-3 and d.top1_agree > 0.9, d


@pytest.fixture(scope="module")
def smollm_int8():
    """The real default model in the default mode (int8 activations)."""
    from tandem import LLM
    llm = LLM(poison_future_map=True, device_backend="inline", max_prefill_tokens=min(64, small_m()))
    yield llm
    llm.shutdown()


def test_real_model_default_mode_gate(smollm_int8):
    """SmolLM2 (Q4_1 + Q8_0 head) over 512 tokens of real text: KL from the exact mode small, top-1 agreement
    high; where llama-cpp-python is installed, no larger than llama.cpp's own KL on the same file (with a 5 %
    allowance: the two round activations the same way, so on this short text they measure within noise of
    each other; benchmarks/kl_divergence.py runs the full gate over >= 4k tokens)."""
    from tandem.bench.accuracy import divergence, teacher_forced_logprobs
    from tandem import LLM
    assert smollm_int8.engine.config.kernels_act == "int8"
    ids = _text_ids(smollm_int8.tokenizer, 512)
    exact = LLM(kernels_act="fp32", device_backend="inline", max_prefill_tokens=min(64, small_m()))
    try:
        ref = teacher_forced_logprobs(exact, ids)
    finally:
        exact.shutdown()
    d = divergence(ref, teacher_forced_logprobs(smollm_int8, ids))
    assert d.kl_mean < 0.01 and d.top1_agree > 0.9, d
    try:
        from llama_cpp import Llama
    except ImportError:
        return
    from tandem.bench.accuracy import llama_cpp_logprobs
    from tandem.model.loader import default_model_path
    llama = Llama(default_model_path(), logits_all=True, n_ctx=1024, n_threads=2, verbose=False)
    peer = divergence(ref, llama_cpp_logprobs(llama, ids))
    assert d.kl_mean <= 1.05 * peer.kl_mean, (d, peer)


def test_real_model_default_mode_serial_equals_overlap_and_agrees(smollm, smollm_int8):
    """The default mode's greedy outputs: the same through both loops on one engine (the second run is served
    by the prefix cache: a cached prompt's last token is recomputed alone, and gives what the fresh prefill
    gave), and mostly the exact mode's (reported in full by benchmarks/kl_divergence.py)."""
    from tests.helpers.engine_checks import run_with
    from tandem import SamplingParams
    tok = smollm.tokenizer
    prompts = [tok.encode(t) for t in ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
                                       "Once upon a time"]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    serial = run_with(smollm_int8, "serial", prompts, params)
    overlap = run_with(smollm_int8, "overlap", prompts, params)
    assert [o.token_ids for o in serial] == [o.token_ids for o in overlap]
    exact = run_with(smollm, "overlap", prompts, params)
    first = [o.token_ids[0] for o in exact]
    assert sum(a == b for a, b in zip(first, [o.token_ids[0] for o in serial])) >= 3
    # (The chat "What is the capital of France?" is a near-tie at its first token in the exact mode: "The"
    # -1.88 against "L" -1.96. The default mode, like llama.cpp on the same file, answers "L'Étoile, ...".)
