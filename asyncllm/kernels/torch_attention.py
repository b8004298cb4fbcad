"""Reference paged attention in plain torch: runs anywhere, and is the oracle for the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store new tokens' keys/values ([tokens, kv_heads, head_dim]) into their cache slots."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          causal: bool = False) -> torch.Tensor:
    """SDPA over [batch, heads, len, dim] tensors with grouped KV heads (no copy where torch allows)."""
    if k.shape[1] != q.shape[1] and _HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


@dataclass
class _DecodeGroup:
    """Decoding sequences of similar length, attended together (prepared once per step)."""

    rows: torch.Tensor         # their query rows in the flattened batch
    block_ids: torch.Tensor    # [seqs * max_blocks] their block tables, flattened and padded
    mask: torch.Tensor         # [seqs, 1, 1, max_blocks * block_size] True where a key is real
    num_seqs: int


class TorchAttentionBackend:
    """Paged attention by gathering each sequence's blocks and calling SDPA.

    Decodes (one query token) are sorted by length and attended in small groups: padding stays
    small, and each group's gathered K/V is still in the CPU cache when SDPA reads it (one big
    gather of the whole batch is several times slower). Each prefill chunk gets its own call,
    attending causally to its cached prefix plus itself.
    """

    name = "torch"
    decode_group_size = 8

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers: the decode groups."""
        order = sorted(meta.decode_indices, key=lambda i: meta.seq_lens[i])
        groups = []
        for start in range(0, len(order), self.decode_group_size):
            groups.append(self._group(order[start:start + self.decode_group_size], meta))
        meta.backend_state = groups

    @staticmethod
    def _group(idx: list[int], meta: AttentionMetadata) -> _DecodeGroup:
        device = meta.block_tables.device
        max_blocks = -(-max(meta.seq_lens[i] for i in idx) // meta.block_size)
        index = torch.tensor(idx, device=device)
        tables = meta.block_tables.index_select(0, index)[:, :max_blocks]
        lens = meta.seq_lens_tensor.index_select(0, index)
        positions = torch.arange(max_blocks * meta.block_size, device=device)
        mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        rows = torch.tensor([meta.query_start[i] for i in idx], device=device)
        return _DecodeGroup(rows, tables.reshape(-1), mask, len(idx))

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query: [tokens, heads, head_dim] -> output of the same shape."""
        output = torch.empty_like(query)
        if meta.backend_state is None:
            self.prepare(meta)
        for group in meta.backend_state:
            self._decode(group, query, k_cache, v_cache, scale, output)
        for i in meta.prefill_indices:
            self._prefill(i, query, k_cache, v_cache, meta, scale, output)
        return output

    @staticmethod
    def _decode(group: _DecodeGroup, query, k_cache, v_cache, scale, output) -> None:
        n, (_, block_size, kv_heads, dim) = group.num_seqs, k_cache.shape
        k = k_cache.index_select(0, group.block_ids).view(n, -1, kv_heads, dim).transpose(1, 2)
        v = v_cache.index_select(0, group.block_ids).view(n, -1, kv_heads, dim).transpose(1, 2)
        # Grouped-query trick: the query heads sharing one KV head become that head's "query rows",
        # so K/V are read once per KV head instead of being copied for every query head.
        q = query.index_select(0, group.rows).view(n, kv_heads, -1, dim)  # [seqs, kv_heads, group, dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        output[group.rows] = out.reshape(n, -1, dim)

    def _prefill(self, i, query, k_cache, v_cache, meta, scale, output) -> None:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        seq_len, q_len = meta.seq_lens[i], end - start
        num_blocks = -(-seq_len // meta.block_size)
        blocks = meta.block_tables[i, :num_blocks]
        kv_heads, dim = k_cache.shape[-2:]
        k = k_cache.index_select(0, blocks).view(1, -1, kv_heads, dim)[:, :seq_len].transpose(1, 2)
        v = v_cache.index_select(0, blocks).view(1, -1, kv_heads, dim)[:, :seq_len].transpose(1, 2)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        if seq_len == q_len:
            out = _sdpa(q, k, v, None, scale, causal=True)
        else:  # query j sits at absolute position seq_len - q_len + j and sees keys up to it
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            out = _sdpa(q, k, v, mask, scale)
        output[start:end] = out.squeeze(0).transpose(0, 1)
