"""The pipelined KV hand-off, in one process: a prefill worker reporting layer groups of its prompt chunks
(KVProgress) and a decode worker pulling them while the prompt is computed, through the in-process transfer backend.

The messages a proxy would relay are handed from one handler to the other here. The decode worker's output must be
the plain hand-off's token for token, every page must be pulled once per generation, and every way out (abort, a
failed layer pull, a preempted prompt, a peer gone) must leave no block in use.
"""
import time
from types import SimpleNamespace

import pytest
import torch

from common.config.base import EngineConfig
from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from decode_worker.worker import DecodeHandler
from kv_transfer.segments import Layers, PoolGeometry, Segment, pull_segments
from prefill_worker.pipeline import LayerProgress, group_ends
from prefill_worker.worker import PrefillHandler
from tests.fake_transfer import FakeBackend

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(i * 7) % 300 + 1 for i in range(150)]  # 9 full blocks of 16 and 6 tokens: chunks of 48, so 4 steps
BLOCK = 16


# ---- segments of a layer range ---------------------------------------------------------------------------
def test_a_layer_range_is_one_run_inside_each_rank_slice():
    # 4 layers of 10 bytes a block at tp 1: layers 1..3 of remote block 2 into local block 0
    remote, local = PoolGeometry(1, 4, 40, 4), PoolGeometry(1, 3, 40, 4)
    assert pull_segments(remote, local, [2], [0], Layers(1, 3)) == [Segment(90, 10, 20)]
    # Two blocks: the runs are not contiguous (layer 0 of the next block sits between), so they do not merge.
    assert pull_segments(remote, local, [1, 2], [0, 1], Layers(2, 4)) == [Segment(60, 20, 20), Segment(100, 60, 20)]
    # The whole range is the whole block.
    assert pull_segments(remote, local, [1, 2], [0, 1], Layers(0, 4)) == pull_segments(remote, local, [1, 2], [0, 1])


def test_a_layer_range_at_tensor_parallelism_is_a_run_in_each_rank_slice():
    # tp 2: a rank's slice of a block is 20 bytes, 5 a layer; layer 3 of block 1 on each rank.
    remote, local = PoolGeometry(2, 4, 40, 4), PoolGeometry(2, 3, 40, 4)
    assert pull_segments(remote, local, [1], [2], Layers(3, 4)) == [Segment(35, 55, 5), Segment(115, 115, 5)]


@pytest.mark.parametrize("layers, message", [(Layers(2, 2), "not a range"), (Layers(0, 5), "not a range"),
                                             (Layers(-1, 2), "not a range")])
def test_a_bad_layer_range_is_refused(layers, message):
    with pytest.raises(ValueError, match=message):
        pull_segments(PoolGeometry(1, 4, 40, 4), PoolGeometry(1, 3, 40, 4), [0], [0], layers)


def test_a_layer_range_across_tensor_parallel_sizes_is_refused():
    with pytest.raises(ValueError, match="equal tensor parallelism"):
        pull_segments(PoolGeometry(1, 4, 40, 4), PoolGeometry(2, 3, 40, 4), [0], [0], Layers(0, 2))


def test_layer_groups_cover_every_layer_once():
    assert group_ends(2, 4) == [1, 2]
    assert group_ends(22, 4) == [6, 12, 17, 22]
    assert group_ends(16, 1) == [16]


