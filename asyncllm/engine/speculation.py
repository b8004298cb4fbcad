"""Speculative decoding: proposals, their verification rule, back-off and counters.

A sequence that decodes may carry ``draft_tokens`` proposed for the positions after its last
token. The scheduler then gives it ``1 + len(draft_tokens)`` tokens in one step (its last token and
the drafts: a multi-token decode through the paged attention), and the model returns logits for
every one of those positions. Row ``j`` is sampled as usual, with the drafts before it counted as
generated (penalties, grammar, min_tokens see them); draft ``j`` is accepted while the row's pick
equals it, and the first pick that differs (or the pick after the last draft) is the step's last
token. Each step therefore yields between 1 and ``1 + k`` tokens.

The drafts here are deterministic (a copy from earlier text, or a draft model's greedy choice), so
"sample row j, accept iff the sample equals the draft" is exactly rejection sampling with a one-hot
proposal: the draft is kept with probability p(draft), and on rejection the emitted token follows
p restricted to the other tokens. Greedy output is unchanged token for token and sampled output
keeps its distribution (tests/test_speculative.py).

KV entries written for rejected drafts lie past the sequence's computed length: they are never
read (attention stops at the computed length), never offered to the prefix cache (only full,
computed blocks are), and the next step overwrites them.

How many drafts a sequence asks for follows its acceptance so far (``plan_drafts``): the length
that maximises the expected tokens per unit of step time, none when no draft pays (then a single
probe now and then).
"""

from __future__ import annotations

import array
import json
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

METHODS = ("ngram", "draft_model")
# What one more draft row adds to a verification step, relative to a one-token decode step. Measured on
# the CPU decode stack (SmolLM2-135M float32: 5 rows 43.8 ms, 1 row 24.7 ms: 0.19 per row); the draft
# length is chosen against it (draft_length).
DRAFT_ROW_COST = 0.2
# Evidence about a sequence's acceptance decays by this factor per verification, so a sequence that
# stops (or starts) repeating itself is noticed within a few steps.
ACCEPTANCE_DECAY = 0.8
# A sequence for which no draft pays (acceptance too low) still tries one draft now and then, after
# waiting 1, 2, 4, ... up to MAX_COOLDOWN steps, so that text which starts repeating is noticed.
FIRST_COOLDOWN = 1
MAX_COOLDOWN = 32


@dataclass
class SpeculativeConfig:
    """``speculative_config``: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": m, "prompt_lookup_min": 1}`` or ``{"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k}``."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From the engine argument (a dict, a JSON string, or None); ConfigError names a bad key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config: expected a mapping such as "
                              '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        method = value.get("method", "ngram" if "model" not in value else "draft_model")
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        lookup_max = value.get("prompt_lookup_max", 4)
        default_min = min(2, lookup_max) if isinstance(lookup_max, int) else 2
        config = cls(method=method, num_speculative_tokens=value.get("num_speculative_tokens", 4),
                     prompt_lookup_max=lookup_max, prompt_lookup_min=value.get("prompt_lookup_min", default_min),
                     model=value.get("model"))
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            number = getattr(self, name)
            if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 64:
                raise ConfigError(f"speculative_config.{name} must be an integer in [1, 64], got {number!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("speculative_config.prompt_lookup_min must not exceed prompt_lookup_max")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ConfigError("speculative_config.model: the draft model's path is required with draft_model")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError("speculative_config.model: only used with method 'draft_model'")


class Proposer:
    """Makes draft tokens for decoding sequences (``propose`` one at a time, or ``propose_many``)."""

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        raise NotImplementedError

    def propose_many(self, items: list[tuple[Any, int]]) -> list[list[int]]:
        """Drafts for each (sequence, at most this many tokens)."""
        return [self.propose(seq.token_ids, limit) for seq, limit in items]

    def reset(self) -> None:
        """Forget per-sequence state (the engine was reset)."""


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    ``n`` tokens (longest ``n`` first, from ``prompt_lookup_max`` down to ``prompt_lookup_min``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """At most ``min(k, limit)`` draft tokens for what follows ``token_ids`` (may be none)."""
        limit = min(self.k, limit)
        if limit <= 0 or len(token_ids) <= self.min_n:
            return []
        # bytes.rfind runs the search in C; 4-byte items, so a hit must also be item-aligned
        data = array.array("i", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            pattern = data[-4 * n:]
            end = len(data) - 4  # the suffix itself is not an earlier occurrence
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return token_ids[start:start + limit]
                end = at + 4 * n - 1
        return []


@dataclass
class SpeculationStats:
    """Counters of ``stats()`` and /metrics: drafts proposed and accepted, verification steps."""

    num_drafts: int = 0            # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0      # draft tokens proposed (and verified)
    num_accepted_tokens: int = 0   # of which accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: 1 + accepted drafts per step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def record_outcome(seq, num_proposed: int, num_accepted: int) -> None:
    """Fold one verification into the sequence's acceptance evidence: ``num_accepted`` drafts kept,
    and one rejection unless every draft was kept."""
    seq.spec_hits = seq.spec_hits * ACCEPTANCE_DECAY + num_accepted
    seq.spec_misses = seq.spec_misses * ACCEPTANCE_DECAY + (1 if num_accepted < num_proposed else 0)


def acceptance_rate(seq) -> float:
    """The chance that the sequence's next draft token is accepted given the ones before it were
    (Laplace-smoothed: 0.5 before any evidence)."""
    return (seq.spec_hits + 1) / (seq.spec_hits + seq.spec_misses + 2)


def draft_length(rate: float, k: int, row_cost: float = DRAFT_ROW_COST) -> int:
    """How many drafts (0 to ``k``) maximise the expected tokens per unit of step time:
    (1 + a + ... + a^d) / (1 + row_cost * d) for per-token acceptance ``a`` (0: none pays)."""
    best, best_gain = 0, 1.0
    expected, power = 1.0, 1.0
    for d in range(1, k + 1):
        power *= rate
        expected += power
        gain = expected / (1 + row_cost * d)
        if gain > best_gain:
            best, best_gain = d, gain
    return best


def plan_drafts(seq, k: int) -> int:
    """The number of drafts to ask for this step: what pays given the sequence's acceptance, or a
    single probe after a back-off wait when none does (0 while waiting)."""
    if seq.spec_wait > 0:
        seq.spec_wait -= 1
        return 0
    length = draft_length(acceptance_rate(seq), k)
    if length > 0:
        seq.spec_cooldown = 0
        return length
    seq.spec_cooldown = min(max(2 * seq.spec_cooldown, FIRST_COOLDOWN), MAX_COOLDOWN)
    seq.spec_wait = seq.spec_cooldown
    return 1


def grammar_states_along(state, drafts: list[int]) -> tuple[list[int], list]:
    """The drafts a constrained sequence's grammar allows (the longest allowed prefix), and the
    grammar state after each of them: the masks of the verification rows behind the drafts."""
    states = []
    current = state
    for token in drafts:
        following = current.fork()
        if following.matcher.is_stopped() or not following.accept(token):
            break
        states.append(following)
        current = following
    return drafts[:len(states)], states
