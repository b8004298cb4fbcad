"""How much prefill may join a step's decodes: the stall-free policy (docs/async.md#smooth-streams).

Every running stream decodes in every step, so a step's length is the gap its streams see between
two tokens. A step that also carries a long prefill chunk freezes every stream for as long as the
chunk takes; this module sizes the chunks so that the predicted step time (engine/step_time.py)
stays within an inter-token latency target:

- ``max_itl_ms="auto"`` (the AsyncLLM default): the target is ``AUTO_ITL_FACTOR`` times the predicted
  decode step of the engine's load: every request in it (decoding, prefilling or waiting, up to
  ``max_num_seqs``) counted as a decoding row with its context. That is the gap streams will see once
  the queue is in, so a step with prefill lasts at most about three of them. It follows the load: a
  few streams decode fast and get small chunks beside them; at high concurrency the decode step is
  long and carries proportionally more prefill. Counting the queue matters: were the reference only
  the rows decoding now, a backlog (few decoding yet) would shrink the chunks that drain it.
- ``max_itl_ms=<number>``: a fixed target in milliseconds.
- ``max_itl_ms=None`` (the LLM default): no target; prefills take whatever token budget is left.

Whatever the target, the first prefill of a step gets at least ``MIN_PREFILL_TOKENS`` tokens, so the
head of the queue advances every step: no prompt starves, however busy the decodes keep the engine.
A step without decodes has no stream to protect and takes the whole token budget.

A burst (``max_itl_ms="auto"`` only): when the prompts waiting to start that fit one token budget each are at
least ``BURST_RATIO`` times as many as the streams decoding, and at least ``BURST_MIN_ROWS``, the step takes the
whole token budget too. A lone prompt joining a few streams is no wave and is chunked as before. The scheduler
keeps bursting until the prompts that waited when the burst began are all in (``Scheduler._burst_wave``). This
is a wave of chat requests arriving together (closed-loop clients whose requests ended together, a page
load fanning out): chunking it to the decodes' target would make every waiting prompt's first token wait
several times its prefill, to spare the few streams already running one long gap each. Such a stream sees
that gap once per wave, which keeps well under 1% of its gaps for replies of a hundred tokens and more. Long
prompts (more than a token budget) never make a burst: a document arriving while others chat is chunked
as before.
"""

from __future__ import annotations

import math

from .step_time import StepTimeModel

AUTO_ITL_FACTOR = 3.0
MIN_PREFILL_TOKENS = 32
BURST_RATIO = 0.5  # burst rows per decoding row that make a step a burst (see above)
BURST_MIN_ROWS = 4  # and never fewer than this many


class PrefillAllowance:
    """The prefill one step may still take: tokens (the step's token budget) and, with a target,
    seconds of predicted step time.

    With a CPU decode stack (``StepTimeModel.stack_limits``) a step up to ``fast_room`` more tokens, its
    chunks ending within ``fast_context`` positions, stays on the stack; a chunk past that line pays the
    eager pass (``StepTimeModel.eager_seconds``) on top of the tokens' own price. A chunk crosses that line only when the crossing pays: when the longer
    step it allows computes more prefill tokens per second of step than stopping at the line would."""

    def __init__(self, tokens: int, seconds: float | None = None, model: StepTimeModel | None = None,
                 min_tokens: int = MIN_PREFILL_TOKENS, fast_room: int | None = None,
                 fast_context: int = 1 << 62, step_seconds: float = 0.0) -> None:
        self.tokens = tokens
        self.seconds = seconds
        self.model = model
        self.min_tokens = min_tokens
        self.fast_room = fast_room        # tokens the step may still add on the decode stack; None: no line
        self.fast_context = fast_context  # and the position its chunks must end within
        self.step_seconds = step_seconds  # the step's predicted time so far (its decodes, then its chunks)
        self.granted_any = False

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0 or (self.granted_any and self.seconds is not None and self.seconds <= 0)

    def grant(self, context: int, wanted: int) -> int:
        """How many of ``wanted`` prompt tokens (after ``context`` computed ones) this step takes."""
        n = min(wanted, self.tokens)
        if self.seconds is not None and n > 0:
            fit = self.model.prefill_tokens_within(self.seconds, context)
            if self.fast_room is not None and min(n, fit) > self._room(context):
                fit = self._across_the_line(context, min(n, fit))
            if not self.granted_any:  # the head of the queue always advances
                fit = max(fit, self.min_tokens)
            n = min(n, fit)
        return max(n, 0)

    def _across_the_line(self, context: int, wanted: int) -> int:
        """A chunk that would take the step off the decode stack: the tokens that fit once the eager pass
        is paid, if that beats stopping at the line (in prefill tokens per second of step), else the line."""
        stay = self._room(context)
        over = min(wanted, self.model.prefill_tokens_within(self.seconds - self.model.eager_seconds, context))
        if over <= stay:
            return stay
        stay_rate = stay / (self.step_seconds + self.model.prefill_seconds(context, stay)) if stay > 0 else 0.0
        over_seconds = self.step_seconds + self.model.eager_seconds + self.model.prefill_seconds(context, over)
        return over if over / over_seconds > stay_rate else stay

    def _room(self, context: int) -> int:
        """The most tokens a chunk after ``context`` computed ones takes while the step stays on the stack."""
        return max(min(self.fast_room, self.fast_context - context), 0)

    def spend(self, context: int, n: int) -> None:
        """Record a chunk of ``n`` tokens (after ``context`` computed ones) as scheduled."""
        self.tokens -= n
        if self.seconds is not None:
            cost = self.model.prefill_seconds(context, n)
            if self.fast_room is not None:
                if n > self._room(context):  # off the decode stack: the eager pass is paid, once
                    cost += self.model.eager_seconds
                    self.fast_room = None
                else:
                    self.fast_room -= n
            self.seconds -= cost
            self.step_seconds += cost
        self.granted_any = self.granted_any or n > 0


