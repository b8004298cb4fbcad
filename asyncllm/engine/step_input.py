"""``StepInput``: one engine step's work for the model, as plain data.

The engine builds it from the scheduler's batch; the model runner reads only it, never the
engine's live ``Sequence`` objects. Everything in it is lists, integers and the adapters' weights,
so one record can describe a step to another process (the rank-0-to-workers broadcast of tensor
parallelism builds on this).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .block_tables import BlockTableRows
from .scheduler import ScheduledBatch


@dataclass
class StepInput:
    """What the model computes in one step. Sequence ``i`` contributes ``num_new_tokens[i]`` tokens,
    starting at position ``start_positions[i]``; its KV blocks are ``block_tables[i]`` or, from the
    engine, row ``table_rows[i]`` of the runner's buffer once ``table_updates`` are applied."""

    token_ids: list[int]                      # the new tokens of every sequence, flattened in batch order
    start_positions: list[int]                # per sequence: the position of its first new token
    num_new_tokens: list[int]                 # per sequence
    block_tables: list[list[int]] | None      # per sequence: its KV blocks, in order; or None, and then:
    logit_rows: list[int]                     # flat token positions whose logits are returned
    table_rows: list[int] | None = None       # per sequence: its row in the runner's block-table buffer
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, start, blocks)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, done first
    loras: list[Any] = field(default_factory=list)      # per sequence: its adapter's weights, or None
    loras_in_use: set[int] = field(default_factory=set)  # adapter ids of every running sequence
    pool_rows: list[int] = field(default_factory=list)  # flat positions whose final hidden states are kept
    prompt_lens: list[int] | None = None  # per sequence: its prompt's length (length-dependent rope reads it)

    @property
    def num_seqs(self) -> int:
        return len(self.num_new_tokens)

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, logit_rows: list[int], tables: BlockTableRows,
                   pool_rows: list[int] = ()) -> "StepInput":
        """The record of one scheduled batch; block tables travel as changes to the runner's rows."""
        token_ids: list[int] = []
        starts = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            chunk = seq.token_ids[start:start + n]
            token_ids.extend(chunk)
            if len(chunk) < n:  # a speculative step: the last token, then the drafts to verify
                token_ids.extend(seq.draft_tokens[:n - len(chunk)])
            starts.append(start)
        rows, updates = tables.describe(batch.seqs)
        return cls(token_ids=token_ids, start_positions=starts, num_new_tokens=list(batch.num_new_tokens),
                   block_tables=None, logit_rows=list(logit_rows), table_rows=rows, table_updates=updates,
                   block_copies=list(batch.block_copies), loras=[seq.request.lora for seq in batch.seqs],
                   loras_in_use=set(batch.loras_in_use), pool_rows=list(pool_rows),
                   prompt_lens=[len(seq.request.prompt_token_ids) for seq in batch.seqs])
