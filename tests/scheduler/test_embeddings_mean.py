"""Mean pooling (SamplingParams.pooling="mean", LLM.embed(pooling="mean")): the vector is the mean of the
transformers model's last hidden states (final-normed) over every prompt position, L2-normalized; it is the same bits
alone, batched with generation (speculative too), over several prefill chunks, beside prompt logprobs rows and with
the prompt's prefix already cached (a mean request never takes a prefix-cache hit), under both loops, both executors,
tp and pp; the device's per-row sums start at zero for a row's next request (an aborted one's partial sum dropped);
bad values are refused before anything is queued.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.device.embed import MEAN, OUT, RESET, pooled
from tandem.device.step import StepInput
from tandem.kernels import available
from tests.helpers.engine_checks import run_to_idle
from tests.scheduler.test_embeddings import PROMPTS, alone_runs, drive, q8_gguf  # noqa: F401 (the fixture)

MEAN_EMBED = SamplingParams(max_tokens=1, temperature=0.0, embed=True, pooling="mean")


@pytest.mark.parametrize("backend", ["inline", "process"])
def test_vector_is_the_mean_of_the_models_last_hidden_states(tiny_llama, make_llm, backend):
    from transformers import AutoModelForCausalLM
    llm = make_llm(tiny_llama, device_backend=backend, max_prefill_tokens=32)     # the 93-token prompt: 3 chunks
    outs = llm.embed(PROMPTS, use_tqdm=False, pooling="mean")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    for ids, o in zip(PROMPTS, outs):
        assert o.error is None and o.prompt_token_ids == ids
        v = np.array(o.outputs.embedding)
        assert abs(np.linalg.norm(v) - 1) < 1e-5
        with torch.no_grad():
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().mean(0).numpy()
        np.testing.assert_allclose(v, h / np.linalg.norm(h), atol=2e-4)
    last = llm.embed(PROMPTS[:2], use_tqdm=False)
    assert all(not np.allclose(a.outputs.embedding, b.outputs.embedding) for a, b in zip(outs, last))


@pytest.mark.skipif(not available(), reason="native kernels not built")
@pytest.mark.parametrize("backend,spec", [("inline", None), ("process", None),
                                          ("process", {"method": "ngram", "num_speculative_tokens": 3})])
def test_same_bits_alone_batched_chunked_and_cached(q8_gguf, make_llm, backend, spec):  # noqa: F811
    alone_llm = make_llm(q8_gguf, device_backend=backend, prefix_cache=False)
    alone, gen, gen_alone = alone_runs(alone_llm, "m", MEAN_EMBED)
    # Small step budgets: the 93-token prompt spans several chunks, steps mix decode rows with prefill chunks.
    llm = make_llm(q8_gguf, device_backend=backend, max_prefill_tokens=16, mixed_prefill_tokens=8,
                   speculative_config=spec)
    # The prompts' prefixes already cached (last pooling and a generation share them): mean must compute anyway.
    warm = [(f"w{i}", ids, SamplingParams(max_tokens=1, temperature=0.0, embed=True)) for i, ids in enumerate(PROMPTS)]
    drive(llm, "serial", warm + [("p", PROMPTS[1][:60], SamplingParams(temperature=0.0, max_tokens=2))])
    hits = llm.stats()["prefix_cache_hits"]
    means = [(f"m{i}", ids, MEAN_EMBED) for i, ids in enumerate(PROMPTS)]
    out = drive(llm, "serial", means)
    assert llm.stats()["prefix_cache_hits"] == hits               # every position computed: no hit taken
    assert {k: out[k] for k in alone} == alone
    for loop in ("serial", "overlap"):
        for run in range(2):
            out = drive(llm, loop, gen[:2] + means[:2], later=gen[2:] + means[2:])
            for label, want in {**alone, **gen_alone}.items():
                assert out[label] == want, (loop, run, label)
    assert llm.stats()["prefix_cache_hits"] > hits              # generation hit the cache meanwhile


def test_a_rows_sum_starts_at_zero_for_its_next_request():
    """Device state: an aborted mean request's partial sum (no OUT chunk) is dropped when its row runs another
    request, and restarted by the RESET chunk of the row's next mean request."""
    h = torch.arange(12, dtype=torch.float32).reshape(6, 2)

    def step(rows, ext, seq, embed):
        n = len(rows)
        return StepInput(0, np.array(rows), np.array(ext), np.array(seq), np.zeros(n, np.int64),
                         np.zeros(sum(ext), np.int64), np.zeros(sum(ext), np.int64), np.ones(n), np.ones(n),
                         np.zeros(n, np.int64), np.zeros(n), np.zeros(n, np.int64), np.zeros(0, np.int64),
                         embed=np.array(embed))

    sums: dict = {}
    assert pooled(step([3], [2], [2], [MEAN | RESET]), h[:3], sums) is None and set(sums) == {3}  # aborted here
    assert pooled(step([3], [1], [5], [0]), h[:1], sums) is None and not sums       # row 3 reused: dropped
    pooled(step([3], [2], [2], [MEAN | RESET]), h[:3], sums)                          # again, then aborted
    v = pooled(step([3], [3], [3], [MEAN | RESET | OUT]), h[:4], sums)               # the row's next request
    np.testing.assert_array_equal(v.numpy(), h[1:4].double().mean(0).float()[None].numpy())
    assert not sums


