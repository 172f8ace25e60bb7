"""The idle engine's liveness probe reaches every tensor-parallel rank, not only rank 0: with rank 1 stopped
(SIGSTOP) and nothing in flight, Engine.probe_device blocks (so the engine sends no heartbeat and /health turns
503, as for a stopped rank 0), and returns once the rank runs again (SIGCONT). The bound here only says the probe
is still blocked, never how fast anything runs."""
from __future__ import annotations

import os
import signal
import threading

from tandem import LLM, SamplingParams


def test_probe_blocks_while_a_tp_rank_is_stopped(tiny_llama):
    llm = LLM(tiny_llama, tp_size=2, device_threads=1, kv_cache_tokens=1024, max_running_requests=4)
    try:
        ex = llm.engine.executor
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        llm.engine.probe_device()                   # both ranks answer
        (rank1,) = ex.ranks
        os.kill(rank1.pid, signal.SIGSTOP)
        probe = threading.Thread(target=llm.engine.probe_device, daemon=True)
        try:
            probe.start()
            probe.join(3.0)
            assert probe.is_alive(), "the probe returned with tp rank 1 stopped"
        finally:
            os.kill(rank1.pid, signal.SIGCONT)
        probe.join(60)
        assert not probe.is_alive()
    finally:
        llm.shutdown()
