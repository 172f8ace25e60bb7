"""Every request parameter of OpenAI's /v1/completions and /v1/chat/completions (and the vLLM extras tandem
takes) is either honoured or refused with a 400 that names it: none is silently ignored.

One table per endpoint: parameter -> ("ok", a value that must be accepted) or ("400", a value that must be
refused, naming the parameter). Behaviour of the honoured ones is tested where it lives (test_server.py,
test_sampling_surface.py, test_grammar.py, test_engine.py); here each is exercised once over HTTP.
"""
from __future__ import annotations

import pytest

from tests.helpers.server_utils import assert_error

OK, REFUSED = "ok", "400"
COMMON = {
    "model": (OK, "tiny"), "max_tokens": (OK, 3), "temperature": (OK, 0.5), "top_p": (OK, 0.9), "n": (OK, 2),
    "stop": (OK, ["\n\n"]), "seed": (OK, 7), "stream": (OK, False),
    "stream_options": (REFUSED, {"include_usage": True}),
    "presence_penalty": (OK, 0.5), "frequency_penalty": (OK, 0.5), "logit_bias": (OK, {"11": 2.0}),
    "user": (OK, "someone"), "metadata": (OK, {"k": "v"}), "store": (OK, False), "service_tier": (OK, "auto"),
    "response_format": (OK, {"type": "json_object"}),
    # vLLM extras
    "top_k": (OK, 5), "min_p": (OK, 0.05), "stop_token_ids": (OK, [13]), "ignore_eos": (OK, True),
    "skip_special_tokens": (OK, False), "include_stop_str_in_output": (OK, True), "repetition_penalty": (OK, 1.2),
    "min_tokens": (OK, 1), "structured_outputs": (OK, {"regex": "[a-z]+"}), "guided_json": (OK, {"type": "object"}),
    "guided_regex": (OK, "[0-9]+"), "guided_choice": (OK, ["x", "y"]), "guided_grammar": (OK, 'start: "a"'),
    "timeout": (OK, 30),                     # tandem's extra: the request's deadline (test_server_deadlines.py)
    "priority": (OK, -3),                    # vLLM's extra: --scheduling-policy priority (test_server_policy.py)
    "no_such_parameter": (REFUSED, 1),
}
COMPLETIONS = {**COMMON, "echo": (OK, True), "logprobs": (OK, 2), "best_of": (OK, 2), "suffix": (REFUSED, "end")}
CHAT = {**COMMON, "max_completion_tokens": (OK, 3), "logprobs": (OK, True), "top_logprobs": (REFUSED, 2),
        "tools": (OK, [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        "tool_choice": (REFUSED, "required"), "parallel_tool_calls": (OK, False),
        "functions": (REFUSED, [{"name": "f"}]), "function_call": (REFUSED, "auto"),
        "add_generation_prompt": (OK, True), "chat_template_kwargs": (OK, {})}
# Values that are refused only in combination (noted in the table): stream_options needs stream=true,
# top_logprobs needs logprobs=true, tool_choice needs tools; suffix and functions are not supported.


def _body(path: str, name: str, value) -> dict:
    base = {"prompt": "hello"} if path.endswith("/completions") and "chat" not in path else \
        {"messages": [{"role": "user", "content": "hello"}]}
    body = {**base, "max_tokens": 3, name: value}
    if name == "best_of":
        body["n"] = 2
    return body


@pytest.mark.parametrize("path,table", [("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
def test_every_parameter_is_honoured_or_refused(server, path, table):
    for name, (expect, value) in table.items():
        resp = server.http.post(path, json=_body(path, name, value))
        if expect == OK:
            assert resp.status_code == 200, (name, resp.text)
        else:
            assert_error(resp, 400, name)
