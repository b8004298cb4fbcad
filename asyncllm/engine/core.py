"""EngineCore: the step loop (schedule, run the model, sample, update) behind both fronts.

Nothing here knows about asyncio or threads beyond one thread-safe inbox: ``add_request``,
``abort_request`` and ``stop_sequence`` may be called from any thread; their effect happens at
the top of the next ``step()``, which only the engine's own thread calls.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapters.registry import LoRARegistry
from ..config import EngineConfig
from ..errors import InvalidRequestError
from ..kernels.transfer import to_device
from ..model.loader import load_hf_config
from ..model.source import resolve_model_source
from ..model.sampler import SamplingRow, prompt_logprobs, sample
from ..structured import prefetch_masks
from .beam_search import BeamGroup
from .speculation import (NgramProposer, SpeculationStats, SpeculativeConfig, grammar_states_along, plan_drafts,
                          record_outcome)
from .kv_cache import KVCacheManager
from .request import EngineRequest, Sequence, SequenceStatus
from .scheduler import ScheduledBatch, Scheduler, prompt_logprob_rows
from .step_budget import StepBudget
from .step_time import StepTimeModel, calibrate
from .block_tables import BlockTableRows
from .executor import Executor
from .step_input import step_input_of
from .stopping import StopChecker, resolve_max_model_len

logger = logging.getLogger(__name__)


@dataclass
class SequenceOutput:
    """What one sequence produced in one step (a delta)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    serial: int = 0  # EngineRequest.serial: tells a reused request id's new request from the old one
    embedding: list[float] | None = None  # an embedding request's vector, with its finish


