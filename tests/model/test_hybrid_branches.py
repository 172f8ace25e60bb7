"""The engine's branches on a hybrid linear-attention model. Speculative decoding changes no output: a verify run
advances the request's state by its drafts, and the rejected ones are taken back out of it (model/verify_runs.py);
greedy and seeded requests, both loops, accepted runs and rejections at every draft position; a chat's next turn
resumed from the checkpoint a speculating request left is the bits computed from scratch; the combinations not
followed yet are refused by name. A grammar row beside free rows, and the trace of both loops."""
from __future__ import annotations

import random

import pytest

import tandem.scheduler.speculative as spec_mod
from tandem import LLM, SamplingParams
from tests.helpers.engine_checks import assert_grammar_row_and_trace, assert_no_leaks
from tests.helpers.tiny_models import skip_gguf_tokenizer_build
from tests.model.test_hybrid import tiny_hybrid
from tests.model.test_parity import prompts_for
from tests.scheduler.test_speculative import Oracle, configure, pin_row_cost

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}


def _params(n: int) -> list[SamplingParams]:
    rng = random.Random(1)
    return [SamplingParams(temperature=0, max_tokens=rng.randrange(10, 20), ignore_eos=True, logprobs=2)
            if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(1000), max_tokens=rng.randrange(10, 20),
                           ignore_eos=True, logprobs=1) for i in range(n)]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [(o.token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("source, kernels, invariant", [("q8", "native", True), ("hf", "torch", True),
                                                       ("q8", "native", False)])
def test_speculation_changes_no_output(source, kernels, invariant, tmp_path_factory, tmp_path, monkeypatch,
                                       make_llm):
    """Q8_0 on the native kernels: the same tokens and logprobs, bit for bit (their rows do not depend on the row
    count); the torch path: the same tokens (its linears round the last bit by row count). Without batch
    invariance prompts take the chunked delta rule, and a verify run, shorter than any chunk, the recurrent bits
    the replay gives back."""
    from tandem.model.numerics import LINEAR_CHUNK
    from tandem.speculative.config import MAX_SPECULATIVE_TOKENS
    assert MAX_SPECULATIVE_TOKENS + 1 < LINEAR_CHUNK
    m = tiny_hybrid("qwen3_5_moe", tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    llm = make_llm(m[source], kv_cache_tokens=4096, max_running_requests=8, kernels=kernels, max_prefill_tokens=48,
                   poison_future_map=True, cache_dir=str(tmp_path / "cache"), speculative_config=SPEC,
                   batch_invariant=invariant)
    pin_row_cost(llm, monkeypatch)
    prompts = prompts_for(m["ref"].config.vocab_size, n=6, seed=11) + [list(range(5, 80))]   # 75: chunks of 32
    params = _params(len(prompts))
    for loop in ("serial", "overlap"):
        configure(llm, loop, False)
        plain = _run(llm, prompts, params)
        truth = {tuple(p): o[0] for p, o in zip(prompts, plain)}
        monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle(truth, wrong=0.4, seed=len(loop)))
        configure(llm, loop, True, SPEC)
        before = llm.stats()
        spec = _run(llm, prompts, params)
        after = llm.stats()
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        assert 0 < accepted < drafted, (drafted, accepted)        # runs kept whole and runs taken back
        for (a, la), (b, lb) in zip(spec, plain):
            assert a == b, loop
            if kernels == "native":
                assert la == lb, loop


def test_a_speculated_turn_resumes_as_computed_from_scratch(tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """The checkpoint a speculating request leaves at its end holds only the tokens it kept: the next turn resumed
    from it gives the bits of the whole conversation computed in one piece without the cache."""
    m = tiny_hybrid("qwen3_next", tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    kw = dict(kv_cache_tokens=4096, max_running_requests=8, max_prefill_tokens=512, cache_dir=str(tmp_path / "cache"))
    prompts = prompts_for(m["ref"].config.vocab_size, n=3, seed=5)
    first = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = make_llm(m["q8"], prefix_cache=False, **kw)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, plain.generate(prompts, first, use_tqdm=False))}
    nexts = [p + truth[tuple(p)] + [7, 8, 9, 10] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    fresh = _run(plain, nexts, params)
    plain.shutdown()
    llm = make_llm(m["q8"], speculative_config=SPEC, **kw)
    pin_row_cost(llm, monkeypatch)
    monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle(truth, wrong=0.5, seed=3))
    before = llm.stats()
    assert [o.token_ids for o in llm.generate(prompts, first, use_tqdm=False)] == [truth[tuple(p)] for p in prompts]
    after = llm.stats()
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] < after["spec_draft_tokens"] - \
        before["spec_draft_tokens"]                               # some runs were taken back before the finish
    restored = after["state_checkpoints_restored"]
    assert _run(llm, nexts, params) == fresh
    assert llm.stats()["state_checkpoints_restored"] - restored == len(nexts)


def test_refused_combinations(tmp_path_factory, tmp_path, monkeypatch):
    """Under tp only rank 0 samples, so the other ranks' states would keep rejected drafts; a hybrid draft model's
    own state would keep the drafts the target rejects."""
    m = tiny_hybrid("qwen3_5", tmp_path_factory)
    with pytest.raises(ValueError, match="tp_size > 1"):
        LLM(m["hf"], tp_size=2, speculative_config=SPEC)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    from tandem.speculative.draft import DraftModel
    from tandem.model.loader import load_tokenizer, resolve_model
    target = resolve_model(m["hf"], None)
    with pytest.raises(ValueError, match="draft model is a hybrid"):
        DraftModel(m["hf"], target.config, load_tokenizer(target), 2, 256, 256, "torch")


def test_grammar_rows_and_the_trace(tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """A regex-constrained row among free ones: the free rows' tokens are those they get alone, the constrained one
    matches; every step of both loops is in the trace."""
    m = tiny_hybrid("qwen3_5", tmp_path_factory)
    skip_gguf_tokenizer_build(monkeypatch, str(tmp_path / "cache"))
    llm = make_llm(m["q8"], device_threads=1, max_prefill_tokens=16, cache_dir=str(tmp_path / "cache"))
    assert_grammar_row_and_trace(llm, prompts_for(m["ref"].config.vocab_size, n=3, seed=4))
