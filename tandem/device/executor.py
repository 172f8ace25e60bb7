"""The launch/handle interface between the scheduler and the device side: the Executor the scheduler calls
(InlineExecutor here, ProcessExecutor in process/executor.py) and the ResultHandle of each step.

`launch_step(step)` returns at once with a ResultHandle; `handle.wait()` is copy_done.wait() followed by a
read of the sampled ids. Both loops use it; the serial loop just waits at once.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from .model_runner import ModelRunner
from .runner_spec import RunnerSpec
from .step import StepInput
from .streams import DeviceStreams, Event, now


class ResultHandle(Protocol):
    step_id: int
    comm_s: float           # the step's seconds in tensor-parallel collectives (0 without tp); after wait()
    stage_spans: tuple      # pipeline stages: ((stage, busy start, end, seconds in sends), ...); after wait()

    def wait(self) -> np.ndarray:
        """Block until the step's sampled ids are on the host; returns them ([B] int64)."""

    @property
    def device_span(self) -> tuple[float, float]:
        """(start, end) of the forward on the shared clock; valid after wait()."""

    def send_masks(self, masks: np.ndarray) -> None:
        """The grammar branch: the step's token masks, after its launch (executors with defers_masks)."""

    def logprobs(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chosen [B], top ids [B, k], top logprobs [B, k]) after wait(), for a step whose rows asked."""

    def prompt_logprobs(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same for the step's n prompt positions (step.prompt_logprob_targets), after wait()."""

    def embeddings(self, n: int) -> np.ndarray:
        """[n, hidden] float32 after wait(): the raw pooled vectors of the step's n embeddings rows (embed.py)."""


class Executor(Protocol):
    num_slots: int
    max_context: int
    kv_slot_bytes: int      # a KV slot's bytes on the device (every layer's K and V of one token)

    defers_masks: bool      # the grammar branch: a step's token masks may follow its launch
    nests_steps: bool       # the urgent-step branch: runs a step between two layers of a long one (urgent.py)

    def wait_ready(self) -> None: ...
    def launch_step(self, step: StepInput, masks: np.ndarray | None = None) -> ResultHandle: ...
    # With nests_steps: launch_step(step, masks, yields=..., urgent=...), poll_done(timeout), buffer_slots and
    # handle.ready() (process/executor.py)
    def shutdown(self) -> None: ...
    def save_kv(self, saves, state_saves, state_ops) -> None: ...   # the disk tier's saves, while idle
    def probe(self) -> None: ...        # liveness of an idle device: a no-op round trip (blocks while it is stuck)


class InlineHandle:
    def __init__(self, step: StepInput, host_tokens: torch.Tensor, copy_done: Event, start: float,
                 end: float | None, events: tuple | None, logprobs=None, prompt_logprobs=None,
                 embeddings=None) -> None:
        self._logprobs = logprobs          # the model runner's Logprobs of this step (device tensors), if asked
        self._embeddings = embeddings      # [E, H] float32 device tensor of its embeddings rows, if any
        self._prompt_logprobs = prompt_logprobs
        self.step_id = step.step_id
        self._step = step                  # host tensors an in-flight step reads stay alive until it is done
        self._host_tokens = host_tokens
        self._copy_done = copy_done
        self._start, self._end, self._events = start, end, events
        self._result: np.ndarray | None = None
        self.comm_s = 0.0
        self.stage_spans = ()

    def wait(self) -> np.ndarray:
        if self._result is None:
            self._copy_done.wait()
            if self._events is not None:   # CUDA: span from the forward's timing events
                begin, finish = self._events
                self._end = self._start + begin.event.elapsed_time(finish.event) / 1e3
            self._result = self._host_tokens.numpy().astype(np.int64, copy=True)
            self._step = None
        return self._result

    @property
    def device_span(self) -> tuple[float, float]:
        return self._start, self._end if self._end is not None else self._start

    def logprobs(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _host_logprobs(self._logprobs, k)

    def prompt_logprobs(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _host_logprobs(self._prompt_logprobs, k)

    def embeddings(self, n: int) -> np.ndarray:
        return self._embeddings[:n].cpu().numpy()


def _host_logprobs(lp, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (lp.chosen.cpu().numpy().astype(np.float64), lp.top_ids[:, :k].cpu().numpy(),
            lp.top[:, :k].cpu().numpy().astype(np.float64))


class InlineExecutor:
    """The executor in the scheduler's process: its model runner runs each step on CUDA streams on a GPU,
    synchronously on CPU."""

    def __init__(self, spec: RunnerSpec) -> None:
        self.model_runner = ModelRunner(spec)
        self.num_slots = self.model_runner.num_slots
        self.max_context = self.model_runner.max_context
        self.kv_slot_bytes = self.model_runner.kv_slot_bytes
        self.streams = DeviceStreams(self.model_runner.device)

    def wait_ready(self) -> None:
        return None

    defers_masks = False      # it samples within launch_step: grammar masks come with the launch
    nests_steps = False       # each step runs whole within its launch

    def launch_step(self, step: StepInput, masks: np.ndarray | None = None) -> InlineHandle:
        start = now()
        with self.streams.forward():
            begin = self.streams.record(timing=True) if self.streams.cuda else None
            out = self.model_runner.run(step, lambda: masks)
            finish = self.streams.record(timing=True) if self.streams.cuda else None
        host, copy_done = self.streams.copy_to_host(out.tokens)
        lp, plp, emb = out.logprobs, out.prompt_logprobs, out.embeddings
        if self.streams.cuda:
            return InlineHandle(step, host, copy_done, start, None, (begin, finish), lp, plp, emb)
        return InlineHandle(step, host, copy_done, start, now(), None, lp, plp, emb)

    def save_kv(self, saves: np.ndarray, state_saves: np.ndarray, state_ops: np.ndarray) -> None:
        """The disk tier's saves with no step to ride (ProcessExecutor.save_kv)."""
        self.model_runner.save_kv(saves, state_saves, state_ops)

    def probe(self) -> None:
        """Nothing to probe: the device is driven from this process, whose loop the heartbeat already shows."""

    def shutdown(self) -> None:
        if self.model_runner is not None and self.model_runner.kv_disk is not None:
            self.model_runner.kv_disk.flush()
            self.model_runner.kv_disk.close()
        self.model_runner = None
