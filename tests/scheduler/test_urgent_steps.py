"""Urgent steps (scheduler/urgent.py) on the tiny model: a high-priority arrival while a low-priority prefill step
is in flight is launched as an urgent step (the device runs it between two of that step's layers), with the tokens
each request gives alone, in both loops; a full running cap retracts the low request riding in the long step (its
row and KV wait for that step) and it resumes with the same tokens; an arrival whose prefix hit would read KV the
long step is still writing waits for it instead; decode rows of the arrival's own rank in the long step do not
hold it back; two arrivals during one long step go in two urgent steps; only the priority policy on the device
process runs them; and every release keeps the KV slots a partition throughout. Decisions and tokens only:
nothing depends on how fast a step is (where it could, the device process is stopped meanwhile)."""
from __future__ import annotations

import os
import signal

import pytest

from tandem import SamplingParams
from tandem.scheduler import loops
from tandem.config import SPARE_ROWS
from tests.helpers.engine_checks import assert_no_leaks, run_to_idle


def greedy(n: int, priority: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, priority=priority)


LONG = [5 + (7 * i) % 190 for i in range(300)]
SHORT = [11, 12, 13, 14, 15, 16]
LAUNCH = loops.launch_step


def drive(llm, initial: list, arrivals: list, loop: str, monkeypatch, hold: bool = False) -> tuple[dict, list]:
    """Run `initial` [(label, ids, params)]; each of `arrivals` is added at a poll of the scheduler while a step
    that yields, with a low-priority chunk, is in flight (one a poll; `hold`: the device process stopped from the
    first arrival to the poll after the last, so that step is still in flight for all). Returns (label -> tokens,
    labels launched in urgent steps, in launch order)."""
    eng = llm.engine
    s = eng.scheduler
    eng.config = eng.config.replace(scheduler=loop)
    label_of, tokens, urgent, pending = {}, {}, [], list(arrivals)

    def add(label, ids, params) -> None:
        req = eng.make_request(ids, params)
        label_of[req.rid], tokens[label] = label, []
        eng.add_request(req)

    def sink(outputs) -> None:
        for o in outputs:
            tokens[label_of[o.rid]] += o.new_token_ids

    pid, stopped = eng.executor.proc.pid, []

    def poll() -> None:
        s.audit_kv()                            # deferred releases included: still a partition
        if stopped and not pending:
            os.kill(pid, signal.SIGCONT)
            stopped.clear()
        if pending and any(b.yields and any(r.params.priority > 0 for r in b.reqs[b.num_decode:])
                           for b, _ in s.result_queue):
            if hold and not stopped:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            add(*pending.pop(0))

    def spy(s, batch):
        if batch.urgent:
            urgent.extend(label_of[r.rid] for r in batch.reqs)
        return LAUNCH(s, batch)
    monkeypatch.setattr(loops, "launch_step", spy)
    s.poll = poll
    try:
        run_to_idle(llm, sink, lambda: [add(*r) for r in initial])
    finally:
        s.poll = None
        if stopped:
            os.kill(pid, signal.SIGCONT)
    assert not pending
    assert_no_leaks(llm)
    return tokens, urgent


@pytest.fixture
def urgent_llm(tiny_llama, make_llm):
    def make(**kw):
        llm = make_llm(tiny_llama, scheduling_policy="priority", **kw)
        assert llm.engine.executor.nests_steps            # with spare request-table rows for the urgent ones
        assert llm.stats()["total_req_rows"] == kw["max_running_requests"] + SPARE_ROWS
        return llm
    return make


def alone(llm, ids, params, monkeypatch) -> list[int]:
    return drive(llm, [("x", ids, params)], [], "serial", monkeypatch)[0]["x"]


