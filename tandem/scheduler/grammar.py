"""The grammar branch of the scheduler: structured-output requests, whose next token is masked by their
grammar's state after every token before it.

Invariant (stated in loops.py beside the loops): a batch's token masks are computed when every step
launched before it has been processed, i.e. at its launch when the result queue is empty (serial loop, or
an overlap step with nothing in flight), else when it becomes the oldest unprocessed batch. The forward is
never delayed by a mask: the device runs it at once and only its sampling waits for the masks (an executor
that cannot defer them, the inline one, gets host truth first instead).

Grammars compile off the loop, on a worker thread; a request waits in the queue until its grammar is ready,
without holding back the requests behind it.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..device.executor import ResultHandle
from ..grammar import GrammarCompiler, mask_words
from ..grammar.after_reasoning import AfterReasoning
from ..request import Req
from ..trace.recorder import Recorder
from .batch import Batch


class GrammarError(RuntimeError):
    """A sampled token its grammar does not allow (the mask should make this impossible)."""


class Grammars:
    """The grammar branch's manager: compiles requests' grammars on a worker thread, tracks those still compiling,
    and computes a batch's token masks from its rows' grammar state (when: launch.py and results.py, by the rule
    above)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.words = mask_words(compiler.vocab_size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        self.compiling: dict[Req, Future] = {}

    def submit(self, req: Req) -> None:
        self.compiling[req] = self._pool.submit(self._matcher, req.params)

    def _matcher(self, params):
        """The request's matcher; with reasoning_end_ids, gated until its reasoning ends (after_reasoning.py)."""
        m = self.compiler.matcher(params.structured_outputs)
        return m if not params.reasoning_end_ids else AfterReasoning(m, params.reasoning_end_ids,
                                                                     params.reasoning_start_id)

    def collect(self, fail: Callable[[Req, BaseException], None]) -> None:
        """Attach the compiled grammars (a failed compile fails its request alone: `fail`)."""
        for req, fut in [(r, f) for r, f in self.compiling.items() if f.done()]:
            del self.compiling[req]
            if req.finished:
                continue
            try:
                req.grammar = fut.result()
            except Exception as e:
                fail(req, e)

    def ready(self, req: Req) -> bool:
        return req not in self.compiling

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def masks(self, batch: Batch, recorder: Recorder) -> np.ndarray:
        """[G, W] int32 token bitmasks of the batch's grammar rows from their grammars' current state. A request
        that already finished (it rides in this batch, one-step lag) gets an all-allowing mask: its token is
        dropped."""
        rows = batch.step.grammar_rows
        out = np.full((len(rows), self.words), -1, np.int32)
        with recorder.span("mask", batch.step_id):
            for i, r in enumerate(rows):
                req = batch.reqs[r]
                if not req.finished:
                    req.grammar.fill_mask(out[i])
        return out

    def send_pending(self, batch: Batch, handle: ResultHandle, recorder: Recorder) -> None:
        """Called when `batch` is the oldest unprocessed one: its rows' grammars are current, send its masks."""
        if batch.masks_pending:
            batch.masks_pending = False
            handle.send_masks(self.masks(batch, recorder))


def grammar_rows(reqs: list[Req]) -> np.ndarray:
    """Batch rows whose sampling a grammar masks."""
    return np.array([i for i, r in enumerate(reqs) if r.grammar is not None], np.int64)


def accept(req: Req, token: int) -> bool:
    """Advance the request's grammar by its sampled token; True when the grammar is complete (stop)."""
    if not req.grammar.accept(token):
        raise GrammarError(f"token {token} is not allowed by the grammar: {req.grammar.error}")
    return req.grammar.done
