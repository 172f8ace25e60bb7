"""Speculative decoding changes no output: with speculation on, greedy and seeded requests give the same tokens,
finish reasons, texts and (to float rounding) logprobs as with it off, on both loops, with stops inside accepted
runs, retraction, aborts, the FutureMap poisoned, and no leaked slot or row.

Random tiny models seldom repeat themselves, so most tests drive the verifier with a proposer that knows the
plain output (drafts mostly right, some corrupted: long accepted runs and rejections) or proposes garbage; the
real SmolLM2 runs the real n-gram proposer on a quoting prompt.
"""
from __future__ import annotations

import random

import pytest

import tandem.scheduler.speculative as spec_mod
import tandem.speculative.speculation as speculation
from tests.helpers.engine_checks import assert_no_leaks
from tandem import LLM, SamplingParams
from tests.scheduler.test_overlap import run_script

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
LOOPS = ("serial", "overlap")


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def configure(llm, loop: str, on: bool, spec: dict | None = None) -> None:
    llm.engine.config = llm.engine.config.replace(scheduler=loop, speculative_config=(spec or SPEC) if on else None)


def pin_row_cost(llm, monkeypatch) -> None:
    """How many tokens a step drafts depends on the row cost measured from device step times (observe_step): pinned
    at its prior, so that counts of drafts (and of steps picked ahead) do not follow the machine's load (one failed
    on a shared CPU; a timing outlier once pushed it to its ceiling, drafting looked unprofitable and a count of
    picks ahead came out 0)."""
    monkeypatch.setattr(llm.engine.scheduler.spec, "observe_step", lambda *a, **kw: None)
    monkeypatch.setattr(llm.engine.scheduler.spec, "row_cost", speculation.ROW_COST)


class Oracle:
    """Proposes the plain path's continuation of each prompt (known in advance), corrupting one draft in
    `wrong` of the calls: long accepted runs, and rejections at every draft position."""

    def __init__(self, truth: dict[tuple, list[int]], wrong: float = 0.3, garbage: bool = False, seed: int = 0):
        self.truth, self.wrong, self.garbage = truth, wrong, garbage
        self.rng = random.Random(seed)
        self.calls = 0

    def __call__(self, req, k: int, lo: int, hi: int) -> list[int]:
        """Stands in for scheduler/speculative.py's ngram_drafts: drafts for req's text (truth + assumed tail)."""
        self.calls += 1
        tokens = req.fill_ids() + req.spec.guess
        for prompt, out in self.truth.items():
            if tuple(tokens[:len(prompt)]) != prompt:
                continue
            if self.garbage:
                return [self.rng.randrange(3, 200) for _ in range(k)]
            n = len(tokens) - len(prompt)
            if n <= len(out):
                d = list(out[n:n + k]) or [self.rng.randrange(3, 200)]
                if self.rng.random() < self.wrong:
                    d[self.rng.randrange(len(d))] = self.rng.randrange(3, 200)
                return d
        return []


def outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [(o.token_ids, o.finish_reason, o.text) for o in outs], outs


def assert_logprobs_close(a, b, tol=1e-4):
    """Per accepted token: the same tokens in the same order, logprobs equal to float rounding (a verify step
    has more rows than a plain decode step; the torch-path linear rounds the last bit by row count)."""
    la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert list(x) == list(y)
        assert all(abs(x[t] - y[t]) <= tol for t in x)


@pytest.fixture(scope="module")
def spec_llm(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_tokens=4096, max_running_requests=16, poison_future_map=True,
              speculative_config=SPEC)
    yield llm
    assert_no_leaks(llm)
    llm.shutdown()


def _mixed_workload(vocab: int = 1000, seed: int = 0):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(6):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))] + [i + 3])
        if i % 3 == 0:
            params.append(greedy(rng.randrange(8, 24), ignore_eos=True, logprobs=2))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=rng.randrange(1000),
                                         max_tokens=rng.randrange(8, 24), ignore_eos=True, logprobs=1))
        else:
            params.append(SamplingParams(temperature=0.7, min_p=0.05, seed=rng.randrange(1000),
                                         max_tokens=rng.randrange(8, 24), ignore_eos=True,
                                         logit_bias={7: 2.0, 11: -3.0}))
    return prompts, params


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("drafts", ["oracle", "garbage"])
def test_spec_equals_plain_greedy_and_seeded(spec_llm, monkeypatch, loop, drafts):
    prompts, params = _mixed_workload()
    configure(spec_llm, loop, False)
    plain, plain_outs = outputs(spec_llm, prompts, params)
    truth = {tuple(p): o[0] for p, o in zip(prompts, plain)}
    monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle(truth, garbage=drafts == "garbage"))
    configure(spec_llm, loop, True)
    before = spec_llm.stats()
    spec, spec_outs = outputs(spec_llm, prompts, params)
    after = spec_llm.stats()
    assert spec == plain
    for a, b in zip(spec_outs, plain_outs):
        if b.outputs[0].logprobs is not None:
            assert_logprobs_close(a, b)
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0
    if drafts == "oracle":
        assert accepted > drafted // 3
    else:
        assert accepted < drafted // 4


