"""How long an engine step takes, predicted from what it computes: the stall-free scheduler's model.

A step's time is modelled as a linear function of five features of its batch:

    t = c0 + c_token * tokens + c_context * decode_context + c_pair * prefill_pairs + c_eager * eager

``tokens`` is every token the step computes (decode rows and prefill chunk tokens: they go through
the same projections), ``decode_context`` the KV positions the decode rows read, and
``prefill_pairs`` the causal query-key pairs of the prefill chunks (a chunk of ``n`` tokens after
``p`` computed ones: ``n * (p + (n + 1) / 2)``). ``c0`` holds what does not grow with the batch
(streaming the weights once at small batch, the per-step Python). ``eager`` is 1 when a CPU engine
with a decode stack runs (part of) the step through the eager model: the step is more than the
stack runs whole (``StepTimeModel.stack_limits``), so the weights are read a second time and the per-layer torch
calls add up; measured on cpu-llama float32 (when the stack's line was 64 tokens) a jump from 14 to
37 ms just past it, which no per-token price can express. Without a decode stack (GPU, other families) the
feature is always 0.

The coefficients come from a few timed dummy steps when the engine starts (:func:`calibrate`), and
are refitted every few steps from the steps the engine actually ran: a weighted least-squares fit
over the latest steps plus the calibration points, whose residuals are relative (a 5 ms decode step
counts as much as a 500 ms prefill), with coefficients kept non-negative.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..kernels.cpu_decode_stack import StackLimits

logger = logging.getLogger(__name__)

NUM_FEATURES = 5
WINDOW_STEPS = 512       # the latest steps the online fit uses
REFIT_EVERY = 16         # steps between refits
CALIBRATION_WEIGHT = 4   # each calibration point counts as this many observed steps
MIN_SECONDS = 1e-4       # relative residuals: no step is weighed as if it took less


@dataclass(frozen=True)
class StepFeatures:
    """What one step computes, as the model sees it."""

    tokens: int = 0
    decode_context: int = 0
    prefill_pairs: float = 0.0
    eager: int = 0  # 1: the step (or its prefill part) runs the eager model beside a decode stack

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.tokens, self.decode_context, self.prefill_pairs, self.eager])

    @classmethod
    def of_batch(cls, batch: Any, limits: StackLimits | None = None) -> "StepFeatures":
        """The features of a scheduled batch (its ``seqs`` and ``num_new_tokens``; read before the step
        advances its sequences). Typed loosely: the scheduler imports this module, not the reverse.
        ``limits``: what the decode stack runs whole (``StepTimeModel.stack_limits``)."""
        tokens = context = 0
        pairs = 0.0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            tokens += n
            done = seq.num_computed_tokens
            if n == 1:
                context += done + 1
            else:
                pairs += prefill_pairs(done, n)
        ends = [seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        return cls(tokens, context, pairs, eager_pass(batch.num_new_tokens, ends, limits))


def eager_pass(num_new_tokens: list[int], ends: list[int], limits: StackLimits | None) -> int:
    """1 when a step of these new-token counts (sequence ``i`` reaching position ``ends[i]``) is more than
    the decode stack runs whole; 0 without a stack."""
    return int(limits is not None and not limits.runs_whole(num_new_tokens, ends))


def prefill_pairs(context: int, n: int) -> float:
    """Causal query-key pairs of a chunk of ``n`` tokens after ``context`` computed ones."""
    return n * (context + (n + 1) / 2)


class StepTimeModel:
    """Predicts a step's seconds from its :class:`StepFeatures`; learns from the steps it is shown."""

    def __init__(self, coefficients: np.ndarray | None = None) -> None:
        # fewer coefficients than features: the missing ones are 0 (a model without the eager pass)
        given = np.zeros(0) if coefficients is None else np.maximum(np.asarray(coefficients, dtype=float), 0.0)
        self.coefficients = np.concatenate([given, np.zeros(NUM_FEATURES - len(given))])
        self._prior: list[tuple[np.ndarray, float]] = []
        self._window: deque[tuple[np.ndarray, float]] = deque(maxlen=WINDOW_STEPS)
        self._since_fit = 0
        self.num_observed = 0
        self.stack_limits: StackLimits | None = None  # what the engine's CPU decode stack runs whole

    @property
    def calibrated(self) -> bool:
        return self.coefficients[1] > 0.0

    def predict(self, features: StepFeatures) -> float:
        return float(features.vector() @ self.coefficients)

    def features(self, batch: Any) -> StepFeatures:
        """The features of a scheduled batch, on this engine."""
        return StepFeatures.of_batch(batch, self.stack_limits)

    @property
    def eager_seconds(self) -> float:
        """What a step pays for leaving the decode stack (0 without one)."""
        return float(self.coefficients[4])

    def decode_seconds(self, rows: int, context: int, whole: bool = False) -> float:
        """A decode-only step of ``rows`` sequences reading ``context`` KV positions in all (``whole``: as the
        decode part of a step the decode stack runs whole, without the eager pass)."""
        c = self.coefficients
        eager = not whole and self.stack_limits is not None and rows > self.stack_limits.decode_rows
        return c[0] + c[1] * rows + c[2] * context + (c[4] if eager else 0.0)

    def prefill_seconds(self, context: int, n: int) -> float:
        """What a prefill chunk of ``n`` tokens after ``context`` computed ones adds to a step."""
        c = self.coefficients
        return c[1] * n + c[3] * prefill_pairs(context, n)

    def prefill_tokens_within(self, seconds: float, context: int) -> int:
        """The longest chunk (after ``context`` computed tokens) that adds at most ``seconds``."""
        if seconds <= 0:
            return 0
        c_token, c_pair = self.coefficients[1], self.coefficients[3]
        # c_pair/2 * n^2 + (c_token + c_pair * (context + 1/2)) * n <= seconds
        a, b = c_pair / 2, c_token + c_pair * (context + 0.5)
        if a <= 0:
            return int(seconds / b) if b > 0 else 1 << 30
        return int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a))

    def calibrate_with(self, points: list[tuple[StepFeatures, float]]) -> None:
        """Set the start-up measurements; they stay in every later fit (as its prior)."""
        self._prior = [(f.vector(), seconds) for f, seconds in points]
        self._fit()

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Record a step that ran; every ``REFIT_EVERY`` steps the coefficients are refitted."""
        self._window.append((features.vector(), seconds))
        self.num_observed += 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        rows = [(x, y, CALIBRATION_WEIGHT) for x, y in self._prior] + [(x, y, 1) for x, y in self._window]
        if not rows:
            return
        x = np.array([r[0] for r in rows])
        y = np.array([r[1] for r in rows])
        # relative residuals (divide each row by its time), and the calibration points weighed more
        w = np.sqrt(np.array([r[2] for r in rows])) / np.maximum(y, MIN_SECONDS)
        fitted = _nonnegative_lstsq(x * w[:, None], y * w)
        if fitted[1] > 0:  # a fit that prices tokens at nothing has seen too little: keep the old one
            self.coefficients = fitted


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: columns whose coefficient comes out negative are
    dropped and the rest refitted (four columns: a few passes at most). Columns that are zero in
    every row (a feature the data never exercised) get zero."""
    active = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    coef = np.zeros(a.shape[1])
    while active:
        # scale columns to unit norm: the features differ by orders of magnitude
        sub = a[:, active]
        norms = np.linalg.norm(sub, axis=0)
        solution = np.linalg.lstsq(sub / norms, b, rcond=None)[0] / norms
        if np.all(solution >= 0):
            coef[active] = solution
            return coef
        active = [j for j, v in zip(active, solution) if v >= 0] if np.any(solution > 0) else []
    return coef


