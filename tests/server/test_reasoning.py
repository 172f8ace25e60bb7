"""Reasoning parsers (tandem/server/reasoning.py, --reasoning-parser): <think> text into reasoning_content.

The splitter on scripted outputs fed in every two pieces and one character at a time gives the whole text's
split (tags cut across pieces, whitespace before the tag, a prompt that opens the thinking, a missing end, a
lookalike tag); through `tandem serve` with the openai client, a stream's reasoning and content deltas add up
to the non-streamed message."""
from __future__ import annotations

import pytest

from tandem.server.reasoning import ReasoningSplitter, split

CASES = [
    ("qwen3", "user: hi", "<think>let me see\nok</think>\n\nThe answer.", ("let me see\nok", "The answer.")),
    ("qwen3", "user: hi", "  <think>a</think>b", ("a", "b")),
    ("qwen3", "user: hi", "Plain answer, no thinking.", (None, "Plain answer, no thinking.")),
    ("qwen3", "user: hi", "<thinking> is not the tag", (None, "<thinking> is not the tag")),
    ("qwen3", "assistant:\n<think>\n", "reasons</think>\nAnswer", ("reasons", "Answer")),
    ("qwen3", "user: hi", "<think>cut off by max_tokens </thi", ("cut off by max_tokens </thi", "")),
    ("qwen3", "user: hi", "<thi", (None, "<thi")),
    ("deepseek_r1", "user: hi", "thinking without an end", ("thinking without an end", "")),
    ("deepseek_r1", "user: hi", "<think>x</think>y</think>z", ("x", "y</think>z")),
    ("deepseek_r1", "user: hi", "a</think>\n\n\nb\n", ("a", "b\n")),
    ("deepseek_r1", "user: hi", "\n <think>r</think>c", ("r", "c")),
]


def _streamed(parser, prompt, pieces):
    s = ReasoningSplitter.for_prompt(parser, prompt)
    r = c = ""
    for p in pieces:
        dr, dc = s.feed(p)
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    return (r + dr if s.thought else None), c + dc


@pytest.mark.parametrize("parser,prompt,text,want", CASES)
def test_whole_and_every_cut_agree(parser, prompt, text, want):
    assert split(parser, prompt, text) == want
    assert _streamed(parser, prompt, list(text)) == want
    for i in range(len(text) + 1):
        assert _streamed(parser, prompt, [text[:i], text[i:]]) == want, i


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningSplitter.for_prompt("o1", "")


def test_server_splits_alike_streamed_and_not(tiny_llama, tmp_path):
    """deepseek_r1 on the tiny model (it never writes </think>): every output token is reasoning, content empty,
    the stream's reasoning deltas the non-streamed reasoning_content; qwen3's absent tags leave plain content."""
    from tests.helpers.server_utils import ServerProcess
    srv = ServerProcess(["--model", tiny_llama, "--served-model-name", "tiny", "--device-threads", "1",
                         "--reasoning-parser", "deepseek_r1"], str(tmp_path / "server.log"))
    client = srv.openai_client(timeout=60)
    try:
        msgs = [{"role": "user", "content": "think about it"}]
        whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
        m = whole.choices[0].message
        assert m.reasoning_content and not m.content
        reasoning = content = ""
        for chunk in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                    stream=True):
            if chunk.choices:
                d = chunk.choices[0].delta
                reasoning += getattr(d, "reasoning_content", None) or ""
                content += d.content or ""
        assert (reasoning, content) == (m.reasoning_content, "")
    finally:
        client.close()
        assert srv.stop() == 0, srv.log()
