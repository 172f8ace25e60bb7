"""Penalties, logit_bias and min_tokens against a straightforward reference on a tiny model, and
transformers' repetition-penalty logits processor, which defines the repetition penalty the same way.

The reference decodes greedily one token at a time with the transformers model: logits of the last
position, then repetition (prompt and output tokens), frequency and presence penalties (output tokens),
logit_bias, and -inf for EOS and the stop ids below min_tokens.
"""
from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams

PROMPTS = ["hello there friend of mine", "a b c d e f g", "the the the the"]


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm


@pytest.fixture(scope="module")
def ref_model(tiny_llama):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def reference(model, prompt_ids, p: SamplingParams, eos: set[int], steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].clone()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float() \
            if out else torch.zeros_like(logits)
        seen = counts > 0
        seen_any = seen.clone()
        seen_any[prompt_ids] = True
        r = p.repetition_penalty
        logits = torch.where(seen_any, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * seen.float()
        for tok, bias in (p.logit_bias or {}).items():
            logits[tok] += bias
        if len(out) < p.min_tokens:
            for tok in eos | set(p.stop_token_ids):
                logits[tok] = -float("inf")
        out.append(int(logits.argmax()))
        if out[-1] in eos and len(out) >= p.min_tokens:
            break
    return out


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition-below-1": dict(repetition_penalty=0.6),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.2),
    "all-three": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.5),
    "logit-bias": dict(logit_bias={11: 5.0, 42: 3.0, 100: -100.0}),
    "min-tokens": dict(min_tokens=6, logit_bias={2: 8.0}),
}


@pytest.mark.parametrize("loop", ["serial", "overlap"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(llm, ref_model, case, loop):
    llm.engine.config = llm.engine.config.replace(scheduler=loop)
    eos = set(llm.engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=10, **CASES[case])
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, params, use_tqdm=False)
    for prompt_ids, o in zip(ids, outs):
        assert o.token_ids == reference(ref_model, prompt_ids, params, eos, 10)[:len(o.token_ids)]


def test_repetition_penalty_equals_transformers_processor(llm, ref_model):
    from transformers import RepetitionPenaltyLogitsProcessor
    ids = llm.tokenizer.encode(PROMPTS[2])
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.7),
                        use_tqdm=False)[0].token_ids
    proc, seq = RepetitionPenaltyLogitsProcessor(1.7), list(ids)
    for _ in range(8):
        with torch.no_grad():
            logits = ref_model(torch.tensor([seq])).logits[:, -1]
        seq.append(int(proc(torch.tensor([seq]), logits).argmax()))
    assert ours == seq[len(ids):]


def test_penalties_survive_retraction_and_leave_batch_mates_alone(make_llm, tiny_llama, ref_model):
    """A small KV cache forces retractions: re-prefilled rows rebuild their penalty state from their outputs;
    unpenalized batch mates decode as without penalized ones."""
    llm = make_llm(tiny_llama, kv_cache_tokens=300)
    pen = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=1.0,
                         repetition_penalty=1.4)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [[7 + i] * (20 + 3 * i) for i in range(8)]
    alone = llm.generate(ids[4:], free, use_tqdm=False)
    outs = llm.generate(ids, [pen] * 4 + [free] * 4, use_tqdm=False)
    assert llm.engine.scheduler.retractions > 0
    assert [o.token_ids for o in outs[4:]] == [o.token_ids for o in alone]
    for prompt_ids, o in zip(ids[:2], outs[:2]):
        assert o.token_ids == reference(ref_model, prompt_ids, SamplingParams(
            max_tokens=40, frequency_penalty=1.0, repetition_penalty=1.4), set(), 40)


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                         ("repetition_penalty", 0),
                                         ("logit_bias", {5: 101}), ("logit_bias", {-1: 1}), ("min_tokens", -1),
                                         ("logit_bias", {i: 1.0 for i in range(301)})])
def test_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
