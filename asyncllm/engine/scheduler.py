"""Token-budget scheduler: which sequences run this step, and how many tokens each computes.

One budget per step (``max_num_batched_tokens``). Running sequences go first (one token for a
decode, or the next chunk of a prefill), then waiting ones in arrival order, so prefill chunks and
decodes share a batch. When the pool runs dry, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later.

``max_num_seqs`` is a hard bound on the running set: a request enters only when all of its ``n``
sequences fit (the front refuses ``n > max_num_seqs``). Both queues are ordered dicts,
so taking any sequence out (finish, abort, preemption) costs O(1) however many there are.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .kv_cache import KVCacheManager
from .request import Sequence, SequenceStatus


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

    def __len__(self) -> int:
        return len(self.seqs)


# A request kept out by full LoRA slots may let others with already-slotted adapters pass it, but
# only for this many steps; then admission turns strictly first-come-first-served until it gets in.
LORA_MAX_SKIPPED_STEPS = 16


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 8) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.waiting: OrderedDict[Sequence, None] = OrderedDict()  # arrival order; preempted ones go first
        self.running: dict[Sequence, None] = {}   # admission order; the newest is preempted first
        self.num_reserved = 0  # seats held for children of running leaders, forked after their prefill
        self.num_preemptions = 0

    @property
    def num_seats_taken(self) -> int:
        """Running sequences plus the children their leaders will fork: what ``max_num_seqs`` bounds."""
        return len(self.running) + self.num_reserved

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting[seq] = None

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        budget -= batch.total_tokens
        if not preempted:  # a pool that just ran dry admits nobody new this step
            self._schedule_waiting(batch, budget)
        batch.block_copies = self.kv.pending_copies
        self.kv.pending_copies = []
        batch.loras_in_use = self.loras_in_use()
        return batch

    def loras_in_use(self) -> set[int]:
        return {seq.lora_id for seq in self.running if seq.lora_id is not None}

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        preempted = False
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted below to make room for an older sequence
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, num_new):
                preempted = True
                victim = next(reversed(self.running))
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        return preempted

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        loras = self.loras_in_use()
        admitted = []
        for seq in self.waiting:
            if budget <= 0:
                break
            seats = 1 + len(seq.pending_children)
            if self.num_seats_taken + seats > self.max_num_seqs:
                break
            if seq.lora_id is not None and seq.lora_id not in loras and len(loras) >= self.max_loras:
                seq.lora_wait_steps += 1  # no free LoRA slot: let others pass, but not forever
                if seq.lora_wait_steps > LORA_MAX_SKIPPED_STEPS:
                    break
                continue
            num_new = self._admit(seq, budget)
            if num_new is None:
                break
            admitted.append(seq)
            if seq.lora_id is not None:
                loras.add(seq.lora_id)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        for seq in admitted:  # not while iterating over the queue
            del self.waiting[seq]

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting sequence its blocks (prefix hits first); the tokens it computes, or None."""
        fresh = seq.num_computed_tokens == 0 and not seq.block_table
        cached = self.kv.find_cached_prefix(seq) if fresh else []
        num_new = min(seq.num_tokens - len(cached) * self.kv.block_size, budget)
        if not self.kv.allocate(seq, num_new, cached):
            return None
        if fresh and seq.num_output_tokens == 0:
            self.kv.count_prefix_query(seq)
        seq.status = SequenceStatus.RUNNING
        seq.lora_wait_steps = 0
        self.running[seq] = None
        self.num_reserved += len(seq.pending_children)
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first for recomputation."""
        del self.running[seq]
        self.num_reserved -= len(seq.pending_children)  # taken again when it is re-admitted
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting[seq] = None
        self.waiting.move_to_end(seq, last=False)
        self.num_preemptions += 1

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
            self.waiting.pop(seq, None)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        for child in seq.pending_children:  # aborted before its prefill finished
            child.status = SequenceStatus.FINISHED
        seq.pending_children = []

