"""Compiling structured-output requests with llguidance, on the front side, with a cache.

A request's ``json_schema`` / ``regex`` / ``choice`` / ``grammar`` (or a forced tool call) is
compiled here, when the request is submitted: a bad schema, regex or grammar becomes an
:class:`~asyncllm.errors.InvalidRequestError` naming the field before anything reaches the engine.
The result is a :class:`GrammarTemplate` (a pristine matcher); the engine clones one matcher per
sequence from it, which costs microseconds, so a compiled grammar is shared by every request that
asks for the same thing. llguidance was chosen over xgrammar because its compile time does not
grow with the vocabulary (every tool call brings its own schema): see docs/tools.md for figures.

The grammar engine is native code: limits.py refuses the sources known to crash it, and on every
cache miss the same compile runs first in a child process (compile_guard.py), so an unknown crash
or a runaway compile is one request's 400 and the host compiles only what compiled there.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Iterable

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .compile_child import compile_grammar
from .compile_guard import CompileGuard, guard_enabled, tokenizer_json
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
        self.worn = False     # a clone failed (see GrammarState.failed): compile afresh, do not reuse

    def new_state(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and model vocabulary; safe to use from any thread.

    ``vocab_size`` is the model's (it may exceed the tokenizer's, as Qwen pads it): masks cover
    every id the model can emit and forbid those the tokenizer does not define. EOS is allowed only
    where the grammar is complete; ``eos_token_ids`` are all the ids that end a sequence.
    ``guard``: compile each new grammar in a child process first (compile_guard.py); None follows
    ``ASYNCLLM_GRAMMAR_GUARD`` (on unless 0). ``guard_time_limit``: seconds a child may compile.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int] = (),
                 cache_size: int = DEFAULT_CACHE_SIZE, guard: bool | None = None,
                 guard_time_limit: float | None = None) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[tuple[str, str], GrammarTemplate] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._tokenizer_json: str | None = None
        self._use_guard = guard_enabled() if guard is None else guard
        self._guard_time_limit = guard_time_limit
        self._guard: CompileGuard | None = None

    def ll_tokenizer(self) -> "llguidance.LLTokenizer":
        """The tokenizer in llguidance's form, built on first use (tens of ms for a 16k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._tokenizer_json = tokenizer_json(self.hf_tokenizer)  # the guard's children build theirs from it
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                            eos_token=self._eos())
            return self._ll_tokenizer

    def guard(self) -> CompileGuard | None:
        """The compile guard, made on first use (its children start on its first job); None if off."""
        if not self._use_guard:
            return None
        self.ll_tokenizer()
        with self._lock:
            if self._guard is None:
                kwargs = {} if self._guard_time_limit is None else {"time_limit": self._guard_time_limit}
                self._guard = CompileGuard(self._tokenizer_json, self.vocab_size, self._eos(), **kwargs)
                weakref.finalize(self, self._guard.close)  # a compiler dropped without close(): no orphans
            return self._guard

    def close(self) -> None:
        """Stop the guard's children (they also end with this process); compiling later starts new ones."""
        with self._lock:
            guard, self._guard = self._guard, None
        if guard is not None:
            guard.close()

    def _eos(self) -> list[int] | int | None:
        return self.eos_token_ids or getattr(self.hf_tokenizer, "eos_token_id", None)

    def compile_params(self, params: SamplingParams) -> GrammarTemplate | None:
        """The grammar that ``params`` ask for (json_schema, regex, choice or grammar), or None."""
        if params.json_schema is not None:
            schema = parse_schema(params.json_schema, "json_schema")
            check_schema(schema, "json_schema")  # before anything recursive, ours or the compiler's
            source = json.dumps(closed_objects(schema), ensure_ascii=False)
            return self._compile("json_schema", source, "json_schema", (source, JSON_OPTIONS))
        if params.regex is not None:
            return self._compile("regex", params.regex, "regex", (params.regex,))
        if params.choice is not None:
            lark = choice_grammar(params.choice)
            return self._compile("lark", lark, "choice", (lark,))
        if params.grammar is not None:
            return self.compile_lark(_to_lark(params.grammar), "grammar")
        return None

    def compile_lark(self, lark: str, field: str) -> GrammarTemplate:
        """A Lark grammar (llguidance's dialect: ``%json {...}`` embeds a JSON schema)."""
        check_lark(lark, field)
        return self._compile("lark", lark, field, (lark,))

    def _compile(self, kind: str, source: str, field: str, args: tuple) -> GrammarTemplate:
        """The cached template of ``(kind, source)``; on a miss, ``compile_child.compile_grammar(kind,
        args)``: in a guard child first (a crash or overrun there is this request's 400), then here."""
        require_grammar_engine(field)
        key = (kind, source)
        with self._lock:
            template = self._cache.get(key)
            if template is not None and template.worn:  # one request wore its shared lexer out
                del self._cache[key]
                template = None
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template
        tokenizer = self.ll_tokenizer()
        guard = self.guard()
        if guard is not None:
            guard.check(kind, args, field)  # returns once the same compile succeeded in a child
        matcher, grammar, error = compile_grammar(tokenizer, kind, args)
        if matcher is None:
            raise InvalidRequestError(f"{field}: {error}", field=field)
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
