"""Triton paged attention over variable-length query batches (decode, prefill, chunked prefill,
prefix hits), with an optional split of the KV dimension (flash-decoding).

One program computes one *query block* of one sequence against one KV head. A query block is up
to ``BLOCK_Q`` consecutive query tokens of a sequence; its ``BLOCK_M = BLOCK_Q * GROUP`` rows are
those tokens times the ``GROUP`` query heads that share the KV head (GQA/MQA packing), so each
K/V tile is loaded once for all of them. Keys are walked in tiles of ``TILE_N`` positions, each
position's physical slot found through the block table, with an online softmax in float32.
Query ``j`` of a sequence with ``q_len`` new tokens and ``seq_len`` tokens in all sits at absolute
position ``seq_len - q_len + j`` and sees keys up to and including that position: this one rule
covers decode, prefill, chunked prefill and prefix-cache hits.

With ``NUM_SPLITS > 1`` program ``(qb, kv_head, split)`` covers only its share of the key tiles
and writes an unnormalised partial result plus its running max and sum; a second small kernel
merges the splits. Long contexts at small batch then fill the GPU instead of a few SMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import dot_flags, next_power_of_2

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _attend_tile(q, q_pos, m_i, l_i, acc, keys, kv_lo, kv_end, table, k_head, v_head, stride_kb, stride_ks, stride_vb,
                 stride_vs, dims, dim_ok, scale_log2, window, softcap, chunk, BLOCK_SIZE: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """One step of the online softmax: the rows' scores against key positions ``keys``, found
    through the block table; returns the updated (running max, running sum, unnormalised output).
    ``HAS_WINDOW``: a row sees only the last ``window`` positions up to its own; ``HAS_SOFTCAP``:
    scores pass through ``softcap * tanh(score / softcap)`` before the softmax; ``HAS_CHUNK``: a row at
    position p sees only positions ``p // chunk * chunk .. p`` (Llama 4). Keys before ``kv_lo`` (the
    window's or chunk's start for the block's first query) are not even loaded: their blocks may have
    been given back to the pool (engine/kv_cache.py, release_outside_window)."""
    key_ok = keys < kv_end
    if HAS_WINDOW:
        key_ok = key_ok & (keys >= kv_lo)
    if HAS_CHUNK:
        key_ok = key_ok & (keys >= kv_lo)
    block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = keys % BLOCK_SIZE
    k = tl.load(k_head + block[None, :] * stride_kb + slot[None, :] * stride_ks + dims[:, None],
                mask=dim_ok[:, None] & key_ok[None, :], other=0.0)      # [D, TILE_N]
    v = tl.load(v_head + block[:, None] * stride_vb + slot[:, None] * stride_vs + dims[None, :],
                mask=key_ok[:, None] & dim_ok[None, :], other=0.0)      # [TILE_N, D]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = _dot(q, k, IEEE_DOT) * scale_log2
    if HAS_SOFTCAP:  # in the exp2 domain: log2(e) * cap * tanh(raw / cap), raw = s / log2(e)
        x = s / (softcap * 1.4426950408889634)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        s = tanh * (softcap * 1.4426950408889634)
    visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (keys[None, :] > q_pos[:, None] - window)
    if HAS_CHUNK:
        visible = visible & (keys[None, :] >= (q_pos // chunk * chunk)[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps max -inf; 0 as its reference gives exp2 -> 0, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width changes every step: one compiled kernel
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, qblock_seq_ptr, qblock_start_ptr, sinks_ptr,
    scale_log2, window, softcap, chunk,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(qblock_seq_ptr + qb)
    first_query = tl.load(qblock_start_ptr + qb)          # index of this block's first query in its sequence
    q_begin = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context = seq_len - q_len                             # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_query + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context + q_idx

    # The block's last query bounds the keys it can see; this program takes its share of those tiles.
    kv_end = tl.minimum(seq_len, context + first_query + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    kv_lo = 0
    if HAS_WINDOW:  # the block's first query sees nothing before its window: skip those tiles
        kv_lo = tl.maximum(context + first_query - window + 1, 0)
    if HAS_CHUNK:  # nor anything before its chunk
        kv_lo = tl.maximum(kv_lo, (context + first_query) // chunk * chunk)
    first_tile = kv_lo // TILE_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    for tile in range(tile_lo, tile_hi):
        m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, tile * TILE_N + tl.arange(0, TILE_N), kv_lo, kv_end,
                                     table, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs, dims, dim_ok,
                                     scale_log2, window, softcap, chunk, BLOCK_SIZE, UPCAST, IEEE_DOT, HAS_WINDOW,
                                     HAS_SOFTCAP, HAS_CHUNK)

    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the head's sink logit joins the denominator (exp2 domain, like the scores)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_sink = tl.maximum(m_i, sink)
            rescale = tl.exp2(m_i - m_sink)
            l_i = l_i * rescale + tl.exp2(sink - m_sink)
            acc = acc * rescale[:, None]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = ((qb.to(tl.int64) * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split) * BLOCK_M + rows
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, query_start_ptr, qblock_seq_ptr, qblock_start_ptr, sinks_ptr,
    stride_ot, stride_oh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Combine the splits of one (query block, KV head): rescale each partial to the global max (the head's
    sink logit, where there is one, joins the max and the denominator once)."""
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(qblock_seq_ptr + qb)
    first_query = tl.load(qblock_start_ptr + qb)
    q_begin = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_begin
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_query + rows // GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    base = (qb.to(tl.int64) * NUM_KV_HEADS + kv_head) * NUM_SPLITS * BLOCK_M + rows

    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + s * BLOCK_M, mask=row_ok, other=float("-inf")))
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + kv_head * GROUP + rows % GROUP, mask=row_ok, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)   # empty splits carry -inf and weigh 0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        part = base + s * BLOCK_M
        weight = tl.exp2(tl.load(part_m_ptr + part, mask=row_ok, other=float("-inf")) - m_ref)
        denom += weight * tl.load(part_l_ptr + part, mask=row_ok, other=0.0)
        acc += weight[:, None] * tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
                                         mask=row_ok[:, None], other=0.0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_ref)
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    token = (q_begin + q_idx).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