@pytest.mark.parametrize("loop", LOOPS)
def test_stops_inside_accepted_runs(spec_llm, monkeypatch, loop):
    """Stop ids, stop strings, EOS (forced by logit_bias once min_tokens allows it) and max_tokens land inside
    fully accepted runs and truncate them exactly where plain decode stops."""
    base_prompt = [31, 32, 33, 34]
    eos = min(spec_llm.engine.eos_token_ids)
    prompts = [base_prompt + [i] for i in range(5)]
    configure(spec_llm, loop, False)
    ref = spec_llm.generate(prompts, greedy(24, ignore_eos=True), use_tqdm=False)
    params = [greedy(24, stop_token_ids=[ref[0].token_ids[6]], ignore_eos=True),
              greedy(24, stop=[ref[1].text[len(ref[1].text) // 2:len(ref[1].text) // 2 + 3]], ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, max_tokens=24, min_tokens=6, logit_bias={eos: 40.0}),
              greedy(7, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=11, ignore_eos=True)]
    plain, _ = outputs(spec_llm, prompts, params)
    assert plain[0][1] == "stop" and plain[1][1] == "stop" and plain[2][1] == "stop"
    assert len(plain[2][0]) == 7 and plain[2][0][-1] == eos and len(plain[3][0]) == 7
    truth = {tuple(p): ref_o.token_ids for p, ref_o in zip(prompts, ref)}
    truth[tuple(prompts[2])] = plain[2][0]
    truth[tuple(prompts[4])] = plain[4][0]
    monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle(truth, wrong=0.0))
    configure(spec_llm, loop, True)
    spec, _ = outputs(spec_llm, prompts, params)
    assert spec == plain
    assert ref[3].token_ids[:len(plain[3][0])] == plain[3][0]


@pytest.mark.parametrize("loop", LOOPS)
def test_retraction_and_aborts(tiny_llama, make_llm, monkeypatch, loop):
    """A small KV cache retracts requests while others speculate; an abort mid-run ends only its request."""
    initial = [(f"r{i}", [9 + i] * (15 + 4 * i), greedy(35, ignore_eos=True)) for i in range(6)]
    llm = make_llm(tiny_llama, kv_cache_tokens=260, speculative_config=SPEC)
    configure(llm, loop, False)
    plain = run_script(llm, loop, initial, {})
    assert llm.engine.scheduler.retractions > 0
    truth = {tuple(ids): plain[label][0] for label, ids, _ in initial}
    monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle(truth))
    llm = make_llm(tiny_llama, kv_cache_tokens=260, speculative_config=SPEC)   # fresh admission state
    configure(llm, loop, True)
    spec = run_script(llm, loop, initial, {})
    assert spec == plain
    assert llm.engine.scheduler.retractions > 0 and llm.stats()["spec_accepted_tokens"] > 0
    aborted = run_script(llm, loop, initial, {3: [("abort", "r2")], 5: [("abort", "r4")]})
    for label in ("r2", "r4"):
        toks, reason = aborted[label]
        assert reason == "abort" and toks == plain[label][0][:len(toks)]
    assert {k: v for k, v in aborted.items() if k not in ("r2", "r4")} == \
        {k: v for k, v in plain.items() if k not in ("r2", "r4")}


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_mix_both_loops(tiny_qwen2, make_llm, monkeypatch, seed):
    rng = random.Random(seed)
    llm = make_llm(tiny_qwen2, kv_cache_tokens=rng.choice([400, 2000]), max_running_requests=8,
                   speculative_config={**SPEC, "num_speculative_tokens": rng.choice([2, 5])})
    spec_cfg = llm.engine.config.speculative_config
    reqs = []
    for i in range(14):
        ids = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))] + [1000 + i]
        if rng.random() < 0.5:
            p = greedy(rng.randrange(1, 20), ignore_eos=True)
        else:
            p = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                               seed=rng.randrange(1000), max_tokens=rng.randrange(1, 20), ignore_eos=True)
        reqs.append((f"q{i}", ids, p))
    initial, events = reqs[:5], {}
    for r in reqs[5:]:
        events.setdefault(rng.randrange(1, 6), []).append(("add",) + r)   # steps both runs reach
    configure(llm, "serial", False)
    plain = run_script(llm, "serial", initial, events)
    monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle({tuple(ids): plain[lab][0] for lab, ids, _ in reqs},
                                                         wrong=0.5, seed=seed))
    for loop in LOOPS:
        configure(llm, loop, True, spec_cfg)
        assert run_script(llm, loop, initial, events) == plain
    assert llm.stats()["spec_draft_tokens"] > 0


