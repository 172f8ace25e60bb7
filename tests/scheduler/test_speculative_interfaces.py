"""Speculative decoding's interfaces: the proposers, speculative_config checks, the CLI flag, stats and
Prometheus metrics, the server's streamed runs, tensor parallelism, the benchmark's table, and the draft-model
proposer (a draft equal to the target accepts every draft; a random one almost none; outputs equal either way).
"""
from __future__ import annotations

import random

import pytest

import tandem.scheduler.speculative as spec_mod
from tandem import LLM, SamplingParams
from tandem.speculative.ngram import NgramIndex, propose_ngram
from tests.scheduler.test_speculative import (LOOPS, QUOTE, SPEC, Oracle, _mixed_workload, assert_logprobs_close,
                                              configure, greedy, outputs)
from tests.scheduler.test_speculative import spec_llm  # noqa: F401,F811 (a fixture)


def test_ngram_proposer():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 4, 1, 4) == [3, 4, 1, 2]
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 3, 1, 4) == [3, 1, 2]      # most recent match of the longest
    assert propose_ngram([5, 6, 7], 4, 1, 4) == []
    assert propose_ngram([9, 1, 2, 8, 2], 2, 2, 3) == []                       # a 1-token match is below min
    assert propose_ngram([9, 1, 2, 8, 2], 2, 1, 3) == [8, 2]


@pytest.mark.parametrize("vocab", [2, 4, 30, 1000])
def test_ngram_index_equals_the_scan(vocab):
    """The scheduler's incremental index proposes what the reference scan does over truth + assumed tail, as
    prompt and outputs grow and the tail changes every step (small vocabularies: many overlapping matches)."""
    rng = random.Random(vocab)
    for _ in range(300):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        index = NgramIndex(lo, hi)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        out: list[int] = []
        for _ in range(rng.randint(1, 10)):
            out += [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            tail = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            k = rng.randint(0, 7)
            assert index.propose((prompt, out), tail, k) == propose_ngram(prompt + out + tail, k, lo, hi)


@pytest.mark.parametrize("bad, match", [
    ({"method": "eagle"}, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "k": 3}, "unknown field"),
    ({"num_speculative_tokens": 3}, "'method' is required"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "ngram", "model": "x.gguf"}, "'model' is for method 'draft_model'"),
    ("{not json", "not valid JSON"),
    ([1, 2], "JSON object"),
])
def test_bad_config_is_one_clear_error_before_start(bad, match):
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/model", speculative_config=bad)        # refused before the model is even looked for


def test_cli_flag(capsys):
    from tandem.cli import main
    assert main(["generate", "hi", "--model", "/nonexistent", "--speculative-config", '{"method": "x"}']) == 2
    assert "unknown method 'x'" in capsys.readouterr().err
    from tandem.cli import build_parser
    args = build_parser().parse_args(["generate", "hi", "--speculative-config", '{"method": "ngram"}'])
    from tandem.cli import engine_config
    assert engine_config(args).speculative_config.num_speculative_tokens == 4


def test_metrics_and_stats_keys(spec_llm):
    from tandem.server.metrics import ServerMetrics
    stats = spec_llm.stats()
    assert {"spec_draft_tokens", "spec_accepted_tokens"} <= set(stats)
    text = ServerMetrics("m", lambda: [(stats, 0, True)]).render().decode()
    for name in ("tandem:spec_decode_num_draft_tokens_total", "tandem:spec_decode_num_accepted_tokens_total",
                 "tandem:spec_decode_accepted_length_bucket"):
        assert name in text


def test_server_streams_speculative_runs_with_usage(tmp_path):
    """`tandem serve --speculative-config`: a streamed chat on SmolLM2 that quotes its prompt arrives in runs of
    several tokens, equal to speculation off offline, with usage counting every token, and /metrics counts
    drafts and accepted tokens."""
    import json

    import httpx

    from tests.helpers.server_utils import ServerProcess
    chat = [{"role": "user", "content": "Repeat this passage exactly:\n\n" + QUOTE}]
    ref_llm = LLM(kv_cache_tokens=4096)
    try:
        ref = ref_llm.chat(chat, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    finally:
        ref_llm.shutdown()
    srv = ServerProcess(["--kv-cache-tokens", "4096", "--speculative-config", json.dumps(SPEC)],
                        str(tmp_path / "server.log"))
    try:
        client = srv.openai_client()
        chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=chat,
                                                     max_tokens=40, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
        metrics = httpx.get(srv.url + "/metrics", trust_env=False).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("tandem:spec_decode_num")}
        assert values["tandem:spec_decode_num_accepted_tokens_total"] > 0
        assert values["tandem:spec_decode_num_draft_tokens_total"] >= values[
            "tandem:spec_decode_num_accepted_tokens_total"]
        client.close()
    finally:
        assert srv.stop() == 0, srv.log()


