"""Pipeline stages on several machines (`--pp N --nnodes M`): N / M stages on each node, node 0's first.

Node 0 runs the scheduler, the server and stages 0 .. N/M - 1 as device processes beside it (process/executor.py,
reading each step from the shared buffers). On node R > 0, `tandem serve --node-rank R` starts that node's
stages (run_node in parallel/tp_worker.py); each is `python -m tandem.device.parallel.pp_stage` and runs stage_main:
  recv the step's words from the stage before -> pass them on (a later stage) -> its layers (the hidden
  states follow the words on the same link) -> the last stage samples and sends its results to the relay.
The relay is node 0's last stage: ResultRelay, a thread there, receives each step's results over a group of
the two ranks, writes them into the step's out buffer and sends the "done" the executor waits for. Grammar masks
go the other way over a second group (send_masks / recv_masks), after the relay's own forward.

Idle: node 0's stage before the boundary sends a no-op every step_wire.KEEPALIVE_S (process/main.py), passed
along to the last stage, which answers the relay with one, so no receive's timeout fires while the engine waits
for requests. A quit is passed the same way. A stage that dies breaks its neighbours' links: they fail at once,
node 0's executor names the failure (503 for the requests, as with tp), node R's stages exit 1.
"""
from __future__ import annotations

import pickle
import sys
import threading
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ...lifeline import die_with_parent
from ..denormals import flush_denormals
from ...sampler import MAX_LOGPROBS
from . import step_wire
from .pp import PPGroup
from ..ranks import rank_device
from ..process.buffers import write_results

_RESULT = 5                 # result header: kind, step id, out words, logprob words, rows


def send_results(pp: PPGroup, kind: int, step_id: int = 0, b: int = 0, tokens: torch.Tensor | None = None,
                 lp=None, plp=None) -> None:
    """The last stage (on another node): the step's sampled ids and logprobs to the relay, laid out as the
    out buffer holds them (process/buffers.py), only the words written."""
    n = n_lp = 0
    if tokens is not None:
        n = b if lp is None and plp is None else (b + (0 if plp is None else len(plp.chosen))) * (1 + MAX_LOGPROBS)
        n_lp = 0 if lp is None and plp is None else n
        outs, lps = np.zeros(n, np.int64), np.zeros(n, np.float64)
        write_results(outs, lps, b, tokens, lp, plp)
    dst = pp.relay_rank
    dist.send(torch.tensor([kind, step_id, n, n_lp, b], dtype=torch.int64), dst, group=pp.results)
    if n:
        dist.send(torch.from_numpy(outs), dst, group=pp.results)
    if n_lp:
        dist.send(torch.from_numpy(lps), dst, group=pp.results)


class ResultRelay(threading.Thread):
    """On the relay (node 0's last stage): receives the last stage's results, writes them into the step's out
    buffer and calls done(step_id, start); fail(traceback) when the link breaks. `expect` is called by the
    stage's own loop before the step runs, so every result finds its buffer and start time."""

    def __init__(self, pp: PPGroup, buffers, done: Callable[[int, float], None],
                 fail: Callable[[], None]) -> None:
        super().__init__(name="pp-result-relay", daemon=True)
        self.pp, self.buffers, self.done, self.fail = pp, buffers, done, fail
        self._pending: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def expect(self, step_id: int, buf: int, start: float) -> None:
        with self._lock:
            self._pending[step_id] = (buf, start)

    def run(self) -> None:
        src, group = self.pp.size - 1, self.pp.results
        try:
            while True:
                head = torch.zeros(_RESULT, dtype=torch.int64)
                dist.recv(head, src, group=group)
                kind, step_id, n, n_lp, _ = head.tolist()
                if kind == step_wire.QUIT:
                    return
                if kind != step_wire.STEP:
                    continue
                with self._lock:
                    buf, start = self._pending.pop(step_id)
                for words, out, dtype in ((n, self.buffers.outs[buf], torch.int64),
                                          (n_lp, self.buffers.lp_outs[buf], torch.float64)):
                    if words:
                        t = torch.empty(words, dtype=dtype)
                        dist.recv(t, src, group=group)
                        out[:words] = t.numpy()
                self.done(step_id, start)
        except Exception:
            try:
                self.fail()
            except Exception:
                pass                    # the scheduler is gone too: nothing to tell

    def send_masks(self, masks: np.ndarray) -> None:
        """The step's grammar masks to the last stage (it waits for them before sampling)."""
        dist.send(torch.from_numpy(np.ascontiguousarray(masks)), self.pp.size - 1, group=self.pp.masks)


def recv_masks(pp: PPGroup, rows: int, width: int) -> np.ndarray:
    t = torch.empty((rows, width), dtype=torch.int32)
    dist.recv(t, pp.relay_rank, group=pp.masks)
    return t.numpy()


def stage_main() -> int:
    """A stage on a node R > 0: join the pipeline, load its layers, then run every step passed to it."""
    die_with_parent()
    flush_denormals()                  # before the first parallel region: its threads inherit it
    spec, info = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(info.threads)
    pp = PPGroup(info, rank_device(spec.device, info), spec)
    from ...grammar.compiler import mask_words
    from ..model_runner import ModelRunner
    width = mask_words(spec.source.config.vocab_size)
    try:
        model_runner = ModelRunner(spec, pp=pp)
        with torch.inference_mode():
            while True:
                kind, step_id, step, ints, floats = pp.recv_step()
                if kind != step_wire.STEP:          # a no-op or the quit: passed on to the end of the pipeline
                    if pp.passes_step:
                        pp.send_step(kind)
                    elif pp.last:
                        send_results(pp, kind)
                    if kind == step_wire.QUIT:
                        return 0
                    continue
                if pp.passes_step:
                    pp.send_step(step_wire.STEP, step_id, step, ints, floats)
                masks = (lambda: recv_masks(pp, len(step.grammar_rows), width)) if pp.last else None
                out = model_runner.run(step, masks)
                if out is not None:
                    send_results(pp, step_wire.STEP, step_id, step.batch_size, out.tokens, out.logprobs,
                                 out.prompt_logprobs)
    finally:
        pp.close()


if __name__ == "__main__":
    sys.exit(stage_main())
