"""Compiling structured-output requests with llguidance, on the front side, with a cache.

A request's ``json_schema`` / ``regex`` / ``choice`` / ``grammar`` (or a forced tool call) is
compiled here, when the request is submitted: a bad schema, regex or grammar becomes an
:class:`~asyncllm.errors.InvalidRequestError` naming the field before anything reaches the engine.
The result is a :class:`GrammarTemplate` (a pristine matcher); the engine clones one matcher per
sequence from it, which costs microseconds, so a compiled grammar is shared by every request that
asks for the same thing. llguidance was chosen over xgrammar because its compile time does not
grow with the vocabulary (every tool call brings its own schema): see docs/tools.md for figures.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Callable, Iterable

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .grammar_engine import llguidance, require_grammar_engine
from .limits import check_lark, check_schema
from .schema import JSON_OPTIONS, choice_grammar, closed_objects, parse_schema
from .state import GrammarState, fill_bitmask, forbidden_mask

DEFAULT_CACHE_SIZE = 256


class GrammarTemplate:
    """A compiled grammar: a matcher that never advances; sequences get clones of it."""

    def __init__(self, matcher: "llguidance.LLMatcher", source: str) -> None:
        self._matcher = matcher
        self.source = source  # the llguidance grammar, for debugging and tests

    def new_state(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy())


class GrammarCompiler:
    """Compiles grammars for one tokenizer and model vocabulary; safe to use from any thread.

    ``vocab_size`` is the model's (it may exceed the tokenizer's, as Qwen pads it): masks cover
    every id the model can emit and forbid those the tokenizer does not define. EOS is allowed only
    where the grammar is complete; ``eos_token_ids`` are all the ids that end a sequence.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int] = (),
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[tuple[str, str], GrammarTemplate] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    def ll_tokenizer(self) -> "llguidance.LLTokenizer":
        """The tokenizer in llguidance's form, built on first use (tens of ms for a 16k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                eos = self.eos_token_ids or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=eos)
            return self._ll_tokenizer

    def compile_params(self, params: SamplingParams) -> GrammarTemplate | None:
        """The grammar that ``params`` ask for (json_schema, regex, choice or grammar), or None."""
        if params.json_schema is not None:
            schema = parse_schema(params.json_schema, "json_schema")
            check_schema(schema, "json_schema")  # before anything recursive, ours or the compiler's
            schema = closed_objects(schema)
            return self._compile("json_schema", json.dumps(schema, ensure_ascii=False), "json_schema",
                                 lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        if params.regex is not None:
            regex = params.regex
            return self._compile("regex", regex, "regex", lambda: llguidance.LLMatcher.grammar_from_regex(regex))
        if params.choice is not None:
            lark = choice_grammar(params.choice)
            return self._compile("lark", lark, "choice", lambda: llguidance.LLMatcher.grammar_from_lark(lark))
        if params.grammar is not None:
            return self.compile_lark(_to_lark(params.grammar), "grammar")
        return None

    def compile_lark(self, lark: str, field: str) -> GrammarTemplate:
        """A Lark grammar (llguidance's dialect: ``%json {...}`` embeds a JSON schema)."""
        check_lark(lark, field)
        return self._compile("lark", lark, field, lambda: llguidance.LLMatcher.grammar_from_lark(lark))

    def _compile(self, kind: str, source: str, field: str, build: Callable[[], str]) -> GrammarTemplate:
        require_grammar_engine(field)
        key = (kind, source)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template
        tokenizer = self.ll_tokenizer()
        try:
            grammar = build()
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{field}: {exc}", field=field) from None
        # llguidance compiles in the constructor (without the GIL) and reports errors, not raises
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{field}: {_first_line(matcher.get_error())}", field=field)
        if not self._can_start(matcher):
            raise InvalidRequestError(f"{field}: no output can satisfy it (the grammar admits nothing but "
                                      "the end of the text, and the empty text is not a match)", field=field)
        template = GrammarTemplate(matcher, grammar)
        with self._lock:
            self.misses += 1
            self._cache[key] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template


    def _can_start(self, matcher: "llguidance.LLMatcher") -> bool:
        """False for a grammar whose language is empty (``{"$ref": "#"}``, ``[^\\s\\S]``): it allows
        no token but EOS at the start without accepting the empty text, so generation would end at
        once with output that does not match. (Emptiness that shows only later cannot be seen here.)"""
        if matcher.is_accepting():
            return True
        bitmask = fill_bitmask([GrammarState(matcher)], self.vocab_size)  # reads the state, does not advance it
        allowed = ~forbidden_mask(bitmask, self.vocab_size)[0]
        allowed[self.eos_token_ids] = False
        return bool(allowed.any())


def _to_lark(grammar: str) -> str:
    """Lark (llguidance's dialect) as it is; GBNF (``root ::= ...``, llama.cpp's) converted."""
    require_grammar_engine("grammar")
    check_lark(grammar, "grammar")  # GBNF's `name ::=` reads as a rule too
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as exc:  # the converter raises plain exceptions for malformed GBNF
        raise InvalidRequestError(f"grammar: {exc}", field="grammar") from None


def _first_line(message: str) -> str:
    """llguidance's errors end with a source excerpt; the first lines say what is wrong."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "invalid grammar"
