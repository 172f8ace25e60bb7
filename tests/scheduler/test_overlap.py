"""Serial and overlap loops give identical outputs, with arrivals, aborts in flight, stops and retraction,
and never leak KV or rows. The FutureMap is poisoned (-1) in these engines: a gather of an entry never
written raises."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.engine_checks import assert_no_leaks, run_to_idle
from tandem import SamplingParams
from tandem.device.future_map import FutureMap


def run_script(llm, scheduler: str, initial: list, events: dict[int, list]) -> dict:
    """Drive the engine: `initial` requests up front; at the n-th processed step run events[n] (add or abort).

    Each request is (label, prompt_ids, params); an event is ("add", label, ids, params) or ("abort", label).
    Returns label -> (token_ids, finish_reason).
    """
    eng = llm.engine
    eng.config = eng.config.replace(scheduler=scheduler)
    rid_of, out, seen = {}, {}, {"steps": 0}

    def add(label, ids, params):
        req = eng.make_request(ids, params)
        rid_of[req.rid] = label
        out[label] = ([], None)
        eng.add_request(req)

    def sink(outputs):
        for o in outputs:
            toks, _ = out[rid_of[o.rid]]
            out[rid_of[o.rid]] = (toks + o.new_token_ids, o.finish_reason)
        seen["steps"] += 1
        for ev in events.get(seen["steps"], []):
            if ev[0] == "add":
                add(*ev[1:])
            else:
                label = ev[1]
                eng.abort(next(r for r, lab in rid_of.items() if lab == label))

    run_to_idle(llm, sink, lambda: [add(label, ids, params) for label, ids, params in initial])
    assert_no_leaks(llm)
    return out


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_same_outputs_max_tokens_stops_and_arrivals(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    base = llm.generate([[11, 12, 13]], greedy(8, ignore_eos=True), use_tqdm=False)[0]
    initial = [
        ("one", [5, 6, 7], greedy(1, ignore_eos=True)),
        ("two", [8, 9], greedy(2, ignore_eos=True)),
        ("many", [3] * 30, greedy(25, ignore_eos=True)),
        ("stopid", [11, 12, 13], greedy(8, stop_token_ids=[base.token_ids[4]], ignore_eos=True)),
        ("seeded", [21, 22, 23, 24], SamplingParams(temperature=0.8, seed=7, max_tokens=15, ignore_eos=True)),
        ("stopstr", [11, 12, 13], greedy(8, stop=[base.text[-4:-1]] if len(base.text) > 4 else None,
                                          ignore_eos=True)),
    ]
    events = {2: [("add", "late", [40, 41, 42, 43], greedy(6, ignore_eos=True))],
              5: [("add", "later", [50] * 9, SamplingParams(temperature=1.0, seed=3, max_tokens=7))]}
    serial = run_script(llm, "serial", initial, events)
    overlap = run_script(llm, "overlap", initial, events)
    assert serial == overlap
    assert len(serial["one"][0]) == 1 and len(serial["two"][0]) == 2 and len(serial["many"][0]) == 25
    assert serial["stopid"] == (base.token_ids[:5], "stop")


def test_abort_while_in_flight(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    initial = [("a", [5] * 10, greedy(30, ignore_eos=True)), ("b", [6] * 12, greedy(30, ignore_eos=True)),
               ("c", [7] * 5, greedy(30, ignore_eos=True))]
    full = run_script(llm, "serial", initial, {})
    for scheduler in ("serial", "overlap"):
        out = run_script(llm, scheduler, initial, {4: [("abort", "b")], 6: [("abort", "c")]})
        assert out["a"] == full["a"]
        for label in ("b", "c"):
            toks, reason = out[label]
            assert reason == "abort"
            assert toks == full[label][0][:len(toks)] and len(toks) < 30


def test_abort_waiting_request(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_running_requests=1)
    initial = [("a", [5] * 10, greedy(12, ignore_eos=True)), ("b", [6] * 12, greedy(12, ignore_eos=True))]
    for scheduler in ("serial", "overlap"):
        out = run_script(llm, scheduler, initial, {2: [("abort", "b")]})
        assert out["b"] == ([], "abort") and len(out["a"][0]) == 12


def test_retraction_under_both_loops(tiny_llama, make_llm):
    initial = [(f"r{i}", [9 + i] * (15 + 4 * i), greedy(35, ignore_eos=True)) for i in range(7)]
    outs = {}
    for scheduler in ("serial", "overlap"):
        llm = make_llm(tiny_llama, kv_cache_tokens=260)
        outs[scheduler] = run_script(llm, scheduler, initial, {})
        assert llm.engine.scheduler.retractions > 0
        assert llm.stats()["num_preemptions"] == llm.engine.scheduler.retractions     # /metrics' counter
        aborted = run_script(llm, scheduler, initial, {3: [("abort", "r2")]})
        assert aborted["r2"][1] == "abort"
        assert {k: v for k, v in aborted.items() if k != "r2"} == {k: v for k, v in outs[scheduler].items()
                                                                   if k != "r2"}
    assert outs["serial"] == outs["overlap"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_arrivals_aborts_and_lengths(tiny_qwen2, make_llm, seed):
    rng = random.Random(seed)
    vocab = 1000
    llm = make_llm(tiny_qwen2, kv_cache_tokens=rng.choice([300, 2000]), max_running_requests=8)
    reqs = []
    for i in range(24):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.5:
            p = greedy(rng.randrange(1, 20), ignore_eos=True)
        else:
            p = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                               seed=rng.randrange(1000), max_tokens=rng.randrange(1, 20), ignore_eos=True)
        reqs.append((f"q{i}", ids, p))
    initial = reqs[:8]
    events: dict[int, list] = {}
    for r in reqs[8:]:
        events.setdefault(rng.randrange(1, 25), []).append(("add",) + r)
    aborted = {f"q{i}" for i in rng.sample(range(8), 3)}
    for label in aborted:
        events.setdefault(rng.randrange(1, 10), []).append(("abort", label))
    serial = run_script(llm, "serial", initial, events)
    overlap = run_script(llm, "overlap", initial, events)
    keep = set(serial) - aborted
    assert keep and {k: serial[k] for k in keep} == {k: overlap[k] for k in keep}
    for label in aborted:
        for out in (serial, overlap):
            assert out[label][1] in ("abort", "length")


def test_poison_check_fires_on_unwritten_entry():
    fm = FutureMap(4, torch.device("cpu"), poison=True)
    fm.stash(torch.tensor([1]), torch.tensor([17]))
    assert fm.gather(torch.tensor([1])).tolist() == [17]
    with pytest.raises(RuntimeError, match="poison"):
        fm.gather(torch.tensor([2]))
    fm.poison(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="poison"):
        fm.gather(torch.tensor([1]))


def test_device_process_crash_is_an_error_not_a_hang(tiny_llama, make_llm):
    from tandem.device.process.executor import DeviceProcessError
    llm = make_llm(tiny_llama)
    llm.engine.executor.proc.kill()
    with pytest.raises(DeviceProcessError):
        llm.generate([[5, 6, 7]], greedy(5), use_tqdm=False)
    # The engine is unusable now; reset its books so the fixture's leak check looks at a clean engine.
    s = llm.engine.scheduler
    for req in list(s.running):
        s.finish(req, "abort")
    s.result_queue.clear()


def test_device_process_dies_with_its_parent(tiny_llama, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from tandem import LLM\n"
        f"llm = LLM({tiny_llama!r}, kv_cache_tokens=1024)\n"
        "print(llm.engine.executor.proc.pid, flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        for _ in range(100):
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("device process outlived its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_process_previous_before_consecutive_prefill_keeps_outputs(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_prefill_tokens=16)        # several prefill batches back to back
    initial = [(f"p{i}", [20 + i] * 12, greedy(6, ignore_eos=True)) for i in range(6)]
    plain = run_script(llm, "overlap", initial, {})
    llm.engine.config = llm.engine.config.replace(process_prev_before_prefill=True)
    flushed = run_script(llm, "overlap", initial, {})
    assert plain == flushed == run_script(llm, "serial", initial, {})
