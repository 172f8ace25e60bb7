"""What a request constrains its output to: vLLM's StructuredOutputsParams (one of json, regex, choice,
grammar, json_object), turned into the grammar text llguidance compiles.

llguidance was chosen over xgrammar by install weight and fit for CPU: it is one wheel with no dependencies
(xgrammar pulls in triton, ~1 GB on Linux x86_64 and useless on CPU), builds its tokenizer view in ~0.5 s,
makes a matcher for a JSON schema in ~1 ms and a token mask over SmolLM2's 49k vocabulary in a few ms
(measured here; docs/serving.md), and takes JSON schemas, regexes and Lark (GBNF converted) natively.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): `json` a JSON schema (dict or its text), `regex`, `choice` a
    list of strings, `grammar` a Lark (or GBNF, with `::=`) grammar, `json_object` any JSON object."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_) or 'none'}")
        kind = set_[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        elif kind in ("regex", "grammar"):
            if not isinstance(getattr(self, kind), str) or not getattr(self, kind):
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The compile-cache key: the kind and the canonical text of its source."""
        value = getattr(self, self.kind)
        return self.kind + ":" + (json.dumps(value, sort_keys=True) if not isinstance(value, str) else value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def coerce(cls, value: "StructuredOutputsParams | dict | None") -> "StructuredOutputsParams | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**value)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet validated: GrammarCompiler does that)."""
    from llguidance import LLMatcher, gbnf_to_lark
    kind = spec.kind
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(spec.json, defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    text = spec.grammar
    return LLMatcher.grammar_from_lark(gbnf_to_lark(text) if "::=" in text else text)
