"""Checks on engines shared by the tests: the leak audit every fixture ends with, a run through a chosen loop, a
run to idle with the step outputs sent to the test's own sink."""
from __future__ import annotations

from typing import Callable


def assert_no_leaks(llm) -> None:
    """After a run every KV slot is free or owned, unlocked, by the prefix cache, and every request row is
    back in its free list; stats() agrees with a walk over the allocator, the requests and the tree."""
    s = llm.stats()
    assert s["free_kv_slots"] + s["evictable_kv_slots"] == s["total_kv_slots"], s
    assert s["cached_kv_slots"] == s["evictable_kv_slots"], s       # nothing locked
    llm.engine.scheduler.audit_kv()
    assert s["free_req_rows"] == s["total_req_rows"], s
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s


def run_with(llm, scheduler: str, prompts, params, **kw):
    """Run one generate call through the given loop on the same engine."""
    llm.engine.config = llm.engine.config.replace(scheduler=scheduler)
    outs = llm.generate(prompts, params, use_tqdm=False, **kw)
    assert_no_leaks(llm)
    return outs


def run_to_idle(llm, sink: Callable, start: Callable[[], None]) -> None:
    """start() queues the first requests, then the engine runs until idle with each step's outputs sent to
    sink (which may add or abort requests); the engine's own sink is back afterwards."""
    eng = llm.engine
    old, eng._sink = eng._sink, sink
    try:
        start()
        eng.run()
    finally:
        eng._sink = old


def count_attention_calls(monkeypatch, name: str) -> dict:
    """Count the calls the attention entry point (model/attention_paths.py) makes to one native op by `name`
    ("extend_attention", "causal_attention", ...): returns {"n": calls so far}, the op still run."""
    from tandem.model import attention_paths
    calls = {"n": 0}
    real = getattr(attention_paths, name)

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(attention_paths, name, counted)
    return calls


def assert_grammar_row_and_trace(llm, prompts: list) -> None:
    """A regex-constrained request beside two free ones (prompts: three), through both loops: the free rows' tokens
    those they get alone, the constrained one matching; the trace recorder's device spans one a step, prefill and
    decode, every kept token counted."""
    import re

    from tandem import SamplingParams
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = run_with(llm, "serial", prompts[:2], free)
    regex = SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs={"regex": r"[0-9]{3}-[a-c]{2}"})
    for loop in ("serial", "overlap"):
        llm.engine.recorder.clear()
        outs = run_with(llm, loop, prompts, [free, free, regex])
        assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone], loop
        assert outs[2].finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-c]{2}", outs[2].text), outs[2].text
        summary = llm.engine.recorder.summary()
        spans = list(llm.engine.recorder.devices)
        assert summary["steps"] == len(spans) > 0 and any(d.is_prefill for d in spans)
        assert summary["output_tokens"] == sum(len(o.token_ids) for o in outs)
