"""Engine behaviour on tiny models: stops, sampling, seeds, retraction, bad inputs, memory."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.engine_checks import assert_no_leaks
from tandem import SamplingParams
from tandem.sampler import SamplingBatch, draw_seeds, sample

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500], [42] * 17, list(range(1000, 1031))]


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_max_tokens_one_and_two(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    for n in (1, 2):
        outs = llm.generate(PROMPTS, greedy(n, ignore_eos=True), use_tqdm=False)
        assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in outs)


def test_stop_token_ids_and_eos(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    base = llm.generate(PROMPTS, greedy(10, ignore_eos=True), use_tqdm=False)
    stop_at = {i: o.token_ids[3] for i, o in enumerate(base)}
    outs = llm.generate(PROMPTS, [greedy(10, stop_token_ids=[stop_at[i]], ignore_eos=True)
                                  for i in range(len(PROMPTS))], use_tqdm=False)
    for b, o, i in zip(base, outs, range(len(PROMPTS))):
        cut = b.token_ids.index(stop_at[i]) + 1
        assert o.token_ids == b.token_ids[:cut] and o.finish_reason == "stop"
    # EOS: pretend the 3rd token is EOS by adding it to the engine's EOS set for one run.
    eos = base[0].token_ids[2]
    llm.engine.eos_token_ids = frozenset({eos})
    try:
        out = llm.generate([PROMPTS[0]], greedy(10), use_tqdm=False)[0]
        cut = base[0].token_ids.index(eos) + 1
        assert out.token_ids == base[0].token_ids[:cut] and out.finish_reason == "stop"
        ignored = llm.generate([PROMPTS[0]], greedy(10, ignore_eos=True), use_tqdm=False)[0]
        assert ignored.token_ids == base[0].token_ids
    finally:
        llm.engine.eos_token_ids = frozenset(llm.engine.model_config.eos_token_ids)


def test_stop_string_across_tokens(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    base = llm.generate(PROMPTS[1], greedy(12, ignore_eos=True), use_tqdm=False)[0]
    text = base.text
    # A stop string that straddles tokens: the tail of token 3's text plus the head of token 4's.
    tok = llm.tokenizer
    pieces = [tok.decode(base.token_ids[:i]) for i in range(1, 13)]
    k = next(i for i in range(3, 11) if len(pieces[i]) > len(pieces[i - 1]) + 1 and len(pieces[i - 1]) > 2)
    boundary = len(pieces[k - 1])
    stop = text[boundary - 2:boundary + 1]
    assert len(stop) == 3
    out = llm.generate(PROMPTS[1], greedy(12, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.find(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < 12


def test_seeded_sampling_reproducible_across_batch_mates(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], p, use_tqdm=False)[0].token_ids
    crowd = llm.generate(PROMPTS + [PROMPTS[2]] * 3, [SamplingParams(temperature=1.0, max_tokens=9,
                                                                    ignore_eos=True)] * 4 + [p] * 3,
                         use_tqdm=False)
    assert all(o.token_ids == alone for o in crowd[4:])
    other = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99,
                                                      max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert other.token_ids != alone


def test_retraction_gives_same_outputs(tiny_llama, make_llm):
    prompts = [[7 + i] * (20 + 3 * i) for i in range(8)]
    params = greedy(40, ignore_eos=True)
    big = make_llm(tiny_llama, kv_cache_tokens=8192).generate(prompts, params, use_tqdm=False)
    for scheduler in ("serial", "overlap"):
        small = make_llm(tiny_llama, kv_cache_tokens=300, scheduler=scheduler)
        outs = small.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in big]
        assert small.engine.scheduler.retractions > 0      # the small cache really forced retraction


@pytest.mark.parametrize("bad, field", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(seed=1 << 64), "seed"), (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"), (dict(max_tokens=2.0), "max_tokens"),
])
def test_bad_sampling_params_raise(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_inputs_queue_nothing(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], greedy(4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(4))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, vocab]], greedy(4))
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        llm.generate(["hi"], {"max_tokens": 4, "bogus": 1})
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], greedy(4, stop_token_ids=[vocab + 5]))
    with pytest.raises(ValueError, match="prompt has"):
        llm.generate([[5] * 600], greedy(4))          # tiny model context is 512
    # One bad prompt among good ones: nothing of the batch is queued.
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [1, vocab]], greedy(4))
    assert_no_leaks(llm)
    assert llm.generate([[5, 6]], greedy(3), use_tqdm=False)[0].finish_reason == "length"


def test_unknown_engine_option(tiny_llama):
    from tandem import LLM
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(tiny_llama, not_an_option=1)


def test_sampler_respects_top_k_top_p_min_p():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000) * 3
    order = logits[0].argsort(descending=True)
    n = 400
    seeds = draw_seeds(np.arange(n), np.zeros(n))
    rep = logits.repeat(n, 1)
    cpu = torch.device("cpu")

    def draw(top_k=-1, top_p=1.0, min_p=0.0, temperature=1.0):
        full = np.full
        return sample(rep, SamplingBatch.from_host(full(n, temperature), full(n, top_p), full(n, top_k),
                                                   full(n, min_p), seeds, cpu))

    assert set(draw(top_k=5).tolist()) <= set(order[:5].tolist())
    probs = torch.softmax(logits[0], -1)[order]
    keep = int((probs.cumsum(0) - probs < 0.5).sum())
    assert set(draw(top_p=0.5).tolist()) <= set(order[:keep].tolist())
    allowed = (torch.softmax(logits[0], -1) >= 0.2 * torch.softmax(logits[0], -1).max()).nonzero().squeeze(1)
    assert set(draw(min_p=0.2).tolist()) <= set(allowed.tolist())
    plain = draw()
    assert len(set(plain.tolist())) > 20        # a real distribution, not argmax
    assert (draw(temperature=0.0) == logits.argmax()).all()
    # Mixed batch: greedy, plain and top-k rows in one call keep their own semantics.
    mixed = sample(rep[:3], SamplingBatch.from_host(np.array([0.0, 1.0, 1.0]), np.ones(3), np.array([-1, -1, 1]),
                                                    np.zeros(3), seeds[:3], cpu))
    assert mixed[0] == logits.argmax() and mixed[2] == logits.argmax()


def test_sampler_draws_follow_the_distribution():
    """The exponential race samples softmax(logits / T): frequencies match over many seeds."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    n = 20000
    seeds = draw_seeds(np.arange(n), np.zeros(n))
    for temperature in (1.0, 0.5):
        out = sample(logits.repeat(n, 1), SamplingBatch.from_host(
            np.full(n, temperature), np.ones(n), np.full(n, -1), np.zeros(n), seeds, torch.device("cpu")))
        freq = torch.bincount(out, minlength=5).double() / n
        expect = torch.softmax(logits[0].double() / temperature, -1)
        assert (freq - expect).abs().max() < 0.015, (freq, expect)
        assert freq[4] == 0


