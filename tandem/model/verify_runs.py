"""A verify step's speculating requests as a hybrid model's linear-attention layers see them, and how their states
are taken back to the tokens verification keeps.

A request with k drafts rides as k + 1 decode rows that share its request-table row (scheduler/make_batch.py); to
the linear layers it is one row of k + 1 tokens (its last token, then the drafts), which advance its state in order,
each token by the recurrent rule's arithmetic, as k + 1 decode steps would. Verification (device/verify.py) keeps
the first a + 1 of them; the state must then be the state after those alone. A recurrent state cannot be cut back,
so each layer records what it needs (the state before the run, the run's conv inputs and delta-rule inputs) and,
once the step's tokens are sampled, a run with rejected drafts gets its state from before the run and replays its
a + 1 kept tokens: the conv state is their last inputs, the delta rule runs again from the same state on the same
inputs (the same bits: its arithmetic per token depends only on the state and the token). Replaying the rule costs
~4 Dk Dv flops a head a kept token, far below the layer's projections; keeping a state per position would copy the
whole state k + 1 times a step (Qwen3.6-35B-A3B: 66 MB a copy).

The invariant this relies on, enforced where the scheduler picks (scheduler/speculative.py's assumable): no step
is launched with rows of a hybrid request picked on the assumption that its in-flight verify run holds, so no
dropped row ever advances a state past what its request keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


@dataclass
class LayerRecord:
    """One linear layer's view of the runs before it advanced them (tokens in the runs' order)."""
    conv: torch.Tensor          # [R, C, width - 1] each run's conv state before the step
    x: torch.Tensor             # [N, C] the conv's inputs of the runs' tokens
    ssm: torch.Tensor | None = None     # [R, Hv, Dk, Dv] each run's delta-rule state before the step
    rule: tuple = ()            # (k, v, g, beta) of the runs' tokens, as the rule took them


@dataclass
class VerifyRuns:
    """The step's runs: the i-th holds lens[i] tokens from starts[i] in state slot slots[i]. The states before the
    step go to `saved` (conv [L, >= R, C, width - 1], ssm [L, >= R, Hv, Dk, Dv]: the pool's scratch, kept between
    steps, so a step's copies touch no new page)."""
    slots: list[int]
    starts: list[int]
    lens: list[int]
    saved: tuple = ()
    layers: dict[int, LayerRecord] = field(default_factory=dict)     # by linear layer index, filled as they run

    def __post_init__(self) -> None:
        self.tokens = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(self.starts, self.lens)]))
        self.offsets = [0, *np.cumsum(self.lens).tolist()]           # run i's tokens in a record: offsets[i:i + 2]
        self.slots_t = torch.tensor(self.slots, dtype=torch.int64, device=self.saved[0].device) if self.saved \
            else torch.tensor(self.slots, dtype=torch.int64)           # once a step, read by every layer

    @classmethod
    def of(cls, rows: np.ndarray, draft_lens: np.ndarray, extend_lens: np.ndarray,
           scratch: Callable[[int], tuple]) -> "VerifyRuns | None":
        """The runs of a step's rows (StepInput: request-table rows, draft_lens, extend_lens), before merging;
        scratch(R): where R runs' states before the step go."""
        heads = np.flatnonzero(draft_lens > 0)
        if not len(heads):
            return None
        first = np.concatenate([[0], np.cumsum(extend_lens)])
        return cls([int(r) for r in rows[heads]], [int(s) for s in first[heads]],
                   [int(k) + 1 for k in draft_lens[heads]], scratch(len(heads)))

    def before_conv(self, j: int, conv: torch.Tensor, x: torch.Tensor) -> None:
        """Layer j, before its conv: the runs' conv states (conv: the layer's pool) and inputs (x [T, C])."""
        out = self.saved[0][j, :len(self.slots)]
        torch.index_select(conv, 0, self.slots_t, out=out)
        self.layers[j] = LayerRecord(out, x[self.tokens.to(x.device)])

    def before_rule(self, j: int, ssm: torch.Tensor, k, v, g, beta) -> None:
        """Layer j, before its delta rule: the runs' states (ssm: the layer's pool) and inputs ([T, ...] each)."""
        rec, tok = self.layers[j], self.tokens.to(v.device)
        rec.ssm = self.saved[1][j, :len(self.slots)]
        torch.index_select(ssm, 0, self.slots_t, out=rec.ssm)
        rec.rule = tuple(t[tok] for t in (k, v, g, beta))

    def kept_back(self, kept: list[int]) -> list[int]:
        """The runs that keep fewer tokens than they ran (kept[i]: run i's accepted drafts + 1)."""
        return [i for i, (n, length) in enumerate(zip(kept, self.lens)) if n < length]

    def kept_tokens(self, back: list[int], kept: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The record's rows of those runs' kept tokens, and where each run starts among them."""
        idx = np.concatenate([np.arange(self.offsets[i], self.offsets[i] + kept[i]) for i in back])
        return torch.from_numpy(idx), [0, *np.cumsum([kept[i] for i in back]).tolist()]
