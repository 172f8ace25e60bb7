"""Structured output (the grammar branch): specs, compiling with llguidance, per-request matchers."""
from .compiler import GrammarCompiler, GrammarMatcher, mask_words
from .spec import StructuredOutputsParams

__all__ = ["GrammarCompiler", "GrammarMatcher", "StructuredOutputsParams", "mask_words"]
