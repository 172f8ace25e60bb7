"""Incremental detokenization: token ids in, valid UTF-8 text deltas out.

Decoding a window of recent tokens (not one token alone) keeps the spaces and merges that depend on the
previous token; a trailing U+FFFD means an incomplete multi-byte character, which is held back.
"""
from __future__ import annotations

_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-_CONTEXT:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is now certain."""
        out = []
        for tok in token_ids:
            self.ids.append(int(tok))
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                out.append(delta)
        delta = "".join(out)
        self.text += delta
        return delta


class StopStrings:
    """Finds stop strings across token boundaries in the detokenized output."""

    def __init__(self, detok: IncrementalDetokenizer, stops: list[str], include: bool = False) -> None:
        self.detok = detok
        self.stops = stops
        self.include = include              # keep the stop string in the text (include_stop_str_in_output)
        self.longest = max(len(s) for s in stops)

    def add(self, token_id: int) -> str | None:
        """Feed one token; return the text cut at the earliest stop string (before it, or after it with
        include), or None if none matched."""
        delta = self.detok.add([token_id])
        if not delta:
            return None
        text = self.detok.text
        start = max(0, len(text) - len(delta) - self.longest + 1)
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        i, stop = min(hits, key=lambda h: h[0])
        return text[:i + len(stop)] if self.include else text[:i]
