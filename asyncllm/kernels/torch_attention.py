"""Reference paged attention in plain torch: runs anywhere, and is the oracle for the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store new tokens' keys/values ([tokens, kv_heads, head_dim]) into their cache slots (rounded to the cache's
    dtype where it differs: ``kv_cache_dtype="bfloat16"`` under float32 activations)."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _as_query(cached: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Gathered cache rows in the query's dtype (a bfloat16 cache under float32 activations is widened)."""
    return cached if cached.dtype == query.dtype else cached.to(query.dtype)


def _in(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


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


@dataclass
class PrefillGroup:
    """Prefill chunks of one shape (same new-token count, same total length): one SDPA call for all.
    Many requests behind one cached prefix (a shared system prompt) arrive like this."""

    rows: torch.Tensor       # [seqs * q_len] their query rows, chunk after chunk
    block_ids: torch.Tensor  # [seqs * blocks] their block tables, flattened
    num_seqs: int
    q_len: int
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] True where a key is visible; None: plain causal
    first_row: int | None = None  # rows == first_row + arange(seqs * q_len): read and written as a slice


@dataclass
class PrefillPlan:
    groups: list[PrefillGroup]
    singles: list[int]       # sequences whose chunk shape is unique this step: one call each


def plan_prefills(meta: AttentionMetadata) -> PrefillPlan:
    """Group the step's prefill chunks by shape (prepared once per step, used by every layer)."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i in meta.prefill_indices:
        by_shape.setdefault((meta.query_len(i), meta.seq_lens[i]), []).append(i)
    groups, singles = [], []
    device = meta.block_tables.device
    for (q_len, seq_len), idx in by_shape.items():
        if len(idx) == 1:
            singles.append(idx[0])
            continue
        num_blocks = -(-seq_len // meta.block_size)
        index = torch.tensor(idx, device=device)
        rows = torch.tensor([meta.query_start[i] + j for i in idx for j in range(q_len)], device=device)
        mask = None
        if seq_len != q_len:  # query j sits at position seq_len - q_len + j and sees keys up to it
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        first = meta.query_start[idx[0]]
        adjacent = all(meta.query_start[i] == first + k * q_len for k, i in enumerate(idx))
        groups.append(PrefillGroup(rows, meta.block_tables.index_select(0, index)[:, :num_blocks].reshape(-1),
                                    len(idx), q_len, seq_len, mask, first if adjacent else None))
    return PrefillPlan(groups, singles)


@dataclass
class _NewKeys:
    """One layer's keys and values of this step ([tokens, kv_heads, head_dim]), as write_kv was given them, and the
    caches they went into. A chunk whose sequence has no cached prefix sees exactly its own rows of them, rounded to
    the cache's dtype as the cache holds them, so reading them here gives the same numbers as gathering the blocks."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor

    def of(self, k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor) -> bool:
        """Whether these are the rows of the layer now attending (its caches, one row per query row)."""
        return (self.k_cache is k_cache and self.v_cache is v_cache and self.key.shape[0] == query.shape[0]
                and self.key.shape[1:] == k_cache.shape[2:] and self.value.shape[1:] == v_cache.shape[2:])

    def rows(self, start: int, end: int, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _in(self.key[start:end], cache_dtype), _in(self.value[start:end], cache_dtype)


@dataclass
class _TorchPlan:
    decode_groups: list[_DecodeGroup]
    prefills: PrefillPlan


class TorchAttentionBackend:
    """Paged attention by gathering each sequence's blocks and calling SDPA.

    Decodes (one query token) are sorted by length and attended in small groups: padding stays
    small, and each group's gathered K/V is still in the CPU cache when SDPA reads it (one big
    gather of the whole batch is several times slower). Prefill chunks attend causally to their
    cached prefix plus themselves: chunks of the same shape in one call, the others one call each.
    """

    name = "torch"
    decode_group_size = 8
    _new_keys: _NewKeys | None = None  # the last write_kv's rows, until run_prefills takes them

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers: the decode groups and the prefill plan."""
        order = sorted(meta.decode_indices, key=lambda i: meta.seq_lens[i])
        groups = []
        for start in range(0, len(order), self.decode_group_size):
            groups.append(self._group(order[start:start + self.decode_group_size], meta))
        meta.backend_state = _TorchPlan(groups, plan_prefills(meta))

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
        # A prefill chunk with no cached prefix attends to exactly these rows (as the cache holds them): run_prefills
        # reads them here rather than gathering them back from the blocks just written (see _NewKeys)
        self._new_keys = _NewKeys(k_cache, v_cache, key, value)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, chunk: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query: [tokens, heads, head_dim] -> output of the same shape. ``window``: each query sees
        only the last ``window`` positions (itself included); ``softcap``: scores pass through
        ``softcap * tanh(score / softcap)`` before the softmax; ``chunk``: a query at position p sees
        only positions ``p // chunk * chunk .. p`` (Llama 4's chunked attention); ``sinks`` [heads]: one
        learnt logit per head in each softmax's denominator, attending to nothing (gpt-oss)."""
        if (window is not None or softcap is not None or chunk is not None or sinks is not None
                or meta.bidirectional):
            return windowed_attention(query, k_cache, v_cache, meta, scale, window, softcap, chunk=chunk, sinks=sinks)
        output = torch.empty_like(query)
        if meta.backend_state is None:
            self.prepare(meta)
        for group in meta.backend_state.decode_groups:
            self._decode(group, query, k_cache, v_cache, scale, output)
        self.run_prefills(meta.backend_state.prefills, query, k_cache, v_cache, meta, scale, output)
        return output

    def run_prefills(self, plan: PrefillPlan, query, k_cache, v_cache, meta, scale, output,
                     compute_dtype: torch.dtype | None = None) -> None:
        """The step's prefill chunks through SDPA, in ``compute_dtype`` (default: the query's dtype; the cache's
        values and the query are converted to it, the outputs back to ``output``'s)."""
        new, self._new_keys = self._new_keys, None
        if new is not None and not new.of(k_cache, v_cache, query):
            new = None
        for group in plan.groups:
            self._prefill_group(group, query, k_cache, v_cache, scale, output, compute_dtype, new)
        for i in plan.singles:
            self._prefill(i, query, k_cache, v_cache, meta, scale, output, compute_dtype, new)

    @staticmethod
    def _prefill_group(group: PrefillGroup, query, k_cache, v_cache, scale, output, compute_dtype=None,
                       new: _NewKeys | None = None) -> None:
        n, (_, _, kv_heads, dim) = group.num_seqs, k_cache.shape
        first, size = group.first_row, group.num_seqs * group.q_len
        if first is not None and new is not None and group.seq_len == group.q_len:  # no prefix: the new rows
            k, v = (t.view(n, group.q_len, kv_heads, dim).transpose(1, 2)
                    for t in new.rows(first, first + size, k_cache.dtype))
        else:
            k = k_cache.index_select(0, group.block_ids).view(n, -1, kv_heads, dim)[:, :group.seq_len].transpose(1, 2)
            v = v_cache.index_select(0, group.block_ids).view(n, -1, kv_heads, dim)[:, :group.seq_len].transpose(1, 2)
        rows = query[first:first + size] if first is not None else query.index_select(0, group.rows)
        q = _in(rows.view(n, group.q_len, -1, dim).transpose(1, 2), compute_dtype)  # [n, heads, q_len, dim]
        k, v = _as_query(k, q), _as_query(v, q)
        out = _sdpa(q, k, v, group.mask, scale, causal=group.mask is None).transpose(1, 2)  # [n, q_len, heads, dim]
        if first is not None:  # a strided copy (converting where the dtypes differ): no index arithmetic
            output[first:first + size].view(n, group.q_len, -1, dim).copy_(out)
        else:
            output.index_copy_(0, group.rows, _in(out.reshape(size, -1, dim), output.dtype))

    @staticmethod
    def _decode(group: _DecodeGroup, query, k_cache, v_cache, scale, output) -> None:
        n, (_, _, kv_heads, dim) = group.num_seqs, k_cache.shape
        k = _as_query(k_cache.index_select(0, group.block_ids).view(n, -1, kv_heads, dim).transpose(1, 2), query)
        v = _as_query(v_cache.index_select(0, group.block_ids).view(n, -1, kv_heads, dim).transpose(1, 2), query)
        # Grouped-query trick: the query heads sharing one KV head become that head's "query rows",
        # so K/V are read once per KV head instead of being copied for every query head.
        q = query.index_select(0, group.rows).view(n, kv_heads, -1, dim)  # [seqs, kv_heads, group, dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        output[group.rows] = out.reshape(n, -1, dim)

    def _prefill(self, i, query, k_cache, v_cache, meta, scale, output, compute_dtype=None,
                 new: _NewKeys | None = None) -> None:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        seq_len, q_len = meta.seq_lens[i], end - start
        num_blocks = -(-seq_len // meta.block_size)
        blocks = meta.block_tables[i, :num_blocks]
        kv_heads, dim = k_cache.shape[-2:]
        q = _in(query[start:end].transpose(0, 1).unsqueeze(0), compute_dtype)  # [1, heads, q_len, dim]
        if new is not None and seq_len == q_len:  # no prefix: the rows just written
            k, v = (t.unsqueeze(0).transpose(1, 2) for t in new.rows(start, end, k_cache.dtype))
        else:
            k = k_cache.index_select(0, blocks).view(1, -1, kv_heads, dim)[:, :seq_len].transpose(1, 2)
            v = v_cache.index_select(0, blocks).view(1, -1, kv_heads, dim)[:, :seq_len].transpose(1, 2)
        k, v = _as_query(k, q), _as_query(v, q)
        if seq_len == q_len:
            out = _sdpa(q, k, v, None, scale, causal=True)
        else:  # query j sits at absolute position seq_len - q_len + j and sees keys up to it
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            out = _sdpa(q, k, v, mask, scale)
        output[start:end] = out.squeeze(0).transpose(0, 1)


def windowed_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, window: int | None, softcap: float | None, sequences: list[int] | None = None,
                       output: torch.Tensor | None = None, chunk: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention with a sliding window, soft-capped scores and/or chunks, one sequence at a time:
    the reference for those layers (Gemma 2/3, Mistral and Qwen2 windows, Llama 4's chunks), and the
    prefill path of the CPU backend for them. A window or a chunk also bounds the keys read: only the
    blocks inside it are gathered. ``chunk``: a query at position p sees only positions
    ``p // chunk * chunk .. p``. ``sinks`` [heads]: a logit per head that joins the softmax as one more
    column and is dropped after it (gpt-oss's attention sinks). ``meta.bidirectional``: spans whose queries
    also see the span's later keys (before the window applies, as transformers composes Gemma 3's masks).
    ``sequences``: only these (default: all), written into ``output`` (default: a new tensor)."""
    output = torch.empty_like(query) if output is None else output
    kv_heads, dim = k_cache.shape[-2:]
    heads = query.shape[1]
    for i in (range(meta.num_seqs) if sequences is None else sequences):
        start, end = meta.query_start[i], meta.query_start[i + 1]
        if end == start:
            continue
        seq_len, q_len = meta.seq_lens[i], end - start
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)  # oldest key any query here sees
        if chunk is not None:
            first = max(first, (seq_len - q_len) // chunk * chunk)
        first_block = first // meta.block_size
        num_blocks = -(-seq_len // meta.block_size)
        blocks = meta.block_tables[i, first_block:num_blocks]
        offset = first_block * meta.block_size
        k = k_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:seq_len - offset]
        v = v_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:seq_len - offset]
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        q = query[start:end].float().transpose(0, 1)                    # [heads, q_len, dim]
        scores = q @ k.float().permute(1, 2, 0) * scale                 # [heads, q_len, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(offset, seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        for a, b in (meta.bidirectional or {}).get(i, ()):
            visible |= (q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b)
        if window is not None:
            visible &= k_pos > q_pos - window
        if chunk is not None:
            visible &= k_pos >= q_pos // chunk * chunk
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # the sink's column takes its share of the probability mass, then goes
            sink = sinks.float()[:, None, None].expand(heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        output[start:end] = (probs @ v.float().transpose(0, 1)).transpose(0, 1).to(query.dtype)
    return output
