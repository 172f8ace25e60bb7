"""PrefillAdder (scheduler/pick.py) answered directly, on an idle engine's scheduler: ADMIT takes a chunk and
locks the prefix hit it computes beside; STOP after the match (a batch mate computes the same uncached prefix)
undoes the match, so nothing stays locked; STOP before the match (the running cap) touches nothing; commit()
moves the admitted into running, and the engine then runs every request to the tokens it gives on its own."""
from __future__ import annotations

from tandem import SamplingParams
from tandem.scheduler.pick import PrefillAdder, Verdict
from tests.helpers.engine_checks import assert_no_leaks, run_to_idle

SYSTEM = [5 + (3 * i) % 150 for i in range(64)]        # cached before the picks
SHARED = [7 + (5 * i) % 140 for i in range(40)]         # uncached, shared by two requests: IN_BATCH_SHARE is 32


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_the_adder_admits_stops_and_undoes_a_refused_match(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, max_running_requests=2)
    eng, s = llm.engine, llm.engine.scheduler
    prompts = {"a": SYSTEM + SHARED + [1], "b": SYSTEM + SHARED + [2], "c": SYSTEM + [3], "d": SYSTEM + [4]}
    alone = {k: llm.generate([p], greedy(4), use_tqdm=False)[0].outputs[0].token_ids for k, p in prompts.items()}
    s.reset_prefix_cache()
    llm.generate([SYSTEM], greedy(1), use_tqdm=False)               # only SYSTEM's KV in the prefix cache
    reqs = {k: eng.make_request(p, greedy(4)) for k, p in prompts.items()}
    label = {r.rid: k for k, r in reqs.items()}
    tokens: dict[str, list[int]] = {k: [] for k in prompts}

    def sink(outputs) -> None:
        for o in outputs:
            tokens[label[o.rid]] += o.new_token_ids

    def pick() -> None:
        for r in reqs.values():
            eng.add_request(r)
        s.recv_requests()
        adder = PrefillAdder(s, 4096)
        evictable = s.memory.stats()["evictable_kv_slots"]
        assert adder.add(reqs["a"]) is Verdict.ADMIT and reqs["a"].cached_len == len(SYSTEM)
        locked = s.memory.stats()["evictable_kv_slots"]
        assert locked < evictable                                   # a's hit is locked
        assert adder.add(reqs["b"]) is Verdict.STOP                 # a computes SHARED in this step: b waits
        assert s.memory.stats()["evictable_kv_slots"] == locked     # b's match undone
        assert adder.add(reqs["c"]) is Verdict.ADMIT
        assert adder.add(reqs["d"]) is Verdict.STOP                 # the running cap (2) is reached
        chunks = adder.commit()
        assert [c.req for c in chunks] == [reqs["a"], reqs["c"]] and all(c.last for c in chunks)
        assert s.running == [reqs["a"], reqs["c"]] and list(s.waiting) == [reqs["b"], reqs["d"]]
        # Nothing launched them (make_batch would): the loop goes on with a and c as started prefills.
    run_to_idle(llm, sink, pick)
    assert tokens == alone
    assert_no_leaks(llm)