def test_draw_seeds_are_deterministic_and_distinct():
    a = draw_seeds(np.array([1, 1, 2]), np.array([0, 1, 0]))
    b = draw_seeds(np.array([1, 1, 2]), np.array([0, 1, 0]))
    assert (a == b).all() and len(set(a.tolist())) == 3 and (a >= 0).all()
    many = draw_seeds(np.zeros(10000, np.int64), np.arange(10000))
    assert len(set(many.tolist())) == 10000


def test_n_samples_per_prompt(tiny_llama, make_llm):
    """n > 1: n distinct samples per prompt, each reproducible and independent of its batch mates."""
    llm = make_llm(tiny_llama)
    p = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=10, ignore_eos=True)
    a = llm.generate(["hello there", "a b c"], p, use_tqdm=False)
    b = llm.generate(["a b c"], p, use_tqdm=False)
    assert [len(o.outputs) for o in a] == [3, 3]
    assert [c.index for c in a[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a[0].outputs}) == 3
    assert [c.token_ids for c in a[1].outputs] == [c.token_ids for c in b[0].outputs]
    assert a[0].token_ids == a[0].outputs[0].token_ids
    single = llm.generate(["hello there"], SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)
    assert single[0].token_ids == a[0].outputs[0].token_ids      # sample 0 keeps the request's seed
    with pytest.raises(ValueError, match="n="):
        SamplingParams(n=0)


@pytest.mark.parametrize("backend", ["process", "inline"])
def test_logprobs_equal_a_log_softmax_reference(tiny_llama, make_llm, backend):
    """Logprobs of the sampled distribution (temperature applied; raw logits for greedy), with top-k."""
    from transformers import AutoModelForCausalLM
    llm = make_llm(tiny_llama, device_backend=backend)
    params = [SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=4, max_tokens=5, logprobs=0, ignore_eos=True)]
    outs = llm.generate(["hello there", "a b c"], params, use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for out, p in zip(outs, params):
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1]
        lp = torch.log_softmax(logits / (p.temperature or 1.0), dim=-1)
        got = out.outputs[0].logprobs
        assert len(got) == len(out.token_ids)
        for i, tok in enumerate(out.token_ids):
            assert got[i][tok] == pytest.approx(lp[i, tok].item(), abs=1e-4)
            top = lp[i].topk(p.logprobs).indices.tolist()
            assert set(got[i]) == {tok, *top}
        assert out.outputs[0].cumulative_logprob == pytest.approx(sum(g[t] for g, t in zip(got, out.token_ids)))


def test_n_samples_prefill_their_prompt_once(tiny_llama, make_llm):
    """n = 3 samples of one long prompt: the first computes the prompt, the others hit its KV in the prefix
    cache (they wait one step for it), so only the last prompt token is computed again for each."""
    llm = make_llm(tiny_llama)
    prompt = list(range(1000, 1080))
    before = llm.stats()["prefix_cache_hits"]
    outs = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3
    assert llm.stats()["prefix_cache_hits"] - before == 2 * (len(prompt) - 1)


@pytest.mark.parametrize("chunk,n", [(2048, 20), (7, 20), (2048, 500)])
def test_prompt_logprobs_equal_a_log_softmax_reference(tiny_llama, make_llm, chunk, n):
    """Prompt logprobs (echo with logprobs): raw log_softmax at each position, scoring the next prompt token,
    across prefill chunks too, and across the pieces of PROMPT_LOGPROB_ROWS positions the LM head runs on
    (n = 500); the first token has none. Such prompts do not reuse cached KV."""
    from transformers import AutoModelForCausalLM
    llm = make_llm(tiny_llama, max_prefill_tokens=chunk)
    ids = [500 + i % 300 for i in range(n)]
    llm.generate([ids], greedy(2), use_tqdm=False)                   # its prefix is now cached
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0], dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        got = out.prompt_logprobs[i]
        assert got[ids[i]] == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
        assert set(lp[i - 1].topk(2).indices.tolist()) <= set(got)
    assert out.num_cached_tokens == 0
