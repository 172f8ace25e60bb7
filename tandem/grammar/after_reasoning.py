"""A grammar that starts after the reasoning (vLLM's rule with a reasoning parser): a thinking model's
`<think> ... </think>` is free text, and the structured output (a JSON schema, a regex, a tool call) constrains
what follows the end tag.

The rule is enforced here and only here: the scheduler's grammar branch asks every grammar row for its mask and
feeds it every sampled token (scheduler/grammar.py), in both loops, and speculation never runs on grammar rows
(scheduler/speculative.py), so wrapping the matcher is all it takes. A request says where its reasoning ends with
SamplingParams.reasoning_end_ids (the end tag's token ids) and, when its output may or may not open a reasoning
part, reasoning_start_id (the start tag, one token):
- "reasoning": every token is allowed, none reaches the grammar; once the output's last tokens are the end ids,
  "grammar";
- "maybe" (reasoning_start_id set): the grammar's mask plus the start token; the start token opens "reasoning",
  any other token is the grammar's first;
- "grammar": the wrapped matcher, as if the output began here.
"""
from __future__ import annotations

import numpy as np


class AfterReasoning:
    """GrammarMatcher's interface (accept, done, error, fill_mask) around one, gated by the reasoning."""

    def __init__(self, matcher, end_ids: list[int], start_id: int | None = None) -> None:
        self.m, self.end = matcher, list(end_ids)
        self.start = start_id
        self.state = "maybe" if start_id is not None else "reasoning"
        self.tail: list[int] = []           # the output's last len(end) tokens while reasoning

    def accept(self, token: int) -> bool:
        if self.state == "maybe":
            if token == self.start:
                self.state = "reasoning"
                return True
            self.state = "grammar"
        if self.state == "reasoning":
            self.tail = (self.tail + [token])[-len(self.end):]
            if self.tail == self.end:
                self.state = "grammar"
            return True
        return self.m.accept(token)

    @property
    def done(self) -> bool:
        return self.state == "grammar" and self.m.done

    @property
    def error(self) -> str:
        return self.m.error

    def fill_mask(self, row: np.ndarray) -> None:
        if self.state == "reasoning":
            row.fill(-1)
            return
        self.m.fill_mask(row)
        if self.state == "maybe":
            row.view(np.uint32)[self.start // 32] |= np.uint32(1 << (self.start % 32))
