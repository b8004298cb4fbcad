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
from ..model.loader import load_hf_config
from ..model.source import resolve_model_source
from ..model.runner import ModelRunner
from ..model.sampler import SamplingRow, prompt_logprobs, sample
from ..structured import prefetch_masks
from .kv_cache import KVCacheManager
from .request import EngineRequest, Sequence, SequenceStatus
from .scheduler import ScheduledBatch, Scheduler
from .step_budget import StepBudget
from .step_time import StepFeatures, StepTimeModel, calibrate
from .block_tables import BlockTableRows
from .step_input import StepInput
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


class EngineCore:
    """Owns the model runner, the KV-cache manager and the scheduler; one ``step()`` at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model_source(config.model, config.revision, config.hf_token)
        root: Path = self.source.root
        self.model_dir = root  # config, tokenizer and generation config files
        self.hf_config = load_hf_config(root)
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.runner = ModelRunner(config, self.hf_config, self.source, self.max_model_len)
        self.vocab_size = self.runner.shape.vocab_size
        self.token_budget = config.max_num_batched_tokens or self.runner.platform.default_token_budget
        # the step-time model outlives resets: it describes the machine and the model, not the requests
        self.step_time = StepTimeModel()
        if config.max_itl_ms is not None:
            calibrate(self.step_time, self.runner, self.token_budget, config.max_num_seqs, self.max_model_len)
        self._build_scheduling_state()
        self.loras = LoRARegistry(self.runner.shape, config.max_lora_rank, config.max_cpu_loras)
        self.stop_checker = StopChecker(root, self.hf_config, self.max_model_len)
        self.generator = torch.Generator(self.runner.device).manual_seed(config.seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sequences: dict[str, list[Sequence]] = {}

    def _build_scheduling_state(self) -> None:
        config = self.config
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        step_budget = StepBudget(self.step_time, config.max_itl_ms) if config.max_itl_ms is not None else None
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.token_budget, config.max_loras, step_budget)
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

    # ---- thread-safe entry points -------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        self._inbox.put(("add", request))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop_sequence(self, request_id: str, index: int) -> None:
        """Finish one sequence early (a stop string was found by the detokenizer)."""
        self._inbox.put(("stop", (request_id, index)))

    # ---- the engine thread ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._sequences) or not self._inbox.empty()

    def step(self) -> list[SequenceOutput]:
        """Apply queued requests/aborts, run one batch, and return every sequence's delta."""
        outputs = self.apply_pending()
        batch = self.scheduler.schedule()
        if batch.seqs:
            if self.scheduler.step_budget is None:
                outputs.extend(self._run(batch))
            else:  # the policy's model learns from every step it shaped
                features = StepFeatures.of_batch(batch)
                begin = time.perf_counter()
                outputs.extend(self._run(batch))
                self.step_time.observe(features, time.perf_counter() - begin)
        return outputs

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
        seqs = [Sequence(request, i, self._generator_for(request, i)) for i in range(request.params.n)]
        request.num_unfinished = len(seqs)
        leader = seqs[0]
        if request.grammar is not None:  # children clone the leader's state when they fork
            leader.grammar = request.grammar.new_state()
        for child in seqs[1:]:
            child.status = SequenceStatus.AWAITING_FORK
        leader.pending_children = seqs[1:]
        self._sequences[request.request_id] = seqs
        self.scheduler.add(leader)

    def _generator_for(self, request: EngineRequest, index: int) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        seed = seed if index == 0 else (seed * 1_000_003 + index) & (2**63 - 1)
        return torch.Generator(self.runner.device).manual_seed(seed)

    def _run(self, batch: ScheduledBatch) -> list[SequenceOutput]:
        rows, plans = self._plan_logits(batch)
        self._prefetch_grammar_masks(batch, plans)
        logits = self.runner.execute(StepInput.from_batch(batch, rows, self.block_table_rows))
        prompt_lps: dict[int, list[dict[int, float]]] = {}
        to_sample: list[tuple[Sequence, int]] = []
        for seq, n, (prompt_plan, sample_row) in zip(batch.seqs, batch.num_new_tokens, plans):
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
            if prompt_plan is not None:
                row, lo, hi = prompt_plan
                k = seq.params.prompt_logprobs
                prompt_lps[id(seq)] = prompt_logprobs(logits[row:row + hi - lo], seq.token_ids[lo + 1:hi + 1], k)
                seq.prompt_logprob_pos = hi
            if sample_row is not None:
                to_sample.append((seq, sample_row))
                for child in self.scheduler.start_children(seq):
                    if seq.grammar is not None:  # forked before the leader samples: same (empty) progress
                        child.grammar = seq.grammar.fork()
                    to_sample.append((child, sample_row))
        outputs = self._sample_and_update(logits, to_sample, prompt_lps)
        for seq in batch.seqs:  # prompt chunks that sampled nothing still report their logprobs
            if id(seq) in prompt_lps:
                outputs.append(SequenceOutput(seq.request_id, seq.index, [], [], None, prompt_lps.pop(id(seq)),
                                              serial=seq.request.serial))
        return outputs

    def _prefetch_grammar_masks(self, batch: ScheduledBatch, plans) -> None:
        """Constrained sequences that sample this step get their token masks computed while the model
        runs (the grammar engine works in its own threads, without the GIL). On CPU this competes with
        the model for the cores and still wins since the fused CPU kernels landed (W-JSON 0.82-0.84 ->
        0.89-0.92 of unconstrained throughput, docs/benchmarks.md)."""
        states = [seq.grammar for seq, (_, sample_row) in zip(batch.seqs, plans)
                  if sample_row is not None and seq.grammar is not None]
        if states:
            prefetch_masks(states, self.vocab_size)

    def _plan_logits(self, batch: ScheduledBatch):
        """Which flat token positions need logits: each sequence's last one when it samples,
        and every prompt position whose logprob was asked for (prompt_logprobs)."""
        rows: list[int] = []
        plans = []
        flat = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            prompt_plan = None
            if seq.wants_prompt_logprobs:
                lo, hi = max(start, seq.prompt_logprob_pos), min(end, seq.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_plan = (len(rows), lo, hi)
                    rows.extend(range(flat + lo - start, flat + hi - start))
            sample_row = None
            if end == seq.num_tokens:
                sample_row = len(rows)
                rows.append(flat + n - 1)
            plans.append((prompt_plan, sample_row))
            flat += n
        return rows, plans

    def _sample_and_update(self, logits: torch.Tensor, to_sample: list[tuple[Sequence, int]],
                           prompt_lps: dict[int, list]) -> list[SequenceOutput]:
        if not to_sample:
            return []
        rows = [self._sampling_row(seq) for seq, _ in to_sample]
        index = torch.tensor([row for _, row in to_sample], device=logits.device)
        result = sample(logits[index], rows, self.generator, fused_greedy=self.runner.platform.fused_greedy)
        outputs = []
        for i, (seq, _) in enumerate(to_sample):
            token = result.token_ids[i]
            seq.token_ids.append(token)
            top = [result.top_logprobs[i]] if result.top_logprobs[i] is not None else None
            reason, stop_reason = self.stop_checker.check(seq, token)
            if reason is None and seq.grammar is not None:
                reason = self._advance_grammar(seq, token)
            lps = prompt_lps.pop(id(seq), None)
            if reason is not None:
                outputs.append(self._finish(seq, reason, stop_reason, [token], [result.logprobs[i]], top, lps))
            else:
                outputs.append(SequenceOutput(seq.request_id, seq.index, [token], [result.logprobs[i]], top, lps,
                                              num_cached_tokens=seq.num_cached_tokens, serial=seq.request.serial))
        return outputs

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        blocked = self.stop_checker.min_tokens_blocked(seq.params) if seq.params.min_tokens else []
        return SamplingRow(seq.params, seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids,
                           seq.generator, blocked, seq.grammar)

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
