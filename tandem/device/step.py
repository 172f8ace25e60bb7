"""StepInput: the small message a launch sends to the device side (index tensors, no weights, no tokens
of earlier steps: decode rows read their input ids from the FutureMap)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Layout of the packed int64 header: B rows, T new tokens, P poisoned rows, S prefix slots, G grammar rows,
# and whether the grammar rows' token masks were written with the launch (1) or follow it (0).
_INT_FIELDS = ("rows", "extend_lens", "seq_lens", "use_future", "top_k", "draw_seed", "prefix_lens",
               "num_logprobs")                                                          # each [B]
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")
HEADER = 6                                       # each [B]


@dataclass
class StepInput:
    step_id: int
    rows: np.ndarray          # [B] request-table row of each batch row
    extend_lens: np.ndarray   # [B] new tokens this step (1 for decode)
    seq_lens: np.ndarray      # [B] KV length after this step
    use_future: np.ndarray    # [B] 1: the row's one input token comes from the FutureMap
    input_ids: np.ndarray     # [T] host ids for prefill rows (ignored where use_future)
    out_cache_loc: np.ndarray # [T] KV slot each new token is written to
    temperature: np.ndarray   # [B] float
    top_p: np.ndarray
    top_k: np.ndarray         # [B] int, <= 0 off
    min_p: np.ndarray
    draw_seed: np.ndarray     # [B] int64 noise seed, from (request seed, output position)
    poison_rows: np.ndarray   # [P] rows freed since the last launch (FutureMap poison in debug mode)
    # Prefix cache hits: a row's first launch maps positions [0, prefix_lens[i]) of its request-table row to
    # the cached KV slots in prefix_slots (rows concatenated); 0 for every other row.
    prefix_lens: np.ndarray = None    # [B]
    prefix_slots: np.ndarray = None   # [S]
    # The grammar branch: batch rows whose sampling is masked by a token bitmask ([G, ceil(V/32)] int32, sent
    # beside the step), and whether the masks came with the launch or follow it (see loops.py).
    grammar_rows: np.ndarray = None   # [G]
    mask_ready: bool = True
    num_logprobs: np.ndarray = None   # [B] top logprobs a row returns with its token's (-1: no logprobs)

    def __post_init__(self) -> None:
        if self.prefix_lens is None:
            self.prefix_lens = np.zeros(len(self.rows), np.int64)
        if self.prefix_slots is None:
            self.prefix_slots = np.zeros(0, np.int64)
        if self.grammar_rows is None:
            self.grammar_rows = np.zeros(0, np.int64)
        if self.num_logprobs is None:
            self.num_logprobs = np.full(len(self.rows), -1, np.int64)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def int_words(self) -> int:
        return HEADER + len(_INT_FIELDS) * self.batch_size + 2 * self.num_tokens + len(self.poison_rows) + \
            len(self.prefix_slots) + len(self.grammar_rows)

    def pack(self, ints: np.ndarray, floats: np.ndarray) -> None:
        """Write into preallocated shared buffers (int64 and float64)."""
        b, t, p, s = self.batch_size, self.num_tokens, len(self.poison_rows), len(self.prefix_slots)
        g = len(self.grammar_rows)
        ints[:HEADER] = (b, t, p, s, g, int(self.mask_ready))
        o = HEADER
        for name in _INT_FIELDS:
            ints[o:o + b] = getattr(self, name)
            o += b
        ints[o:o + t] = self.input_ids
        ints[o + t:o + 2 * t] = self.out_cache_loc
        o += 2 * t
        ints[o:o + p] = self.poison_rows
        ints[o + p:o + p + s] = self.prefix_slots
        ints[o + p + s:o + p + s + g] = self.grammar_rows
        for i, name in enumerate(_FLOAT_FIELDS):
            floats[i * b:(i + 1) * b] = getattr(self, name)

    @classmethod
    def unpack(cls, step_id: int, ints: np.ndarray, floats: np.ndarray) -> "StepInput":
        """Copies out of the shared buffers, so the host may reuse them once the step is done."""
        b, t, p, s, g, ready = (int(x) for x in ints[:HEADER])
        o = HEADER
        fields = {}
        for name in _INT_FIELDS:
            fields[name] = ints[o:o + b].copy()
            o += b
        fields["input_ids"] = ints[o:o + t].copy()
        fields["out_cache_loc"] = ints[o + t:o + 2 * t].copy()
        o += 2 * t
        fields["poison_rows"] = ints[o:o + p].copy()
        fields["prefix_slots"] = ints[o + p:o + p + s].copy()
        fields["grammar_rows"] = ints[o + p + s:o + p + s + g].copy()
        fields["mask_ready"] = bool(ready)
        for i, name in enumerate(_FLOAT_FIELDS):
            fields[name] = floats[i * b:(i + 1) * b].copy()
        return cls(step_id=step_id, **fields)
