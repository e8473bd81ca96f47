"""The host tier: evicted cached blocks copied out whole, reloaded on a hit, every slot accounted for; and the
kept queue that holds a session's blocks longer."""
from __future__ import annotations

import torch

from common.config.base import EngineConfig
from common.engine.block_manager import BlockManager
from common.engine.host_tier import HostTier
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import prefix_block_hashes

BS = 4


class Copies:
    """Stands in for the KV bytes: each pool block and host slot holds the hash it was last filled with."""

    def __init__(self, pool: BlockManager | None = None) -> None:
        self.pool: dict[int, int] = {}
        self.host: dict[int, int] = {}

    def out(self, block_id: int, slot: int) -> None:
        self.host[slot] = self.pool[block_id]

    def into(self, slot: int, block_id: int) -> None:
        self.pool[block_id] = self.host[slot]


def manager(num_blocks: int, host_blocks: int) -> tuple[BlockManager, Copies]:
    copies = Copies()
    return BlockManager(num_blocks, BS, host=HostTier(host_blocks, copies.out, copies.into)), copies


def compute(blocks: BlockManager, copies: Copies, tokens: list[int], keep_s: float = 0.0) -> list[int]:
    """What the scheduler does for one prompt: hits, reloads, new blocks "computed", all cached, then freed."""
    max_blocks = len(tokens) // BS
    hits = blocks.find_cached_prefix(tokens, max_blocks)
    blocks.acquire(hits)
    table = hits + blocks.reload_prefix(tokens, hits, max_blocks)
    reused = len(table)
    table += blocks.allocate(max_blocks - len(table))
    blocks.cache_full_blocks(table, tokens, 0, max_blocks)
    for block_id in table[reused:]:
        copies.pool[block_id] = blocks.blocks[block_id].hash
    for block_id in table:
        assert copies.pool[block_id] == blocks.blocks[block_id].hash  # every block holds its own bytes
    blocks.free(table, keep_s)
    return table[:reused]


def test_evicted_blocks_come_back_from_the_host_tier_instead_of_being_computed():
    blocks, copies = manager(num_blocks=4, host_blocks=8)
    first, second = list(range(16)), list(range(100, 116))
    compute(blocks, copies, first)
    compute(blocks, copies, second)  # evicts all four of first's blocks: copied out
    assert blocks.host.copies_out == 4 and blocks.host.used == 4
    reused = compute(blocks, copies, first)  # none in the pool: all four reloaded (second's copied out now)
    assert len(reused) == 4 and blocks.host.copies_in == 4
    assert blocks.host.copies_out == 8 and blocks.host.used == 8
    reused = compute(blocks, copies, second)  # second's come back, and first's are already in the tier: no copy
    assert len(reused) == 4 and blocks.host.copies_out == 8
    assert blocks.num_free_blocks == 4


def test_a_full_host_tier_drops_its_least_recently_used_blocks_and_leaks_no_slot():
    blocks, copies = manager(num_blocks=4, host_blocks=4)
    prompts = [list(range(k * 100, k * 100 + 16)) for k in range(6)]
    for _ in range(3):
        for tokens in prompts:
            compute(blocks, copies, tokens)
    host = blocks.host
    assert host.used == host.capacity == 4 and len(host._free_slots) == 0
    assert sorted(slot for slot, _ in host._entries.values()) == [0, 1, 2, 3]  # each slot holds one block
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked in the pool either


def test_a_one_block_host_tier_gives_up_a_reload_its_own_spill_displaced():
    blocks, copies = manager(num_blocks=1, host_blocks=1)
    compute(blocks, copies, list(range(4)))
    compute(blocks, copies, list(range(10, 14)))  # spills the first
    assert compute(blocks, copies, list(range(4))) == []  # reloading it would spill the second over it
    assert blocks.num_free_blocks == 1


def test_kept_blocks_are_evicted_after_plain_free_ones_until_their_time_passes(monkeypatch):
    clock = [10.0]
    monkeypatch.setattr("common.engine.block_manager.time.monotonic", lambda: clock[0])
    blocks = BlockManager(4, BS)
    session, other = list(range(8)), list(range(50, 58))
    copies = Copies()
    compute(blocks, copies, session, keep_s=30.0)
    compute(blocks, copies, other)
    compute(blocks, copies, list(range(200, 208)))  # two new blocks: taken from other's, not the session's
    assert len(blocks.find_cached_prefix(session, 2)) == 2 and blocks.find_cached_prefix(other, 2) == []
    clock[0] += 31  # kept no longer: plain LRU again, and the session's blocks are the oldest
    compute(blocks, copies, list(range(300, 308)))
    assert blocks.find_cached_prefix(session, 2) == [] and blocks.num_free_blocks == 4


