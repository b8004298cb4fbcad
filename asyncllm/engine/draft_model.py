"""Draft-model proposals for speculative decoding: a small model of the same vocabulary guesses the
next k tokens greedily (engine/speculation.py verifies them against the target model).

The draft keeps its own paged KV cache and block pool (no prefix caching, no sharing between
sequences): it never touches the target's blocks, so forks, copy-on-write and prefix hits of the
target need no mirroring. Each sequence's draft state is the number of its tokens whose draft KV is
valid; a proposal first catches up on the tokens the draft has not seen (the prompt, then the
accepted tokens and the step's last one, as one chunk), then decodes ``k - 1`` more tokens.
Draft KV of accepted drafts stays valid (they were computed from the same tokens); what follows a
rejection is recomputed. Sequences that finished are released lazily at the next proposal.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from ..config import EngineConfig
from ..errors import ConfigError
from ..model.loader import load_hf_config
from ..model.runner import ModelRunner
from ..model.shape import DecoderShape
from ..model.source import resolve_model_source
from .block_pool import BlockPool
from .kv_cache import blocks_for
from .request import Sequence
from .speculation import Proposer, SpeculativeConfig
from ..model.step_io import StepInput

logger = logging.getLogger(__name__)


@dataclass
class _DraftState:
    table: list[int] = field(default_factory=list)   # the draft's KV blocks of this sequence
    computed: int = 0                                 # tokens whose draft KV is valid
    proposed_at: int = 0                              # len(token_ids) when the last drafts were made
    drafts: list[int] = field(default_factory=list)   # those drafts (their KV is valid if accepted)


class DraftModelProposer(Proposer):
    """Greedy proposals from a draft checkpoint run beside the target (same device and dtype)."""

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: ModelRunner, max_model_len: int,
                 token_budget: int) -> None:
        self.k = spec.num_speculative_tokens
        self.block_size = config.block_size
        self.token_budget = token_budget
        source = resolve_model_source(spec.model, None, config.hf_token)
        hf_config = load_hf_config(source.root)
        shape = DecoderShape.from_hf_config(hf_config)
        if shape.vocab_size != target.shape.vocab_size:
            raise ConfigError(f"speculative_config.model: the draft's vocabulary ({shape.vocab_size} tokens) differs "
                              f"from the target's ({target.shape.vocab_size}); the draft must share its tokenizer")
        itemsize = torch.finfo(target.dtype).bits // 8
        bytes_per_block = 2 * shape.num_layers * self.block_size * shape.num_kv_heads * shape.head_dim * itemsize
        draft_config = dataclasses.replace(
            config, model=spec.model, revision=None, quantization=None, speculative_config=None,
            enable_cuda_graphs=False, max_loras=1, kv_cache_memory=bytes_per_block * target.num_blocks,
            tensor_parallel_size=1, nnodes=1, node_rank=0,  # the draft runs whole on rank 0
            dtype=str(target.dtype).removeprefix("torch."), device=str(target.device))
        self.runner = ModelRunner(draft_config, hf_config, source, max_model_len)
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=False)
        self._states: dict[Sequence, _DraftState] = {}
        logger.info("draft model %s: %d layers, %d KV blocks", spec.model, shape.num_layers, self.runner.num_blocks)

    def reset(self) -> None:
        """Forget every sequence (the engine was reset)."""
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=False)
        self._states = {}

    def propose_many(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for each (sequence, limit): at most ``min(k, limit)`` tokens, [] where the draft's
        KV blocks ran out."""
        self._release_finished()
        work: list[tuple[int, Sequence, _DraftState, int]] = []
        for i, (seq, limit) in enumerate(items):
            limit = min(self.k, limit)
            state = self._states.setdefault(seq, _DraftState())
            self._keep_accepted(seq, state)
            if limit > 0 and self._reserve(state, seq.num_tokens + limit - 1):
                work.append((i, seq, state, limit))
        drafts: list[list[int]] = [[] for _ in items]
        group: list = []
        tokens = 0
        for entry in work:  # catch-up chunks (prompts, at first) within the engine's token budget per call
            catch_up = entry[1].num_tokens - entry[2].computed
            if group and tokens + catch_up > self.token_budget:
                self._run_group(group, drafts)
                group, tokens = [], 0
            group.append(entry)
            tokens += catch_up
        if group:
            self._run_group(group, drafts)
        return drafts

    @torch.inference_mode()
    def _run_group(self, work: list, drafts: list[list[int]]) -> None:
        # catch up: every token the draft has not computed, then its first guess
        last = self._forward([(state.table, seq.token_ids[state.computed:], state.computed)
                              for _, seq, state, _ in work])
        for (i, seq, state, limit), token in zip(work, last):
            state.computed = seq.num_tokens
            state.proposed_at = seq.num_tokens
            drafts[i] = [token]
        for step in range(1, max(limit for *_, limit in work)):
            active = [(i, seq, state) for i, seq, state, limit in work if step < limit]
            tokens = self._forward([(state.table, [drafts[i][-1]], seq.num_tokens + step - 1)
                                    for i, seq, state in active])
            for (i, _, _), token in zip(active, tokens):
                drafts[i].append(token)
        for i, _, state, _ in work:
            state.drafts = list(drafts[i])

    def _forward(self, rows: list[tuple[list[int], list[int], int]]) -> list[int]:
        """One draft step over (block table, new tokens, first position) rows; each row's greedy next token."""
        token_ids, starts, counts, logit_rows = [], [], [], []
        for _, tokens, start in rows:
            token_ids.extend(tokens)
            starts.append(start)
            counts.append(len(tokens))
            logit_rows.append(len(token_ids) - 1)
        step = StepInput(token_ids=token_ids, start_positions=starts, num_new_tokens=counts,
                         block_tables=[table for table, _, _ in rows], logit_rows=logit_rows,
                         loras=[None] * len(rows))
        return self.runner.execute(step).logits.argmax(dim=-1).tolist()

    def _keep_accepted(self, seq: Sequence, state: _DraftState) -> None:
        """Draft KV written for drafts that were accepted is valid: count it as computed."""
        at = state.proposed_at
        if not state.drafts or state.computed != at:
            return
        kept = 0
        # the last draft's KV was never written (nothing was decoded after it)
        while kept < len(state.drafts) - 1 and at + kept < seq.num_tokens and \
                seq.token_ids[at + kept] == state.drafts[kept]:
            kept += 1
        state.computed = min(at + kept, seq.num_tokens - 1)
        state.drafts = []

    def _reserve(self, state: _DraftState, num_positions: int) -> bool:
        needed = blocks_for(num_positions, self.block_size) - len(state.table)
        if needed <= 0:
            return True
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return False
        state.table.extend(blocks)
        return True

    def _release_finished(self) -> None:
        for seq in [s for s in self._states if s.is_finished]:
            self.pool.free(self._states.pop(seq).table)
