"""The harmony parser (tandem/server/harmony.py, --reasoning-parser gpt-oss): gpt-oss's channels into reasoning,
content and tool calls. Each output is parsed whole, then fed in two pieces cut at every character (inside the
special tokens' text too) and one character at a time: the pieces always add up to the whole parse."""
from __future__ import annotations

import json

import pytest

from tandem.server.harmony import Header, HarmonySplitter, parse, special_ids, speaks_harmony

A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
CASES = [
    # reasoning, then the answer
    (A + "Think first.<|end|><|start|>assistant<|channel|>final<|message|>The answer.<|return|>",
     ("Think first.", "The answer.", [])),
    # a call, the recipient after the channel (<|constrain|>json stuck to it)
    (A + "Need a tool." + NEXT + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Paris"}<|call|>', ("Need a tool.", "", [("get_weather", '{"city": "Paris"}')])),
    (A + "x" + NEXT + '<|channel|>commentary to=functions.f<|constrain|>json<|message|> {"a": 1}\n<|call|>',
     ("x", "", [("f", '{"a": 1}')])),
    # the recipient before the channel, after a preamble to the user (commentary without a recipient)
    (A + "Plan." + NEXT + "<|channel|>commentary<|message|>Let me check." + NEXT + " to=functions.get_time"
     '<|channel|>commentary json<|message|>{"zone": "cet"}<|call|>',
     ("Plan.", "Let me check.", [("get_time", '{"zone": "cet"}')])),
    # several analysis messages, and two calls: bodies of one kind joined by a newline
    (A + "one" + NEXT + A + "two" + NEXT + "<|channel|>final<|message|>done<|return|>", ("one\ntwo", "done", [])),
    (A + "r" + NEXT + " to=functions.a<|channel|>commentary json<|message|>{}<|call|><|start|>assistant to="
     "functions.b<|channel|>commentary json<|message|>{}<|call|>", ("r", "", [("a", "{}"), ("b", "{}")])),
    # no reasoning at all; a final channel without <|start|> before it
    ("<|channel|>final<|message|>Just this.<|return|>", (None, "Just this.", [])),
    (A + "r<|end|><|channel|>final<|message|>a", ("r", "a", [])),
    # text that looks like a marker is text
    ("<|channel|>final<|message|>a <| b <|end c<|return|>", (None, "a <| b <|end c", [])),
    # cut by max_tokens: in the reasoning, in a header (dropped), in a call's arguments (kept as written)
    (A + "still thinking", ("still thinking", "", [])),
    (A + "r" + NEXT + "<|channel|>fin", ("r", "", [])),
    (A + "r" + NEXT + '<|channel|>commentary to=functions.f json<|message|>{"a": ', ("r", "", [("f", '{"a":')])),
    ("", (None, "", [])),
]


def _streamed(pieces: list[str]) -> tuple:
    s = HarmonySplitter()
    r = c = ""
    for p in pieces:
        dr, dc = s.feed(p)
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    return (r + dr if s.thought else None), c + dc, [(x["function"]["name"], x["function"]["arguments"])
                                                     for x in s.calls]


@pytest.mark.parametrize("text,want", CASES)
def test_whole_and_every_cut_agree(text, want):
    p = parse(text)
    assert (p.reasoning, p.content, [(x["function"]["name"], x["function"]["arguments"]) for x in p.calls]) == want
    assert all(x["id"].startswith("call_") and x["type"] == "function" for x in p.calls)
    assert _streamed(list(text)) == want
    for i in range(len(text) + 1):
        assert _streamed([text[:i], text[i:]]) == want, i


def test_reasoning_is_said_as_it_comes():
    """A stream says the body's text at once, holding back only a tail that may start a marker."""
    s = HarmonySplitter()
    assert s.feed(A + "abc") == ("abc", "")
    assert s.feed(" d<|") == (" d", "")
    assert s.feed("x <|e") == ("<|x ", "")
    assert s.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")
    assert (s.thought, s.closed) == (True, True)
    assert json.loads(parse(A + NEXT + ' to=functions.f<|channel|>commentary<|message|>{"x": [1]}<|call|>')
                      .calls[0]["function"]["arguments"]) == {"x": [1]}


def test_header_fields():
    assert Header.parse("assistant<|channel|>commentary to=functions.f <|constrain|>json") == \
        Header("commentary", "functions.f")
    assert Header.parse("assistant to=functions.g<|channel|>commentary json").kind == "call"
    assert Header.parse("assistant<|channel|>analysis").kind == "reasoning"
    assert Header.parse("assistant<|channel|>commentary").kind == "content"


def test_special_tokens_are_looked_up_in_the_tokenizer():
    from tests.helpers.tiny_harmony import harmony_tokenizer
    from tests.helpers.tiny_models import smollm2_tokenizer
    plain = smollm2_tokenizer()
    tok = harmony_tokenizer(plain)
    ids = special_ids(tok)
    assert ids["<|call|>"] == tok.convert_tokens_to_ids("<|call|>") and len(set(ids.values())) == 7
    assert speaks_harmony(tok) and not speaks_harmony(plain)
    with pytest.raises(ValueError, match="lacks <\\|start\\|>"):
        special_ids(plain)


def test_the_grammar_starts_after_the_final_channels_header():
    """A structured output's gate on a harmony output (Generation.reasoning_gate: the ids of
    `<|channel|>final<|message|>`, tandem/grammar/after_reasoning.py): analysis and commentary are free, the
    matcher sees the final channel's body from its first token."""
    import numpy as np
    from tandem.grammar.after_reasoning import AfterReasoning
    from tandem.server.harmony import FINAL_HEADER
    from tests.helpers.tiny_harmony import SCRIPTS, harmony_tokenizer
    from tests.helpers.tiny_models import smollm2_tokenizer

    class Seen:
        def __init__(self):
            self.ids, self.done, self.error = [], False, ""

        def accept(self, t):
            self.ids.append(t)
            return True

        def fill_mask(self, row):
            row.fill(0)

    tok = harmony_tokenizer(smollm2_tokenizer())
    encode = lambda s: tok.encode(s, add_special_tokens=False)     # noqa: E731
    m = Seen()
    gate = AfterReasoning(m, encode(FINAL_HEADER))
    row = np.zeros(4, dtype=np.int32)
    for t in encode(SCRIPTS["json"]):
        gate.fill_mask(row)
        assert (row == (-1 if gate.state == "reasoning" else 0)).all()
        assert gate.accept(t)
    assert tok.decode(m.ids, skip_special_tokens=False) == '{"answer": 42}<|return|>'
