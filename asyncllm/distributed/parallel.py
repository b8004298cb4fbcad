"""A rank's view of tensor parallelism: what it owns, and the collectives the model calls.

Column-parallel projections (qkv, gate/up) keep a contiguous range of heads or intermediate
columns; row-parallel ones (o, down) the matching input columns, and their partial outputs are
summed by an all-reduce. The vocabulary (embedding and LM head) is split in ranges of
``ceil(vocab / size)`` rows, the last one padded. KV heads are split like the query heads when
there are at least as many as ranks, and replicated otherwise (rank ``r`` keeps KV head
``r // (size / kv_heads)``, the one its query heads read).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..model.shape import DecoderShape


# gloo: tensors up to this many elements are all-reduced as an all-gather and a local sum
# (measured on the 2-core VM, [rows, 576] float32: 8 rows 0.68 vs 2.19 ms, 32 rows 0.46 vs 1.46 ms;
# at 512 rows both ~3 ms)
GATHER_SUM_MAX_ELEMENTS = 64 * 1024


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``size == 1`` is the plain single-process engine."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # mixture-of-experts layers: whole experts per rank instead of column shares

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ---- collectives (called by the model in the same order on every rank) --------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it.

        On CPU (gloo) a small tensor is gathered from every rank and summed here, in rank order:
        gloo's all-reduce of a decode step's hidden state takes several message rounds, and one
        all-gather is 1.5-3x faster for the sizes of decode steps (``GATHER_SUM_MAX_ELEMENTS``;
        docs/scaling.md). Every rank sums the same values in the same order, so all hold the
        same result."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        if x.device.type == "cpu" and x.numel() <= GATHER_SUM_MAX_ELEMENTS and x.is_contiguous():
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
            torch.add(parts[0], parts[1], out=x)
            for part in parts[2:]:
                x.add_(part)
            return x
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    # ---- what this rank owns -------------------------------------------------------------------------
    def split(self, total: int) -> tuple[int, int]:
        """(start, count) of this rank's equal share of ``total`` (a multiple of size)."""
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank keeps: a share, or one replicated head."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank // (self.size // num_kv_heads), 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of the vocabulary-parallel embedding and LM head."""
        per_rank = -(-vocab_size // self.size)
        return self.rank * per_rank, per_rank

    def local_shape(self, shape: DecoderShape) -> DecoderShape:
        """The decoder as this rank runs it: its heads and intermediate columns (the vocabulary
        stays whole in the shape; the embedding module holds the rank's rows)."""
        if self.size == 1:
            return shape
        return dataclasses.replace(shape, num_heads=shape.num_heads // self.size,
                                   num_kv_heads=self.kv_heads(shape.num_kv_heads)[1],
                                   intermediate_size=shape.intermediate_size // self.size)


SINGLE = TensorParallel()


def check_tensor_parallel(shape: DecoderShape, size: int, expert_parallel: bool = False) -> None:
    """ConfigError naming ``tensor_parallel_size`` when the model cannot be split ``size`` ways."""
    if size == 1:
        return
    problems = []
    moe = shape.moe
    if moe is not None:
        if expert_parallel and moe.num_experts % size:
            problems.append(f"{moe.num_experts} experts (enable_expert_parallel needs a multiple of the size)")
        if not expert_parallel and moe.intermediate_size % size:
            problems.append(f"an expert intermediate size of {moe.intermediate_size}")
        if moe.shared_intermediate_size % size:
            problems.append(f"a shared-expert intermediate size of {moe.shared_intermediate_size}")
    if shape.num_heads % size:
        problems.append(f"{shape.num_heads} attention heads")
    if shape.intermediate_size % size:
        problems.append(f"an intermediate size of {shape.intermediate_size}")
    kv = shape.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (a multiple or a divisor of the size is needed)")
    if problems:
        raise ConfigError(f"tensor_parallel_size={size} does not divide this model: it has "
                          + ", ".join(problems))