def test_each_chunk_reports_the_blocks_it_fills_once_per_group_and_a_preemption_at_once():
    sent = []
    progress = LayerProgress(num_layers=6, block_size=4, worker_id="p", send=sent.append)
    progress.add("r", groups=3)  # layers 0-1, 2-3, 4-5
    seq = SimpleNamespace(request_id="r", num_computed_tokens=6, num_preemptions=0, block_table=[10, 11, 12, 13])
    other = SimpleNamespace(request_id="plain", num_computed_tokens=0, num_preemptions=0, block_table=[20])
    plan = SimpleNamespace(seqs=[other, seq], num_new_tokens=[3, 8])  # tokens 6..13: blocks 1 and 2 fill
    counts, report = progress.hook(epoch=9)(plan)
    assert counts == {2, 4, 6}  # only the groups' ends: on a GPU each report waits for the device
    short = SimpleNamespace(seqs=[other, seq], num_new_tokens=[3, 1])  # token 6 only: no block fills
    assert progress.hook(epoch=9)(short) is None
    for layers_done in range(1, 7):
        if layers_done in counts:
            report(layers_done)
    assert [(m.first_block, m.block_ids, m.layer_start, m.layer_end) for m in sent] == [
        (1, [11, 12], 0, 2), (1, [11, 12], 2, 4), (1, [11, 12], 4, 6)]
    assert {(m.request_id, m.epoch, m.generation) for m in sent} == {("r", 9, 0)}
    sent.clear()
    progress.after_step({"r": (seq, 30.0)}, epoch=9)
    assert sent == []  # not preempted
    seq.num_preemptions = 1
    progress.after_step({"r": (seq, 30.0)}, epoch=9)
    assert sent == [wire.KVProgress("r", "p", 9, 1, 0, [], 0, 0)]
    progress.discard("r")
    assert progress.hook(epoch=9) is None  # no pipelined prompt: the step runs without a hook


# ---- the two handlers --------------------------------------------------------------------------------------
def handler(cls, model_dir, transfer, **engine):
    config = EngineConfig(model=str(model_dir), block_size=BLOCK, **{"num_kv_blocks": 64,
                                                                      "max_num_batched_tokens": 48, **engine})
    h = cls(WorkerConfig(role=cls.role, worker_id=f"{cls.role}-0", engine=config, observability={"metrics_port": 0}),
            lambda: transfer)
    sent = []
    h.bind(sent.append)
    return h, sent


@pytest.fixture
def pair(tiny_chat_model_dir):
    prefill, to_proxy = handler(PrefillHandler, tiny_chat_model_dir, FakeBackend())
    decode, from_decode = handler(DecodeHandler, tiny_chat_model_dir, FakeBackend())
    decode.handle(wire.Peers([wire.PeerInfo("prefill-0", prefill.epoch, "fake", prefill.transfer_metadata)]))
    yield prefill, to_proxy, decode, from_decode
    decode.transfer.close()
    prefill.transfer.close()


def early(request_id: str, prefill, prompt=PROMPT) -> wire.DecodeRequest:
    return wire.DecodeRequest(request_id, prompt, PARAMS, seed=1, source_worker_id="prefill-0",
                              kv_lease_left_s=600.0, source_epoch=prefill.epoch, kv_pipelined=True)


def final(request_id: str, done: wire.PrefillDone, prompt=PROMPT, cache_salt: int = 0) -> wire.DecodeRequest:
    return wire.DecodeRequest(request_id, prompt, PARAMS, seed=1, first_token=done.first_token,
                              source_worker_id="prefill-0", source_block_ids=done.block_ids, kv_lease_left_s=60.0,
                              source_epoch=done.epoch, cache_salt=cache_salt)


def prefill_relaying(prefill, to_proxy, decode, request_id: str, groups: int = 2) -> tuple[wire.PrefillDone, int]:
    """Compute the prompt, handing each KVProgress to the decode worker as it comes (the proxy's relay) and turning
    the decode worker's loop between steps; PrefillDone, and how many KVProgress there were."""
    prefill.handle(wire.PrefillRequest(request_id, PROMPT, PARAMS, seed=1, lease_s=600,
                                       kv_pipeline_layer_groups=groups))
    progress = 0
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline
        prefill.tick()
        for msg in list(to_proxy):
            to_proxy.remove(msg)
            if isinstance(msg, wire.KVProgress):
                progress += 1
                decode.handle(msg)
            elif isinstance(msg, wire.PrefillDone):
                return msg, progress
        decode.tick()


