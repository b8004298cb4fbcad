"""Result objects handed to applications."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tools.calls import ToolCall


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them per request)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # None, "stop", "length", "abort" or "tool_calls"
    stop_reason: str | int | None = None
    # with tools: the calls parsed out of the output (``text`` is then the content around them);
    # in a streamed delta, the new fragments (see asyncllm.tools.ToolCall)
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()``) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """What a request produced so far (or in total, once ``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None  # an embedding request's vector (``embed``), else None


@dataclass
class BeamSearchSequence:
    """One hypothesis of ``LLM.beam_search``: prompt and generated tokens, and their text."""

    tokens: list[int]            # prompt + generated (the end token included when the beam ended on it)
    logprobs: list[float]        # of each generated token
    cum_logprob: float           # their sum
    text: str                    # the generated text
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class BeamSearchOutput:
    """``LLM.beam_search``'s result for one prompt: its ``beam_width`` hypotheses, best first."""

    sequences: list[BeamSearchSequence]
