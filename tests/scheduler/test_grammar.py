"""The grammar branch: structured output (JSON schema, choice, regex, Lark) under both loops.

Outputs always parse and validate, the two loops give identical outputs (the overlap loop sends a step's
token masks after its launch, the serial loop with it), grammar requests leave their free batch mates'
outputs unchanged, and an invalid schema is refused before anything is queued.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
          "required": ["name", "ok", "color", "tags"], "additionalProperties": False}
PROMPTS = [f"Record {i}: " + "describe it " * (i % 3) for i in range(8)]


def run(llm, loop, prompts, params):
    llm.engine.config = llm.engine.config.replace(scheduler=loop)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_outputs_validate_and_loops_agree(llm, seed):
    params = [SamplingParams(temperature=1.0, seed=seed * 100 + i, max_tokens=120,
                             structured_outputs={"json": SCHEMA}) for i in range(len(PROMPTS))]
    outs = {loop: run(llm, loop, PROMPTS, params) for loop in ("serial", "overlap")}
    assert [o.token_ids for o in outs["serial"]] == [o.token_ids for o in outs["overlap"]]
    for o in outs["overlap"]:
        assert o.finish_reason == "stop", o        # the grammar completed: the JSON closed
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_grammar_requests_leave_free_batch_mates_unchanged(llm):
    free = [SamplingParams(temperature=0.9, seed=i, max_tokens=16, ignore_eos=True) for i in range(4)]
    alone = run(llm, "overlap", PROMPTS[:4], free)
    constrained = [SamplingParams(temperature=0.9, seed=50 + i, max_tokens=60, structured_outputs={"json": SCHEMA})
                   for i in range(4)]
    mixed = run(llm, "overlap", PROMPTS[:4] + PROMPTS[4:], free + constrained)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for o in mixed[4:]:
        jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.parametrize("spec,check", [
    ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"regex": r"[0-9]{3}-[a-c]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-c]{2}", t) is not None),
    ({"grammar": 'start: "(" num ("," num)* ")"\nnum: /[1-9]/'}, lambda t: re.fullmatch(r"\([1-9](,[1-9])*\)", t)),
])
@pytest.mark.parametrize("loop", ["serial", "overlap"])
def test_other_constraints(llm, spec, check, loop):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=spec) for i in range(4)]
    for o in run(llm, loop, PROMPTS[:4], params):
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_greedy_json_on_the_inline_executor(tiny_llama, make_llm):
    """A runner that samples at launch gets its masks with the launch (host truth first)."""
    inline = make_llm(tiny_llama, device_backend="inline")
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": SCHEMA})
    outs = inline.generate(PROMPTS[:3], params, use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.parametrize("spec", [{"json": {"type": "nonsense"}}, {"regex": "[a-z"}, {"choice": []},
                                  {"json": "{not json"}, {"json": {"type": "object"}, "regex": "a"}])
def test_invalid_specs_are_refused_before_queueing(llm, spec):
    with pytest.raises(ValueError, match="structured|invalid"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0


def test_json_object_opens_an_object_and_closes_it_when_it_stops(llm):
    """Any JSON object: a random model rarely closes one in time, so only a stopped output must parse."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs={"json_object": True})
              for i in range(6)]
    for o in run(llm, "overlap", PROMPTS[:6], params):
        assert o.text.startswith("{")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)


def test_a_slow_compile_waits_instead_of_failing(llm, monkeypatch):
    """The offline loop waits for a grammar that compiles for a while (it is progress, not a stall)."""
    import time

    compiler = llm.engine.grammar
    original = type(compiler).matcher
    monkeypatch.setattr(type(compiler), "matcher", lambda self, spec: (time.sleep(0.5), original(self, spec))[1])
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, structured_outputs={"choice": ["ab", "cd"]}),
                       use_tqdm=False)[0]
    assert out.text in ("ab", "cd")


@pytest.mark.parametrize("vocab, rows", [(262144, [0, 1, 2, 3]), (49152, [2, 0]), (1000, [3]), (77, [1, 2, 3])])
def test_token_bitmask_equals_masked_fill(vocab, rows):
    """apply_token_bitmask (a byte table on the logits' int32 view) sets exactly the bits masked_fill does: on
    every row or some, a vocabulary that is not a multiple of 32, and NaN, -0.0, +-inf logits."""
    import torch
    from tandem.sampler import apply_token_bitmask, apply_token_bitmask_reference
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    logits[0, :5], logits[1, :7], logits[2, 9], logits[3, :11] = float("nan"), -0.0, float("inf"), -float("inf")
    r = torch.tensor(rows)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), (vocab + 31) // 32), generator=g, dtype=torch.int32)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask(a, r, mask)
    apply_token_bitmask_reference(b, r, mask)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


CHOICE = {"choice": ["alpha", "beta", "gamma delta"]}


@pytest.mark.parametrize("loop", ["serial", "overlap"])
def test_grammar_starts_after_the_reasoning(llm, loop):
    """reasoning_end_ids (a reasoning parser's end tag, tandem/grammar/after_reasoning.py): tokens up to the end
    ids are free, even ones the grammar forbids (a logit bias makes the output write them), and the rest follows
    the grammar from its start; with reasoning_start_id the output may open the reasoning with it, and one that
    does not is constrained from its first token."""
    bang = llm.tokenizer.encode("!", add_special_tokens=False)[0]       # no choice starts with it
    at = llm.tokenizer.encode("@", add_special_tokens=False)[0]
    gated = SamplingParams(temperature=0, max_tokens=40, structured_outputs=CHOICE, logit_bias={bang: 100},
                           reasoning_end_ids=[bang, bang])
    o = run(llm, loop, PROMPTS[:1], gated)[0]
    assert o.token_ids[:2] == [bang, bang] and o.finish_reason == "stop", o
    assert llm.tokenizer.decode(o.token_ids[2:]) in CHOICE["choice"], o.text
    opened = SamplingParams(temperature=0, max_tokens=6, structured_outputs=CHOICE, logit_bias={at: 100},
                            reasoning_end_ids=[bang], reasoning_start_id=at)
    o = run(llm, loop, PROMPTS[:1], opened)[0]
    assert o.token_ids == [at] * 6 and o.finish_reason == "length", o       # in the reasoning, never ended
    plain = SamplingParams(temperature=0, max_tokens=40, structured_outputs=CHOICE, logit_bias={at: -100},
                           reasoning_end_ids=[bang], reasoning_start_id=at)
    o = run(llm, loop, PROMPTS[:1], plain)[0]
    assert o.text in CHOICE["choice"] and o.finish_reason == "stop", o      # no start tag: the grammar at once