def test_grammar_rows_never_draft(spec_llm, monkeypatch):
    prompts = [[40, 41, 42]]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=30, structured_outputs={"choice": ["yes", "no"]})]
    configure(spec_llm, "overlap", False)
    plain, _ = outputs(spec_llm, prompts, params)
    oracle = Oracle({tuple(p): o[0] for p, o in zip(prompts, plain)})
    monkeypatch.setattr(spec_mod, "ngram_drafts", oracle)
    for loop in LOOPS:
        configure(spec_llm, loop, True)
        before = spec_llm.stats()["spec_draft_tokens"]
        assert outputs(spec_llm, prompts, params)[0] == plain
        assert spec_llm.stats()["spec_draft_tokens"] == before and oracle.calls == 0
    assert plain[0][2] in ("yes", "no")


@pytest.mark.parametrize("loop", LOOPS)
def test_penalties_count_per_accepted_token(spec_llm, monkeypatch, loop):
    """A penalized draft row is penalized as if the drafts before it were outputs, and only kept tokens count:
    presence / frequency / repetition penalties give the plain path's tokens, beside unpenalized mates."""
    prompts = [[50, 51, 52, 50, 51], [60, 61, 62], [70, 71]]
    bias = {7: 6.0, 8: 5.5, 9: 5.0}           # a few tokens on top, so that the penalties decide the order
    params = [SamplingParams(temperature=0.8, seed=2, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=bias),
              greedy(24, ignore_eos=True, frequency_penalty=1.5, logit_bias=bias),
              SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)]
    configure(spec_llm, loop, False)
    plain, _ = outputs(spec_llm, prompts, params)
    unpenalized = outputs(spec_llm, prompts[1:2], [greedy(24, ignore_eos=True, logit_bias=bias)])[0]
    assert unpenalized[0][0] == [7] * 24 and len(set(plain[1][0])) > 2 and len(set(plain[0][0])) > 2
    monkeypatch.setattr(spec_mod, "ngram_drafts", Oracle({tuple(p): o[0] for p, o in zip(prompts, plain)}))
    pin_row_cost(spec_llm, monkeypatch)
    configure(spec_llm, loop, True)
    before = spec_llm.stats()
    assert outputs(spec_llm, prompts, params)[0] == plain
    after = spec_llm.stats()
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] > 10


def test_n_samples_and_adaptive_off(spec_llm, monkeypatch):
    """n > 1: each sample speculates on its own seed. Garbage drafts drive the acceptance EMA under the floor,
    after which a request drafts only on probes; a batch above disable_by_batch_size never drafts."""
    prompt = [60, 61, 62, 63]
    params = SamplingParams(temperature=0.9, seed=11, n=3, max_tokens=40, ignore_eos=True)
    configure(spec_llm, "serial", False)
    plain = spec_llm.generate([prompt], params, use_tqdm=False)[0]
    oracle = Oracle({tuple(prompt): []}, garbage=True)
    monkeypatch.setattr(spec_mod, "ngram_drafts", oracle)
    configure(spec_llm, "serial", True)
    before = spec_llm.stats()["spec_draft_tokens"]
    out = spec_llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
    drafted = spec_llm.stats()["spec_draft_tokens"] - before
    assert 0 < drafted < 3 * 40 * 4 / 4           # far fewer than k drafts at every one of the 3 x 40 steps
    wide = [[70 + i, 71, 72] for i in range(SPEC["disable_by_batch_size"] + 1)]
    calls = oracle.calls
    spec_llm.generate(wide, greedy(6, ignore_eos=True), use_tqdm=False)
    assert oracle.calls == calls                   # above the batch cap nobody drafts (prefill steps aside)


QUOTE = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were "
         "striking thirteen. Winston Smith, his chin nuzzled into his breast in an effort to escape the vile "
         "wind, slipped quickly through the glass doors of Victory Mansions.")


