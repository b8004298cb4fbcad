"""The Triton attention backend: paged attention and the KV-cache write as Triton kernels.

Same interface as :class:`~asyncllm.kernels.torch_attention.TorchAttentionBackend`:
``prepare(meta)`` once per step, then per layer ``write_kv`` and ``forward``.

A step's sequences are attended in at most two launches. Decodes (one query token) get a small
query block (16 rows: the query heads of one KV head) and, when their launch would leave the GPU
mostly idle, a split of the KV dimension; sequences with several query tokens (prefill chunks,
prefix hits) get taller blocks, so each K/V tile they load serves more queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache_write import write_kv_cache
from .metadata import AttentionMetadata
from .paged_attention import paged_attention, split_buffers
from .transfer import stage, to_device
from .triton_utils import next_power_of_2, num_sms


@dataclass(frozen=True)
class AttentionTuning:
    """Launch shapes and the split-KV heuristic. The defaults aim at H100/H200-class GPUs;
    tests shrink them so that small shapes still take every path."""

    decode_block_m: int = 16        # rows per decode program (>= 16: the tensor-core minimum)
    prefill_block_m: int = 64       # rows per program for sequences with several query tokens
    tile_n: int = 64                # key positions per inner-loop step
    max_splits: int = 16
    min_split_tokens: int = 256     # a split should walk at least this many keys to pay for the merge
    waves: int = 4                  # aim for this many programs per SM before splitting
    num_sms: int | None = None      # None: ask the device


@dataclass
class _Launch:
    """One kernel launch: a set of query blocks sharing one block height and split count."""

    qblock_seq: torch.Tensor        # [query blocks] int32: the sequence of each block
    qblock_start: torch.Tensor      # [query blocks] int32: its first query index within the sequence
    block_m: int
    num_splits: int
    partials: tuple | None = None   # split-KV scratch, made on first use and shared by all layers


@dataclass
class _Plan:
    launches: list[_Launch] = field(default_factory=list)


class TritonAttentionBackend:
    """Paged attention with Triton kernels (CUDA, or triton's interpreter on CPU for tests)."""

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, tuning: AttentionTuning | None = None) -> None:
        self.tuning = tuning or AttentionTuning()
        self.num_kv_heads = num_kv_heads
        group = num_heads // num_kv_heads
        # A block holds whole GQA groups: at least one group, and a power of two rows.
        self.decode_block_m = max(self.tuning.decode_block_m, next_power_of_2(group))
        self.prefill_block_m = max(self.tuning.prefill_block_m, next_power_of_2(group))
        self.prefill_block_q = self.prefill_block_m // group
        self._arange: dict[tuple, torch.Tensor] = {}

    # ---- per step ---------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        """Group the step's sequences into launches (once per step, shared by every layer)."""
        device = meta.block_tables.device
        plan = _Plan()
        if meta.decode_indices:
            decodes = meta.decode_indices
            if len(decodes) == meta.num_seqs:  # decode-only step: the blocks are simply 0..n-1
                seqs = self._range(len(decodes), device)
            else:
                seqs = to_device(decodes, device, torch.int32)
            max_len = max(meta.seq_lens[i] for i in decodes)
            plan.launches.append(self._decode_launch(seqs, max_len, device))
        if meta.prefill_indices:
            plan.launches.append(self._prefill_launch(meta, device))
        meta.backend_state = plan

    def prepare_static(self, meta: AttentionMetadata, max_seq_len: int) -> None:
        """A decode-only plan whose launches depend on the batch size alone, not on the values in
        ``meta``'s tensors: what a CUDA graph captures and then replays with new lengths."""
        device = meta.block_tables.device
        meta.backend_state = _Plan([self._decode_launch(self._range(meta.num_seqs, device), max_seq_len, device)])

    def _decode_launch(self, seqs: torch.Tensor, max_len: int, device: torch.device) -> _Launch:
        starts = self._range(seqs.numel(), device, zeros=True)
        return _Launch(seqs, starts, self.decode_block_m, self._num_splits(seqs.numel(), max_len, device))

    def _prefill_launch(self, meta: AttentionMetadata, device: torch.device) -> _Launch:
        seqs, starts = [], []
        for i in meta.prefill_indices:
            for start in range(0, meta.query_len(i), self.prefill_block_q):
                seqs.append(i)
                starts.append(start)
        seqs_t, starts_t = stage([seqs, starts], device, torch.int32)  # one non-blocking copy
        return _Launch(seqs_t, starts_t, self.prefill_block_m, 1)

    def _num_splits(self, num_qblocks: int, max_len: int, device: torch.device) -> int:
        """Split the keys when the launch would give each SM less than ``waves`` programs to run
        and every split still has ``min_split_tokens`` keys to walk (flash-decoding)."""
        t = self.tuning
        target = t.waves * (t.num_sms or num_sms(device))
        programs = num_qblocks * self.num_kv_heads
        splits = min(t.max_splits, target // max(programs, 1), max_len // t.min_split_tokens)
        # A power of two: each split count is a separate compiled kernel, and these few are all
        # compiled when the CUDA graphs are captured, not in the middle of serving.
        return 1 << (splits.bit_length() - 1) if splits >= 2 else 1

    def _range(self, n: int, device: torch.device, zeros: bool = False) -> torch.Tensor:
        key = (n, str(device), zeros)
        if key not in self._arange:
            self._arange[key] = (torch.zeros if zeros else torch.arange)(n, dtype=torch.int32, device=device)
        return self._arange[key]

    # ---- per layer ----------------------------------------------------------------------------
    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, chunk: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query: [tokens, heads, head_dim] -> output of the same shape (contiguous). ``window``,
        ``softcap``, ``chunk`` and ``sinks`` (sliding-window, soft-capped, chunked layers and gpt-oss's
        per-head sink logits) are the kernel's own specialisations."""
        if meta.bidirectional:  # an image attended both ways (Gemma 3): the reference, for this step only
            from .torch_attention import windowed_attention as reference

            return reference(query, k_cache, v_cache, meta, scale, window, softcap, chunk=chunk, sinks=sinks)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.backend_state is None:
            self.prepare(meta)
        for launch in meta.backend_state.launches:
            self._run(launch, output, query, k_cache, v_cache, meta, scale, window, softcap, chunk, sinks)
        return output

    def _run(self, launch: _Launch, output, query, k_cache, v_cache, meta, scale, window=None, softcap=None,
             chunk=None, sinks=None) -> None:
        if launch.num_splits > 1 and launch.partials is None:
            launch.partials = split_buffers(launch.qblock_seq.numel(), self.num_kv_heads, launch.num_splits,
                                            launch.block_m, k_cache.shape[3], query.device)
        tile_n = self.tuning.tile_n
        if query.element_size() == 4 and k_cache.shape[3] > 64:
            tile_n //= 2  # float32 K/V tiles take twice the bytes: keep the pipelined stages in shared memory
        paged_attention(output, query, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor,
                        meta.query_start_tensor, launch.qblock_seq, launch.qblock_start, scale,
                        block_m=launch.block_m, tile_n=max(16, tile_n), num_splits=launch.num_splits,
                        partials=launch.partials, window=window, softcap=softcap, chunk=chunk, sinks=sinks)
