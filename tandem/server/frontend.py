"""Frontend text work: prompts and chat messages to token ids (validated), token ids back to text deltas.

Everything a client sends is checked here before it reaches the engine: text that has a UTF-8 form, token
ids in the vocabulary, prompt and prompt + max_tokens within the context, sampling fields in range. The
engine checks again. Tokenizing and chat templating run on a small thread pool (`encode` of the fast
tokenizer releases the GIL; a template yields it every few ms), so a huge prompt never stalls the event
loop that serves /health and every open stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..detokenizer import IncrementalDetokenizer
from ..grammar import GrammarCompiler, StructuredOutputsParams
from . import tools
from .tools import ToolPlan
from ..sampling_params import SamplingParams, is_utf8
from .protocol import INT64, APIError, ChatCompletionRequest, CompletionRequest

_PARAM = re.compile(r"invalid sampling parameter (\w+)=")
TOKENIZER_THREADS = 2
MAX_PROMPTS = 1024          # prompts in one completions request (each is a request of its own, times n)


def find_bad_text(value: Any, path: str) -> str | None:
    """The path of the first string in a parsed request that no tokenizer can take (a lone surrogate such
    as "\\ud800", which JSON allows), else None."""
    if isinstance(value, str):
        return None if is_utf8(value) else path
    if isinstance(value, dict):
        for k, v in value.items():
            bad = find_bad_text(k, path) or find_bad_text(v, f"{path}.{k}" if path else str(k))
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = find_bad_text(v, f"{path}[{i}]")
            if bad:
                return bad
    return None


NO_CHAT_TEMPLATE = ("this model has no chat template (a base model), so /v1/chat/completions cannot format "
                    "messages; send a text prompt to /v1/completions")


class Frontend:
    def __init__(self, tokenizer, max_context: int, vocab_size: int, max_messages: int = 2048,
                 defaults: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.defaults = self._valid_defaults(defaults or {}, vocab_size)   # the model's, for fields a request omits
        self.max_context = max_context      # prompt + output tokens, capped by the KV cache
        self.vocab_size = vocab_size
        self.max_messages = max_messages
        self._token_text: dict[int, str] = {}
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.grammar = GrammarCompiler(tokenizer, vocab_size, eos)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tandem-tokenizer")

    async def off_loop(self, fn, *args):
        """Run text work on the tokenizer pool, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- checks --------------------------------------------------------------------------------------------
    def check_text(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """APIError(400) naming the first field whose text has no UTF-8 form."""
        bad = find_bad_text(body.model_dump(exclude_defaults=True), "")
        if bad is not None:
            raise APIError(400, f"{bad} is not valid Unicode text (it holds a lone UTF-16 surrogate)", bad)

    def check_messages(self, body: ChatCompletionRequest) -> None:
        if len(body.messages) > self.max_messages:
            raise APIError(400, f"too many messages: {len(body.messages)}, the limit is {self.max_messages} "
                                f"(--max-messages)", "messages")

    # ---- prompts (called on the pool through off_loop) ------------------------------------------------------
    def completion_ids(self, body: CompletionRequest) -> list[list[int]]:
        """The token ids of each prompt of a completions request (OpenAI's batch: a list of prompts)."""
        self.check_text(body)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and \
            isinstance(body.prompt[0], (str, list)) else [body.prompt]
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"too many prompts: {len(prompts)}, the limit is {MAX_PROMPTS}", "prompt")
        return [self.completion_prompt(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
                for i, p in enumerate(prompts)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs name it (cached: a few thousand distinct tokens at most)."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def chat_ids(self, body: ChatCompletionRequest, tool_plan: ToolPlan | None = None,
                 add_special_tokens: bool = False) -> list[int]:
        self.check_messages(body)
        self.check_text(body)
        return self.chat_prompt(body, tool_plan, add_special_tokens)

    def completion_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """One prompt (text or token ids) as validated token ids; APIError(400) names `param`."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = prompt
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})", param)
        if not ids:
            raise APIError(400, "prompt is empty", param)
        return ids

    def chat_prompt(self, req: ChatCompletionRequest, tool_plan: ToolPlan | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """The rendered chat's ids; add_special_tokens (/tokenize's option) adds the tokenizer's own (BOS) too,
        where the template already wrote what the model expects."""
        if not getattr(self.tokenizer, "chat_template", None):     # a base model (Gemma 3 270M's GGUF has none)
            raise APIError(400, NO_CHAT_TEMPLATE, "messages")
        messages = [m.as_template_dict() for m in req.messages]
        extra: dict = {}
        if tool_plan is not None:
            messages, extra = tools.render_messages(messages, tool_plan, self.tokenizer.chat_template)
        if req.reasoning_effort is not None:
            if "reasoning_effort" not in self.tokenizer.chat_template:
                raise APIError(400, "reasoning_effort is not supported by this model: its chat template does not "
                                    "read reasoning_effort", "reasoning_effort")
            extra["reasoning_effort"] = req.reasoning_effort
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=req.add_generation_prompt,
                                                      **{**(req.chat_template_kwargs or {}), **extra})
        except Exception as e:          # the template may reject roles or orderings
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise APIError(400, "the messages produce an empty prompt", "messages")
        return ids

    def structured(self, req: CompletionRequest | ChatCompletionRequest,
                   tool_plan: ToolPlan | None = None) -> dict | None:
        """The request's structured output, compiled (cached) so that an invalid schema, regex or grammar is a
        400 naming its field at submit time, never an engine error. Runs on the pool (compiling can take
        ~1 s for a large schema; the first call builds llguidance's view of the vocabulary)."""
        asked = req.structured()
        if tool_plan is not None and tool_plan.schema is not None:
            if asked is not None:
                raise APIError(400, f"{asked[0]} and tool_choice {tool_plan.mode!r} both constrain the output; "
                                    f"give one", asked[0])
            asked = ("tool_choice", {"json": tool_plan.schema})
        if asked is None:
            return None
        field, value = asked
        try:
            spec = StructuredOutputsParams.coerce(value)
            self.grammar.compile(spec)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), field) from None
        return spec.to_dict()

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, num_prompt: int,
                        default_max_tokens: int | None, structured: dict | None = None) -> SamplingParams:
        """SamplingParams for a request, or APIError(400) naming the field (context limits included)."""
        kw = {**self.defaults, **req.sampling_kwargs(default_max_tokens)}   # the request's own fields win
        kw["structured_outputs"] = structured
        try:
            params = SamplingParams(**kw)
            params.validate(self.vocab_size)
        except ValueError as e:
            m = _PARAM.match(str(e))
            raise APIError(400, str(e), m.group(1) if m else None) from None
        if params.seed is not None and not -INT64 <= params.seed < INT64:
            raise APIError(400, "seed must fit in 64 bits", "seed")
        ctx = self.max_context
        if num_prompt + 1 > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, your prompt has "
                                f"{num_prompt} tokens (one generated token at least must fit).",
                           "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           "context_length_exceeded")
        if params.max_tokens is not None and num_prompt + params.max_tokens > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                                f"{params.max_tokens} for the completion).", "max_tokens", "context_length_exceeded")
        return params

    @staticmethod
    def _valid_defaults(defaults: dict, vocab_size: int) -> dict:
        """The model's sampling defaults that SamplingParams accepts; one out of range is dropped with a warning
        (a model's metadata must not make every request that omits the field fail)."""
        out = {}
        for name, value in defaults.items():
            try:
                SamplingParams(**{name: value}).validate(vocab_size)
                out[name] = value
            except ValueError as e:
                logging.getLogger(__name__).warning("ignoring the model's sampling default %s=%r: %s", name, value, e)
        return out

    def text_stream(self, prompt_ids: list[int], params: SamplingParams) -> "TextStream":
        return TextStream(self.tokenizer, prompt_ids, params)

    @staticmethod
    def params_dict(params: SamplingParams) -> dict:
        return dataclasses.asdict(params)


class TextStream:
    """Token ids in, text deltas out: each delta is valid UTF-8 and never part of a stop string.

    The detokenizer holds back incomplete multi-byte characters; with stop strings, the last
    (longest stop - 1) characters are held back too, until more text proves they start no stop string, or
    the request finishes (then the engine's cut text, if any, is the truth).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent = 0                       # characters handed out so far

    def add(self, token_ids: list[int]) -> str:
        self.detok.add(token_ids)
        safe = len(self.detok.text) - self.hold
        if safe <= self.sent:
            return ""
        delta = self.detok.text[self.sent:safe]
        self.sent = safe
        return delta

    def finish(self, token_ids: list[int], final_text: str | None) -> str:
        """The rest of the text, given the last tokens; `final_text` is the engine's text when a stop string cut
        it (the stop string may end inside these tokens, so they are not passed through add())."""
        self.detok.add(token_ids)
        text = self.detok.text if final_text is None else final_text
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
