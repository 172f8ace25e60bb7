"""Greedy outputs equal transformers' greedy generate on the same weights (ARCHITECTURE.md section 8)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.engine_checks import run_with
from tandem import SamplingParams

NEAR_TIE = 1e-4


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=None)
    return out.sequences[0, len(prompt_ids):].tolist(), [s[0] for s in out.scores]


def assert_parity(ours: list[int], ref: list[int], scores: list[torch.Tensor]) -> None:
    """Equal token for token; a divergence is accepted only at a genuine near-tie of the reference."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = scores[i].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin < NEAR_TIE and float(scores[i][a]) >= float(top2[1]) - NEAR_TIE, \
                f"diverged at {i}: ours {a}, transformers {b}, top-2 margin {margin:.3g}"
            return
    assert len(ours) == len(ref)


def assert_greedy_parity(llm, prompts: list[list[int]], refs: list, max_new: int,
                         loops: tuple[str, ...] = ("serial", "overlap")) -> None:
    """The engine's greedy outputs of `prompts` through each loop against transformers' (refs: hf_greedy's, one a
    prompt), by assert_parity."""
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    for scheduler in loops:
        for o, (ref_ids, scores) in zip(run_with(llm, scheduler, prompts, params), refs):
            assert_parity(o.token_ids, ref_ids, scores)


def prompts_for(vocab: int, n: int = 9, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("scheduler", ["serial", "overlap"])
def test_tiny_parity_with_transformers(arch, scheduler, request, make_llm):
    from transformers import AutoModelForCausalLM
    path = request.getfixturevalue(arch)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = make_llm(path, scheduler=scheduler)
    prompts = prompts_for(ref.config.vocab_size)
    max_new = 12
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref_ids, scores = hf_greedy(ref, p, max_new)
        assert_parity(o.token_ids, ref_ids, scores)
        assert o.prompt_token_ids == p and o.finish_reason == "length"


def test_real_model_parity_with_transformers(smollm):
    ref = _hf_from_gguf()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "1, 2, 3, 4,"]
    tok = smollm.tokenizer
    prompts = [tok.encode(t) for t in texts]
    outs = run_with(smollm, "overlap", prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ref_ids, scores = hf_greedy(ref, p, 16)
        assert_parity(o.token_ids, ref_ids, scores)


def _hf_from_gguf():
    import os

    from transformers import AutoModelForCausalLM

    from tandem.model.loader import default_model_path
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def test_chat_answers_paris(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.text