def test_a_kv_cache_host_tier_copies_whole_blocks_both_ways():
    layout = KVLayout(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=8, dtype="float32")
    cache = KVCache(layout, num_blocks=3)
    tier = cache.host_tier(2 * layout.bytes_per_block + 1)
    assert tier.capacity == 2 and cache.host_buffer.shape[0] == 2
    cache.buffer[1] = torch.randn(cache.buffer[1].shape)
    want = cache.buffer[1].clone()
    tier.spill(1, block_hash=77, tokens=(1, 2, 3, 4))
    cache.buffer[1].zero_()
    assert tier.holds(77, (1, 2, 3, 4)) and not tier.holds(77, (1, 2, 3, 5))
    tier.reload(77, 2)
    assert torch.equal(cache.buffer[2], want)
    assert cache.host_tier(layout.bytes_per_block - 1) is None


def test_greedy_output_with_a_tiny_pool_and_a_host_tier_equals_the_plain_engine(tiny_chat_model_dir):
    """A pool of 12 blocks cannot keep four conversations' histories; the host tier does, and what it reloads is
    the same KV the prompt would compute."""
    histories = [[{"role": "user", "content": f"Conversation {k}: tell me about the number {k}."}] for k in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=256))
    tiered = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=12,
                                    kv_tiers={"host_memory_bytes": 64 << 20}))
    for turn in range(3):
        prompts = [plain.tokenizer.apply_chat_template(h) for h in histories]
        want = [o.outputs[0].text for o in plain.generate(prompts, params)]
        got = [tiered.generate([p], params)[0].outputs[0].text for p in prompts]  # one at a time: 12 blocks
        assert got == want
        for history, text in zip(histories, want):
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And turn {turn}?"}]
    host = tiered.block_manager.host
    assert host.copies_out > 0 and host.copies_in > 0
    assert tiered.block_manager.num_free_blocks == 12 and host.used <= host.capacity


def test_blocks_the_host_tier_evicts_go_to_disk_and_come_back_whole(tmp_path):
    layout = KVLayout(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    cache = KVCache(layout, num_blocks=4)
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "0123.kv").write_bytes(b"a previous run's")
    tier = cache.host_tier(layout.bytes_per_block, str(tmp_path / "kv"), 2 * layout.bytes_per_block)
    assert tier.capacity == 1 and tier.disk.capacity == 2 and not list((tmp_path / "kv").iterdir())
    blocks = BlockManager(4, BS, host=tier)
    want = {}
    for k in range(4):  # four prompts of one block each, each computed into the pool and cached
        tokens = list(range(10 * k, 10 * k + BS))
        (block_id,) = blocks.allocate(1)
        cache.buffer[block_id] = torch.randn(cache.buffer[block_id].shape).to(torch.bfloat16)
        blocks.cache_full_blocks([block_id], tokens, 0, 1)
        want[k] = cache.buffer[block_id].clone()
        blocks.free([block_id])
    blocks.allocate(4)  # the pool hands all four out, each spilled: host memory keeps the last, disk the two before
    blocks.free(list(range(4)))
    assert tier.used == 1 and tier.disk.used == 2 and tier.disk.writes == 3  # the first went on to disk, then out
    for k in (1, 2):  # on disk: read back into a pool block, equal to what was computed
        tokens = list(range(10 * k, 10 * k + BS))
        (block_id,) = blocks.reload_prefix(tokens, [], 1)
        assert torch.equal(cache.buffer[block_id], want[k])
        blocks.free([block_id])
    assert tier.disk.reads == 2 and blocks.reload_prefix(list(range(0, BS)), [], 1) == []  # the first: gone


def test_kv_events_count_a_block_held_while_the_pool_or_the_host_tier_keeps_it():
    """A block the pool evicts into the host tier is still held (a prompt's hit reloads it, and the worker counts it
    in its cached tokens); it is removed once the host tier lets it go too."""
    blocks, copies = manager(num_blocks=2, host_blocks=2)
    blocks.record_kv_events()
    first, second, third = list(range(8)), list(range(100, 108)), list(range(200, 208))
    compute(blocks, copies, first)
    assert blocks.take_kv_events() == (prefix_block_hashes(first, BS), [])
    compute(blocks, copies, second)  # first's blocks go to the host tier: still held
    assert blocks.take_kv_events() == (prefix_block_hashes(second, BS), [])
    compute(blocks, copies, third)  # second's go to the host tier, which lets first's go
    stored, removed = blocks.take_kv_events()
    assert stored == prefix_block_hashes(third, BS) and sorted(removed) == sorted(prefix_block_hashes(first, BS))
    compute(blocks, copies, second)  # reloaded from the host tier: held all along, so no event for them
    stored, removed = blocks.take_kv_events()
    assert set(stored) <= set(prefix_block_hashes(second, BS)) and not set(removed) & set(stored)
    assert set(blocks.host.hashes()) | {blocks.blocks[i].hash for i in range(2)} >= set(prefix_block_hashes(second,
                                                                                                             BS))
