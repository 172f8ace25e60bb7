"""One OpenAI shape for every 503 and 408: the JSON body of an engine failure, a refusal or /health, and the
SSE error event of a stream, all say `code` "503" (or "408"), never null in one place and a string in another."""
from __future__ import annotations

import json

import pytest

from tandem.replicas.engine_client import EngineError
from tandem.server.errors import engine_error, error, stream_error
from tandem.server.protocol import APIError


def _event(text: str) -> dict:
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[6:])["error"]


@pytest.mark.parametrize("status,type_", [(503, "service_unavailable"), (408, "timeout")])
def test_engine_errors_read_the_same_in_a_body_and_a_stream(status, type_):
    e = EngineError(status, "why")
    body = json.loads(engine_error(e).body)["error"]
    assert body == _event(stream_error(e)) == {"message": "why", "type": type_, "param": None, "code": str(status)}


def test_a_refusal_and_an_api_error_503_carry_the_same_code():
    refusal = json.loads(error(503, "stuck", "service_unavailable").body)["error"]
    assert refusal["code"] == "503" == _event(stream_error(APIError(503, "stuck")))["code"]


def test_other_statuses_keep_their_own_code_or_null():
    assert json.loads(error(400, "bad", "invalid_request_error", "n").body)["error"]["code"] is None
    assert json.loads(error(404, "no", "invalid_request_error", "model", "model_not_found").body)["error"]["code"] \
        == "model_not_found"
    assert _event(stream_error(APIError(500, "failed")))["code"] is None
    assert json.loads(engine_error(EngineError(400, "bad")).body)["error"]["code"] is None
