"""/tokenize and /detokenize in vLLM's shapes: what a client calls to count and inspect tokens without generating.

/tokenize takes a prompt (`prompt`, special tokens added by default) or chat messages (`messages`, rendered by the
model's chat template as /v1/chat/completions renders them, tools included; special tokens not added by default:
the template holds them) and answers {"count", "max_model_len", "tokens", "token_strs"}. /detokenize takes
`tokens` and answers {"prompt"}: the text /v1/completions would have been given. Both validate as the generation
routes do: unknown fields, ids out of the vocabulary and a model that is not this server's are 400 / 404.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from . import tools
from .frontend import Frontend
from .protocol import APIError, ChatCompletionRequest, ChatMessage, Int64, _Strict, check_model, refuse


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None      # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int64]


def tokenize(fe: Frontend, served: str, body: TokenizeRequest) -> dict:
    """The body's token ids (and their texts when asked), in vLLM's TokenizeResponse."""
    check_model(body.model, served)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) and messages (chat)", "prompt")
    if body.messages is None:
        extra = [n for n in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
                 if n in body.model_fields_set]
        if extra:
            raise APIError(400, f"{extra[0]} applies to messages, not to a prompt", extra[0])
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = fe.tokenizer.encode(body.prompt, add_special_tokens=add) if body.prompt else []
    else:
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt=false", "continue_final_message")
        kwargs = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                     chat_template_kwargs=kwargs or None, tools=body.tools)
        refuse(chat.unsupported())
        ids = fe.chat_ids(chat, tools.plan(body.tools, None), bool(body.add_special_tokens))
    return {"count": len(ids), "max_model_len": fe.max_context, "tokens": ids,
            "token_strs": [fe.tokenizer.convert_ids_to_tokens(t) for t in ids] if body.return_token_strs else None}


def detokenize(fe: Frontend, served: str, body: DetokenizeRequest) -> dict:
    check_model(body.model, served)
    bad = [t for t in body.tokens if not 0 <= t < fe.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of range [0, {fe.vocab_size})", "tokens")
    return {"prompt": fe.decode(body.tokens)}
