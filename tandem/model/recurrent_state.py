"""The per-request state of a hybrid model's linear-attention layers (linear_attention.py), beside the paged KV cache
of its attention layers: a fixed-size slot per request-table row, not pages that grow with its tokens.

A request's slot is its row: allocated with the row (memory/req_table.py), released with it, so the scheduler's
admission, which already counts rows, counts the state too. A row's first step starts from position 0 (zeros, see
RecurrentRows.fresh) or from what its earlier steps left in the slot: chunked prefill and decode carry it on. Row 0 is
the padding row: a padded batch row may update its slot, which no request reads.

Per row and linear layer: the conv state [q/k/v channels, width - 1] and the delta rule's [value heads, Dk, Dv],
both fp32 (Qwen3.6-35B-A3B: 30 layers x (8192 x 3 + 32 x 128 x 128) x 4 B ~ 66 MB a request).
"""
from __future__ import annotations

import numpy as np
import torch

from .config import ModelConfig
from ..memory.state_checkpoints import RESTORE, SAVE_AFTER
from .linear_attention import RecurrentRows
from .verify_runs import VerifyRuns


def state_bytes_per_row(c: ModelConfig, layers: int) -> int:
    """Bytes of one row's state over `layers` linear-attention layers."""
    conv = c.linear_conv_dim * (c.linear_conv_kernel - 1)
    ssm = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return layers * (conv + ssm) * 4


class RecurrentState:
    """The device's state pool: conv [L, rows, C, width - 1] and ssm [L, rows, Hv, Dk, Dv], fp32; and
    the prefix cache's checkpoints of it, the same per layer, `checkpoints` of them
    (memory/state_checkpoints.py decides what each holds)."""

    def __init__(self, c: ModelConfig, layers: int, rows: int, device: torch.device, checkpoints: int = 0) -> None:
        shapes = ((c.linear_conv_dim, c.linear_conv_kernel - 1),
                  (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))
        # Left uninitialized, as the KV cache: a row's first step starts from zeros (fresh) whatever its slot holds,
        # a checkpoint is written before it is read, and pages never touched cost no memory (a 4-layer
        # Qwen3.6-35B-A3B-shaped file's 133 rows and 256 checkpoints would have held 2.6 GB at once). Row 0, the
        # padding row padded batch rows read, is zeroed.
        self.conv, self.ssm = (torch.empty(layers, rows, *sh, dtype=torch.float32, device=device) for sh in shapes)
        self.conv[:, 0].zero_()
        self.ssm[:, 0].zero_()
        self.saved_conv, self.saved_ssm = (torch.empty(layers, checkpoints, *sh, dtype=torch.float32, device=device)
                                           for sh in shapes)
        self.device = device
        self._scratch = tuple(t[:, :0] for t in (self.conv, self.ssm))     # scratch(): none until a verify step

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in (self.conv, self.ssm, self.saved_conv, self.saved_ssm, *self._scratch))

    def copy(self, ops: np.ndarray, after_forward: bool) -> None:
        """The step's checkpoint copies (StepInput.state_ops), in their order: before the forward, saves of rows
        into checkpoints, then restores of checkpoints into rows; after it, the saves of chunk ends."""
        for kind, src, dst in np.asarray(ops).reshape(-1, 3).tolist():
            if (kind == SAVE_AFTER) != after_forward:
                continue
            if kind == RESTORE:
                self.conv[:, dst].copy_(self.saved_conv[:, src])
                self.ssm[:, dst].copy_(self.saved_ssm[:, src])
            else:
                self.saved_conv[:, dst].copy_(self.conv[:, src])
                self.saved_ssm[:, dst].copy_(self.ssm[:, src])

    def scratch(self, runs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for `runs` rows' states (conv, ssm; every layer), where a verify step keeps the states its runs
        started from (model/verify_runs.py): grown to the most runs a step has had, and kept."""
        if self._scratch[0].shape[1] < runs:
            self._scratch = tuple(torch.empty(t.shape[0], runs, *t.shape[2:], dtype=t.dtype, device=t.device)
                                  for t in (self.conv, self.ssm))
        return self._scratch

    def rows_of(self, rows: np.ndarray, extend_lens: np.ndarray, seq_lens: np.ndarray,
                draft_lens: np.ndarray | None = None) -> RecurrentRows:
        """The step's rows (request-table rows, new tokens, lengths after the step) as the layers read them. A
        verify step's speculating request (draft_lens: k at its head row, -1 at its draft rows) is one row of k + 1
        tokens here: its drafts' rows share its slot and advance its state in order (model/verify_runs.py)."""
        runs = None if draft_lens is None else VerifyRuns.of(rows, draft_lens, extend_lens, self.scratch)
        if runs is not None:
            head = draft_lens > 0
            extend_lens, seq_lens = extend_lens + head * draft_lens, seq_lens + head * draft_lens
            keep = draft_lens >= 0
            rows, extend_lens, seq_lens = rows[keep], extend_lens[keep], seq_lens[keep]
        starts = np.concatenate([[0], np.cumsum(extend_lens)]).astype(np.int64)
        fresh = np.asarray(seq_lens - extend_lens == 0, dtype=bool)
        slots = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self.device)
        return RecurrentRows(slots, [int(s) for s in starts], [bool(f) for f in fresh], self.conv, self.ssm,
                             torch.from_numpy(starts).to(self.device), torch.from_numpy(fresh).to(self.device), runs)
