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

Beams (engine/beam_search.py) are preempted one at a time like any sequence, so a beam group
whose beams never fit the cache together still finishes: its beam step waits for every beam's
row, and a beam that has offered its row is *idle* until then. Idle beams are never scheduled and
are the first victims among their priority, for running sequences and waiting ones alike: held,
they would keep out the very beams their group waits for (the deadlock of 5 running / 3 waiting
beams with every block used). Within a priority, the earliest admitted non-idle sequence is
preempted only when it runs alone, and one sequence always fits (the engine's start checks it, and
``EngineCore.check_fits`` each request), so every step advances some sequence.

A sequence that wants prompt logprobs computes at most ``max_prompt_logprob_rows`` of them per
step, over all sequences (a vocabulary-wide float32 row each; ``prompt_logprob_rows``): its
prefill is chunked to that, and other streams decode between its chunks.

``max_num_seqs`` is a hard bound on the running set: a request enters only when all of its ``n``
sequences fit (the front refuses ``n > max_num_seqs``). The queues are ordered dicts, so taking
any sequence out (finish, abort, preemption) costs O(1) however many there are.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

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
    encode_ahead: list = field(default_factory=list)  # ImageInputs encoded ahead this step, in order
    encode_ahead_rows: int = 0                        # the share of the encoder budget they get

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
        # per priority: each sequence and the tokens it was counted with (a waiting beam still grows
        # when its group steps, so its count is the one it entered with)
        self._levels: dict[int, OrderedDict[Sequence, int]] = {}
        self._order: list[int] = []  # the priorities present, sorted
        self.num_tokens = 0  # of every waiting sequence, as counted when it entered

    def add(self, seq: Sequence, front: bool = False) -> None:
        level = self._levels.get(seq.priority)
        if level is None:
            level = self._levels[seq.priority] = OrderedDict()
            bisect.insort(self._order, seq.priority)
        if seq not in level:
            self.num_tokens += seq.num_tokens
            level[seq] = seq.num_tokens
        if front:  # a preempted sequence is recomputed before its priority's newcomers
            level.move_to_end(seq, last=False)

    def remove(self, seq: Sequence) -> None:
        level = self._levels.get(seq.priority)
        if level is None or seq not in level:
            return
        self.num_tokens -= level.pop(seq)
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


def is_idle_beam(seq: Sequence) -> bool:
    """A beam its group is not waiting on: it already offered its next-token log-probabilities (or
    is a spare sequence). It has nothing to compute until the group's next beam step, so it is never
    scheduled, and it is the first to give up its blocks and seat (its offered row stays with the
    group; only its KV is recomputed later)."""
    group = seq.beam_group
    return group is not None and not group.awaits(seq)


# Bound on one step's prompt-logprob rows: each is a float32 row of the vocabulary, materialised
# beside the step's other logits (a 7,900-token prompt of a 49,152-token vocabulary in one step
# was 1.5 GB and froze every stream for its duration).
PROMPT_LOGPROBS_STEP_BYTES = 64 * 2**20


