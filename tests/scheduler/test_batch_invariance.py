"""Same request, same bits, under any traffic (batch invariance: tandem/model/attention_paths.py states the rule).

Target requests (greedy, seeded, penalties, a grammar, n = 2, long prompts that are chunked, top logprobs) run
alone, one at a time; then again inside random traffic: prompts of 1-300 tokens arriving at random steps, aborts,
chunked prefill (small step budgets), mixed steps, prefix-cache hits on the targets' own prompts, retraction under
a small KV cache, both loops, 1 and 2 device threads, speculation. Every target's tokens and logprobs must be the
same bits as alone, through the engine and through the server (official openai client, concurrent streams).
Quantized GGUF files (Q8_0, every K-quant, Q5_1) with the default int8 kernels: the mode whose paths differ by
step size unless the rule holds; and a hybrid model's (linear-attention states carried across chunks, resumed from
state checkpoints, retracted).
"""
from __future__ import annotations

import random
import threading

import pytest

from tandem import SamplingParams
from tandem.kernels import available
from tests.helpers.engine_checks import assert_no_leaks, count_attention_calls, run_to_idle
from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf

pytestmark = pytest.mark.skipif(not available(), reason="native kernels not built")
VOCAB = 1000


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """A tiny Llama (hidden 256: K-quant rows; 4 layers, 256 positions of RoPE) as Q8_0, K_MIX and Q5_1 files; a
    tiny hybrid (Qwen3.5-MoE: linear-attention layers, a shared expert) as Q8_0; a tiny Gemma 4 (a KV cache of two
    shapes, V as K, per-layer inputs, KV-shared layers) as Q8_0."""
    from tests.helpers.tiny_gemma4 import make_tiny_gemma4, write_gemma4_gguf
    from tests.helpers.tiny_hybrid import write_hybrid_gguf
    d = tmp_path_factory.mktemp("inv")
    hf = make_tiny_model(d / "hf", "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    files = {q: str(write_tiny_gguf(d / f"{q}.gguf", hf, quant=q)) for q in ("Q8_0", "K_MIX", "Q5_1")}
    hybrid = make_tiny_model(d / "hybrid", "qwen3_5_moe", seed=5, max_position_embeddings=1024)
    files["hybrid_Q8_0"] = write_hybrid_gguf(d / "hybrid.gguf", hybrid, quant="Q8_0", with_tokenizer=True)
    gemma4 = make_tiny_gemma4(d / "gemma4", seed=5, max_position_embeddings=1024, attention_k_eq_v=True,
                              num_global_key_value_heads=1, hidden_size_per_layer_input=32)   # Q8_0 rows: 32 wide
    files["gemma4_Q8_0"] = write_gemma4_gguf(d / "gemma4.gguf", gemma4, quant="Q8_0")
    return files


def targets(rng: random.Random) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests whose outputs are compared; prompts of 4 to 260 tokens (past small_m(): chunked under load)."""
    def ids(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]
    lp = dict(logprobs=3, ignore_eos=True)
    return [
        ("greedy", ids(5), SamplingParams(temperature=0, max_tokens=12, **lp)),
        ("long", ids(260), SamplingParams(temperature=0, max_tokens=10, **lp)),
        ("seeded", ids(120), SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, **lp)),
        ("penalties", ids(40), SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.3,
                                              repetition_penalty=1.1, max_tokens=12, **lp)),
        ("grammar", ids(30), SamplingParams(temperature=0.9, seed=5, max_tokens=12, logprobs=2,
                                            structured_outputs={"regex": "[a-z]{3,9}( [a-z]{2,6}){1,3}"})),
        ("n2", ids(70), SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, **lp)),
    ]


def drive(llm, scheduler: str, initial: list, events: dict[int, list]) -> dict:
    """Run the engine: `initial` (label, ids, params) up front, events[n] at the n-th processed step (("add",
    label, ids, params) or ("abort", label)). n > 1 requests are their samples, labelled label/i. Returns
    label -> (token ids, logprobs, finish reason)."""
    eng = llm.engine
    eng.config = eng.config.replace(scheduler=scheduler)
    rid_of, out, steps = {}, {}, [0]

    def add(label, ids, params):
        for i in range(params.n):
            req = eng.make_request(ids, params.sample(i))
            name = label if params.n == 1 else f"{label}/{i}"
            rid_of[req.rid] = name
            out[name] = ([], [], None)
            eng.add_request(req, bounded=False)

    def sink(outputs):
        for o in outputs:
            toks, lps, _ = out[rid_of[o.rid]]
            out[rid_of[o.rid]] = (toks + o.new_token_ids, lps + (o.logprobs or []), o.finish_reason)
        steps[0] += 1
        for ev in events.get(steps[0], []):
            if ev[0] == "add":
                add(*ev[1:])
            elif ev[1] in rid_of.values():
                eng.abort(next(r for r, lab in rid_of.items() if lab == ev[1]))

    run_to_idle(llm, sink, lambda: [add(*r) for r in initial])
    assert_no_leaks(llm)
    return out


def traffic(rng: random.Random, tgts: list) -> tuple[list, dict[int, list]]:
    """The targets among 14 background requests (1-300 tokens; some share a target's prompt or its prefix),
    arriving over the first 30 steps, 4 of them aborted."""
    bg = []
    for i in range(14):
        n = rng.choice([1, 2, rng.randrange(3, 60), rng.randrange(60, 300)])
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        if i % 5 == 0:                                           # a prefix-cache hit on a target's prompt
            ids = rng.choice(tgts)[1][:rng.randrange(1, 30)] + ids[:20]
        p = SamplingParams(temperature=rng.choice([0, 0.9]), seed=rng.randrange(100), max_tokens=rng.randrange(1, 40),
                           ignore_eos=True)
        bg.append((f"bg{i}", ids, p))
    everyone = bg + tgts
    rng.shuffle(everyone)
    initial, events = everyone[:5], {}
    for r in everyone[5:]:
        events.setdefault(rng.randrange(1, 30), []).append(("add",) + r)
    for label in rng.sample([r[0] for r in bg], 4):
        events.setdefault(rng.randrange(1, 40), []).append(("abort", label))
    return initial, events


def assert_same(alone: dict, loaded: dict, tgts: list) -> None:
    names = [n for n in loaded if n.split("/")[0] in {t[0] for t in tgts}]
    assert len(names) == len(alone) == 7
    for n in names:
        toks, lps, reason = loaded[n]
        assert reason == alone[n][2] and reason in ("length", "stop"), (n, reason)   # stop: the grammar ended
        assert toks == alone[n][0], n
        assert lps == alone[n][1], n                 # the token's logprob and its top alternatives, bit for bit


@pytest.mark.parametrize("quant,alone_kw,load_kw", [
    ("Q8_0", dict(device_threads=1, scheduler="serial"),
     dict(device_threads=2, scheduler="overlap", max_prefill_tokens=64, mixed_prefill_tokens=32)),
    ("K_MIX", dict(device_threads=2, scheduler="overlap"),
     dict(device_threads=1, scheduler="serial", max_prefill_tokens=200, kv_cache_tokens=900)),
    ("Q5_1", dict(device_threads=2, scheduler="serial"),
     dict(device_threads=2, scheduler="overlap", max_prefill_tokens=48, kv_cache_tokens=900,
          speculative_config={"method": "ngram", "num_speculative_tokens": 3})),
    ("hybrid_Q8_0", dict(device_threads=1, scheduler="serial"),     # states resumed from checkpoints, retracted
     dict(device_threads=2, scheduler="overlap", max_prefill_tokens=48, kv_cache_tokens=400,
          hybrid_checkpoint_tokens=16, speculative_config={"method": "ngram", "num_speculative_tokens": 3})),
    ("gemma4_Q8_0", dict(device_threads=1, scheduler="serial"),
     dict(device_threads=2, scheduler="overlap", max_prefill_tokens=48, kv_cache_tokens=900,
          speculative_config={"method": "ngram", "num_speculative_tokens": 3})),
])
def test_targets_alone_and_in_random_traffic(ggufs, make_llm, quant, alone_kw, load_kw):
    rng = random.Random(quant)
    tgts = targets(rng)
    llm = make_llm(ggufs[quant], device_backend="process", max_running_requests=8, **alone_kw)
    alone = {}
    for t in tgts:                                               # each alone, the prefix cache cold for it
        alone.update(drive(llm, alone_kw["scheduler"], [t], {}))
    llm.shutdown()
    llm = make_llm(ggufs[quant], device_backend="process", max_running_requests=8, **load_kw)
    for round_ in range(2):                                      # the second round hits the prefix cache more
        initial, events = traffic(rng, tgts)
        assert_same(alone, drive(llm, load_kw["scheduler"], initial, events), tgts)


def test_server_streams_under_concurrent_traffic(ggufs, tmp_path):
    """Through `tandem serve` with the official openai client: each target alone, then again while 6 clients
    stream other prompts at the same time; the same tokens and logprobs."""
    from tests.helpers.server_utils import ServerProcess
    srv = ServerProcess(["--model", ggufs["Q8_0"], "--served-model-name", "tiny", "--max-prefill-tokens", "64",
                         "--kv-cache-tokens", "4096"], str(tmp_path / "server.log"))
    client = srv.openai_client()
    rng = random.Random(1)
    words = "alpha beta gamma delta river stone cloud light table seven open north".split()
    prompts = [" ".join(rng.choice(words) for _ in range(n)) for n in (3, 150, 40)]
    kw = [dict(temperature=0), dict(temperature=0.8, seed=4), dict(temperature=0.9, seed=9, presence_penalty=0.4)]

    def ask(prompt, extra):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, logprobs=3, **extra)
        c = r.choices[0]
        return c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs

    try:
        alone = [ask(p, k) for p, k in zip(prompts, kw)]
        stop = threading.Event()

        def noise(i):
            r = random.Random(i)
            while not stop.is_set():
                text = " ".join(r.choice(words) for _ in range(r.randrange(1, 200)))
                for _ in client.completions.create(model="tiny", prompt=text, max_tokens=r.randrange(1, 30),
                                                   stream=True, temperature=0.7):
                    pass
        threads = [threading.Thread(target=noise, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        try:
            loaded = [ask(p, k) for p, k in zip(prompts, kw) for _ in range(2)]
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert loaded == [a for a in alone for _ in range(2)]
    finally:
        client.close()
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("scheduler", ["serial", "overlap"])
def test_an_earlier_answer_in_the_prompt_gets_the_bits_it_gets_alone(ggufs, make_llm, scheduler):
    """A multi-turn prompt holds an earlier answer whose KV the prefix cache got from decode steps, while on an
    empty cache the same tokens attend as prompt tokens (the causal op): one arithmetic, so the second turn hits
    the first turn's prompt and answer (all but the answer's last token, whose KV was never written) and answers
    as on an empty cache, bit for bit."""
    rng = random.Random(5)
    first = [rng.randrange(3, VOCAB) for _ in range(90)]
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)

    def run(llm, prompts):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm = make_llm(ggufs["K_MIX"], device_backend="inline", scheduler=scheduler)
    answer = run(llm, [first])[0][0]
    second = first + list(answer) + [rng.randrange(3, VOCAB) for _ in range(40)]
    hits = llm.engine.scheduler.memory.prefix_hits
    warm = run(llm, [second])
    hits = llm.engine.scheduler.memory.prefix_hits - hits
    llm.shutdown()
    cold = make_llm(ggufs["K_MIX"], device_backend="inline", scheduler=scheduler)
    assert run(cold, [second]) == warm
    assert hits == len(first) + len(answer) - 1  # the first prompt's KV and the answer's


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_retraction_recomputes_outputs_as_decode_rows(ggufs, make_llm, monkeypatch, prefix_cache):
    """A KV cache too small for every request: retracted requests come back and recompute what the cache no
    longer holds, prompt tokens and outputs alike by the causal op (the decode op's bits) in the same chunks;
    every token and logprob as with a cache that holds them all. The extend op (another order) never runs."""
    calls = count_attention_calls(monkeypatch, "extend_attention")
    rng = random.Random(9)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(40 + 9 * i)] for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True)

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp, use_tqdm=False)]
    want = run(make_llm(ggufs["Q8_0"], device_backend="inline"))
    assert calls["n"] == 0
    small = make_llm(ggufs["Q8_0"], device_backend="inline", kv_cache_tokens=420, prefix_cache=prefix_cache)
    assert run(small) == want
    assert small.engine.scheduler.retractions > 0 and calls["n"] == 0