def run_out(decode, sent, request_id: str | None = None) -> tuple[list[int], list[wire.KVPulled]]:
    """Turn the decode loop until every request (or ``request_id``) finished: its tokens, and the KVPulled."""
    def going() -> bool:
        if request_id is None:
            return decode.engine.has_unfinished() or bool(decode.pipelined)
        return request_id in decode.engine.requests or request_id in decode.pipelined

    deadline = time.monotonic() + 30
    while going():
        assert time.monotonic() < deadline
        decode.tick()
    tokens = [t for m in sent if isinstance(m, wire.TokenDeltas) for d in m.deltas for t in d.token_ids]
    return tokens, [m for m in sent if isinstance(m, wire.KVPulled)]


def plain_handoff(prefill, to_proxy, decode, from_decode, request_id: str, cache_salt: int = 99) -> list[int]:
    """The hand-off without pipelining; under another cache salt (by default) than the runs after it, so that
    neither worker's prefix cache serves them from it."""
    prefill.handle(wire.PrefillRequest(request_id, PROMPT, PARAMS, seed=1, lease_s=600, cache_salt=cache_salt))
    while not any(isinstance(m, wire.PrefillDone) for m in to_proxy):
        prefill.tick()
    (done,) = [m for m in to_proxy if isinstance(m, wire.PrefillDone)]
    to_proxy.clear()
    decode.handle(final(request_id, done, cache_salt=cache_salt))
    tokens, (pulled,) = run_out(decode, from_decode)
    assert pulled.ok
    prefill.handle(wire.ReleaseKV(request_id))
    from_decode.clear()
    return tokens


def pipelined_bytes(decode) -> dict[str, float]:
    get = decode.metrics.registry.get_sample_value
    return {when: get("tessera_worker_kv_pipelined_bytes_total", {"when": when})
            for when in ("during_prefill", "after_prefill")}


