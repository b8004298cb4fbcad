"""Per-sequence block tables on top of the block pool: allocation, prefix hits, forks, copy-on-write."""

from __future__ import annotations

from .block_pool import BlockPool
from .request import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Decides which KV blocks each sequence uses. Knows nothing about the KV tensors themselves:
    copies it needs (copy-on-write of a shared partial block) are queued in ``pending_copies``
    for the model runner to perform before the next forward pass."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        """``window``: when every layer of the model attends to at most this many positions, the blocks
        that fall behind it are given back as sequences advance (:meth:`release_outside_window`)."""
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of which served from it

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding the longest cached prefix of ``seq``'s tokens.

        At least one token is always left to compute, so the step still yields logits."""
        if not self.pool.enable_caching or seq.params.prompt_logprobs is not None or seq.request.pooling == "mean":
            return []  # prompt logprobs and mean pooling need every prompt position computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.pool.lookup(seq.block_key(i, self.block_size))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more KV entries of ``seq`` (after taking ``cached_blocks``).

        Returns False, changing nothing, when the pool has too few free blocks."""
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        table_len = len(seq.block_table) + len(cached_blocks)
        needed = blocks_for(num_computed + num_new_tokens, self.block_size) - table_len
        cow = self._needs_copy_on_write(seq, num_computed)
        reusable_free = sum(1 for b in cached_blocks if self.pool.is_free(b))
        if needed + cow > self.pool.num_free - reusable_free:
            return False
        if cached_blocks:
            self.pool.share(cached_blocks)
            seq.block_table.extend(cached_blocks)
            seq.num_computed_tokens = num_computed
            seq.num_cached_tokens = num_computed
        if cow:
            self._copy_last_block(seq)
        if needed > 0:
            seq.block_table.extend(self.pool.allocate(needed))
        return True

    def count_prefix_query(self, seq: Sequence) -> None:
        """Record a first-time prompt lookup (and its hits) for the prefix-cache metrics."""
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_cached_tokens

    def _needs_copy_on_write(self, seq: Sequence, num_computed: int) -> int:
        """1 if the next write lands in a partly filled block that other sequences share."""
        if num_computed % self.block_size == 0 or not seq.block_table:
            return 0
        last = seq.block_table[num_computed // self.block_size]
        return 1 if self.pool.ref_counts[last] > 1 else 0

    def _copy_last_block(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        source = seq.block_table[index]
        (copy,) = self.pool.allocate(1)
        self.pending_copies.append((source, copy))
        seq.block_table[index] = copy
        self.pool.free([source])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks and computed tokens (n > 1)."""
        self.pool.share(parent.block_table[parent.num_released_blocks:])
        child.block_table = list(parent.block_table)
        child.num_released_blocks = parent.num_released_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_keys = list(parent.block_keys)
        child.num_registered_blocks = parent.num_registered_blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed blocks to the prefix cache."""
        if not self.pool.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.register(seq.block_table[i], seq.block_key(i, self.block_size))
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back the blocks no layer reads any more: every position before the oldest key the
        sequence's next query can see (``num_computed_tokens - window + 1``). Their entries stay in the
        block table (positions still index it; no kernel reads before a window's first block), and a
        full block stays in the prefix cache until its slot is needed. Returns how many were released."""
        if self.window is None:
            return 0
        keep_from = seq.num_computed_tokens - self.window + 1
        releasable = min(max(0, keep_from) // self.block_size, len(seq.block_table))
        if releasable <= seq.num_released_blocks:
            return 0
        self.pool.free(reversed(seq.block_table[seq.num_released_blocks:releasable]))
        count = releasable - seq.num_released_blocks
        seq.num_released_blocks = releasable
        return count

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (tail first, see BlockPool.free) and reset its progress."""
        self.pool.free(reversed(seq.block_table[seq.num_released_blocks:]))
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
