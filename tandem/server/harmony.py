"""gpt-oss's harmony output format (`--reasoning-parser gpt-oss`): its channels into reasoning, content and tool
calls, streaming-safe across any cut of the text, special tokens' text included.

The chat template ends the prompt with `<|start|>assistant`, so the output starts in a message header. A message
is `{header}<|message|>{body}` closed by `<|end|>`, `<|return|>` or `<|call|>` (the last two end generation);
the next one opens with `<|start|>`. The header names the channel (`<|channel|>analysis`) and, for a tool call,
the recipient (`to=functions.NAME`, before or after the channel; `<|constrain|>json` or a bare `json` says the
body's type and is not read). What the bodies become:
- analysis (no recipient): reasoning;
- a recipient (commentary `to=functions.NAME`): a tool call, NAME with the body as its arguments;
- final, and commentary without a recipient (a preamble to the user): content.
Bodies of one kind are joined by a newline (vLLM joins analysis messages so). Parsing reads the text with the
special tokens kept (Generation decodes a harmony chat output with skip_special_tokens off), so that one state
machine serves whole texts and streams cut anywhere; unlike vLLM's parser, which reads token ids, a marker's text
that a model spells out in ordinary tokens is read as the marker too.
A header never closed by `<|message|>` (cut by max_tokens) says nothing and is dropped; a body cut by the end of
the output is kept, a tool call cut so included (its arguments as written; the finish reason says "length").
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from .reasoning import _open_tail

NAMES = ("gpt-oss", "openai_gptoss")            # --reasoning-parser choices: ours and vLLM's name for it
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
SPECIAL = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOPS = (RETURN, CALL)                          # end generation; <|end|> only closes a message
FINAL_HEADER = CHANNEL + "final" + MESSAGE      # where a structured output (the final channel's) starts
CLOSERS = (END, RETURN, CALL)                   # close a body; START and CHANNEL also open the next header
BODY_MARKERS = (END, RETURN, CALL, START, CHANNEL)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]\w*)")


def is_parser(name: str | None) -> bool:
    return name in NAMES


def special_ids(tokenizer) -> dict[str, int]:
    """Harmony's special tokens' ids in this tokenizer (never assumed: a test tokenizer has others); ValueError
    naming the missing ones, so a server started with the parser on a model without them fails at once."""
    vocab = tokenizer.get_added_vocab()
    missing = [t for t in SPECIAL if t not in vocab]
    if missing:
        raise ValueError(f"the gpt-oss reasoning parser needs a tokenizer with harmony's special tokens; this one "
                         f"lacks {', '.join(missing)}")
    return {t: vocab[t] for t in SPECIAL}


def speaks_harmony(tokenizer) -> bool:
    """Whether a model's tokenizer has harmony's special tokens and its chat template writes channels: the
    parser is then chosen without --reasoning-parser (its output is unreadable without it)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or CHANNEL not in template:
        return False
    vocab = tokenizer.get_added_vocab()
    return all(t in vocab for t in SPECIAL)


@dataclass
class Header:
    channel: str | None
    recipient: str | None

    @staticmethod
    def parse(text: str) -> "Header":
        """A header's channel and recipient; the text is what follows the last `<|start|>` (the role first)."""
        ch, to = _CHANNEL.search(text), _RECIPIENT.search(text)
        return Header(ch.group(1) if ch else None, to.group(1) if to else None)

    @property
    def kind(self) -> str:
        if self.recipient is not None and self.recipient != "assistant":
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"


def new_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call (tools.parse's shape)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class HarmonySplitter:
    """One output's parse, fed text as it comes (feed / finish: the ReasoningSplitter's interface), with the tool
    calls gathered in `calls` as their messages close."""
    state: str = "header"           # "header": reading one up to <|message|>; "body": a message's text
    header: str = ""                # the header so far
    held: str = ""                  # body text not yet said: a possible start of a marker
    kind: str = ""                  # the open body's: "reasoning", "content" or "call"
    name: str = ""                  # the open call's function
    args: str = ""                  # the open call's arguments so far
    opened: bool = False            # the open body said something (the joining newline is out)
    said: dict = field(default_factory=lambda: {"reasoning": False, "content": False})
    calls: list[dict] = field(default_factory=list)
    thought: bool = False           # an analysis message was opened (reasoning_content is "" rather than None)
    closed: bool = False            # a message other than analysis opened: the reasoning is over

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that this delta makes certain."""
        out = {"reasoning": "", "content": ""}
        text = delta
        while text:
            if self.state == "header":
                text = self._read_header(text)
            else:
                text = self._read_body(self.held + text, out)
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str]:
        """The end of the output: a body's held text said, an open call kept; an open header dropped."""
        out = {"reasoning": "", "content": ""}
        if self.state == "body":
            held, self.held = self.held, ""
            self._say(held, out)
            self._close()
        self.state, self.header = "header", ""
        return out["reasoning"], out["content"]

    # ---- states --------------------------------------------------------------------------------------------
    def _read_header(self, text: str) -> str:
        """Take header text up to <|message|> (then open the body); returns what follows it."""
        seen = len(self.header)
        self.header += text
        i = self.header.find(MESSAGE, max(0, seen - len(MESSAGE) + 1))
        if i < 0:
            return ""
        rest, head = self.header[i + len(MESSAGE):], self.header[:i]
        for marker in (START, *CLOSERS):          # a message's header starts after the last of these
            j = head.rfind(marker)
            if j >= 0:
                head = head[j + len(marker):]
        self._open(Header.parse(head))
        return rest

    def _read_body(self, text: str, out: dict) -> str:
        """Say the body's text up to a marker (close the message there) or up to a tail that may start one."""
        self.held = ""
        hits = [(i, m) for i, m in ((text.find(m), m) for m in BODY_MARKERS) if i >= 0]
        if not hits:
            keep = max(_open_tail(text, m) for m in BODY_MARKERS)
            self._say(text[:len(text) - keep], out)
            self.held = text[len(text) - keep:]
            return ""
        i, marker = min(hits)
        self._say(text[:i], out)
        self._close()
        self.state, self.header = "header", ""
        # <|start|> opens the next header (dropped: the header is what follows it); <|channel|> without a
        # <|start|> before it is a header too, kept for its channel
        return text[i:] if marker == CHANNEL else text[i + len(marker):]

    def _open(self, h: Header) -> None:
        self.state, self.kind, self.opened = "body", h.kind, False
        if self.kind == "call":
            self.name, self.args = h.recipient.removeprefix("functions."), ""
        if self.kind == "reasoning":
            self.thought = True
        else:
            self.closed = True

    def _say(self, text: str, out: dict) -> None:
        if not text:
            return
        if self.kind == "call":
            self.args += text
            return
        if not self.opened and self.said[self.kind]:
            text = "\n" + text                     # a later message of the same kind
        self.opened = self.said[self.kind] = True
        out[self.kind] += text

    def _close(self) -> None:
        if self.kind == "call":
            self.calls.append(new_call(self.name, self.args.strip()))
        self.kind = ""


@dataclass
class Parsed:
    reasoning: str | None           # None: the output had no analysis message
    content: str
    calls: list[dict]


def parse(text: str) -> Parsed:
    """A whole output's parse (the stream's, fed at once)."""
    s = HarmonySplitter()
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return Parsed(r1 + r2 if s.thought else None, c1 + c2, s.calls)
