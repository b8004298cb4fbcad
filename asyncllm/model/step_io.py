"""The records that cross the engine/model seam: ``StepInput`` (one step's work) and ``StepOutput``.

The engine builds a ``StepInput`` from the scheduler's batch (engine/core.py); the model runner reads
only it, never the engine's live ``Sequence`` objects, and answers with a ``StepOutput``. Both are
plain data (lists, integers, the adapters' weights, tensors), so a record can describe a step to
another process (tensor parallelism's rank-0-to-workers broadcast), and this module imports nothing
of the engine or the model: either side imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ImageInput:
    """One image of a prompt: the run of placeholder tokens it fills and what the model's vision encoder
    reads (the processor's outputs for this image: ``pixel_values``, and e.g. ``image_grid_thw``)."""

    content_hash: str                   # of the processed pixels: the prefix cache and the encoder cache key
    offset: int                         # the prompt position of its first placeholder
    length: int                         # its placeholders: the rows of embeddings the encoder gives it
    pixels: dict[str, torch.Tensor]


@dataclass
class ImageRows:
    """Rows ``begin .. begin + count`` of an image's embeddings, which replace the token embeddings of
    the step's flat rows ``row .. row + count`` (a prefill chunk may hold part of an image)."""

    row: int
    image: ImageInput
    begin: int
    count: int


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
    images: list[ImageRows] = field(default_factory=list)  # image embeddings in place of placeholder tokens
    # M-RoPE families (model/mrope.py) with an image prompt in the step: the rotary positions, [tokens] or
    # [3, tokens] (an image's height/width positions), where they differ from the sequence positions; None: equal
    rope_positions: Any = None
    # images too large for one step's encoder budget, encoded ahead of their prompt chunks a share at a time
    # while the running streams decode (model/image_embeddings.py ``advance``), and that share in image rows
    encode_ahead: list[ImageInput] = field(default_factory=list)
    encode_ahead_rows: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.num_new_tokens)


@dataclass
class StepOutput:
    """What the model returns for a step: the logits of ``StepInput.logit_rows`` ([rows, vocab], float32)
    and the final hidden states of ``StepInput.pool_rows`` ([rows, hidden], float32; None when there
    are none). Sampling is the engine's: it reads the logits (model/sampler.py)."""

    logits: torch.Tensor
    pooled: torch.Tensor | None = None
    images_ready: list[str] = field(default_factory=list)  # content hashes of encode_ahead images now encoded
