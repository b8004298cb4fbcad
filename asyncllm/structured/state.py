"""Per-sequence grammar state on the engine side, and the token bitmasks applied to logits.

Each constrained sequence owns a :class:`GrammarState`. The sampler asks the states of the
constrained rows (and only those) for a bitmask of allowed tokens and sets every other logit to
``-inf``; unconstrained rows are not touched. After sampling, the engine advances the state with
the chosen token, exactly once per generated token: a sequence recomputed after preemption keeps
its state and does not replay tokens it already accepted.

A matcher can give up mid-generation: a per-step resource limit (lexer fuel, Earley items, lexer
states) runs out while it computes a mask, after which it allows only EOS, or it rejects a token.
The text can no longer be held to the grammar then, so the engine finishes the sequence with
reason "error" (:attr:`GrammarState.failed`) and the front ends the request with
:func:`generation_error`, a 400, rather than a "stop" whose text ignores the grammar.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..kernels.transfer import to_device
from .compile_child import first_line
from .grammar_engine import llguidance

_executor = None
_executor_lock = threading.Lock()
_prefetch_pool: ThreadPoolExecutor | None = None


class GrammarState:
    """An llguidance matcher that follows one sequence's generated tokens."""

    __slots__ = ("matcher", "prefetched", "template")

    def __init__(self, matcher: "llguidance.LLMatcher", template=None) -> None:
        """``template``: the compiled grammar this state was cloned from (told when the state fails)."""
        self.matcher = matcher
        self.template = template
        self.prefetched: tuple[Future, int] | None = None  # (bitmask being filled, this state's row)

    def fork(self) -> "GrammarState":
        """An independent copy at the current position (``n > 1`` children fork from their leader);
        a mask being prefetched for the parent is the child's too (same position)."""
        if self.prefetched is not None:  # the worker may still be filling from this matcher
            self.prefetched[0].result()
        child = GrammarState(self.matcher.deep_copy(), self.template)
        child.prefetched = self.prefetched
        return child

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (state is then an error)."""
        return self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS would be allowed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def failed(self) -> bool:
        """The grammar engine gave up on this sequence (a limit ran out computing a mask, or a
        token was rejected): it stays so, and nothing holds the text to the grammar any more.

        The compiled grammar it came from is then marked worn: clones share llguidance's lexer, so
        one request that used up its states would fail every later request with the same grammar
        (a cache hit) at its first token; a worn grammar is compiled afresh on its next use."""
        if not self.matcher.is_error():
            return False
        if self.template is not None:
            self.template.worn = True
        return True

    @property
    def failure(self) -> str:
        """Why it gave up, in a line (the engine's finish ``stop_reason`` for reason "error"); the
        parser-state dump llguidance appends (the tokens so far) is left out."""
        return first_line(self.matcher.get_error().split("<state>", 1)[0])


_GRAMMAR_FIELDS = ("json_schema", "regex", "choice", "grammar")


def generation_error(params, detail: str) -> InvalidRequestError:
    """The error a request ends with when its grammar engine gave up during generation
    (``detail``: :attr:`GrammarState.failure`), naming the field the grammar came from."""
    field = next((name for name in _GRAMMAR_FIELDS if getattr(params, name, None) is not None), "tools")
    return InvalidRequestError(f"{field}: the grammar engine gave up on it during generation ({detail}); the "
                               "output could not be held to it, so none is returned", field=field)


def _get_executor() -> "llguidance.LLExecutor":
    global _executor, _prefetch_pool
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
            _prefetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncllm-grammar")
        return _executor


def prefetch_masks(states: list[GrammarState], vocab_size: int) -> None:
    """Start filling these states' next bitmasks in a worker thread, to overlap the forward pass
    (llguidance releases the GIL); :func:`apply_grammar_masks` collects them. The states must not
    advance before then, which holds within one engine step (sampling comes after the model)."""
    _get_executor()
    future = _prefetch_pool.submit(fill_bitmask, list(states), vocab_size)
    for row, state in enumerate(states):
        state.prefetched = (future, row)


def grammar_bitmask(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """The states' next-token bitmasks (``[len(states), ceil(vocab / 32)]`` int32, on CPU): prefetched
    rows where there are some, the others filled now. Consumes the prefetch: call once per step."""
    rows: list[torch.Tensor | None] = [None] * len(states)
    for i, state in enumerate(states):
        if state.prefetched is not None:
            future, row = state.prefetched
            rows[i] = future.result()[row]
        state.prefetched = None  # the state advances next: a mask is good for one step only
    missing = [i for i, row in enumerate(rows) if row is None]
    if len(missing) == len(states):
        return fill_bitmask(states, vocab_size)
    if missing:
        fresh = fill_bitmask([states[i] for i in missing], vocab_size)
        for k, i in enumerate(missing):
            rows[i] = fresh[k]
    return torch.stack(rows)


def fill_bitmask(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """``[len(states), ceil(vocab / 32)]`` int32 bitmask (bit set: token allowed), filled on CPU."""
    bitmask = torch.zeros((len(states), (vocab_size + 31) // 32), dtype=torch.int32)
    if len(states) == 1:
        llguidance.torch.fill_next_token_bitmask(states[0].matcher, bitmask, 0)
    else:  # llguidance spreads the rows over its own threads (the GIL is released)
        llguidance.torch.fill_next_token_bitmask_par(
            _get_executor(), [(s.matcher, i) for i, s in enumerate(states)], bitmask)
    return bitmask


def forbidden_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[rows, vocab_size]``: True where the token is *not* allowed.

    On CPU the words are inverted (32x fewer elements than the mask) and numpy's ``unpackbits``
    expands them, several times faster than torch's shifts; on an accelerator the int32 words
    travel and are expanded there (32x less to copy than a bool mask)."""
    if bitmask.device.type == "cpu":
        bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: nothing to copy
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] == 0


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set every token the grammar forbids to ``-inf`` in ``logits[rows]`` (in place)."""
    vocab_size = logits.shape[1]
    bitmask = grammar_bitmask(states, vocab_size)
    if logits.device.type != "cpu":
        bitmask = to_device(bitmask, logits.device, torch.int32)  # page-locked: the copy does not wait
    forbidden = forbidden_mask(bitmask, vocab_size)
    if len(rows) == logits.shape[0]:  # every row constrained: no gather/scatter needed
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = to_device(rows, logits.device)
    constrained = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))
    logits.index_copy_(0, index, constrained)
