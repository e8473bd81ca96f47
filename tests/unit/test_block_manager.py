"""Block manager: allocation, ref counts, chained hashes, LRU eviction, no leaks."""
import pytest
from hypothesis import given, settings, strategies as st

from common.engine.block_manager import BlockManager, OutOfBlocks
from common.protocol.wire import cache_salt_of, chain_hash, prefix_block_hashes


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert bm.num_free_blocks == 0
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_double_free_is_an_error():
    bm = BlockManager(4, 4)
    ids = bm.allocate(1)
    bm.free(ids)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(ids)


def test_ref_counts_keep_shared_blocks_alive():
    bm = BlockManager(4, 4)
    ids = bm.allocate(2)
    bm.acquire(ids)
    bm.free(ids)
    assert bm.num_free_blocks == 2
    assert [bm.blocks[i].ref_count for i in ids] == [1, 1]
    bm.free(ids)
    assert bm.num_free_blocks == 4


def test_chain_hash_depends_on_parent_and_is_stable():
    assert chain_hash(None, [1, 2, 3]) == chain_hash(None, [1, 2, 3])
    assert chain_hash(None, [1, 2, 3]) != chain_hash(chain_hash(None, [9]), [1, 2, 3])
    assert chain_hash(None, [1, 2, 3]) != chain_hash(None, [1, 2, 4])
    hashes = prefix_block_hashes(list(range(10)), 4)
    assert hashes == [chain_hash(None, [0, 1, 2, 3]), chain_hash(hashes[0], [4, 5, 6, 7])]


def _cache_sequence(bm, tokens, cache_salt=0):
    n = len(tokens) // bm.block_size
    ids = bm.allocate(-(-len(tokens) // bm.block_size))
    bm.cache_full_blocks(ids, tokens, 0, n, cache_salt)
    return ids


def test_prefix_hit_finds_full_blocks_and_compares_tokens():
    bm = BlockManager(16, 4)
    tokens = list(range(11))
    ids = _cache_sequence(bm, tokens)
    assert bm.find_cached_prefix(tokens, 10) == ids[:2]
    assert bm.find_cached_prefix(tokens[:4] + [99] * 7, 10) == ids[:1]
    assert bm.find_cached_prefix([99] + tokens[1:], 10) == []
    assert bm.find_cached_prefix(tokens, 1) == ids[:1]
    # A hash collision must not return a block whose tokens differ.
    block = bm.blocks[ids[0]]
    block.token_ids = (7, 7, 7, 7)
    assert bm.find_cached_prefix(tokens, 10) == []


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(4, 2)
    first = _cache_sequence(bm, [1, 2, 3, 4])
    bm.free(first)
    assert bm.find_cached_prefix([1, 2, 3, 4, 5], 2) == first
    # Freed in reverse: the tail block is the first to be evicted.
    other = bm.allocate(3)
    assert first[1] in other and first[0] not in other
    assert bm.find_cached_prefix([1, 2, 3, 4, 5], 2) == first[:1]
    bm.acquire(first[:1])  # a hit takes the block off the free queue
    assert bm.num_free_blocks == 0
    bm.free(first[:1])
    bm.free(other)
    assert bm.num_free_blocks == 4


def test_duplicate_content_keeps_first_mapping():
    bm = BlockManager(8, 2)
    a = _cache_sequence(bm, [5, 6])
    b = _cache_sequence(bm, [5, 6])
    assert bm.find_cached_prefix([5, 6, 7], 1) == a
    bm.free(a)
    bm.allocate(bm.num_free_blocks)  # evicts a; b's copy is not mapped
    assert bm.find_cached_prefix([5, 6, 7], 1) == []
    assert b


def test_a_cache_salt_is_the_root_of_the_chain_and_tenants_get_distinct_ones():
    tokens = list(range(10))
    assert prefix_block_hashes(tokens, 4, 0) == prefix_block_hashes(tokens, 4)
    salted = prefix_block_hashes(tokens, 4, 77)
    assert salted == [chain_hash(77, tokens[:4]), chain_hash(salted[0], tokens[4:8])]
    assert not set(salted) & set(prefix_block_hashes(tokens, 4))
    salts = {cache_salt_of(name) for name in ("alpha", "beta", "tenant:alpha", "group:alpha", "")}
    assert len(salts) == 5 and 0 not in salts
    assert cache_salt_of("alpha") == cache_salt_of("alpha") < 1 << 64  # stable: the proxy and workers agree


def test_equal_tokens_under_different_salts_share_no_block():
    bm = BlockManager(16, 4)
    tokens = list(range(13))
    alpha, beta = cache_salt_of("tenant:alpha"), cache_salt_of("tenant:beta")
    ids = _cache_sequence(bm, tokens, alpha)
    bm.free(ids)
    assert bm.find_cached_prefix(tokens, 3, alpha) == ids[:3]  # the same salt hits every full block
    assert bm.find_cached_prefix(tokens, 3, beta) == []
    assert bm.find_cached_prefix(tokens, 3) == []  # nor does an unsalted request see it
    other = _cache_sequence(bm, tokens, beta)  # beta computes its own copy, cached beside alpha's
    assert not set(other) & set(ids)
    assert bm.find_cached_prefix(tokens, 3, beta) == other[:3]
    assert bm.find_cached_prefix(tokens, 3, alpha) == ids[:3]
    # Extending a salted sequence's cached run keeps its salt: the chain continues from its last cached block.
    longer = tokens + [50, 51, 52]
    table = ids[:3] + bm.allocate(1)
    bm.acquire(ids[:3])
    assert bm.cache_full_blocks(table, longer, 3, 4, alpha) == 4
    assert bm.find_cached_prefix(longer, 4, alpha) == table
    assert bm.find_cached_prefix(longer, 4, beta) == other[:3]


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    _cache_sequence(bm, [1, 2, 3, 4])
    assert bm.find_cached_prefix([1, 2, 3, 4, 5], 2) == []


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "share", "cache"]), st.integers(0, 5), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_alloc_free_sequences_never_leak(operations):
    bm = BlockManager(12, 2)
    owners: list[list[int]] = []  # each owner holds one reference to each of its blocks
    for op, a, b in operations:
        if op == "alloc" and bm.can_allocate(a):
            owners.append(bm.allocate(a))
        elif op == "free" and owners:
            bm.free(owners.pop(a % len(owners)))
        elif op == "share" and owners:
            src = owners[a % len(owners)]
            bm.acquire(src)
            owners.append(list(src))
        elif op == "cache" and owners:
            ids = owners[a % len(owners)]
            tokens = [b] * (2 * len(ids))
            hits = bm.find_cached_prefix(tokens, len(ids))
            bm.acquire(hits)
            owners.append(hits)
            bm.cache_full_blocks(ids, tokens, 0, len(ids))
        held = {}
        for ids in owners:
            for i in ids:
                held[i] = held.get(i, 0) + 1
        for block in bm.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
        assert bm.num_free_blocks == 12 - len(held)
    for ids in owners:
        bm.free(ids)
    assert bm.num_free_blocks == 12