def split_buffers(num_qblocks: int, num_kv_heads: int, num_splits: int, block_m: int, head_dim: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch space for split-KV partials: (out, max, sum), float32."""
    rows = num_qblocks * num_kv_heads * num_splits * block_m
    out = torch.empty(rows, next_power_of_2(head_dim), dtype=torch.float32, device=device)
    stats = torch.empty(2, rows, dtype=torch.float32, device=device)
    return out, stats[0], stats[1]


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                    qblock_seq: torch.Tensor, qblock_start: torch.Tensor, scale: float, *, block_m: int,
                    tile_n: int, num_splits: int = 1, partials: tuple | None = None, num_warps: int = 4,
                    window: int | None = None, softcap: float | None = None, chunk: int | None = None,
                    sinks: torch.Tensor | None = None) -> None:
    """Attention of the query blocks listed in ``qblock_seq``/``qblock_start`` into ``out``.

    query/out: [tokens, heads, head_dim] (last dim contiguous); caches: [blocks, block_size,
    kv_heads, head_dim]; block_tables [seqs, max_blocks]; seq_lens [seqs]; query_start [seqs+1];
    qblock_seq/qblock_start [query blocks]: each block's sequence and first query index in it.
    ``partials`` (from :func:`split_buffers`) is required when ``num_splits > 1``. ``window``: each
    query sees only the last ``window`` positions (itself included); ``softcap``: tanh soft-capping of
    the scores (Gemma 2); ``chunk``: a query at position p sees only positions ``p // chunk * chunk .. p``
    (Llama 4); ``sinks`` [heads] (contiguous, any float dtype): a logit per head that joins its softmax's
    denominator and attends to nothing (gpt-oss). Each compiles its own specialisation; without them the
    kernel is unchanged.
    """
    num_qblocks = qblock_seq.numel()
    if num_qblocks == 0:
        return
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // kv_heads
    block_q = max(1, block_m // group)
    if num_splits > 1 and partials is None:
        raise ValueError("num_splits > 1 needs the partial buffers of split_buffers()")
    part_out, part_m, part_l = partials if num_splits > 1 else (out, out, out)  # unused when not split
    if sinks is not None and (sinks.shape != (query.shape[1],) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be contiguous with one logit per head ({query.shape[1]}), "
                         f"got {tuple(sinks.shape)}")
    sinks_arg = out if sinks is None else sinks  # not read without HAS_SINKS
    meta = dict(NUM_KV_HEADS=kv_heads, BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim,
                HEAD_DIM_PAD=next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_Q=block_q)
    _paged_attention_kernel[(num_qblocks, kv_heads, num_splits)](
        out, part_out, part_m, part_l, query, k_cache, v_cache,
        block_tables, seq_lens, query_start, qblock_seq, qblock_start, sinks_arg, scale * _LOG2E,
        int(window or 0), float(softcap or 0.0), int(chunk or 1),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        TILE_N=tile_n, NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        HAS_CHUNK=chunk is not None, HAS_SINKS=sinks is not None,
        **meta, **dot_flags(query.dtype), num_warps=num_warps)
    if num_splits > 1:
        meta.pop("BLOCK_SIZE")
        _merge_splits_kernel[(num_qblocks, kv_heads)](
            out, part_out, part_m, part_l, query_start, qblock_seq, qblock_start, sinks_arg, out.stride(0),
            out.stride(1), NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None, **meta, num_warps=num_warps)
