"""What loading leaves behind, given back once the model is built, so the device process holds each weight once."""
from __future__ import annotations


def release_load_memory() -> None:
    """Drop the GGUF maps' resident pages (packing read them; the packed copies are the weights now, and what is
    read again, an embedding's rows, faults back), then give the heap's free pages back to the system (glibc):
    the row layouts the packed copies replaced were freed, but glibc's grown mmap threshold had put them in the
    heap, where 1 GB of them stayed resident (measured on a 1.5B-shaped Q4_K_M file)."""
    from ..model.gguf.file import drop_mapped_pages
    drop_mapped_pages()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