def test_layer_groups_are_pulled_while_the_prompt_is_computed_and_the_output_is_the_plain_handoffs(pair):
    prefill, to_proxy, decode, from_decode = pair
    expected = plain_handoff(prefill, to_proxy, decode, from_decode, "plain")
    decode.handle(early("piped", prefill))
    done, progress = prefill_relaying(prefill, to_proxy, decode, "piped")
    assert progress == 3 * 2  # 3 chunks of 48 tokens fill 3 blocks each (the fourth's 6 tokens none), 2 groups
    decode.handle(final("piped", done))
    tokens, (pulled,) = run_out(decode, from_decode)
    layout = decode.engine.runner.layout
    blocks = -(-len(PROMPT) // BLOCK)
    assert pulled.ok and pulled.num_bytes == blocks * layout.bytes_per_block
    assert tokens == expected
    moved = pipelined_bytes(decode)
    assert moved["during_prefill"] == (len(PROMPT) // BLOCK) * layout.bytes_per_block  # every full block
    assert moved["after_prefill"] == layout.bytes_per_block  # the last, partial one
    prefill.handle(wire.ReleaseKV("piped"))
    assert decode.engine.block_manager.num_used_blocks == 0
    assert prefill.engine.block_manager.num_used_blocks == 0


def test_pages_equal_the_prefill_workers_after_a_pipelined_pull(pair):
    prefill, to_proxy, decode, from_decode = pair
    decode.handle(early("r", prefill))
    done, _ = prefill_relaying(prefill, to_proxy, decode, "r")
    decode.handle(final("r", done))
    state = decode.pipelined["r"]
    local_blocks = list(state.block_ids)
    while decode.pipelined:
        decode.tick()
    full = len(PROMPT) // BLOCK
    remote, local = prefill.engine.runner.kv_cache.pool, decode.engine.runner.kv_cache.pool
    assert torch.equal(remote[:, done.block_ids[:full]], local[:, local_blocks[:full]])
    run_out(decode, from_decode)
    prefill.handle(wire.ReleaseKV("r"))


def test_an_abort_while_the_prompt_is_computed_frees_the_reserved_blocks(pair):
    prefill, to_proxy, decode, from_decode = pair
    decode.handle(early("r", prefill))
    assert decode.engine.block_manager.num_used_blocks == -(-len(PROMPT) // BLOCK)
    prefill.handle(wire.PrefillRequest("r", PROMPT, PARAMS, seed=1, lease_s=600, kv_pipeline_layer_groups=2))
    prefill.tick()  # the first chunk: its layer groups reported
    for msg in [m for m in to_proxy if isinstance(m, wire.KVProgress)]:
        decode.handle(msg)
    assert decode.pipelined["r"].parts  # pulls in flight
    decode.handle(wire.Abort("r"))
    prefill.handle(wire.Abort("r"))
    assert not decode.pipelined and decode.engine.block_manager.num_used_blocks == 0
    assert not decode.busy()
    prefill.tick()
    assert prefill.engine.block_manager.num_used_blocks == 0
    assert not from_decode  # it never reached the engine: nothing to report


def test_a_failed_layer_pull_is_pulled_again_after_prefill_done(pair, tiny_chat_model_dir):
    prefill, to_proxy, decode, from_decode = pair
    expected = plain_handoff(prefill, to_proxy, decode, from_decode, "plain")
    flaky, sent = handler(DecodeHandler, tiny_chat_model_dir, FakeBackend(fail_every=4))
    flaky.handle(wire.Peers([wire.PeerInfo("prefill-0", prefill.epoch, "fake", prefill.transfer_metadata)]))
    flaky.handle(early("r", prefill))
    done, _ = prefill_relaying(prefill, to_proxy, flaky, "r")
    flaky.handle(final("r", done))
    tokens, (pulled,) = run_out(flaky, sent)
    assert pulled.ok and tokens == expected
    moved = pipelined_bytes(flaky)
    assert moved["after_prefill"] > flaky.engine.runner.layout.bytes_per_block  # more than the partial block
    assert flaky.engine.block_manager.num_used_blocks == 0
    flaky.transfer.close()
    prefill.handle(wire.ReleaseKV("r"))


def test_pages_of_an_earlier_generation_are_pulled_again(pair):
    """A prompt the prefill worker's scheduler preempted is computed again into other blocks: a report of the new
    generation makes what was pulled before count for nothing."""
    prefill, to_proxy, decode, from_decode = pair
    expected = plain_handoff(prefill, to_proxy, decode, from_decode, "plain")
    decode.handle(early("r", prefill))
    done, _ = prefill_relaying(prefill, to_proxy, decode, "r")
    while decode.pipelined["r"].parts:
        decode.tick()
    decode.handle(wire.KVProgress("r", "prefill-0", prefill.epoch, 1, 0, [], 0, 0))
    decode.handle(final("r", done))
    tokens, (pulled,) = run_out(decode, from_decode)
    assert pulled.ok and tokens == expected
    bytes_per_block = decode.engine.runner.layout.bytes_per_block
    assert pipelined_bytes(decode)["after_prefill"] == -(-len(PROMPT) // BLOCK) * bytes_per_block  # all again
    prefill.handle(wire.ReleaseKV("r"))
    assert decode.engine.block_manager.num_used_blocks == 0


def test_a_lost_prefill_worker_fails_the_layer_pulls_and_the_abort_frees_the_blocks(pair):
    prefill, to_proxy, decode, from_decode = pair
    decode.handle(early("r", prefill))
    prefill.handle(wire.PrefillRequest("r", PROMPT, PARAMS, seed=1, lease_s=600, kv_pipeline_layer_groups=2))
    prefill.tick()
    for msg in [m for m in to_proxy if isinstance(m, wire.KVProgress)]:
        decode.handle(msg)
    decode.handle(wire.Peers([]))  # the proxy lists it no more: its pulls fail
    decode.tick()
    assert not decode.pipelined["r"].parts
    decode.handle(wire.Abort("r"))  # the proxy resumes the request elsewhere
    assert decode.engine.block_manager.num_used_blocks == 0 and not decode.busy()


def test_blocks_the_decode_worker_holds_are_not_pulled(pair):
    """Delta pull: a prompt whose leading blocks the decode worker's prefix cache holds pulls only the others."""
    prefill, to_proxy, decode, from_decode = pair
    expected = plain_handoff(prefill, to_proxy, decode, from_decode, "plain", cache_salt=0)
    decode.handle(early("r", prefill))
    held = decode.pipelined["r"].held
    assert held == len(PROMPT) // BLOCK  # every full block, from the plain run
    done, _ = prefill_relaying(prefill, to_proxy, decode, "r")
    decode.handle(final("r", done))
    tokens, (pulled,) = run_out(decode, from_decode)
    bytes_per_block = decode.engine.runner.layout.bytes_per_block
    assert pulled.ok and pulled.num_bytes == bytes_per_block and tokens == expected
    assert pipelined_bytes(decode)["during_prefill"] == 0
    prefill.handle(wire.ReleaseKV("r"))


def test_a_final_request_that_does_not_match_drops_the_reservation_and_pulls_as_usual(pair):
    prefill, to_proxy, decode, from_decode = pair
    decode.handle(early("r", prefill))
    done, _ = prefill_relaying(prefill, to_proxy, decode, "r")
    other_epoch = final("r", done)
    other_epoch.source_epoch = prefill.epoch + 1
    decode.handle(other_epoch)  # refused as pages of another epoch, and recomputed
    tokens, (pulled,) = run_out(decode, from_decode)
    assert not pulled.ok and "epoch" in pulled.error and len(tokens) == PARAMS.max_tokens - 1  # after the first
    assert decode.engine.block_manager.num_used_blocks == 0
    prefill.handle(wire.ReleaseKV("r"))


def test_the_proxy_lost_frees_what_its_pipelined_hand_offs_reserved(pair):
    prefill, to_proxy, decode, from_decode = pair
    decode.handle(early("waiting", prefill))
    decode.handle(early("pulling", prefill))
    done, _ = prefill_relaying(prefill, to_proxy, decode, "pulling")
    decode.handle(final("pulling", done))
    decode.fail_all("its proxy is gone", only={"waiting", "pulling"})
    assert not decode.pipelined and decode.engine.block_manager.num_used_blocks == 0
    failed = [m for m in from_decode if isinstance(m, wire.RequestFailed)]
    assert [m.request_id for m in failed] == ["pulling"]  # the one in the engine; the other never reached it
    prefill.handle(wire.ReleaseKV("pulling"))


def test_a_reservation_without_its_decode_request_is_given_up_past_its_bound(pair, monkeypatch):
    prefill, _, decode, _ = pair
    request = early("r", prefill)
    request.kv_lease_left_s = 5.0
    decode.handle(request)
    assert decode.engine.block_manager.num_used_blocks > 0 and 0 < decode.wait_s(60.0) <= 5.0
    later = SimpleNamespace(monotonic=lambda: time.monotonic() + 6.0, sleep=time.sleep)  # the worker's clock only
    monkeypatch.setattr("decode_worker.worker.time", later)
    decode.tick()
    assert not decode.pipelined and decode.engine.block_manager.num_used_blocks == 0


# ---- the pull's state machine over pools of any tensor parallelism ------------------------------------------
@pytest.mark.parametrize("remote_tp, local_tp", [(2, 2), (1, 2), (2, 1)])
def test_layer_groups_at_one_tensor_parallelism_and_a_whole_staged_pull_across_two(remote_tp, local_tp):
    from decode_worker.pipelined_pull import PipelinedPull
    from tests.unit.test_kv_transfer_tp import full_view, layout
    from common.engine.kv_cache import KVCache

    source = KVCache(layout(remote_tp), 10)
    source.pool.copy_(torch.randn(source.pool.shape, generator=torch.Generator().manual_seed(remote_tp)))
    target = KVCache(layout(local_tp), 12)
    server, puller = FakeBackend(), FakeBackend()
    try:
        metadata = server.register_pool(source)
        puller.register_pool(target)
        puller.add_peer("p", metadata)
        remote, local = [7, 2, 3], [0, 5, 6]
        state = PipelinedPull("r", "p", 0, local, 0, 2, puller.needs_staging("p"), wait_ends=float("inf"))
        for start in (0, 1):  # two layer groups of the first two blocks
            state.on_progress(wire.KVProgress("r", "p", 0, 0, 0, remote[:2], start, start + 1), puller, 30.0)
        assert len(state.parts) == (0 if state.staged else 2)
        staging = [8, 9, 10] if state.staged else []
        state.finish(object(), remote, float("inf"), staging)
        deadline = time.monotonic() + 30
        while (outcome := state.advance(puller, time.monotonic(), 30.0)) is None:
            assert time.monotonic() < deadline
        assert outcome.ok, outcome.error
        # The layer groups brought blocks 0 and 1; after PrefillDone only the last is pulled (all three, staged).
        whole = source.layout.bytes_per_block
        assert (state.bytes_during, state.bytes_after) == ((0, 3 * whole) if state.staged else (2 * whole, whole))
        assert torch.equal(full_view(source, remote), full_view(target, local))
    finally:
        puller.close()
        server.close()


def test_a_prompt_the_prefill_worker_preempts_is_pulled_again_and_decodes_as_the_plain_handoff(pair,
                                                                                               tiny_chat_model_dir):
    """A real preemption: a 14-block pool, prompt A of 10 blocks done and lent, prompt B (pipelined, 3 blocks in)
    cannot grow and is preempted until A's pages are released; it is computed again under generation 1."""
    prefill, to_proxy, decode, from_decode = pair
    prompt_b = [(i * 11) % 300 + 2 for i in range(150)]
    expected = {}
    for request_id, prompt in (("plain-a", PROMPT), ("plain-b", prompt_b)):
        prefill.handle(wire.PrefillRequest(request_id, prompt, PARAMS, seed=1, lease_s=600, cache_salt=99))
        while not any(isinstance(m, wire.PrefillDone) for m in to_proxy):
            prefill.tick()
        (done,) = [m for m in to_proxy if isinstance(m, wire.PrefillDone)]
        to_proxy.clear()
        decode.handle(final(request_id, done, prompt, cache_salt=99))
        expected[request_id], _ = run_out(decode, from_decode)
        from_decode.clear()
    small, sent = handler(PrefillHandler, tiny_chat_model_dir, FakeBackend(), num_kv_blocks=14,
                          max_num_batched_tokens=64)
    try:
        decode.handle(wire.Peers([wire.PeerInfo("prefill-0", small.epoch, "fake", small.transfer_metadata)]))
        for request_id, prompt in (("a", PROMPT), ("b", prompt_b)):
            decode.handle(early(request_id, small, prompt))
            small.handle(wire.PrefillRequest(request_id, prompt, PARAMS, seed=1, lease_s=600,
                                             kv_pipeline_layer_groups=2))
        generations, tokens, lent = set(), {}, []
        deadline = time.monotonic() + 60
        while len(tokens) < 2:
            assert time.monotonic() < deadline
            small.tick()
            if lent and ("b", 1) in generations:  # A's pages freed only once B had to give its blocks up
                small.handle(wire.ReleaseKV(lent.pop()))
            for msg in list(sent):
                sent.remove(msg)
                if isinstance(msg, wire.KVProgress):
                    generations.add((msg.request_id, msg.generation))
                    decode.handle(msg)
                elif isinstance(msg, wire.PrefillDone):
                    prompt = PROMPT if msg.request_id == "a" else prompt_b
                    decode.handle(final(msg.request_id, msg, prompt))
                    tokens[msg.request_id], (pulled,) = run_out(decode, from_decode, msg.request_id)
                    assert pulled.ok
                    from_decode.clear()
                    lent.append(msg.request_id)
            decode.tick()
        small.handle(wire.ReleaseKV("b"))
        # Layer groups reported, then preempted (the generation is the sequence's count of its preemptions).
        assert ("b", 0) in generations and ("b", 1) in generations
        assert tokens == {"a": expected["plain-a"], "b": expected["plain-b"]}
        assert decode.engine.block_manager.num_used_blocks == 0 and small.engine.block_manager.num_used_blocks == 0
    finally:
        small.transfer.close()
