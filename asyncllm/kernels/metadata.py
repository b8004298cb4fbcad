"""What an attention backend needs to know about one step's batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Layout of one step's flattened batch of query tokens.

    Sequence ``i`` owns query tokens ``query_start[i]:query_start[i+1]`` of the flattened batch;
    after this step it holds ``seq_lens[i]`` tokens of KV (cached ones plus the new ones), stored
    in the blocks listed in row ``i`` of ``block_tables`` (padded with zeros).
    """

    slot_mapping: torch.Tensor      # [num_tokens] int64: cache slot (block * block_size + offset) per new token
    query_start: list[int]          # [num_seqs + 1]
    seq_lens: list[int]             # [num_seqs]
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int64
    seq_lens_tensor: torch.Tensor   # [num_seqs] int64
    query_start_tensor: torch.Tensor  # [num_seqs + 1] int64
    block_size: int
    decode_indices: list[int]       # sequences with exactly one query token
    prefill_indices: list[int]      # sequences with several query tokens
    backend_state: Any = None       # whatever the attention backend prepares once per step
    # one "sequence" per token, several of them consecutive positions of one real sequence (a small
    # multi-token step laid out for the CPU decode stack, which then writes every row's KV first)
    chained: bool = False
    # per sequence: the length its rope is computed for, max(prompt length, seq_lens[i]) (longrope and
    # dynamic rope, model/rotary.py); None: seq_lens
    rope_lens: list[int] | None = None
    rope_lens_tensor: torch.Tensor | None = None
    # per sequence index: absolute position spans [a, b) inside which attention goes both ways (an image's
    # rows in Gemma 3); None: causal everywhere. Every backend then runs windowed_attention (torch_attention.py)
    bidirectional: dict[int, list[tuple[int, int]]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start[i + 1] - self.query_start[i]
