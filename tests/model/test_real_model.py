"""The real SmolLM2-135M model: serial and overlap give identical outputs (greedy and seeded, with stops)."""
from __future__ import annotations

from tests.helpers.engine_checks import run_with
from tandem import SamplingParams


def test_real_model_serial_equals_overlap(smollm):
    tok = smollm.tokenizer
    prompts = [tok.encode(t) for t in ["The capital of France is", "List three colors:", "def add(a, b):",
                                       "Water boils at"]]
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=20, stop=["."])]
    serial = run_with(smollm, "serial", prompts, params)
    overlap = run_with(smollm, "overlap", prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in serial] == \
        [(o.token_ids, o.text, o.finish_reason) for o in overlap]
    assert len(serial[2].token_ids) == 1
    assert "." not in serial[3].text
