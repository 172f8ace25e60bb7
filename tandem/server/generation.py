"""What every route shares, whatever its API's shapes: submit a response's requests to the engine (all or
none), read their outputs as they come (merged across choices, an engine failure raised as the client sees it),
split each chat output into reasoning, content and tool calls, collect a whole response unless the client leaves
(ClientLeft: a 499), stream one with its requests aborted however it ends, and abort what is left. The OpenAI
routes (openai_api.py), Anthropic's (anthropic_api.py), the Responses route (responses_api.py) and embeddings
(embeddings_api.py) are given one Generation.
"""
from __future__ import annotations

import asyncio
import functools
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..replicas.engine_client import EngineError, RequestStream
from ..replicas.replica_set import ReplicaSet
from ..request import StepOutput
from ..sampling_params import SamplingParams
from .frontend import Frontend, TextStream
from .protocol import APIError, ChatCompletionRequest
from . import harmony, tools
from .harmony import HarmonySplitter
from .reasoning import END, START, ReasoningSplitter
from .tools import ToolPlan

CLIENT_LEFT = 499           # nginx's "client closed request": the answer of a request whose client went away


class ClientLeft(Exception):
    """The client went away before its whole response was ready: its requests are aborted, it gets a 499."""


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Streamed:
    """What Generation.content_deltas read of a choice: its text after the reasoning (all of it without a
    reasoning parser) and its reasoning, and once it ended, the finish reason and its output tokens, of which
    `n_reasoning` up to the end of the reasoning (the step that closed it included); then the content and the
    tool calls parsed out of the text (`finish`)."""
    text: str = ""
    reasoning: str | None = None    # None: the output had no reasoning part
    reason: str | None = None       # the engine's finish reason
    n_out: int = 0
    n_reasoning: int = 0
    sent: int = 0                   # characters of `text` streamed as content
    content: str | None = None      # once ended: the text with its tool calls parsed out (None: only calls)
    calls: list[dict] = field(default_factory=list)     # OpenAI tool_calls (tools.parse)
    finish_reason: str | None = None    # OpenAI's: "tool_calls" where the output called tools (tools.parse)

    def finish(self, plan: ToolPlan, reason: str | None, calls: list[dict] | None = None) -> str:
        """End the output: its tool calls parsed out (or given: a harmony output's, parsed from its channels);
        returns the content not yet streamed, none when the calls are all there is (what a tool call might have
        begun was held back: tools.content_prefix)."""
        self.reason = reason
        if calls is not None:
            self.content, self.calls = (self.text or None) if calls else self.text, calls
            self.finish_reason = "tool_calls" if calls and reason == "stop" else reason
        else:
            self.content, self.calls, self.finish_reason = tools.parse(plan, self.text, reason)
        return (self.content or "")[self.sent:] if not self.calls or self.content else ""


@dataclass(eq=False)
class Choice:
    """One sampled sequence of a response: choice `index`, from prompt `ids`."""
    index: int
    ids: list[int]
    st: RequestStream
    ts: TextStream
    echo: str = ""                 # the prompt's text, sent first (completions with echo=true)
    sample: int = 0                # which of its prompt's n samples
    want_logprobs: bool = False
    lps: list = field(default_factory=list)   # (token, logprob, top) entries not yet sent
    offset: int = 0                # text offset of the next token (completions' logprobs.text_offset)
    split: ReasoningSplitter | HarmonySplitter | None = None    # a chat output's split (--reasoning-parser)
    out: Streamed = field(default_factory=Streamed)     # the output as content_deltas read it


def cached_tokens(choices: list[Choice]) -> int:
    """Prompt tokens the prefix cache served, each prompt counted once (as prompt_tokens are)."""
    return sum(c.st.num_cached_tokens for c in choices if c.sample == 0)