@pytest.mark.parametrize("loop", ["overlap", "serial"])
def test_a_high_priority_arrival_runs_in_an_urgent_step_with_its_own_tokens(urgent_llm, loop, monkeypatch):
    llm = urgent_llm(max_running_requests=4)
    low, high = greedy(12, 5), greedy(6, 0)
    ref_low, ref_high = alone(llm, LONG, low, monkeypatch), alone(llm, SHORT, high, monkeypatch)
    tokens, urgent = drive(llm, [("low", LONG, low)], [("high", SHORT, high)], loop, monkeypatch)
    assert urgent == ["high"]
    assert tokens == {"low": ref_low, "high": ref_high}


def test_a_full_running_cap_retracts_the_low_request_riding_in_the_long_step(urgent_llm, monkeypatch):
    llm = urgent_llm(max_running_requests=1)
    low, high = greedy(12, 5), greedy(6, 0)
    ref_low, ref_high = alone(llm, LONG, low, monkeypatch), alone(llm, SHORT, high, monkeypatch)
    before = llm.engine.scheduler.retractions
    tokens, urgent = drive(llm, [("low", LONG, low)], [("high", SHORT, high)], "overlap", monkeypatch)
    assert urgent == ["high"] and llm.engine.scheduler.retractions == before + 1
    assert tokens == {"low": ref_low, "high": ref_high}          # retracted mid-step, re-prefilled, same tokens


def test_an_arrival_whose_prefix_hit_is_still_being_written_waits_for_the_long_step(urgent_llm, monkeypatch):
    llm = urgent_llm(max_running_requests=4)
    low, high = greedy(8, 5), greedy(6, 0)
    shares = LONG[:64] + SHORT                   # the long step writes the KV of its first 64 tokens
    ref_high = alone(llm, shares, high, monkeypatch)
    llm.engine.scheduler.reset_prefix_cache()
    tokens, urgent = drive(llm, [("low", LONG, low)], [("high", shares, high)], "overlap", monkeypatch)
    assert urgent == [] and tokens["high"] == ref_high


@pytest.mark.parametrize("kw", [dict(urgent_steps=False), dict(scheduling_policy="fcfs"),
                                dict(device_backend="inline")])
def test_only_the_priority_policy_on_the_device_process_runs_urgent_steps(tiny_llama, make_llm, kw):
    llm = make_llm(tiny_llama, **{"scheduling_policy": "priority", "max_running_requests": 4, **kw})
    assert not llm.engine.executor.nests_steps and llm.stats()["total_req_rows"] == 4
    assert len(llm.generate([LONG], greedy(3, 0), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_decode_rows_of_the_arrivals_own_rank_in_the_long_step_do_not_hold_it_back(urgent_llm, monkeypatch):
    # "high1" decodes in the low prefill's step (the low lead does not outrank it); "high2" still goes in between.
    llm = urgent_llm(max_running_requests=4)
    low, high = greedy(8, 5), greedy(12, 0)
    other = [21, 22, 23, 24, 25, 26, 27]
    ref = {"low": alone(llm, LONG, low, monkeypatch), "high1": alone(llm, other, high, monkeypatch),
           "high2": alone(llm, SHORT, high, monkeypatch)}
    tokens, urgent = drive(llm, [("high1", other, high), ("low", LONG, low)], [("high2", SHORT, high)], "overlap",
                           monkeypatch)
    assert urgent == ["high2"] and tokens == ref


def test_two_arrivals_during_one_long_step_go_in_two_urgent_steps(urgent_llm, monkeypatch):
    # The device is stopped while both arrive: the long step is in flight for both picks, and the second urgent
    # step is launched while the first is still in flight (each in a buffer slot of its own).
    llm = urgent_llm(max_running_requests=4)
    low, high = greedy(8, 5), greedy(6, 0)
    other = [31, 32, 33, 34, 35]
    ref = {"low": alone(llm, LONG, low, monkeypatch), "high": alone(llm, SHORT, high, monkeypatch),
           "high2": alone(llm, other, high, monkeypatch)}
    tokens, urgent = drive(llm, [("low", LONG, low)], [("high", SHORT, high), ("high2", other, high)], "overlap",
                           monkeypatch, hold=True)
    assert urgent == ["high", "high2"] and tokens == ref
