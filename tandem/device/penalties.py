"""Repetition, frequency and presence penalties on the device, with per-row state kept beside the KV cache.

State per request-table row: pen_counts [rows, V] int32 (how often each token was sampled as an output) and
pen_prompt [rows, V] bool (tokens of the prompt). A row's first launch resets both (StepInput.pen_reset);
every launched prefill chunk adds its own ids, and a cached prefix adds its ids once (pen_prefix_ids):
positions below the prompt length go to pen_prompt, the rest (outputs re-prefilled after a retraction) to
pen_counts; each sampled token that is an output adds to pen_counts (pen_count). Speculative decoding: a draft
row (StepInput.draft_lens -1) adds no input, is penalized as if the drafts up to its own were outputs (they
are, if accepted), and of a verified run only the kept tokens s_0..s_a count. The one-step lag is safe:
a finished request that rides in batch k updates its freed row before any later step resets it (steps run
in launch order).

Penalized logits, vLLM's definitions (applied before temperature):
  repetition (prompt or output tokens): l / r if l > 0 else l * r;
  then  l -= frequency * count + presence * [count > 0]  (output tokens)
"""
from __future__ import annotations

import numpy as np
import torch

from .step import StepInput


class PenaltyState:
    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, device
        self.counts: torch.Tensor | None = None     # [rows, V] int32, made at the first penalized step
        self.prompt: torch.Tensor | None = None     # [rows, V] bool

    def update_inputs(self, step: StepInput, rows: torch.Tensor, tok_row: torch.Tensor, positions: torch.Tensor,
                      input_ids: torch.Tensor) -> None:
        """Before the forward: resets, cached prefix ids and the step's own prefill ids."""
        if self.counts is None:
            self.counts = torch.zeros(self.rows, self.vocab, dtype=torch.int32, device=self.device)
            self.prompt = torch.zeros(self.rows, self.vocab, dtype=torch.bool, device=self.device)
        act = step.penalized()
        reset = np.nonzero(act & (step.pen_reset == 1))[0]
        if len(reset):
            r = rows[torch.from_numpy(reset).to(self.device)]
            self.counts[r] = 0
            self.prompt[r] = False
            lens = step.prefix_lens[reset]
            if lens.sum():
                batch_row = np.repeat(reset, lens)
                pos = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
                self._add(step, rows, torch.from_numpy(batch_row).to(self.device),
                          torch.from_numpy(pos).to(self.device),
                          torch.from_numpy(step.pen_prefix_ids).to(self.device))
        host_ids = torch.from_numpy(act & (step.use_future == 0) & (step.draft_lens >= 0)).to(self.device)[tok_row]
        if bool(host_ids.any()):
            sel = host_ids.nonzero().squeeze(1)
            self._add(step, rows, tok_row[sel], positions[sel], input_ids[sel])

    def _add(self, step: StepInput, rows: torch.Tensor, batch_row: torch.Tensor, pos: torch.Tensor,
             ids: torch.Tensor) -> None:
        in_prompt = pos < torch.from_numpy(step.prompt_lens).to(self.device)[batch_row]
        r = rows[batch_row]
        self.prompt[r[in_prompt], ids[in_prompt]] = True
        out = ~in_prompt
        self.counts.index_put_((r[out], ids[out]), torch.ones_like(ids[out], dtype=torch.int32), accumulate=True)

    def apply(self, step: StepInput, rows: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Penalize the logits of the penalized rows in place."""
        act = np.nonzero(step.penalized())[0]
        a = torch.from_numpy(act).to(self.device)
        r = rows[a]
        counts = self.counts[r].float()                                  # [A, V]
        if (step.draft_lens[act] < 0).any():
            counts = counts + self._draft_counts(step, act, input_ids)
        seen = counts > 0
        f32 = lambda x: torch.from_numpy(x[act]).to(self.device, torch.float32)[:, None]  # noqa: E731
        rep = f32(step.repetition_penalty)
        lg = logits[a]
        lg = torch.where(seen | self.prompt[r], torch.where(lg > 0, lg / rep, lg * rep), lg)
        logits[a] = lg - f32(step.frequency_penalty) * counts - f32(step.presence_penalty) * seen.float()

    def _draft_counts(self, step: StepInput, act: np.ndarray, input_ids: torch.Tensor) -> torch.Tensor:
        """[A, V]: for each penalized draft row at offset j of its run, one count per draft d_1..d_j (the inputs
        of the run's rows 1..j: the outputs before its position if they are accepted); 0 for other rows."""
        dl = step.draft_lens
        a_idx, t_idx = [], []
        for i, row in enumerate(act):
            if dl[row] >= 0:
                continue
            head = row - 1
            while dl[head] < 0:
                head -= 1
            a_idx.extend([i] * (row - head))
            t_idx.extend(range(head + 1, row + 1))         # decode rows hold one token: row i is token i
        extra = torch.zeros(len(act), self.vocab, dtype=torch.float32, device=self.device)
        ti = torch.tensor(t_idx, dtype=torch.int64, device=self.device)
        extra.index_put_((torch.tensor(a_idx, dtype=torch.int64, device=self.device), input_ids[ti]),
                         torch.ones(len(t_idx), device=self.device), accumulate=True)
        return extra

    def count_outputs(self, step: StepInput, rows: torch.Tensor, tokens: torch.Tensor,
                      kept: torch.Tensor | None = None) -> None:
        """After sampling: the sampled tokens that are outputs add to their rows' counts. kept [B] bool: of a
        speculative step, the rows whose token its acceptance kept (verify.kept_rows)."""
        sel = np.nonzero(step.penalized() & (step.pen_count == 1))[0]
        if len(sel):
            s = torch.from_numpy(sel).to(self.device)
            if kept is not None:
                s = s[kept[s]]
            self.counts.index_put_((rows[s], tokens[s]), torch.ones(len(s), dtype=torch.int32,
                                                                    device=self.device), accumulate=True)


def apply_logit_bias(step: StepInput, logits: torch.Tensor) -> None:
    """logit_bias and min_tokens: add each (row, token, value) in place (-inf forbids)."""
    dev = logits.device
    logits.index_put_((torch.from_numpy(step.bias_rows).to(dev), torch.from_numpy(step.bias_ids).to(dev)),
                      torch.from_numpy(step.bias_vals).to(dev, logits.dtype), accumulate=True)
