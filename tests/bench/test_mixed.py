"""`tandem bench serve --mixed` (tandem/bench/mixed.py) against the fake server: each mix's bodies, its classes
and the backlog mix's shares of the tokens."""
from __future__ import annotations

import pytest

from tests.helpers.fake_openai import FakeOpenAI, fake_server, run_json


@pytest.mark.parametrize("mix", ["priority", "tenants"])
def test_serve_mixed_workload_reports_each_class(tmp_path, mix):
    fake = FakeOpenAI()
    with fake_server(fake) as url:
        r = run_json(tmp_path, "serve", "--base-url", url, "--num-prompts", "10", "--input-len", "8",
                     "--output-len", "8", "--mixed", mix, "--warmup-requests", "0")
    assert r["completed"] == 10 and r["mixed"] == mix
    flood = [b for b in fake.bodies if b["max_tokens"] == 8]
    trickle = [b for b in fake.bodies if b["max_tokens"] == 2]          # a quarter of the lengths
    assert len(flood) == 8 and len(trickle) == 2 and all(len(b["prompt"]) == 2 for b in trickle)
    if mix == "priority":
        assert {b["priority"] for b in flood} == {10} and {b["priority"] for b in trickle} == {0}
        assert set(r["classes"]) == {"low-priority flood", "high-priority trickle"}
    else:
        assert {b["user"] for b in flood} == {"tenant-0"} and {b["user"] for b in trickle} == {"tenant-1", "tenant-2"}
        assert set(r["classes"]) == {"tenant-0 flood", "tenant-1", "tenant-2"}
    assert sum(c["completed"] for c in r["classes"].values()) == 10
    assert all(c["p99_ttft_ms"] >= c["p50_ttft_ms"] > 0 and c["output_throughput"] > 0 for c in r["classes"].values())


def test_serve_backlog_mix_reports_each_tenants_share(tmp_path):
    fake = FakeOpenAI()
    with fake_server(fake) as url:
        r = run_json(tmp_path, "serve", "--base-url", url, "--num-prompts", "12", "--input-len", "8",
                     "--output-len", "4", "--mixed", "backlog", "--warmup-requests", "0")
    users = [b["user"] for b in fake.bodies]
    assert users.count("tenant-0") == 6 and {users.count(f"tenant-{i}") for i in (1, 2, 3)} == {2}
    assert all(b["max_tokens"] == 4 and len(b["prompt"]) == 8 for b in fake.bodies)
    shares = [c["backlog_share"] for c in r["classes"].values()]
    assert len(shares) == 4 and sum(shares) == pytest.approx(1.0)


def test_backlog_shares_count_tokens_until_the_first_class_is_done():
    from tandem.bench.mixed import backlog_shares
    from tandem.bench.serving import RequestResult

    def done(sent, ttft, itl, tokens):
        return RequestResult(success=True, output_tokens=tokens, sent=sent, ttft=ttft, itl=itl,
                             latency=ttft + sum(itl))
    # a: a token at 1, 2, 3 (its last at 3: the window); b: 2 tokens at each of 1.5, 2.5, 3.5, 4.5
    results = [done(0.0, 1.0, [1.0, 1.0], 3), done(0.0, 1.5, [1.0, 1.0, 1.0], 8)]
    assert backlog_shares(["a", "b"], results) == pytest.approx({"a": 3 / 7, "b": 4 / 7})
    failed = RequestResult(success=False)
    assert backlog_shares(["a", "b"], [results[0], failed]) == {}


def test_serve_agents_send_each_tenants_system_prompt(tmp_path):
    """--agents: every request starts with its tenant's system prompt (the same ids each time), then its own."""
    fake = FakeOpenAI()
    with fake_server(fake) as url:
        r = run_json(tmp_path, "serve", "--base-url", url, "--num-prompts", "12", "--input-len", "4",
                     "--output-len", "3", "--agents", "3", "--system-len", "20", "--warmup-requests", "0")
    assert r["completed"] == 12 and r["agents"] == 3 and r["system_len"] == 20
    by_tenant: dict = {}
    for b in fake.bodies:
        assert len(b["prompt"]) == 24
        by_tenant.setdefault(b["user"], set()).add(tuple(b["prompt"][:20]))
    assert set(by_tenant) <= {"tenant-0", "tenant-1", "tenant-2"} and len(by_tenant) >= 2
    assert all(len(systems) == 1 for systems in by_tenant.values())       # one system prompt a tenant
    assert len({next(iter(v)) for v in by_tenant.values()}) == len(by_tenant)