class Generation:
    def __init__(self, client: ReplicaSet, frontend: Frontend, reasoning_parser: str | None = None) -> None:
        self.client, self.fe = client, frontend
        self.reasoning_parser = reasoning_parser       # --reasoning-parser (reasoning.py, harmony.py), or None
        # gpt-oss: harmony's special token ids, looked up (a ValueError at start-up if the tokenizer lacks them)
        self.harmony = harmony.special_ids(frontend.tokenizer) if harmony.is_parser(reasoning_parser) else None

    # ---- submit --------------------------------------------------------------------------------------------
    async def chat_prompt(self, chat: ChatCompletionRequest, one_call: bool = False) -> tuple[ToolPlan, list[int]]:
        """A chat request's tool plan and prompt ids (on the tokenizer pool). `one_call` caps a required tool
        choice at one call through the grammar (Anthropic's disable_parallel_tool_use, parallel_tool_calls=false)."""
        def prompt() -> tuple[ToolPlan, list[int]]:
            plan = tools.plan(chat.tools, chat.tool_choice)
            if self.harmony is not None and plan.schema is not None:
                raise APIError(400, f"tool_choice {chat.tool_choice!r} is not supported with the gpt-oss parser: "
                                    "a harmony model calls tools in its own format; give auto or none",
                               "tool_choice")
            if plan.mode == "required" and one_call:
                plan.schema = {**plan.schema, "maxItems": 1}
            return plan, self.fe.chat_ids(chat, plan)
        return await self.fe.off_loop(prompt)

    def splitter(self, prompt_ids: list[int]) -> ReasoningSplitter | None:
        """A reasoning split for an output of this prompt (None without --reasoning-parser): whether the output
        starts in the reasoning follows the rendered prompt's last tokens (a template that opens <think>)."""
        if self.reasoning_parser is None:
            return None
        if self.harmony is not None:
            return HarmonySplitter()
        return ReasoningSplitter.for_prompt(self.reasoning_parser, self.fe.tokenizer.decode(prompt_ids[-16:]))

    async def submit(self, body, prompts: list[list[int]], kind: str, arrival: float,
                     default_max_tokens: int | None, tool_plan: ToolPlan | None = None,
                     chat: bool = False) -> tuple[str, list[Choice]]:
        """Submit every choice of a response: each prompt n times (sample i with its own derived seed).
        Every prompt's fields are validated before anything is queued (submit_all). A chat output's grammar
        starts after its reasoning when a reasoning parser is set (reasoning_gate); its text is split there."""
        constrained = body.structured() is not None or (tool_plan is not None and tool_plan.schema is not None)
        structured = await self.fe.off_loop(self.fe.structured, body, tool_plan) if constrained else None
        params = [self.fe.sampling_params(body, len(ids), default_max_tokens, structured) for ids in prompts]
        if structured is not None and chat:
            for ids, p in zip(prompts, params):
                p.reasoning_end_ids, p.reasoning_start_id = self.reasoning_gate(ids)
        if self.harmony is not None and chat:
            for p in params:
                self.harmony_params(p)
        rid = f"{kind}-{uuid.uuid4().hex}"
        plan = [(ids, p.sample(i)) for ids, p in zip(prompts, params) for i in range(p.n)]
        subs = await self.submit_all([(rid if len(plan) == 1 else f"{rid}-{k}", ids, self.fe.params_dict(p))
                                      for k, (ids, p) in enumerate(plan)], arrival)
        echo = [await self.fe.off_loop(self.fe.decode, ids) if getattr(body, "echo", False) else ""
                for ids, _ in plan]
        samples = [i for p in params for i in range(p.n)]
        return rid, [Choice(k, ids, st, self.fe.text_stream(ids, p), e, i, p.logprobs is not None, offset=len(e),
                            split=self.splitter(ids) if chat else None)
                     for k, ((ids, p), st, e, i) in enumerate(zip(plan, subs, echo, samples))]

    async def submit_all(self, requests: list[tuple[str, list[int], dict]], arrival: float) -> list[RequestStream]:
        """Submit (request id, prompt ids, params) requests at once; if one submit fails, the others are
        aborted and its error raised, so a refused response leaves nothing running."""
        subs = await asyncio.gather(*(self.client.submit(rid, ids, params, arrival) for rid, ids, params in requests),
                                    return_exceptions=True)
        failed = [e for e in subs if isinstance(e, BaseException)]
        if failed:
            self.abort(st for st in subs if isinstance(st, RequestStream))
            raise failed[0]
        return subs

    def harmony_params(self, p: SamplingParams) -> None:
        """A harmony chat output: <|return|> and <|call|> end it (<|end|> only closes a message), and its
        special tokens stay in the text, which the parser reads (harmony.py)."""
        p.skip_special_tokens = False
        p.stop_token_ids = list(dict.fromkeys([*p.stop_token_ids, *(self.harmony[t] for t in harmony.STOPS)]))

    def reasoning_gate(self, prompt_ids: list[int]) -> tuple[list[int] | None, int | None]:
        """(reasoning_end_ids, reasoning_start_id) of a grammar that starts after the reasoning, as the splitter
        reads the output (tandem/grammar/after_reasoning.py): an output that starts in the reasoning waits for
        the end tag's ids; one that may open it waits too if it writes the start tag first, when that tag is one
        token (Qwen3's); otherwise, and without a reasoning parser, the grammar applies from the start."""
        split = self.splitter(prompt_ids)
        if split is None:
            return None, None
        encode = functools.partial(self.fe.tokenizer.encode, add_special_tokens=False)
        if isinstance(split, HarmonySplitter):      # the final channel's header: what follows is the answer
            return encode(harmony.FINAL_HEADER), None
        end = encode(END)
        if split.mode == "reasoning":
            return end, None
        start = encode(START)
        return (end, start[0]) if len(start) == 1 else (None, None)

    # ---- read ----------------------------------------------------------------------------------------------
    async def outputs(self, st: RequestStream) -> AsyncIterator[StepOutput]:
        """The request's engine outputs; the last one is finished. APIError(500) if the engine failed this
        request (engine isolation: the others go on); EngineError(503) if it waited past --max-queue-time,
        EngineError(408) if its own `timeout` passed (Scheduler.expire)."""
        async for o in self.client.outputs(st):
            st.num_cached_tokens = o.num_cached_tokens
            if o.finish_reason == "error":
                if o.error_status in (408, 503):
                    raise EngineError(o.error_status, o.error or "the request's deadline passed")
                raise APIError(500, f"the engine failed this request: {o.error}", type="server_error")
            yield o

    async def deltas(self, st: RequestStream, ts: TextStream) -> AsyncIterator[tuple[str, StepOutput]]:
        """(text delta, output) per engine output (outputs)."""
        async for o in self.outputs(st):
            yield (ts.finish(o.new_token_ids, o.text) if o.finished else ts.add(o.new_token_ids)), o

    async def merged(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, str, StepOutput]]:
        """The outputs of every choice, as they come; the first error ends them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for delta, o in self.deltas(c.st, c.ts):
                    queue.put_nowait((c, delta, o))
            except Exception as e:            # handed to the reader, which raises it: never a silent hang
                queue.put_nowait((c, e, None))
        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            left = len(choices)
            while left:
                c, delta, o = await queue.get()
                if isinstance(delta, Exception):
                    raise delta
                if o.prompt_logprobs:        # echo with logprobs: the prompt's, first (its first token has none)
                    c.lps[:0] = [(c.ids[0], None, [])] + [(t, lp, top) for t, (lp, top)
                                                          in zip(c.ids[1:], o.prompt_logprobs)]
                    c.offset = 0
                if o.logprobs:
                    c.lps.extend((t, lp, top) for t, (lp, top) in zip(o.new_token_ids, o.logprobs))
                yield c, delta, o
                left -= o.finished
        finally:
            for t in tasks:
                t.cancel()

    async def content_deltas(self, choices: list[Choice], plan: ToolPlan = tools.NO_TOOLS
                             ) -> AsyncIterator[tuple[Choice, str, str]]:
        """(choice, kind, piece) as the outputs come, merged: "reasoning", with a reasoning split, as it becomes
        certain; "content" in the pieces that surely are content: all of it without tools; under a tool plan, up
        to where a tool call may begin (tools.content_prefix); "end" once a choice ended, with the content not
        yet sent (Streamed.finish). Each choice's `out` gathers the rest."""
        async for c, delta, o in self.merged(choices):
            out, split = c.out, c.split
            out.n_out = o.num_output_tokens
            if split is not None:
                was_closed = split.closed
                thought, delta = split.feed(delta)
                if o.finished:
                    more, rest = split.finish()
                    thought, delta = thought + more, delta + rest
                if split.thought and not was_closed:
                    out.n_reasoning = o.num_output_tokens
                    out.reasoning = (out.reasoning or "") + thought
                if thought:
                    yield c, "reasoning", thought
            out.text += delta
            if o.finished:
                calls = split.calls if isinstance(split, HarmonySplitter) else None
                yield c, "end", out.finish(plan, o.finish_reason, calls)
                continue
            harmonic = isinstance(split, HarmonySplitter)      # its calls are no content: all of it is safe
            safe = len(out.text) if plan.mode == "none" or harmonic else tools.content_prefix(plan, out.text)
            if safe > out.sent:
                yield c, "content", out.text[out.sent:safe]
                out.sent = safe

    # ---- whole responses and streams -------------------------------------------------------------------------
    async def read(self, request: Request, choices: list[Choice], plan: ToolPlan = tools.NO_TOOLS) -> None:
        """content_deltas read to the end (a whole response), unless the client leaves (ClientLeft): each
        choice's `out` holds its split output."""
        async def work() -> None:
            async for _ in self.content_deltas(choices, plan):
                pass
        await self.unless_disconnected(request, [c.st for c in choices], work())

    async def unless_disconnected(self, request: Request, streams: list[RequestStream], work: Awaitable):
        """Await `work` (a coroutine reading the requests), aborting them when it ends, when it fails, and when
        the client leaves first (then ClientLeft)."""
        task = asyncio.ensure_future(work)      # a task: cancelled quietly if the client leaves
        watch = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise ClientLeft()
            return task.result()
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
            self.abort(streams)

    def stream(self, events: AsyncIterator[str], choices: list[Choice], failed: Callable[[Exception], str],
               end: str = "") -> StreamingResponse:
        """An SSE response of `events`: an engine failure (or a refusal to go on) ends it with `failed(e)`'s
        events, then `end`; its requests are aborted however it ends (a client that left mid-stream: its KV
        freed; a no-op for finished ones)."""
        async def guarded() -> AsyncIterator[str]:
            try:
                async with aclosing(events) as it:
                    async for ev in it:
                        yield ev
            except (EngineError, APIError) as e:
                yield failed(e)
            finally:
                self.abort(c.st for c in choices)
            if end:
                yield end
        return StreamingResponse(guarded(), media_type="text/event-stream")

    def abort(self, streams: Iterable[RequestStream]) -> None:
        """Free the KV of every unfinished request (a no-op for finished ones)."""
        for st in streams:
            self.client.abort(st.rid)