def test_real_model_quoting_same_tokens_both_loops():
    """SmolLM2 with the real n-gram proposer: a quoting request accepts most drafts, and greedy and seeded
    outputs equal speculation off under both loops. The reference is the second plain run, whose prompts hit
    the prefix cache as the speculative runs' do: on an AVX2-only CPU the uncached tail (at most 16 rows) runs
    the decode body while a fresh 95-token prefill runs the int8 GEMM, whose last bits differ for Q4_1 / Q8_0
    there (README, "Exact mode and the int8 default"), so a cache hit moves logprobs by up to ~0.03 whether
    speculation is on or off."""
    llm = LLM(poison_future_map=True, speculative_config=SPEC)
    try:
        chats = [[{"role": "user", "content": "Repeat this passage exactly:\n\n" + QUOTE}],
                 [{"role": "user", "content": "Repeat this passage exactly:\n\n" + QUOTE[:120]}]]
        params = [SamplingParams(temperature=0, max_tokens=48, logprobs=1),
                  SamplingParams(temperature=0.7, seed=5, max_tokens=32)]
        configure(llm, "serial", False)
        fresh = llm.chat(chats, params, use_tqdm=False)
        plain = llm.chat(chats, params, use_tqdm=False)            # the prompts from the prefix cache
        assert [o.token_ids for o in plain] == [o.token_ids for o in fresh]
        for loop in LOOPS:
            configure(llm, loop, True)
            before = llm.stats()
            spec = llm.chat(chats, params, use_tqdm=False)
            after = llm.stats()
            assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
            assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
            assert_logprobs_close(spec[0], plain[0])
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            assert accepted > 0.5 * (after["spec_draft_tokens"] - before["spec_draft_tokens"]) > 0
            assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_adaptive_k_follows_acceptance_and_batch(spec_llm):
    """k: the j-th draft only while p^j beats its row's cost at this batch size; 0 (with probes) when it never
    does; never past max_tokens."""
    from tandem.request import Req
    s = spec_llm.engine.scheduler.spec
    configure(spec_llm, "serial", True)
    cfg = spec_llm.engine.config.speculative_config
    s.row_cost = speculation.ROW_COST           # the initial row cost (the engine measures its own as it runs)
    req = Req("r", [1, 2, 3], greedy(100), seed=0, max_len=1000)
    req.spec.acc, req.spec.trials = 0.8, 1.0
    assert s.draft_len(cfg, req, 1) == 4
    assert s.draft_len(cfg, req, 8) == 1                          # 0.8^2 < one row's cost at 8 requests
    req.spec.acc = 0.3
    assert s.draft_len(cfg, req, 1) == 1 and s.draft_len(cfg, req, 8) == 0
    req.spec.acc, req.spec.skipped = 0.05, 0
    ks = [s.draft_len(cfg, req, 1) for _ in range(2 * speculation.PROBE_EVERY)]
    assert ks.count(1) == 2 and set(ks) == {0, 1}                     # probes only
    s.settle(req, 1, 0)                                     # a failed probe doubles the gap
    ks = [s.draft_len(cfg, req, 1) for _ in range(2 * speculation.PROBE_EVERY)]
    assert ks.count(1) == 1 and req.spec.probe_gap == 2 * speculation.PROBE_EVERY
    req.spec.acc = 0.95
    req.output_ids = [5] * 98
    assert s.draft_len(cfg, req, 1) == 1                         # one output left after this step's own


def test_adaptive_k_prices_the_draft_model_step(spec_llm):
    """With a draft model each draft also costs a draft step, as measured against the target's decode step: a
    draft a tenth of the target still drafts where acceptance is high, one as costly as the target never does."""
    from types import SimpleNamespace
    from tandem.request import Req
    s = spec_llm.engine.scheduler.spec
    configure(spec_llm, "serial", True)
    cfg = spec_llm.engine.config.speculative_config
    s.row_cost = speculation.ROW_COST
    req = Req("r", [1, 2, 3], greedy(100), seed=0, max_len=1000)
    req.spec.acc, req.spec.trials = 0.9, 1.0
    assert s.draft_len(cfg, req, 1) == 4 and s.draft_len(cfg, req, 8) == 3     # 0.9^3 > 0.67 at 8
    s.drafter, s.decode_step_s = SimpleNamespace(step_s=0.001), 0.010
    try:
        assert s.draft_cost() == pytest.approx(0.1)
        assert s.draft_len(cfg, req, 1) == 4                      # 0.9^4 = 0.66 > 0.2 + 0.1
        assert s.draft_len(cfg, req, 8) == 2                      # 0.9^3 = 0.73 < 0.67 + 0.1
        s.drafter.step_s = 0.010
        assert s.draft_len(cfg, req, 1) == 0                      # a draft step costs a whole target step
    finally:
        s.drafter, s.decode_step_s = None, None
