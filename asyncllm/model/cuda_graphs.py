"""CUDA graphs for decode-only steps, one per batch-size bucket.

Decoding a small model is bound by kernel launches, not by the GPU: a step of a 28-layer model
is some 400 launches of a few microseconds of work each. A CUDA graph replays the whole forward
pass with one launch. Graphs freeze shapes and pointers, so:

* every bucket (1, 2, 4, ... up to ``max_num_seqs``) has static input buffers, and a step of n
  sequences is padded to the smallest bucket >= n. Padding rows have slot -1 (the KV write skips
  them) and length 0 (attention reads nothing for them); their outputs are ignored;
* the attention backend plans the launch from the bucket size alone
  (:meth:`TritonAttentionBackend.prepare_static`), so one graph serves any sequence lengths;
* steps with prefill tokens, more sequences than the largest bucket, or LoRA adapters run eagerly.

Only the decoder stack is captured; the LM head runs eagerly on the rows that need logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs`` (at most 512), then ``max_num_seqs`` itself."""
    top = min(max_num_seqs, BUCKETS[-1])
    return [b for b in BUCKETS if b < top] + [top]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    meta: AttentionMetadata     # views of the static buffers; its backend_state is the static plan
    hidden: torch.Tensor        # the captured output, [bucket, hidden]


class DecodeGraphs:
    """Captured decode steps and the static buffers they read."""

    def __init__(self, model, kv_caches, backend, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.max_blocks = -(-max_model_len // block_size)
        n, device = self.buckets[-1], next(model.parameters()).device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.long, device=device)
        self.graphs: dict[int, _Graph] = {}

    def _static_meta(self, bucket: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start=list(range(bucket + 1)), seq_lens=[0] * bucket,
            block_tables=self.block_tables[:bucket], seq_lens_tensor=self.seq_lens[:bucket],
            query_start_tensor=self.query_start[:bucket + 1], block_size=self.block_size,
            decode_indices=list(range(bucket)), prefill_indices=[])
        self.backend.prepare_static(meta, self.max_model_len)
        return meta

    @torch.inference_mode()
    def capture(self) -> "DecodeGraphs":
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool. Each is
        run once eagerly before capture: Triton compiles on first launch, and compiling cannot
        happen inside a capture. The static buffers hold padding (slot -1, length 0), so neither
        run touches the KV cache."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                meta = self._static_meta(bucket)
                self._run(bucket, meta)                     # warm-up: compile, allocate split buffers
                graph = torch.cuda.CUDAGraph()
                # thread_local: another engine's thread may use the GPU while this one captures
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    hidden = self._run(bucket, meta)
                self.graphs[bucket] = _Graph(graph, meta, hidden)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batches of %s sequences", self.buckets)
        return self

    def _run(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], meta, self.kv_caches)

    def fits(self, meta: AttentionMetadata) -> bool:
        """A decode-only step that some bucket holds."""
        return (not meta.prefill_indices and 0 < meta.num_seqs <= self.buckets[-1]
                and meta.block_tables.shape[1] <= self.max_blocks)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy the step into the static buffers, replay its bucket's graph; [n, hidden] hidden states."""
        n = meta.num_seqs
        bucket = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens_tensor)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        # Rows n..bucket may hold an earlier step's sequences: make them padding again.
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].zero_()
        captured = self.graphs[bucket]
        captured.graph.replay()
        return captured.hidden[:n]