def test_invalid_pooling_is_refused(tiny_llama, make_llm):
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=1, embed=True, pooling="max")
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=4, pooling="mean")            # mean pooling is for embeddings requests
    llm = make_llm(tiny_llama, device_backend="inline")
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("hi", use_tqdm=False, pooling="cls")
    assert llm.embed("hi", use_tqdm=False, pooling="mean")[0].outputs.embedding is not None


def test_mean_rows_beside_prompt_logprobs_rows(tiny_llama, make_llm):
    """A step's hidden states: the rows' last tokens, the prompt logprob positions, then the mean rows' positions;
    each reader takes its own part, so both come out as they do alone."""
    llm = make_llm(tiny_llama, device_backend="inline", max_prefill_tokens=48)
    plp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    eng = llm.engine

    def run(items):
        got, rids = {}, []

        def start():
            for ids, params in items:
                req = eng.make_request(list(ids), params)
                rids.append(req.rid)
                eng.add_request(req, bounded=False)
        run_to_idle(llm, lambda outs: [got.setdefault(o.rid, []).append(o) for o in outs], start)
        return [got[r] for r in rids]

    def prompt_lp(outs):
        return [e for o in outs if o.prompt_logprobs for e in o.prompt_logprobs]

    alone_lp = prompt_lp(run([(PROMPTS[1], plp)])[0])
    alone_v = [run([(ids, MEAN_EMBED)])[0][-1].embedding for ids in PROMPTS]
    both = run([(PROMPTS[1], plp)] + [(ids, MEAN_EMBED) for ids in PROMPTS])
    lp = prompt_lp(both[0])
    assert len(lp) == len(alone_lp) == len(PROMPTS[1]) - 1
    for (c, top), (c0, top0) in zip(lp, alone_lp):
        assert [t for t, _ in top] == [t for t, _ in top0]
        np.testing.assert_allclose([c] + [v for _, v in top], [c0] + [v for _, v in top0], atol=1e-5)
    for outs, a in zip(both[1:], alone_v):
        np.testing.assert_allclose(np.frombuffer(outs[-1].embedding, "<f4"), np.frombuffer(a, "<f4"), atol=1e-6)


def test_tp_and_pp_give_the_same_mean_vectors(tiny_llama, make_llm):
    """tp ranks and the last pipeline stage keep the sums as a single device does: tp 2 up to the all-reduce's
    summation order, pp 2 the same bits."""
    kw = dict(device_threads=1, kv_cache_tokens=4096, max_running_requests=8, max_prefill_tokens=32)
    ref = [np.array(o.outputs.embedding) for o in make_llm(tiny_llama, **kw).embed(PROMPTS, False, "mean")]
    for par in ({"tp_size": 2}, {"pp_size": 2}):
        got = [np.array(o.outputs.embedding) for o in make_llm(tiny_llama, **kw, **par).embed(PROMPTS, False, "mean")]
        for a, b in zip(ref, got):
            if "tp_size" in par:
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
            else:
                np.testing.assert_equal(a, b)


@pytest.mark.parametrize("loop", ["serial", "overlap"])
def test_aborted_mid_prefill_then_the_row_is_reused(tiny_llama, make_llm, loop):
    """A mean request aborted between its chunks leaves a partial sum on its row; the next mean request takes that
    row (the only free one beside a generation's) and starts from zero: its vector is the one it gets alone."""
    llm = make_llm(tiny_llama, device_backend="process", max_prefill_tokens=16, max_running_requests=2)
    eng = llm.engine
    eng.config = eng.config.replace(scheduler=loop)
    alone = llm.embed(PROMPTS[:1], use_tqdm=False, pooling="mean")[0].outputs.embedding
    got: dict = {}
    gen = eng.make_request([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    first = eng.make_request(list(PROMPTS[1]), MEAN_EMBED)
    second = eng.make_request(list(PROMPTS[0]), MEAN_EMBED)

    def sink(outputs):               # the generation's outputs come once a step
        for o in outputs:
            got.setdefault(o.rid, []).append(o)
        if len(got.get(gen.rid, ())) == 3 and second.rid not in got:
            got[second.rid] = []
            eng.abort(first.rid)
            eng.add_request(second, bounded=False)

    run_to_idle(llm, sink, lambda: [eng.add_request(r, bounded=False) for r in (gen, first)])
    assert got[first.rid][-1].finish_reason == "abort" and got[first.rid][-1].embedding is None
    assert second.row == 0 and first.row == 0      # both freed
    np.testing.assert_allclose(np.frombuffer(got[second.rid][-1].embedding, "<f4"), alone, atol=1e-6)