def test_grow_and_shrink_a_block_table_in_place():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    table: list[int] = []
    assert bm.grow(table, 5) and len(table) == 2  # 5 positions need 2 blocks of 4
    assert bm.grow(table, 8) and len(table) == 2  # still covered
    assert not bm.grow(table, 17) and len(table) == 2  # 5 blocks: the pool is short, nothing taken
    assert bm.grow(table, 16) and bm.num_free_blocks == 0
    bm.shrink(table, 5)
    assert len(table) == 2 and bm.num_free_blocks == 2
    bm.shrink(table, 0)
    assert table == [] and bm.num_free_blocks == 4


# -- KV events: what the prefix cache gains and loses (common/runtime/kv_events.py publishes them) ----------


def cache(bm: BlockManager, tokens: list[int], salt: int = 0) -> list[int]:
    """One prompt computed and freed: its full blocks cached, as the scheduler leaves them."""
    table = bm.allocate(len(tokens) // bm.block_size)
    bm.cache_full_blocks(table, tokens, 0, len(table), salt)
    bm.free(table)
    return table


def test_kv_events_record_stored_and_evicted_hashes_between_takes():
    bm = BlockManager(4, 2)
    cache(bm, [1, 2, 3, 4])  # recorded only once asked for
    bm.record_kv_events()
    first = prefix_block_hashes([1, 2, 3, 4], 2)
    assert bm.take_kv_events() == (first, [])  # what it held already counts as stored
    assert bm.take_kv_events() == ([], [])
    salted = prefix_block_hashes([1, 2, 3, 4], 2, cache_salt_of("t"))
    cache(bm, [1, 2, 3, 4], cache_salt_of("t"))  # another tenant's: other hashes, in the two free blocks
    assert bm.take_kv_events() == (salted, [])
    cache(bm, [9, 9])  # evicts the least recently freed: the first prompt's tail block, freed first
    stored, removed = bm.take_kv_events()
    assert stored == prefix_block_hashes([9, 9], 2) and removed == [first[1]]


def test_a_hash_stored_and_evicted_within_one_take_is_reported_as_its_last_state():
    bm = BlockManager(1, 2)
    bm.record_kv_events()
    cache(bm, [1, 2])
    cache(bm, [3, 4])  # takes the only block: [1, 2]'s hash goes
    assert bm.take_kv_events() == (prefix_block_hashes([3, 4], 2), prefix_block_hashes([1, 2], 2))


def test_a_block_already_cached_by_another_sequence_is_not_stored_twice():
    bm = BlockManager(4, 2)
    bm.record_kv_events()
    held = bm.allocate(1)
    bm.cache_full_blocks(held, [1, 2], 0, 1)
    bm.take_kv_events()
    duplicate = bm.allocate(1)
    bm.cache_full_blocks(duplicate, [1, 2], 0, 1)  # the same prefix computed twice: the first copy serves
    assert bm.take_kv_events() == ([], [])
    bm.free(duplicate)
    bm.allocate(3)  # the duplicate's block is handed out again: the hash is still held by the first
    assert bm.take_kv_events() == ([], [])
