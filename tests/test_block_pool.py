"""Property tests of the block pool: no leak, no double free, no block handed out while in use."""

from hypothesis import given, settings, strategies as st

from asyncllm.engine.block_pool import BlockKey, BlockPool

NUM_BLOCKS = 12

operations = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(1, 4)),
        st.tuples(st.just("share"), st.integers(0, 50)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("register"), st.integers(0, 50), st.integers(0, 5)),
        st.tuples(st.just("hit"), st.integers(0, 5)),
    ),
    max_size=80,
)


def _key(n: int) -> BlockKey:
    return BlockKey(None, (n, n + 1, n + 2), None)


@settings(max_examples=300, deadline=None)
@given(operations, st.booleans())
def test_block_pool_invariants(ops, caching):
    pool = BlockPool(NUM_BLOCKS, enable_caching=caching)
    held: list[int] = []  # one entry per reference we own (a block may appear several times)
    for op in ops:
        kind = op[0]
        if kind == "allocate":
            got = pool.allocate(op[1])
            free_before = NUM_BLOCKS - len(set(held))
            if got is None:
                assert op[1] > free_before
                continue
            assert not set(got) & set(held), "a block in use was handed out again"
            assert len(set(got)) == len(got)
            held.extend(got)
        elif kind == "share" and held:
            block = held[op[1] % len(held)]
            pool.share([block])
            held.append(block)
        elif kind == "free" and held:
            block = held.pop(op[1] % len(held))
            pool.free([block])
        elif kind == "register" and held:
            pool.register(held[op[1] % len(held)], _key(op[2]))
        elif kind == "hit":
            block = pool.lookup(_key(op[1]))
            if block is not None:  # a cache hit takes the block back, free or not
                assert pool.block_keys[block] == _key(op[1])
                pool.share([block])
                held.append(block)
        _check(pool, held)
    pool.free(held)
    assert pool.num_free == NUM_BLOCKS and pool.num_used == 0


def _check(pool: BlockPool, held: list[int]) -> None:
    for block in range(NUM_BLOCKS):
        assert pool.ref_counts[block] == held.count(block)
        assert pool.is_free(block) == (held.count(block) == 0)
    assert pool.num_used == len(set(held))
    for key, block in pool._cached.items():
        assert pool.block_keys[block] == key


def test_double_free_is_refused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    try:
        pool.free([block])
    except RuntimeError as exc:
        assert "freed more often" in str(exc)
    else:
        raise AssertionError("double free went unnoticed")


def test_free_blocks_keep_content_until_evicted_lru():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, n in ((a, 1), (b, 2), (c, 3)):
        pool.register(block, _key(n))
    pool.free([c, b, a])  # tail first: c is evicted first, a last
    assert pool.lookup(_key(1)) == a and pool.num_used == 0
    (first,) = pool.allocate(1)
    assert first == c and pool.lookup(_key(3)) is None
    assert pool.lookup(_key(1)) == a and pool.lookup(_key(2)) == b


def test_reset_prefix_cache_hands_out_written_blocks_before_untouched_ones():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)  # 3, 4 and 5 never written
    for block, n in ((a, 1), (b, 2), (c, 3)):
        pool.register(block, _key(n))
    pool.free([c, b, a])  # cached: kept behind the untouched blocks
    assert pool.allocate(1) == [3]
    pool.free([3])  # no content: evicted first
    pool.reset_prefix_cache()
    assert pool.lookup(_key(1)) is None and pool.num_cached == 0
    assert pool.allocate(6) == [c, b, a, 3, 4, 5]  # the once-cached blocks first, in their eviction order


def test_collision_is_resolved_by_token_equality():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.register(block, BlockKey(None, (1, 2), None))
    assert pool.lookup(BlockKey(None, (1, 3), None)) is None
    assert pool.lookup(BlockKey(None, (1, 2), "adapter-a")) is None  # extra keys separate adapters
    assert pool.lookup(BlockKey(None, (1, 2), None)) == block
