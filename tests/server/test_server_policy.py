"""--scheduling-policy priority on a real `tandem serve` with one running row: a request with a better
`priority` (lower) retracts the long stream that holds the row, finishes while that stream is still open, and
the stream then goes on; /metrics counts the retraction and the request under its class (priority, tenant);
`priority` and `user` are checked at the boundary (400 naming the field)."""
from __future__ import annotations

import pytest

from tests.helpers.server_utils import ServerProcess, assert_error
from tests.helpers.tiny_models import make_tiny_model
from tests.server.test_server_deadlines import CHAT, CMPL, SHORT, Occupant, wait_idle


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=4096)
    srv = ServerProcess(["--model", model, "--kv-cache-tokens", "8192", "--device-threads", "1",
                         "--max-running-requests", "1", "--scheduling-policy", "priority"],
                        str(tmp_path_factory.mktemp("log") / "server.log"))
    yield srv
    assert "Traceback" not in srv.log(), srv.log()
    assert srv.stop() == 0, srv.log()


def test_a_better_priority_preempts_the_running_stream(server):
    wait_idle(server)
    occupant = Occupant(server)             # priority 0 (the default), holding the only row; -100 outranks it
    #                                         whatever its head start (priority_aging: a level a minute)
    try:
        r = server.http.post(CMPL, json={**SHORT, "priority": -100, "user": "alice"}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert occupant.thread.is_alive()   # it was retracted, not ended: its stream is still open
    finally:
        occupant.stop()
    assert not any('"error"' in line for line in occupant.lines), occupant.lines[-3:]
    metrics = server.metrics()
    assert metrics["tandem:num_preemptions_total"] >= 1           # the occupant's retraction
    # Its class in /metrics: its tokens, queue time and TTFT under its priority and tenant.
    m = {k: v for k, v in metrics.items() if 'priority="-100"' in k and 'tenant="alice"' in k}
    assert [v for k, v in m.items() if k.startswith("tandem:class_generation_tokens_total")] == [SHORT["max_tokens"]]
    for name in ("tandem:class_queue_time_seconds_count", "tandem:class_time_to_first_token_seconds_count"):
        assert [v for k, v in m.items() if k.startswith(name)] == [1], m


@pytest.mark.parametrize("field,value", [("priority", "1"), ("priority", 1.5), ("priority", 2 ** 63),
                                         ("user", 5), ("user", "x" * 300)])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_bad_priority_or_user_is_a_400_naming_it(server, path, field, value):
    body = {"prompt": "hi"} if path == CMPL else {"messages": [{"role": "user", "content": "hi"}]}
    assert_error(server.http.post(path, json={**body, "max_tokens": 2, field: value}), 400, field)


def test_the_tenant_reaches_the_chat_request_from_every_route():
    """`user` names the tenant of --scheduling-policy fair: Anthropic's metadata.user_id and the Responses
    route's user become the chat request's user (a non-string user_id is no tenant)."""
    from tandem.server.anthropic_protocol import MessagesRequest
    from tandem.server.responses_protocol import ResponsesRequest
    msgs = [{"role": "user", "content": "hi"}]
    assert MessagesRequest.model_validate({"model": "m", "max_tokens": 2, "messages": msgs,
                                           "metadata": {"user_id": "alice"}}).to_chat().user == "alice"
    assert MessagesRequest.model_validate({"model": "m", "max_tokens": 2, "messages": msgs,
                                           "metadata": {"user_id": 7}}).to_chat().user is None
    assert ResponsesRequest.model_validate({"model": "m", "input": "hi", "user": "bob"}).to_chat().user == "bob"
