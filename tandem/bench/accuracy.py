"""Accuracy of the int8-activation decode path: next-token distributions over real text against the exact mode.

The gate of issue 17: over >= 4k tokens of real text, the KL divergence of tandem's next-token distributions
from the fp32 reference (tandem's exact mode, kernels_act="fp32": dequantized weights, fp32 activations,
greedy parity with transformers) is at most llama.cpp's own on the same GGUF. Both engines are teacher-forced
on the same token ids. tandem's prompt runs in chunks of at most small_m() tokens, so every quantized linear
takes the in-kernel rows, the path a decode step takes (a row's numerics do not depend on how many rows ride
with it); its distributions are captured where prompt logprobs are computed (every prompt position's full
logits, before the top-k is taken).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def real_text(min_chars: int = 40_000) -> list[str]:
    """Documents of real English prose that every Python install ships: the topics of the language reference
    (pydoc_data.topics), longest first, until min_chars characters."""
    from pydoc_data.topics import topics
    docs, n = [], 0
    for key in sorted(topics, key=lambda k: -len(topics[k])):
        docs.append(topics[key])
        n += len(topics[key])
        if n >= min_chars:
            break
    return docs


@contextlib.contextmanager
def _capture_prompt_logits(out: list[torch.Tensor]):
    """Record the full logits [rows, V] of every prompt-logprob piece the model runner computes (in order)."""
    from ..device import model_runner
    orig = model_runner.prompt_logprobs

    def spy(logits, targets, k):
        out.append(logits.float().log_softmax(-1))
        return orig(logits, targets, k)
    model_runner.prompt_logprobs = spy
    try:
        yield
    finally:
        model_runner.prompt_logprobs = orig


def teacher_forced_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log p(. | ids[:i+1]) for i < len(ids) - 1, [len(ids) - 1, V], from an LLM built with
    device_backend="inline" (the model runner in this process)."""
    from ..sampling_params import SamplingParams
    got: list[torch.Tensor] = []
    with _capture_prompt_logits(got):
        llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    lp = torch.cat(got)
    assert lp.shape[0] == len(ids) - 1, (lp.shape, len(ids))
    return lp


def llama_cpp_logprobs(llama, ids: list[int]) -> torch.Tensor:
    """The same from a llama_cpp.Llama built with logits_all=True (its own KV cache reset first)."""
    import numpy as np
    llama.reset()
    llama.eval(ids)
    scores = np.asarray(llama.scores[:len(ids) - 1], dtype=np.float32)
    return torch.from_numpy(scores).log_softmax(-1)


@dataclass
class Divergence:
    tokens: int            # positions compared
    kl_mean: float         # mean KL(ref || test) in nats
    kl_p99: float          # its 99th percentile over positions
    top1_agree: float      # fraction of positions whose argmax equals the reference's


def divergence(ref: torch.Tensor, test: torch.Tensor) -> Divergence:
    """KL(ref || test) per position of two [N, V] log-probability tensors (test's extra vocabulary rows of
    padding, if any, dropped), summarized."""
    v = min(ref.shape[1], test.shape[1])
    ref, test = ref[:, :v], test[:, :v]
    kl = (ref.exp() * (ref - test)).sum(-1).clamp_min(0)
    return Divergence(int(kl.numel()), float(kl.mean()), float(kl.quantile(0.99)),
                      float((ref.argmax(-1) == test.argmax(-1)).float().mean()))
