"""Engine isolation and bounded sampling fields, offline: one request's failure ends that request alone.

Faults are injected into one request's own path (tandem/faults.py): while its step is prepared or while its
results are processed. The other requests' outputs must equal a run without the fault, in both loops, and
every KV slot and row must come back (the make_llm fixture checks).
"""
from __future__ import annotations

import pytest

from tandem import SamplingParams, faults
from tandem.sampling_params import GREEDY_EPS

FAULT_IDS = [7, 7, 7, 7, 7]
PROMPTS = [[100 + i, 200 + i, 300 + 7 * i, 42] for i in range(6)]


@pytest.fixture
def fault():
    yield faults.set_fault
    faults.set_fault(None)


@pytest.mark.parametrize("stage", faults.STAGES)
@pytest.mark.parametrize("loop", ["serial", "overlap"])
def test_a_fault_in_one_request_ends_it_alone(make_llm, tiny_llama, fault, stage, loop):
    llm = make_llm(tiny_llama, scheduler=loop)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = llm.generate(PROMPTS, params, use_tqdm=False)
    fault(f"{stage}:" + ",".join(map(str, FAULT_IDS)))
    mixed = PROMPTS[:3] + [FAULT_IDS + [1, 2, 3]] + PROMPTS[3:]
    outs = llm.generate(mixed, params, use_tqdm=False)
    bad = outs.pop(3)
    assert bad.finish_reason == "error" and "InjectedFault" in bad.error, bad
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in reference]
    fault(None)
    again = llm.generate(PROMPTS, params, use_tqdm=False)      # the engine goes on
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]


def test_a_fault_mid_decode_among_sampled_requests(make_llm, tiny_llama, fault):
    """The failing request rides in the in-flight batch when it fails (overlap): its slot is freed safely and
    seeded batch mates keep their tokens."""
    llm = make_llm(tiny_llama, scheduler="overlap")
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(len(PROMPTS))]
    reference = llm.generate(PROMPTS, params, use_tqdm=False)
    fault("process:" + ",".join(map(str, FAULT_IDS)))
    outs = llm.generate(PROMPTS + [FAULT_IDS], params + [SamplingParams(max_tokens=20)], use_tqdm=False)
    assert outs[-1].finish_reason == "error"
    assert [o.token_ids for o in outs[:-1]] == [o.token_ids for o in reference]


@pytest.mark.parametrize("field,value", [
    ("top_k", 2 ** 63), ("top_k", 2 ** 64 + 1), ("top_k", -2), ("temperature", float("inf")),
    ("temperature", float("nan")), ("top_p", float("nan")), ("min_p", float("inf")), ("stop", ["\ud800"]),
    ("seed", 2 ** 63)])
def test_out_of_range_fields_are_refused_before_queueing(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_k_beyond_the_vocabulary_is_refused(make_llm, tiny_llama):
    llm = make_llm(tiny_llama)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="top_k"):
        llm.generate([PROMPTS[0]], SamplingParams(top_k=vocab + 1), use_tqdm=False)
    out = llm.generate([PROMPTS[0]], SamplingParams(top_k=vocab, max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, GREEDY_EPS / 2])
def test_tiny_temperatures_act_greedy(make_llm, tiny_llama, temperature):
    llm = make_llm(tiny_llama)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tiny = llm.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True, seed=3),
                        use_tqdm=False)
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
