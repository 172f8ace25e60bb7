"""Grammar compiling and matching with llguidance: a compile cache keyed by the spec, one tokenizer view
built once, and the per-request matcher that advances with each processed token and writes the next
token mask.

Token masks are bitmasks, [rows, ceil(V / 32)] int32, bit t of a row set when token t is allowed: 6 KiB a
row for a 49k vocabulary, so the host hands the device a few KiB per grammar row and step.
"""
from __future__ import annotations

import collections
import threading

import numpy as np

from .spec import StructuredOutputsParams, grammar_text

CACHE_SIZE = 256             # compiled grammars kept (LRU)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Thread-safe: the frontend validates on its tokenizer pool, the engine compiles off its loop."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int] | frozenset[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tok = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, str] = collections.OrderedDict()

    def tokenizer(self):
        """llguidance's view of the vocabulary (~0.5 s to build; once)."""
        with self._lock:
            if self._tok is None:
                import llguidance.hf
                self._tok = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
            return self._tok

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The validated grammar of a spec (cached); ValueError with llguidance's message if it is invalid."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        from llguidance import LLMatcher
        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {spec.kind} for structured output: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer())
        if error:
            raise ValueError(f"invalid {spec.kind} for structured output: {error.strip()}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutputsParams) -> "GrammarMatcher":
        from llguidance import LLMatcher
        return GrammarMatcher(LLMatcher(self.tokenizer(), self.compile(spec)), self.vocab_size)


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.m = matcher
        self.words = mask_words(vocab_size)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher is then dead)."""
        return self.m.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete (the JSON closed): nothing but EOS may follow."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row ([words] int32, C-contiguous)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"] and row.size == self.words
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)
