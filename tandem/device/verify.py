"""The acceptance rule of a verified run, one definition for the device (FutureMap write) and the host
(process_results).

A speculating request occupies k + 1 consecutive decode rows of a step: its head row (input: its last token)
and one row per draft token d_1..d_k (input: the draft). Row j samples s_j exactly as the plain path samples
output position n + j. Drafts are accepted while s_j == d_{j+1}; the run kept is s_0..s_a, a the number of
accepted drafts, so s_a (the first sampled token that differs, or the bonus token after k accepted drafts) is
the request's last token, the next step's input.
"""
from __future__ import annotations

import numpy as np
import torch


def accepted_counts(draft_lens: np.ndarray, sampled: torch.Tensor, inputs: torch.Tensor
                    ) -> tuple[np.ndarray, torch.Tensor]:
    """(head rows [H], accepted drafts [H]) of a step's speculating rows. draft_lens [B] (host): k at a head row,
    -1 at a draft row, 0 elsewhere; sampled, inputs [B]: the sampled and the input token of each decode row
    (a decode row holds one token: row i is token i). No host sync: the gather indices are built on the host."""
    heads = np.flatnonzero(draft_lens > 0)
    ks = draft_lens[heads]
    kmax = int(ks.max())
    j = np.arange(kmax)
    idx = heads[:, None] + np.minimum(j[None, :], ks[:, None] - 1)              # [H, kmax] rows h .. h + k - 1
    valid = torch.from_numpy(j[None, :] < ks[:, None]).to(sampled.device)
    ix = torch.from_numpy(idx).to(sampled.device)
    match = (sampled[ix] == inputs[ix + 1]) & valid                               # s_j == d_{j+1}
    return heads, torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)        # leading matches


def kept_rows(draft_lens: np.ndarray, heads: np.ndarray, acc: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose sampled token is kept (a plain row's; of a run, rows 0..a)."""
    head_of = np.maximum.accumulate(np.where(draft_lens >= 0, np.arange(len(draft_lens)), 0))   # [B] run head
    full = torch.zeros(len(draft_lens), dtype=torch.int64, device=acc.device)
    full[torch.from_numpy(heads).to(acc.device)] = acc
    offset = torch.from_numpy(np.arange(len(draft_lens)) - head_of).to(acc.device)
    return offset <= full[torch.from_numpy(head_of).to(acc.device)]


def stash_values(draft_lens: np.ndarray, rows: torch.Tensor, sampled: torch.Tensor, heads: np.ndarray,
                 acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(request-table rows, last token) the FutureMap keeps after this step: a plain row's sampled token, a
    speculating request's s_a at its head row; draft rows write nothing (they share the head's table row).
    heads, acc: accepted_counts of the step."""
    last = sampled.clone()
    h = torch.from_numpy(heads).to(sampled.device)
    last[h] = sampled[h + acc]
    keep = torch.from_numpy(np.flatnonzero(draft_lens >= 0)).to(sampled.device)
    return rows[keep], last[keep]
