"""The CPU attention backend: decodes through the C kernel in ``csrc/paged_decode.c``, prefills through SDPA.

Decoding is where the torch reference loses most on CPU: it gathers every sequence's blocks into a
contiguous copy (``index_select``) and then reads that copy again in SDPA. The kernel reads the
blocks in place, once per KV head. Prefill chunks stay on SDPA, whose flash kernel is faster than a
scalar loop for many query tokens; both share the reference's KV write.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field

import torch

from . import cpu_prefill_attention
from .cpu_build import load_library
from .metadata import AttentionMetadata
from .torch_attention import TorchAttentionBackend, PrefillPlan, plan_prefills, windowed_attention

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@dataclass
class _Decodes:
    """The step's decoding sequences, prepared once for all layers."""

    rows: torch.Tensor  # [n] int64: query/output row of each decode in the flattened batch
    seqs: torch.Tensor  # [n] int64: its sequence index in the batch (row of block_tables / seq_lens)
    prefills: PrefillPlan  # the step's prefill chunks, for SDPA
    # the chunks without a cached prefix, for the C prefill kernel where it runs: (starts, lengths, the rest's plan)
    own_rows: tuple[torch.Tensor, torch.Tensor, PrefillPlan] | None = None
    # chunked layers (Llama 4): (chunk, window) -> decodes grouped by the window their chunk leaves them
    chunked: dict = field(default_factory=dict)


_PAGED_DECODE = (("paged_decode_f32", (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                                        _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, ctypes.c_float, ctypes.c_int, _i64,
                                        ctypes.c_float, _ptr, ctypes.c_int),
                   ctypes.c_int),)


def _library() -> ctypes.CDLL | None:
    return load_library("paged_decode", _PAGED_DECODE)


def cpu_kernels_available() -> bool:
    """Whether the C decode kernel could be built and loaded on this machine."""
    return _library() is not None


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, rows: torch.Tensor, seqs: torch.Tensor, scale: float,
                 out: torch.Tensor, window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
    """Attention of one query token per decoding sequence over its cached keys/values, written into ``out``.

    query/out: [tokens, heads, head_dim] float32 (rows ``rows`` are read/written); caches:
    [num_blocks, block_size, kv_heads, head_dim] contiguous, float32 or bfloat16 (both the same dtype); block_tables: [seqs, max_blocks] int64;
    seq_lens: [seqs] int64; rows/seqs: [n] int64 (decode i uses query row ``rows[i]`` and sequence
    ``seqs[i]``). ``sinks``: [heads] logits that join each head's softmax denominator (gpt-oss).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU decode kernel is not available on this machine")
    for name, t in (("query", query), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        allowed = (torch.float32, torch.bfloat16) if name.endswith("cache") else (torch.float32,)
        if t.dtype not in allowed or t.device.type != "cpu":
            kinds = " or ".join(str(d).removeprefix("torch.") for d in allowed)
            raise TypeError(f"{name} must be a {kinds} CPU tensor, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("rows", rows), ("seqs", seqs)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous int64 tensor")
    _, block_size, kv_heads, head_dim = k_cache.shape
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        if sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must have one logit per head ({query.shape[1]}), got {tuple(sinks.shape)}")
    failed = lib.paged_decode_f32(
        query.data_ptr(), query.stride(0), query.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), block_size, kv_heads, head_dim, query.shape[1],
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(), rows.data_ptr(),
        seqs.data_ptr(), rows.numel(), scale, torch.get_num_threads(), int(window or 0), float(softcap or 0.0),
        None if sinks is None else sinks.data_ptr(), int(k_cache.dtype == torch.bfloat16))
    if failed == 2:
        raise ValueError("a decoding sequence is empty or longer than its block table covers")
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch memory")


def _forced_bf16_attention() -> bool | None:
    """``ASYNCLLM_BF16_ATTENTION=0|1``: bf16 prefill attention forced off or on; None: decided per machine."""
    forced = os.environ.get("ASYNCLLM_BF16_ATTENTION", "").strip().lower()
    if forced in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        return forced in ("1", "true", "yes", "on")
    return None


@functools.cache
def amx_attention() -> bool:
    """Whether prefill SDPA over a bfloat16 cache runs in bfloat16 here: on CPUs with AMX tiles, where torch's bf16
    flash kernel multiplies in tiles (2.2x float32's on 16 x 128 tokens, 9 heads); elsewhere it measured no faster
    than float32, which then keeps the float32 query's precision. ``ASYNCLLM_BF16_ATTENTION=0|1`` overrides."""
    forced = _forced_bf16_attention()
    if forced is not None:
        return forced
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe and probe() and torch.cpu._init_amx())
    except (AttributeError, RuntimeError):
        return False