# ---- start-up calibration --------------------------------------------------------------------------

def calibration_steps(max_tokens: int, num_blocks: int, block_size: int, max_seqs: int, max_model_len: int
                      ) -> list[tuple[list[int], list[int]]]:
    """The dummy steps timed at start-up, each as (start positions, new tokens per sequence): decode
    at one and a few rows, decode over a longer context, and four prefill lengths (two that a CPU decode
    stack runs whole, two past it, so the eager pass's price is told apart from the tokens'). Capped by
    the token budget, the context length and the KV blocks there are, so any engine can run them."""
    slots = min(num_blocks * block_size, max_model_len)
    long_context = max(0, min(256, slots - 1))
    rows = max(1, min(4, max_seqs, num_blocks // 2))
    chunks = sorted({max(1, min(n, max_tokens, slots)) for n in (32, 64, 128, 256)})
    steps = [([0], [1]), ([0] * rows, [1] * rows), ([long_context], [1])]
    steps += [([0], [n]) for n in chunks if n > 1]
    return steps


def dummy_step(starts: list[int], lengths: list[int], block_size: int, num_blocks: int) -> Any:
    """A step of token id 1 for sequences at ``starts`` taking ``lengths`` new tokens each, on KV blocks counted
    from 0 (rows share blocks when the pool is too small for all of them), one logits row per sequence. Only for
    an engine that holds no sequence yet: it writes KV into whatever blocks it names."""
    from ..model.step_io import StepInput

    tables, next_block = [], 0
    for start, n in zip(starts, lengths):
        count = -(-(start + n) // block_size)
        if next_block + count > num_blocks:  # rows share blocks when the pool is tiny
            next_block = 0
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    logit_rows, flat = [], 0
    for n in lengths:
        flat += n
        logit_rows.append(flat - 1)
    return StepInput(token_ids=[1] * sum(lengths), start_positions=list(starts), num_new_tokens=list(lengths),
                     block_tables=tables, logit_rows=logit_rows, loras=[None] * len(lengths))


def calibrate(model: StepTimeModel, runner: Any, max_tokens: int, max_seqs: int, max_model_len: int,
              repeats: int = 2) -> None:
    """Time a few dummy steps on ``runner`` (fastest of ``repeats`` runs each) and fit ``model``.

    The steps write KV into blocks that no sequence holds yet (the engine has not started), so
    nothing is disturbed: a block's slots are always written before they are read."""
    block_size, num_blocks = runner.block_size, runner.num_blocks
    points = []
    for starts, lengths in calibration_steps(max_tokens, num_blocks, block_size, max_seqs, max_model_len):
        step = dummy_step(starts, lengths, block_size, num_blocks)
        best = math.inf
        for _ in range(repeats):
            begin = time.perf_counter()
            logits = runner.execute(step).logits
            logits.argmax(dim=-1).tolist()  # the step's end: the sampler reads the logits back
            best = min(best, time.perf_counter() - begin)
        context = sum(s + 1 for s, n in zip(starts, lengths) if n == 1)
        pairs = sum(prefill_pairs(s, n) for s, n in zip(starts, lengths) if n > 1)
        ends = [s + n for s, n in zip(starts, lengths)]
        points.append((StepFeatures(sum(lengths), context, pairs, eager_pass(lengths, ends, model.stack_limits)), best))
    model.calibrate_with(points)
    logger.info("step time model: %s", describe(model))


def describe(model: StepTimeModel) -> str:
    c = model.coefficients
    return (f"{1e3 * c[0]:.2f} ms per step + {1e6 * c[1]:.1f} us per token + {1e9 * c[2]:.1f} ns per decode "
            f"context position + {1e9 * c[3]:.2f} ns per prefill query-key pair"
            + (f" + {1e3 * c[4]:.2f} ms per step past the decode stack" if model.stack_limits is not None else ""))
