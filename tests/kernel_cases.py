"""Random paged-attention batches for the kernel tests, and the device they run on.

Without CUDA the kernels run in triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1);
with CUDA (and no interpreter) the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from asyncllm.kernels.metadata import AttentionMetadata
from asyncllm.model.shape import DecoderShape

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


@dataclass
class PagedBatch:
    """One step: ``specs[i] = (cached tokens, new tokens)`` of sequence i, with its query and new
    keys/values (views of one fused qkv tensor, as the model makes them) and the paged caches."""

    specs: list[tuple[int, int]]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: list[list[int]]
    slots: list[int]
    block_size: int

    def meta(self) -> AttentionMetadata:
        """Fresh metadata (no backend state) for this step."""
        query_start, seq_lens = [0], []
        for cached, new in self.specs:
            query_start.append(query_start[-1] + new)
            seq_lens.append(cached + new)
        width = max(len(t) for t in self.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.block_tables], device=DEVICE)
        return AttentionMetadata(
            slot_mapping=torch.tensor(self.slots, device=DEVICE), query_start=query_start, seq_lens=seq_lens,
            block_tables=tables, seq_lens_tensor=torch.tensor(seq_lens, device=DEVICE),
            query_start_tensor=torch.tensor(query_start, device=DEVICE), block_size=self.block_size,
            decode_indices=[i for i, (_, n) in enumerate(self.specs) if n == 1],
            prefill_indices=[i for i, (_, n) in enumerate(self.specs) if n > 1])


def paged_batch(specs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, seed: int = 0) -> PagedBatch:
    """Caches hold random keys/values for the cached tokens (and garbage elsewhere); each
    sequence's blocks are scattered over the pool in random order (non-contiguous tables)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(cached + new) // block_size) for cached, new in specs]
    pool = list(range(1, sum(needed) + 4))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    slots = [table[p // block_size] * block_size + p % block_size
             for table, (cached, new) in zip(tables, specs) for p in range(cached, cached + new)]
    cache_shape = (sum(needed) + 4, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    tokens = sum(new for _, new in specs)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return PagedBatch(specs, q.reshape(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
                      v.view(tokens, kv_heads, head_dim), k_cache, v_cache, tables, slots, block_size)


def reference_attention(batch: PagedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The torch backend in float32 over the same (already rounded) inputs: the oracle."""
    from asyncllm.kernels.torch_attention import TorchAttentionBackend

    meta = batch.meta()
    return TorchAttentionBackend().forward(batch.query.float(), k_cache.float(), v_cache.float(), meta, scale)


def lora_test_shape() -> DecoderShape:
    """A tiny decoder shape for the LoRA kernel tests."""
    return DecoderShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, qkv_bias=False, qk_norm=False,
                        tie_word_embeddings=False)


class FakeAdapter:
    """Just what LoRASlots reads from a LoRAWeights."""

    def __init__(self, adapter_id: int, weights: dict):
        self.adapter_id, self.weights = adapter_id, weights


def lora_adapter(adapter_id: int, rank: int, targets: list[str], shapes: dict, gen: torch.Generator) -> FakeAdapter:
    weights = {}
    for layer in range(2):
        for target in targets:
            in_features, out_features = shapes[target]
            weights[(layer, target)] = (torch.randn(rank, in_features, generator=gen),
                                        torch.randn(out_features, rank, generator=gen) * 0.5)
    return FakeAdapter(adapter_id, weights)


def build_variant_or_skip(name: str, extra_flags: list[str], out, signatures=()):
    """``csrc/<name>.c`` built with the project's flags plus ``extra_flags`` (another ISA level), loaded; the test is
    skipped where the compiler cannot build it."""
    import pytest

    from asyncllm.kernels.cpu_build import _FLAGS, BuildError, build_variant

    try:
        return build_variant(name, [*_FLAGS, *extra_flags], out, signatures)
    except BuildError as e:
        pytest.skip(str(e))