def bf16_kernel_attention() -> bool:
    """Whether prefill chunks attending only to themselves may attend in bf16 through the C kernel
    (kernels/cpu_prefill_attention.py: vdpbf16ps, 1.7x its float32 query's speed on Zen 4) where SDPA would not
    run bf16 (no AMX); ``ASYNCLLM_BF16_ATTENTION=0`` keeps the float32 query."""
    return _forced_bf16_attention() is not False and cpu_prefill_attention.available()


class CpuAttentionBackend(TorchAttentionBackend):
    """Paged attention for float32 on CPU: the C kernel for decodes, SDPA for prefill chunks; the cache float32 or
    bfloat16 (``kv_cache_dtype``: read widened to float32 by the decode kernel; prefill SDPA over a bf16 cache runs in
    bf16 where the CPU has AMX, see :meth:`prefill_dtype`)."""

    name = "cpu"

    def prepare(self, meta: AttentionMetadata) -> None:
        idx = meta.decode_indices
        device = meta.block_tables.device
        meta.backend_state = _Decodes(
            rows=torch.tensor([meta.query_start[i] for i in idx], dtype=torch.int64, device=device),
            seqs=torch.tensor(idx, dtype=torch.int64, device=device), prefills=plan_prefills(meta))
        if meta.prefill_indices and device.type == "cpu" and cpu_prefill_attention.available():
            meta.backend_state.own_rows = _own_rows(meta.backend_state.prefills, meta)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, chunk: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if meta.bidirectional:  # an image attended both ways (Gemma 3): the reference, for this step only
            return windowed_attention(query, k_cache, v_cache, meta, scale, window, softcap, chunk=chunk, sinks=sinks)
        output = torch.empty_like(query)
        if meta.backend_state is None:
            self.prepare(meta)
        decodes = meta.backend_state
        if decodes.rows.numel() and chunk is None:
            paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, decodes.rows,
                         decodes.seqs, scale, output, window, softcap, sinks)
        elif decodes.rows.numel():
            for rows, seqs, seen in _chunked_decodes(decodes, meta, chunk, window):
                paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, rows, seqs, scale,
                             output, seen, softcap, sinks)
        if window is not None or softcap is not None or chunk is not None or sinks is not None:
            # their prefill chunks: the reference
            windowed_attention(query, k_cache, v_cache, meta, scale, window, softcap, meta.prefill_indices, output,
                               chunk, sinks)
        else:
            self.run_prefills(decodes.prefills, query, k_cache, v_cache, meta, scale, output,
                              self.prefill_dtype(query, k_cache))
        return output

    def run_prefills(self, plan: PrefillPlan, query, k_cache, v_cache, meta, scale, output,
                     compute_dtype: torch.dtype | None = None) -> None:
        """The step's prefill chunks: those without a cached prefix through the C kernel where it applies (a bf16
        cache, the layer's own new keys at hand, and float32 activations, or bf16 ones on CPUs without AMX:
        kernels/cpu_prefill_attention.py), the rest through SDPA."""
        own, new = getattr(meta.backend_state, "own_rows", None), self._new_keys
        if (own is not None and own[0].numel() and compute_dtype is None and query.dtype in (torch.float32, torch.bfloat16)
                and output.dtype == query.dtype and k_cache.dtype == torch.bfloat16 and new is not None
                and new.of(k_cache, v_cache, query)
                # a bf16 query (bf16 prefill layers): AMX CPUs keep torch's bf16 SDPA, which multiplies in tiles
                and (query.dtype == torch.float32 or (new.key.dtype == torch.bfloat16 and not amx_attention()))
                and cpu_prefill_attention.shape_supported(query.shape[1], k_cache.shape[2], query.shape[2])):
            starts, lengths, plan = own
            cpu_prefill_attention.prefill_attention(query, new.key, new.value, output, starts, lengths, scale)
        super().run_prefills(plan, query, k_cache, v_cache, meta, scale, output, compute_dtype)

    @staticmethod
    def bf16_prefill_layers(hidden: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a prefill-only step's attention layers may keep q, k and v in bf16 from the qkv projection to the o
        projection (model/decoder.py): float32 activations over a bf16 cache, and either SDPA runs bf16 here
        (:func:`amx_attention`) or every chunk of the step attends only to itself and the C kernel takes it in bf16
        (:func:`bf16_kernel_attention`; a chunk with a cached prefix would go to SDPA, bf16 at float32's speed)."""
        if hidden.dtype != torch.float32 or k_cache.dtype != torch.bfloat16:
            return False
        if amx_attention():
            return True
        own = getattr(meta.backend_state, "own_rows", None)
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        return (own is not None and not own[2].groups and not own[2].singles and bf16_kernel_attention()
                and cpu_prefill_attention.shape_supported(kv_heads, kv_heads, head_dim))

    @staticmethod
    def prefill_dtype(query: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype | None:
        """SDPA's dtype for prefill chunks: bfloat16 for a float32 query over a bfloat16 cache where
        :func:`amx_attention` says so (the query rounded to bf16, as the cache's keys are), else the query's."""
        if query.dtype == torch.float32 and k_cache.dtype == torch.bfloat16 and amx_attention():
            return torch.bfloat16
        return None


def _own_rows(plan: PrefillPlan, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, PrefillPlan]:
    """The plan's chunks that attend only to themselves (no cached prefix), as rows ``starts[s] ..
    starts[s] + lengths[s] - 1`` of the step, and the plan of the others (prepared once per step)."""
    starts, lengths, groups, singles = [], [], [], []
    for group in plan.groups:
        if group.mask is None and group.seq_len == group.q_len:
            starts.extend(group.rows[::group.q_len].tolist())  # each sequence's first row
            lengths.extend([group.q_len] * group.num_seqs)
        else:
            groups.append(group)
    for i in plan.singles:
        if meta.seq_lens[i] == meta.query_len(i):
            starts.append(meta.query_start[i])
            lengths.append(meta.query_len(i))
        else:
            singles.append(i)
    device = meta.block_tables.device
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(lengths, dtype=torch.int64, device=device), PrefillPlan(groups, singles))


def _chunked_decodes(decodes: _Decodes, meta: AttentionMetadata, chunk: int,
                     window: int | None) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The step's decodes under chunked attention, as (rows, seqs, window) groups for the C kernel: a decode at
    position p sees positions ``p // chunk * chunk .. p``, i.e. the last ``p % chunk + 1`` of them, a window that
    differs by sequence; decodes sharing one go in one call (made once per step, for every chunked layer)."""
    key = (chunk, window)
    if key not in decodes.chunked:
        by_window: dict[int, list[tuple[int, int]]] = {}
        for row, seq in zip(decodes.rows.tolist(), decodes.seqs.tolist()):
            seen = (meta.seq_lens[seq] - 1) % chunk + 1
            by_window.setdefault(seen if window is None else min(seen, window), []).append((row, seq))
        device = decodes.rows.device
        decodes.chunked[key] = [
            (torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=device),
             torch.tensor([s for _, s in pairs], dtype=torch.int64, device=device), seen)
            for seen, pairs in by_window.items()]
    return decodes.chunked[key]
