"""Embeddings through the engine (SamplingParams.embed, LLM.embed): prefill-only requests in the same scheduler as
generation. A vector is the transformers model's last hidden state (final-normed) of the prompt's last token,
L2-normalized; it is the same bits alone, batched with generation, chunked, on a prefix-cache hit, under both
loops and both executors; generation beside it is unchanged; bad requests are refused before anything is queued.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.kernels import available
from tests.helpers.engine_checks import assert_no_leaks, run_to_idle
from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf

EMBED = SamplingParams(max_tokens=1, temperature=0.0, embed=True)
PROMPTS = [[5, 9, 12, 40, 7], [3] * 3 + list(range(100, 190)), [11]]


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> str:
    """A tiny Llama as Q8_0 with the native kernels: the mode the batch-invariance rule covers
    (tandem/model/attention_paths.py; float32 torch linears give a row other bits at other row counts)."""
    d = tmp_path_factory.mktemp("emb")
    hf = make_tiny_model(d / "hf", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return str(write_tiny_gguf(d / "q8.gguf", hf, quant="Q8_0"))


def alone_runs(llm, tag: str, params: SamplingParams) -> tuple[dict, list, dict]:
    """Each of PROMPTS embedded alone (checked: no tokens, finished, a 128-wide vector), four generation requests,
    and each of those alone: what the batched runs must reproduce bit for bit."""
    alone = {f"{tag}{i}": drive(llm, "serial", [(f"{tag}{i}", ids, params)])[f"{tag}{i}"]
             for i, ids in enumerate(PROMPTS)}
    for v in alone.values():
        assert v[0] == [] and v[2] == "stop" and len(v[1]) == 4 * 128
    gen = [(f"g{i}", [20 + i, 30 + i] * (2 + 9 * i), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
           for i in range(4)]
    return alone, gen, {g[0]: drive(llm, "serial", [g])[g[0]] for g in gen}


def drive(llm, loop: str, items: list, later: list = ()) -> dict:
    """Run (label, ids, params) requests (`later` ones added after the first processed step) on the engine's own
    loop; label -> (output ids, embedding bytes, finish reason)."""
    eng = llm.engine
    eng.config = eng.config.replace(scheduler=loop)
    label_of, out, pending = {}, {}, list(later)

    def add(label, ids, params):
        req = eng.make_request(ids, params)
        label_of[req.rid] = label
        out[label] = ([], None, None)
        eng.add_request(req, bounded=False)

    def sink(outputs):
        for o in outputs:
            toks, emb, _ = out[label_of[o.rid]]
            out[label_of[o.rid]] = (toks + o.new_token_ids, o.embedding or emb, o.finish_reason)
        while pending:
            add(*pending.pop())

    run_to_idle(llm, sink, lambda: [add(*item) for item in items])
    assert_no_leaks(llm)
    return out


@pytest.mark.parametrize("backend", ["inline", "process"])
def test_vector_is_the_models_last_hidden_state(tiny_llama, make_llm, backend):
    from transformers import AutoModelForCausalLM
    llm = make_llm(tiny_llama, device_backend=backend)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    for ids, o in zip(PROMPTS, outs):
        assert o.error is None and o.prompt_token_ids == ids
        v = np.array(o.outputs.embedding)
        assert v.shape == (model.config.hidden_size,)
        assert abs(np.linalg.norm(v) - 1) < 1e-5
        with torch.no_grad():
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].double().numpy()
        np.testing.assert_allclose(v, h / np.linalg.norm(h), atol=2e-4)


@pytest.mark.skipif(not available(), reason="native kernels not built")
@pytest.mark.parametrize("backend,spec", [("inline", None), ("process", None),
                                          ("process", {"method": "ngram", "num_speculative_tokens": 3})])
def test_same_bits_alone_batched_chunked_and_cached(q8_gguf, make_llm, backend, spec):
    alone_llm = make_llm(q8_gguf, device_backend=backend, prefix_cache=False)
    alone, gen, gen_alone = alone_runs(alone_llm, "e", EMBED)
    # Small step budgets: the 93-token prompt is chunked and steps mix decode rows with prefill chunks.
    llm = make_llm(q8_gguf, device_backend=backend, max_prefill_tokens=32, mixed_prefill_tokens=16,
                   speculative_config=spec)
    embeds = [(f"e{i}", ids, EMBED) for i, ids in enumerate(PROMPTS)]
    for loop in ("serial", "overlap"):
        for run in range(2):            # the second run hits the prefix cache the first one filled
            out = drive(llm, loop, gen[:2] + embeds[:1], later=gen[2:] + embeds[1:])
            for label, want in {**alone, **gen_alone}.items():
                assert out[label] == want, (loop, run, label)
    assert llm.stats()["prefix_cache_hits"] > 0


def test_invalid_embeddings_requests_are_refused(tiny_llama, make_llm):
    with pytest.raises(ValueError, match="embed"):
        SamplingParams(max_tokens=4, embed=True)
    with pytest.raises(ValueError, match="embed"):
        SamplingParams(max_tokens=1, embed=True, logprobs=2)
    llm = make_llm(tiny_llama, device_backend="inline")
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]], use_tqdm=False)
    assert llm.embed("hi", use_tqdm=False)[0].outputs.embedding is not None      # the engine is untouched


def test_tp_and_pp_give_the_same_vectors(tiny_llama, make_llm):
    """tp rank 0 and the last pipeline stage hold the whole final hidden state: tp 2 gives tp 1's vectors up to
    the all-reduce's summation order, pp 2 the same bits. Stages on several nodes are refused."""
    kw = dict(device_threads=1, kv_cache_tokens=4096, max_running_requests=8)
    ref = [np.array(o.outputs.embedding) for o in make_llm(tiny_llama, **kw).embed(PROMPTS, use_tqdm=False)]
    for par in ({"tp_size": 2}, {"pp_size": 2}):
        llm = make_llm(tiny_llama, **kw, **par)
        got = [np.array(o.outputs.embedding) for o in llm.embed(PROMPTS, use_tqdm=False)]
        for a, b in zip(ref, got):
            if "tp_size" in par:
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
            else:
                np.testing.assert_equal(a, b)
    eng = llm.engine
    config = eng.config
    eng.config = config.replace(nnodes=2, dist_init_addr="127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match="several nodes"):
            eng.make_request([5, 6], EMBED)
    finally:
        eng.config = config


def test_vector_crosses_the_replica_ipc():
    """Data parallelism (LLM(dp_size=...), serve --dp): a StepOutput's vector travels as its bytes."""
    from tandem.device.embed import normalized, vector
    from tandem.replicas import ipc
    from tandem.request import StepOutput
    data = normalized(np.arange(1, 9, dtype=np.float32))
    msg = ipc.decode(ipc.encode(ipc.Outputs([StepOutput("r", [], True, "stop", embedding=data)], {})))
    assert msg.outputs[0].embedding == data and abs(np.linalg.norm(vector(data)) - 1) < 1e-6