def test_tensor_parallel_ranks_keep_the_accepted_token(tiny_llama, monkeypatch):
    """Under tp the other ranks stash what rank 0's acceptance kept (the FutureMap is poisoned)."""
    llm = LLM(tiny_llama, kv_cache_tokens=2048, tp_size=2, device_threads=1, speculative_config=SPEC,
              poison_future_map=True)
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        params = [greedy(20, ignore_eos=True), SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)]
        configure(llm, "overlap", False)
        plain, _ = outputs(llm, prompts, params)
        monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle({tuple(p): o[0] for p, o in zip(prompts, plain)}))
        for loop in LOOPS:
            configure(llm, loop, True)
            assert outputs(llm, prompts, params)[0] == plain
        assert llm.stats()["spec_accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_bench_report_renders():
    from tandem.bench.speculative import render
    out = {"output_len": 8, "threads": 2, "speculative_config": SPEC, "rounds": 1, "throughput_requests": 4,
           "skipped": {}, "tpot_ms": {"a_quote": {"tandem spec off": 20.0, "tandem spec overlap": 9.0,
                                                  "tandem spec serial": 8.0, "llama.cpp plain": 14.0,
                                                  "llama.cpp prompt lookup": 12.0}},
           "spec_stats": {"a_quote": {"spec_draft_tokens": 8, "spec_accepted_tokens": 6, "spec_accepted_len_3": 2,
                                      "tokens": 40}},
           "device_idle_overlap": {"a_quote": 0.03}, "throughput_tok_s": {"off": 100.0, "on": 99.0}}
    md = render(out)
    assert "| a_quote | 20.00 | 9.00 | 8.00 | 14.00 | 12.00 | 0.40x | 0.67x | 0.75 | 4.00 | 3.0 % | - | 40 |" in md
    assert "0.990x" in md
    out["device_idle_overlap_off"] = {"a_quote": 0.04}
    assert "| 3.0 % | 4.0 % | 40 |" in render(out)
    out["tpot_ms"]["a_quote"]["tandem spec overlap, always ahead"] = 10.0
    out["loops"] = {"a_quote": {r: {"device_idle": 0.05, "decode_steps": 30, "ahead": 20, "dropped": 2}
                                for r in ("tandem spec serial", "tandem spec overlap",
                                          "tandem spec overlap, always ahead")}}
    assert "| a_quote | 5.0 % | 30 | 20 / 2 | 5.0 % | 30 | 20 / 2 | 5.0 % | 30 | 20 / 2 | 10.00 |" in render(out)


@pytest.fixture(scope="module")
def other_tiny_llama(tmp_path_factory):
    """Same architecture and tokenizer as tiny_llama, other random weights: a draft that is almost never right."""
    from tests.helpers.tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-other"), "llama", seed=1)


@pytest.mark.parametrize("loop", LOOPS)
def test_draft_model_equal_to_target_accepts_everything(tiny_llama, other_tiny_llama, make_llm, loop):
    """Coupled draws: a draft equal to the target samples what the target samples, greedy and seeded alike; a
    random draft's greedy drafts are almost never right. Outputs equal speculation off either way. (Acceptance
    is measured on greedy rows: a tiny random model's sampled tokens are mostly its noise, which coupled draws
    share, so even the random draft's sampled drafts are often right.)"""
    prompts, _ = _mixed_workload(seed=3)
    plain_params = [greedy(20, ignore_eos=True, logprobs=1 if i % 2 else None) for i in range(len(prompts))]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    rates = {}
    for name, draft in (("same", tiny_llama), ("random", other_tiny_llama)):
        llm = make_llm(tiny_llama, speculative_config={"method": "draft_model", "model": draft,
                                                       "num_speculative_tokens": 3})
        sc = llm.engine.config.speculative_config
        for params in (plain_params, seeded):
            configure(llm, loop, False)
            plain, plain_outs = outputs(llm, prompts, params)
            configure(llm, loop, True, sc)
            before = llm.stats()
            spec, spec_outs = outputs(llm, prompts, params)
            after = llm.stats()
            assert spec == plain
            for a, b in zip(spec_outs, plain_outs):
                if b.outputs[0].logprobs is not None:
                    assert_logprobs_close(a, b)
            rates.setdefault(name, (after["spec_accepted_tokens"] - before["spec_accepted_tokens"])
                             / max(1, after["spec_draft_tokens"] - before["spec_draft_tokens"]))
        drafter = llm.engine.scheduler.spec.drafter
        assert not drafter.state and drafter.kv.available() == drafter.kv.num_slots
        assert drafter.rows.available() == drafter.rows.size
    assert rates["same"] > 0.9 and rates["random"] < 0.2, rates


def test_draft_model_vocabulary_mismatch_is_an_error(tiny_llama, tmp_path):
    from tests.helpers.tiny_models import make_tiny_model
    other = make_tiny_model(tmp_path, "llama", vocab_size=2000)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_llama, kv_cache_tokens=1024, speculative_config={"method": "draft_model", "model": other})
