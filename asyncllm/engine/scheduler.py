"""Token-budget scheduler: which sequences run this step, and how many tokens each computes.

One budget per step (``max_num_batched_tokens``). Every running sequence that decodes goes first
(one token each: a stream never skips a step for a prefill), then the next chunks of running
prefills, then waiting sequences by priority and arrival; prefill chunks and decodes share the
batch. How much prefill joins the decodes is the stall-free policy's call (engine/step_budget.py):
with an inter-token latency target, chunks are sized so the predicted step stays within it.

When the pool runs dry, the running sequence with the worst priority (the newest among equals) is
preempted: its blocks are freed and it goes back to the front of its priority's queue to be
recomputed later. A waiting request with a better priority than some running one may preempt it
to get a seat or blocks. Lower ``priority`` values go first; all requests default to 0 (first come,
first served).

``max_num_seqs`` is a hard bound on the running set: a request enters only when all of its ``n``
sequences fit (the front refuses ``n > max_num_seqs``). The queues are ordered dicts, so taking
any sequence out (finish, abort, preemption) costs O(1) however many there are.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from .kv_cache import KVCacheManager
from .request import Sequence, SequenceStatus
from .step_budget import PrefillAllowance, StepBudget


@dataclass
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``seqs[i]``, plus block copies to do first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    loras_in_use: set[int] = field(default_factory=set)  # adapter ids of every running sequence

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)

    def remove(self, seq: Sequence) -> None:
        """Take back a sequence scheduled earlier in this step (it was preempted after all)."""
        i = self.seqs.index(seq)
        del self.seqs[i], self.num_new_tokens[i]

    def __len__(self) -> int:
        return len(self.seqs)


class WaitingQueue:
    """Waiting sequences by priority (lower first), first come first served within a priority."""

    def __init__(self) -> None:
        self._levels: dict[int, OrderedDict[Sequence, None]] = {}
        self._order: list[int] = []  # the priorities present, sorted
        self.num_tokens = 0  # of every waiting sequence (they do not change while waiting)

    def add(self, seq: Sequence, front: bool = False) -> None:
        level = self._levels.get(seq.priority)
        if level is None:
            level = self._levels[seq.priority] = OrderedDict()
            bisect.insort(self._order, seq.priority)
        if seq not in level:
            self.num_tokens += seq.num_tokens
        level[seq] = None
        if front:  # a preempted sequence is recomputed before its priority's newcomers
            level.move_to_end(seq, last=False)

    def remove(self, seq: Sequence) -> None:
        level = self._levels.get(seq.priority)
        if level is None or seq not in level:
            return
        del level[seq]
        self.num_tokens -= seq.num_tokens
        if not level:
            del self._levels[seq.priority]
            self._order.remove(seq.priority)

    def __iter__(self) -> Iterator[Sequence]:
        for priority in list(self._order):
            yield from list(self._levels.get(priority, ()))

    def __contains__(self, seq: Sequence) -> bool:
        level = self._levels.get(seq.priority)
        return level is not None and seq in level

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels.values())


# A request kept out by full LoRA slots may let others with already-slotted adapters pass it, but
# only for this many steps; then admission turns strictly first-come-first-served until it gets in.
LORA_MAX_SKIPPED_STEPS = 16


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 8, step_budget: StepBudget | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.step_budget = step_budget  # None: prefills take whatever token budget the decodes leave
        self.waiting = WaitingQueue()   # preempted ones first within their priority
        self.running: dict[Sequence, None] = {}   # admission order
        self.num_reserved = 0  # seats held for children of running leaders, forked after their prefill
        self.num_preemptions = 0
        self._preempted_this_step: set[Sequence] = set()

    @property
    def num_seats_taken(self) -> int:
        """Running sequences plus the children their leaders will fork: what ``max_num_seqs`` bounds."""
        return len(self.running) + self.num_reserved

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._preempted_this_step = set()
        preempted, prefilling = self._schedule_decodes(batch)
        allowance = self._prefill_allowance(batch, prefilling)
        preempted = self._schedule_running_prefills(batch, prefilling, allowance) or preempted
        if not preempted:  # a pool that just ran dry admits nobody new this step
            self._schedule_waiting(batch, allowance)
        batch.block_copies = self.kv.pending_copies
        self.kv.pending_copies = []
        batch.loras_in_use = self.loras_in_use()
        return batch

    def loras_in_use(self) -> set[int]:
        return {seq.lora_id for seq in self.running if seq.lora_id is not None}

    def _prefill_allowance(self, batch: ScheduledBatch, prefilling: list[Sequence]) -> PrefillAllowance:
        """What prefill may join the decodes in ``batch``; ``prefilling``: running sequences still
        computing their prompts."""
        tokens = self.max_num_batched_tokens - batch.total_tokens
        if self.step_budget is None:
            return PrefillAllowance(tokens)
        decode_context = sum(seq.num_computed_tokens + 1 for seq in batch.seqs)  # KV positions the decodes read
        # the sequences that will decode once their prompts are in: running prefills, then the queue
        pending_rows = len(prefilling) + len(self.waiting)
        pending_context = sum(seq.num_tokens for seq in prefilling) + self.waiting.num_tokens
        room = max(self.max_num_seqs - len(batch), 0)
        if pending_rows > room:  # only max_num_seqs can decode at once
            pending_context = pending_context * room // pending_rows
            pending_rows = room
        return self.step_budget.allowance(tokens, len(batch), decode_context, pending_rows, pending_context)

    def _schedule_decodes(self, batch: ScheduledBatch) -> tuple[bool, list[Sequence]]:
        """Every running sequence one token from its next sample, within the token budget (one pass
        over the running set); returns whether the pool ran dry, and the running sequences still
        computing their prompts, in admission order."""
        preempted = False
        prefilling = []
        tokens = 0
        for seq in list(self.running):
            if seq not in self.running:  # preempted to make room for an earlier one
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1:
                prefilling.append(seq)
            elif remaining == 1 and tokens < self.max_num_batched_tokens:
                num_new = self._speculative_tokens(seq, self.max_num_batched_tokens - tokens)
                if num_new > 1 or self._allocate_running(seq, 1, batch):
                    batch.add(seq, num_new)
                    tokens += num_new
                else:
                    preempted = True
        return preempted, prefilling

    def _speculative_tokens(self, seq: Sequence, room: int) -> int:
        """1 + the draft tokens a decoding sequence verifies this step (engine/speculation.py), with
        their blocks allocated; 1 (nothing allocated yet) when it has none, or they do not fit the
        budget or the free blocks (drafts never preempt anyone)."""
        drafts = seq.draft_tokens
        if drafts and room > 1:
            del drafts[room - 1:]
            if self.kv.allocate(seq, 1 + len(drafts)):
                return 1 + len(drafts)
        drafts.clear()
        return 1

    def _schedule_running_prefills(self, batch: ScheduledBatch, prefilling: list[Sequence],
                                   allowance: PrefillAllowance) -> bool:
        """The next chunk of every running sequence still computing its prompt (or recomputing)."""
        preempted = False
        for seq in prefilling:
            if allowance.exhausted:
                break
            if seq not in self.running:  # preempted for a decode or an earlier chunk
                continue
            context = seq.num_computed_tokens
            num_new = allowance.grant(context, seq.num_tokens - context)
            if num_new <= 0:
                break
            if self._allocate_running(seq, num_new, batch):
                batch.add(seq, num_new)
                allowance.spend(context, num_new)
            else:
                preempted = True
        return preempted

    def _allocate_running(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``num_new`` more tokens of a running sequence, preempting the worst running
        ones (``seq`` itself, if it is the worst) until they fit."""
        while not self.kv.allocate(seq, num_new):
            victim = self._worst_running()
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _worst_running(self) -> Sequence:
        """The running sequence to preempt first: the worst priority, the newest among equals."""
        return max(reversed(self.running), key=lambda s: s.priority)

    def _schedule_waiting(self, batch: ScheduledBatch, allowance: PrefillAllowance) -> None:
        loras = self.loras_in_use()
        admitted = []
        for seq in self.waiting:
            if allowance.exhausted:
                break
            if seq in self._preempted_this_step:  # not back in the step that just pushed it out
                continue
            seats = 1 + len(seq.pending_children)
            if self.num_seats_taken + seats > self.max_num_seqs and not self._outranks_running(seq):
                break
            if seq.lora_id is not None and seq.lora_id not in loras and len(loras) >= self.max_loras:
                seq.lora_wait_steps += 1  # no free LoRA slot: let others pass, but not forever
                if seq.lora_wait_steps > LORA_MAX_SKIPPED_STEPS:
                    break
                continue
            num_new = self._admit(seq, allowance, batch)
            if num_new is None:
                break
            admitted.append(seq)
            if seq.lora_id is not None:
                loras.add(seq.lora_id)
            batch.add(seq, num_new)
        for seq in admitted:  # not while iterating over the queue
            if seq.status is SequenceStatus.RUNNING:  # (not preempted again by a later admission)
                self.waiting.remove(seq)

    def _admit(self, seq: Sequence, allowance: PrefillAllowance, batch: ScheduledBatch) -> int | None:
        """Give a waiting sequence its seats and blocks (prefix hits first), preempting running
        sequences of a worse priority when they are missing; the tokens it computes, or None."""
        seats = 1 + len(seq.pending_children)
        while True:
            if self.num_seats_taken + seats <= self.max_num_seqs:
                fresh = seq.num_computed_tokens == 0 and not seq.block_table
                cached = self.kv.find_cached_prefix(seq) if fresh else []
                context = len(cached) * self.kv.block_size if fresh else seq.num_computed_tokens
                num_new = allowance.grant(context, seq.num_tokens - context)
                if num_new <= 0:
                    return None
                if self.kv.allocate(seq, num_new, cached):
                    break
            if not self._preempt_for(seq, batch):
                return None
        if fresh and seq.num_output_tokens == 0:
            self.kv.count_prefix_query(seq)
        seq.status = SequenceStatus.RUNNING
        seq.lora_wait_steps = 0
        self.running[seq] = None
        self.num_reserved += len(seq.pending_children)
        allowance.spend(context, num_new)
        return num_new

    def _outranks_running(self, seq: Sequence) -> bool:
        """Whether some running sequence has a worse priority than ``seq`` (and may be preempted for it)."""
        return bool(self.running) and self._worst_running().priority > seq.priority

    def _preempt_for(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Preempt the worst running sequence if its priority is worse than ``seq``'s."""
        if not self._outranks_running(seq):
            return False
        self._preempt(self._worst_running(), batch)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch | None = None) -> None:
        """Free ``seq``'s blocks and queue it first (within its priority) for recomputation; take it
        out of this step's batch if it was already scheduled."""
        del self.running[seq]
        self.num_reserved -= len(seq.pending_children)  # taken again when it is re-admitted
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq, front=True)
        self.num_preemptions += 1
        self._preempted_this_step.add(seq)
        if batch is not None and seq in batch.seqs:
            batch.remove(seq)

    def start_children(self, leader: Sequence) -> list[Sequence]:
        """After ``leader``'s prefill, fork its waiting siblings onto its blocks (n > 1)."""
        children, leader.pending_children = leader.pending_children, []
        self.num_reserved -= len(children)
        for child in children:
            self.kv.fork(leader, child)
            child.status = SequenceStatus.RUNNING
            self.running[child] = None
        return children

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.pop(seq, None)
            self.num_reserved -= len(seq.pending_children)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        for child in seq.pending_children:  # aborted before its prefill finished
            child.status = SequenceStatus.FINISHED
        seq.pending_children = []