class StepBudget:
    """The policy: given the decodes already in a step, the allowance for its prefills."""

    def __init__(self, model: StepTimeModel, max_itl_ms: float | str) -> None:
        self.model = model
        self.fixed_seconds = None if max_itl_ms == "auto" else float(max_itl_ms) / 1e3
        self.last_target_seconds: float | None = None  # of the latest step that had decodes
        self.num_bursts = 0  # steps with decodes that took the whole token budget as a burst

    def burst_threshold(self, decode_rows: int) -> int | None:
        """The burst rows (prompts fitting one token budget, waiting to start) that make a step with
        ``decode_rows`` decodes a burst, or None where this target never bursts (a fixed one)."""
        if self.fixed_seconds is not None or decode_rows == 0:
            return None
        return max(BURST_MIN_ROWS, math.ceil(decode_rows * BURST_RATIO))

    def target_seconds(self, rows: int, context: int) -> float:
        """The step time the prefills may fill up to, for a load of ``rows`` sequences holding
        ``context`` tokens in all (decoding now, and to decode once their prompts are in)."""
        if self.fixed_seconds is not None:
            return self.fixed_seconds
        return AUTO_ITL_FACTOR * self.model.decode_seconds(rows, context)

    def allowance(self, tokens: int, decode_rows: int, decode_context: int, pending_rows: int = 0,
                  pending_context: int = 0, burst_rows: int = 0, step_tokens: int | None = None) -> PrefillAllowance:
        """What prefill may join ``decode_rows`` decodes reading ``decode_context`` positions, with
        ``pending_rows`` more sequences (``pending_context`` tokens) waiting to decode, ``burst_rows`` of
        them prompts that fit one token budget (counted up to :meth:`burst_threshold` at least).
        ``step_tokens``: the tokens already in the step (its decodes and their drafts; default: one a row)."""
        if decode_rows == 0 or not self.model.calibrated:
            return PrefillAllowance(tokens)
        threshold = self.burst_threshold(decode_rows)
        if threshold is not None and burst_rows >= threshold:
            self.num_bursts += 1
            return PrefillAllowance(tokens)
        target = self.target_seconds(decode_rows + pending_rows, decode_context + pending_context)
        self.last_target_seconds = target
        step_tokens = decode_rows if step_tokens is None else step_tokens
        limits = self.model.stack_limits
        if limits is None or step_tokens >= limits.mixed_rows:  # no line, or the decodes alone are past it
            decode = self.model.decode_seconds(decode_rows, decode_context)
            return PrefillAllowance(tokens, max(target - decode, 0.0), self.model, step_seconds=decode)
        # with chunks inside the line the step runs whole on the stack, even where its decodes alone would not
        decode = self.model.decode_seconds(decode_rows, decode_context, whole=True)
        return PrefillAllowance(tokens, max(target - decode, 0.0), self.model, fast_room=limits.mixed_rows - step_tokens,
                                fast_context=limits.mixed_context, step_seconds=decode)
