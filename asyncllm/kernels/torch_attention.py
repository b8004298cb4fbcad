"""Reference paged attention in plain torch: runs anywhere, and is the oracle for the kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store new tokens' keys/values ([tokens, kv_heads, head_dim]) into their cache slots."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[seqs, max_blocks] block ids -> [seqs, max_blocks * block_size, kv_heads, head_dim]."""
    seqs, blocks = block_tables.shape
    gathered = cache[block_tables]
    return gathered.view(seqs, blocks * cache.shape[1], *cache.shape[2:])


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


class TorchAttentionBackend:
    """Paged attention by gathering each sequence's blocks and calling SDPA.

    Decodes (one query token) are batched into one SDPA call with a length mask; each prefill
    chunk gets its own call, attending causally to its cached prefix plus itself.
    """

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query: [tokens, heads, head_dim] -> output of the same shape."""
        output = torch.empty_like(query)
        if meta.decode_indices:
            self._decode(query, k_cache, v_cache, meta, scale, output)
        for i in meta.prefill_indices:
            self._prefill(i, query, k_cache, v_cache, meta, scale, output)
        return output

    def _decode(self, query, k_cache, v_cache, meta, scale, output) -> None:
        idx = meta.decode_indices
        rows = torch.tensor([meta.query_start[i] for i in idx], device=query.device)
        lens = meta.seq_lens_tensor[idx]
        max_blocks = -(-max(meta.seq_lens[i] for i in idx) // meta.block_size)
        tables = meta.block_tables[idx, :max_blocks]
        k = _gather(k_cache, tables).transpose(1, 2)  # [seqs, kv_heads, ctx, dim]
        v = _gather(v_cache, tables).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=query.device)
        mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        # Grouped-query trick: the query heads sharing one KV head become that head's "query rows",
        # so K/V are read once per KV head instead of being copied for every query head.
        kv_heads = k.shape[1]
        q = query[rows].view(len(idx), kv_heads, -1, query.shape[-1])  # [seqs, kv_heads, group, dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        output[rows] = out.reshape(len(idx), -1, query.shape[-1])

    def _prefill(self, i, query, k_cache, v_cache, meta, scale, output) -> None:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        seq_len, q_len = meta.seq_lens[i], end - start
        num_blocks = -(-seq_len // meta.block_size)
        tables = meta.block_tables[i:i + 1, :num_blocks]
        k = _gather(k_cache, tables)[:, :seq_len].transpose(1, 2)
        v = _gather(v_cache, tables)[:, :seq_len].transpose(1, 2)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        if seq_len == q_len:
            out = _sdpa(q, k, v, None, scale, causal=True)
        else:  # query j sits at absolute position seq_len - q_len + j and sees keys up to it
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            out = _sdpa(q, k, v, mask, scale)
        output[start:end] = out.squeeze(0).transpose(0, 1)
