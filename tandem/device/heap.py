"""What loading and the steps leave behind, given back: the device process holds each weight once, and an idle
one holds no activations."""
from __future__ import annotations

from ..model.host_heap import give_back_heap

IDLE_TRIM_S = 1.0       # a device process with no step for this long gives its heap's free pages back

__all__ = ["IDLE_TRIM_S", "give_back_heap", "release_load_memory"]


def release_load_memory() -> None:
    """Drop the GGUF maps' resident pages (packing read them; the packed copies are the weights now, and what is
    read again, an embedding's rows, faults back), then give the heap's free pages back to the system (glibc):
    the row layouts the packed copies replaced were freed, but glibc's grown mmap threshold had put them in the
    heap, where 1 GB of them stayed resident (measured on a 1.5B-shaped Q4_K_M file)."""
    from ..model.gguf.file import drop_mapped_pages
    drop_mapped_pages()
    give_back_heap()
