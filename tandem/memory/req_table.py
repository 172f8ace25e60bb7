"""Host-side allocator of request-table rows.

The device holds `req_to_token[max_running + 1, max_context]` and the FutureMap, both indexed by row.
Row 0 is the padding row: never handed out, so padded batch rows may read and write it harmlessly.
"""
from __future__ import annotations


class ReqRowAllocator:
    def __init__(self, max_running: int) -> None:
        self.size = max_running
        self._free: list[int] = list(range(max_running, 0, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise MemoryError("no free request rows")
        return self._free.pop()

    def free(self, row: int) -> None:
        assert row > 0, "row 0 is the padding row"
        self._free.append(row)
