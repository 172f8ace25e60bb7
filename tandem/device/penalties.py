"""Repetition, frequency and presence penalties on the device, with per-row state kept beside the KV cache.

State per request-table row: pen_counts [rows, V] int32 (how often each token was sampled as an output) and
pen_prompt [rows, V] bool (tokens of the prompt). A row's first launch resets both (StepInput.pen_reset);
every launched prefill chunk adds its own ids, and a cached prefix adds its ids once (pen_prefix_ids):
positions below the prompt length go to pen_prompt, the rest (outputs re-prefilled after a retraction) to
pen_counts; each sampled token that is an output adds to pen_counts (pen_count). The one-step lag is safe:
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
        host_ids = torch.from_numpy(act & (step.use_future == 0)).to(self.device)[tok_row]   # [T]
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

    def apply(self, step: StepInput, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """Penalize the logits of the penalized rows in place."""
        act = np.nonzero(step.penalized())[0]
        a = torch.from_numpy(act).to(self.device)
        r = rows[a]
        counts = self.counts[r].float()                                  # [A, V]
        seen = counts > 0
        f32 = lambda x: torch.from_numpy(x[act]).to(self.device, torch.float32)[:, None]  # noqa: E731
        rep = f32(step.repetition_penalty)
        lg = logits[a]
        lg = torch.where(seen | self.prompt[r], torch.where(lg > 0, lg / rep, lg * rep), lg)
        logits[a] = lg - f32(step.frequency_penalty) * counts - f32(step.presence_penalty) * seen.float()

    def count_outputs(self, step: StepInput, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """After sampling: the sampled tokens that are outputs add to their rows' counts."""
        sel = np.nonzero(step.penalized() & (step.pen_count == 1))[0]
        if len(sel):
            s = torch.from_numpy(sel).to(self.device)
            self.counts.index_put_((rows[s], tokens[s]), torch.ones(len(sel), dtype=torch.int32,
                                                                    device=self.device), accumulate=True)


def apply_logit_bias(step: StepInput, logits: torch.Tensor) -> None:
    """logit_bias and min_tokens: add each (row, token, value) in place (-inf forbids)."""
    dev = logits.device
    logits.index_put_((torch.from_numpy(step.bias_rows).to(dev), torch.from_numpy(step.bias_ids).to(dev)),
                      torch.from_numpy(step.bias_vals).to(dev, logits.dtype), accumulate=True)