class EngineCore:
    """Owns the model runner, the KV-cache manager and the scheduler; one ``step()`` at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model_source(config.model, config.revision, config.hf_token)
        root: Path = self.source.root
        self.model_dir = root  # config, tokenizer and generation config files
        self.hf_config = load_hf_config(root, config.model_impl)
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.runner = Executor(config, self.hf_config, self.source, self.max_model_len)
        self.vocab_size = self.runner.shape.vocab_size
        self.token_budget = config.max_num_batched_tokens or self.runner.platform.default_token_budget
        # the step-time model outlives resets: it describes the machine and the model, not the requests
        self.step_time = StepTimeModel()
        self.step_time.stack_limits = getattr(self.runner, "stack_limits", None)
        if config.max_itl_ms is not None:
            calibrate(self.step_time, self.runner, self.token_budget, config.max_num_seqs, self.max_model_len)
        self._build_scheduling_state()
        # adapters are checked against the whole model (the slots cut them per tensor-parallel rank);
        # the transformers backend says where they go in its own modules
        layout = None if self.runner.architecture.native else self.runner.lora.layout
        self.loras = LoRARegistry(self.runner.shape, config.max_lora_rank, config.max_cpu_loras, layout)
        self.stop_checker = StopChecker(root, self.hf_config, self.max_model_len)
        self.generator = torch.Generator(self.runner.device).manual_seed(config.seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sequences: dict[str, list[Sequence]] = {}
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = self._build_proposer()
        self.spec_stats = SpeculationStats()

    def _build_proposer(self):
        spec = self.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        from .draft_model import DraftModelProposer  # loads a second model: only when asked for
        return DraftModelProposer(self.config, spec, self.runner, self.max_model_len, self.token_budget)

    def _build_scheduling_state(self) -> None:
        config = self.config
        windows = self.runner.shape.layer_windows  # every layer windowed: blocks behind the widest are freed
        window = max(windows) if windows and all(w is not None for w in windows) else None
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching, window)
        step_budget = StepBudget(self.step_time, config.max_itl_ms) if config.max_itl_ms is not None else None
        vision = getattr(self.runner.shape, "vision", None)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.token_budget, config.max_loras, step_budget,
                                   prompt_logprob_rows(self.vocab_size),
                                   whole_images=bool(getattr(vision, "bidirectional", False)),
                                   encoder_budget=config.encoder_token_budget or self.token_budget,
                                   encoder_seconds_per_row=self._encoder_seconds_per_row)
        self.block_table_rows = BlockTableRows(config.max_num_seqs)

    def reset(self) -> None:
        """Forget every request and free every KV block, keeping the model: the engine after a fault.

        The weights are read-only during a step, so they survive any failure of one; everything a
        step mutates (block pool and prefix cache, queues, sequences, the inbox) is built anew. The
        counters (preemptions, prefix-cache queries and hits) start again from zero. Call it only
        while no step runs (from the engine thread, or with that thread stopped)."""
        while True:  # drop what was queued for the old state (requests whose streams were failed)
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        self._sequences = {}
        self._build_scheduling_state()
        self._drop_encodes_ahead()
        if self.proposer is not None:
            self.proposer.reset()

    @property
    def healthy(self) -> bool:
        """False when the engine cannot go on even after a reset (a tensor-parallel worker is gone)."""
        return self.runner.healthy

    def shutdown(self) -> None:
        """Release what outlives the object: the tensor-parallel worker processes. Call with no step running."""
        self.runner.shutdown()

    # ---- thread-safe entry points -------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue ``request``; InvalidRequestError (nothing queued) if it could never be scheduled."""
        self.check_fits(request)
        self._inbox.put(("add", request))

    def check_fits(self, request: EngineRequest) -> None:
        """Refuse a request that no schedule could complete: one of its sequences at its longest
        (prompt plus ``max_tokens - 1`` positions of KV) needs more blocks than the whole cache.

        One sequence fitting alone is enough: sequences are preempted one at a time, beams included
        (a beam group whose beams do not fit together computes them in turns, scheduler.py), so a
        request that passes always finishes. The engine's start already refuses a cache smaller
        than one ``max_model_len`` sequence, so with its own configuration this never triggers;
        it keeps a request that cannot run from blocking the queue forever."""
        if self.kv.window is not None:  # blocks behind the window are given back as it advances
            return
        block_size, total = self.kv.block_size, self.kv.num_blocks
        positions = len(request.prompt_token_ids) + max(request.max_tokens, 1) - 1
        needed = -(-positions // block_size)
        if needed > total:
            what = f"each of its {request.params.num_sequences} beams" if request.params.use_beam_search \
                else "one sequence"
            raise InvalidRequestError(
                f"max_tokens: the prompt's {len(request.prompt_token_ids)} tokens and {request.max_tokens} new ones "
                f"need {needed} KV blocks of {block_size} tokens for {what}, but the KV cache has {total} blocks",
                field="max_tokens")

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop_sequence(self, request_id: str, index: int) -> None:
        """Finish one sequence early (a stop string was found by the detokenizer)."""
        self._inbox.put(("stop", (request_id, index)))

    # ---- the engine thread ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._sequences) or not self._inbox.empty()

    def queued_count(self) -> int:
        """Requests, aborts and stops put in the inbox and not applied yet (approximate, as queue sizes are)."""
        return self._inbox.qsize()

    def step(self) -> list[SequenceOutput]:
        """Apply queued requests/aborts, run one batch, and return every sequence's delta."""
        outputs = self.apply_pending()
        batch = self.scheduler.schedule()
        if batch.seqs:
            if self.scheduler.step_budget is None:
                outputs.extend(self._run(batch))
            else:  # the policy's model learns from every step it shaped
                features = self.step_time.features(batch)
                begin = time.perf_counter()
                outputs.extend(self._run(batch))
                self.step_time.observe(features, time.perf_counter() - begin)
        if not self.scheduler.num_unfinished:  # idle: no image encoded ahead can still be wanted
            self._drop_encodes_ahead()
        return outputs

    def _drop_encodes_ahead(self) -> None:
        embeddings = getattr(self.runner, "image_embeddings", None)
        if embeddings is not None and embeddings.pending:
            embeddings.clear_pending()

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self.scheduler.running),
            "num_running_requests": len({seq.request_id for seq in self.scheduler.running}),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": self.kv.num_used_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "loras_in_use": len(self.scheduler.loras_in_use()),
            "itl_target_ms": self._itl_target_ms(),
            "num_prefill_bursts": self.scheduler.step_budget.num_bursts if self.scheduler.step_budget else 0,
            "spec_num_drafts": self.spec_stats.num_drafts,
            "spec_draft_tokens": self.spec_stats.num_draft_tokens,
            "spec_accepted_tokens": self.spec_stats.num_accepted_tokens,
        }

    def _itl_target_ms(self) -> int:
        """The stall-free policy's target of the latest step that had decodes (0: none yet, or no policy)."""
        budget = self.scheduler.step_budget
        if budget is None or budget.last_target_seconds is None:
            return 0
        return round(1000 * budget.last_target_seconds)

    def apply_pending(self) -> list[SequenceOutput]:
        """Apply queued requests, aborts and stops now, without running the model."""
        outputs: list[SequenceOutput] = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                self._admit(payload)
            elif kind == "abort":
                unfinished = [seq for seq in self._sequences.get(payload, []) if not seq.is_finished]
                for seq in unfinished:  # children still awaiting their fork are reported too
                    outputs.append(self._finish(seq, "abort", None, [], []))
            elif kind == "stop":
                request_id, index = payload
                seqs = self._sequences.get(request_id, [])
                if index < len(seqs) and not seqs[index].is_finished:
                    self._finish(seqs[index], "stop", None, [], [])

    def _admit(self, request: EngineRequest) -> None:
        for stale in self._sequences.pop(request.request_id, []):
            # The fronts keep live ids unique, so an id still here belongs to a request its front has
            # already finished (e.g. its stop-string stop is still queued): drop it without a word.
            if not stale.is_finished:
                self.scheduler.finish(stale)
        rope_key = self.runner.rope_cache_key(len(request.prompt_token_ids))
        if rope_key is not None:  # length-dependent rope: KV rotated for another prompt length is not reusable
            request.cache_salt = (request.cache_salt, ("rope", rope_key))
        seqs = [Sequence(request, i, self._generator_for(request, i)) for i in range(request.params.num_sequences)]
        request.num_unfinished = len(seqs)
        leader = seqs[0]
        if request.params.use_beam_search:
            params = request.params
            end_tokens = set() if params.ignore_eos else set(self.stop_checker.eos_token_ids)
            group = BeamGroup(seqs, request.max_tokens, end_tokens, set(params.stop_token_ids or ()))
            for seq in seqs:
                seq.beam_group = group
        if request.grammar is not None:  # children clone the leader's state when they fork
            leader.grammar = request.grammar.new_state()
        for child in seqs[1:]:
            child.status = SequenceStatus.AWAITING_FORK
        leader.pending_children = seqs[1:]
        self._sequences[request.request_id] = seqs
        self.scheduler.add(leader)

    def _encoder_seconds_per_row(self) -> float | None:
        """The vision tower's measured time per image row (model/image_embeddings.py); None: not measured."""
        embeddings = getattr(self.runner, "image_embeddings", None)
        return embeddings.seconds_per_row if embeddings is not None else None

    def _generator_for(self, request: EngineRequest, index: int) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        seed = seed if index == 0 else (seed * 1_000_003 + index) & (2**63 - 1)
        return torch.Generator(self.runner.device).manual_seed(seed)

    def _run(self, batch: ScheduledBatch) -> list[SequenceOutput]:
        rows, plans, pools, pool_rows = self._plan_logits(batch)
        self._prefetch_grammar_masks(batch, plans)
        result = self.runner.execute(step_input_of(batch, rows, self.block_table_rows, pool_rows))
        if result.images_ready:
            self.scheduler.images_ready(result.images_ready)
        logits = result.logits
        prompt_lps: dict[int, list[dict[int, float]]] = {}
        to_sample: list[tuple[Sequence, int, int]] = []  # (sequence, first logits row, drafts verified)
        to_rank: list[tuple[Sequence, int]] = []
        for seq, n, (prompt_plan, sample_row, num_drafts) in zip(batch.seqs, batch.num_new_tokens, plans):
            # drafts verified this step count as computed only once accepted (_sample_and_update)
            seq.num_computed_tokens += min(n, seq.num_tokens - seq.num_computed_tokens)
            self.kv.cache_full_blocks(seq)
            self.kv.release_outside_window(seq)
            if prompt_plan is not None:
                row, lo, hi = prompt_plan
                k = seq.params.prompt_logprobs
                prompt_lps[id(seq)] = prompt_logprobs(logits[row:row + hi - lo], seq.token_ids[lo + 1:hi + 1], k)
                seq.prompt_logprob_pos = hi
            if sample_row is None:
                continue
            if seq.beam_group is not None:  # the beams' next-token distributions, ranked per group below
                to_rank.append((seq, sample_row))
                self.scheduler.start_children(seq)  # the other beams: forks of the prompt, until the first step
                continue
            to_sample.append((seq, sample_row, num_drafts))
            for child in self.scheduler.start_children(seq):
                if seq.grammar is not None:  # forked before the leader samples: same (empty) progress
                    child.grammar = seq.grammar.fork()
                to_sample.append((child, sample_row, 0))
        outputs = self._sample_and_update(logits, to_sample, prompt_lps)
        if to_rank:
            outputs.extend(self._step_beams(logits, to_rank))
        if pools:
            outputs.extend(self._pool(result.pooled, pools))
        for seq in batch.seqs:  # prompt chunks that sampled nothing still report their logprobs
            if id(seq) in prompt_lps:
                outputs.append(SequenceOutput(seq.request_id, seq.index, [], [], None, prompt_lps.pop(id(seq)),
                                              serial=seq.request.serial))
        return outputs

    def _pool(self, hidden: torch.Tensor | None, pools: list[tuple[Sequence, int, int, bool]]) -> list[SequenceOutput]:
        """Embedding requests: fold this step's hidden states in (``pools``: sequence, first pooled row,
        rows, whether its prompt is complete); those whose prompt is complete finish with their
        (L2-normalised) embedding."""
        outputs = []
        for seq, first, count, done in pools:
            if not count:  # last-token pooling, an earlier chunk of the prompt: nothing to keep yet
                continue
            rows = hidden[first:first + count]
            if seq.request.pooling == "mean":
                total = rows.sum(dim=0)
                seq.pooled_sum = total if seq.pooled_sum is None else seq.pooled_sum + total
            if not done:
                continue
            vector = seq.pooled_sum / seq.num_tokens if seq.request.pooling == "mean" else rows[-1]
            vector = torch.nn.functional.normalize(vector, dim=0)
            output = self._finish(seq, "stop", None, [], [])
            output.embedding = vector.tolist()
            outputs.append(output)
        return outputs

    def _step_beams(self, logits: torch.Tensor, to_rank: list[tuple[Sequence, int]]) -> list[SequenceOutput]:
        """Hand each beam its log-probabilities; groups whose beams all have theirs take a beam step
        (a preempted beam's group waits for its recomputation)."""
        index = to_device([row for _, row in to_rank], logits.device)
        logprobs = torch.log_softmax(logits[index].float(), dim=-1)
        outputs: list[SequenceOutput] = []
        for (seq, _), row in zip(to_rank, logprobs):
            group = seq.beam_group
            if group.offer(seq, row) and group.step(self.kv):
                outputs.extend(self._finish_beams(group))
        return outputs

    def _finish_beams(self, group: BeamGroup) -> list[SequenceOutput]:
        """End a beam search: free every beam, report the n best hypotheses as sequences 0..n-1."""
        request = group.beams[0].seq.request
        for seq in group.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "stop"
        request.num_unfinished = 0
        if (seqs := self._sequences.get(request.request_id)) and seqs[0].request is request:
            del self._sequences[request.request_id]
        return [SequenceOutput(request.request_id, i, h.token_ids, h.logprobs, h.top_logprobs, None,
                               h.finish_reason, h.stop_reason, group.beams[0].seq.num_cached_tokens, request.serial)
                for i, h in enumerate(group.best(request.params.n))]

    def _prefetch_grammar_masks(self, batch: ScheduledBatch, plans) -> None:
        """Constrained sequences that sample this step get their token masks computed while the model
        runs (the grammar engine works in its own threads, without the GIL). On CPU this competes with
        the model for the cores and still wins since the fused CPU kernels landed (W-JSON 0.82-0.84 ->
        0.89-0.92 of unconstrained throughput, docs/benchmarks.md)."""
        states = [seq.grammar for seq, (_, sample_row, _) in zip(batch.seqs, plans)
                  if sample_row is not None and seq.grammar is not None]
        if states:
            prefetch_masks(states, self.vocab_size)

    def _plan_logits(self, batch: ScheduledBatch):
        """Which flat token positions need logits: each sequence's last one when it samples,
        and every prompt position whose logprob was asked for (prompt_logprobs); and which need
        their hidden states (embedding requests: the last position, or every one for mean pooling)."""
        rows: list[int] = []
        plans = []
        pools: list[tuple[Sequence, int, int, bool]] = []  # (sequence, first pool row, rows, last chunk)
        pool_rows: list[int] = []
        flat = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if seq.request.pooling is not None:
                done = end == seq.num_tokens
                wanted = range(flat, flat + n) if seq.request.pooling == "mean" else \
                    range(flat + n - 1, flat + n) if done else range(0)
                pools.append((seq, len(pool_rows), len(wanted), done))
                pool_rows.extend(wanted)
                plans.append((None, None, 0))
                flat += n
                continue
            prompt_plan = None
            if seq.wants_prompt_logprobs:
                lo, hi = max(start, seq.prompt_logprob_pos), min(end, seq.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_plan = (len(rows), lo, hi)
                    rows.extend(range(flat + lo - start, flat + hi - start))
            sample_row = None
            if end >= seq.num_tokens:  # past it: drafts to verify, one logits row each (speculation.py)
                sample_row = len(rows)
                first = flat + n - 1 - (end - seq.num_tokens)
                rows.extend(range(first, flat + n))
            plans.append((prompt_plan, sample_row, max(end - seq.num_tokens, 0)))
            flat += n
        return rows, plans, pools, pool_rows

    def _sample_and_update(self, logits: torch.Tensor, to_sample: list[tuple[Sequence, int, int]],
                           prompt_lps: dict[int, list]) -> list[SequenceOutput]:
        """Sample every sequence's next token(s): ``(sequence, first logits row, drafts verified)``;
        one row each, or 1 + k rows for a sequence that verifies k drafts (the drafts before a row
        count as generated in it, speculation.py)."""
        if not to_sample:
            return []
        rows: list[SamplingRow] = []
        index: list[int] = []
        drafts_of: list[list[int]] = []
        for seq, row, num_drafts in to_sample:
            drafts = seq.draft_tokens[:num_drafts]
            drafts_of.append(drafts)
            rows.append(self._sampling_row(seq))
            for j in range(len(drafts)):
                grammar = seq.draft_grammars[j] if seq.grammar is not None else None
                rows.append(self._sampling_row(seq, drafts[:j + 1], grammar))
            index.extend(range(row, row + len(drafts) + 1))
        if index != list(range(logits.shape[0])):  # usually every row, in order: no gather
            logits = logits[to_device(index, logits.device)]
        result = sample(logits, rows, self.generator, fused_greedy=self.runner.platform.fused_greedy)
        outputs = []
        at = 0
        for (seq, _, _), drafts in zip(to_sample, drafts_of):
            picks = result.token_ids[at:at + len(drafts) + 1]
            accepted = 0
            while accepted < len(drafts) and picks[accepted] == drafts[accepted]:
                accepted += 1
            if drafts:
                self._count_verification(seq, len(drafts), accepted)
            outputs.append(self._append_tokens(seq, picks[:accepted + 1], result, at, prompt_lps.pop(id(seq), None)))
            at += len(drafts) + 1
        if self.proposer is not None:
            self._propose(to_sample)
        return outputs

    def _append_tokens(self, seq: Sequence, tokens: list[int], result, at: int, lps) -> SequenceOutput:
        """Append the step's tokens one by one (stop checks and grammar after each: a stop inside
        accepted drafts drops what follows it); their KV, but the last one's, was computed."""
        new: list[int] = []
        logprobs: list[float] = []
        tops: list[dict[int, float]] | None = [] if result.top_logprobs[at] is not None else None
        reason = stop_reason = None
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            new.append(token)
            logprobs.append(result.logprobs[at + i])
            if tops is not None:
                tops.append(result.top_logprobs[at + i])
            reason, stop_reason = self.stop_checker.check(seq, token)
            if reason is None and seq.grammar is not None:
                reason = self._advance_grammar(seq, token)
            if seq.grammar is not None and seq.grammar.failed:  # gave up (even where EOS said "stop"): an error
                reason, stop_reason = "error", seq.grammar.failure
            if reason is not None:
                break
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.draft_tokens, seq.draft_grammars = [], []
        if len(tokens) > 1:
            self.kv.cache_full_blocks(seq)
        if reason is not None:
            return self._finish(seq, reason, stop_reason, new, logprobs, tops, lps)
        return SequenceOutput(seq.request_id, seq.index, new, logprobs, tops, lps,
                              num_cached_tokens=seq.num_cached_tokens, serial=seq.request.serial)

    def _count_verification(self, seq: Sequence, proposed: int, accepted: int) -> None:
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted
        record_outcome(seq, proposed, accepted)

    def _propose(self, sampled: list[tuple[Sequence, int, int]]) -> None:
        """Drafts for the sequences that just sampled and go on (speculation.py): within their
        output budget and the context length; filtered by their grammar when constrained."""
        items = []
        for seq, _, _ in sampled:
            if seq.is_finished or seq.beam_group is not None:
                continue
            limit = min(seq.request.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
            if limit > 0:
                limit = min(limit, plan_drafts(seq, self.speculative.num_speculative_tokens))
            if limit > 0:
                items.append((seq, limit))
        if not items:
            return
        for (seq, _), drafts in zip(items, self.proposer.propose_many(items)):
            if drafts and seq.grammar is not None:
                drafts, seq.draft_grammars = grammar_states_along(seq.grammar, drafts)
            seq.draft_tokens = drafts

    def _sampling_row(self, seq: Sequence, drafts: list[int] = (), grammar=None) -> SamplingRow:
        """The sampler's view of ``seq``; with ``drafts``: of the position after them (``grammar``: the
        sequence's grammar state advanced over them)."""
        blocked = self.stop_checker.min_tokens_blocked(seq.params) if seq.params.min_tokens else []
        output = seq.output_token_ids + list(drafts) if drafts else seq.output_token_ids
        return SamplingRow(seq.params, seq.token_ids[:seq.num_prompt_tokens], output,
                           seq.generator, blocked, grammar if drafts else seq.grammar, seq.request.bad_words_ids)

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> str | None:
        """Feed the sampled token to the sequence's matcher (once: recomputation never replays it);
        "stop" once the grammar is complete. A rejected token (the grammar engine's own failure)
        ends the sequence rather than the engine."""
        if not seq.grammar.accept(token):
            logger.warning("request %s: grammar rejected token %d (%s); finishing the sequence",
                           seq.request_id, token, seq.grammar.error)
            return "stop"
        return "stop" if seq.grammar.is_finished else None

    def _finish(self, seq: Sequence, reason: str, stop_reason, tokens: list[int], logprobs: list[float],
                top=None, prompt_lps=None) -> SequenceOutput:
        request = seq.request
        if not seq.is_finished:  # an unforked child was finished with its leader: counted then
            request.num_unfinished -= 1 + len(seq.pending_children)  # a counter: O(1) per sequence
        self.scheduler.finish(seq)
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seqs = self._sequences.get(seq.request_id)
        if request.num_unfinished == 0 and seqs and seqs[0].request is request:
            del self._sequences[seq.request_id]
        return SequenceOutput(seq.request_id, seq.index, tokens, logprobs, top, prompt_lps, reason, stop_reason,
                              seq.num_cached_tokens, seq.request.serial)
