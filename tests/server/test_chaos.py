"""A bounded chaos run in the suite: hundreds of requests against one `tandem serve` (tiny model) with random
disconnects, clients that give up, hostile inputs and requests an injected engine fault fails, on every
generation route (completions, chat, Responses, Messages), /tokenize and /v1/embeddings (tandem/bench/soak.py;
`tandem bench soak` is the long version).

Afterwards the gauges are back to idle (nothing running, waiting, in the KV cache or held by the frontend),
no answer was a 500 but the faults', and the service still answers.
"""
from __future__ import annotations

import asyncio

import pytest

from tests.helpers.server_utils import ServerProcess
from tandem.bench.soak import FAULT_IDS, run_soak

REQUESTS, CONCURRENCY = 300, 12


@pytest.mark.parametrize("scheduler", ["overlap", "serial"])
def test_chaos_run_leaves_the_service_idle_and_answering(tiny_qwen2, tmp_path, scheduler):
    srv = ServerProcess(["--model", tiny_qwen2, "--kv-cache-tokens", "2048", "--device-threads", "1",
                         "--max-running-requests", "8", "--scheduler", scheduler],
                        str(tmp_path / "server.log"),
                        env={"TANDEM_INJECT_FAULT": "process:" + ",".join(map(str, FAULT_IDS))})
    try:
        summary = asyncio.run(asyncio.wait_for(run_soak(srv.url, REQUESTS, CONCURRENCY, seed=11, fault=True),
                                               600))
        assert summary["unexpected"] == [], summary["unexpected"][:10]
        kinds, statuses = summary["kinds"], summary["statuses"]
        assert kinds["fault"] >= 1 and kinds["disconnect"] > 10 and kinds["bad"] > 30, kinds
        assert min(kinds[k] for k in ("responses", "messages", "route_stream", "tokenize", "embeddings")) >= 5, kinds
        assert statuses.get("500", 0) == kinds["fault"], statuses          # only the injected faults
        for gauge in ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
                      "tandem:frontend_open_requests"):
            assert srv.wait_metric(gauge, lambda v: v == 0) == 0
        assert srv.http.get("/health").status_code == 200
        assert srv.http.get("/health_generate").status_code == 200
        r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        code = srv.stop()
    assert code == 0
