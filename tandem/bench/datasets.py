"""Benchmark requests: seeded prompts of token ids drawn from the vocabulary, with their output lengths.
Datasets: random (below), shared-prefix, long and multi-turn (at the end).

Lengths follow `vllm bench serve --dataset-name random`: with range ratio r, input lengths are uniform in
[L(1-r), L(1+r)] and output lengths in [O(1-r), O(1+r)]; r = 0 (the default) makes every request the same.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# Low ids hold the special tokens of most vocabularies (SmolLM2: 0..16); prompts leave them out.
LOWEST_ID = 100

# Words that are one token each in most BPE vocabularies: text prompts of about input_len tokens.
WORDS = ("the of and to in is was for on that with as by at from it an be this are or his which had not but "
         "have one they were all her she there would their we him been has when who will more no if out so "
         "said what up its about into than them can only other new some could time these two may then do "
         "first any my now such like our over man me even most made after also did many before must through "
         "back years where much your way well down should because each just those people how too little state "
         "good very make world still own see men work long get here between both life being under never day "
         "same another know while last might us great old year off come since against go came right used take "
         "three").split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int          # tokens (for text prompts: the word count, about one token per word)
    output_len: int


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0, text: bool = False) -> list[BenchRequest]:
    """`num_prompts` seeded random requests; `text`: prompts are strings of common words instead of ids."""
    for name, v in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    ins = _lengths(rng, num_prompts, input_len, range_ratio)
    outs = _lengths(rng, num_prompts, output_len, range_ratio)
    lo = min(LOWEST_ID, vocab_size // 2)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        if text:
            prompt: list[int] | str = " ".join(rng.choice(WORDS) for _ in range(n_in))
        else:
            prompt = [rng.randrange(lo, vocab_size) for _ in range(n_in)]
        reqs.append(BenchRequest(prompt, n_in, n_out))
    return reqs


def shared_prefix_requests(num_prompts: int, prefix_len: int, input_len: int, output_len: int, vocab_size: int,
                           seed: int = 0) -> list[BenchRequest]:
    """One random `prefix_len`-token prefix shared by every request, then `input_len` tokens of its own (a
    system prompt or few-shot header in front of each question: what the prefix cache is for)."""
    rng = random.Random(seed)
    lo = min(LOWEST_ID, vocab_size // 2)
    prefix = [rng.randrange(lo, vocab_size) for _ in range(prefix_len)]
    return [BenchRequest(prefix + [rng.randrange(lo, vocab_size) for _ in range(input_len)],
                         prefix_len + input_len, output_len) for _ in range(num_prompts)]


def agent_requests(num_prompts: int, tenants: int, system_len: int, input_len: int, output_len: int,
                   vocab_size: int, seed: int = 0) -> list[tuple[BenchRequest, int]]:
    """Agents of `tenants` tenants, each with a random `system_len`-token system prompt (tools, instructions) sent in
    front of every request of its, then `input_len` tokens of the request's own; the tenant of each request drawn
    at random. (request, its tenant). The working set is tenants x system_len tokens of KV: a prefix cache smaller
    than it keeps evicting the prompts the next requests need (the disk tier's workload, issue 68)."""
    rng = random.Random(seed)
    lo = min(LOWEST_ID, vocab_size // 2)
    systems = [[rng.randrange(lo, vocab_size) for _ in range(system_len)] for _ in range(tenants)]
    out = []
    for _ in range(num_prompts):
        t = rng.randrange(tenants)
        own = [rng.randrange(lo, vocab_size) for _ in range(input_len)]
        out.append((BenchRequest(systems[t] + own, system_len + input_len, output_len), t))
    return out


def long_requests(num_prompts: int, output_len: int, vocab_size: int, min_len: int = 1000, max_len: int = 4000,
                  seed: int = 0) -> list[BenchRequest]:
    """Prompts of `min_len` to `max_len` random tokens (chunked prefill's workload)."""
    rng = random.Random(seed)
    lo = min(LOWEST_ID, vocab_size // 2)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    return [BenchRequest([rng.randrange(lo, vocab_size) for _ in range(n)], n, output_len) for n in lengths]


def multi_turn_messages(num_conversations: int, turns: int, input_len: int, vocab_size: int,
                        seed: int = 0) -> list[list[list[int]]]:
    """conversation -> turn -> the user's new tokens. Each turn's prompt is the whole history (earlier
    messages and the model's answers) plus the new message, built by the runner as answers come back."""
    rng = random.Random(seed)
    lo = min(LOWEST_ID, vocab_size // 2)
    return [[[rng.randrange(lo, vocab_size) for _ in range(input_len)] for _ in range(turns)]
            for _ in range(num_conversations)]
