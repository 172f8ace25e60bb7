"""Deadlines on the offline engine (Scheduler.expire): max_queue_time ends a request still waiting for its
first admission, a request's own `timeout` ends it wherever it is; either way only that request ends (finish
reason "error" with its error and status), its memory is freed (the leak check of make_llm) and the others finish
as they would have. The clock the scheduler reads is moved forward once a request is running, so nothing here
depends on how fast a step is."""
from __future__ import annotations

import pytest

from tandem import SamplingParams
from tandem.scheduler import scheduler as scheduler_mod

LONG = [5, 6, 7, 8]
SHORT = [100, 200, 300]


@pytest.fixture
def jump_clock(monkeypatch):
    """Returns arm(llm): from the first output token on, the scheduler's clock reads 1000 s later (arm returns
    the state: {"jumped": False} puts it back)."""
    real = scheduler_mod.now
    state = {"jumped": False}
    monkeypatch.setattr(scheduler_mod, "now", lambda: real() + (1000.0 if state["jumped"] else 0.0))

    def arm(llm) -> None:
        collect = llm.engine._sink

        def sink(outputs):
            if any(o.new_token_ids for o in outputs):
                state["jumped"] = True
            collect(outputs)
        llm.engine._sink = sink
        return state
    return arm


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_max_queue_time_ends_a_waiting_request_only(tiny_llama, make_llm, jump_clock):
    llm = make_llm(tiny_llama, max_running_requests=1, max_queue_time=30.0)
    clock = jump_clock(llm)
    base = llm.generate([LONG], greedy(40), use_tqdm=False)[0]
    clock["jumped"] = False
    long, waiting = llm.generate([LONG, SHORT], [greedy(40), greedy(8)], use_tqdm=False)
    assert long.finish_reason == "length" and long.error is None and long.token_ids == base.token_ids
    assert waiting.finish_reason == "error" and waiting.token_ids == []
    assert "in the queue" in waiting.error and "max_queue_time 30 s" in waiting.error, waiting.error
    assert llm.engine.scheduler.expired == 1      # the running one was admitted: past max_queue_time's reach


@pytest.mark.parametrize("loop", ["overlap", "serial"])
def test_timeout_ends_a_running_request_and_the_others_finish(tiny_llama, make_llm, jump_clock, loop):
    llm = make_llm(tiny_llama, max_running_requests=4, scheduler=loop)
    jump_clock(llm)
    timed, other = llm.generate([LONG, SHORT], [greedy(200, timeout=60.0), greedy(30)], use_tqdm=False)
    assert timed.finish_reason == "error" and "timeout of 60 s passed" in timed.error, timed.error
    assert 0 < len(timed.token_ids) < 200            # ended while running: the tokens so far are kept
    assert other.finish_reason == "length" and len(other.token_ids) == 30 and other.error is None


def test_timeout_ends_a_waiting_request(tiny_llama, make_llm, jump_clock):
    llm = make_llm(tiny_llama, max_running_requests=1)
    jump_clock(llm)
    long, waiting = llm.generate([LONG, SHORT], [greedy(20), greedy(8, timeout=5.0)], use_tqdm=False)
    assert long.finish_reason == "length" and len(long.token_ids) == 20
    assert waiting.finish_reason == "error" and waiting.token_ids == [] and "timeout of 5 s" in waiting.error


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_bad_timeout_is_refused(value):
    with pytest.raises(ValueError, match="timeout"):
        SamplingParams(timeout=value)


@pytest.mark.parametrize("value", [0, -2.0, float("inf"), "5"])
def test_bad_max_queue_time_is_refused(value):
    from tandem.config import EngineConfig
    with pytest.raises(ValueError, match="max_queue_time"):
        EngineConfig(max_queue_time=value)
