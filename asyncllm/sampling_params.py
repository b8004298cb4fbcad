"""``SamplingParams``: how one request is decoded, validated at submission."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidRequestError, short_repr

_DECIMAL_KEY = re.compile(r"-?[0-9]{1,18}")  # a token id as a JSON object key (logit_bias)

_STRUCTURED_FIELDS = ("json_schema", "regex", "choice", "grammar")

# Temperatures below this are greedy: dividing logits by 1e-40 overflows to inf/NaN (vLLM uses the
# same threshold).
GREEDY_TEMPERATURE_EPS = 1e-5
# Seeds are 64-bit, signed or unsigned, as torch.Generator.manual_seed accepts them.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# n above this is refused (OpenAI's own bound); engines lower or raise it with ``max_n``.
DEFAULT_MAX_N = 128
# bad_words: how many, and how long each (tokenized at submission, checked every step)
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256
# stop strings: how many, and how long each (a stop string's length is text held back from the stream)
MAX_STOP_STRINGS = 4096
MAX_STOP_CHARS = 4096
# beam search: longest stop string (each step decodes a tail this long for every candidate)
MAX_BEAM_STOP_CHARS = 256


def _fail(name: str, message: str) -> None:
    raise InvalidRequestError(f"{name}: {message}", field=name)


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        _fail(name, f"expected {'an integer' if integer else 'a number'}, got {short_repr(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        _fail(name, f"must be a finite number, got {value!r}")


@dataclass
class SamplingParams:
    """Decoding parameters of one request; the fields follow vLLM's ``SamplingParams``.

    ``temperature=0`` means greedy. Every value is checked by :meth:`validate`, which raises
    :class:`~asyncllm.errors.InvalidRequestError` naming the bad field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    best_of: int | None = None           # sequences generated; the n best (cumulative logprob) returned
    use_beam_search: bool = False        # beam search with best_of (or n) beams (docs/decoding.md)
    length_penalty: float = 1.0          # beam search: hypothesis score = logprob sum / length**length_penalty
    early_stopping: bool | str = False   # beam search: True, False (transformers' heuristic) or "never"
    bad_words: list[str] | None = None   # words never generated (their last token is banned after the rest)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens

    @classmethod
    def from_kwargs(cls, params: "SamplingParams | None", kwargs: dict[str, Any]) -> "SamplingParams":
        """Merge keyword overrides into ``params`` (or defaults); unknown names are an error."""
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise InvalidRequestError(f"unknown sampling parameter {name!r}", field=name)
        base = {f.name: getattr(params, f.name) for f in fields(cls)} if params else {}
        base.update(kwargs)
        return cls(**base)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: ``best_of`` (beams or samples), else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that sampling would divide by (almost) zero."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self, vocab_size: int | None = None, max_n: int = DEFAULT_MAX_N) -> "SamplingParams":
        """Check every field against its whole range; return self so calls can be chained.

        ``vocab_size`` bounds token ids and ``top_k``; ``max_n`` bounds ``n``."""
        self._validate_counts(max_n)
        self._validate_probabilities(vocab_size)
        self._validate_penalties()
        self._validate_stops(vocab_size)
        self._validate_logit_bias(vocab_size)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"expected a boolean, got {getattr(self, name)!r}")
        self._validate_structured()
        self._validate_best_of(max_n)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                                          for w in self.bad_words):
                _fail("bad_words", "expected a list of non-empty strings")
            # every step checks each word against each sequence's output: both are bounded
            if len(self.bad_words) > MAX_BAD_WORDS:
                _fail("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            if any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                _fail("bad_words", f"each word may have at most {MAX_BAD_WORD_CHARS} characters")
            self.bad_words = list(self.bad_words)
        if self.truncate_prompt_tokens is not None:
            _check_number("truncate_prompt_tokens", self.truncate_prompt_tokens, integer=True)
            if self.truncate_prompt_tokens < 1:
                _fail("truncate_prompt_tokens", f"must be at least 1, got {self.truncate_prompt_tokens}")
        return self

    def _validate_counts(self, max_n: int) -> None:
        _check_number("n", self.n, integer=True)
        if not 1 <= self.n <= max_n:
            _fail("n", f"must be between 1 and {max_n}, got {self.n}")
        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 1:
                _fail("max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            _fail("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_number(name, value, integer=True)
                if not 0 <= value <= 20:
                    _fail(name, f"must be between 0 and 20, got {value}")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                _fail("seed", f"must fit in 64 bits ({SEED_MIN} to {SEED_MAX}), got {self.seed}")

    def _validate_probabilities(self, vocab_size: int | None) -> None:
        _check_number("temperature", self.temperature)
        if not 0 <= self.temperature <= 100:
            _fail("temperature", f"must be between 0 and 100, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            _fail("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            _fail("top_k", f"must not exceed the vocabulary size ({vocab_size}), got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:
                _fail(name, f"must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 10:
            _fail("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")

    def _validate_stops(self, vocab_size: int | None) -> None:
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                _fail("stop", "expected a non-empty string or a list of non-empty strings")
            if len(stops) > MAX_STOP_STRINGS:
                _fail("stop", f"{len(stops)} stop strings, more than the {MAX_STOP_STRINGS} allowed")
            longest = max(len(s) for s in stops) if stops else 0
            if longest > MAX_STOP_CHARS:
                _fail("stop", f"a stop string of {longest} characters, more than the {MAX_STOP_CHARS} allowed")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                _fail("stop_token_ids", "expected a list of token ids")
            for token in self.stop_token_ids:
                _check_token("stop_token_ids", token, vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", "expected a mapping of token id to bias")
        converted: dict[int, float] = {}
        for token, bias in self.logit_bias.items():
            # JSON keys are strings: "42" is token 42. Only short ASCII decimals are converted ("²" and
            # "٣" pass str.isdigit, and int() refuses 5,000 digits); anything else fails _check_token.
            token_id = int(token) if isinstance(token, str) and _DECIMAL_KEY.fullmatch(token) else token
            _check_token("logit_bias", token_id, vocab_size)
            _check_number("logit_bias", bias)
            if not -100 <= bias <= 100:
                _fail("logit_bias", f"bias for token {token_id} must be in [-100, 100], got {bias}")
            converted[token_id] = float(bias)
        self.logit_bias = converted

    def _validate_structured(self) -> None:
        """Types and exclusivity only: the grammar engine compiles (and rejects) the content."""
        given = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            _fail(given[1], f"only one of json_schema, regex, choice and grammar may be set (got {', '.join(given)})")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            _fail("json_schema", "expected a JSON schema (a dict or a JSON string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(name, "expected a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                _fail("choice", "expected a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    def _validate_best_of(self, max_n: int) -> None:
        if self.best_of is not None:
            _check_number("best_of", self.best_of, integer=True)
            if not self.n <= self.best_of <= max_n:
                _fail("best_of", f"must be between n ({self.n}) and {max_n}, got {self.best_of}")
        if not isinstance(self.use_beam_search, bool):
            _fail("use_beam_search", f"expected a boolean, got {self.use_beam_search!r}")
        _check_number("length_penalty", self.length_penalty)
        if not -10 <= self.length_penalty <= 10:
            _fail("length_penalty", f"must be in [-10, 10], got {self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            _fail("early_stopping", f'expected true, false or "never", got {short_repr(self.early_stopping)}')
        if self.use_beam_search:
            self._validate_beam_search()
        elif self.best_of is not None and self.best_of > self.n and self.greedy:
            _fail("best_of", "best_of > n needs sampling (temperature > 0) or use_beam_search: "
                             "greedy samples are all the same")

    def _validate_beam_search(self) -> None:
        """Beam search ranks by the model's own log-probabilities (as transformers' generate with
        num_beams and do_sample=False): logits processors that would change them are refused."""
        refused = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
        for name, neutral in refused.items():
            if getattr(self, name) != neutral:
                _fail(name, "not supported with use_beam_search")
        if self.logit_bias:
            _fail("logit_bias", "not supported with use_beam_search")
        if self.bad_words:
            _fail("bad_words", "not supported with use_beam_search")
        if self.structured:
            name = next(n for n in _STRUCTURED_FIELDS if getattr(self, n) is not None)
            _fail(name, "structured output is not supported with use_beam_search")
        if self.prompt_logprobs is not None:
            _fail("prompt_logprobs", "not supported with use_beam_search")
        # every beam step checks each candidate's text against the stop strings: bound their length
        if any(len(stop) > MAX_BEAM_STOP_CHARS for stop in self.stop_strings):
            _fail("stop", f"with use_beam_search, stop strings may have at most {MAX_BEAM_STOP_CHARS} characters")

    @property
    def beam_width(self) -> int:
        """Beam search: the number of beams (``best_of``, else ``n``)."""
        return self.num_sequences

    @property
    def structured(self) -> bool:
        """True when the output is constrained (json_schema, regex, choice or grammar)."""
        return any(getattr(self, name) is not None for name in _STRUCTURED_FIELDS)


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s parameters (vLLM's names): ``beam_width`` beams, up to ``max_tokens``
    new tokens each. The search ranks by the model's log-probabilities (``temperature`` must be 0)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        """The equivalent request: ``best_of = n = beam_width`` with ``use_beam_search``."""
        if self.temperature != 0:
            _fail("temperature", "beam search ranks by the model's log-probabilities: temperature must be 0")
        _check_number("beam_width", self.beam_width, integer=True)
        if self.beam_width < 1:
            _fail("beam_width", f"must be at least 1, got {self.beam_width}")
        return SamplingParams(n=self.beam_width, best_of=self.beam_width, use_beam_search=True, temperature=0.0,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, logprobs=0,
                              length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                              include_stop_str_in_output=self.include_stop_str_in_output)


def _check_token(name: str, token: Any, vocab_size: int | None) -> None:
    _check_number(name, token, integer=True)
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        _fail(name, f"token id {token} is outside the vocabulary (size {vocab_size})")
