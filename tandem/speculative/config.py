"""speculative_config: vLLM's names, checked once before anything starts."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16       # drafts a row verifies in one step at most


@dataclass(frozen=True)
class SpeculativeConfig:
    """What `LLM(..., speculative_config={...})` and `--speculative-config JSON` take.

    ngram: prompt lookup (the longest suffix of prompt + output, prompt_lookup_max down to prompt_lookup_min
    tokens, matched earlier in the same text proposes the tokens that followed it). draft_model: `model`, a smaller
    model with the target's tokenizer, samples the drafts (tandem/speculative/draft.py). disable_by_batch_size is vLLM's batch-size switch; below it the scheduler
    still drafts only what pays (scheduler/speculative.py)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4      # drafts verified per step (k; the step scores k + 1 positions)
    prompt_lookup_max: int = 4           # ngram: longest suffix matched
    prompt_lookup_min: int = 1           # ngram: shortest suffix matched
    model: str | None = None             # draft_model: the draft's GGUF file or Hugging Face folder
    disable_by_batch_size: int = 8       # decode batches with more requests than this run without speculation

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; known: {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
                raise ValueError(f"speculative_config: need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lo!r} and {hi!r}")
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method 'draft_model', not 'ngram'")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft's GGUF file or "
                             "Hugging Face folder, with the target's tokenizer)")
        b = self.disable_by_batch_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {b!r}")

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict, or a JSON object string (the CLI's form)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg}): {value!r}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object / dict, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(names))}")
        if "method" not in value:
            raise ValueError("speculative_config: 'method' is required (e.g. \"ngram\")")
        return cls(**value)

    @property
    def extra_rows(self) -> int:
        """Batch rows a step may carry beyond one per request: the draft rows of the speculating requests."""
        return self.disable_by_batch_size * self.num_speculative_tokens
