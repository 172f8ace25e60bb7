"""What a user asks of one generation, with the field names of vLLM and the OpenAI API."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from .grammar.spec import StructuredOutputsParams

# Temperatures below this act greedy, as in vLLM: dividing logits by ~1e-38 overflows to inf/NaN and would
# sample garbage instead of the argmax.
GREEDY_EPS = 1e-5
INT64 = 1 << 63
MAX_LOGPROBS = 20            # top logprobs per token at most (OpenAI's limit)
MAX_LOGIT_BIAS = 300         # logit_bias entries at most (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 512     # with logit_bias and the EOS ids, within the device's MAX_BIASES a row
MAX_N = 128                  # samples per prompt (n) at most: each is a request of its own
SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15   # seed of sample i = seed + i * stride (mod 2**63): far apart, odd


MAX_USER_CHARS = 256    # a tenant name (fair share keys a counter on it)

@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None: up to the context length
    temperature: float = 1.0             # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1                      # -1 (or 0): off
    min_p: float = 0.0
    seed: int | None = None              # same seed, same output, whatever the batch mates
    stop: str | list[str] | None = None  # stop strings, not included in the text (unless the flag below)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False   # keep the matched stop string at the end of the text
    n: int = 1                           # completions per prompt (independent samples; seeds derived per sample)
    structured_outputs: StructuredOutputsParams | dict | None = None  # constrain the output (JSON schema, regex ...)
    logprobs: int | None = None          # return each token's logprob and this many top alternatives (0-20)
    prompt_logprobs: int | None = None   # the same for the prompt's tokens (their KV is then not cached)
    presence_penalty: float = 0.0        # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0       # subtracted once per occurrence of a token in the output
    repetition_penalty: float = 1.0      # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None   # added to those tokens' logits (-100..100; -100 about bans)
    min_tokens: int = 0                  # EOS and stop_token_ids are forbidden, stop strings ignored, before this
    # Seconds from its arrival after which the request ends wherever it is, waiting or running: finish_reason
    # "error" with error_status 408 (the server answers 408 `timeout`, or an error event in a stream); None: none.
    timeout: float | None = None
    # With structured_outputs and a reasoning model (tandem/grammar/after_reasoning.py): the grammar starts once
    # the output has generated these ids (the reasoning's end tag); with reasoning_start_id, the output may open
    # the reasoning with that token first, else the grammar applies from the start. None: from the start.
    reasoning_end_ids: list[int] | None = None
    reasoning_start_id: int | None = None
    priority: int = 0                    # --scheduling-policy priority: lower goes first (vLLM's sign); else no effect
    user: str | None = None              # the tenant (OpenAI's `user`): --scheduling-policy fair shares by it
    # An embeddings request (prefill only): the prompt's pooled final-normed hidden state, L2-normalized,
    # comes back in StepOutput.embedding and nothing is generated (max_tokens 1: its one sampled token is dropped).
    embed: bool = False
    pooling: str = "last"                # with embed: "last" token's state, or "mean" of every prompt position

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):     # JSON keys are strings ("50256": -100)
            self.logit_bias = {int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        try:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid sampling parameter structured_outputs: {e}") from None
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field; called before anything is queued."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}={quote(getattr(self, name))}: {why}")

        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            bad("repetition_penalty", "must be in (0, 100] (1 is off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for t, v in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0 or \
                        (vocab_size is not None and t >= vocab_size):
                    bad("logit_bias", f"token ids must be integers in [0, {vocab_size or 'vocab_size'})")
                if not _is_number(v) or not -100.0 <= v <= 100.0:
                    bad("logit_bias", "biases must be numbers in [-100, 100]")
        if self.timeout is not None and (not _is_number(self.timeout) or not math.isfinite(self.timeout)
                                         or self.timeout <= 0):
            bad("timeout", "must be a finite number of seconds > 0")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or abs(self.priority) >= 2 ** 63:
            bad("priority", "must be an integer (lower goes first)")
        if self.user is not None and (not isinstance(self.user, str) or len(self.user) > MAX_USER_CHARS):
            bad("user", f"must be a string of at most {MAX_USER_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0 or \
                (isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        top_k_max = vocab_size if vocab_size is not None else INT64 - 1
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= top_k_max:
            bad("top_k", f"must be -1 (off), 0 (off) or an integer in [1, {vocab_size or 'vocab_size'}]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -INT64 <= self.seed < INT64):
            bad("seed", "must be a 64-bit integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(is_utf8(s) for s in self.stop):
            bad("stop", "must be valid Unicode text (no lone UTF-16 surrogates)")
        if not isinstance(self.embed, bool):
            bad("embed", "must be a boolean")
        if self.pooling not in ("last", "mean") or (self.pooling == "mean" and not self.embed):
            bad("pooling", "must be 'last' or 'mean', and 'mean' only with embed")
        if self.embed and (self.max_tokens != 1 or self.n != 1 or self.logprobs is not None or self.min_tokens
                           or self.prompt_logprobs is not None or self.structured_outputs is not None):
            bad("embed", "an embeddings request generates nothing: max_tokens 1, n 1, no logprobs, min_tokens "
                         "or structured_outputs")
        if self.reasoning_start_id is not None and not self.reasoning_end_ids:
            bad("reasoning_start_id", "needs reasoning_end_ids")
        for t in self.stop_token_ids + list(self.reasoning_end_ids or []) + \
                ([] if self.reasoning_start_id is None else [self.reasoning_start_id]):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids" if t in self.stop_token_ids else "reasoning_end_ids",
                    f"ids must be integers in [0, {vocab_size or 'vocab_size'})")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    def sample(self, i: int) -> "SamplingParams":
        """The params of the i-th of n samples: n=1, and a seed of its own derived from this seed (sample 0
        keeps it), so the n samples differ and each is reproducible."""
        seed = self.seed if self.seed is None or i == 0 else (self.seed + i * SAMPLE_SEED_STRIDE) % INT64
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that only the argmax can win (GREEDY_EPS)."""
        return self.temperature < GREEDY_EPS


QUOTE_CHARS = 200      # an error quotes a value up to this many characters of its repr


def quote(value: Any) -> str:
    """repr(value), cut to QUOTE_CHARS: a 50,000-entry logit_bias must not come back as a 600k-character error."""
    r = repr(value)
    return r if len(r) <= QUOTE_CHARS else f"{r[:QUOTE_CHARS]}... ({len(r)} characters)"


def is_utf8(text: str) -> bool:
    """False for text that has no UTF-8 form (a lone surrogate such as "\\ud800"): no tokenizer takes it."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