def prompt_logprob_rows(vocab_size: int) -> int:
    """How many prompt positions' logprobs one step may compute: ``PROMPT_LOGPROBS_STEP_BYTES`` of
    float32 logits rows, at least one."""
    return max(1, PROMPT_LOGPROBS_STEP_BYTES // (4 * max(vocab_size, 1)))


# A request kept out by full LoRA slots may let others with already-slotted adapters pass it, but
# only for this many steps; then admission turns strictly first-come-first-served until it gets in.
LORA_MAX_SKIPPED_STEPS = 16

# Image hashes remembered as encoded ahead (a few per prompt waiting on one; stale ones cost a re-encode).
MAX_ENCODED_AHEAD = 256


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 8, step_budget: StepBudget | None = None,
                 max_prompt_logprob_rows: int | None = None, whole_images: bool = False,
                 encoder_budget: int | None = None,
                 encoder_seconds_per_row: Callable[[], float | None] | None = None) -> None:
        """``max_prompt_logprob_rows``: prompt positions whose logprobs one step may compute, over
        all sequences (``prompt_logprob_rows``); None: unbounded. ``whole_images``: an image's rows are
        computed in one step and a cached prefix never ends inside one (models attending inside an image
        both ways: Gemma 3). ``encoder_budget``: image rows whose encoding one step may start (the
        first image of a step always goes; None: unbounded). ``encoder_seconds_per_row()``: the measured tower
        time of an image row (None: not measured); with a step-time target, an image whose encoding would not
        fit what the step has left is encoded ahead too."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.step_budget = step_budget  # None: prefills take whatever token budget the decodes leave
        self.waiting = WaitingQueue()   # preempted ones first within their priority
        self.running: dict[Sequence, None] = {}   # admission order
        # the short prompts that were pending when the latest burst began (engine/step_budget.py): the steps
        # after it burst too until all of them are in, so a wave is never cut into a burst and a tail of chunks
        self._burst_wave: list[Sequence] = []
        self.num_reserved = 0  # seats held for children of running leaders, forked after their prefill
        self.num_preemptions = 0
        self._preempted_this_step: set[Sequence] = set()
        self.max_prompt_logprob_rows = max_prompt_logprob_rows
        self._prompt_logprob_rows_left = 0  # of this step's bound
        self.whole_images = whole_images
        self.encoder_budget = encoder_budget
        self.encoder_seconds_per_row = encoder_seconds_per_row
        self._encoder_rows = 0  # image rows this step starts
        # images the runner has encoded ahead (StepOutput.images_ready), bounded: one evicted here or from
        # the runner's cache is simply encoded again in its chunk's step
        self.encoded_ahead: OrderedDict[str, None] = OrderedDict()
        self._encode_ahead: list = []  # this step's
        self.sent_ahead: OrderedDict[str, None] = OrderedDict()  # images being encoded ahead (bounded as above)
        self._waits_for_image: Sequence | None = None  # the sequence this step stopped before such an image
        self._step_decodes = 0  # decode rows in this step: streams an image's whole pass would stall

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
        self._prompt_logprob_rows_left = self.max_prompt_logprob_rows or 0
        self._encoder_rows = 0
        self._encode_ahead = []
        self._waits_for_image = None
        preempted, prefilling = self._schedule_decodes(batch)
        self._step_decodes = len(batch)
        allowance = self._prefill_allowance(batch, prefilling)
        preempted = self._schedule_running_prefills(batch, prefilling, allowance) or preempted
        if not preempted:  # a pool that just ran dry admits nobody new this step
            self._schedule_waiting(batch, allowance)
        batch.block_copies = self.kv.pending_copies
        self.kv.pending_copies = []
        batch.loras_in_use = self.loras_in_use()
        if self._encode_ahead:
            batch.encode_ahead = self._encode_ahead
            shares = [max(self.encoder_budget - self._encoder_rows, 0)] if self.encoder_budget is not None else []
            timed = self._encoder_rows_within(allowance)
            batch.encode_ahead_rows = min(shares + ([timed] if timed is not None else []), default=0)
        return batch

    def images_ready(self, content_hashes: list[str]) -> None:
        """The runner has encoded these images ahead: their prompts' chunks may start them."""
        for key in content_hashes:
            self.encoded_ahead[key] = None
            self.encoded_ahead.move_to_end(key)
            self.sent_ahead.pop(key, None)
        while len(self.encoded_ahead) > MAX_ENCODED_AHEAD:
            self.encoded_ahead.popitem(last=False)

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
        threshold = self.step_budget.burst_threshold(len(batch))
        self._burst_wave = [seq for seq in self._burst_wave if self._still_prefilling(seq)]
        if threshold is not None and self._burst_wave:
            burst_rows = threshold  # the wave a burst began goes on until it is in
        else:
            burst_rows = self._burst_rows(prefilling, threshold, room)
        bursts = self.step_budget.num_bursts
        allowance = self.step_budget.allowance(tokens, len(batch), decode_context, pending_rows, pending_context,
                                               burst_rows, step_tokens=batch.total_tokens)
        if self.step_budget.num_bursts > bursts and not self._burst_wave:  # a new burst: its wave is what waits
            self._burst_wave = [seq for seq in itertools.islice(itertools.chain(prefilling, self.waiting), room)
                                if seq.num_tokens - seq.num_computed_tokens <= self.max_num_batched_tokens]
        return allowance

    def _still_prefilling(self, seq: Sequence) -> bool:
        """Whether ``seq`` still has prompt tokens to compute (waiting, or running with more than its next token);
        finished and aborted sequences are neither."""
        if seq in self.waiting:
            return True
        return seq in self.running and seq.num_tokens - seq.num_computed_tokens > 1

    def _burst_rows(self, prefilling: list[Sequence], threshold: int | None, room: int) -> int:
        """Prompts still to compute that fit one token budget, running prefills first, then the queue, up to
        ``threshold`` (counting stops there: the queue may be long) and the seats left."""
        if threshold is None:
            return 0
        limit = min(threshold, room)
        count = 0
        for seq in itertools.chain(prefilling, self.waiting):
            if count >= limit:
                break
            if seq.num_tokens - seq.num_computed_tokens <= self.max_num_batched_tokens:
                count += 1
        return count

    def _schedule_decodes(self, batch: ScheduledBatch) -> tuple[bool, list[Sequence]]:
        """Every running sequence one token from its next sample, within the token budget (one pass
        over the running set); returns whether the pool ran dry, and the running sequences still
        computing their prompts, in admission order."""
        preempted = False
        prefilling = []
        tokens = 0
        for seq in list(self.running):
            if seq not in self.running or is_idle_beam(seq):  # preempted for an earlier one; nothing to do
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
            wanted = self._prompt_logprob_limit(seq, context, seq.num_tokens - context)
            if wanted <= 0:  # this step's prompt-logprob rows are taken: the next chunk waits a step
                continue
            num_new = allowance.grant(context, wanted)
            if num_new <= 0:
                break
            num_new = self._fit_images(seq, context, num_new, allowance)
            if num_new <= 0:  # an image waits for the next step's encoder budget
                continue
            if self._allocate_running(seq, num_new, batch):
                batch.add(seq, num_new)
                allowance.spend(context, num_new)
                self._spend_prompt_logprob_rows(seq, context, num_new)
                self._spend_encoder_rows(seq, context, num_new, allowance)
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
        """The running sequence to preempt first: the worst priority; among equals an idle beam
        (``is_idle_beam``), then the newest."""
        return max(reversed(self.running), key=lambda s: (s.priority, is_idle_beam(s)))

    def _schedule_waiting(self, batch: ScheduledBatch, allowance: PrefillAllowance) -> None:
        loras = self.loras_in_use()
        admitted = []
        for seq in self.waiting:
            if allowance.exhausted:
                break
            if seq in self._preempted_this_step:  # not back in the step that just pushed it out
                continue
            if is_idle_beam(seq):  # its row is in: nothing to recompute before its group steps
                continue
            if self._prompt_logprob_limit(seq, seq.num_computed_tokens, 1) <= 0:
                continue  # this step's prompt-logprob rows are taken; it keeps its place
            seats = 1 + len(seq.pending_children)
            if self.num_seats_taken + seats > self.max_num_seqs and self._victim_for(seq) is None:
                break
            if seq.lora_id is not None and seq.lora_id not in loras and len(loras) >= self.max_loras:
                seq.lora_wait_steps += 1  # no free LoRA slot: let others pass, but not forever
                if seq.lora_wait_steps > LORA_MAX_SKIPPED_STEPS:
                    break
                continue
            num_new = self._admit(seq, allowance, batch)
            if num_new is None:
                if self._waits_for_image is seq:  # its image is encoded ahead: the ones behind it may go
                    continue
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
                cached = self._outside_images(seq, self.kv.find_cached_prefix(seq)) if fresh else []
                context = len(cached) * self.kv.block_size if fresh else seq.num_computed_tokens
                num_new = allowance.grant(context, self._prompt_logprob_limit(seq, context, seq.num_tokens - context))
                if num_new > 0:
                    num_new = self._fit_images(seq, context, num_new, allowance)
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
        self._spend_prompt_logprob_rows(seq, context, num_new)
        self._spend_encoder_rows(seq, context, num_new, allowance)
        return num_new

    def _seconds_per_image_row(self) -> float | None:
        """The tower's measured time per image row; None: not measured (or no vision tower)."""
        per_row = self.encoder_seconds_per_row() if self.encoder_seconds_per_row is not None else None
        return per_row if per_row is not None and per_row > 0 else None

    def _encoder_rows_within(self, allowance: PrefillAllowance) -> int | None:
        """Image rows whose measured tower time fits the step time ``allowance`` has left; None: no bound
        (no step-time target this step, or no measurement yet)."""
        per_row = self._seconds_per_image_row()
        if per_row is None or allowance.seconds is None:
            return None
        return max(int(allowance.seconds / per_row), 0)

    def _fit_images(self, seq: Sequence, context: int, num_new: int, allowance: PrefillAllowance) -> int:
        """A prompt chunk of ``num_new`` tokens after ``context`` cut to the images' rules: it stops before an
        image whose encoding the step's encoder budget cannot take (unless it is the step's first), and under
        ``whole_images`` before an image it would split, or is stretched to the end of one it starts with."""
        images = seq.request.images
        if not images or context >= seq.num_prompt_tokens:
            return num_new
        end, rows = context + num_new, self._encoder_rows
        for image in images:
            first, last = image.offset, image.offset + image.length
            if last <= context or first >= end:
                continue
            if first >= context and image.content_hash not in self.encoded_ahead:  # the chunk starts its encoding
                if self.encoder_budget is not None and rows and rows + image.length > self.encoder_budget:
                    return first - context
                timed = self._encoder_rows_within(allowance) if self._step_decodes else None
                too_big = (self.encoder_budget is not None and image.length > self.encoder_budget) or (
                    timed is not None and image.length > timed) or image.content_hash in self.sent_ahead
                if too_big and self._step_decodes:
                    # its whole pass would stall the decoding streams: encode it ahead, a share a step (and once
                    # sent ahead, until it is done: a noisy time estimate must not start it half-way)
                    if all(a.content_hash != image.content_hash for a in self._encode_ahead):
                        self._encode_ahead.append(image)
                        self.sent_ahead[image.content_hash] = None
                        while len(self.sent_ahead) > MAX_ENCODED_AHEAD:
                            self.sent_ahead.popitem(last=False)
                    self._waits_for_image = seq
                    return first - context
                rows += image.length
            if self.whole_images and last > end:
                if first > context:
                    return first - context
                end = last  # the chunk starts at the image: all of it, whatever the token budget says
        return end - context

    def _spend_encoder_rows(self, seq: Sequence, context: int, num_new: int, allowance: PrefillAllowance) -> None:
        for image in seq.request.images:
            if context <= image.offset < context + num_new:
                if image.content_hash in self.encoded_ahead:  # its rows are in the runner's cache
                    del self.encoded_ahead[image.content_hash]
                    continue
                self._encoder_rows += image.length
                per_row = self._seconds_per_image_row()
                if per_row is not None and allowance.seconds is not None:  # the tower's time comes out of the step's too
                    allowance.seconds = max(allowance.seconds - image.length * per_row, 0.0)

    def _outside_images(self, seq: Sequence, cached: list[int]) -> list[int]:
        """Under ``whole_images``, the cached prefix cut back to end where no image is half computed."""
        if not self.whole_images or not cached or not seq.request.images:
            return cached
        end = len(cached) * self.kv.block_size
        for image in seq.request.images:
            if image.offset < end < image.offset + image.length:
                end = image.offset
        return cached[:end // self.kv.block_size]

    def _prompt_logprob_limit(self, seq: Sequence, context: int, wanted: int) -> int:
        """``wanted`` prompt tokens (after ``context`` computed ones) cut so that the logprob rows
        of the chunk fit what is left of this step's bound (positions already reported, being
        recomputed after a preemption, need no rows)."""
        if self.max_prompt_logprob_rows is None or not seq.wants_prompt_logprobs:
            return wanted
        free = max(seq.prompt_logprob_pos - context, 0)
        return min(wanted, free + self._prompt_logprob_rows_left)

    def _spend_prompt_logprob_rows(self, seq: Sequence, context: int, num_new: int) -> None:
        """Count the logprob rows a chunk computes (the rows EngineCore._plan_logits asks for)."""
        if self.max_prompt_logprob_rows is None or not seq.wants_prompt_logprobs:
            return
        lo = max(context, seq.prompt_logprob_pos)
        hi = min(context + num_new, seq.num_prompt_tokens - 1)
        self._prompt_logprob_rows_left -= max(hi - lo, 0)

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """The running sequence a waiting ``seq`` may preempt: the worst running one if its priority
        is worse, or if it is an idle beam of the same priority (idle beams holding the pool must
        not keep out the sequences their groups wait for: that was a deadlock)."""
        if not self.running:
            return None
        worst = self._worst_running()
        if worst.priority > seq.priority or (worst.priority == seq.priority and is_idle_beam(worst)):
            return worst
        return None

    def _preempt_for(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Preempt the running sequence ``seq`` may displace (``_victim_for``), if any."""
        victim = self._victim_for(seq)
        if victim is None:
            return False
        self._preempt(victim, batch)
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

