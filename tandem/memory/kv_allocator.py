"""Host-side free list over the device's KV slots (page size 1)."""
from __future__ import annotations


class KVSlotAllocator:
    """Hands out KV slots in [0, num_slots). The device owns the K/V tensors; the host only owns the numbers."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Popping from the end hands out low slots first, which keeps gathers local.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV slots, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))
