"""FutureMap: the device-side relay that lets batch k read the tokens batch k-1 sampled, with no host trip.

`next_token[row]` holds the last token sampled for the request in that request-table row. The sampler
stashes into it after every step; a decode step gathers its input ids from it. Indexed by row, not by a
ring of future slots, so it cannot alias or overflow.
"""
from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, num_rows: int, device: torch.device, poison: bool = False) -> None:
        self.poison_enabled = poison
        self.next_token = torch.full((num_rows,), -1 if poison else 0, dtype=torch.int64, device=device)

    def stash(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.next_token[rows] = tokens

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        ids = self.next_token[rows]
        if self.poison_enabled and bool((ids < 0).any()):
            bad = rows[ids < 0].tolist()
            raise RuntimeError(f"FutureMap poison: a step gathered a token never written for rows {bad}")
        return ids

    def poison(self, rows: torch.Tensor) -> None:
        """Mark freed rows so that a read before the next write is caught (debug mode only)."""
        if self.poison_enabled and rows.numel():
            self.next_token[rows] = -1
