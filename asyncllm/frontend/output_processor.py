"""Assembles engine deltas into RequestOutputs: detokenizes, applies stop strings, tracks timing.

Runs outside the engine step (in the caller's thread for ``LLM``, on the event-loop side for
``AsyncLLM``). A stop string found here finishes the sequence and tells the engine to drop it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine.core import SequenceOutput
from ..engine.request import EngineRequest
from ..errors import RequestFailedError
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from ..structured.state import generation_error
from ..tools import ToolCall, ToolParser, compact_fragments, parser_class
from .detokenizer import NO_TEXT, IncrementalDetokenizer, StopStringMatcher

logger = logging.getLogger(__name__)


@dataclass
class _ToolStream:
    """A sequence's tool-call parsing: raw text in, content and call fragments out.

    The parser is fed only text that no stop string can still remove (stop strings are matched
    on the raw text first), so nothing it hands out is ever taken back.
    """

    parser: ToolParser
    marker_ids: dict[int, str]  # special tokens the format needs as text (the detokenizer skips them)
    raw: str = ""
    fed: int = 0
    pending: list[ToolCall] = field(default_factory=list)  # fragments not yet handed out


@dataclass
class _SequenceState:
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    sent_chars: int = 0     # text already handed out as deltas
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False
    tools: _ToolStream | None = None


@dataclass
class RequestState:
    """Everything the front knows about one request while it runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    finished: bool = False
    serial: int = 0
    error: BaseException | None = None  # processing this request's output failed: it ends with this
    # best_of > n (sampling): all best_of sequences are tracked, none is shown until every one has
    # finished; then the n with the highest cumulative log-probability, renumbered 0..n-1
    choose_best: bool = False
    _chosen: list[_SequenceState] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, once computed

    def visible(self) -> list[_SequenceState]:
        """The sequences the caller sees: all of them, or with best_of, the chosen n once done."""
        if not self.choose_best:
            return self.seqs
        if not all(s.completion.finished for s in self.seqs):
            return []
        if self._chosen is None:
            ranked = sorted(self.seqs, key=lambda s: s.completion.cumulative_logprob, reverse=True)
            self._chosen = ranked[:self.params.n]
            for i, s in enumerate(self._chosen):
                s.completion.index = i
        return self._chosen

    def output(self) -> RequestOutput:
        """The cumulative output so far."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.completion for s in self.visible()], self.finished, self.prompt_logprobs,
                             self.metrics, self.embedding)

    def take_delta(self) -> RequestOutput:
        """Only what is new since the last call: text safe to show (stop strings held back)."""
        outputs = []
        for s in self.visible():
            c = s.completion
            end = len(c.text) if c.finished or s.tools else max(s.sent_chars, len(c.text) - s.stops.hold_back)
            finish = c.finish_reason if not s.sent_finish else None  # reported once, with its last text
            delta = CompletionOutput(
                c.index, c.text[s.sent_chars:end], c.token_ids[s.sent_tokens:],
                c.logprobs[s.sent_logprobs:] if c.logprobs is not None else None,
                c.cumulative_logprob, finish, c.stop_reason if finish else None, _take_calls(s))
            s.sent_chars, s.sent_tokens, s.sent_finish = end, len(c.token_ids), c.finished
            s.sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
            outputs.append(delta)
        prompt_lps = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent and self._prompt_logprobs_done():
            prompt_lps, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             prompt_lps, self.metrics, self.embedding)

    def _prompt_logprobs_done(self) -> bool:
        return len(self.prompt_logprobs) >= len(self.prompt_token_ids)


def _num_tracked(params: SamplingParams) -> int:
    """Sequences the front follows: beam search reports its n best beams only when it ends; best_of
    sampling reports each of its best_of sequences, and the front picks the n best."""
    return params.n if params.use_beam_search else params.num_sequences


def _take_calls(seq: _SequenceState) -> list[ToolCall] | None:
    if seq.tools is None or not seq.tools.pending:
        return None
    fragments, seq.tools.pending = compact_fragments(seq.tools.pending), []
    return fragments


class OutputProcessor:
    """Keeps a RequestState per live request and folds engine outputs into them."""

    def __init__(self, tokenizer, stop_sequence: Callable[[str, int], None],
                 abort: Callable[[str], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_sequence = stop_sequence  # tells the engine a sequence hit a stop string
        self.abort = abort                  # tells the engine to drop a request whose processing failed
        self.requests: dict[str, RequestState] = {}
        self._marker_ids: dict[type, dict[int, str]] = {}

    def add(self, request: EngineRequest, prompt: str | None) -> RequestState:
        """Start tracking ``request`` (``prompt`` is its text, if it had one)."""
        params, prompt_ids = request.params, request.prompt_token_ids
        seqs = [_SequenceState(
            CompletionOutput(i, logprobs=[] if params.logprobs is not None else None, cumulative_logprob=0.0),
            (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
             if self.tokenizer is not None else NO_TEXT),
            StopStringMatcher(params.stop_strings, params.include_stop_str_in_output)) for i in range(_num_tracked(params))]
        tools = getattr(request, "tool_context", None)
        if tools is not None and tools.parses_calls:
            fmt = parser_class(tools.parser)
            for seq in seqs:
                seq.tools = _ToolStream(fmt(), self._markers(fmt))
        state = RequestState(request.request_id, prompt, prompt_ids, params, seqs,
                             RequestMetrics(request.arrival_time),
                             [None] if params.prompt_logprobs is not None else None, serial=request.serial,
                             choose_best=not params.use_beam_search and params.num_sequences > params.n)
        self.requests[request.request_id] = state
        return state

    def process(self, outputs: list[SequenceOutput]) -> list[RequestState]:
        """Apply one step's outputs; return the requests that changed (finished ones are dropped)."""
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None or (out.serial and state.serial and out.serial != state.serial):
                continue  # a finished request whose id was reused: its late outputs are not the new one's
            if state.error is None and out.index < len(state.seqs):  # (a beam request reports n of its beams)
                try:
                    self._apply(state, state.seqs[out.index], out, now)
                except Exception as exc:  # noqa: BLE001 - one request's failure must not reach the others
                    self._fail(state, exc)
            touched[out.request_id] = state
        for request_id, state in touched.items():
            if state.error is not None or all(s.completion.finished for s in state.seqs):
                state.finished = True
                state.metrics.finish_time = now
                del self.requests[request_id]
        return list(touched.values())

    def _fail(self, state: RequestState, exc: Exception) -> None:
        """End one request with a RequestFailedError (its stream raises it) and drop it in the engine."""
        logger.exception("request %s: processing its output failed", state.request_id)
        error = RequestFailedError(f"request {state.request_id}: processing its output failed ({type(exc).__name__})")
        error.__cause__ = exc
        state.error = error
        if self.abort is not None:
            self.abort(state.request_id)

    def _apply(self, state: RequestState, seq: _SequenceState, out: SequenceOutput, now: float) -> None:
        if out.finish_reason == "error":  # the grammar engine gave up (structured/state.py): a 400, no text
            state.error = generation_error(state.params, str(out.stop_reason))
            if self.abort is not None:
                self.abort(state.request_id)  # (its other sequences, with n > 1)
            return
        if out.embedding is not None:
            state.embedding = out.embedding
        if out.prompt_logprobs:
            state.prompt_logprobs.extend(out.prompt_logprobs)
        completion = seq.completion
        if completion.finished:  # already stopped by a stop string; the engine may lag a step
            return
        if out.new_token_ids and state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.num_cached_tokens = max(state.metrics.num_cached_tokens, out.num_cached_tokens)
        completion.token_ids.extend(out.new_token_ids)
        completion.cumulative_logprob += sum(out.new_logprobs)
        if completion.logprobs is not None and out.new_top_logprobs:
            completion.logprobs.extend(out.new_top_logprobs)
        new_text = "".join(self._decode(seq, t) for t in out.new_token_ids)
        if seq.tools is not None:
            self._apply_tool_text(state, seq, out, new_text)
            return
        completion.text += new_text
        hit = seq.stops.find(completion.text, len(new_text)) if new_text else None
        if hit is not None:
            stop, keep = hit
            completion.text = completion.text[:keep]
            completion.finish_reason, completion.stop_reason = "stop", stop
            if out.finish_reason is None:
                self.stop_sequence(state.request_id, completion.index)
        elif out.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason

    @staticmethod
    def _decode(seq: _SequenceState, token_id: int) -> str:
        text = seq.detokenizer.step(token_id)
        if not text and seq.tools is not None:  # a skipped special token the tool format needs
            return seq.tools.marker_ids.get(token_id, "")
        return text

    def _apply_tool_text(self, state: RequestState, seq: _SequenceState, out: SequenceOutput,
                         new_text: str) -> None:
        """Stop strings on the raw text, then the parser: content into ``text``, calls aside."""
        completion, tools = seq.completion, seq.tools
        tools.raw += new_text
        reason, stop_reason = out.finish_reason, out.stop_reason
        hit = seq.stops.find(tools.raw, len(new_text)) if new_text else None
        if hit is not None:
            stop, keep = hit
            tools.raw = tools.raw[:keep]
            reason, stop_reason = "stop", stop
            if out.finish_reason is None:
                self.stop_sequence(state.request_id, completion.index)
        end = len(tools.raw) if reason is not None else max(tools.fed, len(tools.raw) - seq.stops.hold_back)
        content, fragments = tools.parser.feed(tools.raw[tools.fed:end])
        tools.fed = end
        if reason is not None:
            rest, more = tools.parser.finish(cut=reason == "length")
            content, fragments = content + rest, fragments + more
        completion.text += content
        tools.pending.extend(fragments)
        completion.tool_calls = tools.parser.calls or None
        if reason is not None:
            if reason == "stop" and tools.parser.calls:
                reason = "tool_calls"
            completion.finish_reason, completion.stop_reason = reason, stop_reason

    def _markers(self, fmt: type[ToolParser]) -> dict[int, str]:
        if fmt not in self._marker_ids:
            added = getattr(self.tokenizer, "added_tokens_encoder", None) or {}
            self._marker_ids[fmt] = {added[m]: m for m in fmt.markers if m in added}
        return self._marker_ids[fmt]

    def abort_all(self, reason: str = "abort") -> list[RequestState]:
        """Mark every live request finished (engine shutdown or death)."""
        states = list(self.requests.values())
        for state in states:
            for seq in state.seqs:
                if not seq.completion.finished:
                    seq.completion.finish_reason = reason
            state.finished = True
        self.requests.clear()
        return states
