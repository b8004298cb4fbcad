"""Structured output: grammars compiled with llguidance, token bitmasks applied in the sampler.

``GrammarCompiler`` (front side) turns a request's json_schema / regex / choice / grammar, or a
forced tool call, into a cached :class:`GrammarTemplate`; the engine gives each sequence its own
:class:`GrammarState` and the sampler masks the logits of constrained rows only.
"""

from .compiler import GrammarCompiler, GrammarTemplate
from .state import GrammarState, apply_grammar_masks, grammar_bitmask, prefetch_masks

__all__ = ["GrammarCompiler", "GrammarTemplate", "GrammarState", "apply_grammar_masks", "grammar_bitmask",
           "prefetch_masks"]
