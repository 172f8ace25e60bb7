"""chat_template_kwargs (vLLM's extra, e.g. Qwen3's enable_thinking) reach the chat template on every route that
renders one: chat completions, Responses and Messages (count_tokens included), beside a Messages prefill's own
continue_final_message."""
from __future__ import annotations

import copy

import pytest

from tandem.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tandem.server.frontend import Frontend
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.responses_protocol import ResponsesRequest
from tests.helpers.tiny_models import smollm2_tokenizer

# A template that shows the enable_thinking it was given (transformers cuts a continued turn's text after it).
TEMPLATE = ("{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
KW = {"enable_thinking": False}


@pytest.fixture(scope="module")
def frontend():
    tok = copy.copy(smollm2_tokenizer())
    tok.chat_template = TEMPLATE
    fe = Frontend(tok, 4096, len(tok))
    yield fe
    fe.close()


def _rendered(fe: Frontend, chat: ChatCompletionRequest) -> str:
    return fe.decode(fe.chat_ids(chat))


def test_every_route_passes_them_through(frontend):
    user = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate({"messages": user, "chat_template_kwargs": KW})
    responses = ResponsesRequest.model_validate({"model": "m", "input": "hi", "chat_template_kwargs": KW})
    messages = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": user,
                                               "chat_template_kwargs": KW})
    count = CountTokensRequest.model_validate({"model": "m", "messages": user, "chat_template_kwargs": KW})
    for req in (chat, responses.to_chat(), messages.to_chat(), count.chat_request()):
        assert _rendered(frontend, req).endswith("[thinking=False]<user>hi<end><assistant>"), req
    plain = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": user})
    assert "[thinking" not in _rendered(frontend, plain.to_chat())


def test_a_messages_prefill_keeps_them_beside_continue(frontend):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}]
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": turns,
                                          "chat_template_kwargs": KW})
    assert _rendered(frontend, req.to_chat()).endswith("[thinking=False]<user>hi<end><assistant>Well")
