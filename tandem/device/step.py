"""StepInput: the small message a launch sends to the device side (index tensors, no weights, no tokens
of earlier steps: decode rows read their input ids from the FutureMap)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Packed layout. ints (int64): a header [B, mask_ready, length of each VAR_INTS field, of each VAR_FLOATS
# field], then each ROW_INTS field ([B] each), then each VAR_INTS field. floats (float64): each ROW_FLOATS
# field ([B] each), then each VAR_FLOATS field.
ROW_INTS = ("rows", "extend_lens", "seq_lens", "use_future", "top_k", "draw_seed", "prefix_lens", "num_logprobs",
            "prompt_lens", "pen_reset", "pen_count", "prompt_logprobs", "next_ids", "draft_lens", "embed")
ROW_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
VAR_INTS = ("input_ids", "out_cache_loc", "poison_rows", "prefix_slots", "grammar_rows", "pen_prefix_ids",
            "bias_rows", "bias_ids", "stash_rows", "stash_ids", "state_ops", "kv_saves", "kv_loads",
            "kv_state_saves", "kv_state_loads")
VAR_FLOATS = ("bias_vals",)
HEADER = 2 + len(VAR_INTS) + len(VAR_FLOATS)


def _ints(n: int = 0, fill: int = 0) -> np.ndarray:
    return np.full(n, fill, np.int64)


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
    # Prompt logprobs (echo with logprobs): a prefill row with prompt_logprobs >= 0 returns the logprob of
    # each of its ids after the first (and that many top alternatives), the chunk's last position scoring
    # next_ids[i], the first id of its next chunk (-1: the chunk ends the prompt; its last position samples).
    prompt_logprobs: np.ndarray = None    # [B]
    next_ids: np.ndarray = None           # [B]
    # Penalties (device state per request-table row: output-token counts, prompt tokens seen). A row's first
    # launch resets its state (pen_reset) and adds its cached prefix ids (pen_prefix_ids, rows concatenated,
    # prefix_lens[i] each); every launched chunk adds its own input ids (positions < prompt_lens[i] to the
    # prompt, the rest to the counts); a sampled token counts where pen_count[i] (not a non-final chunk's).
    prompt_lens: np.ndarray = None    # [B]
    pen_reset: np.ndarray = None      # [B] 1: (re)start this row's penalty state
    pen_count: np.ndarray = None      # [B] 1: the sampled token is an output the penalties count
    presence_penalty: np.ndarray = None     # [B] float, 0 off
    frequency_penalty: np.ndarray = None    # [B] float, 0 off
    repetition_penalty: np.ndarray = None   # [B] float, 1 off
    pen_prefix_ids: np.ndarray = None       # [Q]
    # Additive logit biases (logit_bias, and -inf for tokens min_tokens forbids): row, token, value.
    bias_rows: np.ndarray = None      # [L]
    bias_ids: np.ndarray = None       # [L]
    bias_vals: np.ndarray = None      # [L] float
    # Speculative decoding (tandem/device/verify.py): k at the head row of a request verifying k drafts
    # (its k draft rows follow it, same table row, host input ids), -1 at a draft row, 0 at a plain row.
    draft_lens: np.ndarray = None     # [B]
    # Pipeline parallelism (device/parallel/pp.py): the FutureMap relay. Rows and the ids the last stage sampled for
    # them in steps the host has waited for since the last launch; the first stage stashes them first.
    stash_rows: np.ndarray = None     # [R]
    stash_ids: np.ndarray = None      # [R]
    # Embeddings (device/embed.py): flags of an embeddings request's prefill chunk: OUT (its last chunk: the pooled
    # vector comes back with the step's results, rows in batch order), MEAN (mean pooling: its positions add to the
    # row's sum), RESET (that sum starts at zero); 0 elsewhere.
    embed: np.ndarray = None          # [B]
    # A hybrid model's state checkpoints (memory/state_checkpoints.py): (kind, from, to) triples, saves of released
    # rows and restores into rows before the forward, saves of rows whose chunk ends a checkpoint after it.
    state_ops: np.ndarray = None      # [3 S]
    # The disk tier (memory/disk_tier.py, device/kv_disk.py), before the forward: saves (a chunk's key words and its
    # CHUNK_TOKENS slots, each) copied out first, then loads (key words, skip, n, n slots) written into their slots.
    kv_saves: np.ndarray = None
    kv_loads: np.ndarray = None
    # A hybrid's state entries (memory/disk_tier.py): saves (key words, checkpoint id, tail, parent key words, the
    # tail's slots) copied out with the saves, loads (key words, checkpoint id, tail, its slots) with the loads.
    kv_state_saves: np.ndarray = None
    kv_state_loads: np.ndarray = None

    def __post_init__(self) -> None:
        b = len(self.rows)
        defaults = {"prefix_lens": _ints(b), "num_logprobs": _ints(b, -1), "prompt_lens": _ints(b),
                    "prompt_logprobs": _ints(b, -1), "next_ids": _ints(b, -1), "draft_lens": _ints(b),
                    "pen_reset": _ints(b), "pen_count": _ints(b), "embed": _ints(b), "presence_penalty": np.zeros(b),
                    "frequency_penalty": np.zeros(b), "repetition_penalty": np.ones(b), "bias_vals": np.zeros(0)}
        for name in ROW_INTS + ROW_FLOATS + VAR_INTS + VAR_FLOATS:
            if getattr(self, name) is None:
                setattr(self, name, defaults.get(name, _ints()))

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def has_penalties(self) -> bool:
        return bool(self.penalized().any())

    def penalized(self) -> np.ndarray:
        """[B] rows whose request uses a presence, frequency or repetition penalty."""
        return (self.presence_penalty != 0) | (self.frequency_penalty != 0) | (self.repetition_penalty != 1)

    def int_words(self) -> int:
        return HEADER + len(ROW_INTS) * self.batch_size + sum(len(getattr(self, n)) for n in VAR_INTS)

    def float_words(self) -> int:
        return len(ROW_FLOATS) * self.batch_size + sum(len(getattr(self, n)) for n in VAR_FLOATS)

    def pack(self, ints: np.ndarray, floats: np.ndarray) -> None:
        """Write into preallocated shared buffers (int64 and float64)."""
        b = self.batch_size
        ints[:HEADER] = (b, int(self.mask_ready), *(len(getattr(self, n)) for n in VAR_INTS + VAR_FLOATS))
        o = HEADER
        for name in ROW_INTS + VAR_INTS:
            a = getattr(self, name)
            ints[o:o + len(a)] = a
            o += len(a)
        o = 0
        for name in ROW_FLOATS + VAR_FLOATS:
            a = getattr(self, name)
            floats[o:o + len(a)] = a
            o += len(a)

    @classmethod
    def unpack(cls, step_id: int, ints: np.ndarray, floats: np.ndarray) -> "StepInput":
        """Copies out of the shared buffers, so the host may reuse them once the step is done."""
        header = [int(x) for x in ints[:HEADER]]
        b, ready = header[:2]
        lens = dict(zip(VAR_INTS + VAR_FLOATS, header[2:]))
        fields: dict = {"mask_ready": bool(ready)}
        o = HEADER
        for name in ROW_INTS + VAR_INTS:
            n = lens.get(name, b)
            fields[name] = ints[o:o + n].copy()
            o += n
        o = 0
        for name in ROW_FLOATS + VAR_FLOATS:
            n = lens.get(name, b)
            fields[name] = floats[o:o + n].copy()
            o += n
        return cls(step_id=step_id, **fields)


def prompt_logprob_targets(step: StepInput) -> tuple[np.ndarray, np.ndarray] | None:
    """Flat token indices whose logits score a prompt token, and those tokens: every position of a row that
    asks but its last, which scores next_ids (or samples, when the chunk ends the prompt). Rows in batch
    order, positions ascending; the host reads the results in the same order."""
    ask = np.nonzero((step.prompt_logprobs >= 0) & (step.use_future == 0))[0]
    if not len(ask):
        return None
    starts = np.cumsum(step.extend_lens) - step.extend_lens
    index, target = [], []
    for i in ask:
        s, n = int(starts[i]), int(step.extend_lens[i])
        ids = list(step.input_ids[s + 1:s + n]) + ([int(step.next_ids[i])] if step.next_ids[i] >= 0 else [])
        index.extend(range(s, s + len(ids)))
        target.extend(ids)
    return np.array(index, np.int64), np.array(target, np.int64)
