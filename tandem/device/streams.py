"""A small device-stream abstraction: launch on a forward stream, record events, wait on them.

On CUDA: the forward stream waits on the scheduling (current) stream, the copy stream waits on the forward
stream, and `copy_done` is recorded after the D2H copy into pinned memory, so the host waits only for the
copy of the batch it processes. On CPU (inline) work is synchronous and every event is already complete;
the CPU device process gives the same interface across a process boundary (process/executor.py).
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Protocol

import torch


class Event(Protocol):
    def wait(self) -> None: ...
    def query(self) -> bool: ...


class CompletedEvent:
    """An event whose work already ran (inline CPU execution)."""

    def wait(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CudaEvent:
    def __init__(self, stream: "torch.cuda.Stream", timing: bool = False) -> None:
        self.event = torch.cuda.Event(enable_timing=timing)
        self.event.record(stream)

    def wait(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


class DeviceStreams:
    """Forward and copy streams on CUDA; no-ops on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.forward_stream = torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run the enclosed launches on the forward stream, after what the scheduler queued before them."""
        if not self.cuda:
            yield
            return
        self.forward_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.forward_stream):
            yield

    def record(self, timing: bool = False) -> Event:
        """An event after everything launched on the forward stream so far."""
        return CudaEvent(self.forward_stream, timing) if self.cuda else CompletedEvent()

    def copy_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Event]:
        """Async D2H copy into pinned memory on the copy stream; returns (host tensor, copy_done)."""
        if not self.cuda:
            return t, CompletedEvent()
        self.copy_stream.wait_stream(self.forward_stream)
        with torch.cuda.stream(self.copy_stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.copy_stream)
            return host, CudaEvent(self.copy_stream)


def now() -> float:
    """The clock of every span, host or device (CLOCK_MONOTONIC, shared by processes)."""
    return time.perf_counter()
