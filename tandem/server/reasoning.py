"""Reasoning parsers (vLLM's --reasoning-parser names): a thinking model's `<think> ... </think>` text goes to
`reasoning_content`, the rest to `content`, streaming-safe across token boundaries.

One state machine serves both the whole text (split) and a stream (ReasoningSplitter.feed / finish), so a stream's
pieces always add up to the non-streamed answer. Where the output starts:
- in reasoning when the rendered prompt ends with an open `<think>` (a template that opens the thinking, as
  DeepSeek-R1's and Qwen3 thinking models' do), or when the output itself begins with `<think>`;
- `deepseek_r1`: always in reasoning (the model thinks first; a missing `</think>` leaves everything reasoning);
- `qwen3`: otherwise in content (Qwen3 with enable_thinking false writes no tags: all of it is content).
Text after `</think>` is content, its leading newlines dropped. Tool calls are parsed from the content only.
"""
from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def _open_tail(prefix: str, tag: str) -> int:
    """Length of the longest end of `prefix` that is a proper start of `tag` (text to hold back)."""
    for n in range(min(len(tag) - 1, len(prefix)), 0, -1):
        if tag.startswith(prefix[-n:]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """One output's split. mode: "maybe" (the output may still open with <think>), "reasoning", "content"."""
    mode: str
    held: str = ""                  # text not yet said: a possible start of a tag
    content_started: bool = False   # leading newlines of the content are dropped until it starts
    opening: bool = False           # in reasoning from the start: a <think> the output still writes is dropped
    closed: bool = False            # the reasoning ended (</think> seen)

    @property
    def thought(self) -> bool:
        """Whether the output had a reasoning part (it started in one, or opened one)."""
        return self.closed or self.mode == "reasoning"

    @staticmethod
    def for_prompt(parser: str, prompt_text: str) -> "ReasoningSplitter":
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        opened = prompt_text.rstrip().endswith(START)
        if opened or parser == "deepseek_r1":
            return ReasoningSplitter("reasoning", opening=True)
        return ReasoningSplitter("maybe")

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that this delta makes certain."""
        text, self.held = self.held + delta, ""
        reasoning = content = ""
        while text:
            if self.mode == "maybe":
                body = text.lstrip()
                if body.startswith(START):
                    self.mode, text = "reasoning", body[len(START):]
                elif START.startswith(body):              # still possibly the tag (or only whitespace)
                    self.held = text
                    return reasoning, content
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                if self.opening:
                    body = text.lstrip()
                    if START.startswith(body) and body != START:      # maybe the tag (or blank so far): wait
                        self.held = text
                        return reasoning, content
                    self.opening = False
                    if body.startswith(START):
                        text = body[len(START):]
                end = text.find(END)
                if end >= 0:
                    reasoning += text[:end]
                    self.mode, self.closed, text = "content", True, text[end + len(END):]
                    continue
                keep = _open_tail(text, END)
                reasoning += text[:len(text) - keep]
                self.held = text[len(text) - keep:]
                return reasoning, content
            else:
                if not self.content_started:
                    text = text.lstrip("\n")
                    self.content_started = bool(text)
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, said at the end of the output."""
        held, self.held = self.held, ""
        if self.mode == "reasoning":
            return held, ""
        return "", held if self.content_started else held.lstrip("\n")


def split(parser: str, prompt_text: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    s = ReasoningSplitter.for_prompt(parser, prompt_text)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.thought else None), c1 + c2
